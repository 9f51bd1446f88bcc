"""benchmarks/bench_decode.py runs end to end on the CPU at a tiny shape: the (batch, context) cells, the bandwidth
limit on every line, time-to-first-token lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}


def test_cpu_smoke_run_records_context_cells_limits_and_ttft(tmp_path):
    results = tmp_path / "decode.jsonl"
    out = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--layers", "1", "--hidden", "128",
                          "--intermediate", "256", "--vocab", "320", "--batch-sizes", "1", "2", "--context", "0", "40",
                          "--max-kv-tokens", "40", "--new-tokens", "12", "--modes", "default", "--ttft-prompt", "24",
                          "--results", str(results), "--commit", "test"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    decode = [x for x in lines if x["path"] == "default"]
    # batch 2 x context 40 exceeds --max-kv-tokens: three cells, the default path is quantpack's
    assert sorted((x["batch"], x["context"]) for x in decode) == [(1, 0), (1, 40), (2, 0)]
    for x in decode:
        assert x["model"] == "quantpack" and x["tok_s"] > 0 and x["copy_tb_s"] > 0
        assert abs(x["limit_tok_s"] - x["copy_tb_s"] * 1e12 / x["bytes_per_token"]) < 1e-6 * x["limit_tok_s"]
        assert abs(x["limit_fraction"] - x["tok_s"] / x["limit_tok_s"]) < 1e-9
    by_cell = {(x["batch"], x["context"]): x["bytes_per_token"] for x in decode}
    # a longer cache reads more per token; a batch shares the weights
    kv_per_position = 2 * 1 * 1 * 128 * 2  # (k and v, 1 layer, 1 KV head of 128, bf16)
    assert by_cell[1, 40] - by_cell[1, 0] == kv_per_position * (40 - 32)  # (the short prompt: 32 tokens)
    assert by_cell[2, 0] < by_cell[1, 0]
    ttft = {x["model"]: x for x in lines if x["path"] == "ttft"}
    assert set(ttft) == {"bf16", "quantpack"} and ttft["bf16"]["context"] == 24
    assert ttft["quantpack"]["ratio_to_bf16"] == ttft["bf16"]["ttft_ms"] / ttft["quantpack"]["ttft_ms"]
    assert "time to first token, 24-token prompt" in out.stdout


def test_unread_expert_bytes_count_every_layout_of_the_experts():
    """The experts a decode step does not hit are not read, whatever their tensors' rank: bf16 (E, N, K)
    parameters, the checkpoint layout's (E, K/2, N) codes, or the mma layout's (E, N/16, K/64, 32, 4) words."""
    import torch
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCH.parent))
    from bench_decode import unread_expert_bytes

    experts, top_k = 8, 2

    class Model(torch.nn.Module):
        def __init__(self, codes):
            super().__init__()
            self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(num_experts=experts,
                                                                                num_experts_per_tok=top_k))
            self.register_buffer("codes", codes)
            self.register_buffer("scales", torch.zeros(experts, 2, 64, dtype=torch.bfloat16))

    rows = Model(torch.zeros(experts, 64, 64, dtype=torch.uint8))  # (E, K/2, N): 128 x 64
    mma = Model(torch.zeros(experts, 4, 2, 32, 4, dtype=torch.int32))  # the same bytes, 5-D
    for batch in (1, 3):
        hit = experts * (1 - (1 - top_k / experts) ** batch)
        want = (experts * 64 * 64 + experts * 2 * 64 * 2) * (1 - hit / experts)
        assert unread_expert_bytes(rows, batch) == unread_expert_bytes(mma, batch) == want
