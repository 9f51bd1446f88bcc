"""W4A8-FP8: a packed 4-bit weight-only checkpoint on Hopper's FP8 tensor cores.

The same (K/2, N) packed codes the W4A16 kernels read (docs/format.md), no new format. Per call:

1. :func:`quantize_activations_fp8`: one program per row of x: ``amax = max(max_k |x[m, k]|, AMAX_FLOOR)``,
   ``scale[m] = amax / 448``, ``xq = clamp(x * (448 / amax), -448, 448)`` rounded to float8 e4m3 (to nearest, ties to
   even). It writes the row in blocks of one GEMM K step, each block's even in-features first and its odd ones after
   them (they meet the low and the high nibbles of the step's packed rows: no interleaving in the GEMM), and the sum
   of the quantized values of each (row, K-group), which the zero term needs.
2. :func:`w4a8_matmul`: per (M, N) tile, per K group ``g``: ``acc_g = xq_g . q_g``, one FP8 dot per K step (the codes
   0..15 are exact in e4m3), then ``acc += s[g, n] * acc_g - xsum[m, g] * (z * s)[g, n]`` in float32 (HQQ's
   ``w = (q - z) * s``), and finally ``out = acc * scale[m] (+ bias)``.

:func:`~quantpack.reference.matmul_fp8_activations` is the float reference of the same arithmetic. dispatch.py
decides where this path runs (``QUANTPACK_W4A8``); the launcher (launcher.py) runs it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch_plan
from .dequant import cdiv, interpreting, next_power_of_2, on_device
from .w4a8_wgmma import block_k, w4a8_wgmma_fits, w4a8_wgmma_matmul
from ..reference import FP8_AMAX_FLOOR

__all__ = ["quantize_activations_fp8", "w4a8_matmul", "w4a8_layout_fits", "w4a8_config", "MIN_GROUP"]

MIN_GROUP = 64  # the smallest group (and K step) tested; one K step never straddles two groups
_CHUNK = 1024  # pair rows per quantizer step (whole groups)


# ---------------------------------------------------------------------------------------------
# Activation quantization: one program per row.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _round_half_even(y):
    # (|y| <= 16 here; the interpreter has no rint)
    t = y.to(tl.int32)
    frac = y - t.to(tl.float32)
    afrac = tl.abs(frac)
    up = (afrac > 0.5) | ((afrac == 0.5) & ((t & 1) != 0))
    return tl.where(up, t + tl.where(frac > 0, 1, -1), t).to(tl.float32)


@triton.jit
def _to_e4m3(y, EMULATE: tl.constexpr):
    """``y`` (|y| <= 448) rounded to float8 e4m3, ties to even. The interpreter's own conversion drops the carry of
    a mantissa that rounds up into the next power of two (124.3 -> 64), so there the rounding is done in float32
    first (to 3 mantissa bits, subnormals below 2**-6), leaving an exact conversion."""
    if EMULATE:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = _round_half_even(y / ulp) * ulp
        y = tl.where(y < 0, -tl.abs(r), r)  # (keeps the sign of a value that rounds to zero)
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_chunk(x_row, q_row, sum_row, c0, KH, inv, SG, GS: tl.constexpr, CHUNK: tl.constexpr, R: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Quantize pair rows [c0, c0 + CHUNK) of one row; store them in blocks of R pair rows (evens, then odds) and the
    group sums."""
    j = c0 + tl.arange(0, CHUNK)
    mask = j < KH
    x_e = tl.load(x_row + 2 * j, mask=mask, other=0.0).to(tl.float32)
    x_o = tl.load(x_row + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
    q_e = _to_e4m3(tl.minimum(tl.maximum(x_e * inv, -448.0), 448.0), EMULATE)
    q_o = _to_e4m3(tl.minimum(tl.maximum(x_o * inv, -448.0), 448.0), EMULATE)
    at = (j // R) * (2 * R) + j % R
    tl.store(q_row + at, q_e, mask=mask)
    tl.store(q_row + at + R, q_o, mask=mask)
    PAIRS: tl.constexpr = GS // 2
    both = q_e.to(tl.float32) + q_o.to(tl.float32)
    sums = tl.sum(tl.reshape(both, (CHUNK // PAIRS, PAIRS)), axis=1)
    g = c0 // PAIRS + tl.arange(0, CHUNK // PAIRS)
    tl.store(sum_row + g * SG, sums, mask=g < KH // PAIRS)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, sum_ptr, K, stride_xm, SR, SG, AMAX_FLOOR: tl.constexpr,
                         GS: tl.constexpr, CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr, R: tl.constexpr,
                         EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    sum_row = sum_ptr + row * SR
    KH = K // 2
    offs = tl.arange(0, 2 * CHUNK)
    if ONE_CHUNK:
        amax = tl.max(tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)), axis=0)
    else:
        run_max = tl.zeros([2 * CHUNK], dtype=tl.float32)
        for k0 in range(0, K, 2 * CHUNK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            run_max = tl.maximum(run_max, tl.abs(xk))
        amax = tl.max(run_max, axis=0)
    amax = tl.maximum(amax, AMAX_FLOOR)
    inv = tl.math.div_rn(448.0, amax)
    tl.store(s_ptr + row, tl.math.div_rn(amax, 448.0))
    for c0 in range(0, KH, CHUNK):  # (a second read of the row mostly hits L2)
        _quantize_chunk(x_row, q_row, sum_row, c0, KH, inv, SG, GS, CHUNK, R, EMULATE)


def quantize_activations_fp8(x2: torch.Tensor, group_size: int, block_r: int | None = None,
                             sums_by_group: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token FP8 e4m3 quantization of ``x2`` (M, K) for :func:`w4a8_matmul`: ``(xq, scale, xsum)`` with ``xq``
    (M, K) float8_e4m3fn, ``scale`` (M,) float32 (x ~ xq * scale) and ``xsum`` (M, K / group_size) float32, the sum
    of each group's quantized values. ``xq`` holds each row in blocks of ``2 * block_r`` in-features (default: the
    whole row), the block's even in-features first, then its odd ones: a K step of the GEMM is one contiguous block.
    ``group_size``: a power of two >= 2 dividing K; ``block_r``: a power of two dividing ``group_size / 2``.
    ``sums_by_group``: ``xsum`` as (K / group_size, M) instead, a group's sums contiguous (the Gluon kernel's loads)."""
    m, k = x2.shape
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x2.device)
    groups = k // group_size
    xsum = torch.empty((groups, m) if sums_by_group else (m, groups), dtype=torch.float32, device=x2.device)
    sr, sg = (1, m) if sums_by_group else (groups, 1)
    if m:
        chunk = max(group_size // 2, min(_CHUNK, next_power_of_2(k // 2)))
        r = block_r if block_r is not None else k // 2
        with on_device(x2):
            launch_plan.launch(_quantize_fp8_kernel, (m,), x2, q, scale, xsum, k, x2.stride(0), sr, sg,
                               AMAX_FLOOR=FP8_AMAX_FLOOR, GS=group_size, CHUNK=chunk, ONE_CHUNK=k <= 2 * chunk, R=r,
                               EMULATE=interpreting(), num_warps=4 if chunk <= 512 else 8)
    return q, scale, xsum


# ---------------------------------------------------------------------------------------------
# FP8 activations x 4-bit codes, group-wise scale and zero in float32.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _nibbles_fp8(b, shift, F32: tl.constexpr):
    """The nibble n of packed bytes ``b`` at bit ``shift`` (0 or 4) as the FP8 e4m3 value n * 2**-9: the nibble alone in
    a byte is that e4m3 number exactly (0..7 subnormal, 8..15 the lowest binade), so no conversion; the fold scales
    by :data:`CODE_UNIT`. (float32 n in the interpreter, unit 1.)"""
    q = (b >> shift) & 0xF
    if F32:
        return q.to(tl.float32)
    return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


CODE_UNIT = tl.constexpr(512.0)  # 1 / the e4m3 value of a lone nibble 1


@triton.jit
def _meta(s_ptr, z_ptr, xsum_ptr, g, mw, nw, N, NG, F32: tl.constexpr):
    """Group g's scales s[g, n] (times the codes' unit), s * z and the sums xsum[m, g] of its quantized x."""
    s = tl.load(s_ptr + g * N + nw).to(tl.float32)
    zs = tl.load(z_ptr + g * N + nw).to(tl.float32) * s
    if not F32:
        s = s * CODE_UNIT
    return s, zs, tl.load(xsum_ptr + mw * NG + g)


@triton.jit
def _fold(acc, acc_g, s, zs, xsum):
    """acc + s[n] * acc_g - xsum[m] * (z * s)[n]: a group's share of x . ((q - z) * s), over xq's scale."""
    return acc + acc_g * s[None, :] - xsum[:, None] * zs[None, :]


@triton.jit
def _fold_t(acc, acc_g, s, zs, xsum):
    """:func:`_fold` of a transposed (N, M) accumulator. (Two helpers, not one with a flag: Triton 3.9 reused a helper
    compiled for one value of a constexpr argument for the other.)"""
    return acc + acc_g * s[:, None] - zs[:, None] * xsum[None, :]


@triton.jit
def _w4a8_kernel(xq_ptr, xs_ptr, xsum_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                 GS: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr, SWAP: tl.constexpr,
                 PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """out = (xq @ W.T) * xs[m] (+ bias) over K steps of 2 * BLOCK_R in-features, each one FP8 dot: xq's block
    (evens, then odds) times the step's codes, whose rows k < BLOCK_R are pair row k's low nibbles and the rest the
    high ones (each packed byte row read twice, from L1/L2). SWAP computes out^T = W xq^T instead (the codes as the
    MMA's A operand, xq's K-contiguous tile as B). PAIR (a step per group, an even number of groups) issues two
    groups' dots before folding the first, so the second runs while the first is folded."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped order: GROUP_M row tiles share each weight tile while it is in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrapped indices keep every load in bounds without masks; those rows/columns are never stored
    mw = (m % M).to(tl.int64)
    nw = n % N
    NG = K // GS
    STEPS: tl.constexpr = GS // (2 * BLOCK_R)  # K steps per group
    PREC: tl.constexpr = "ieee" if F32 else None
    kk = tl.arange(0, 2 * BLOCK_R)
    row = kk % BLOCK_R  # (the step's pair row of in-feature kk of its block)
    shift = (kk // BLOCK_R) * 4
    if SWAP:
        a_ptrs = xq_ptr + mw[None, :] * K + kk[:, None]  # (2R, BM): xq^T
        b_ptrs = qw_ptr + row[None, :] * N + nw[:, None]  # (BN, 2R)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        shift = shift[None, :]
    else:
        a_ptrs = xq_ptr + mw[:, None] * K + kk[None, :]  # (BM, 2R)
        b_ptrs = qw_ptr + row[:, None] * N + nw[None, :]  # (2R, BN)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        shift = shift[:, None]
    for it in range(0, NG * STEPS, 2 if PAIR else 1):
        g = it // STEPS
        s0, zs0, xsum0 = _meta(s_ptr, z_ptr, xsum_ptr, g, mw, nw, N, NG, F32)  # (issued first: latency under the MMAs)
        a = tl.load(a_ptrs)
        w = _nibbles_fp8(tl.load(b_ptrs), shift, F32)
        if F32:
            a = a.to(tl.float32)
        if PAIR:
            s1, zs1, xsum1 = _meta(s_ptr, z_ptr, xsum_ptr, g + 1, mw, nw, N, NG, F32)
            a1 = tl.load(a_ptrs + 2 * BLOCK_R)
            w1 = _nibbles_fp8(tl.load(b_ptrs + BLOCK_R * N), shift, F32)
            if F32:
                a1 = a1.to(tl.float32)
            if SWAP:
                acc_g = tl.dot(w, a, input_precision=PREC)
                acc_g1 = tl.dot(w1, a1, input_precision=PREC)
                acc = _fold_t(acc, acc_g, s0, zs0, xsum0)
                acc = _fold_t(acc, acc_g1, s1, zs1, xsum1)
            else:
                acc_g = tl.dot(a, w, input_precision=PREC)
                acc_g1 = tl.dot(a1, w1, input_precision=PREC)
                acc = _fold(acc, acc_g, s0, zs0, xsum0)
                acc = _fold(acc, acc_g1, s1, zs1, xsum1)
        else:
            if SWAP:
                acc_g = tl.dot(w, a, acc_g if STEPS > 1 else None, input_precision=PREC)
            else:
                acc_g = tl.dot(a, w, acc_g if STEPS > 1 else None, input_precision=PREC)
            if (it + 1) % STEPS == 0:
                if SWAP:
                    acc = _fold_t(acc, acc_g, s0, zs0, xsum0)
                else:
                    acc = _fold(acc, acc_g, s0, zs0, xsum0)
                if STEPS > 1:
                    acc_g = tl.zeros_like(acc_g)
        a_ptrs += (2 if PAIR else 1) * 2 * BLOCK_R
        b_ptrs += (2 if PAIR else 1) * BLOCK_R * N
    xs = tl.load(xs_ptr + mw)
    if SWAP:
        acc = acc * xs[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nw).to(tl.float32)[:, None]
        mask = (n < N)[:, None] & (m < M)[None, :]
        tl.store(out_ptr + m[None, :].to(tl.int64) * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        acc = acc * xs[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + nw).to(tl.float32)[None, :]
        mask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


def w4a8_layout_fits(n: int, k: int, group_size: int, bits: int, axis: int, transposed: bool = False) -> bool:
    """Whether a call of this weight can run the W4A8 path: forward, 4-bit, groups along K of a power of two of at
    least :data:`MIN_GROUP` in-features (one K step never straddles two groups)."""
    return (bits == 4 and axis == 1 and not transposed and group_size >= MIN_GROUP
            and group_size & (group_size - 1) == 0 and k % group_size == 0 and n >= 1)


def w4a8_config(gluon: bool = False, m: int = 0, n: int = 0, sms: int = 0):
    """The tiles of a call of ``m`` rows of x and ``n`` of the weight on a GPU of ``sms`` SMs. ``gluon`` (Hopper with
    Gluon): the wgmma kernel (w4a8_wgmma.py; the config's ``wgmma`` flag), 128 rows of x by 64 of the weight, four MMA
    warps issuing their own TMA copies into a 4-deep ring; where those tiles would not give every SM a program (two
    run at once), 64 rows of x with a producer warp. Of the variants timed on an H100 (BENCHMARKS.md, "W4A8-FP8"),
    the fastest or within 2% of it at every shape and M = 256-4096 (a producer warp costs its warpgroup's registers:
    6% at 128 rows). Else the Triton kernel: 128 rows of x by 64 of the weight, K steps of 128, 4 warps, 3 stages,
    the fastest of its variants or within 4% of it."""
    from .configs import KernelConfig
    if gluon:
        if cdiv(m, 128) * cdiv(n, 64) <= sms:
            return KernelConfig("w4a8", block_m=64, block_n=64, block_r=64, num_warps=4, num_stages=4, wgmma=True,
                                producer=True)
        return KernelConfig("w4a8", block_m=128, block_n=64, block_r=64, num_warps=4, num_stages=4, wgmma=True)
    return KernelConfig("w4a8", block_m=128, block_n=64, block_r=64, num_warps=4, num_stages=3)


def w4a8_matmul(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, *, n: int, k: int, group_size: int, cfg) -> torch.Tensor:
    """``out`` (M, N) = ``x2 @ W.T (+ bias)`` with x2 quantized per token to FP8 (:func:`quantize_activations_fp8`)
    and the packed 4-bit W (groups along K, :func:`w4a8_layout_fits`); ``cfg`` a ``w4a8`` KernelConfig (``wgmma``:
    the Gluon kernel, where the tensors fit its TMA copies, else the Triton one)."""
    m = x2.shape[0]
    if m == 0:
        return out
    interp = interpreting()
    if cfg.wgmma:
        if not interp and x2.is_cuda and w4a8_wgmma_fits(x2, qweight, scales, zeros, n, k, group_size):
            bk = block_k(group_size)
            xq, xs, xsum = quantize_activations_fp8(x2, bk, bk // 2, sums_by_group=True)
            return w4a8_wgmma_matmul(xq, xs, xsum, qweight, scales, zeros, bias, out, n=n, k=k, group_size=group_size,
                                     block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.num_stages,
                                     producer=cfg.producer)
        cfg = w4a8_config()  # (tensors its TMA copies cannot take: the Triton kernel's own tiles)
    bm, bn = (16, 32) if interp else (cfg.block_m, cfg.block_n)  # (the interpreter: small tiles, several per call)
    block_r = min(cfg.block_r, group_size // 2)
    xq, xs, xsum = quantize_activations_fp8(x2, group_size, block_r)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    with on_device(x2):
        launch_plan.launch(_w4a8_kernel, grid, xq, xs, xsum, qweight, scales, zeros,
                           bias if bias is not None else out, out, m, n, k, out.stride(0), GS=group_size, HAS_BIAS=bias is not None, F32=interp, SWAP=cfg.swap,
                           PAIR=cfg.pair and block_r * 2 == group_size and (k // group_size) % 2 == 0, BLOCK_M=bm,
                           BLOCK_N=bn, BLOCK_R=block_r, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages)
    return out
