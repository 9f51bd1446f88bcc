"""benchmarks/bench_load.py runs end to end on the CPU at a tiny shape: both checkpoints hold the same packed bytes,
and each row carries its tensor count and its time against the dense load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_load.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}


def test_cpu_smoke_run_compares_a_moe_load_with_a_dense_one_of_the_same_bytes(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--experts", "16", "--expert-width", "64",
                          "--hidden", "128", "--layers", "1", "--repeats", "2", "--results", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["case"]: r for r in map(json.loads, (tmp_path / "load.jsonl").read_text().splitlines())}
    moe, dense = rows["load-moe"], rows["load-dense"]
    # 16 experts x 3 matrices x (qweight, scales, zeros) in the MoE; one MLP of 16 x 64 rows in the dense model
    assert moe["tensors"] - dense["tensors"] == 16 * 3 * 3 - 3 * 3 + 3  # (+ the router, Qwen3's q and k norms)
    assert moe["stored_bytes"] - dense["stored_bytes"] == 16 * 128 * 2 + 2 * 64 * 2  # (the router, the norms: bf16)
    assert dense["ratio_to_dense"] == 1.0 and moe["ratio_to_dense"] == moe["seconds"] / dense["seconds"]
    assert len(moe["seconds_all"]) == 2 and "peak_bytes" not in moe  # (a GPU's peak only)
    assert "x the dense load" in out.stdout
