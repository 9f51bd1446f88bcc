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
* ``WORDS`` (N % 4 == 0) reads int32 words of 4 columns, so no byte extraction either;
* split-K over programs: partial rows go to a float32 workspace and the last program of a column
  tile (an arrival counter, reset by that program) sums them in one 2-D load, so results are
  deterministic and one launch does everything (CUDA-graph friendly).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import launch_plan
from .dequant import cdiv, next_power_of_2


@triton.jit
def _magic_f32(v, SHIFT: tl.constexpr, MASK: tl.constexpr, BASE: tl.constexpr):
    """BASE + (the bit field of ``v`` that lands under MASK after shifting left by SHIFT), as float32."""
    if SHIFT >= 0:
        v = v << SHIFT
    else:
        v = v >> (-SHIFT)
    return ((v & MASK) | BASE).to(tl.float32, bitcast=True)


@triton.jit
def _load_meta(s_ptr, z_ptr, g, cols, N, K, r0, EVEN: tl.constexpr):
    """Scale and zero of group row ``g`` at ``cols``; zero for a program whose range ends past K."""
    if EVEN:
        s = tl.load(s_ptr + g * N + cols)
        z = tl.load(z_ptr + g * N + cols)
    else:
        mask = (cols < N) & (2 * r0 + tl.zeros_like(cols) < K)
        s = tl.load(s_ptr + g * N + cols, mask=mask, other=0.0)
        z = tl.load(z_ptr + g * N + cols, mask=mask, other=0.0)
    return s, z


@triton.jit
def _load_tile(base, rows, k_of_rows, row_len, cols, K, EVEN: tl.constexpr):
    """Packed rows ``rows`` x ``cols``; rows whose in-feature ``k_of_rows`` is past K read as 0."""
    ptrs = base + rows[:, None] * row_len + cols[None, :]
    if EVEN:
        q = tl.load(ptrs)
    else:
        q = tl.load(ptrs, mask=(k_of_rows < K)[:, None] & (cols < row_len)[None, :], other=0)
    return q


