"""Hopper (sm_90) 4-bit x bf16/fp16 GEMM on asynchronous warpgroup MMA (Gluon).

Each program computes a (BLOCK_N x BLOCK_M) tile of ``out^T = W x^T``: the weight's rows fill the
wgmma M side (64 per warpgroup), x's rows its N side (8..256), so 16-row batches waste nothing.
Per K step of BLOCK_K in-features:

- TMA copies x's (BLOCK_M, BLOCK_K) tile, the packed (BLOCK_K / 2, BLOCK_N) bytes and the step's
  scale and zero rows into a ring of STAGES shared-memory slots (one mbarrier each);
- the warps unpack and dequantize the bytes in registers (float32 FMA, then x's dtype: the
  reference's rounding) and store the (BLOCK_K, BLOCK_N) tile into one of two shared buffers;
- an asynchronous wgmma multiplies it (A, N-major) by x's tile (B, K-major), and the program moves
  on to dequantize the next step while it runs; waiting for one MMA in flight frees the buffers
  and the ring slot that the next TMA refills.

Triton's own pipeliner cannot overlap a dequantized operand with its MMA (benchmarks/NOTES.md v5);
Gluon states the schedule explicitly. Split-K partials are summed by the last program to arrive, as
in the other paths. The kernel needs a GPU with wgmma (compute capability 9.x); the interpreter
cannot run Gluon, so CI compiles it for sm_90 and the GPU tests check it against the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

try:  # Gluon ships with Triton >= 3.4; without it the path is simply unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "WgmmaGrid", "descriptor_types", "wgmma_usable", "wgmma_grid", "launch_wgmma"]

if HAVE_GLUON:
    # one CTA-wide barrier, whatever this Triton calls it (3.6: thread_barrier, 3.9: barrier)
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # the TMA load, whatever this Triton calls it (3.6: async_copy_global_to_shared, 3.9: async_load)
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    # 4 packed bytes (columns n..n+3 of one pair row) -> their 8 weights as x's 16-bit dtype, two per
    # register: each nibble is moved to bits 16-19 and OR-ed into 1.0f, so the float is 1 + q / 128
    # exactly; one FMA with S = 128 s and C = -(128 + z) s gives (q - z) s in float32 (the error, about
    # 2**-15 s, is far below the 16-bit rounding that follows). 27 instructions per 8 weights.
    _NIBBLES = ("shl.b32 t, $4, 16; lop3.b32 v0, t, 0x000F0000, 0x3F800000, 0xEA; "
                "shl.b32 t, $4, 12; lop3.b32 v1, t, 0x000F0000, 0x3F800000, 0xEA; "
                "shl.b32 t, $4, 8; lop3.b32 v2, t, 0x000F0000, 0x3F800000, 0xEA; "
                "shl.b32 t, $4, 4; lop3.b32 v3, t, 0x000F0000, 0x3F800000, 0xEA; "
                "lop3.b32 v4, $4, 0x000F0000, 0x3F800000, 0xEA; "
                "shr.b32 t, $4, 4; lop3.b32 v5, t, 0x000F0000, 0x3F800000, 0xEA; "
                "shr.b32 t, $4, 8; lop3.b32 v6, t, 0x000F0000, 0x3F800000, 0xEA; "
                "shr.b32 t, $4, 12; lop3.b32 v7, t, 0x000F0000, 0x3F800000, 0xEA; "
                "fma.rn.f32 f0, v0, $5, $9; fma.rn.f32 f1, v1, $5, $9; fma.rn.f32 f2, v2, $6, $10; "
                "fma.rn.f32 f3, v3, $6, $10; fma.rn.f32 f4, v4, $7, $11; fma.rn.f32 f5, v5, $7, $11; "
                "fma.rn.f32 f6, v6, $8, $12; fma.rn.f32 f7, v7, $8, $12; ")
    _PACK = "{cvt} $0, f2, f0; {cvt} $1, f6, f4; {cvt} $2, f3, f1; {cvt} $3, f7, f5; }}"
    _REGS = "{ .reg .b32 t, v0, v1, v2, v3, v4, v5, v6, v7; .reg .f32 f0, f1, f2, f3, f4, f5, f6, f7; "
    _DEQUANT_BF16 = gl.constexpr(_REGS + _NIBBLES + _PACK.format(cvt="cvt.rn.bf16x2.f32"))
    _DEQUANT_FP16 = gl.constexpr(_REGS + _NIBBLES + _PACK.format(cvt="cvt.rn.f16x2.f32"))

    @gluon.jit
    def _dequant_tile(q, s, z, DTYPE: gl.constexpr):
        """(BK/2, BN) packed bytes and (1, BN) scale/zero rows -> (BK, BN) weights in DTYPE: row
        2r from byte r's low nibble, 2r + 1 from its high nibble, (q - z) * s in float32."""
        S, _ = gl.broadcast(s * 128.0, q)
        C, _ = gl.broadcast(-(z * s) - s * 128.0, q)
        if DTYPE == gl.bfloat16:
            lo, hi = gl.inline_asm_elementwise(_DEQUANT_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [q, S, C],
                                               dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = gl.inline_asm_elementwise(_DEQUANT_FP16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [q, S, C],
                                               dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        w = gl.permute(gl.join(lo, hi), (0, 2, 1))  # (BK/2, 2, BN): rows 2r, 2r + 1 adjacent
        return gl.reshape(w, (2 * q.shape[0], q.shape[1]))

    @gluon.jit
    def _issue_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, bars, step, slot, m0, n0,
                    G: gl.constexpr, pred):
        """Start the TMA copies of K step ``step`` into ring slot ``slot`` (skipped when not pred)."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        bar = bars.index(slot)
        nbytes: gl.constexpr = (x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
        mbarrier.expect(bar, nbytes, pred=pred)
        k0 = step * BK
        _tma_load(x_desc, [m0, k0], bar, x_s.index(slot), pred=pred)
        _tma_load(q_desc, [k0 // 2, n0], bar, q_s.index(slot), pred=pred)
        _tma_load(s_desc, [k0 // G, n0], bar, s_s.index(slot), pred=pred)
        _tma_load(z_desc, [k0 // G, n0], bar, z_s.index(slot), pred=pred)

    @gluon.jit
    def _mma_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, w_s, bars, first, i, steps, m0, n0, acc, use_acc,
                  G: gl.constexpr, STAGES: gl.constexpr, q_layout: gl.constexpr):
        """K step i: wait for its copies, dequantize into a shared buffer, start its MMA, retire the
        previous MMA, and refill the ring slot that one read with step i + STAGES - 1."""
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        q = q_s.index(slot).load(q_layout)
        s = s_s.index(slot).load(q_layout).to(gl.float32)
        z = z_s.index(slot).load(q_layout).to(gl.float32)
        w = _dequant_tile(q, s, z, x_desc.dtype)
        buf = w_s.index(i % 2)  # the MMA two steps back read it; the previous step's wait retired that one
        buf.store(w)
        fence_async_shared()
        acc = warpgroup_mma(buf.permute((1, 0)), x_s.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
        # at most this step's MMA in flight: the previous step's ring slot and buffer are free
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        nxt = i + STAGES - 1
        _issue_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, bars, first + nxt, nxt % STAGES, m0, n0, G,
                    nxt < steps)
        return acc

    @gluon.jit
    def _wgmma_kernel(x_desc, q_desc, s_desc, z_desc, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_om,
                      G: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = q_desc.block_type.shape[1]
        DTYPE: gl.constexpr = x_desc.dtype

        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_s = gl.program_id(2)
        n0 = pid_n * BN
        m0 = pid_m * BM
        total = (K + BK - 1) // BK
        per = (total + SPLIT - 1) // SPLIT
        first = pid_s * per
        steps = gl.minimum(per, total - first)

        # out^T tile in the wgmma accumulator: warps stacked along the weight's rows (16 each)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BM, 16])
        # packed bytes: 4 pair rows x 4 columns per thread (an int32 word per row, so each thread
        # derives the per-column FMA constants of 4 columns, not 16)
        q_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 4], threads_per_warp=[32 * 4 // BN, BN // 4],
                                                  warps_per_cta=[num_warps, 1], order=[1, 0])
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], DTYPE)

        x_s = gl.allocate_shared_memory(DTYPE, [STAGES, BM, BK], x_desc.layout)
        q_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BK // 2, BN], q_desc.layout)
        s_s = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, BN], s_desc.layout)
        z_s = gl.allocate_shared_memory(z_desc.dtype, [STAGES, 1, BN], z_desc.layout)
        w_s = gl.allocate_shared_memory(DTYPE, [2, BK, BN], w_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        for i in gl.static_range(STAGES - 1):
            _issue_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, bars, first + i, i, m0, n0, G,
                        i < steps)

        # the first step is peeled and starts the accumulator (use_acc=False): a zero-filled accumulator
        # carried into the loop is registers that non-wgmma instructions define inside the MMA pipeline,
        # and ptxas then serializes every wgmma (C7515; the sm_90 compile test checks)
        acc = _mma_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, w_s, bars, first, 0, steps, m0, n0,
                        gl.zeros((BN, BM), gl.float32, acc_layout), False, G, STAGES, q_layout)
        for i in range(1, steps):
            acc = _mma_step(x_desc, q_desc, s_desc, z_desc, x_s, q_s, s_s, z_s, w_s, bars, first, i, steps, m0, n0,
                            acc, True, G, STAGES, q_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # epilogue: out[m, n] = acc[n, m]; threads run along n, out's contiguous dimension
        o_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[BN // 32, 1], threads_per_warp=[32, 1],
                                                  warps_per_cta=[1, num_warps], order=[0, 1])
        tile = gl.convert_layout(acc, o_layout)
        n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, o_layout))
        m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, o_layout))
        mask = (n < N)[:, None] & (m < M)[None, :]
        if SPLIT > 1:
            ws_off = m[None, :] * N + n[:, None]
            gl.store(ws_ptr + pid_s * M * N + ws_off, tile, mask=mask)
            _cta_barrier()
            counter = cnt_ptr + pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tile = gl.zeros((BN, BM), gl.float32, o_layout)
                for j in range(SPLIT):
                    tile += gl.load(ws_ptr + j * M * N + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                _store_tile(tile, n, m, mask, bias_ptr, out_ptr, stride_om, N, HAS_BIAS)
                gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        else:
            _store_tile(tile, n, m, mask, bias_ptr, out_ptr, stride_om, N, HAS_BIAS)

    @gluon.jit
    def _store_tile(tile, n, m, mask, bias_ptr, out_ptr, stride_om, N, HAS_BIAS: gl.constexpr):
        if HAS_BIAS:
            tile += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptr + m[None, :] * stride_om + n[:, None], tile.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class WgmmaGrid:
    """A launch: (BLOCK_M, BLOCK_N, BLOCK_K) tile, K split, ring depth, warps (4 per 64 weight rows)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    stages: int
    warps: int

    def programs(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(n, self.block_n), triton.cdiv(m, self.block_m), self.split


def wgmma_grid(m: int, n: int, k: int, group_size: int, block_m: int, block_n: int, block_k: int, split: int,
               stages: int) -> WgmmaGrid:
    """Clamp a tuned tile to this call: BLOCK_M to x's rows (a power of two, as TMA blocks are, 16 to 256),
    BLOCK_K to a divisor of the group (64 or 128 in-features), the split so that every program has at
    least one K step."""
    block_m = max(16, min(block_m, 256, triton.next_power_of_2(m)))
    block_k = 128 if block_k >= 128 and group_size % 128 == 0 else 64
    steps = triton.cdiv(k, block_k)
    split = max(1, min(split, steps))
    while split > 1 and (split - 1) * triton.cdiv(steps, split) >= steps:
        split -= 1
    return WgmmaGrid(block_m, block_n, block_k, split, max(2, stages), block_n // 16)


def wgmma_usable(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, k: int,
                 group_size: int, bits: int, axis: int) -> bool:
    """What the kernel's TMA copies and tiles need (the caller checks the GPU): 4-bit weights grouped along K
    in groups of 64 or a multiple of 128, 16-bit activations, 16-byte aligned bases and rows (K % 8, N % 16)."""
    aligned = all(t.data_ptr() % 16 == 0 for t in (x2, qweight, scales, zeros))
    return (HAVE_GLUON and bits == 4 and axis == 1 and (group_size == 64 or group_size % 128 == 0)
            and k % group_size == 0 and k % 8 == 0 and n % 16 == 0 and aligned
            and x2.dtype in (torch.bfloat16, torch.float16) and x2.stride(1) == 1 and x2.stride(0) % 8 == 0
            and scales.dtype == zeros.dtype and scales.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())


def _layouts(x_dtype: torch.dtype, s_dtype: torch.dtype, grid: WgmmaGrid):
    """Shared-memory layouts of the four TMA tiles: x (BM, BK), packed (BK/2, BN), scale and zero rows (1, BN)."""
    dt = gl.bfloat16 if x_dtype == torch.bfloat16 else gl.float16
    bm, bn, bk = grid.block_m, grid.block_n, grid.block_k
    row = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * s_dtype.itemsize, rank=2)
    return (([bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt)),
            ([bk // 2, bn], gl.NVMMASharedLayout.get_default_for([bk // 2, bn], gl.uint8)), ([1, bn], row), ([1, bn], row))


def descriptor_types(x_dtype: torch.dtype, s_dtype: torch.dtype, grid: WgmmaGrid) -> dict:
    """The kernel's descriptor arguments as Triton signature strings (compiling without a GPU)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    dtypes = (names[x_dtype], "u8", names[s_dtype], names[s_dtype])
    return {arg: f"tensordesc<{dt}{list(shape)},{layout!r}>"
            for arg, dt, (shape, layout) in zip(("x_desc", "q_desc", "s_desc", "z_desc"), dtypes,
                                                 _layouts(x_dtype, s_dtype, grid))}


def _descriptors(x2, qweight, scales, zeros, grid: WgmmaGrid):
    return tuple(TensorDescriptor.from_tensor(t, shape, layout)
                 for t, (shape, layout) in zip((x2, qweight, scales, zeros), _layouts(x2.dtype, scales.dtype, grid)))


def launch_wgmma(x2, qweight, scales, zeros, bias, out, ws, cnt, *, n: int, k: int, group_size: int,
                 grid: WgmmaGrid) -> torch.Tensor:
    """out (M, N) = x2 (M, K) @ W.T (+ bias); ws (split, M, N) float32 and cnt (one int32 per tile, zero)
    are used when grid.split > 1."""
    m = x2.shape[0]
    x_desc, q_desc, s_desc, z_desc = _descriptors(x2, qweight, scales, zeros, grid)
    _wgmma_kernel[grid.programs(m, n)](x_desc, q_desc, s_desc, z_desc, bias if bias is not None else out, out, ws,
                                       cnt, m, n, k, out.stride(0), G=group_size, HAS_BIAS=bias is not None,
                                       SPLIT=grid.split, STAGES=grid.stages, num_warps=grid.warps)
    return out
