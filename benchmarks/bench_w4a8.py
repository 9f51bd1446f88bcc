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
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timing import graph_time, kernel_line, record  # noqa: E402  (benchmarks/timing.py)

from quantpack import reference  # noqa: E402
from quantpack.format import PackedWeight  # noqa: E402
from quantpack.kernels import mixed_mm  # noqa: E402
from quantpack.kernels.configs import KernelConfig  # noqa: E402
from quantpack.kernels.dispatch import choose, device_props, Flags  # noqa: E402
from quantpack.kernels.w4a8 import quantize_activations_fp8, w4a8_config  # noqa: E402

SHAPES = "4096x4096,14336x4096,4096x14336,8192x8192,28672x8192,8192x28672"  # N x K
SWEEP = [KernelConfig("w4a8", block_m=bm, block_n=bn, block_r=br, num_warps=w, num_stages=st, swap=sw, pair=pr)
         for sw, pr, bm, bn, br, w, st in [
             (False, False, 128, 128, 64, 8, 3), (False, False, 128, 64, 64, 4, 3), (False, False, 64, 128, 64, 4, 4),
             (False, True, 128, 128, 64, 8, 2), (False, True, 128, 64, 64, 4, 2), (True, False, 128, 128, 64, 8, 3),
             (True, False, 64, 128, 64, 4, 3), (True, True, 128, 128, 64, 8, 2), (True, True, 64, 128, 64, 4, 2),
             (True, False, 256, 128, 64, 8, 2), (False, False, 128, 128, 32, 8, 4)]]


# the Gluon wgmma kernel (w4a8_wgmma.py; K steps of 128 in-features, BLOCK_N / 16 MMA warps and a producer warp)
GLUON = [KernelConfig("w4a8", block_m=bm, block_n=bn, block_r=64, num_warps=bn // 16, num_stages=st, wgmma=True,
                      producer=prod)
         for bm, bn, st, prod in [(128, 64, 4, False), (128, 64, 3, False), (128, 64, 4, True), (128, 128, 3, False),
                                  (64, 64, 4, True), (64, 128, 4, False)]]


def name(c):
    if c.wgmma:
        return f"w4a8 gluon {c.block_m}x{c.block_n}x128 w{c.num_warps}{'+1' if c.producer else ''} s{c.num_stages}"
    return (f"w4a8 {c.block_m}x{c.block_n}x{2 * c.block_r} w{c.num_warps} s{c.num_stages}"
            + (" swap" if c.swap else "") + (" pair" if c.pair else ""))