@triton.jit
def _load_step(x_row, qw_ptr, s_ptr, z_ptr, r0, n, N, K, stride_xk,
               BITS: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr, G: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Every load of one step of pair rows ``r0 ..``: the packed tile(s), x's even and odd
    in-features, and the group's scale and zero rows (``WORDS``: one per column j of a word, the
    strided rows at 4c + j; otherwise s0/z0 hold the whole row and the rest repeat it)."""
    r = r0 + tl.arange(0, BLOCK_R)
    ke = 2 * r
    ko = 2 * r + 1
    g = (2 * r0) // G
    if WORDS:
        c = tl.program_id(0) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
        cols = c
        row_len = N // 4
        base = qw_ptr.to(tl.pointer_type(tl.int32))
    else:
        cols = n
        row_len = N
        base = qw_ptr
    # 4-bit: pair row r is one packed row; 8-bit: even and odd in-features are byte rows 2r, 2r + 1
    if BITS == 4:
        q_lo = _load_tile(base, r, ke, row_len, cols, K, EVEN)
        q_hi = q_lo
    else:
        q_lo = _load_tile(base, ke, ke, row_len, cols, K, EVEN)
        q_hi = _load_tile(base, ko, ko, row_len, cols, K, EVEN)
    if WORDS:
        s0, z0 = _load_meta(s_ptr, z_ptr, g, 4 * c, N, K, r0, EVEN)
        s1, z1 = _load_meta(s_ptr, z_ptr, g, 4 * c + 1, N, K, r0, EVEN)
        s2, z2 = _load_meta(s_ptr, z_ptr, g, 4 * c + 2, N, K, r0, EVEN)
        s3, z3 = _load_meta(s_ptr, z_ptr, g, 4 * c + 3, N, K, r0, EVEN)
    else:
        s0, z0 = _load_meta(s_ptr, z_ptr, g, n, N, K, r0, EVEN)
        s1, s2, s3 = s0, s0, s0  # unused: one row serves every column
        z1, z2, z3 = z0, z0, z0
    if EVEN:
        xe = tl.load(x_row + ke * stride_xk)
        xo = tl.load(x_row + ko * stride_xk)
    else:
        xe = tl.load(x_row + ke * stride_xk, mask=ke < K, other=0.0)
        xo = tl.load(x_row + ko * stride_xk, mask=ko < K, other=0.0)
    return q_lo, q_hi, s0, s1, s2, s3, z0, z1, z2, z3, xe, xo


@triton.jit
def _word_column(acc, q_lo, q_hi, xe, xo, sx, s, z, J: tl.constexpr, BITS: tl.constexpr):
    """Column 4c + J of a word tile, scaled and added to ``acc``: 4-bit, its nibbles (lo at bit 8J,
    hi at 8J + 4 of the same word) onto bits 16..19 of 128.0; 8-bit, byte J of the even and odd
    rows' words onto bits 15..22 of 256.0."""
    if BITS == 4:
        v_lo = _magic_f32(q_lo, 16 - 8 * J, 0x000F0000, 0x43000000)
        v_hi = _magic_f32(q_hi, 12 - 8 * J, 0x000F0000, 0x43000000)
        offset = 128.0
    else:
        v_lo = _magic_f32(q_lo, 15 - 8 * J, 0x007F8000, 0x43800000)
        v_hi = _magic_f32(q_hi, 15 - 8 * J, 0x007F8000, 0x43800000)
        offset = 256.0
    d = tl.sum(xe[:, None] * v_lo + xo[:, None] * v_hi, axis=0)
    s = s.to(tl.float32)
    return acc + s * d - (z.to(tl.float32) + offset) * s * sx


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
        # column 4c + j of the tile accumulates in a_j
        a0 = tl.zeros((BLOCK_N // 4,), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N // 4,), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N // 4,), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N // 4,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    nxt = _load_step(x_row, qw_ptr, s_ptr, z_ptr, r_begin, n, N, K, stride_xk, BITS, WORDS, EVEN, G, BLOCK_N, BLOCK_R)
    for i in range(STEPS):
        q_lo, q_hi, s0, s1, s2, s3, z0, z1, z2, z3, xe, xo = nxt
        # the next step's loads go out before this step's math (the last step re-reads itself)
        nxt = _load_step(x_row, qw_ptr, s_ptr, z_ptr, r_begin + tl.minimum(i + 1, STEPS - 1) * BLOCK_R, n, N, K,
                         stride_xk, BITS, WORDS, EVEN, G, BLOCK_N, BLOCK_R)
        xe = xe.to(tl.float32)
        xo = xo.to(tl.float32)
        sx = tl.sum(xe + xo, axis=0)
        if WORDS:
            a0 = _word_column(a0, q_lo, q_hi, xe, xo, sx, s0, z0, 0, BITS)
            a1 = _word_column(a1, q_lo, q_hi, xe, xo, sx, s1, z1, 1, BITS)
            a2 = _word_column(a2, q_lo, q_hi, xe, xo, sx, s2, z2, 2, BITS)
            a3 = _word_column(a3, q_lo, q_hi, xe, xo, sx, s3, z3, 3, BITS)
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
            s0 = s0.to(tl.float32)
            acc += s0 * d - (z0.to(tl.float32) + OFFSET) * s0 * sx
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
    steps_total = cdiv(cdiv(k, 2), block_r)
    steps = cdiv(steps_total, max(1, split))
    split = cdiv(steps_total, steps)
    if split > 1:
        split = next_power_of_2(split)
    return steps, split, cdiv(n, block_n)


def launch_gemv(x2, qweight, scales, zeros, bias, out, workspace, counters, *, n: int, k: int, group_size: int,
                bits: int, block_n: int, block_r: int, split: int, words: bool, num_warps: int) -> None:
    """Run ``_gemv_kernel``: ``out = x2 @ W.T (+ bias)``. ``workspace`` (M, split, N) float32 and
    ``counters`` (M * column tiles) int32, zero at rest, are used when ``split > 1``; ``split``
    must come from :func:`gemv_grid`. Needs groups along K with ``group_size % (2 * block_r) == 0``."""
    m = x2.shape[0]
    steps, split_, tiles_n = gemv_grid(m, n, k, block_n, block_r, split)
    assert split_ == split, "split must come from gemv_grid"
    words = words and n % 4 == 0 and qweight.storage_offset() % 4 == 0
    even = n % block_n == 0 and k == 2 * block_r * steps * split  # tiles cover N and K exactly: no masks
    launch_plan.launch(
        _gemv_kernel, (tiles_n, split, m),
        x2, qweight, scales, zeros, bias if bias is not None else out, out, workspace, counters,
        n, k, x2.stride(0), x2.stride(1), out.stride(0), out.stride(1),
        BITS=bits, G=group_size, HAS_BIAS=bias is not None, WORDS=words, EVEN=even,
        BLOCK_N=block_n, BLOCK_R=block_r, STEPS=steps, SPLIT=split, num_warps=num_warps, num_stages=1)
