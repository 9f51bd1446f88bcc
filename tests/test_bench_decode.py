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


def test_step_profile_takes_the_prefill_out_by_kernel():
    """--profile's accounting: a decode step's kernels are the long generate's less the prefill-only one's, name by
    name (a kernel of the prefill alone adds nothing), over the steps; the gaps are the rest of the step's wall."""
    sys.path.insert(0, str(BENCH.parent))
    from bench_decode import step_profile

    prefill = {"_wgmma_kernel": 900.0, "_rms_norm_kernel": 40.0, "indexSelectSmallIndex": 2.0}
    long = {"_wgmma_kernel": 900.0, "_rms_norm_kernel": 40.0 + 4 * 3.0, "indexSelectSmallIndex": 2.0 + 4 * 1.0,
            "_mma_gemv_kernel": 4 * 50.0, "void at::native::vectorized_elementwise_kernel<4, add>": 4 * 2.0}
    got = step_profile(long, 1e-3 + 4 * 100e-6, prefill, 1e-3, 4)
    assert abs(got["step_us"] - 100.0) < 1e-6
    fam = got["families_us"]
    assert fam["quantized linears"] == 50.0 and "cuBLAS GEMM/GEMV (bf16 linears, lm_head)" not in fam
    assert fam["fused RMSNorm, rotary, SiLU*up (quantpack)"] == 3.0
    assert fam["embedding"] == 1.0 and fam["elementwise mul/add"] == 2.0
    assert abs(fam["gaps (no kernel running)"] - (100.0 - 56.0)) < 1e-6
    assert list(got["top_kernels_us"])[0] == "_mma_gemv_kernel" and got["top_kernels_us"]["_wgmma_kernel"] == 0.0


def test_every_quantpack_kernel_has_a_profile_family():
    """--profile sorts kernels into families by name: each Triton kernel quantpack launches (every ``*_kernel`` that
    ``@triton.jit`` or Gluon defines in the package) lands in a named family, not in 'other'."""
    import re

    sys.path.insert(0, str(BENCH.parent))
    from bench_decode import FAMILIES

    root = BENCH.parent.parent / "quantpack"
    names = set()
    for path in root.rglob("*.py"):
        names.update(re.findall(r"@(?:triton|gluon)\.jit[^\n]*\n\s*def (\w*kernel)\(", path.read_text()))
    assert {"_mma_gemv_kernel", "_kv_write_kernel", "_wgmma_kernel", "_activate_kernel"} <= names
    homeless = sorted(n for n in names if not any(re.search(rx, n) for _, rx in FAMILIES))
    assert not homeless, homeless


def test_profile_decode_subtracts_a_prefill_only_run(monkeypatch):
    """profile_decode's wiring, with the profiler and the model stood in: the step's kernels are the (steps + 1)-token
    generate's less the 1-token one's (a GPU runs the real profiler)."""
    import contextlib

    import torch

    sys.path.insert(0, str(BENCH.parent))
    import bench_decode

    cuda = torch.autograd.DeviceType.CUDA

    class Event:
        def __init__(self, name, us):
            self.name, self.device_time_total, self.device_type = name, us, cuda

    class Model:
        calls = []

        def generate(self, prompt, max_new_tokens, **kw):
            self.calls.append(max_new_tokens)

    model = Model()

    @contextlib.contextmanager
    def profile(activities):
        class Prof:
            def events(self):  # (read after the profiled call: a prefill kernel, and 30 us a decode step)
                return [Event("_wgmma_kernel", 500.0), Event("_mma_gemv_kernel", 30.0 * (model.calls[-1] - 1))]
        yield Prof()

    monkeypatch.setattr(bench_decode.torch.profiler, "profile", profile)
    monkeypatch.setattr(bench_decode, "_sync", lambda: None)
    got = bench_decode.profile_decode(model, None, steps=5)
    assert model.calls == [4, 1, 6]  # (warm-up, the prefill alone, five decode steps after it)
    assert got["families_us"]["quantized linears"] == 30.0
    assert got["top_kernels_us"]["_wgmma_kernel"] == 0.0
