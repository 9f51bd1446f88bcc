"""The W4A8-FP8 path (quantpack/kernels/w4a8.py) against cuBLAS bf16 and the default W4A16 path, on one GPU.

    python benchmarks/bench_w4a8.py [--ms 256,1024,4096] [--shapes 4096x4096,...] [--sweep] [--out DIR]

Checks first, at every shape: the quantizer bit for bit against quantpack.reference.quantize_activations_fp8, and
the product against the float32 reference of the same FP8 activations and codes (reference.matmul_fp8_activations).
Then times (BENCHMARKS.md "Method": medians of do_bench over CUDA-graph replays, one call per weight copy, copies past
4x L2; cuBLAS in the same process) cuBLAS bf16 F.linear, quantpack with QUANTPACK_W4A8=0 (W4A16) and the W4A8 path
(its dispatched config; ``--sweep`` also times the other tile configs). JSON lines go to ``<out>/kernels.jsonl``
(``impl`` "w4a8"; default benchmarks/results/; ``--out ""`` writes nothing).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timing import graph_time, kernel_line, record  # noqa: E402  (benchmarks/timing.py)

from quantpack import reference  # noqa: E402
from quantpack.format import PackedWeight  # noqa: E402
from quantpack.kernels import mixed_mm  # noqa: E402
from quantpack.kernels.configs import KernelConfig  # noqa: E402
from quantpack.kernels.dispatch import choose, device_props, Flags  # noqa: E402
from quantpack.kernels.w4a8 import quantize_activations_fp8  # noqa: E402

SHAPES = "4096x4096,14336x4096,4096x14336,8192x8192,28672x8192,8192x28672"  # N x K
SWEEP = [KernelConfig("w4a8", block_m=bm, block_n=bn, block_r=br, num_warps=w, num_stages=st)
         for bm, bn, br, w, st in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                   (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 32, 8, 4),
                                   (128, 64, 64, 4, 4)]]


def packed(n, k, gs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qw = torch.randint(0, 256, (k // 2, n), device="cuda", dtype=torch.uint8, generator=g)
    s = (torch.rand((k // gs, n), device="cuda", generator=g) * 0.02 + 0.005).bfloat16()
    z = (torch.rand((k // gs, n), device="cuda", generator=g) * 15).bfloat16()
    return qw, s, z


def check(n, k, gs, m):
    """Max relative error of the W4A8 product against the float reference, and whether the quantizer matched."""
    qw, s, z = packed(n, k, gs, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    xq, xs, xsum = quantize_activations_fp8(x, gs)
    rq, rs = reference.quantize_activations_fp8(x)
    perm = torch.cat([rq[:, 0::2], rq[:, 1::2]], 1)
    same = (torch.equal(xq.view(torch.uint8), perm.view(torch.uint8)) and torch.equal(xs, rs)
            and torch.allclose(xsum, rq.float().view(m, -1, gs).sum(-1), rtol=1e-6, atol=1e-3))
    cfg = choose(device_props(x.device), max(m, 256), n, k, 4, x.dtype, group_size=gs, flags=Flags(w4a8="on")).config
    out = mixed_mm(x, qw, s, z, group_size=gs, config=cfg, out_dtype=torch.float32)
    want = reference.matmul_fp8_activations(x.float(), PackedWeight(qw, s, z, 4, gs, 1, (n, k)))
    return ((out - want).norm() / want.norm()).item(), same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--gs", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    bad = []
    for n, k in shapes:
        for gs in (a.gs, 64):
            for m in (1, 17, 1024):
                err, same = check(n, k, gs, m)
                print(f"check {n}x{k} g{gs} M={m}: rel err {err:.2e}, quantizer {'exact' if same else 'DIFFERS'}",
                      flush=True)
                if not (err < 1e-5 and same):
                    bad.append((n, k, gs, m, err, same))
    if bad:
        print("FAILED", bad)
        sys.exit(1)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for n, k in shapes:
        copies_q = max(2, min(16, math.ceil(4 * l2 / (n * k // 2))))
        ws = [packed(n, k, a.gs, seed=i) for i in range(copies_q)]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, min(8, math.ceil(4 * l2 / (2 * n * k)))))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cub, _ = graph_time([lambda w=w: F.linear(x, w) for w in wb])
            os.environ["QUANTPACK_W4A8"] = "0"
            w16, _ = graph_time([lambda w=w: mixed_mm(x, *w, group_size=a.gs) for w in ws])
            os.environ.pop("QUANTPACK_W4A8")
            cfg = choose(device_props(x.device), m, n, k, 4, x.dtype, group_size=a.gs, flags=Flags(w4a8="on")).config
            times = {}
            for c in ([cfg] + [c for c in SWEEP if c != cfg] if a.sweep else [cfg]):
                try:
                    times[c] = graph_time([lambda w=w, c=c: mixed_mm(x, *w, group_size=a.gs, config=c) for w in ws])[0]
                except Exception as e:  # (a tile that does not fit this GPU)
                    print(f"  {c.block_m}x{c.block_n}x{c.block_r} w{c.num_warps} s{c.num_stages}: {type(e).__name__}")
            t = times[cfg]
            best = min(times, key=times.get)
            xq_t, _ = graph_time([lambda: quantize_activations_fp8(x, a.gs)])
            print(f"{n}x{k} M={m}: cuBLAS {cub*1e3:.1f} us, W4A16 {w16*1e3:.1f} ({cub/w16:.2f}x), W4A8 {t*1e3:.1f} "
                  f"({cub/t:.2f}x; quantizer {xq_t*1e3:.1f}), best {best.block_m}x{best.block_n}x{best.block_r} "
                  f"w{best.num_warps} s{best.num_stages} {times[best]*1e3:.1f} ({cub/times[best]:.2f}x)", flush=True)
            for c, tc in sorted(times.items(), key=lambda kv: kv[1]):
                print(f"    {c.block_m}x{c.block_n}x{c.block_r} w{c.num_warps} s{c.num_stages}: {tc*1e3:.1f} us")
            rows.append(kernel_line(n, k, m, 4, a.gs, "bf16", "w4a8", t * 1e3, cub * 1e3,
                                    config=f"w4a8 {cfg.block_m}x{cfg.block_n}x{2 * cfg.block_r} s{cfg.num_stages} "
                                           f"w{cfg.num_warps}", w4a16_us=round(w16 * 1e3, 2),
                                    quantizer_us=round(xq_t * 1e3, 2)))
        del ws, wb
        torch.cuda.empty_cache()
    record("kernels", rows, a.out)


if __name__ == "__main__":
    main()
