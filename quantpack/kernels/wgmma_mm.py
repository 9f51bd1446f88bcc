"""Hopper (sm_90) 4- and 8-bit x bf16/fp16 GEMM on asynchronous warpgroup MMA (Gluon).

Each program computes a (BLOCK_N x BLOCK_M) tile of ``out^T = W x^T``: the weight's rows fill the wgmma M side (64
per warpgroup), x's rows its N side (8..256), so 16-row batches waste nothing. Per K step of BLOCK_K in-features:

- TMA copies x's (BLOCK_M, BLOCK_K) tile, the packed (BLOCK_K / 2, BLOCK_N) bytes ((BLOCK_K, BLOCK_N) for 8-bit; as
  16-bit words: the bytes of two adjacent weight rows) and the step's scale and zero rows (one copy: the two tensors
  as planes of one view) into a ring of STAGES shared-memory slots (one mbarrier each);
- each thread loads the words of the wgmma A-operand fragment it owns (ldmatrix), dequantizes them in registers
  (float32 FMA, then x's dtype: the reference's rounding) straight into that fragment;
- an asynchronous wgmma multiplies the fragment (A, from registers) by x's tile (B, K-major, shared), and the program
  dequantizes the next step while it runs; waiting for one MMA in flight frees the ring slot that the next TMA
  refills.

With PRODUCER, one extra warp (Gluon ``warp_specialize``) issues the copies, each once the MMA warps have released
the slot through its "empty" mbarrier, so the MMA warps run no TMA code and fewer CTA barriers per step. With RAWQ
(4-bit, with PRODUCER) the A operand is q - z in x's dtype, without the scales: the nibbles OR-ed into OFFSET's
mantissa are q + OFFSET exactly, then two packed subtractions (OFFSET, exact; z, rounded once, as dequantizing
rounds) give q - z (17 instructions per 8 weights instead of 24), and each step's MMA is scaled once:
acc += s (W_q-z x) (for few rows of x, where the dequant's instructions are a larger share of a step).

The weight's rows reach the MMA permuted (rows 16w + 2g + b as MMA rows 16w + 8b + g, so a thread's two rows are one
16-bit load); the epilogue undoes it. Triton's own pipeliner cannot overlap a dequantized operand with its MMA; Gluon
states the schedule explicitly. Split-K partials are summed by the last program to arrive, as in the other paths. The
kernel needs a GPU with wgmma (compute capability 9.x); the interpreter cannot run Gluon, so CI compiles it for sm_90
and the GPU tests check it against the reference. With GROUPED (mixture-of-experts prefill), each BLOCK_M rows of x
go to the expert the block table names, its matrix read from the stack of all experts' (no split).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
from triton.runtime.errors import OutOfResources

from . import launch_plan
from .dequant import cdiv
from .wgmma_host import WgmmaGrid, producer_maxnreg, scale_zero_planes

try:  # Gluon ships with Triton >= 3.4; without it the path is simply unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "descriptor_types", "launch_wgmma", "resident_programs", "wgmma_usable"]

if HAVE_GLUON:
    # one CTA-wide barrier, whatever this Triton calls it (3.6: thread_barrier, 3.9: barrier)
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # the TMA load, whatever this Triton calls it (3.6: async_copy_global_to_shared, 3.9: async_load)
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    # one int32 word = pair rows kk and kk + 4 (in-features 2kk, 2kk + 1 and 2kk + 8, 2kk + 9) of weight rows
    # r and r + 1: bytes [r kk, r+1 kk, r kk+4, r+1 kk+4]. One shift puts a byte's low nibble at mantissa
    # bits 15-18 and its high nibble at 19-22; OR-ed into 1.0f they are 1 + q / 256 and 1 + q / 16 exactly,
    # and one FMA each with S = 256 s, C = -(256 + z) s (low) or S = 16 s, C = -(16 + z) s (high) gives
    # (q - z) s in float32 (the error, at most about 2**-16 s, is far below the 16-bit rounding that
    # follows). Each output register holds one byte's two weights (low half in-feature 2kk), as wgmma reads
    # its A fragment: $0, $1 row r (kk, kk + 4), $2, $3 row r + 1. Inputs (each twice, pack=2): $4 the word,
    # S low / S high of row r $5 $7, of row r + 1 $9 $11; C likewise from $13. 24 instructions per 8 weights.
    _DEQUANT = ("{{ .reg .b32 t, v0, v1, v2, v3, v4, v5, v6, v7; .reg .f32 f0, f1, f2, f3, f4, f5, f6, f7; "
                "shl.b32 t, $4, 15; lop3.b32 v0, t, 0x00078000, 0x3F800000, 0xEA; "
                "lop3.b32 v1, t, 0x00780000, 0x3F800000, 0xEA; "
                "shl.b32 t, $4, 7; lop3.b32 v2, t, 0x00078000, 0x3F800000, 0xEA; "
                "lop3.b32 v3, t, 0x00780000, 0x3F800000, 0xEA; "
                "shr.b32 t, $4, 1; lop3.b32 v4, t, 0x00078000, 0x3F800000, 0xEA; "
                "lop3.b32 v5, t, 0x00780000, 0x3F800000, 0xEA; "
                "shr.b32 t, $4, 9; lop3.b32 v6, t, 0x00078000, 0x3F800000, 0xEA; "
                "lop3.b32 v7, t, 0x00780000, 0x3F800000, 0xEA; "
                "fma.rn.f32 f0, v0, $5, $13; fma.rn.f32 f1, v1, $7, $15; fma.rn.f32 f2, v2, $9, $17; "
                "fma.rn.f32 f3, v3, $11, $19; fma.rn.f32 f4, v4, $6, $14; fma.rn.f32 f5, v5, $8, $16; "
                "fma.rn.f32 f6, v6, $10, $18; fma.rn.f32 f7, v7, $12, $20; "
                "{cvt} $0, f1, f0; {cvt} $1, f5, f4; {cvt} $2, f3, f2; {cvt} $3, f7, f6; }}")
    _DEQUANT_BF16 = gl.constexpr(_DEQUANT.format(cvt="cvt.rn.bf16x2.f32"))
    _DEQUANT_FP16 = gl.constexpr(_DEQUANT.format(cvt="cvt.rn.f16x2.f32"))
    # 8-bit: one int32 word = in-features k and k + 1 of weight rows r and r + 1: bytes [r k, r+1 k, r k+1, r+1 k+1].
    # A shift puts each byte at mantissa bits 15-22: OR-ed into 1.0f it is 1 + q / 256 exactly, and one FMA with
    # S = 256 s, C = -(256 + z) s gives (q - z) s. Outputs: $0 row r (k, k + 1), $1 row r + 1, as wgmma reads its
    # A fragment. Inputs (each twice, pack=2): $2 the word, S of rows r, r + 1 $3 $5, C likewise $7 $9.
    # 14 instructions per 4 weights.
    _DEQUANT8 = ("{{ .reg .b32 t, v0, v1, v2, v3; .reg .f32 f0, f1, f2, f3; "
                 "shl.b32 t, $2, 15; lop3.b32 v0, t, 0x007F8000, 0x3F800000, 0xEA; "
                 "shl.b32 t, $2, 7; lop3.b32 v1, t, 0x007F8000, 0x3F800000, 0xEA; "
                 "shr.b32 t, $2, 1; lop3.b32 v2, t, 0x007F8000, 0x3F800000, 0xEA; "
                 "shr.b32 t, $2, 9; lop3.b32 v3, t, 0x007F8000, 0x3F800000, 0xEA; "
                 "fma.rn.f32 f0, v0, $3, $7; fma.rn.f32 f2, v2, $4, $8; "
                 "fma.rn.f32 f1, v1, $5, $9; fma.rn.f32 f3, v3, $6, $10; "
                 "{cvt} $0, f2, f0; {cvt} $1, f3, f1; }}")
    _DEQUANT8_BF16 = gl.constexpr(_DEQUANT8.format(cvt="cvt.rn.bf16x2.f32"))
    _DEQUANT8_FP16 = gl.constexpr(_DEQUANT8.format(cvt="cvt.rn.f16x2.f32"))
    # RAWQ (4-bit): the same word, unpacked to x's dtype without the scales: each byte's nibbles q become q + OFFSET
    # exactly (OR-ed into the mantissa of OFFSET = 128 in bf16, 1024 in fp16), in-feature 2kk in the low half.
    # u = word >> 4 has each byte's high nibble at the bottom; PRMT puts byte b of the word and of u at bytes 0 and 2,
    # one LOP3 keeps those two nibbles and ORs in the magic. Outputs as _DEQUANT's; $4 the word. 9 instructions
    # per 8 weights (_DEQUANT: 24). _ZERO_SUB then makes each register q - z (below); the scales are applied to each
    # K step's MMA result.
    _UNPACK_RAW = ("{{ .reg .b32 u, t; shr.b32 u, $4, 4; "
                   "prmt.b32 t, $4, u, 0x0400; lop3.b32 $0, t, 0x000F000F, {magic}, 0xEA; "
                   "prmt.b32 t, $4, u, 0x0602; lop3.b32 $1, t, 0x000F000F, {magic}, 0xEA; "
                   "prmt.b32 t, $4, u, 0x0501; lop3.b32 $2, t, 0x000F000F, {magic}, 0xEA; "
                   "prmt.b32 t, $4, u, 0x0703; lop3.b32 $3, t, 0x000F000F, {magic}, 0xEA; }}")
    _UNPACK_RAW_BF16 = gl.constexpr(_UNPACK_RAW.format(magic="0x43004300"))
    _UNPACK_RAW_FP16 = gl.constexpr(_UNPACK_RAW.format(magic="0x64006400"))
    # RAWQ's zeros: (q + OFFSET) - OFFSET is q exactly, then - z rounds once to x's dtype, as dequantizing rounds (one
    # subtraction with OFFSET + z would round z to OFFSET's unit). $0, $1 from $2, $4 (q + OFFSET of two weight rows)
    # and $3, $5 (each row's z twice). Subtracting the zeros here instead of applying them to x's sums per step (a
    # second MMA of ones) measured 2-7% faster at 16 rows on an H200.
    _ZERO_SUB = ("{{ .reg .b32 m; mov.b32 m, {magic}; sub.rn.{t}x2 $0, $2, m; sub.rn.{t}x2 $0, $0, $3; "
                 "sub.rn.{t}x2 $1, $4, m; sub.rn.{t}x2 $1, $1, $5; }}")
    _ZERO_SUB_BF16 = gl.constexpr(_ZERO_SUB.format(t="bf16", magic="0x43004300"))
    _ZERO_SUB_FP16 = gl.constexpr(_ZERO_SUB.format(t="f16", magic="0x64006400"))

    @gluon.constexpr_function
    def _operand_words_layout(BN, BK, num_warps):
        """Registers of the packed tile read as (BN/2, BK/2) 16-bit words (the bytes of weight rows 2p, 2p + 1) for the
        register A operand: a thread holds pair rows (in-features k, k+1) t and t + 4 of each 8 and the word p = 8w + g,
        i.e. weight rows 16w + 2g + {0, 1}, which the MMA takes as its rows 16w + g and 16w + g + 8 (_mma_rows)."""
        reg = [[0, 4]] + [[0, 8 << i] for i in range((BK // 16).bit_length() - 1)]
        warps = [[8 << i, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warps, block_bases=[], shape=[BN // 2, BK // 2])

    @gluon.constexpr_function
    def _operand_words_layout8(BN, BK, num_warps):
        """8-bit: registers of the (BK, BN) byte tile read as (BN/2, BK) 16-bit words (the bytes of weight rows 2p,
        2p + 1 at one in-feature) for the register A operand: a thread holds in-features 2t, 2t + 1, 2t + 8, 2t + 9
        of each 16 (k and k + 1 adjacent, one 32-bit register) and the word p = 8w + g, as _operand_words_layout."""
        reg = [[0, 1], [0, 8]] + [[0, 16 << i] for i in range((BK // 16).bit_length() - 1)]
        warps = [[8 << i, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warps, block_bases=[], shape=[BN // 2, BK])

    @gluon.jit
    def _mma_rows8(lo, hi):
        """8-bit: two (BN/2, BK) halves (weight rows 2p and 2p + 1) of 16-bit values -> (BN, BK), weight rows
        16w + 2g + b relabelled 16w + 8b + g as in _mma_rows."""
        P: gl.constexpr = lo.shape[0]
        K: gl.constexpr = lo.shape[1]
        t = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (P // 8, 8, 2, K))  # (w, g, b, k)
        return gl.reshape(gl.permute(t, (0, 2, 1, 3)), (2 * P, K))

    @gluon.jit
    def _mma_rows(lo, hi):
        """Two (BN/2, BK/2) halves (weight rows 2p and 2p + 1) of 16-bit pairs -> (BN, BK): weight rows
        16w + 2g + b relabelled 16w + 8b + g, each pair split into in-features 2kk, 2kk + 1. Relabelling
        only: the registers already sit where the wgmma A operand expects them."""
        P: gl.constexpr = lo.shape[0]
        KK: gl.constexpr = lo.shape[1]
        t = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (P // 8, 8, 2, KK))  # (w, g, b, kk)
        t = gl.reshape(gl.permute(t, (0, 2, 1, 3)), (2 * P, KK))  # rows 16w + 8b + g
        even = (t & 0xFFFF).to(gl.int16)
        odd = (t >> 16).to(gl.int16)
        return gl.reshape(gl.join(even, odd), (2 * P, 2 * KK))

    @gluon.jit
    def weight_rows(acc):
        """The accumulator (BN, BM) from MMA-row order back to weight-row order (the inverse of _mma_rows)."""
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        acc = gl.permute(gl.reshape(acc, (BN // 16, 2, 8, BM)), (0, 2, 1, 3))
        return gl.reshape(acc, (BN, BM))

    @gluon.constexpr_function
    def _planes_layout(BN, num_warps):
        """A step's (2, BN) scale and zero rows as each thread needs them next to _operand_words_layout: both
        planes of weight rows 16w + 2g + {0, 1} (lanes t broadcast)."""
        warps = [[0, 16 << i] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0]],
                                          lane_bases=[[0, 0], [0, 0], [0, 2], [0, 4], [0, 8]], warp_bases=warps,
                                          block_bases=[], shape=[2, BN])

    @gluon.jit
    def _row_pairs(v, pair_layout: gl.constexpr):
        """A (BN,) float32 row -> its even and odd entries as (BN/2,) tensors."""
        BN: gl.constexpr = v.shape[0]
        even, odd = gl.split(gl.reshape(v, (BN // 2, 2)))
        return gl.convert_layout(even, pair_layout), gl.convert_layout(odd, pair_layout)

    @gluon.jit
    def _row_const(v, words):
        """A per-row float32 constant (BN/2,) broadcast over the step's pair rows, as the asm's operand."""
        c, _ = gl.broadcast(v[:, None], words)
        return c

    @gluon.jit
    def _step_rows(sz_smem, S_PLANE: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr):
        """The step's scale and zero rows (float32, (BN,) each, weight-row order), each thread holding weight rows
        16w + 2g + {0, 1} (_planes_layout)."""
        planes = sz_smem.reshape((2, BN)).load(_planes_layout(BN, WARPS)).to(gl.float32)
        first, second = gl.split(gl.permute(planes, (1, 0)))
        if S_PLANE == 0:
            s, z = first, second
        else:
            s, z = second, first
        return s, z

    @gluon.jit
    def _step_scales(sz_smem, S_PLANE: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr,
                     pair_layout: gl.constexpr):
        """The step's scales and zeros (float32) of weight rows 2p and 2p + 1: s0, s1, z0, z1, each (BN/2,)."""
        s, z = _step_rows(sz_smem, S_PLANE, BN, WARPS)
        s0, s1 = _row_pairs(s, pair_layout)
        z0, z1 = _row_pairs(z, pair_layout)
        return s0, s1, z0, z1

    @gluon.jit
    def _dequant_operand(q_smem, sz_smem, x_smem, S_PLANE: gl.constexpr, a_layout: gl.constexpr):
        """The step's weights (4-bit: (BK/2, BN/2) 16-bit words; 8-bit: (BK, BN/2)) as the register A operand
        (BN, BK) of wgmma, in MMA-row order, in the dtype of x's tile (BM, BK)."""
        if q_smem.shape[0] == x_smem.shape[1]:  # 8-bit: a byte row per in-feature
            w = _dequant_operand8(q_smem, sz_smem, S_PLANE, a_layout, x_smem.dtype)
        else:
            w = _dequant_operand4(q_smem, sz_smem, S_PLANE, a_layout, x_smem.dtype)
        return w

    @gluon.jit
    def _dequant_operand4(q_smem, sz_smem, S_PLANE: gl.constexpr, a_layout: gl.constexpr, DTYPE: gl.constexpr):
        """_dequant_operand for 4-bit weights: the (BK/2, BN/2) words of the step's (BK/2, BN) bytes."""
        BN: gl.constexpr = 2 * q_smem.shape[1]
        BK: gl.constexpr = 2 * q_smem.shape[0]
        WARPS: gl.constexpr = a_layout.parent.warps_per_cta[0]
        words_layout: gl.constexpr = _operand_words_layout(BN, BK, WARPS)
        pair_layout: gl.constexpr = gl.SliceLayout(1, words_layout)
        # lowered to ldmatrix.trans, whose per-lane row addresses take the pair rows in the t, t + 4 order
        words = q_smem.permute((1, 0)).load(words_layout)
        s0, s1, z0, z1 = _step_scales(sz_smem, S_PLANE, BN, WARPS, pair_layout)
        consts = (_row_const(s0 * 256.0, words), _row_const(s0 * 16.0, words), _row_const(s1 * 256.0, words),
                  _row_const(s1 * 16.0, words), _row_const(-(z0 * s0) - s0 * 256.0, words),
                  _row_const(-(z0 * s0) - s0 * 16.0, words), _row_const(-(z1 * s1) - s1 * 256.0, words),
                  _row_const(-(z1 * s1) - s1 * 16.0, words))
        asm: gl.constexpr = _DEQUANT_BF16 if DTYPE == gl.bfloat16 else _DEQUANT_FP16
        lo, hi = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r" + ",r" * 17, (words, ) + consts,
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=2)
        w = _mma_rows(lo, hi).to(DTYPE, bitcast=True)
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def _dequant_operand8(q_smem, sz_smem, S_PLANE: gl.constexpr, a_layout: gl.constexpr, DTYPE: gl.constexpr):
        """_dequant_operand for 8-bit weights: the (BK, BN/2) words of the step's (BK, BN) bytes."""
        BN: gl.constexpr = 2 * q_smem.shape[1]
        BK: gl.constexpr = q_smem.shape[0]
        WARPS: gl.constexpr = a_layout.parent.warps_per_cta[0]
        words_layout: gl.constexpr = _operand_words_layout8(BN, BK, WARPS)
        pair_layout: gl.constexpr = gl.SliceLayout(1, words_layout)
        words = q_smem.permute((1, 0)).load(words_layout)
        s0, s1, z0, z1 = _step_scales(sz_smem, S_PLANE, BN, WARPS, pair_layout)
        consts = (_row_const(s0 * 256.0, words), _row_const(s1 * 256.0, words),
                  _row_const(-(z0 * s0) - s0 * 256.0, words), _row_const(-(z1 * s1) - s1 * 256.0, words))
        asm: gl.constexpr = _DEQUANT8_BF16 if DTYPE == gl.bfloat16 else _DEQUANT8_FP16
        lo, hi = gl.inline_asm_elementwise(asm, "=r,=r" + ",r" * 9, (words, ) + consts,
                                           dtype=(gl.int16, gl.int16), is_pure=True, pack=2)
        w = _mma_rows8(lo, hi).to(DTYPE, bitcast=True)
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def _pair_bits(v, DTYPE: gl.constexpr):
        """A float32 value as the 32-bit pair (v, v) in x's dtype."""
        b = v.to(DTYPE).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.jit
    def _raw_operand(q_smem, z, a_layout: gl.constexpr, DTYPE: gl.constexpr):
        """RAWQ: the step's 4-bit weights as q - z (x's dtype, no scales; z the step's zero row from _step_rows), the
        register A operand (BN, BK) in MMA-row order."""
        BN: gl.constexpr = 2 * q_smem.shape[1]
        BK: gl.constexpr = 2 * q_smem.shape[0]
        WARPS: gl.constexpr = a_layout.parent.warps_per_cta[0]
        words_layout: gl.constexpr = _operand_words_layout(BN, BK, WARPS)
        words = q_smem.permute((1, 0)).load(words_layout)
        z0, z1 = _row_pairs(z, gl.SliceLayout(1, words_layout))
        asm: gl.constexpr = _UNPACK_RAW_BF16 if DTYPE == gl.bfloat16 else _UNPACK_RAW_FP16
        lo, hi = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", (words, ), dtype=(gl.int32, gl.int32), is_pure=True,
                                           pack=2)
        sub: gl.constexpr = _ZERO_SUB_BF16 if DTYPE == gl.bfloat16 else _ZERO_SUB_FP16
        lo, hi = gl.inline_asm_elementwise(sub, "=r,=r,r,r,r,r", (lo, _row_const(_pair_bits(z0, DTYPE), words), hi,
                                                                   _row_const(_pair_bits(z1, DTYPE), words)),
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.convert_layout(_mma_rows(lo, hi).to(DTYPE, bitcast=True), a_layout)

    @gluon.jit
    def _mma_order(acc):
        """The inverse of weight_rows: a (BN, BM) tile from weight-row order to MMA-row order (a relabelling)."""
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        return gl.reshape(gl.permute(gl.reshape(acc, (BN // 16, 8, 2, BM)), (0, 2, 1, 3)), (BN, BM))

    @gluon.jit
    def _consume_ring_raw(x_s, q_s, sz_s, ready, empty, steps, trace_ptr, pid, STAGES: gl.constexpr,
                          S_PLANE: gl.constexpr, a_layout: gl.constexpr, acc_layout: gl.constexpr, TRACE: gl.constexpr):
        """The MMA warps' K loop with RAWQ (a producer warp fills the ring): per step one wgmma of the unscaled weights
        (q - z) into a fresh accumulator, waited for, then acc += s part per weight row, in weight-row order (where each
        thread's rows are the ones its scale loads gave it: no exchange). A step lies in one group (BLOCK_K divides it).
        Starting the next step's MMAs before adding this step's, or preparing its operand while this step's MMA runs,
        measured no faster. Returns (accumulator in MMA-row order,), as _consume_ring."""
        BN: gl.constexpr = 2 * q_s.shape[2]
        BM: gl.constexpr = x_s.shape[1]
        DTYPE: gl.constexpr = x_s.dtype
        WARPS: gl.constexpr = acc_layout.warps_per_cta[0]
        acc = weight_rows(gl.zeros((BN, BM), gl.float32, acc_layout))
        rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if i == 0:
                _stamp(trace_ptr, pid, 1, TRACE)
            s, z = _step_rows(sz_s.index(slot), S_PLANE, BN, WARPS)
            a = _raw_operand(q_s.index(slot), z, a_layout, DTYPE)
            # (use_acc=False over zeros: the MMA ignores its input, so no instruction defines these registers before
            # the MMA does, and ptxas keeps it asynchronous)
            part = warpgroup_mma(a, x_s.index(slot).permute((1, 0)), gl.zeros((BN, BM), gl.float32, acc_layout),
                                 use_acc=False, is_async=True)
            s = gl.convert_layout(s, rows)
            part = warpgroup_mma_wait(0, deps=(part, ))
            fence_async_shared()  # (the slot's words and scale rows were read by ordinary loads)
            mbarrier.arrive(empty.index(slot))
            acc = acc + s[:, None] * weight_rows(part)
        return (_mma_order(acc), )

    @gluon.jit
    def _multiply_slot(x_s, q_s, sz_s, ready, i, acc, STAGES: gl.constexpr, S_PLANE: gl.constexpr,
                       a_layout: gl.constexpr):
        """K step i: wait for its copies, dequantize into the register A operand, start its MMA and retire the previous
        MMA. (The previous MMA's operand is safe because it lives in another static site's registers: see the loop.)"""
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a = _dequant_operand(q_s.index(slot), sz_s.index(slot), x_s.index(slot), S_PLANE, a_layout)
        acc = warpgroup_mma(a, x_s.index(slot).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(1, deps=(acc, ))

    @gluon.jit
    def _mma_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first, i, steps, m0, n0, woff, acc,
                  G: gl.constexpr, STAGES: gl.constexpr, S_PLANE: gl.constexpr, a_layout: gl.constexpr):
        """K step i (_multiply_slot), then refill the ring slot the retired MMA read with step i + STAGES - 1."""
        acc = _multiply_slot(x_s, q_s, sz_s, bars, i, acc, STAGES, S_PLANE, a_layout)
        nxt = i + STAGES - 1
        _issue_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first + nxt, nxt % STAGES, m0, n0, woff, G,
                    nxt < steps)
        return acc

    @gluon.jit
    def _issue_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, step, slot, m0, n0, woff, G: gl.constexpr, pred):
        """Start the TMA copies of K step ``step`` into ring slot ``slot`` (skipped when not pred). The weight's
        copies read step ``step + woff`` (grouped: the expert's matrix starts ``woff`` steps into the stack)."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        bar = bars.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + q_desc.block_type.nbytes + sz_desc.block_type.nbytes,
                        pred=pred)
        k0 = step * BK
        tma_load(x_desc, [m0, k0], bar, x_s.index(slot), pred=pred)
        QK: gl.constexpr = q_desc.block_type.shape[0]  # packed rows per step: BK / 2 (4-bit) or BK (8-bit)
        tma_load(q_desc, [(step + woff) * QK, n0 // 2], bar, q_s.index(slot), pred=pred)
        tma_load(sz_desc, [0, (step + woff) * BK // G, n0], bar, sz_s.index(slot), pred=pred)  # both planes: one copy

    @gluon.jit
    def _load_ring(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, ready, empty, first, steps, m0, n0, woff,
                   G: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: each K step's TMA copies into its ring slot, once the consumers have released
        the slot (a fresh mbarrier counts as released: its phase before the first is complete)."""
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            _issue_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, ready, first + i, slot, m0, n0, woff, G, True)

    @gluon.jit
    def _consume_step(x_s, q_s, sz_s, ready, empty, i, acc, STAGES: gl.constexpr, S_PLANE: gl.constexpr,
                      a_layout: gl.constexpr):
        """K step i on the MMA warps (_multiply_slot), then release the slot the retired MMA read to the
        producer."""
        acc = _multiply_slot(x_s, q_s, sz_s, ready, i, acc, STAGES, S_PLANE, a_layout)
        # (the slot's words and scale rows were read by ordinary loads: order them before the TMA that refills it)
        fence_async_shared()
        mbarrier.arrive(empty.index((i - 1) % STAGES))
        return acc

    @gluon.jit
    def _consume_ring(x_s, q_s, sz_s, ready, empty, steps, trace_ptr, pid, STAGES: gl.constexpr, S_PLANE: gl.constexpr,
                      a_layout: gl.constexpr, acc_layout: gl.constexpr, TRACE: gl.constexpr):
        """The MMA warps' K loop when a producer warp fills the ring (the same schedule as the loop in
        _wgmma_kernel, without the copies). Returns (accumulator,)."""
        BN: gl.constexpr = 2 * q_s.shape[2]
        BM: gl.constexpr = x_s.shape[1]
        mbarrier.wait(ready.index(0), 0)
        _stamp(trace_ptr, pid, 1, TRACE)
        a = _dequant_operand(q_s.index(0), sz_s.index(0), x_s.index(0), S_PLANE, a_layout)
        acc = warpgroup_mma(a, x_s.index(0).permute((1, 0)), gl.zeros((BN, BM), gl.float32, acc_layout),
                            use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        for i in range(1, steps - 1, 2):
            acc = _consume_step(x_s, q_s, sz_s, ready, empty, i, acc, STAGES, S_PLANE, a_layout)
            acc = _consume_step(x_s, q_s, sz_s, ready, empty, i + 1, acc, STAGES, S_PLANE, a_layout)
        if steps % 2 == 0:
            acc = _consume_step(x_s, q_s, sz_s, ready, empty, steps - 1, acc, STAGES, S_PLANE, a_layout)
        return (warpgroup_mma_wait(0, deps=(acc, )), )

    @gluon.jit
    def _stamp(trace_ptr, pid, event: gl.constexpr, TRACE: gl.constexpr):
        """With TRACE, record event ``event`` of program ``pid``: the global nanosecond timer at slot ``event`` and the
        SM's cycle counter at slot 8 + ``event`` of the program's 16 int64 (benchmarks/probe_wgmma.py --trace)."""
        if TRACE:
            ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                           pack=1)
            cycles = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False,
                                               pack=1)
            gl.store(trace_ptr + pid * 16 + event, ns)
            gl.store(trace_ptr + pid * 16 + 8 + event, cycles)

    @gluon.jit
    def _wgmma_kernel(x_desc, q_desc, sz_desc, bias_ptr, out_ptr, ws_ptr, cnt_ptr, trace_ptr, experts_ptr, M, N, K,
                      stride_om, whole, E, G: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                      STAGES: gl.constexpr, S_PLANE: gl.constexpr, PRODUCER: gl.constexpr, RAWQ: gl.constexpr,
                      TRACE: gl.constexpr, GROUPED: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = sz_desc.block_type.shape[2]
        DTYPE: gl.constexpr = x_desc.dtype

        # programs [0, whole) own tiles [0, whole) outright; the programs after them split each remaining
        # tile's K range SPLIT ways (whole = 0: split-K everywhere; a partial last wave: only its tiles)
        pid = gl.program_id(0)
        _stamp(trace_ptr, pid, 0, TRACE)  # events: 0 start, 1 first step's copies landed,
        # 2 accumulator done, 3 tile or partial stored (and counted), 4 split tile summed and stored; slot 7: SM
        if TRACE:
            gl.store(trace_ptr + pid * 16 + 7, gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                                                          is_pure=True, pack=1).to(gl.int64))
        tiles_n = (N + BN - 1) // BN
        tile = pid
        total = (K + BK - 1) // BK
        first = 0
        steps = total
        part = 0
        if SPLIT > 1:
            part = tiles_n * ((M + BM - 1) // BM) - whole  # the split tiles
            if pid >= whole:
                tile = whole + (pid - whole) % part
                per = (total + SPLIT - 1) // SPLIT
                first = (pid - whole) // part * per
                steps = gl.minimum(per, total - first)
        n0 = tile % tiles_n * BN
        m0 = tile // tiles_n * BM
        woff = 0  # GROUPED (no split): BM rows of x times expert experts_ptr[m tile] (E: past the filled blocks)
        if GROUPED:
            e = gl.load(experts_ptr + tile // tiles_n)
            if e >= E:
                return
            woff = e * total

        # out^T tile in the wgmma accumulator: warps stacked along the weight's rows (16 each)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

        x_s = gl.allocate_shared_memory(DTYPE, [STAGES, BM, BK], x_desc.layout)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        sz_s = gl.allocate_shared_memory(sz_desc.dtype, [STAGES, 2, 1, BN], sz_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        if PRODUCER:
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(empty.index(i), count=1)
            if RAWQ:
                acc = gl.warp_specialize([(_consume_ring_raw, (x_s, q_s, sz_s, bars, empty, steps, trace_ptr, pid,
                                                               STAGES, S_PLANE, a_layout, acc_layout, TRACE)),
                                          (_load_ring, (x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, empty, first,
                                                        steps, m0, n0, woff, G, STAGES))], [1], [24])[0]
            else:
                acc = gl.warp_specialize([(_consume_ring, (x_s, q_s, sz_s, bars, empty, steps, trace_ptr, pid, STAGES,
                                                           S_PLANE, a_layout, acc_layout, TRACE)),
                                          (_load_ring, (x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, empty, first,
                                                        steps, m0, n0, woff, G, STAGES))], [1], [24])[0]
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(empty.index(i))
        else:
            for i in gl.static_range(STAGES - 1):
                _issue_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first + i, i, m0, n0, woff, G,
                            i < steps)

            # the first step is peeled and starts the accumulator (use_acc=False): a zero-filled accumulator
            # carried into the loop is registers that non-wgmma instructions define inside the MMA pipeline,
            # and ptxas then serializes every wgmma (C7515; the sm_90 compile test checks)
            mbarrier.wait(bars.index(0), 0)
            _stamp(trace_ptr, pid, 1, TRACE)
            a = _dequant_operand(q_s.index(0), sz_s.index(0), x_s.index(0), S_PLANE, a_layout)
            acc = warpgroup_mma(a, x_s.index(0).permute((1, 0)), gl.zeros((BN, BM), gl.float32, acc_layout),
                                use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # (nothing older in flight: only the type changes)
            _issue_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first + STAGES - 1, STAGES - 1, m0, n0,
                        woff, G, STAGES - 1 < steps)
            # two steps per iteration: wgmma reads its register operand asynchronously, so a step must dequantize
            # into other registers than the ones the MMA in flight reads. Each static wgmma gets its own; a
            # one-step loop body would rewrite its operand under the previous MMA (wrong results, measured).
            for i in range(1, steps - 1, 2):
                acc = _mma_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first, i, steps, m0, n0, woff, acc,
                                G, STAGES, S_PLANE, a_layout)
                acc = _mma_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first, i + 1, steps, m0, n0, woff,
                                acc, G, STAGES, S_PLANE, a_layout)
            if steps % 2 == 0:
                acc = _mma_step(x_desc, q_desc, sz_desc, x_s, q_s, sz_s, bars, first, steps - 1, steps, m0, n0, woff,
                                acc, G, STAGES, S_PLANE, a_layout)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        _stamp(trace_ptr, pid, 2, TRACE)
        acc = weight_rows(acc)
        # (here, before the epilogue: the CTA barrier that comes with the invalidates also keeps the epilogue's
        # convert_layout scratch, which reuses the ring's shared memory, from overwriting x's slot while other
        # warps' last wgmma may still read it; moved after the epilogue, 3-stage rings gave NaN)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        _epilogue(acc, pid, tile, whole, part, n0, m0, M, N, bias_ptr, out_ptr, ws_ptr, cnt_ptr, trace_ptr, stride_om,
                  HAS_BIAS, SPLIT, TRACE, num_warps)

    @gluon.constexpr_function
    def vector_layout(BN, BM, per_thread, num_warps):
        """(BN, BM) with ``per_thread`` consecutive n per thread (one 16-byte access), lanes along n first, warps
        along m: out's and the partials' contiguous dimension is n."""
        lanes_n = min(32, BN // per_thread)
        return gl.BlockedLayout(size_per_thread=[per_thread, 1], threads_per_warp=[lanes_n, 32 // lanes_n],
                                warps_per_cta=[1, num_warps], order=[0, 1])

    @gluon.constexpr_function
    def _chunk_cols(BN, BM, SPLIT, num_warps):
        """Columns of x per chunk of the split tile's sum: at most 64 float32 partial values per thread in flight."""
        cm = BM
        while cm > 8 and BN * cm * SPLIT > 64 * 32 * num_warps:
            cm //= 2
        return cm

    @gluon.jit
    def _epilogue(acc, pid, tile, whole, part, n0, m0, M, N, bias_ptr, out_ptr, ws_ptr, cnt_ptr, trace_ptr,
                  stride_om, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, TRACE: gl.constexpr,
                  num_warps: gl.constexpr):
        """out[m, n] = acc[n, m] (+ bias), or, for a split tile, its float32 partial; the last of the tile's
        programs to arrive sums the partials and stores the tile."""
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        acc_layout: gl.constexpr = acc.type.layout
        if SPLIT > 1 and pid >= whole:
            # the partial goes to a (BM, BN) float32 block past the whole tiles in 16-byte stores (stored straight
            # from the accumulator's registers, 4-byte stores, they took 1.4x as long); the last program reads the
            # blocks back in column chunks, so neither its accumulator nor a whole tile of partials stays live
            p_layout: gl.constexpr = vector_layout(BN, BM, 4, num_warps)
            n_p = gl.arange(0, BN, layout=gl.SliceLayout(1, p_layout))
            m_p = gl.arange(0, BM, layout=gl.SliceLayout(0, p_layout))
            gl.store(ws_ptr + (pid - whole) * (BN * BM) + m_p[None, :] * BN + n_p[:, None],
                     gl.convert_layout(acc, p_layout))
            cta_barrier()
            counter = cnt_ptr + (tile - whole)
            arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            _stamp(trace_ptr, pid, 3, TRACE)
            if arrived == SPLIT - 1:
                CM: gl.constexpr = _chunk_cols(BN, BM, SPLIT, num_warps)
                r_layout: gl.constexpr = vector_layout(BN, CM, 4, num_warps)
                nr = gl.arange(0, BN, layout=gl.SliceLayout(1, r_layout))
                mr = gl.arange(0, CM, layout=gl.SliceLayout(0, r_layout))
                local = mr[None, :] * BN + nr[:, None]
                for c in range(0, BM, CM):
                    chunk = gl.zeros((BN, CM), gl.float32, r_layout)
                    for j in gl.static_range(SPLIT):  # (unrolled: all the chunk's loads in flight at once)
                        chunk += gl.load(ws_ptr + (j * part + tile - whole) * (BN * BM) + c * BN + local,
                                         cache_modifier=".cg")
                    if HAS_BIAS:
                        chunk += gl.load(bias_ptr + n0 + nr, mask=n0 + nr < N, other=0.0).to(gl.float32)[:, None]
                    store_out(chunk.to(out_ptr.dtype.element_ty), n0 + nr, m0 + c + mr, M, N, out_ptr, stride_om)
                gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _stamp(trace_ptr, pid, 4, TRACE)
        else:
            if HAS_BIAS:  # (in float32, before the one rounding to out's dtype, as F.linear)
                na = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
                acc += gl.load(bias_ptr + na, mask=na < N, other=0.0).to(gl.float32)[:, None]
            # rounded first, so the layout change through shared memory moves 16-bit values
            o_layout: gl.constexpr = vector_layout(BN, BM, 8, num_warps)
            tile_out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), o_layout)
            store_out(tile_out, n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, o_layout)),
                       m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, o_layout)), M, N, out_ptr, stride_om)
            _stamp(trace_ptr, pid, 3, TRACE)

    @gluon.jit
    def store_out(tile, n, m, M, N, out_ptr, stride_om):
        gl.store(out_ptr + m[None, :] * stride_om + n[:, None], tile, mask=(n < N)[:, None] & (m < M)[None, :])


