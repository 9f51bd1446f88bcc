"""Hopper (sm_90) W4A8-FP8 GEMM on asynchronous warpgroup MMA (Gluon): the 4-bit codes as FP8 e4m3 in registers.

The arithmetic of w4a8.py (per-token FP8 e4m3 activations ``xq`` with scale ``xs[m]`` and per-K-step sums ``xsum``;
the codes 0..15, exact in e4m3; per K step ``acc += s[g, n] * (q . xq) - (z * s)[g, n] * xsum[m, step]``; finally
``out = acc * xs[m] (+ bias)``) on the schedule of wgmma_mm.py: each program computes a (BLOCK_N x BLOCK_M) tile of
``out^T = W xq^T``, the weight's rows on the wgmma M side, xq's on its N side.

- TMA copies each K step's xq tile (BLOCK_M, BLOCK_K) and packed bytes (BLOCK_K / 2, BLOCK_N, read as 16-bit words:
  the bytes of weight rows 2p, 2p + 1) into a ring of STAGES slots, issued by the MMA warps as each slot is consumed
  or, with PRODUCER, by one extra warp (Gluon ``warp_specialize``; 6% slower on an H100: this Triton gives the MMA
  warps none of its warpgroup's registers, so two programs per SM leave them 128).
- The MMA warps load the words of the A fragment they own, mask each nibble into a byte of its own (_CODES: half an
  instruction per code; a nibble n alone in a byte is the e4m3 value n * 2**-9, exactly), and start an FP8 wgmma (A
  from registers, xq's tile as B, K-major) into a fresh accumulator; the step's scale and zero rows and xsum column
  load meanwhile, the scales times 2**9.
- The quantizer writes each K step's in-features as the step's even ones, then its odd ones (w4a8.py), so a
  packed byte's low nibble meets column j and its high nibble column BLOCK_K / 2 + j of the same step: each thread
  owns both nibbles of every byte it reads (columns 4t..4t+3 + 16i of the e4m3 fragment, k_width 4).
- Each step's MMA is waited for and folded before the next step's operand is built: two resident programs per SM
  (four MMA warps each, up to 248 registers per thread) overlap one's folds and conversions with the other's MMAs.

The weight's rows reach the MMA permuted as in wgmma_mm.py (rows 16w + 2g + b as MMA rows 16w + 8b + g, so a
thread's two rows are one 16-bit load); the epilogue undoes it. Gluon has no interpreter: CI compiles the kernel
for sm_90 (tests/kernels/sm90_compile_w4a8.py) and the GPU tests check it against the reference.
"""
from __future__ import annotations

import functools

import torch

from . import launch_plan
from .dequant import cdiv, on_device
from .wgmma_mm import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .wgmma_mm import cta_barrier, store_out, tma_load, vector_layout, weight_rows

__all__ = ["w4a8_wgmma_fits", "w4a8_wgmma_matmul", "descriptor_types", "block_k"]

