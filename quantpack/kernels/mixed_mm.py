"""Fused dequant-matmul for quantpack's packed 4/8-bit weights (forward and transposed).

``mixed_mm(x, qweight, scales, zeros, group_size=...)`` computes ``x @ W.T`` for the packed (N, K)
weight W without materializing it; ``transposed=True`` computes ``x @ W`` (the input gradient of
the forward) from the same buffer. Kernel paths, picked per (M bucket, N, K) from a tuned config
table (``configs/<gpu>.json``) so first use never autotunes:

* ``gemv``: decode (M = 1 and a few rows), groups along K. CUDA-core GEMV in ``gemv.py``:
  split-K, next step's loads issued before this step's math, nibbles turned into floats with one
  shift and one LOP3, ``words=True`` reads int32 words of 4 columns.
* ``mma``: decode (M <= 64), 4/8-bit, groups along K of a multiple of 64. Tensor-core GEMV in
  ``mma_gemv.py`` on a copy of the weight repacked once into MMA fragment order (kept per weight
  tensor while it lives; ``QUANTPACK_MMA=0`` turns the path off and saves that memory).
* ``fma``: small M, any layout (axis 0, groups narrower than a tile). CUDA-core tiles, split-K; the
  group's scale/zero are applied once per tile column (``s * sum(x q) - z s * sum(x)``).
* ``dot`` / ``dot_t``: tensor-core tiles; ``dot_t`` computes ``C^T = W x^T`` (dequantized weight
  as the A operand, the M tile as the narrow N of the MMA). ``rawq=True`` runs the MMA on the raw
  integers (OR-ed into the bits of 128.0 / 1024.0, unpacked by inline PTX) and rescales per group.
* ``dq``: dequantize into a scratch buffer, then cuBLAS; for large M where the fused kernels lose.

benchmarks/NOTES.md records what each variant measured on an H200.

Split-K partial sums go to an fp32 workspace; the last program to finish a tile (an atomic
counter, which it resets) sums them and writes the output, so one launch does it all.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass, asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary
from triton.runtime.errors import OutOfResources

from . import dequant, launch_plan
from .gemv import gemv_grid, launch_gemv
from .mma_gemv import CHUNK, MAX_M as MMA_MAX_M, launch_mma_gemv, mma_depth, mma_grid, mma_pack, mma_usable
from .wgmma_mm import HAVE_GLUON, balance_last_wave, launch_wgmma, resident_programs, wgmma_grid, wgmma_usable
from .dequant import (cdiv, dequant_pair_tile, dequantize, infer_layout, int_to_f32, interpreting, load_pair_bytes,
                      meta_rowwise, on_device, split_pair_rows, triton_usable)
from .. import reference
from ..format import PackedWeight

PATHS = ("gemv", "mma", "wgmma", "fma", "dot", "dot_t", "dq")


def _new_out(shape, dtype, device) -> torch.Tensor:
    """A launch's output, from dequant's allocator (looked up per call: tests swap it for a NaN-filled one, and a
    replayed plan allocates as the module does now)."""
    return dequant._alloc(shape, dtype, device)


def _new_workspace(shape, device, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's float32 partials and its ``tiles`` counters (zero at rest)."""
    return dequant._alloc(shape, torch.float32, device), _counter_slice(device, tiles)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration. ``block_r`` counts pair rows (2 in-features each) per K step
    (forward) or per output tile (transposed); ``split`` splits the reduction over programs. The
    ``mma`` path reads ``block_m`` as the rows of x per program (16 or less: one 16-row block; 32: two
    blocks sharing each unpacked weight fragment) and ``block_n`` as the rows of N per warp
    (:func:`mma_tiles_per_warp`). The ``wgmma`` path (Hopper) reads ``block_m`` as the rows of x per
    program (16-256), ``block_n`` as the weight rows per program (64 or 128: 4 warps per 64),
    ``block_r`` as the pair rows per K step (32 or 64) and ``num_stages`` as its TMA ring depth."""

    path: str = "dot"
    block_m: int = 16
    block_n: int = 64
    block_r: int = 32
    split: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 2  # pipeline stages (dot paths); chunks of loads in flight per warp (mma: 1-2, 0: all)
    rawq: bool = False  # dot/wgmma paths, groups along K: MMA on raw q, rescale per tile (wgmma: 4-bit, per K step)
    words: bool = False  # gemv path, N % 4 == 0: read int32 words of 4 columns (no byte extraction)
    producer: bool = False  # wgmma path: a producer warp issues the TMA copies (warp-specialized)
    k_warps: int = 1  # mma path: warps of a program splitting its K range (summed in shared memory), x num_warps

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}; use one of {PATHS}")


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _finish_tile(acc, m, c, mask, c_mask, out_ptr, stride_om, stride_oc, bias_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        b = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + c[None, :] * stride_oc, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_tile(pid, num_m, num_c, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped order: GROUP_M row tiles share each
    weight tile while it is in L2."""
    width = GROUP_M * num_c
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _split_range(pid_s, length, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """[begin, end) of the reduction range ``length`` that split ``pid_s`` of SPLIT walks in BLOCKs."""
    per_split = tl.cdiv(tl.cdiv(length, BLOCK), SPLIT) * BLOCK
    begin = pid_s * per_split
    return begin, tl.minimum(begin + per_split, length)


@triton.jit
def _finish_split(acc, pid, pid_s, m, c, mask, c_mask, M, COLS, ws_ptr, cnt_ptr, out_ptr, stride_om, stride_oc,
                  bias_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Store a finished tile; with split-K, publish the partial tile, count arrivals, and let the last
    program sum the partials, store, and reset its counter for the next launch."""
    if SPLIT == 1:
        _finish_tile(acc, m, c, mask, c_mask, out_ptr, stride_om, stride_oc, bias_ptr, HAS_BIAS)
    else:
        ws_off = m[:, None] * COLS + c[None, :]
        tl.store(ws_ptr + pid_s * M * COLS + ws_off, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros_like(acc)
            for s_i in range(SPLIT):
                total += tl.load(ws_ptr + s_i * M * COLS + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            _finish_tile(total, m, c, mask, c_mask, out_ptr, stride_om, stride_oc, bias_ptr, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")


# Unpack 4 packed bytes (8 nibbles) into q + OFFSET as 16-bit floats, two per 32-bit register:
# PRMT spreads bytes b0,b1 (b2,b3) into the two halves of a word, then one LOP3 per word computes
# (word & 0x000F000F) | MAGIC (low nibbles), and a shift + LOP3 the high nibbles. ~1 instruction
# per weight instead of extract + convert + FMA. Output element j is input byte j's nibble.
@triton.jit
def _unpack_magic(byte, MAGIC: tl.constexpr):
    """(q_lo + OFFSET, q_hi + OFFSET) as fp16 (MAGIC 0x6400) or bf16 (0x4300) from packed bytes."""
    if MAGIC == 0x6400:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 z, t0, t1, s0, s1; mov.b32 z, 0; prmt.b32 t0, $4, z, 0x4140; prmt.b32 t1, $4, z, 0x4342; " +
            "lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA; " +
            "shr.b32 s0, t0, 4; shr.b32 s1, t1, 4; " +
            "lop3.b32 $2, s0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $3, s1, 0x000F000F, 0x64006400, 0xEA; }",
            "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 z, t0, t1, s0, s1; mov.b32 z, 0; prmt.b32 t0, $4, z, 0x4140; prmt.b32 t1, $4, z, 0x4342; " +
            "lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA; " +
            "shr.b32 s0, t0, 4; shr.b32 s1, t1, 4; " +
            "lop3.b32 $2, s0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $3, s1, 0x000F000F, 0x43004300, 0xEA; }",
            "=r,=r,=r,=r,r", [byte], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _fwd_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                M, N, K, G, N_META, stride_xm, stride_xk, stride_om, stride_on,
                BITS: tl.constexpr, AXIS: tl.constexpr, META_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                PATH: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                RAWQ: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, USE_ASM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                SPLIT: tl.constexpr, GROUP_M: tl.constexpr):
    """out (M, N) = x (M, K) @ W.T. PATH 0: FMA (small M), 1: dot(x, W^T), 2: dot(W, x^T)^T."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    KH = (K + 1) // 2
    r_begin, r_end = _split_range(pid_s, KH, BLOCK_R, SPLIT)

    if PATH == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < KH
        # one contiguous (BM, 2*BR) load of x, split into even/odd in-features in registers
        kk = 2 * r0 + tl.arange(0, 2 * BLOCK_R)
        xt = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :] * stride_xk,
                     mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        x_e, x_o = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_R, 2)))
        if PATH == 0:
            # GEMV: apply the group's scale/zero once per column: s * sum(x q) - z s * sum(x)
            x_e = x_e.to(tl.float32)
            x_o = x_o.to(tl.float32)
            if META_ROW:
                raw = load_pair_bytes(qw_ptr, r, n, r_mask, n_mask, N, K, BITS)  # every load before any use
                g = (2 * r0) // G
                s = tl.load(s_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
                qlo, qhi = split_pair_rows(raw, BITS)
                if BLOCK_M == 1:  # 2-D: a reduction over rows that stays inside each thread
                    xe1 = tl.reshape(x_e, (BLOCK_R,))
                    xo1 = tl.reshape(x_o, (BLOCK_R,))
                    xq = tl.reshape(tl.sum(xe1[:, None] * int_to_f32(qlo) + xo1[:, None] * int_to_f32(qhi), axis=0),
                                    (1, BLOCK_N))
                else:
                    xq = tl.sum(x_e[:, :, None] * int_to_f32(qlo)[None, :, :]
                                + x_o[:, :, None] * int_to_f32(qhi)[None, :, :], axis=1)
                xs = tl.sum(x_e + x_o, axis=1)
                acc += xq * s[None, :] - xs[:, None] * (z * s)[None, :]
            else:
                w_lo, w_hi = dequant_pair_tile(qw_ptr, s_ptr, z_ptr, r, n, r_mask, n_mask, r0, N, K, G, N_META,
                                               BITS, AXIS, META_ROW)
                acc += tl.sum(x_e[:, :, None] * w_lo[None, :, :] + x_o[:, :, None] * w_hi[None, :, :], axis=1)
        elif RAWQ:
            # Tensor cores on the raw integers: q + OFFSET is built by OR-ing q into the bits of
            # OFFSET (bf16 128.0 / fp16 1024.0; exact), one integer op per element. The tile lies in
            # one group, so x (q + OFFSET) is rescaled once per tile column:
            #   s * d - s * (z + OFFSET) * sum(x),  d = x . (q + OFFSET)
            raw = load_pair_bytes(qw_ptr, r, n, r_mask, n_mask, N, K, BITS)  # every load before any use
            g = (2 * r0) // G
            s = tl.load(s_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            if USE_ASM and BITS == 4 and MAGIC != 0:
                blo, bhi = _unpack_magic(raw[0], MAGIC)
            else:
                qlo, qhi = split_pair_rows(raw, BITS)
                if MAGIC != 0:
                    blo = (qlo | MAGIC).to(tl.int16).to(DOT_DTYPE, bitcast=True)
                    bhi = (qhi | MAGIC).to(tl.int16).to(DOT_DTYPE, bitcast=True)
                else:
                    blo = qlo.to(DOT_DTYPE)
                    bhi = qhi.to(DOT_DTYPE)
            zc = s * (z + OFFSET)
            sx = tl.sum(x_e.to(tl.float32) + x_o.to(tl.float32), axis=1)
            x_e = x_e.to(DOT_DTYPE)
            x_o = x_o.to(DOT_DTYPE)
            if PATH == 1:
                d = tl.dot(x_e, blo, input_precision=DOT_PREC)
                d = tl.dot(x_o, bhi, d, input_precision=DOT_PREC)
                acc += d * s[None, :] - sx[:, None] * zc[None, :]
            else:
                d = tl.dot(tl.trans(blo), tl.trans(x_e), input_precision=DOT_PREC)
                d = tl.dot(tl.trans(bhi), tl.trans(x_o), d, input_precision=DOT_PREC)
                acc += d * s[:, None] - zc[:, None] * sx[None, :]
        else:
            w_lo, w_hi = dequant_pair_tile(qw_ptr, s_ptr, z_ptr, r, n, r_mask, n_mask, r0, N, K, G, N_META,
                                           BITS, AXIS, META_ROW)
            w_lo = w_lo.to(DOT_DTYPE)
            w_hi = w_hi.to(DOT_DTYPE)
            x_e = x_e.to(DOT_DTYPE)
            x_o = x_o.to(DOT_DTYPE)
            if PATH == 1:
                acc = tl.dot(x_e, w_lo, acc, input_precision=DOT_PREC)
                acc = tl.dot(x_o, w_hi, acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(tl.trans(w_lo), tl.trans(x_e), acc, input_precision=DOT_PREC)
                acc = tl.dot(tl.trans(w_hi), tl.trans(x_o), acc, input_precision=DOT_PREC)
    if PATH == 2:
        acc = tl.trans(acc)

    _finish_split(acc, pid, pid_s, m, n, m_mask[:, None] & n_mask[None, :], n_mask, M, N, ws_ptr, cnt_ptr, out_ptr,
                  stride_om, stride_on, bias_ptr, HAS_BIAS, SPLIT)


@triton.jit
def _tr_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
               M, N, K, G, N_META, stride_xm, stride_xn, stride_om, stride_ok,
               BITS: tl.constexpr, AXIS: tl.constexpr, META_ROW: tl.constexpr, SWAP: tl.constexpr,
               DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr):
    """out (M, K) = x (M, N) @ W, from the same packed buffer. The output tile is BLOCK_R pair rows
    (2*BLOCK_R in-features: even ones from lo, odd from hi); the reduction runs over N."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    KH = (K + 1) // 2
    pid_m, pid_r = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(KH, BLOCK_R), GROUP_M)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r0 = pid_r * BLOCK_R
    r = r0 + tl.arange(0, BLOCK_R)
    m_mask = m < M
    r_mask = r < KH
    n_begin, n_end = _split_range(pid_s, N, BLOCK_N, SPLIT)

    if SWAP:
        acc_e = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
        acc_o = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    else:
        acc_e = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc_o = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(n_begin, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < N
        xt = tl.load(x_ptr + m[:, None] * stride_xm + n[None, :] * stride_xn,
                     mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(DOT_DTYPE)
        w_lo, w_hi = dequant_pair_tile(qw_ptr, s_ptr, z_ptr, r, n, r_mask, n_mask, r0, N, K, G, N_META,
                                       BITS, AXIS, META_ROW)
        w_lo = w_lo.to(DOT_DTYPE)
        w_hi = w_hi.to(DOT_DTYPE)
        if SWAP:
            acc_e = tl.dot(w_lo, tl.trans(xt), acc_e, input_precision=DOT_PREC)
            acc_o = tl.dot(w_hi, tl.trans(xt), acc_o, input_precision=DOT_PREC)
        else:
            acc_e = tl.dot(xt, tl.trans(w_lo), acc_e, input_precision=DOT_PREC)
            acc_o = tl.dot(xt, tl.trans(w_hi), acc_o, input_precision=DOT_PREC)
    if SWAP:
        acc_e = tl.trans(acc_e)
        acc_o = tl.trans(acc_o)

    # (BM, BR) even and odd columns -> (BM, 2*BR) contiguous in k
    acc = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_M, 2 * BLOCK_R))
    k = 2 * r0 + tl.arange(0, 2 * BLOCK_R)
    _finish_split(acc, pid, pid_s, m, k, m_mask[:, None] & (k < K)[None, :], k < K, M, K, ws_ptr, cnt_ptr, out_ptr,
                  stride_om, stride_ok, out_ptr, False, SPLIT)


# ----------------------------------------------------------------------------------------------
# split-K arrival counters: zero at rest (the last program of each tile resets its counter). Each
# launch takes the next slice of a per-device ring, so launches on concurrent streams (or baked into
# CUDA graphs) use disjoint counters unless 1M tiles of other launches run in between.

_COUNTER_SLOTS = 1 << 20
_counters: dict = {}
_counters_lock = threading.Lock()


def _counter_slice(device: torch.device, tiles: int) -> torch.Tensor:
    """``tiles`` counters of the device's ring, starting 16-byte aligned (as Triton specializes pointers: a launch
    plan replays a kernel compiled for an aligned slice)."""
    with _counters_lock:
        state = _counters.get(str(device))
        if state is None:
            ring = _outside_graph_pools(lambda: torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device), device)
            state = _counters[str(device)] = [ring, 0]
        buf, offset = state
        if offset + tiles > _COUNTER_SLOTS:
            offset = 0
        state[1] = offset + cdiv(tiles, 4) * 4
    return buf[offset:offset + tiles]


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """The whole counter ring of ``device`` (all zeros whenever no launch is in flight)."""
    _counter_slice(device, 0)
    return _counters[str(device)][0]


def _dot_dtype(dtype: torch.dtype):
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.float32 if interpreting() else tl.bfloat16  # the interpreter's bf16 dot is wrong
    return tl.float32


# ----------------------------------------------------------------------------------------------
# configs: tuned tables shipped per GPU, heuristics otherwise

_CONFIG_DIR = Path(__file__).with_name("configs")
_tables: dict[str, dict] = {}


def m_bucket(m: int) -> int:
    """Autotune/config key for M: the next power of two, capped at 4096."""
    return min(4096, 1 << max(0, (m - 1).bit_length()))


_device_names: dict = {}


def device_key(device: torch.device | None = None) -> str:
    """Config-file stem for a device: its name in lower case, non-alphanumerics as '_'
    (``nvidia_h200``, ``nvidia_h100_80gb_hbm3``); ``interpreter`` for CPU under TRITON_INTERPRET."""
    if interpreting() and (device is None or device.type == "cpu"):
        return "interpreter"
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    key = _device_names.get(index)
    if key is None:
        name = torch.cuda.get_device_name(index)
        key = _device_names[index] = "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()
    return key


def config_key(transposed: bool, bits: int, n: int, k: int, m: int) -> str:
    return f"{'tr' if transposed else 'fwd'}|b{bits}|n{n}|k{k}|m{m_bucket(m)}"


def _capability(dev_key: str):
    if dev_key == "interpreter" or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if device_key(torch.device("cuda", index)) == dev_key:
            return list(torch.cuda.get_device_capability(index))
    return None


def tuned_cache_path(dev_key: str) -> Path:
    """Where configs autotuned on this machine (``QUANTPACK_AUTOTUNE=1``) are kept between runs:
    ``$QUANTPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantpack``, else ``~/.cache/quantpack``."""
    root = os.environ.get("QUANTPACK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "quantpack")
    return Path(root) / "configs" / f"{dev_key}.json"


def _read_configs(path: Path) -> dict:
    try:
        return {k: KernelConfig(**v) for k, v in json.loads(path.read_text())["configs"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # a missing or unreadable cache only means tuning again


def _table(dev_key: str) -> dict:
    """Config table of a device: its shipped file, else a shipped file tuned on a GPU of the same
    compute capability (e.g. an H100 PCIe or an H800 takes an H100 or H200 table: same architecture), the one
    whose name shares the longest prefix with this device's, else empty; then the configs autotuned earlier on
    this machine (:func:`tuned_cache_path`) on top. Autotuned entries are added to it in memory (and to that
    cache)."""
    table = _tables.get(dev_key)
    if table is None:
        path = _CONFIG_DIR / f"{dev_key}.json"
        if not path.is_file():
            cap = _capability(dev_key)
            same_arch = [p for p in sorted(_CONFIG_DIR.glob("*.json"))
                         if cap is not None and json.loads(p.read_text()).get("capability") == cap]
            if same_arch:  # (max keeps the first of equals: ties go to the sorted order)
                path = max(same_arch, key=lambda p: len(os.path.commonprefix([p.stem, dev_key])))
        table = {}
        if path.is_file():
            table = {k: KernelConfig(**v) for k, v in json.loads(path.read_text())["configs"].items()}
        if dev_key != "interpreter":
            table.update(_read_configs(tuned_cache_path(dev_key)))
        _tables[dev_key] = table
    return table


_table_changes = 0  # configs added by _remember since import (part of a launch plan's key)


def _remember(dev_key: str, key: str, cfg: KernelConfig) -> None:
    """Add an autotuned config to the in-memory table and to this machine's cache file (merged with
    what other processes wrote, replaced atomically; a cache that cannot be written is skipped)."""
    global _table_changes
    _table(dev_key)[key] = cfg
    _table_changes += 1
    if dev_key == "interpreter":
        return
    path = tuned_cache_path(dev_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        configs = {k: asdict(v) for k, v in _read_configs(path).items()}
        configs[key] = asdict(cfg)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"device": dev_key, "configs": dict(sorted(configs.items()))}, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass


def _nearest(table: dict, transposed: bool, bits: int, n: int, k: int, m: int) -> KernelConfig | None:
    """The tuned config closest in (M bucket, N, K) (log distance, M weighted most) with the same
    direction and bits and an M bucket at most 4x away (a decode config says nothing about a batch of 4096,
    where the heuristic knows more); ``None`` if the table has none."""
    want = config_key(transposed, bits, n, k, m).split("|")
    best, best_d = None, math.inf
    for key, cfg in table.items():
        parts = key.split("|")
        dm = abs(math.log2(int(parts[4][1:]) / m_bucket(m)))
        if parts[0] != want[0] or parts[1] != want[1] or dm > 2:
            continue
        d = 4 * dm + abs(math.log2(int(parts[2][1:]) / n)) + abs(math.log2(int(parts[3][1:]) / k))
        if d < best_d:
            best, best_d = cfg, d
    return best


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fill_split(tiles: int, reduce_steps: int, sms: int, waves: float = 2.0) -> int:
    """Smallest power-of-two split that gives about ``waves`` programs per SM (bounded by the work)."""
    split = 1
    while tiles * split < waves * sms and split * 2 <= reduce_steps and split < 64:
        split *= 2
    return split


def gemv_config(m: int, n: int, k: int, device: torch.device) -> KernelConfig:
    """The CUDA-core GEMV as tuning picked it on an H200 at M = 1: 1-warp programs, ~8 per SM."""
    return KernelConfig(path="gemv", block_m=1, block_n=128, block_r=32, num_warps=1, words=n % 4 == 0,
                        split=_fill_split(m * cdiv(n, 128), cdiv((k + 1) // 2, 32), _num_sms(device),
                                          8.0))


def heuristic_config(transposed: bool, m: int, n: int, k: int, device: torch.device, wgmma: bool = True
                     ) -> KernelConfig:
    """A config without tuning, following what tuning chose on an H200 (benchmarks/NOTES.md): the
    tensor-core GEMV for M <= 16 (the CUDA-core one where its layout needs are not met; tuned tables
    take it up to M = 64), split
    tensor-core tiles up to M = 64, dequantize + cuBLAS beyond (the fused large-M kernels lost to
    it by 2-10x there); on Hopper (``wgmma``) the asynchronous warpgroup-MMA kernel, with its producer warp,
    for 17-4096 rows."""
    sms = _num_sms(device)
    kh = (k + 1) // 2
    if wgmma and not transposed and 16 < m <= WGMMA_MAX_M and wgmma_device(device):
        # the shapes of the H200 table (benchmarks/NOTES.md v11): one 64-row weight tile per program
        # up to 256 rows of x, split until the tiles fill the GPU
        bm = min(256, max(32, m_bucket(m)))
        bn = 64 if bm <= 128 else 128
        tiles = cdiv(m, bm) * cdiv(n, bn)
        return KernelConfig("wgmma", block_m=bm, block_n=bn, block_r=64 if bm <= 128 else 32, num_warps=bn // 16,
                            num_stages=4, split=min(4, _fill_split(tiles, max(1, k // 128), sms, 1.0)),
                            producer=True)
    if m > 64 and device.type == "cuda":
        return KernelConfig(path="dq")
    if m <= 16 and not transposed:
        # 2-warp programs, ~8 per SM (mma_grid rounds the split to a divisor of the group count)
        return KernelConfig(path="mma", block_m=max(8, m_bucket(m)), block_n=16, num_warps=2, num_stages=2,
                            split=_fill_split(max(1, n // 32), max(1, k // 64), sms, 8.0))
    if transposed:
        bm = 16 if m <= 16 else (64 if m <= 64 else 128)
        cfg = KernelConfig(path="dot", block_m=bm, block_n=64, block_r=64 if m > 64 else 32,
                           num_warps=8 if m > 64 else 4, num_stages=3)
        tiles = cdiv(m, bm) * cdiv(kh, cfg.block_r)
        reduce_steps = cdiv(n, cfg.block_n)
    elif m <= 64:
        cfg = KernelConfig(path="dot", block_m=max(16, m_bucket(m)), block_n=64, block_r=64, num_warps=4,
                           num_stages=3)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, 64)
        reduce_steps = cdiv(kh, 64)
    else:
        cfg = KernelConfig(path="dot", block_m=128, block_n=128, block_r=32, num_warps=8, num_stages=3)
        tiles = cdiv(m, 128) * cdiv(n, 128)
        reduce_steps = cdiv(kh, 32)
    return replace(cfg, split=_fill_split(tiles, reduce_steps, sms, 8.0 if m <= 8 else 2.0))


def candidate_configs(transposed: bool, m: int, n: int, k: int, device: torch.device, bits: int = 4
                      ) -> list[KernelConfig]:
    """The search space the autotuner times for one (direction, M bucket, N, K, bits)."""
    sms = _num_sms(device)
    kh = (k + 1) // 2
    mb = m_bucket(m)
    out = [KernelConfig("dq")]

    def add(cfg: KernelConfig, waves=(1.0, 2.0, 4.0)):
        if transposed:
            tiles = cdiv(m, cfg.block_m) * cdiv(kh, cfg.block_r)
            steps = cdiv(n, cfg.block_n)
        else:
            tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
            steps = cdiv(kh, cfg.block_r)
        for w in waves:
            c = replace(cfg, split=_fill_split(tiles, steps, sms, w))
            if c not in out:
                out.append(c)

    if transposed:
        bms = (16,) if mb <= 16 else ((32, 64) if mb <= 64 else (64, 128))
        for path in ("dot", "dot_t"):
            for bm in bms:
                for bn, br, warps, stages in ((64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3),
                                              (32, 64, 4, 4)):
                    add(KernelConfig(path, bm, bn, br, num_warps=warps, num_stages=stages),
                        waves=(1.0, 2.0) if mb <= 64 else (1.0,))
        return out
    if mb <= 8:
        # gemv: programs are (column tile, K range) per row of x; the sweep in benchmarks/NOTES.md (v4)
        # found 1-2 warp programs at 8-16 programs per SM best on an H200
        for bn, br, warps in ((64, 32, 1), (128, 32, 1), (128, 16, 1), (256, 32, 2), (128, 32, 2), (256, 16, 1)):
            for words in (False, True):
                gcfg = KernelConfig("gemv", 1, bn, br, num_warps=warps, num_stages=1, words=words)
                for w in (4.0, 8.0, 16.0):
                    c = replace(gcfg, split=_fill_split(m * cdiv(n, bn), cdiv(kh, br), sms, w))
                    if c not in out:
                        out.append(c)
        for bn, br, warps in ((64, 64, 2), (128, 64, 4), (32, 64, 1)):
            add(KernelConfig("fma", mb, bn, br, num_warps=warps, num_stages=2), waves=(2.0, 4.0, 16.0))
        for bn, br, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3)):
            add(KernelConfig("dot_t", 16, bn, br, num_warps=warps, num_stages=stages, rawq=True),
                waves=(2.0, 4.0, 8.0))
    if mb <= MMA_MAX_M:
        # tensor-core GEMV (mma_grid rounds the split down to a divisor of the group count)
        # (depth 3 and split 32 never won on an H200, benchmarks/NOTES.md v7; depth 3 was removed)
        # (8-bit: one tile per warp, its two nibble planes always rawq; warps splitting a tile's K range
        # and summing in shared memory measured no faster, benchmarks/NOTES.md v8)
        # (block_m: rows of x per program; two 16-row blocks of x in one program always subtract the zeros
        # in A; four measured 1.4-1.8x slower, benchmarks/NOTES.md v9)
        # (rows of N per warp: 16 or 32; four tiles per warp (64), half of x's reads per weight byte, measured
        # 9-22% slower at M = 32..64 on an H200: 255 registers, so 8 warps per SM; benchmarks/NOTES.md v10)
        for x_rows in (min(16, max(8, mb)),) + ((32,) if mb >= 32 and bits == 4 else ()):
            for rows in (16, 32) if bits == 4 else (16,):
                for warps in (1, 2, 4):
                    # (beyond 16 rows there are 2-4x the programs along M, and split-K's float32 partials,
                    # split x M x N x 4 bytes written and read again, rival the weight: fewer splits)
                    for split in (4, 8, 16) if mb <= 16 else (1, 2, 4, 8):
                        # (depth 0: every load of a program issued up front, for programs of at most
                        # PRELOAD_CHUNKS chunks; benchmarks/NOTES.md v25)
                        # (the tables are tuned at group size 128)
                        preload = mb <= 8 and _mma_preloads(n, k, warps, split, rows, bits)
                        for depth in (0, 1, 2) if preload else (1, 2):
                            for rawq in (False, True) if bits == 4 and x_rows <= 16 else (bits == 8,):
                                c = KernelConfig("mma", x_rows, rows, num_warps=warps, split=split,
                                                 num_stages=depth, rawq=rawq)
                                if c not in out:
                                    out.append(c)
        if mb <= 16 and n % 16 == 0 and k % 128 == 0:
            # warps of one program splitting K, summed in shared memory instead of a second pass through L2
            # (latency-bound weights up to 4096^2; benchmarks/NOTES.md v26, v28): one 16-row tile per warp slot
            # (8-bit: its two nibble planes, rawq); (two or four tiles per warp, and 32-row programs for
            # M = 32..64, measured slower on an H200: v29)
            for kwarps, warps, split in itertools.product((2, 4, 8), (1, 2), (1, 2, 4)):
                if kwarps * warps > 8:
                    continue
                preload = mb <= 8 and _mma_preloads(n, k, warps, split, 16, bits, kwarps)
                for depth in (0, 2) if preload else (2,):
                    for rawq in (False, True) if bits == 4 else (True,):
                        c = KernelConfig("mma", min(16, max(8, mb)), 16, num_warps=warps, split=split,
                                         num_stages=depth, rawq=rawq, k_warps=kwarps)
                        if c not in out:
                            out.append(c)
    if 8 < mb <= 64 or mb == 8:
        for bn, br, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3),
                                      (128, 32, 4, 4)):
            for rawq in (False, True):
                add(KernelConfig("dot_t", max(16, mb), bn, br, num_warps=warps, num_stages=stages, rawq=rawq),
                    waves=(1.0, 2.0, 4.0))
        for rawq in (False, True):
            add(KernelConfig("dot", max(16, mb), 64, 64, num_warps=4, num_stages=3, rawq=rawq), waves=(2.0, 4.0))
    if 16 <= mb <= WGMMA_MAX_M and wgmma_device(device):
        # Hopper: (rows of x, weight rows, pair rows per K step) per program, ring depth, split
        for bm in sorted({min(bm, max(16, mb)) for bm in (64, 128, 256)}):
            for bn in (64, 128):
                for br in (32, 64):
                    for stages in (3, 4):
                        if bm * 4 * br * stages > 200 * 1024:  # x's ring alone past shared memory
                            continue
                        for split, producer in itertools.product((1, 2, 4), (False, True)):
                            c = KernelConfig("wgmma", bm, bn, br, split=split, num_warps=bn // 16, num_stages=stages,
                                             producer=producer)
                            if c not in out:
                                out.append(c)
    if mb <= 32 and bits == 4 and wgmma_device(device):
        # Hopper, few rows: the raw weights' MMA, scales and zeros applied per K step (9 instead of 24 instructions
        # per 8 weights; benchmarks/NOTES.md v18), with its producer warp; from one row of x (a 16-row tile)
        for bm, bn, br, split in itertools.product(sorted({16, min(32, max(16, mb))}), (64, 128), (32, 64),
                                                   (1, 2, 4, 8)):
            c = KernelConfig("wgmma", bm, bn, br, split=split, num_warps=bn // 16, num_stages=4, producer=True,
                             rawq=True)
            if c not in out:
                out.append(c)
    if mb > 64:
        for path, bm, bn, br, warps, stages in (("dot", 64, 128, 32, 4, 4), ("dot", 128, 128, 32, 8, 3),
                                                ("dot", 128, 256, 32, 8, 3), ("dot", 128, 128, 64, 8, 3),
                                                ("dot", 256, 128, 32, 8, 3), ("dot", 64, 256, 32, 8, 3),
                                                ("dot_t", 128, 128, 32, 8, 3), ("dot_t", 64, 256, 32, 8, 3)):
            add(KernelConfig(path, bm, bn, br, num_warps=warps, num_stages=stages),
                waves=(1.0,) if mb >= 1024 else (1.0, 2.0))
        if mb <= 256:
            for path, bm, bn in (("dot", 64, 128), ("dot", 128, 128), ("dot_t", 64, 128), ("dot_t", 128, 128)):
                add(KernelConfig(path, bm, bn, 64, num_warps=8 if bm == 128 else 4, num_stages=3, rawq=True),
                    waves=(1.0, 2.0))
    return out


def _mma_preloads(n: int, k: int, warps: int, split: int, rows: int, bits: int, kwarps: int = 1) -> bool:
    """Whether an ``mma`` grid at group size 128 (the tables') runs depth 0 (its warps' K ranges short enough)."""
    if n % 16 or n < 16 or k % 128:
        return False
    grid = mma_grid(n, k, 128, warps, split, max(1, rows // 16), bits, 1, kwarps)
    return mma_depth(grid, 128, 0) == 0


def pick_config(transposed: bool, bits: int, m: int, n: int, k: int, device: torch.device) -> KernelConfig:
    """Tuned config for this key if shipped (or autotuned in this process), else the nearest tuned
    one, else the heuristic. Never times anything unless QUANTPACK_AUTOTUNE=1."""
    table = _table(device_key(device))
    cfg = table.get(config_key(transposed, bits, n, k, m))
    if cfg is None:
        cfg = _nearest(table, transposed, bits, n, k, m)
        cfg = _smaller_tiles(cfg, m, n, _num_sms(device)) if cfg else heuristic_config(transposed, m, n, k, device)
    return cfg


def _smaller_tiles(cfg: KernelConfig, m: int, n: int, sms: int) -> KernelConfig:
    """A ``wgmma`` config borrowed from another shape (:func:`_nearest`) whose tiles leave more than half the SMs
    idle on this one, with smaller tiles: 64 weight rows instead of 128, then 128 rows of x instead of 256, while
    its programs number under half the SMs. Its split is kept: raising it measured up to 1.7x slower at K = 2048-3072
    (benchmarks/NOTES.md v31). On an H100 this took 1024 x 8192 at M = 1024 from 75.6 to 33.2 us (the tuned pick)
    and 2048^2 at M = 1024 from 23.1 to 15.9; where the borrowed tiles filled half the SMs, shrinking them measured
    slower, and is not done."""
    if cfg.path != "wgmma" or cfg.rawq:
        return cfg

    def programs(c):
        return cdiv(m, c.block_m) * cdiv(n, c.block_n) * c.split

    if programs(cfg) < sms // 2 and cfg.block_n > 64:
        cfg = replace(cfg, block_n=64, num_warps=4)
    if programs(cfg) < sms // 2 and cfg.block_m > 128:  # (x's ring: 128-row tiles take 64 pair rows per K step)
        cfg = replace(cfg, block_m=128, block_r=64)
    return cfg


RETIME_TOP = 4  # the sweep's fastest, which the autotuner times again
TUNE_MAX_ERR = 1e-2  # relative error above which the autotuner drops a candidate (the kernels measure 1.6-2.5e-3)


def tunes_on_first_use(x2: torch.Tensor, transposed: bool, bits: int, n: int, k: int) -> bool:
    """Whether a call with ``x2`` autotunes its key first: ``QUANTPACK_AUTOTUNE=1``, on a GPU, outside CUDA-graph
    capture, and the table (shipped, cached or tuned in this process) lacks the key. (Every untuned call asks:
    the switch is read first, from the dict behind os.environ, and the key built only when it is on.)"""
    if not (x2.is_cuda and _plan_env()[_AUTOTUNE_ENV] in ("1", b"1")):
        return False
    return (not torch.cuda.is_current_stream_capturing()
            and config_key(transposed, bits, n, k, x2.shape[0]) not in _table(device_key(x2.device)))


def reference_product(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, n: int,
                      k: int, axis: int, group_size: int, bits: int, transposed: bool = False) -> torch.Tensor:
    """``x2 @ W.T`` (``x2 @ W`` transposed) in float32 from the reference dequantization: what the tuner checks
    each candidate against."""
    w = reference.dequantize(PackedWeight(qweight, scales, zeros, bits, group_size, axis, (n, k)), torch.float32)
    return x2.float() @ (w if transposed else w.t())


def autotune(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
             bits: int = 4, transposed: bool = False, candidates: list[KernelConfig] | None = None,
             weight_copies: int | None = None, rep_ms: int = 40) -> tuple[KernelConfig, dict]:
    """Time the candidate configs on this input (CUDA graph replay over ``weight_copies`` copies of
    the weight so repeated runs do not read it from L2; default :func:`copies_past_l2`), store the
    fastest under its M-bucketed key for this process and in this machine's cache
    (:func:`tuned_cache_path`, so later runs do not tune again), and return it with all timings
    (microseconds). Each candidate's output is first checked against the float32 reference product: one
    off by more than ``TUNE_MAX_ERR`` (a compiler that miscompiles a variant) is never timed (``inf``).
    The fastest ``RETIME_TOP`` of the sweep are timed again twice, in order and in reverse; their mean
    times decide."""
    n, k, axis = infer_layout(qweight, scales, zeros, group_size, bits, None)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    want = reference_product(x2, qweight, scales, zeros, n=n, k=k, axis=axis, group_size=group_size, bits=bits,
                             transposed=transposed)
    candidates = candidates or candidate_configs(transposed, m, n, k, x.device, bits)
    if not (mma_enabled() and mma_usable(x2, n, k, group_size, bits, axis)):
        candidates = [c for c in candidates if c.path != "mma"]  # (it would time the fallback under its name)

    def run(cfg, copy):
        return mixed_mm(x2, *copy, group_size=group_size, bits=bits, transposed=transposed, config=cfg)

    return _tune((transposed, bits, n, k, m), x.device, candidates, run, (qweight, scales, zeros), weight_copies, want,
                 rep_ms)


def autotune_mma(x: torch.Tensor, mma_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 want: torch.Tensor, *, group_size: int, bits: int = 4, weight_copies: int | None = None,
                 rep_ms: int = 40) -> tuple[KernelConfig, dict]:
    """:func:`autotune` for a weight that exists only in the ``mma`` layout (merged_mm.py's stacked projections),
    over the ``mma`` candidates: ``want`` is the float32 product every candidate is checked against (the caller
    has the members' checkpoint-layout weights). The pick is stored under the stacked shape's key."""
    n, k = scales.shape[1], mma_weight.shape[1] * CHUNK
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    candidates = [_fix_config(c, False, m, 1, group_size) for c in candidate_configs(False, m, n, k, x.device, bits)
                  if c.path == "mma"]

    def run(cfg, copy):
        with on_device(x2):
            return _launch(x2, None, copy[1], copy[2], None, n, k, 1, group_size, bits, False, x2.dtype, cfg, copy[0])

    return _tune((False, bits, n, k, m), x.device, list(dict.fromkeys(candidates)), run, (mma_weight, scales, zeros),
                 weight_copies, want, rep_ms)


def copies_past_l2(tensors: tuple, device: torch.device, limit: int = 16) -> int:
    """How many copies of a weight's tensors the tuner cycles through so that together they exceed 4x the GPU's L2
    (as the benchmarks time): in a model, each layer's weight comes from HBM, since the other layers' weights
    evict it, so a config timed on an L2-resident weight is timed for the wrong regime (a 4096^2 4-bit weight is
    8 MB of an H100's 50 MB). At most ``limit``; 1 off a GPU."""
    if device.type != "cuda":
        return 1
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(limit, -(-4 * l2 // max(1, nbytes))))


def _tune(fields: tuple, device: torch.device, candidates: list[KernelConfig], run, tensors: tuple,
          weight_copies: int | None, want: torch.Tensor, rep_ms: int) -> tuple[KernelConfig, dict]:
    """The sweep behind :func:`autotune` and :func:`autotune_mma`: ``run(config, copy)`` computes the product with
    ``tensors`` or one of their ``weight_copies - 1`` clones; each config is checked against ``want`` on its first run,
    timed, the fastest timed again, and the winner stored under the key of ``fields`` (transposed, bits, N, K, M)."""
    from triton.testing import do_bench

    key = config_key(*fields)
    if weight_copies is None:
        weight_copies = copies_past_l2(tensors, device)
    copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(weight_copies - 1)]
    checked = set()
    verbose = os.environ.get("QUANTPACK_TUNE_VERBOSE")

    def time_config(cfg) -> float:
        try:
            if cfg not in checked:
                out = run(cfg, copies[0]).reshape(want.shape).float()
                err = ((out - want).norm() / want.norm().clamp_min(1e-30)).item()
                if not err <= TUNE_MAX_ERR:  # (NaN too)
                    if verbose:
                        print("config dropped", cfg, f"relative error {err:.2e}")
                    return math.inf
                checked.add(cfg)

            def calls():
                for copy in copies:
                    run(cfg, copy)
            calls()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            return do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3 / len(copies)
        except Exception as exc:  # a config that does not compile or fit (shared memory) is skipped
            torch.cuda.synchronize()
            if verbose:
                print("config failed", cfg, repr(exc)[:200])
            return math.inf

    times = {cfg: time_config(cfg) for cfg in candidates}
    # the clock drifts over a long sweep (heat, power), which favours whichever ran early: the fastest few
    # are timed again back to back, in order and then in reverse (a linear drift then weighs them alike),
    # and the best of them by their mean time wins
    top = [cfg for cfg in sorted(times, key=times.get)[:RETIME_TOP] if times[cfg] < math.inf]
    if not top:
        warnings.warn(f"quantpack autotune: none of {len(times)} configs for {key} ran and matched the reference; "
                      "nothing stored, the table's or the heuristic pick stays")
        transposed, bits, n, k, m = fields
        return pick_config(transposed, bits, m, n, k, device), times
    again = {cfg: [] for cfg in top}
    for cfg in top + top[::-1]:
        again[cfg].append(time_config(cfg))
    times.update({cfg: sum(t) / len(t) for cfg, t in again.items()})
    best = min(top, key=times.get)
    _remember(device_key(device), key, best)
    return best, times


def save_table(path: str | os.PathLike, device: torch.device | None = None) -> None:
    """Write this process's config table (shipped plus autotuned) as JSON, atomically."""
    dev_key = device_key(device)
    data = {"device": dev_key, "capability": _capability(dev_key),
            "configs": {k: asdict(v) for k, v in sorted(_table(dev_key).items())}}
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------
# mma path: decode-ordered copies of 4-bit weights, built on first use of each weight tensor

_mma_copies = WeakIdKeyDictionary()  # qweight -> (its version, its mma_pack copy), dropped with qweight
_mma_working: dict = {}  # device -> whether the compiled kernel passed its first-use check


def mma_tiles_per_warp(cfg: KernelConfig) -> int:
    """The mma path's ``block_n`` is the rows of N per warp: 32 or 64 mean two or four 16-row tiles
    sharing x's fragments, anything else one tile."""
    return {32: 2, 64: 4}.get(cfg.block_n, 1)


def mma_blocks(cfg: KernelConfig) -> int:
    """The mma path's 16-row blocks of x per program, from ``block_m`` (the rows of x it covers)."""
    return max(1, cfg.block_m // 16)


def mma_enabled() -> bool:
    return os.environ.get("QUANTPACK_MMA", "1") != "0"


WGMMA_MAX_M = 4096  # rows of x up to which Hopper may run the wgmma kernel (the tuner still times dq + cuBLAS too)


def wgmma_device(device: torch.device) -> bool:
    """Whether ``device`` can run the wgmma kernel: a Hopper GPU (9.x), Gluon in this Triton, and not
    turned off with QUANTPACK_WGMMA=0."""
    return (HAVE_GLUON and device.type == "cuda" and not interpreting()
            and os.environ.get("QUANTPACK_WGMMA", "1") != "0"
            and _major(device.index if device.index is not None else torch.cuda.current_device()) == 9)


PDL_MAX_M = 8  # rows of x up to which the mma path may launch with PDL (H200: M = 16 measured up to 10% slower)


def pdl_enabled(device: torch.device) -> bool:
    """Whether decode kernels launch with programmatic dependent launch (Hopper and later): each starts
    while the kernel before it finishes, waiting only before it reads anything another kernel may write.
    Off unless QUANTPACK_PDL=1: on an H200 it made back-to-back M = 1 calls 8-17% faster, but M = 4/8
    and 8-bit 4096^2 calls 3-9% slower and 8B-shaped graph decode no faster (benchmarks/NOTES.md v10)."""
    return (device.type == "cuda" and not interpreting() and os.environ.get("QUANTPACK_PDL", "0") == "1"
            and _major(device.index if device.index is not None else torch.cuda.current_device()) >= 9)


@functools.cache
def _major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)[0]


def _mma_self_check(device: torch.device) -> bool:
    """Run the mma kernel once on a small problem against the reference. Its correctness rests on
    Triton giving each lane one row of a (32 * warps, 4) tensor (true of every Triton it was tested
    with); if a compiler lays it out otherwise the path is switched off instead of computing garbage."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ok = _mma_working.get(str(device))
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        n, k, gs = 64, 256, 128
        s = (torch.rand(k // gs, n, device=device, generator=g) * 0.1 + 0.01).to(torch.bfloat16)
        x = torch.randn(MMA_MAX_M, k, device=device, generator=g).to(torch.bfloat16)
        out = torch.empty(MMA_MAX_M, n, dtype=torch.float32, device=device)
        try:
            ok = True
            # one and two 8-row halves of x, programs of one and of two 16-row blocks, one, two and four tiles
            # per warp, both ways of applying the zeros, 8-bit planes
            for bits, m, nt, rawq, blocks in ((4, 3, 1, True, 1), (4, 40, 2, True, 1), (4, 16, 2, False, 1),
                                              (4, 20, 4, True, 1), (4, 64, 4, False, 1),
                                              (4, MMA_MAX_M, 2, False, 2), (8, MMA_MAX_M, 1, True, 1)):
                qw = torch.randint(0, 256, (k * bits // 8, n), device=device, dtype=torch.uint8, generator=g)
                z = (torch.rand(k // gs, n, device=device, generator=g) * (2 ** bits - 1)).to(torch.bfloat16)
                w = reference.dequantize(PackedWeight(qw, s, z, bits, gs, 1, (n, k)), torch.float32)
                want = x[:m].float() @ w.t()
                grid = mma_grid(n, k, gs, 2, 1, nt, bits, blocks)
                launch_mma_gemv(x[:m], mma_pack(qw, n, k, bits), s, z, None, out, out, out, n=n, k=k, group_size=gs,
                                grid=grid, depth=2, rawq=rawq, use_asm=not interpreting(), bits=bits)
                ok &= bool(((out[:m] - want).norm() / want.norm()).item() < 1e-2)
        except Exception:  # noqa: BLE001  (a compiler that rejects the inline PTX: same outcome)
            ok = False
        if not ok:
            warnings.warn("quantpack: the tensor-core decode kernel (mma path) failed its self-check with this "
                          "Triton; decode falls back to the CUDA-core gemv path", RuntimeWarning, stacklevel=3)
        _mma_working[str(device)] = ok
    return ok


def _mma_weight(qweight: torch.Tensor, n: int, k: int, bits: int = 4) -> tuple[torch.Tensor | None, bool]:
    """The :func:`mma_pack` copy of ``qweight``, built on first use and kept while ``qweight`` lives
    (rebuilt if it is modified in place), and whether this call built it (then the kernels that wrote
    it may still be running: the launch that reads it must not use PDL); ``None`` where it cannot be
    used now: during CUDA-graph capture before it exists, or if the kernel failed its self-check."""
    try:
        version = qweight._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter (nor can it change outside one)
        version = -1
    hit = _mma_copies.get(qweight)
    if hit is not None and hit[0] == version:
        return hit[1], False
    if qweight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, False
    if not _mma_self_check(qweight.device):
        return None, False
    packed = _outside_graph_pools(lambda: mma_pack(qweight, n, k, bits), qweight.device)
    _mma_copies[qweight] = (version, packed)
    return packed, True


def _outside_graph_pools(build, device: torch.device) -> torch.Tensor:
    """``build()`` for a tensor quantpack keeps past the call, allocated outside any CUDA-graph memory pool. The
    warm-up run of torch.compile's CUDA graphs (``mode="reduce-overhead"``, which transformers uses for a static
    cache) sends this thread's allocations to the graph's private pool and fails if one outlives the run ("tensor(s)
    in the cudagraph pool not tracked as outputs"). So the tensor is built by another thread, whose allocations do
    not go there, on its own stream, ordered after this stream's work and before its later work."""
    if device.type != "cuda":
        return build()
    if device.index is None:  # (the helper thread's current device is its own)
        device = torch.device("cuda", torch.cuda.current_device())
    current = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(current)
    result: dict = {}

    def work():
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    result["out"] = build()
                result["done"] = stream.record_event()
        except BaseException as exc:  # noqa: BLE001  (raised again in the caller's thread)
            result["error"] = exc

    worker = threading.Thread(target=work, name="quantpack-build")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    current.wait_event(result["done"])
    result["out"].record_stream(current)  # (freed later, its memory waits for this stream's work too)
    return result["out"]


# ----------------------------------------------------------------------------------------------
# launcher


def _fix_config(cfg: KernelConfig, transposed: bool, m: int, axis: int, group_size: int) -> KernelConfig:
    """Clamp a (possibly nearest-shape) config to what this call can run (the mma path's layout
    needs are checked by mixed_mm, which has the tensors)."""
    if cfg.path == "wgmma" and transposed:
        cfg = KernelConfig("dot", block_m=16 if m <= 16 else 64, block_n=64, block_r=64, split=cfg.split, num_stages=3)
    if cfg.path == "mma" and (transposed or m > MMA_MAX_M):
        cfg = KernelConfig("dot", block_m=16, block_n=64, block_r=64, split=cfg.split, num_stages=3)
    if cfg.path == "gemv" and (transposed or axis != 1 or group_size % (2 * cfg.block_r) or m > 8):
        cfg = replace(cfg, path="fma", words=False)  # the general CUDA-core tiles
    if transposed and cfg.path == "fma":
        cfg = replace(cfg, path="dot")
    if cfg.path == "fma":  # GEMV tiles cover all of M (at most 8 rows each)
        cfg = replace(cfg, block_m=min(m_bucket(m), 8))
    if cfg.path in ("dot", "dot_t"):
        cfg = replace(cfg, block_m=max(16, cfg.block_m), block_r=max(16, cfg.block_r))
    return cfg


def _without_wgmma(transposed: bool, m: int, n: int, k: int, device: torch.device, axis: int, group_size: int
                   ) -> KernelConfig:
    """The config a call runs where the table's pick is ``wgmma`` but ``wgmma`` cannot run it."""
    return _fix_config(heuristic_config(transposed, m, n, k, device, wgmma=False), transposed, m, axis, group_size)


def _launch(x2: torch.Tensor, qweight, scales, zeros, bias, n: int, k: int, axis: int, group_size: int, bits: int,
            transposed: bool, out_dtype: torch.dtype, cfg: KernelConfig, mma_weight=None,
            pdl: bool = False) -> torch.Tensor:
    m = x2.shape[0]
    out_cols = k if transposed else n
    if cfg.path == "dq":
        w = dequantize(qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, out_dtype=x2.dtype)
        out = x2 @ w if transposed else F.linear(x2, w, bias.to(x2.dtype) if bias is not None else None)
        return out.to(out_dtype)
    out = launch_plan.allocate(_new_out, (m, out_cols), out_dtype, x2.device)
    if m == 0:
        return out
    kh = (k + 1) // 2
    meta_row = meta_rowwise(axis, group_size, cfg.block_r)
    n_meta = scales.shape[1]
    dd = _dot_dtype(x2.dtype)
    prec = "ieee" if dd == tl.float32 else "tf32"  # fp32 activations get full-precision dots
    rawq = cfg.rawq and meta_row and not transposed and cfg.path != "fma"
    magic, offset = 0, 0.0
    if rawq and dd == tl.float16:
        magic, offset = 0x6400, 1024.0  # fp16 1024.0: 10 mantissa bits hold any q < 1024
    elif rawq and dd == tl.bfloat16 and bits == 4:
        magic, offset = 0x4300, 128.0  # bf16 128.0: 7 mantissa bits hold q < 16
    split = cfg.split
    warps = cfg.num_warps
    if cfg.path == "gemv":
        _, split, tiles_n = gemv_grid(m, n, k, cfg.block_n, cfg.block_r, split)
        tiles = m * tiles_n
    elif cfg.path == "wgmma":
        wg = wgmma_grid(m, n, k, group_size, cfg.block_m, cfg.block_n, 2 * cfg.block_r, split, cfg.num_stages,
                        cfg.producer, rawq=cfg.rawq and bits == 4)
        if wg.split == 1:
            wg = balance_last_wave(wg, m, n, k, resident_programs(x2, qweight, scales, zeros, bias, out, n=n, k=k,
                                                                  group_size=group_size, bits=bits, grid=wg))
        split, tiles = wg.split, wg.split_tiles(m, n)
    elif cfg.path == "mma":
        grid = mma_grid(n, k, group_size, warps, split, mma_tiles_per_warp(cfg), bits, mma_blocks(cfg), cfg.k_warps)
        split, tiles = grid.split, grid.programs * grid.row_programs(m)
    elif transposed:
        tiles = cdiv(m, cfg.block_m) * cdiv(kh, cfg.block_r)
    else:
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split > 1 and tiles > _COUNTER_SLOTS:
        split = 1  # (a divisor of anything: valid for gemv and mma too)
        if cfg.path == "wgmma":
            wg = replace(wg, split=1, whole=0)
    if split > 1:
        if cfg.path == "gemv":  # each row's partials together
            shape = (m, split, out_cols)
        elif cfg.path == "wgmma":  # one tile-sized block per split program
            shape = (split * tiles, wg.block_n * wg.block_m)
        else:
            shape = (split, m, out_cols)
        ws, cnt = launch_plan.allocate(_new_workspace, shape, x2.device, tiles)
    else:
        ws = cnt = out  # never touched
    if cfg.path == "mma":
        if grid.split != split:  # (too many programs for the counters: one program per column tile)
            grid = mma_grid(n, k, group_size, grid.warps, split, grid.tiles_per_warp, bits, grid.blocks, grid.kwarps)
        launch_mma_gemv(x2, mma_weight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size,
                        grid=grid, depth=mma_depth(grid, group_size, cfg.num_stages), rawq=cfg.rawq,
                        use_asm=not interpreting(),
                        bits=bits, pdl=pdl)
        return out
    if cfg.path == "gemv":
        launch_gemv(x2, qweight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size, bits=bits,
                    block_n=cfg.block_n, block_r=cfg.block_r, split=split, words=cfg.words, num_warps=cfg.num_warps)
        return out
    grid = (tiles, split)

    def launch(num_stages):
        if cfg.path == "wgmma":
            launch_wgmma(x2, qweight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size, bits=bits,
                         grid=replace(wg, stages=num_stages))
        elif transposed:
            launch_plan.launch(_tr_kernel, grid, x2, qweight, scales, zeros, out, ws, cnt, m, n, k, group_size,
                               n_meta, x2.stride(0), x2.stride(1), out.stride(0), out.stride(1),
                               BITS=bits, AXIS=axis, META_ROW=meta_row, SWAP=cfg.path == "dot_t", DOT_DTYPE=dd,
                               DOT_PREC=prec, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
                               SPLIT=split, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=num_stages)
        else:
            path = {"fma": 0, "dot": 1, "dot_t": 2}[cfg.path]
            launch_plan.launch(_fwd_kernel, grid, x2, qweight, scales, zeros, bias if bias is not None else out, out,
                               ws, cnt, m, n, k, group_size, n_meta, x2.stride(0), x2.stride(1), out.stride(0),
                               out.stride(1), BITS=bits, AXIS=axis, META_ROW=meta_row, HAS_BIAS=bias is not None,
                               PATH=path, DOT_DTYPE=dd, DOT_PREC=prec, RAWQ=rawq, MAGIC=magic, OFFSET=offset,
                               USE_ASM=not interpreting(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                               BLOCK_R=cfg.block_r, SPLIT=split, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                               num_stages=num_stages)

    # A config whose pipeline does not fit this GPU's shared memory (a forced or borrowed table entry)
    # runs with fewer stages instead of failing (wgmma's ring needs two).
    lowest = 2 if cfg.path == "wgmma" else 1
    for stages in range(max(cfg.num_stages, lowest), lowest - 1, -1):
        try:
            launch(stages)
            return out
        except OutOfResources:
            if stages == lowest:
                raise
    return out


# ----------------------------------------------------------------------------------------------
# launch plans (launch_plan.py): what a call decides, made once per key and replayed

_PLAN_ENV = ("QUANTPACK_MMA", "QUANTPACK_WGMMA", "QUANTPACK_PDL", "QUANTPACK_AUTOTUNE", "TRITON_INTERPRET")
# (every planned call reads these: os.environ.get costs about 0.8 us a name, mostly the KeyError of an unset one,
# so the names are looked up in CPython's dict behind os.environ, 0.05 us each, where there is one)
_ENV_NAMES = _PLAN_ENV + ("QUANTPACK_LAUNCH_PLANS",)
_AUTOTUNE_ENV = _PLAN_ENV.index("QUANTPACK_AUTOTUNE")
_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)
_ENV_KEYS = (tuple(map(_ENVIRON.encodekey, _ENV_NAMES))
             if isinstance(_ENV_DATA, dict) and hasattr(_ENVIRON, "encodekey") else None)


def _plan_env() -> tuple:
    """The raw values of ``_ENV_NAMES``: the switches in ``_PLAN_ENV``, then QUANTPACK_LAUNCH_PLANS (``None`` when
    unset)."""
    if _ENV_KEYS is not None and os.environ is _ENVIRON:
        return tuple(map(_ENV_DATA.get, _ENV_KEYS))
    return tuple(map(os.environ.get, _ENV_NAMES))


def launch_plans_enabled(env: tuple | None = None) -> bool:
    """Whether ``mixed_mm(plans=...)`` records and replays launch plans (``QUANTPACK_LAUNCH_PLANS=0`` turns them off:
    every call then does its host-side work again, as without a PlanCache). ``env``: :func:`_plan_env`'s values."""
    value = (env if env is not None else _plan_env())[-1]
    return value not in ("0", b"0")


def _table_state() -> tuple:
    """Which config tables are loaded and how many configs were autotuned into them since: a key that holds it
    is not reused after a table changes."""
    return id(_tables), _table_changes


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except (RuntimeError, AttributeError):  # an inference-mode tensor keeps no version counter (or not a tensor)
        return -1


def _plan_key(x2, qweight, scales, zeros, bias, group_size, bits, transposed, out_dtype, axis, config,
              env: tuple) -> tuple:
    """Everything a call's decisions depend on besides the identity of the weight's tensors (which the PlanCache
    checks): x's shape, strides, dtype, device and alignment, the arguments (the bias by identity: a plan that
    launches with it holds it), the tensors' versions (an in-place change rebuilds the mma copy), the environment
    switches and the config table."""
    return (x2.shape, x2.stride(), x2.dtype, x2.device, x2.data_ptr() % 16, out_dtype, transposed, group_size, bits,
            axis, config, _version(qweight), _version(scales), _version(zeros),
            None if bias is None else (id(bias), _version(bias)), env, _table_state())


def _check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed) -> tuple[int, int, int]:
    """Check a call's arguments (shapes, dtypes and devices only: fake tensors pass through here too); return
    (N, K, axis)."""
    n, k, axis = infer_layout(qweight, scales, zeros, group_size, bits, axis)
    width, what = (n, "out_features N") if transposed else (k, "in_features K")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x: expected a floating-point tensor (float16, bfloat16 or float32)")
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"x: last dimension {tuple(x.shape)[-1:] or '()'} does not match {what}={width}")
    if x.device != qweight.device:
        raise ValueError(f"x: on {x.device} but qweight on {qweight.device}; move them to one device")
    if bias is not None and (transposed or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias: expected shape ({n},) and transposed=False")
    return n, k, axis


def mixed_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
             bits: int = 4, transposed: bool = False, out_dtype: torch.dtype | None = None, axis: int | None = None,
             bias: torch.Tensor | None = None, config: KernelConfig | None = None,
             plans: launch_plan.PlanCache | None = None) -> torch.Tensor:
    """``x @ W.T`` (``transposed=False``: x (..., K) -> (..., N)) or ``x @ W`` (``transposed=True``:
    x (..., N) -> (..., K)) for the packed (N, K) weight W, dequantized in registers, accumulated
    in float32. ``axis`` is read off the scales' shape when not given; ``bias`` (N,) is added in
    the forward epilogue; ``config`` forces a launch configuration (tests, tuning); ``plans``, a
    :class:`~quantpack.kernels.launch_plan.PlanCache` kept for this weight, makes repeated calls of one
    x shape replay the first one's launch without its host-side work (launch_plan.py).
    Runs Triton on CUDA (and on CPU under TRITON_INTERPRET=1), the reference otherwise."""
    if plans is not None:
        env = _plan_env()
        if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] > 0) or not launch_plans_enabled(env):
            plans = None  # (the checks below say what is wrong)
        else:
            x2 = x.reshape(-1, x.shape[-1])
            plan_key = _plan_key(x2, qweight, scales, zeros, bias, group_size, bits, transposed, out_dtype, axis,
                                 config, env)
            plan = plans.get((qweight, scales, zeros), plan_key)
            if plan is not None and plan is not launch_plan.MISSING:
                with on_device(x2):
                    out = plan(x2)
                return out.reshape(*x.shape[:-1], out.shape[-1])
            if plan is None:
                plans = None  # (known not to plan: run as usual)
    n, k, axis = _check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed)
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not triton_usable(x2):
        pw = PackedWeight(qweight, scales, zeros, bits, group_size, axis, (n, k))
        w = reference.dequantize(pw, torch.float32)
        out = x2.float() @ (w if transposed else w.t())
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype).reshape(*lead, -1)
    tensors = (qweight, scales, zeros)  # (as the caller holds them: what its PlanCache compares)
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    zeros = zeros.contiguous()
    if config is None:
        if tunes_on_first_use(x2, transposed, bits, n, k):
            autotune(x2, qweight, scales, zeros, group_size=group_size, bits=bits, transposed=transposed)
        config = pick_config(transposed, bits, x2.shape[0], n, k, x2.device)
    config = _fix_config(config, transposed, x2.shape[0], axis, group_size)
    if config.path == "wgmma" and not (wgmma_device(x2.device)
                                       and wgmma_usable(x2, qweight, scales, zeros, n, k, group_size, bits, axis)):
        config = _without_wgmma(transposed, x2.shape[0], n, k, x2.device, axis, group_size)
    mma_weight, pdl, built_now = None, False, False
    if config.path == "mma":
        if mma_enabled() and mma_usable(x2, n, k, group_size, bits, axis):  # (_fix_config took transposed)
            with on_device(x2):
                mma_weight, built_now = _mma_weight(qweight, n, k, bits)
            pdl = not built_now and x2.shape[0] <= PDL_MAX_M and pdl_enabled(x2.device)
        if mma_weight is None:  # the CUDA-core GEMV (or what _fix_config makes of it) instead
            config = _fix_config(gemv_config(x2.shape[0], n, k, x2.device), transposed, x2.shape[0], axis,
                                 group_size)
    # a plan is recorded from a call that runs as every later one will: not one that built the mma copy (it may
    # not use PDL) nor one under CUDA-graph capture (it cannot build the copy)
    record = plans is not None and not built_now and not (x2.is_cuda and torch.cuda.is_current_stream_capturing())
    with on_device(x2):  # Triton launches on the current device: make it x's (device maps over GPUs)
        with launch_plan.recording() if record else contextlib.nullcontext() as rec:
            out = _launch(x2, qweight, scales, zeros, bias, n, k, axis, group_size, bits, transposed, out_dtype,
                          config, mma_weight, pdl)
    if record:  # (under the key of the call's arguments as given, which is how the next call looks it up)
        plans.put(tensors, plan_key, launch_plan.Plan.from_recording(rec, x2, out, keep=(qweight, scales, zeros, bias,
                                                                                    mma_weight)))
    return out.reshape(*lead, out.shape[-1])