def wgmma_usable(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, k: int,
                 group_size: int, bits: int, axis: int) -> bool:
    """What the kernel's TMA copies and tiles need (the caller checks the GPU): 4- or 8-bit weights grouped along K
    in groups of 64 or a multiple of 128, 16-bit activations, 16-byte aligned bases and rows (K % 8, N % 16),
    scales and zeros in two places (the planes of one copy)."""
    aligned = (all(t.data_ptr() % 16 == 0 for t in (x2, qweight, scales, zeros))
               and zeros.data_ptr() != scales.data_ptr())
    return (wgmma_layout_fits(n, k, group_size, bits, axis, x2.dtype) and aligned
            and x2.stride(1) == 1 and x2.stride(0) % 8 == 0
            and scales.dtype == zeros.dtype and scales.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())


def wgmma_layout_fits(n: int, k: int, group_size: int, bits: int, axis: int, dtype: torch.dtype) -> bool:
    """The shape half of :func:`wgmma_usable` (Gluon in this Triton, 4/8-bit, groups along K of 64 or a multiple of
    128, K % 8, N % 16, 16-bit activations): what a call with aligned, contiguous tensors needs."""
    return (HAVE_GLUON and bits in (4, 8) and axis == 1 and (group_size == 64 or group_size % 128 == 0)
            and k % group_size == 0 and k % 8 == 0 and n % 16 == 0 and dtype in (torch.bfloat16, torch.float16))