@triton.jit
def _fp8_gemm(a_ptr, b_ptr, s_ptr, out_ptr, M, N, K, FOLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """A plain FP8 GEMM (a (M, K), b (N, K), both K-contiguous e4m3), optionally folding a per-(128-K group, n)
    scale into the float32 accumulator after each K step, as the W4A8 kernel does: the limits it runs under."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    m = (pid // num_n) * BM + tl.arange(0, BM)
    n = (pid % num_n) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    a_ptrs = a_ptr + (m % M)[:, None].to(tl.int64) * K + k[None, :]
    b_ptrs = b_ptr + (n % N)[None, :].to(tl.int64) * K + k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for it in range(0, K // BK):
        if FOLD:
            s = tl.load(s_ptr + it * N + n % N)
            acc += tl.dot(tl.load(a_ptrs), tl.load(b_ptrs)) * s[None, :]
        else:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], acc.to(tl.bfloat16),
             mask=(m < M)[:, None] & (n < N)[None, :])


def limits(n, k, m, copies):
    """Times (us) of cuBLAS FP8 (torch._scaled_mm, per-token x / per-channel w scales) and of the plain Triton FP8
    GEMM without and with the per-group fold, on FP8 copies of this shape's weight."""
    x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    ws = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(copies)]
    sa = torch.ones(m, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    gs = torch.ones(k // 128, n, device="cuda")
    out = {}
    try:
        out["cublas_fp8"] = graph_time([lambda w=w: torch._scaled_mm(x8, w.t(), scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.bfloat16) for w in ws])[0]
    except Exception as e:  # noqa: BLE001
        print("  _scaled_mm:", type(e).__name__, str(e)[:200])
    o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for fold in (False, True):
        grid = (-(-m // 128) * -(-n // 128),)
        out[f"triton_fp8{'_fold' if fold else ''}"] = graph_time(
            [lambda w=w: _fp8_gemm[grid](x8, w, gs, o, m, n, k, FOLD=fold, BM=128, BN=128, BK=128, num_warps=8,
                                         num_stages=3) for w in ws])[0]
    return out


def packed(n, k, gs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qw = torch.randint(0, 256, (k // 2, n), device="cuda", dtype=torch.uint8, generator=g)
    s = (torch.rand((k // gs, n), device="cuda", generator=g) * 0.02 + 0.005).bfloat16()
    z = (torch.rand((k // gs, n), device="cuda", generator=g) * 15).bfloat16()
    return qw, s, z


def check(n, k, gs, m, cfg=None):
    """Relative error of the W4A8 product (``cfg``, else the dispatched config) against the float reference, and
    whether the quantizer matched it bit for bit."""
    qw, s, z = packed(n, k, gs, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    xq, xs, xsum = quantize_activations_fp8(x, gs)
    rq, rs = reference.quantize_activations_fp8(x)
    perm = torch.cat([rq[:, 0::2], rq[:, 1::2]], 1)
    same = (torch.equal(xq.view(torch.uint8), perm.view(torch.uint8)) and torch.equal(xs, rs)
            and torch.allclose(xsum, rq.float().view(m, -1, gs).sum(-1), rtol=1e-6, atol=1e-3))
    if cfg is None:
        cfg = choose(device_props(x.device), max(m, 256), n, k, 4, x.dtype, group_size=gs,
                     flags=Flags(w4a8="on")).config
    out = mixed_mm(x, qw, s, z, group_size=gs, config=cfg, out_dtype=torch.float32)
    want = reference.matmul_fp8_activations(x.float(), PackedWeight(qw, s, z, 4, gs, 1, (n, k)))
    return ((out - want).norm() / want.norm()).item(), same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--gs", type=int, default=128)
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP config (else the dispatched one)")
    ap.add_argument("--gluon", action="store_true", help="time the GLUON configs and the Triton kernel's default")
    ap.add_argument("--top", type=int, default=0, help="with --sweep: after the first three shapes, time only the "
                                                       "TOP configs that were fastest on them")
    ap.add_argument("--limits", action="store_true", help="also time cuBLAS FP8 and plain Triton FP8 GEMMs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    bad = []
    for n, k in shapes:
        for gs, m in ((a.gs, 1), (a.gs, 1024), (64, 300)):
            err, same = check(n, k, gs, m)
            if not (err < 1e-3 and same):  # (Hopper FP8 MMAs accumulate a group with ~14 bits: ~1e-4)
                bad.append((n, k, gs, m, err, same))
    configs = SWEEP if a.sweep else []
    if a.gluon:
        configs = [c for c in GLUON + SWEEP if c.wgmma or c == w4a8_config()]
    for c in list(configs):
        err, same = check(4000, 4096, 128, 300, c)
        if not err < 1e-3:
            print(f"{name(c)}: WRONG (rel err {err:.2e}): not timed")
            configs.remove(c)
    print(f"checked: {len(bad)} failures {bad}", flush=True)
    if bad:
        sys.exit(1)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, score = [], {}
    for i, (n, k) in enumerate(shapes):
        copies_q = max(2, min(16, math.ceil(4 * l2 / (n * k // 2))))
        ws = [packed(n, k, a.gs, seed=j) for j in range(copies_q)]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
              for _ in range(max(1, min(8, math.ceil(4 * l2 / (2 * n * k)))))]
        if a.top and i == 3 and score:
            configs = sorted(score, key=score.get)[:a.top]
            print("from here on:", [name(c) for c in configs])
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cub, _ = graph_time([lambda w=w: F.linear(x, w) for w in wb])
            os.environ["QUANTPACK_W4A8"] = "0"
            w16, _ = graph_time([lambda w=w: mixed_mm(x, *w, group_size=a.gs) for w in ws])
            os.environ.pop("QUANTPACK_W4A8")
            cfg = choose(device_props(x.device), m, n, k, 4, x.dtype, group_size=a.gs, flags=Flags(w4a8="on")).config
            times = {}
            for c in [cfg] + [c for c in configs if c != cfg]:
                try:
                    times[c] = graph_time([lambda w=w, c=c: mixed_mm(x, *w, group_size=a.gs, config=c) for w in ws])[0]
                except Exception as e:  # noqa: BLE001  (a tile that does not fit this GPU)
                    print(f"  {name(c)}: {type(e).__name__}")
            for c, t in times.items():
                score[c] = score.get(c, 0.0) + t / cub
            best = min(times, key=times.get)
            xq_t, _ = graph_time([lambda: quantize_activations_fp8(x, a.gs)])
            print(f"{n}x{k} M={m}: cuBLAS {cub*1e3:.1f} us, W4A16 {w16*1e3:.1f} ({cub/w16:.2f}x), dispatched "
                  f"{times[cfg]*1e3:.1f} ({cub/times[cfg]:.2f}x), best {name(best)} {times[best]*1e3:.1f} "
                  f"({cub/times[best]:.2f}x; quantizer {xq_t*1e3:.1f})", flush=True)
            for c, tc in sorted(times.items(), key=lambda kv: kv[1])[1:4]:
                print(f"    {name(c)}: {tc*1e3:.1f} us")
            extra = {}
            if a.limits and m == ms[-1]:
                lim = limits(n, k, m, max(1, min(8, math.ceil(4 * l2 / (n * k)))))
                print("    limits: " + ", ".join(f"{key} {v*1e3:.1f} us ({cub/v:.2f}x)" for key, v in lim.items()))
                extra = {f"{key}_us": round(v * 1e3, 2) for key, v in lim.items()}
            rows.append(kernel_line(n, k, m, 4, a.gs, "bf16", "w4a8", times[best] * 1e3, cub * 1e3, config=name(best),
                                    w4a16_us=round(w16 * 1e3, 2), quantizer_us=round(xq_t * 1e3, 2), **extra))
        del ws, wb
        torch.cuda.empty_cache()
        record("kernels", rows, a.out)  # (each shape as it is done)
        rows = []
    if score:
        print("sum over the cells of time / cuBLAS:", {name(c): round(v, 2) for c, v in sorted(score.items(),
                                                                                            key=lambda kv: kv[1])})


if __name__ == "__main__":
    main()
