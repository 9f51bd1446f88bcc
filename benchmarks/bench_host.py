"""Host time per call of a quantized linear, eager (no CUDA graph): F.linear on the bf16 weight, ``mixed_mm``,
``mixed_mm`` with a launch-plan cache (what ``QuantLinear`` runs), the autograd Function with it (training), and the
kernel alone under CUDA-graph replay for scale. Calls are issued back to back and timed with a synchronize at the
end, so a call's time is its host time unless the GPU is the slower of the two (F.linear at the larger shapes).

    python benchmarks/bench_host.py                     # 4096x4096 and 14336x4096, M = 1, 16, 64, 256
    python benchmarks/bench_host.py --shapes 4096x4096 --ms 1 16

Each row is appended to benchmarks/results/host.jsonl (``--results DIR`` elsewhere, ``--results ""`` not at all).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import random_packed  # noqa: E402  (benchmarks/bench_kernels.py)

from quantpack.kernels import MixedMatmul, mixed_mm  # noqa: E402
from quantpack.kernels.launch_plan import PlanCache  # noqa: E402
from quantpack.kernels.mixed_mm import pick_config  # noqa: E402
from timing import host_us, record  # noqa: E402


def graph_us(fn, calls: int = 20) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=5, rep=50, return_mode="median") * 1e3 / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096"], help="NxK")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--results", default=None, help="append the rows to DIR/host.jsonl (default benchmarks/results; "
                    "'' records nothing)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("Error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    dt, gs = torch.bfloat16, 128
    print(f"{torch.cuda.get_device_name()}, bf16, group size {gs}; us per call")
    print(f"{'N x K':>12} {'M':>5} {'path':>12} {'F.linear':>9} {'mixed_mm':>9} {'+plans':>9} {'autograd':>9} "
          f"{'kernel':>9}")
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        qw, s, z = random_packed(n, k, 4, dt, gs=gs)
        w = torch.randn(n, k, dtype=dt, device="cuda")
        plans = PlanCache()
        for m in args.ms:
            x = torch.randn(m, k, dtype=dt, device="cuda")
            cfg = pick_config(False, 4, m, n, k, x.device)
            with torch.no_grad():
                ref = host_us(lambda: F.linear(x, w))
                bare = host_us(lambda: mixed_mm(x, qw, s, z, group_size=gs))
                planned = host_us(lambda: mixed_mm(x, qw, s, z, group_size=gs, plans=plans))
                autograd = host_us(lambda: MixedMatmul.apply(x, qw, s, z, None, gs, 4, 1, False, plans))
                kernel = graph_us(lambda: mixed_mm(x, qw, s, z, group_size=gs, plans=plans))
            path = cfg.path + ("/rawq" if cfg.rawq else "")
            print(f"{n:>6}x{k:<5} {m:>5} {path:>12} {ref:>9.1f} {bare:>9.1f} {planned:>9.1f} {autograd:>9.1f} "
                  f"{kernel:>9.1f}", flush=True)
            rows.append({"shape": [n, k], "M": m, "bits": 4, "group_size": gs, "dtype": "bf16", "path": path,
                         "host_us": {"F.linear": round(ref, 1), "mixed_mm": round(bare, 1),
                                     "planned": round(planned, 1), "autograd": round(autograd, 1)},
                         "kernel_us": round(kernel, 1)})
    record("host", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