@functools.lru_cache(maxsize=1024)  # (Gluon layout objects cost about 30 us a launch to build)
def _layouts(x_dtype: torch.dtype, s_dtype: torch.dtype, grid: WgmmaGrid, bits: int):
    """Shared-memory layouts of the three TMA tiles: x (BM, BK), the packed bytes of a step ((BK/2, BN) for 4-bit,
    (BK, BN) for 8-bit) as 16-bit words (BN/2 per row), and the (2, 1, BN) scale and zero rows of a step (one
    copy: see scale_zero_planes). Cached: the block-shape lists are shared by every launch's descriptors, so nothing
    may modify them."""
    dt = gl.bfloat16 if x_dtype == torch.bfloat16 else gl.float16
    bm, bn, bk = grid.block_m, grid.block_n, grid.block_k
    qk = bk // 2 if bits == 4 else bk
    planes = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * s_dtype.itemsize, rank=3)
    return (([bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt)),
            ([qk, bn // 2], gl.NVMMASharedLayout.get_default_for([qk, bn // 2], gl.int16)),
            ([2, 1, bn], planes))


def descriptor_types(x_dtype: torch.dtype, s_dtype: torch.dtype, grid: WgmmaGrid, bits: int) -> dict:
    """The kernel's descriptor arguments as Triton signature strings (compiling without a GPU)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    dtypes = (names[x_dtype], "i16", names[s_dtype])
    return {arg: f"tensordesc<{dt}{list(shape)},{layout!r}>"
            for arg, dt, (shape, layout) in zip(("x_desc", "q_desc", "sz_desc"), dtypes,
                                                 _layouts(x_dtype, s_dtype, grid, bits))}


def _descriptors(x2, qweight, scales, zeros, n: int, grid: WgmmaGrid, bits: int):
    """The three TMA descriptors of a launch and the plane that holds the scales."""
    (x_block, x_layout), (q_block, q_layout), (sz_block, sz_layout) = _layouts(x2.dtype, scales.dtype, grid, bits)
    words = qweight.view(torch.int16)  # the bytes of weight rows 2p, 2p + 1 (N is even)
    base, plane, s_plane = scale_zero_planes(scales, zeros)
    return (TensorDescriptor.from_tensor(x2, x_block, x_layout), TensorDescriptor.from_tensor(words, q_block, q_layout),
            TensorDescriptor(base, [2, scales.shape[0], n], [plane, n, 1], sz_block, sz_layout), s_plane)


def _run(x2, qweight, scales, zeros, bias, out, ws, cnt, n: int, k: int, group_size: int, bits: int, grid: WgmmaGrid,
         warmup: bool = False, trace: torch.Tensor | None = None, block_expert: torch.Tensor | None = None, launch=None):
    experts = qweight.shape[0] if block_expert is not None else 1
    if block_expert is not None:  # (the stacked experts read as one (E K/2, N) matrix)
        qweight, scales, zeros = (t.reshape(-1, t.shape[-1]) for t in (qweight, scales, zeros))
    x_desc, q_desc, sz_desc, s_plane = _descriptors(x2, qweight, scales, zeros, n, grid, bits)
    m = x2.shape[0]
    # (a warmup compiles only; a launch goes through ``launch`` or launch_plan, which notes it for a plan)
    kernel = (_wgmma_kernel.warmup if warmup else functools.partial(launch or launch_plan.launch, _wgmma_kernel,
                                                                    (grid.programs(m, n), )))
    extra = {"grid": (1, )} if warmup else {}
    if grid.producer:
        extra["maxnreg"] = producer_maxnreg(grid)
    return kernel(x_desc, q_desc, sz_desc, bias if bias is not None else out, out, ws, cnt,
                  trace if trace is not None else cnt, block_expert if block_expert is not None else cnt, m, n, k,
                  out.stride(0), grid.whole, experts, G=group_size, HAS_BIAS=bias is not None, SPLIT=grid.split,
                  STAGES=grid.stages, S_PLANE=s_plane, PRODUCER=grid.producer, RAWQ=grid.rawq,
                  TRACE=trace is not None, GROUPED=block_expert is not None, num_warps=grid.warps, **extra)


_resident: dict = {}  # (device, dtypes, tile, ...) -> programs that run at once


def resident_programs(x2, qweight, scales, zeros, bias, out, *, n: int, k: int, group_size: int, bits: int,
                      grid: WgmmaGrid) -> int:
    """How many programs of this launch run at once on x's GPU: SMs x the CTAs per SM that the compiled
    kernel's registers, shared memory and threads allow (compiled, not run, the first time; then cached)."""
    grid = replace(grid, split=1, whole=0)  # the whole tiles are what fill the waves
    key = (x2.device, x2.dtype, scales.dtype, out.dtype, bias is not None, group_size, bits, grid,
           scale_zero_planes(scales, zeros)[2])
    if key not in _resident:
        kernel = _run(x2, qweight, scales, zeros, bias, out, out, out, n, k, group_size, bits, grid, warmup=True)
        try:
            kernel._init_handles()  # loading the binary is what reads its register count
        except OutOfResources:  # (a ring too deep for this GPU: none fit; the launcher retries with fewer stages)
            _resident[key] = 0
            return 0
        props = torch.cuda.get_device_properties(x2.device)
        warp_regs = cdiv(kernel.n_regs * 32, 256) * 256  # registers go to warps in blocks of 256
        warps = kernel.metadata.num_warps  # (with a producer warp: whole warpgroups)
        per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * warps),
                     getattr(props, "shared_memory_per_multiprocessor", 233472) // (kernel.metadata.shared + 1024),
                     getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps), 32)
        _resident[key] = props.multi_processor_count * max(1, per_sm)
    return _resident[key]


def launch_wgmma(x2, qweight, scales, zeros, bias, out, ws, cnt, *, n: int, k: int, group_size: int, bits: int,
                 grid: WgmmaGrid, trace: torch.Tensor | None = None, block_expert: torch.Tensor | None = None,
                 launch=None) -> torch.Tensor:
    """out (M, N) = x2 (M, K) @ W.T (+ bias) for ``bits``-bit weights in quantpack's layout. When grid.split > 1,
    ws holds grid.split x grid.split_tiles float32 blocks of BLOCK_N x BLOCK_M and cnt one int32 (zero) per split
    tile. ``trace`` (int64, 16 per program, zeroed): each program records its timeline (_stamp). ``block_expert`` (MoE;
    no bias or split, K % BLOCK_K == 0): block b of BLOCK_M rows times expert ``block_expert[b]`` (E or more: rows
    left as they were) of qweight (E, K/2, N), scales (E, K/G, N). ``launch``: in place of launch_plan.launch."""
    _run(x2, qweight, scales, zeros, bias, out, ws, cnt, n, k, group_size, bits, grid, trace=trace,
         block_expert=block_expert, launch=launch)
    return out
