"""Standalone Triton dequantization of a packed weight to the dense (N, K) matrix, and the
packed-tile helpers the mixed-matmul kernels share.

Every kernel walks the packed weight by *pair rows*: pair row ``r`` holds in-features
``k = 2r`` (``lo``) and ``k = 2r + 1`` (``hi``). For 4-bit that is one byte row of ``qweight``
(low and high nibble); for 8-bit, two consecutive byte rows. Splitting K into even and odd halves
this way means the matmul kernels never interleave nibbles in registers: the even columns of ``x``
multiply ``lo`` and the odd columns multiply ``hi``.
"""
from __future__ import annotations

import contextlib

import os

import torch
import triton
import triton.language as tl

from .. import reference
from ..format import SUPPORTED_BITS, PackedWeight


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Uninitialized output and workspace allocation of every kernel launcher (tests swap this for a NaN-filled
    one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function in Triton 3.6: about 10 us a call there,
    several per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), on the host (as ``cdiv``)."""
    return 1 << max(0, n - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def on_device(t: torch.Tensor):
    """Context making ``t``'s GPU the current device: Triton launches on the current device, which
    is not the tensors' own when a model is spread over several GPUs. (Nothing to enter when it already is:
    entering and leaving ``torch.cuda.device`` costs about 2 us a call on an H200 host, the check a fifth of that.)"""
    if not t.is_cuda:
        return _NO_CONTEXT
    index = t.get_device()
    return _NO_CONTEXT if index == torch.cuda.current_device() else torch.cuda.device(index)


_NO_CONTEXT = contextlib.nullcontext()  # (stateless: one instance serves every call)


def infer_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
                 axis: int | None) -> tuple[int, int, int]:
    """Check the packed tensors; return (N, K, axis). ``axis=None`` is read off the scales' shape
    ((K/g, N) is axis 1, (K, N/g) is axis 0; the two cannot coincide since g >= 2)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError("qweight: expected a 2-D torch.uint8 tensor in quantpack's packed layout")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} must be an integer >= 2")
    n = qweight.shape[1]
    k = qweight.shape[0] * 2 if bits == 4 else qweight.shape[0]
    if not isinstance(scales, torch.Tensor) or not isinstance(zeros, torch.Tensor):
        raise ValueError("scales/zeros: expected tensors")
    if scales.shape != zeros.shape:
        raise ValueError(f"zeros: shape {tuple(zeros.shape)} differs from scales {tuple(scales.shape)}")
    shapes = {1: (k // group_size, n), 0: (k, n // group_size)}
    divides = {1: k % group_size == 0, 0: n % group_size == 0}
    if axis is None:
        matching = [a for a in (1, 0) if divides[a] and tuple(scales.shape) == shapes[a]]
        if not matching:
            raise ValueError(f"scales: shape {tuple(scales.shape)} matches neither axis 1 {shapes[1]} nor axis 0 "
                             f"{shapes[0]} for N={n} K={k} group_size={group_size}; check group_size and bits")
        axis = matching[0]
    if axis not in (0, 1):
        raise ValueError(f"axis={axis!r} is not supported; use 1 (groups along K) or 0 (groups along N)")
    if not divides[axis]:
        raise ValueError(f"group_size={group_size} does not divide {'K' if axis == 1 else 'N'}="
                         f"{k if axis == 1 else n}; pass the group size the weight was quantized with")
    if tuple(scales.shape) != shapes[axis]:
        raise ValueError(f"scales: shape {tuple(scales.shape)} does not match {shapes[axis]} for N={n} K={k} "
                         f"group_size={group_size} axis={axis}; check group_size, bits and axis")
    if axis == 1 and group_size % 2 and group_size != k:
        raise ValueError(f"group_size={group_size} must be even (or equal to K)")
    if not scales.is_floating_point():
        raise ValueError(f"scales: dtype {scales.dtype}, expected a floating-point dtype")
    if scales.device != qweight.device or zeros.device != qweight.device:
        raise ValueError("scales/zeros: must be on the same device as qweight")
    return n, k, axis


def meta_rowwise(axis: int, group_size: int, block_pair_rows: int) -> bool:
    """True when a tile of ``block_pair_rows`` pair rows always lies in one group (axis 1), so its
    scales and zeros are one contiguous row of N: loaded once per tile instead of per element."""
    return axis == 1 and group_size % (2 * block_pair_rows) == 0


@triton.jit
def load_pair_bytes(qw_ptr, r, n, r_mask, n_mask, N, K, BITS: tl.constexpr):
    """The packed bytes (uint8) of pair rows ``r`` x columns ``n``, as loaded: a 1-tuple (the byte tile) for 4-bit,
    the rows of k = 2r and 2r + 1 for 8-bit. Split with :func:`split_pair_rows` after the tile's other loads are
    issued (a use of the bytes that changes their layout would otherwise come before those loads)."""
    mask = r_mask[:, None] & n_mask[None, :]
    if BITS == 4:
        raw = (tl.load(qw_ptr + r[:, None] * N + n[None, :], mask=mask, other=0),)
    else:
        raw = (tl.load(qw_ptr + (2 * r)[:, None] * N + n[None, :], mask=mask, other=0),
               tl.load(qw_ptr + (2 * r + 1)[:, None] * N + n[None, :], mask=mask & ((2 * r + 1) < K)[:, None],
                       other=0))
    return raw


@triton.jit
def split_pair_rows(raw, BITS: tl.constexpr):
    """Integer values (int32) (lo, hi) for k = 2r and 2r + 1 from :func:`load_pair_bytes`."""
    if BITS == 4:
        byte = raw[0].to(tl.int32)
        lo, hi = byte & 15, byte >> 4
    else:
        lo, hi = raw[0].to(tl.int32), raw[1].to(tl.int32)
    return lo, hi


@triton.jit
def int_to_f32(q):
    """Exact int -> float32 for 0 <= q < 2**23: 2**23 as float32 has an all-zero mantissa, so OR-ing
    q into its bits gives 2**23 + q, and one exact FADD removes the 2**23. Cheaper than I2F, which
    runs at a fraction of the FP32 rate."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def load_meta(s_ptr, z_ptr, k, n, k_mask, n_mask, N, G, N_META, AXIS: tl.constexpr):
    """Scale and zero (float32) for in-features ``k`` x columns ``n``, any axis and group size."""
    mask = k_mask[:, None] & n_mask[None, :]
    if AXIS == 1:
        off = (k // G)[:, None] * N + n[None, :]
    else:
        off = k[:, None] * N_META + (n // G)[None, :]
    s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def dequant_pair_tile(qw_ptr, s_ptr, z_ptr, r, n, r_mask, n_mask, r0, N, K, G, N_META,
                      BITS: tl.constexpr, AXIS: tl.constexpr, META_ROW: tl.constexpr):
    """Dequantized float32 (lo, hi) tiles (BR, BN) for pair rows ``r`` x columns ``n``.
    With META_ROW the tile sits inside one group (axis 1): scales/zeros are one row, read once,
    and dequant is one FMA per element with -z*s precomputed."""
    raw = load_pair_bytes(qw_ptr, r, n, r_mask, n_mask, N, K, BITS)  # every load first (see _dequant_kernel)
    if META_ROW:
        g = (2 * r0) // G
        s = tl.load(s_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
    else:
        s_lo, z_lo = load_meta(s_ptr, z_ptr, 2 * r, n, r_mask, n_mask, N, G, N_META, AXIS)
        s_hi, z_hi = load_meta(s_ptr, z_ptr, 2 * r + 1, n, r_mask & ((2 * r + 1) < K), n_mask, N, G, N_META, AXIS)
    qlo, qhi = split_pair_rows(raw, BITS)
    flo = int_to_f32(qlo)
    fhi = int_to_f32(qhi)
    if META_ROW:
        mzs = -z * s
        lo = flo * s[None, :] + mzs[None, :]
        hi = fhi * s[None, :] + mzs[None, :]
    else:
        lo = (flo - z_lo) * s_lo
        hi = (fhi - z_hi) * s_hi
    return lo, hi


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, G, N_META, zero_scale, zero_zero,
                    BITS: tl.constexpr, AXIS: tl.constexpr, QUANT_ZERO: tl.constexpr, META_ROW: tl.constexpr,
                    META_COL: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    r0 = pid_r * BLOCK_R
    r = r0 + tl.arange(0, BLOCK_R)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = 2 * r < K
    n_mask = n < N
    # every load is issued before the bytes are touched: unpacked first, the bytes went through a layout change (a
    # CTA barrier) before the scale and zero loads were issued, three memory round trips in a row instead of one
    # (4-bit axis 0, 64 pair rows: 71% -> 86% of copy at 4096^2)
    raw = load_pair_bytes(qw_ptr, r, n, r_mask, n_mask, N, K, BITS)
    if META_ROW:  # axis 1, tile inside one group: one row of scales/zeros
        g = (2 * r0) // G
        s_lo = tl.load(s_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z_lo = tl.load(z_ptr + g * N + n, mask=n_mask, other=0).to(tl.float32)[None, :]
        s_hi = s_lo
        z_hi = z_lo
    elif META_COL:  # axis 0, tile columns inside one group: one scale/zero per in-feature
        gc = (pid_n * BLOCK_N) // G
        # the tile's 2 * BLOCK_R scales (and zeros) as one vector of its own, split into lo/hi after:
        # indexed by the tile's rows they would be gathered again by every thread holding a row
        kk = 2 * r0 + tl.arange(0, 2 * BLOCK_R)
        s_raw = tl.load(s_ptr + kk * N_META + gc, mask=kk < K, other=0.0)  # (both loads before either is used)
        z_raw = tl.load(z_ptr + kk * N_META + gc, mask=kk < K, other=0)
        s_lo, s_hi = tl.split(tl.reshape(s_raw.to(tl.float32), (BLOCK_R, 2)))
        z_lo, z_hi = tl.split(tl.reshape(z_raw.to(tl.float32), (BLOCK_R, 2)))
        s_lo = s_lo[:, None]
        z_lo = z_lo[:, None]
        s_hi = s_hi[:, None]
        z_hi = z_hi[:, None]
    else:
        s_lo, z_lo = load_meta(s_ptr, z_ptr, 2 * r, n, r_mask, n_mask, N, G, N_META, AXIS)
        s_hi, z_hi = load_meta(s_ptr, z_ptr, 2 * r + 1, n, r_mask & ((2 * r + 1) < K), n_mask, N, G, N_META, AXIS)
    qlo, qhi = split_pair_rows(raw, BITS)
    flo = int_to_f32(qlo)
    fhi = int_to_f32(qhi)
    if QUANT_ZERO:  # hqq quant_zero: uint8 zeros with one scalar scale and zero
        z_lo = (z_lo - zero_zero) * zero_scale
        z_hi = (z_hi - zero_zero) * zero_scale
    lo = (flo - z_lo) * s_lo
    hi = (fhi - z_hi) * s_hi
    # (BR, BN) lo/hi -> (BN, 2*BR) rows of the (N, K) output, k contiguous: one wide store per row.
    w = tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2)), (BLOCK_N, 2 * BLOCK_R))
    k = 2 * r0 + tl.arange(0, 2 * BLOCK_R)
    tl.store(out_ptr + n[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (k < K)[None, :])


# (pair rows, columns, warps) per program by (bits, axis, column block), the best of a block sweep on an H200
# at all three benchmark shapes (BENCHMARKS.md run Z; earlier sweeps: runs G and J). For axis 0 the
# column block must divide the group size so each row's scale/zero is one load (META_COL): the widest of 128,
# 64, 32, 16 that does.
DEQUANT_BLOCKS = {(4, 1, 128): (64, 128, 4), (8, 1, 128): (64, 128, 8),
                  (4, 0, 128): (64, 128, 4), (8, 0, 128): (32, 128, 8),
                  (4, 0, 64): (32, 64, 2), (8, 0, 64): (32, 64, 2)}


def _dequant_block(bits: int, axis: int, group_size: int) -> tuple[int, int, int]:
    if interpreting():
        return (32, 64, 4) if axis == 1 or group_size % 64 == 0 else (64, 16 if group_size % 32 else 32, 4)
    if axis == 1:  # fewer pair rows where a tile would straddle groups (keeps one scale/zero row per tile)
        block_r, block_n, warps = DEQUANT_BLOCKS[(bits, 1, 128)]
        while block_r > 8 and group_size % (2 * block_r):
            block_r //= 2
        return block_r, block_n, warps
    block_n = next((b for b in (128, 64, 32, 16) if group_size % b == 0), 16)
    return DEQUANT_BLOCKS.get((bits, 0, block_n), (64, block_n, 4))


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int, bits: int = 4,
               axis: int = 1, out_dtype: torch.dtype | None = None, zero_scale=None, zero_zero=None) -> torch.Tensor:
    """Dense (N, K) weight ``(q - zero) * scale`` from quantpack's packed layout.

    ``zeros`` may be uint8 (hqq's ``quant_zero``): then the real zero is
    ``(zeros - zero_zero) * zero_scale`` with scalar ``zero_scale``/``zero_zero``.
    ``out_dtype`` defaults to the scales' dtype. Runs the Triton kernel on CUDA (or on CPU under
    TRITON_INTERPRET=1) and the pure-torch reference otherwise.
    """
    quant_zero = zeros.dtype == torch.uint8 if isinstance(zeros, torch.Tensor) else False
    if quant_zero and (zero_scale is None or zero_zero is None):
        raise ValueError("zeros: uint8 (quantized) zeros need zero_scale and zero_zero")
    if not quant_zero and (zero_scale is not None or zero_zero is not None):
        raise ValueError("zero_scale/zero_zero: only meaningful with uint8 (quantized) zeros")
    if isinstance(zeros, torch.Tensor) and not quant_zero and not zeros.is_floating_point():
        raise ValueError(f"zeros: dtype {zeros.dtype}; expected a float dtype, or uint8 with zero_scale/zero_zero")
    z_for_check = zeros if not quant_zero else zeros.to(scales.dtype)
    n, k, axis = infer_layout(qweight, scales, z_for_check, group_size, bits, axis)
    out_dtype = out_dtype or scales.dtype
    zs = float(zero_scale) if quant_zero else 1.0
    zz = float(zero_zero) if quant_zero else 0.0
    if not triton_usable(qweight):
        zf = (zeros.float() - zz) * zs if quant_zero else zeros
        pw = PackedWeight(qweight, scales, zf, bits, group_size, axis, (n, k))
        return reference.dequantize(pw, out_dtype)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    out = _alloc((n, k), out_dtype, qweight.device)
    block_r, block_n, warps = _dequant_block(bits, axis, group_size)
    n_meta = scales.shape[1]
    grid = (cdiv((k + 1) // 2, block_r), cdiv(n, block_n))
    with on_device(qweight):
        _dequant_kernel[grid](qweight, scales, zeros, out, n, k, group_size, n_meta, zs, zz,
                              BITS=bits, AXIS=axis, QUANT_ZERO=quant_zero,
                              META_ROW=meta_rowwise(axis, group_size, block_r),
                              META_COL=axis == 0 and group_size % block_n == 0, BLOCK_R=block_r, BLOCK_N=block_n,
                              num_warps=warps)
    return out
