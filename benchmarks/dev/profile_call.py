"""Run one ``mixed_mm`` call (random weights, one forced config) a few times, for a profiler to catch.

    ncu --kernel-name regex:_mma --launch-skip 12 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/dev/profile_call.py --n 14336 --k 4096 --m 64 \\
        --config '{"path": "mma", "block_m": 16, "block_n": 32, "split": 4, "num_warps": 2, "rawq": true}'
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]  # benchmarks/ (the harness), the repo
from bench_kernels import GS, random_packed  # noqa: E402  (benchmarks/bench_kernels.py)

from quantpack.kernels import mixed_mm  # noqa: E402
from quantpack.kernels.mixed_mm import KernelConfig  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--config", default="", help="a KernelConfig as JSON (default: the shipped/heuristic pick)")
    ap.add_argument("--calls", type=int, default=16)
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    qw, s, z = random_packed(args.n, args.k, args.bits, dtype)
    x = torch.randn(args.m, args.k, device="cuda", dtype=dtype)
    cfg = KernelConfig(**json.loads(args.config)) if args.config else None
    for _ in range(args.calls):
        mixed_mm(x, qw, s, z, group_size=GS, bits=args.bits, config=cfg)
    torch.cuda.synchronize()
    print("done", cfg)