_NOT_MMA = object()  # mma_mm's decision for a plan key whose call runs another path


def mma_config(m: int, n: int, k: int, group_size: int, bits: int, device: torch.device) -> KernelConfig | None:
    """The ``mma`` config :func:`mixed_mm` would run a forward call of ``m`` rows of x (16-bit, laid out as the mma
    path needs) with on ``device``, or ``None`` where it would run another path."""
    if not (1 <= m <= MMA_MAX_M and mma_enabled() and (device.type == "cuda" or interpreting())):
        return None
    config = _fix_config(pick_config(False, bits, m, n, k, device), False, m, 1, group_size)
    if config.path == "wgmma" and not wgmma_device(device):
        config = _without_wgmma(False, m, n, k, device, 1, group_size)
    return config if config.path == "mma" else None


def mma_mm(x: torch.Tensor, mma_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
           bits: int = 4, bias: torch.Tensor | None = None, plans: launch_plan.PlanCache | None = None,
           built_now: bool = False) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` from W's :func:`~quantpack.kernels.mma_gemv.mma_pack` copy alone, with no checkpoint-layout
    weight (merged_mm.py: projections merged along N exist only in that layout), or ``None`` where :func:`mixed_mm`
    would run another path than ``mma`` for this call (the caller then computes it another way). N is read off the
    scales, K off the copy. ``plans`` as in :func:`mixed_mm`, kept for these tensors (a declined key is remembered
    too); ``built_now``: the caller built ``mma_weight`` in this call (its kernels may still run: no PDL, no plan)."""
    n, k = scales.shape[1], mma_weight.shape[1] * CHUNK
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features K={k}")
    x2 = x.reshape(-1, k)
    tensors = (mma_weight, scales, zeros)
    env = _plan_env()
    plan_key = None
    if plans is not None and launch_plans_enabled(env):
        plan_key = _plan_key(x2, mma_weight, scales, zeros, bias, group_size, bits, False, None, 1, None, env)
        plan = plans.get(tensors, plan_key)
        if plan is _NOT_MMA:
            return None
        if isinstance(plan, launch_plan.Plan):
            with on_device(x2):
                return plan(x2).reshape(*x.shape[:-1], n)
    m = x2.shape[0]
    config = (mma_config(m, n, k, group_size, bits, x2.device)
              if triton_usable(x2) and mma_usable(x2, n, k, group_size, bits, 1) else None)
    if config is None:
        if plan_key is not None:
            plans.put(tensors, plan_key, _NOT_MMA)
        return None
    pdl = not built_now and m <= PDL_MAX_M and pdl_enabled(x2.device)
    record = plan_key is not None and not built_now and not (x2.is_cuda and torch.cuda.is_current_stream_capturing())
    with on_device(x2):
        with launch_plan.recording() if record else contextlib.nullcontext() as rec:
            out = _launch(x2, None, scales, zeros, bias, n, k, 1, group_size, bits, False, x2.dtype, config,
                          mma_weight, pdl)
    if record:
        plans.put(tensors, plan_key, launch_plan.Plan.from_recording(rec, x2, out,
                                                                     keep=(mma_weight, scales, zeros, bias)))
    return out.reshape(*x.shape[:-1], n)


class MixedMatmul(torch.autograd.Function):
    """``x @ W.T + bias`` over a frozen packed weight; backward is the transposed kernel."""

    @staticmethod
    def forward(ctx, x, qweight, scales, zeros, bias, group_size, bits, axis, plans=None):
        ctx.save_for_backward(qweight, scales, zeros)
        ctx.meta = (group_size, bits, axis, plans)
        return mixed_mm(x, qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, bias=bias,
                        plans=plans)

    @staticmethod
    def backward(ctx, grad_out):
        qweight, scales, zeros = ctx.saved_tensors
        group_size, bits, axis, plans = ctx.meta
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = mixed_mm(grad_out, qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis,
                              transposed=True, plans=plans)
        return grad_x, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# torch.compile: the fused matmul as one opaque custom op

@torch.library.custom_op("quantpack::mixed_mm", mutates_args=(),
                         schema="(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, Tensor? bias, int group_size, "
                                "int bits, int axis, bool transposed) -> Tensor")
def mixed_mm_op(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed):
    """:func:`mixed_mm` as the torch custom op ``torch.ops.quantpack.mixed_mm``, with a fake (shape) function and
    autograd (the input gradient, through the transposed kernel). torch.compile cannot trace the launcher (Triton
    launches, TMA descriptors, caches), so ``QuantLinear`` calls this op while being compiled: the model stays one
    graph (``fullgraph=True``) and ``mode="reduce-overhead"`` captures the whole step, kernels included, in a CUDA
    graph. Eager calls go to :func:`mixed_mm` directly: the dispatcher would add about 10 us to each."""
    return mixed_mm(x, qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, bias=bias,
                    transposed=transposed)


@mixed_mm_op.register_fake
def _mixed_mm_op_fake(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed):
    n, k, _ = _check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed)
    return x.new_empty(*x.shape[:-1], k if transposed else n)


def _mixed_mm_op_setup(ctx, inputs, output):
    x, qweight, scales, zeros, bias, group_size, bits, axis, transposed = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.meta = (group_size, bits, axis, transposed)


def _mixed_mm_op_backward(ctx, grad_out):
    qweight, scales, zeros = ctx.saved_tensors
    group_size, bits, axis, transposed = ctx.meta
    grad_x = None
    if ctx.needs_input_grad[0]:  # (the weight is frozen: only x's gradient, the product with W the other way round)
        grad_x = mixed_mm_op(grad_out, qweight, scales, zeros, None, group_size, bits, axis, not transposed)
    return grad_x, None, None, None, None, None, None, None, None


mixed_mm_op.register_autograd(_mixed_mm_op_backward, setup_context=_mixed_mm_op_setup)
