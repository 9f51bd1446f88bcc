"""Batch 16's decode GEMVs: the shipped path at 1, 8 and 16 rows beside forced `mma` and `wgmma` configs (ring
depths, K splits, two 8-row programs a tile, registers capped), timed like bench_kernels (CUDA-graph replays over
weight replicas past L2) and checked against the shipped path's output. BENCHMARKS.md and NOTES ("the 16-row GEMVs")
cite it.

    python benchmarks/dev/gemv16.py [--shapes 14336x4096,4096x14336] [--rows 1,8,16] [--stages 4,6,8,12]
        [--maxnreg 96,80,64]
    # one config's call alone, for Nsight Compute (the third launch is the timed call's kernel):
    ncu --clock-control none -k regex:"mma|wgmma" --launch-skip 2 --launch-count 1 \\
        python benchmarks/dev/gemv16.py --one 14336x4096 16 wgmma
"""
import argparse
import importlib
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]  # benchmarks/ (the harness), the repo

from bench_kernels import L2, GS, random_packed, replicas  # noqa: E402
from timing import graph_time  # noqa: E402
from quantpack.kernels.configs import KernelConfig  # noqa: E402

mm = importlib.import_module("quantpack.kernels.mixed_mm")  # the module, not the function of that name
launch_plan = importlib.import_module("quantpack.kernels.launch_plan")


def configs(n: int, k: int, stages: list) -> dict:
    """Forced configs by name: the tuner's best `mma` kinds at 16 rows, two 8-row programs a tile (the later one
    reading the weight from L2), and the `wgmma` 16 x 64 tile (split 1 for 4096-wide K, else 4) at each ring depth
    and at half its split."""
    split = 1 if k <= 4096 else 4
    out = {"mma x16 r32 s4 w1 rawq": KernelConfig("mma", 16, 32, 32, split=4, num_warps=1, num_stages=2, rawq=True),
           "mma x16 r16 s1 k8 w1": KernelConfig("mma", 16, 16, 32, split=1, num_warps=1, num_stages=2, k_warps=8),
           "mma x8 r16 s4 w4 (two 8-row programs)": KernelConfig("mma", 8, 16, 32, split=4, num_warps=4,
                                                                  num_stages=2)}
    for depth in stages:
        out[f"wgmma 16x64 split {split} ring {depth}"] = KernelConfig("wgmma", 16, 64, 64, split=split, num_warps=4,
                                                                      num_stages=depth, rawq=True, producer=True)
    half = max(1, split // 2) if split > 1 else 2
    out[f"wgmma 16x64 split {half} ring 4"] = KernelConfig("wgmma", 16, 64, 64, split=half, num_warps=4,
                                                           num_stages=4, rawq=True, producer=True)
    return out


def capped(regs: int | None):
    """launch_plan.launch with Triton's ``maxnreg`` set to ``regs`` (None: as compiled)."""
    original = launch_plan.launch

    def launch(kernel, grid, *args, **kwargs):
        if regs:
            kwargs["maxnreg"] = regs
        return original(kernel, grid, *args, **kwargs)
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="14336x4096,4096x14336")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--stages", default="4,6,8,12", help="ring depths of the wgmma tile")
    ap.add_argument("--maxnreg", default="", help="register caps for the mma configs (comma-separated)")
    ap.add_argument("--one", nargs=3, metavar=("NxK", "ROWS", "PATH"),
                    help="run one call of the shipped path (PATH default) or the first config of PATH three times")
    args = ap.parse_args()
    os.environ["QUANTPACK_LAUNCH_PLANS"] = "0"  # (every call launches: a register cap takes effect)
    if args.one:
        n, k = map(int, args.one[0].split("x"))
        x = torch.randn(int(args.one[1]), k, device="cuda", dtype=torch.bfloat16)
        cfg = None if args.one[2] == "default" else next(
            c for c in configs(n, k, [4]).values() if c.path == args.one[2])
        weight = random_packed(n, k, 4, torch.bfloat16)
        for _ in range(3):
            mm.mixed_mm(x, *weight, group_size=GS, bits=4, config=cfg)
        torch.cuda.synchronize()
        return
    caps = [None] + [int(v) for v in args.maxnreg.split(",") if v]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weights = [random_packed(n, k, 4, torch.bfloat16, gen_seed=i)
                   for i in range(replicas(n * k // 2, L2))]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = mm.mixed_mm(x, *weights[0], group_size=GS, bits=4).float()
            us = graph_time([lambda w=w: mm.mixed_mm(x, *w, group_size=GS, bits=4) for w in weights])[0] * 1e3
            print(f"{shape} M={m:2d} shipped: {us:6.2f} us", flush=True)
            if m == 1:
                continue
            for name, cfg in configs(n, k, [int(v) for v in args.stages.split(",")]).items():
                for regs in (caps if cfg.path == "mma" else [None]):
                    launch_plan.launch, original = capped(regs), launch_plan.launch
                    try:
                        got = mm.mixed_mm(x, *weights[0], group_size=GS, bits=4, config=cfg).float()
                        err = float((got - ref).abs().max() / ref.abs().max())
                        us = graph_time([lambda w=w: mm.mixed_mm(x, *w, group_size=GS, bits=4, config=cfg)
                                         for w in weights])[0] * 1e3
                        print(f"{shape} M={m:2d} {name}{f' maxnreg {regs}' if regs else ''}: {us:6.2f} us "
                              f"(max error against the shipped path {err:.1e})", flush=True)
                    finally:
                        launch_plan.launch = original


if __name__ == "__main__":
    main()
