"""W8A8 (int8 weights x per-token int8 activations) against cuBLAS bf16 and torch._int_mm, on one GPU.

    python benchmarks/bench_w8a8.py [--ms 256,1024,4096] [--skip-check]

1. Correctness first, at full sizes, bf16 and fp16, both matmul kernels (TMA and pointer): the
   activation quantizer bit for bit against the torch reference; the matmul (output buffer poisoned
   with NaN first) against float64 scaling of the exact int32 product from torch._int_mm, within the
   final cast's rounding; the whole layer against the float layer.
2. Timing: per (M, N, K), each implementation is the median of triton.testing.do_bench over CUDA-graph
   replays of one call per weight replica, with replicas (weights and activations) rotated so that
   they exceed 3x L2 and come from HBM. Random data throughout.
   - cuBLAS bf16: F.linear(x, W) with W bf16.
   - _int_mm + scaling: our activation quantizer, torch._int_mm (cuBLAS int8), then separate torch
     ops for x_scale * weight_scale and the cast.
   - w8a8 tma / w8a8 ptr: quantize_activations + w8a8_matmul (= w8a8_linear) with either kernel.
   - the matmul alone (pre-quantized activations), _int_mm alone, and the quantizer alone.
   Each is timed in --rounds interleaved rounds; the table reports each one's best round, the
   JSON every round (their spread is the noise).
Writes bench_w8a8.json and bench_w8a8.md to $OUT (or the current directory), and appends each cell to
benchmarks/results/kernels.jsonl (``--results DIR`` elsewhere, ``--results ""`` not at all).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from quantpack.quantization.w8a8 import quantize_activations_reference, quantize_weight_w8a8  # noqa: E402

from timing import graph_time, kernel_line, median_ms, record  # noqa: E402  (benchmarks/timing.py)

kw = importlib.import_module("quantpack.kernels.w8a8")

SHAPES = [(4096, 4096), (14336, 4096)]  # (N out, K in)
KERNELS = ("tma", "pointer")
FAILURES: list[str] = []


def log(*a):
    print(*a, flush=True)


def graph_ms(calls):
    """Median ms per call over CUDA-graph replays of ``calls`` (one per replica); capture must work."""
    return graph_time(calls, eager_fallback=False)[0]


def ceilings():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    bf16 = 2 * 8192**3 / (median_ms(lambda: a @ b) * 1e-3)
    a8 = torch.randint(-127, 128, (8192, 8192), dtype=torch.int8, device="cuda")
    b8 = torch.randint(-127, 128, (8192, 8192), dtype=torch.int8, device="cuda")
    int8 = 2 * 8192**3 / (median_ms(lambda: torch._int_mm(a8, b8.t())) * 1e-3)
    x = torch.randn(2**28, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / (median_ms(lambda: y.copy_(x)) * 1e-3)
    return bf16, int8, bw


# ------------------------------------------------------------------------------------ correctness

def check(m, n, k, dtype, with_bias):
    torch.manual_seed(m + n + k + (dtype == torch.float16))
    x = torch.randn(m, k, device="cuda").to(dtype)
    rows = torch.arange(0, m, 64, device="cuda")
    x[rows, torch.randint(0, k, (len(rows),), device="cuda")] *= 30  # an outlier in every 64th row
    x[5] = 0  # a zero row
    w = torch.randn(n, k, device="cuda") / k**0.5
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    qweight, weight_scale = quantize_weight_w8a8(w)
    name = f"M={m} N={n} K={k} {str(dtype)[6:]}{' +bias' if with_bias else ''}"

    x_q, x_scale = kw.quantize_activations(x)
    q_ref, s_ref = quantize_activations_reference(x)
    ok = torch.equal(x_q, q_ref) and torch.equal(x_scale, s_ref)
    log(f"check {name} quantize_activations bitwise: {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILURES.append(f"{name} quantizer")

    acc = torch._int_mm(x_q, qweight.t())
    terms = acc.double() * x_scale.double()[:, None] * weight_scale.double()[None, :]
    bias64 = bias.double() if with_bias else torch.zeros(n, dtype=torch.float64, device="cuda")
    ref = terms + bias64
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = unit * ref.abs() + 4 * 2.0**-24 * (terms.abs() + bias64.abs()) + 2.0**-24
    exact_float = F.linear(x.double(), w.double(), bias64)
    for kernel in KERNELS:
        try:
            poison = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            del poison  # the output allocated next reuses this block
            out = kw.w8a8_matmul(x_q, x_scale, qweight, weight_scale, bias, out_dtype=dtype, kernel=kernel)
            torch.cuda.synchronize()
        except Exception as e:  # report and go on: the other kernel may still run
            log(f"check {name} {kernel}: ERROR {e!r}"[:400])
            FAILURES.append(f"{name} {kernel} error")
            continue
        worst = ((out.double() - ref).abs() / bound).max().item()
        finite = bool(torch.isfinite(out).all())
        rel = ((out.double() - exact_float).norm() / exact_float.norm()).item()
        ok = finite and worst <= 1.0 and rel < 0.03
        log(f"check {name} {kernel:7s}: worst err/cast-bound {worst:.3f}, all written {finite}, "
            f"rel err vs float layer {rel:.2e}: {'ok' if ok else 'FAIL'}")
        if not ok:
            FAILURES.append(f"{name} {kernel}")


# ------------------------------------------------------------------------------------------ timing

def bench(ms, l2, rounds):
    rows = []
    for n, k in SHAPES:
        reps = max(2, math.ceil(3 * l2 / (n * k)))  # int8 weight replicas; bf16 ones are twice as large
        g = torch.Generator(device="cuda").manual_seed(n)
        w_bf16 = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16) for _ in range(reps)]
        quantized = [quantize_weight_w8a8(wb) for wb in w_bf16]
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(reps)]
            xq = [kw.quantize_activations(x) for x in xs]
            calls = {
                "cublas_bf16": [lambda i=i: F.linear(xs[i], w_bf16[i]) for i in range(reps)],
                "int_mm_scaled": [lambda i=i: _int_mm_scaled(xs[i], *quantized[i]) for i in range(reps)],
                "int_mm_only": [lambda i=i: torch._int_mm(xq[i][0], quantized[i][0].t()) for i in range(reps)],
                "quantize_only": [lambda i=i: kw.quantize_activations(xs[i]) for i in range(reps)],
            }
            for kernel in KERNELS:
                calls[f"w8a8_{kernel}"] = [lambda i=i, kernel=kernel: _w8a8(xs[i], *quantized[i], kernel)
                                           for i in range(reps)]
                calls[f"matmul_{kernel}"] = [
                    lambda i=i, kernel=kernel: kw.w8a8_matmul(*xq[i], *quantized[i], out_dtype=torch.bfloat16,
                                                              kernel=kernel) for i in range(reps)]
            row = {"M": m, "N": n, "K": k, "replicas": reps}
            times = {name: [] for name in calls}
            for _ in range(rounds):  # rounds interleave the implementations, so drift hits all alike
                for name, fns in calls.items():
                    try:
                        times[name].append(graph_ms(fns) * 1e3)  # us
                    except Exception as e:
                        log(f"time M={m} N={n} K={k} {name}: ERROR {e!r}"[:400])
                        times[name].append(float("nan"))
            for name, ts in times.items():
                row[name] = min((t for t in ts if t == t), default=float("nan"))
                row[f"{name}_rounds"] = ts
            flops = 2 * m * n * k
            log(f"time M={m} N={n} K={k}: " + ", ".join(
                f"{name} {'/'.join(f'{t:.1f}' for t in times[name])}us ({flops / row[name] / 1e6:.0f} TF)"
                for name in calls))
            rows.append(row)
            xs = xq = calls = None  # (their memory, before the next shape's)
        w_bf16 = quantized = None
        torch.cuda.empty_cache()
    return rows


def _int_mm_scaled(x, qweight, weight_scale):
    x_q, x_scale = kw.quantize_activations(x)
    acc = torch._int_mm(x_q, qweight.t())
    return (acc * x_scale[:, None] * weight_scale[None, :]).to(x.dtype)


def _w8a8(x, qweight, weight_scale, kernel):
    x_q, x_scale = kw.quantize_activations(x)
    return kw.w8a8_matmul(x_q, x_scale, qweight, weight_scale, out_dtype=x.dtype, kernel=kernel)


def table(rows):
    head = ("| M | N | K | cuBLAS bf16 us | _int_mm+scale us | w8a8 TMA us | w8a8 ptr us | best vs bf16 "
            "| best vs _int_mm+scale | matmul TMA / ptr / _int_mm alone us | quantize us | best TOP/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        best = min(r["w8a8_tma"], r["w8a8_pointer"], key=lambda v: v if v == v else float("inf"))
        lines.append(
            f"| {r['M']} | {r['N']} | {r['K']} | {r['cublas_bf16']:.1f} | {r['int_mm_scaled']:.1f} "
            f"| {r['w8a8_tma']:.1f} | {r['w8a8_pointer']:.1f} | {r['cublas_bf16'] / best:.2f}x "
            f"| {r['int_mm_scaled'] / best:.2f}x | {r['matmul_tma']:.1f} / {r['matmul_pointer']:.1f} / "
            f"{r['int_mm_only']:.1f} | {r['quantize_only']:.1f} | {2 * r['M'] * r['N'] * r['K'] / best / 1e6:.0f} |")
    return "\n".join(lines)


def kernel_lines(rows):
    """The timed rows as ``kernels.jsonl`` cells: cuBLAS bf16, ``_int_mm`` + scaling, and the faster w8a8 kernel."""
    out = []
    for r in rows:
        best = min(KERNELS, key=lambda kern: r[f"w8a8_{kern}"] if r[f"w8a8_{kern}"] == r[f"w8a8_{kern}"] else math.inf)
        for impl, t, extra in (("cublas", r["cublas_bf16"], {}), ("int_mm", r["int_mm_scaled"], {}),
                               ("quantpack", r[f"w8a8_{best}"], {"config": best})):
            out.append(kernel_line(r["N"], r["K"], r["M"], 8, None, "bf16", impl, t, r["cublas_bf16"], scheme="w8a8",
                                   **extra))
    return out


def chosen_configs():
    out = {}
    for name in ("_w8a8_matmul_tma_autotuned", "_w8a8_matmul_autotuned"):
        for key, cfg in getattr(getattr(kw, name), "cache", {}).items():
            out[f"{name}{key}"] = str(cfg)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds; the table reports the best round")
    ap.add_argument("--results", default=None, help="append the cells to DIR/kernels.jsonl (default "
                    "benchmarks/results; '' records nothing)")
    args = ap.parse_args()
    import triton

    p = torch.cuda.get_device_properties(0)
    l2 = getattr(p, "L2_cache_size", 50 * 2**20)
    log(f"{p.name}, {p.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MB, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    t0 = time.time()
    if not args.skip_check:
        # bf16 without bias shares compiled kernels with the timing below; fp16 covers the bias.
        for dtype, with_bias in ((torch.bfloat16, False), (torch.float16, True)):
            for n, k in SHAPES:
                check(1024, n, k, dtype, with_bias)
        check(4096, 14336, 4096, torch.bfloat16, False)
        log(f"correctness: {'all ok' if not FAILURES else 'FAILURES: ' + '; '.join(FAILURES)} ({time.time() - t0:.0f}s)")
    bf16_peak, int8_peak, bw = ceilings()
    log(f"ceilings: cuBLAS bf16 8192^3 {bf16_peak / 1e12:.0f} TFLOP/s, _int_mm 8192^3 {int8_peak / 1e12:.0f} TOP/s, "
        f"copy {bw / 1e12:.2f} TB/s")
    rows = bench([int(v) for v in args.ms.split(",")], l2, args.rounds)
    md = table(rows)
    configs = chosen_configs()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "bench_w8a8.json"), "w") as f:
        json.dump({"device": p.name, "torch": torch.__version__, "triton": triton.__version__,
                   "ceilings": {"bf16_tflops": bf16_peak / 1e12, "int8_tops": int8_peak / 1e12, "copy_tbs": bw / 1e12},
                   "failures": FAILURES, "rows": rows, "configs": configs}, f, indent=1)
    with open(os.path.join(out_dir, "bench_w8a8.md"), "w") as f:
        f.write(md + "\n")
    record("kernels", kernel_lines(rows), args.results)
    for key, cfg in configs.items():
        log(f"config {key}: {cfg}")
    log(f"total {time.time() - t0:.0f}s; correctness {'ok' if not FAILURES else 'FAILED: ' + '; '.join(FAILURES)}")
    log(md)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