if HAVE_GLUON:
    # Four 16-bit words (pack=4: $4 = words j, j+1; $5 = j+2, j+3), each the bytes of weight rows r (low byte) and
    # r + 1 at pair row j, -> four registers of four e4m3 codes: $0 row r's low nibbles (j..j+3), $1 its high ones,
    # $2, $3 row r + 1's. A nibble n alone in a byte is the e4m3 value n * 2**-9 (0..7 subnormal, 8..15 in the lowest
    # binade: exact), so the codes are the nibbles masked in place; the fold multiplies the scales by 2**9 (CODE_UNIT).
    # Two PRMTs gather each row's bytes, then a mask and a shift-and-mask per register: 8 instructions per 16 codes.
    _CODES = gl.constexpr(
        "{ .reg .b32 b, c; "
        "prmt.b32 b, $4, $5, 0x6420; prmt.b32 c, $4, $5, 0x7531; "
        "and.b32 $0, b, 0x0F0F0F0F; shr.b32 b, b, 4; and.b32 $1, b, 0x0F0F0F0F; "
        "and.b32 $2, c, 0x0F0F0F0F; shr.b32 c, c, 4; and.b32 $3, c, 0x0F0F0F0F; }")
    CODE_UNIT = gl.constexpr(512.0)  # (the codes reach the MMA as n * 2**-9)

    @gluon.constexpr_function
    def _words_layout(BN, BK, num_warps):
        """Registers of the packed tile read as (BN/2, BK/2) 16-bit words [p, j]: a thread holds pair rows
        4t..4t+3 + 16i (its e4m3 fragment's columns, k_width 4) of word p = 8w + g (weight rows 16w + 2g + {0, 1},
        MMA rows 16w + g and 16w + g + 8)."""
        reg = [[0, 1], [0, 2]] + [[0, 16 << i] for i in range((BK // 32).bit_length() - 1)]
        warps = [[8 << i, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warps, block_bases=[], shape=[BN // 2, BK // 2])

    @gluon.jit
    def _halves(lo, hi):
        """(P, J) codes of the low and high nibbles -> (P, 2J): columns j, then J + j."""
        P: gl.constexpr = lo.shape[0]
        J: gl.constexpr = lo.shape[1]
        return gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (P, 2 * J))

    @gluon.jit
    def _codes_operand(q_smem, a_layout: gl.constexpr):
        """The step's (BK/2, BN/2) words as the e4m3 A operand (BN, BK) of wgmma, in MMA-row order."""
        BN: gl.constexpr = 2 * q_smem.shape[1]
        BK: gl.constexpr = 2 * q_smem.shape[0]
        WARPS: gl.constexpr = a_layout.parent.warps_per_cta[0]
        words = q_smem.permute((1, 0)).load(_words_layout(BN, BK, WARPS))
        r_lo, r_hi, s_lo, s_hi = gl.inline_asm_elementwise(_CODES, "=r,=r,=r,=r,r,r", (words, ),
                                                           dtype=(gl.int8, gl.int8, gl.int8, gl.int8),
                                                           is_pure=True, pack=4)
        t = gl.join(_halves(r_lo, r_hi), _halves(s_lo, s_hi))  # (P, BK, b): weight rows 2p + b
        t = gl.permute(gl.reshape(t, (BN // 16, 8, BK, 2)), (0, 3, 1, 2))  # (w, b, g, k)
        a = gl.reshape(t, (BN, BK)).to(gl.float8e4nv, bitcast=True)
        # (a relabelling: the codes already sit in the fragment's registers; a layout change through shared memory
        # would cost more than the MMA, so it is a compile error)
        return gl.convert_layout(a, a_layout, assert_trivial=True)

    @gluon.jit
    def _mma_weight_rows(BN: gl.constexpr, layout: gl.constexpr):
        """The weight row (within the tile) of each MMA row 16w + 8b + g: 16w + 2g + b."""
        r = gl.arange(0, BN, layout=layout)
        return (r // 16) * 16 + (r % 8) * 2 + (r // 8) % 2

    @gluon.jit
    def _step_meta(s_ptr, z_ptr, xsum_ptr, i, n0, m0, M, N, BK: gl.constexpr, G: gl.constexpr,
                   acc_layout: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr):
        """K step i's scales s[g, n] times CODE_UNIT (the MMA's codes are n * 2**-9), s * z (MMA-row order) and
        xsum[i, m] (the sums of its quantized x)."""
        n = n0 + _mma_weight_rows(BN, gl.SliceLayout(1, acc_layout))
        g = (i * BK) // G
        nmask = n < N
        s = gl.load(s_ptr + g * N + n, mask=nmask, other=0.0).to(gl.float32)
        zs = gl.load(z_ptr + g * N + n, mask=nmask, other=0.0).to(gl.float32) * s
        m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        xsum = gl.load(xsum_ptr + i * M + m, mask=m < M, other=0.0)
        return s * CODE_UNIT, zs, xsum

    @gluon.jit
    def _fold(acc, part, s, zs, xsum):
        return acc + s[:, None] * part - zs[:, None] * xsum[None, :]

    @gluon.jit
    def _issue(x_desc, q_desc, x_s, q_s, bar, step, slot, m0, n0, pred):
        """Start the TMA copies of K step ``step`` (xq's tile, the packed words) into ring slot ``slot``."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        mbarrier.expect(bar, x_desc.block_type.nbytes + q_desc.block_type.nbytes, pred=pred)
        tma_load(x_desc, [m0, step * BK], bar, x_s.index(slot), pred=pred)
        tma_load(q_desc, [step * (BK // 2), n0 // 2], bar, q_s.index(slot), pred=pred)

    @gluon.jit
    def _load_ring(x_desc, q_desc, x_s, q_s, ready, empty, steps, m0, n0, STAGES: gl.constexpr):
        """The producer warp: each K step's copies into its ring slot, once the MMA warps have released it."""
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            _issue(x_desc, q_desc, x_s, q_s, ready.index(slot), i, slot, m0, n0, True)

    @gluon.jit
    def _start_step(x_s, q_s, ready, i, STAGES: gl.constexpr, a_layout: gl.constexpr, acc_layout: gl.constexpr):
        """Wait for K step i's copies, build its A operand and start its MMA into a fresh accumulator."""
        BN: gl.constexpr = 2 * q_s.shape[2]
        BM: gl.constexpr = x_s.shape[1]
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a = _codes_operand(q_s.index(slot), a_layout)
        # (use_acc=False over zeros: no instruction defines the accumulator's registers before the MMA does)
        return warpgroup_mma(a, x_s.index(slot).permute((1, 0)), gl.zeros((BN, BM), gl.float32, acc_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _release(ring, i, steps, STAGES: gl.constexpr, PRODUCER: gl.constexpr):
        """Step i's MMA is done: hand its slot to the producer warp, or (without one) refill it with step
        i + STAGES once every MMA warp is past it."""
        x_desc, q_desc, x_s, q_s, ready, empty, m0, n0 = ring
        fence_async_shared()  # (the slot's words were read by ordinary loads: before the TMA that refills it)
        if PRODUCER:
            mbarrier.arrive(empty.index(i % STAGES))
        else:
            cta_barrier()
            _issue(x_desc, q_desc, x_s, q_s, ready.index(i % STAGES), i + STAGES, i % STAGES, m0, n0,
                   i + STAGES < steps)

    @gluon.jit
    def _consume_ring(ring, steps, s_ptr, z_ptr, xsum_ptr, M, N, G: gl.constexpr, STAGES: gl.constexpr,
                      PRODUCER: gl.constexpr, a_layout: gl.constexpr, acc_layout: gl.constexpr):
        """The MMA warps' K loop: per step, its operand, its MMA into a fresh accumulator (the scales and sums load
        meanwhile), waited for, then folded. Starting the next step's MMA before folding this one's (two accumulators
        in flight, two static MMA sites) spills at 128 rows of x; at 64 rows it ran 0.58-0.61x cuBLAS bf16 on an H100
        at M >= 1024, against this loop's 0.72-0.86x. Returns (accumulator in MMA-row order, before xq's scale,)."""
        x_desc, q_desc, x_s, q_s, ready, empty, m0, n0 = ring
        BK: gl.constexpr = x_s.shape[2]
        BN: gl.constexpr = 2 * q_s.shape[2]
        BM: gl.constexpr = x_s.shape[1]
        acc = gl.zeros((BN, BM), gl.float32, acc_layout)
        for i in range(steps):
            part = _start_step(x_s, q_s, ready, i, STAGES, a_layout, acc_layout)
            s, zs, xsum = _step_meta(s_ptr, z_ptr, xsum_ptr, i, n0, m0, M, N, BK, G, acc_layout, BN, BM)
            part = warpgroup_mma_wait(0, deps=(part, ))
            _release(ring, i, steps, STAGES, PRODUCER)
            acc = _fold(acc, part, s, zs, xsum)
        return (acc, )

    @gluon.jit
    def _w4a8_wgmma_kernel(x_desc, q_desc, s_ptr, z_ptr, xsum_ptr, xs_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                           G: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                           PRODUCER: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = 2 * q_desc.block_type.shape[1]
        pid = gl.program_id(0)
        tiles_n = (N + BN - 1) // BN
        n0 = pid % tiles_n * BN
        m0 = pid // tiles_n * BM
        steps = K // BK

        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BM, 32])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)

        x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        ring = (x_desc, q_desc, x_s, q_s, ready, empty, m0, n0)
        if PRODUCER:
            acc = gl.warp_specialize([(_consume_ring, (ring, steps, s_ptr, z_ptr, xsum_ptr, M, N, G, STAGES, PRODUCER,
                                                       a_layout, acc_layout)),
                                      (_load_ring, (x_desc, q_desc, x_s, q_s, ready, empty, steps, m0, n0, STAGES))],
                                     [1], [24])[0]
        else:
            for i in gl.static_range(STAGES):
                _issue(x_desc, q_desc, x_s, q_s, ready.index(i), i, i, m0, n0, i < steps)
            acc = _consume_ring(ring, steps, s_ptr, z_ptr, xsum_ptr, M, N, G, STAGES, PRODUCER, a_layout, acc_layout)[0]
        # (before the epilogue: its layout change reuses the ring's shared memory; see wgmma_mm.py)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

        m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        acc = acc * gl.load(xs_ptr + m, mask=m < M, other=0.0)[None, :]
        if HAS_BIAS:  # (in float32, before the one rounding to out's dtype)
            n = n0 + _mma_weight_rows(BN, gl.SliceLayout(1, acc_layout))
            acc += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)[:, None]
        o_layout: gl.constexpr = vector_layout(BN, BM, 8 if out_ptr.dtype.element_ty.primitive_bitwidth == 16 else 4,
                                                num_warps)
        tile = gl.convert_layout(weight_rows(acc.to(out_ptr.dtype.element_ty)), o_layout)
        store_out(tile, n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, o_layout)),
                   m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, o_layout)), M, N, out_ptr, stride_om)


def block_k(group_size: int) -> int:
    """In-features per K step: 128 where it divides the group, else 64 (a step never straddles two groups)."""
    return 128 if group_size % 128 == 0 else 64


def w4a8_wgmma_fits(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int,
                    k: int, group_size: int) -> bool:
    """What the TMA copies need beyond w4a8.w4a8_layout_fits (the caller checks the GPU): Gluon in this Triton,
    groups of at least 64, rows of 16 bytes (N % 16 and K % 16), 16-byte aligned packed codes."""
    return (HAVE_GLUON and group_size >= 64 and k % block_k(group_size) == 0 and n % 16 == 0 and k % 16 == 0
            and qweight.is_contiguous() and qweight.data_ptr() % 16 == 0 and scales.is_contiguous()
            and zeros.is_contiguous())


@functools.lru_cache(maxsize=64)
def _layouts(block_m: int, block_n: int, bk: int):
    return (([block_m, bk], gl.NVMMASharedLayout.get_default_for([block_m, bk], gl.float8e4nv)),
            ([bk // 2, block_n // 2], gl.NVMMASharedLayout.get_default_for([bk // 2, block_n // 2], gl.int16)))


def descriptor_types(block_m: int, block_n: int, bk: int) -> dict:
    """The kernel's descriptor arguments as Triton signature strings (compiling without a GPU)."""
    (xb, xl), (qb, ql) = _layouts(block_m, block_n, bk)
    return {"x_desc": f"tensordesc<fp8e4nv{xb},{xl!r}>", "q_desc": f"tensordesc<i16{qb},{ql!r}>"}


def maxnreg(block_m: int, warps: int, producer: bool) -> int:
    """The register limit: two programs per SM up to 128 rows of x with four MMA warps, else what one program per SM
    may have. A producer warp counts as a whole warpgroup (and this Triton hands the MMA warps none of its registers:
    its PTX has no setmaxnreg)."""
    total = warps + (4 if producer else 0)
    per_sm = 2 if warps == 4 and block_m <= 128 else 1
    return min(248, 65536 // (32 * total * per_sm) // 8 * 8)


def w4a8_wgmma_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum_t: torch.Tensor, qweight: torch.Tensor,
                      scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *,
                      n: int, k: int, group_size: int, block_m: int = 128, block_n: int = 64, stages: int = 4,
                      producer: bool = False) -> torch.Tensor:
    """``out`` (M, N) from xq (M, K) e4m3 in K steps of :func:`block_k` (each step's even in-features, then its odd
    ones), its row scales ``xs`` (M,) and per-step sums ``xsum_t`` (K / block_k, M), and the packed 4-bit weight."""
    m = xq.shape[0]
    bk = block_k(group_size)
    (xb, xl), (qb, ql) = _layouts(block_m, block_n, bk)
    x_desc = TensorDescriptor.from_tensor(xq, xb, xl)
    q_desc = TensorDescriptor.from_tensor(qweight.view(torch.int16), qb, ql)
    grid = (cdiv(n, block_n) * cdiv(m, block_m), )
    with on_device(xq):
        launch_plan.launch(_w4a8_wgmma_kernel, grid, x_desc, q_desc, scales, zeros, xsum_t, xs,
                           bias if bias is not None else out, out, m, n, k, out.stride(0), G=group_size,
                           HAS_BIAS=bias is not None, STAGES=stages, PRODUCER=producer,
                           num_warps=block_n // 16, maxnreg=maxnreg(block_m, block_n // 16, producer))
    return out
