"""Decode GEMV for packed 4/8-bit weights: ``out (M, N) = x (M, K) @ W.T`` for small M, on CUDA
cores (``mixed_mm``'s ``gemv`` path; one program row per row of x).

At M = 1 the product is bandwidth-bound, and on Hopper the integer unpacking costs about as much
as streaming the bytes, so both must overlap and neither may waste instructions:

* each program walks its K range in steps of ``BLOCK_R`` pair rows (2 in-features each) that lie in
  one group, and issues the next step's loads (weights, x, scale and zero rows) before doing this
  step's math, so every warp keeps a step of weights in flight while it computes;
* each nibble becomes the float ``128 + q`` with one shift and one LOP3 onto bits 16..19 of 128.0
  (8-bit: ``256 + q`` on bits 15..22 of 256.0), no int-to-float conversion; the row reduction
  ``d = sum(x (128 + q))`` stays inside each thread (wide tiles, rows in registers), and the group's
  scale and zero are applied once per column: ``s d - s (z + 128) sum(x)``;
* ``WORDS`` (4-bit, N % 4 == 0) reads int32 words of 4 columns, so no byte extraction either;
* split-K over programs: partial rows go to a float32 workspace and the last program of a column
  tile (an arrival counter, reset by that program) sums them in one 2-D load, so results are
  deterministic and one launch does everything (CUDA-graph friendly).

benchmarks/NOTES.md (v4) has what each of these measured on an H200.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _magic_f32(v, SHIFT: tl.constexpr, MASK: tl.constexpr, BASE: tl.constexpr):
    """BASE + (the bit field of ``v`` that lands under MASK after shifting left by SHIFT), as float32."""
    if SHIFT >= 0:
        v = v << SHIFT
    else:
        v = v >> (-SHIFT)
    return ((v & MASK) | BASE).to(tl.float32, bitcast=True)


@triton.jit
def _load_step(x_row, qw_ptr, s_ptr, z_ptr, r0, n, N, K, stride_xk,
               BITS: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr, G: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Every load of one step of pair rows ``r0 ..``: the packed tile, x's even and odd in-features,
    and the group's scale and zero rows."""
    r = r0 + tl.arange(0, BLOCK_R)
    ke = 2 * r
    ko = 2 * r + 1
    n_mask = n < N
    g = (2 * r0) // G
    if BITS == 4:
        if WORDS:
            c = tl.program_id(0) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
            ptrs = qw_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * (N // 4) + c[None, :]
            t_mask = (ke < K)[:, None] & (c < N // 4)[None, :]
        else:
            ptrs = qw_ptr + r[:, None] * N + n[None, :]
            t_mask = (ke < K)[:, None] & n_mask[None, :]
        if EVEN:
            q_lo = tl.load(ptrs)
        else:
            q_lo = tl.load(ptrs, mask=t_mask, other=0)
        q_hi = q_lo
    else:  # 8-bit: even and odd in-features are separate byte rows
        if EVEN:
            q_lo = tl.load(qw_ptr + ke[:, None] * N + n[None, :])
            q_hi = tl.load(qw_ptr + ko[:, None] * N + n[None, :])
        else:
            q_lo = tl.load(qw_ptr + ke[:, None] * N + n[None, :], mask=(ke < K)[:, None] & n_mask[None, :], other=0)
            q_hi = tl.load(qw_ptr + ko[:, None] * N + n[None, :], mask=(ko < K)[:, None] & n_mask[None, :], other=0)
    if EVEN:
        s = tl.load(s_ptr + g * N + n)
        z = tl.load(z_ptr + g * N + n)
        xe = tl.load(x_row + ke * stride_xk)
        xo = tl.load(x_row + ko * stride_xk)
    else:
        # a program whose range ends past K (split rounded up) reads nothing there: s = 0
        meta_mask = n_mask & (2 * r0 + tl.zeros_like(n) < K)
        s = tl.load(s_ptr + g * N + n, mask=meta_mask, other=0.0)
        z = tl.load(z_ptr + g * N + n, mask=meta_mask, other=0.0)
        xe = tl.load(x_row + ke * stride_xk, mask=ke < K, other=0.0)
        xo = tl.load(x_row + ko * stride_xk, mask=ko < K, other=0.0)
    return q_lo, q_hi, s, z, xe, xo


@triton.jit
def _word_column(q, xe, xo, SH_LO: tl.constexpr, SH_HI: tl.constexpr):
    """sum over rows of x (128 + q) for column 4c + j of a word tile (lo nibble at bit 8j, hi at 8j + 4)."""
    v_lo = _magic_f32(q, SH_LO, 0x000F0000, 0x43000000)
    v_hi = _magic_f32(q, SH_HI, 0x000F0000, 0x43000000)
    return tl.sum(xe[:, None] * v_lo + xo[:, None] * v_hi, axis=0)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                 N, K, stride_xm, stride_xk, stride_om, stride_on,
                 BITS: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr, WORDS: tl.constexpr,
                 EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, STEPS: tl.constexpr,
                 SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    OFFSET: tl.constexpr = 128.0 if BITS == 4 else 256.0
    r_begin = pid_s * STEPS * BLOCK_R
    x_row = x_ptr + pid_m * stride_xm
    if WORDS:
        BW: tl.constexpr = BLOCK_N // 4
        # column 4c + j accumulates in a_j; its scale/zero are the strided rows s[4c + j]
        nw = pid_n * BLOCK_N + 4 * tl.arange(0, BW)
        a0 = tl.zeros((BW,), dtype=tl.float32)
        a1 = tl.zeros((BW,), dtype=tl.float32)
        a2 = tl.zeros((BW,), dtype=tl.float32)
        a3 = tl.zeros((BW,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    nxt = _load_step(x_row, qw_ptr, s_ptr, z_ptr, r_begin, n, N, K, stride_xk, BITS, WORDS, EVEN, G, BLOCK_N, BLOCK_R)
    for i in range(STEPS):
        r0 = r_begin + i * BLOCK_R
        q_lo, q_hi, s, z, xe, xo = nxt
        # the next step's loads go out before this step's math (the last step re-reads itself)
        nxt = _load_step(x_row, qw_ptr, s_ptr, z_ptr, r_begin + tl.minimum(i + 1, STEPS - 1) * BLOCK_R, n, N, K,
                         stride_xk, BITS, WORDS, EVEN, G, BLOCK_N, BLOCK_R)
        xe = xe.to(tl.float32)
        xo = xo.to(tl.float32)
        sx = tl.sum(xe + xo, axis=0)
        if WORDS:
            g_row = (2 * r0) // G * N + nw
            wm = (nw < N) & (2 * r0 + tl.zeros_like(nw) < K)
            d0 = _word_column(q_lo, xe, xo, 16, 12)
            d1 = _word_column(q_lo, xe, xo, 8, 4)
            d2 = _word_column(q_lo, xe, xo, 0, -4)
            d3 = _word_column(q_lo, xe, xo, -8, -12)
            s0 = tl.load(s_ptr + g_row, mask=wm, other=0.0).to(tl.float32)
            s1 = tl.load(s_ptr + g_row + 1, mask=wm, other=0.0).to(tl.float32)
            s2 = tl.load(s_ptr + g_row + 2, mask=wm, other=0.0).to(tl.float32)
            s3 = tl.load(s_ptr + g_row + 3, mask=wm, other=0.0).to(tl.float32)
            z0 = tl.load(z_ptr + g_row, mask=wm, other=0.0).to(tl.float32)
            z1 = tl.load(z_ptr + g_row + 1, mask=wm, other=0.0).to(tl.float32)
            z2 = tl.load(z_ptr + g_row + 2, mask=wm, other=0.0).to(tl.float32)
            z3 = tl.load(z_ptr + g_row + 3, mask=wm, other=0.0).to(tl.float32)
            a0 += s0 * d0 - (z0 + OFFSET) * s0 * sx
            a1 += s1 * d1 - (z1 + OFFSET) * s1 * sx
            a2 += s2 * d2 - (z2 + OFFSET) * s2 * sx
            a3 += s3 * d3 - (z3 + OFFSET) * s3 * sx
        else:
            q_lo = q_lo.to(tl.int32)
            q_hi = q_hi.to(tl.int32)
            if BITS == 4:
                v_lo = _magic_f32(q_lo, 16, 0x000F0000, 0x43000000)  # 128 + low nibble
                v_hi = _magic_f32(q_hi, 12, 0x000F0000, 0x43000000)  # 128 + high nibble
            else:
                v_lo = _magic_f32(q_lo, 15, 0x007F8000, 0x43800000)  # 256 + byte
                v_hi = _magic_f32(q_hi, 15, 0x007F8000, 0x43800000)
            d = tl.sum(xe[:, None] * v_lo + xo[:, None] * v_hi, axis=0)
            s = s.to(tl.float32)
            acc += s * d - (z.to(tl.float32) + OFFSET) * s * sx
    if WORDS:
        acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_N,))  # [c, i, p] -> 4c + 2i + p
    out_row = out_ptr + pid_m * stride_om
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_row + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        # publish the partial row, count arrivals; the last program sums all partials and stores
        tile = pid_m * tl.num_programs(0) + pid_n
        ws_row = ws_ptr + pid_m * SPLIT * N
        tl.store(ws_row + pid_s * N + n, acc, mask=n_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            sp = tl.arange(0, SPLIT)
            parts = tl.load(ws_row + sp[:, None] * N + n[None, :], mask=n_mask[None, :], other=0.0,
                            cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            if HAS_BIAS:
                total += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_row + n * stride_on, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def gemv_grid(m: int, n: int, k: int, block_n: int, block_r: int, split: int) -> tuple[int, int, int]:
    """(steps per program, split, column tiles): the split is rounded so every program gets the same
    number of steps, then up to a power of two (the last program sums the partials in one 2-D load)."""
    steps_total = triton.cdiv(triton.cdiv(k, 2), block_r)
    steps = triton.cdiv(steps_total, max(1, split))
    split = triton.cdiv(steps_total, steps)
    if split > 1:
        split = triton.next_power_of_2(split)
    return steps, split, triton.cdiv(n, block_n)


def launch_gemv(x2, qweight, scales, zeros, bias, out, workspace, counters, *, n: int, k: int, group_size: int,
                bits: int, block_n: int, block_r: int, split: int, words: bool, num_warps: int) -> None:
    """Run ``_gemv_kernel``: ``out = x2 @ W.T (+ bias)``. ``workspace`` (M, split, N) float32 and
    ``counters`` (M * column tiles) int32, zero at rest, are used when ``split > 1``; ``split``
    must come from :func:`gemv_grid`. Needs groups along K with ``group_size % (2 * block_r) == 0``."""
    m = x2.shape[0]
    steps, split_, tiles_n = gemv_grid(m, n, k, block_n, block_r, split)
    assert split_ == split, "split must come from gemv_grid"
    words = words and bits == 4 and n % 4 == 0 and qweight.storage_offset() % 4 == 0
    even = n % block_n == 0 and k == 2 * block_r * steps * split  # tiles cover N and K exactly: no masks
    _gemv_kernel[(tiles_n, split, m)](
        x2, qweight, scales, zeros, bias if bias is not None else out, out, workspace, counters,
        n, k, x2.stride(0), x2.stride(1), out.stride(0), out.stride(1),
        BITS=bits, G=group_size, HAS_BIAS=bias is not None, WORDS=words, EVEN=even,
        BLOCK_N=block_n, BLOCK_R=block_r, STEPS=steps, SPLIT=split, num_warps=num_warps, num_stages=1)
