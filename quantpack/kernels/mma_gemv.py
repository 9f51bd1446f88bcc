"""Tensor-core decode GEMV for 4- and 8-bit weights: ``out (M, N) = x (M, K) @ W.T`` for M <= 64 on
``mma.sync.m16n8k16`` (``mixed_mm``'s ``mma`` path).

The CUDA-core ``gemv`` spends about 3.4 instructions per weight on unpacking and multiply-adds;
here the tensor cores do the multiply-adds and the unpacking is one shift + one LOP3 per two
weights. For that every lane must hold exactly its MMA fragment, so the weight is repacked once
(:func:`~quantpack.kernels.mma_layout.mma_pack`, kept alongside the checkpoint's layout) into the order the fragments are read:

* ``(N/16, K/64, 32, 4)`` int32: for each 16-row tile of N and 64-in-feature chunk of K, lane ``l``
  reads one 16-byte vector; word ``j`` is its A fragment for k-step ``j`` of the chunk (8 nibbles:
  register ``r`` of the fragment takes the nibbles at bits ``4r`` and ``16 + 4r``). The MMA's k
  order inside a chunk is permuted so that each lane's B registers over the chunk are 16
  consecutive in-features of x (two 16-byte loads per chunk and 8-row half of x);
* a Triton tensor of shape ``(32 * warps, 4)`` is laid out one row per lane (checked on the compiled
  TTGIR), so each row is handed to inline PTX (``pack=4``) as that lane's registers;
* the nibbles become ``q + 128`` (bf16) / ``q + 1024`` (fp16) by OR-ing them into the bits of the
  offset; then either (``rawq``) the MMA runs on that and each group is rescaled once,
  ``s (d - (z + offset) sum(x))``, with ``sum(x)`` from a second MMA whose A is all ones (so it lands
  in the accumulator's layout), or two half2 adds make A ``q - z`` first (one MMA per k-step);
* rows 8-15 of x are a second B fragment on the same A; a program may take two 16-row blocks of x
  (``MmaGrid.blocks``), all four fragments multiplied with each A the warp unpacks; beyond its rows,
  the programs of one weight tile are adjacent, so the later ones read it from L2; a warp may take
  two or four 16-row tiles of N that share x's fragments (four, half of x's reads per weight byte, measured
  slower: registers halve the warps per SM); split-K over programs as in ``gemv.py``;
* 8-bit weights ``q = 16 h + l`` are two nibble planes packed as two adjacent 4-bit tiles of the
  same 16 rows (``h`` then ``l``): a warp runs them as its two tiles in ``rawq`` mode and combines
  ``s (16 d_h + d_l - (z + 17 offset) sum(x))`` per group. bf16 has no 8-bit magic number (7
  mantissa bits), and per weight byte this is the 4-bit path's instruction count with the per-chunk
  overhead (addresses, loads, loop) spread over twice the bytes.

Under TRITON_INTERPRET the inline PTX cannot run; the kernel then emulates the fragments with
reshapes and ``tl.dot``-free sums (same packed layout, same arithmetic), which is what CI tests."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import launch_plan
from .dequant import cdiv
from .mma_layout import CHUNK
from .mma_ptx import chunk_asm, hold_asm, ksum_asm

MAX_M = 64  # rows of x: blocks of 16 (two 8-row B fragments each)
MAX_BLOCKS = 2  # 16-row blocks of x per program (four measured 1.4-1.8x slower)
PRELOAD_CHUNKS = 8  # the most chunks a depth-0 program loads before its first MMA (registers)


@triton.jit
def _mma_chunk(a, bs, nz, ds, sxs, FRAGS: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr,
               CONS: tl.constexpr):
    """Four MMA k-steps of one 64-in-feature chunk for FRAGS 8-row fragments of x (B registers
    ``bs[2f]``, ``bs[2f + 1]``) on one A (MODE 0 ``zero``: ``ds[f] += (q - z) . x_f``; 1 ``raw_sum``:
    ``ds[f] += (q + offset) . x_f``, ``sxs[f] += 1 . x_f``; 2 ``raw``: ``ds`` only)."""
    if MODE == 0:
        ds = tl.inline_asm_elementwise(ASM, CONS, (a,) + bs + (nz,) + ds, dtype=(tl.float32,) * FRAGS, is_pure=True,
                                       pack=4)
    elif MODE == 1:
        r = tl.inline_asm_elementwise(ASM, CONS, (a,) + bs + ds + sxs, dtype=(tl.float32,) * (2 * FRAGS),
                                      is_pure=True, pack=4)
        ds = r[:FRAGS]
        sxs = r[FRAGS:]
    else:
        ds = tl.inline_asm_elementwise(ASM, CONS, (a,) + bs + ds, dtype=(tl.float32,) * FRAGS, is_pure=True, pack=4)
    return ds, sxs


@triton.jit
def _acc_layout(r, WARPS: tl.constexpr):
    """A (WARPS, 16 n, 8 m) result as accumulator fragments: element j of lane (g, c) holds
    n = g + 8 (j // 2), m = 2c + j % 2."""
    r = tl.permute(tl.reshape(r, (WARPS, 2, 8, 4, 2)), (0, 2, 3, 1, 4))  # (w, g, c, jh, jl)
    return tl.reshape(r, (32 * WARPS, 4))


@triton.jit
def _emulate_weight(a, z, WARPS: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr):
    """The warps' (16, 64) weight tiles as :func:`_mma_chunk` sees them, from the same words, without
    inline PTX (interpreter): ``q - z`` rounded to x's dtype (MODE 0, ``z`` (WARPS, 16)) or ``q + offset``."""
    # nibble (h, kh, e) of each word sits at bit 4 (h + 2 kh) + 16 e
    n000 = (a & 15).to(tl.float32)
    n001 = ((a >> 16) & 15).to(tl.float32)
    n010 = ((a >> 8) & 15).to(tl.float32)
    n011 = ((a >> 24) & 15).to(tl.float32)
    n100 = ((a >> 4) & 15).to(tl.float32)
    n101 = ((a >> 20) & 15).to(tl.float32)
    n110 = ((a >> 12) & 15).to(tl.float32)
    n111 = ((a >> 28) & 15).to(tl.float32)
    # join order: e innermost, then kh, then h: (32W, 4j, 2e, 2kh, 2h)
    w = tl.join(tl.join(tl.join(n000, n001), tl.join(n010, n011)),
                tl.join(tl.join(n100, n101), tl.join(n110, n111)))
    w = tl.reshape(w, (WARPS, 8, 4, 4, 2, 2, 2))  # (w, g, c, j, e, kh, h)
    w = tl.reshape(tl.permute(w, (0, 6, 1, 2, 5, 3, 4)), (WARPS, 16, 64))  # n = 8h + g, k = 16c + 8kh + 2j + e
    if MODE == 0:
        w = (w - z[:, :, None]).to(tl.float16 if FP16 else tl.bfloat16).to(tl.float32)
    else:
        w = w + (1024.0 if FP16 else 128.0)
    return w


@triton.jit
def _emulate_tile(a, x_ptr, stride_xm, M, kc, z_ptr, grp, N, n_w, ds, sxs,
                  WARPS: tl.constexpr, FRAGS: tl.constexpr, FP16: tl.constexpr, MODE: tl.constexpr):
    """The interpreter's stand-in for one :func:`_mma_chunk` call on the tiles starting at rows
    ``n_w`` (WARPS,), each warp's chunk ``kc`` and group ``grp`` (WARPS,): x's chunk and the tiles' zeros loaded
    plainly, one product per 8-row fragment."""
    xt: tl.constexpr = tl.float16 if FP16 else tl.bfloat16
    z = tl.load(z_ptr + grp[:, None] * N + n_w[:, None] + tl.arange(0, 16)[None, :]).to(xt).to(tl.float32)
    w = _emulate_weight(a, z, WARPS, FP16, MODE)
    kk = kc[:, None] * 64 + tl.arange(0, 64)[None, :]  # (WARPS, 64): each warp's chunk
    new_ds = ()
    new_sxs = ()
    for f in tl.static_range(FRAGS):
        mk = 8 * f + tl.arange(0, 8)
        xk = tl.load(x_ptr + mk[None, :, None] * stride_xm + kk[:, None, :], mask=(mk < M)[None, :, None],
                     other=0.0).to(tl.float32)  # (WARPS, 8, 64)
        new_ds = new_ds + (ds[f] + _acc_layout(tl.sum(w[:, :, None, :] * xk[:, None, :, :], axis=3), WARPS),)
        if MODE == 1:
            ones = tl.zeros((WARPS, 16, 8), dtype=tl.float32) + tl.sum(xk, axis=2)[:, None, :]
            new_sxs = new_sxs + (sxs[f] + _acc_layout(ones, WARPS),)
    if MODE != 1:
        new_sxs = sxs
    return new_ds, new_sxs


@triton.jit
def _load_a(a_ptrs, a_tile, step, NT: tl.constexpr):
    """One chunk's A words of each of the warp's NT packed tiles (adjacent, ``a_tile`` words apart)."""
    a = ()
    for i in tl.static_range(NT):
        a = a + (tl.load(a_ptrs + i * a_tile + step * 128),)
    return a


@triton.jit
def _load_b(b_ptrs, b_masks, fstride, step, FRAGS: tl.constexpr):
    """One chunk's B registers of each 8-row fragment of x (rows beyond M read as zero)."""
    bs = ()
    for f in tl.static_range(FRAGS):
        p = b_ptrs + f * fstride + step * 32
        bs = bs + (tl.load(p, mask=b_masks[f], other=0), tl.load(p + 4, mask=b_masks[f], other=0))
    return bs


@triton.jit
def _load_chunk(a_ptrs, a_tile, b_ptrs, b_masks, fstride, step, FRAGS: tl.constexpr, NT: tl.constexpr):
    return _load_a(a_ptrs, a_tile, step, NT), _load_b(b_ptrs, b_masks, fstride, step, FRAGS)


@triton.jit
def _load_group_meta(s_ptr, z_ptr, grp, N, n_c, TILES: tl.constexpr):
    """Group ``grp``'s scales and zeros of each of the warp's TILES tiles, in the accumulator layout."""
    ss = ()
    zs = ()
    for ti in tl.static_range(TILES):
        ss = ss + (tl.load(s_ptr + grp * N + n_c + 16 * ti),)
        zs = zs + (tl.load(z_ptr + grp * N + n_c + 16 * ti),)
    return ss, zs


@triton.jit
def _rescale(acc, ds, sxs, s, zs, FRAGS: tl.constexpr, SUMS: tl.constexpr):
    """``acc[f] + s ds[f] (- zs sxs[f])``: one group's products, scaled, into the accumulators."""
    out = ()
    for f in tl.static_range(FRAGS):
        if SUMS:
            out = out + (acc[f] + s * ds[f] - zs * sxs[f],)
        else:
            out = out + (acc[f] + s * ds[f],)
    return out


@triton.jit
def _chunk_products(d, sx, a, bs, nzs, x_ptr, stride_xm, M, kc, z_ptr, grp, N, n_w, USE_ASM: tl.constexpr,
                    ASM: tl.constexpr, CONS: tl.constexpr, ASM2: tl.constexpr, CONS2: tl.constexpr,
                    MODE1: tl.constexpr, MODE2: tl.constexpr, NT: tl.constexpr, PLANES: tl.constexpr,
                    TILES: tl.constexpr, FRAGS: tl.constexpr, WARPS: tl.constexpr, FP16: tl.constexpr):
    """One chunk (A words ``a`` of the warp's NT packed tiles, x's B registers ``bs``) into the group's products
    ``d`` (packed tile i at i * FRAGS + f) and x's sums ``sx`` (rawq: taken with the first tile); ``nzs``: the
    group's negated zeros per 16-row tile (:func:`_neg_zeros`)."""
    dn = ()
    for ti in tl.static_range(NT):
        di = d[ti * FRAGS:(ti + 1) * FRAGS]
        if USE_ASM:
            di, sx = _mma_chunk(a[ti], bs, nzs[ti // PLANES], di, sx, FRAGS, MODE1 if ti == 0 else MODE2,
                                ASM if ti == 0 else ASM2, CONS if ti == 0 else CONS2)
        else:
            di, sx = _emulate_tile(a[ti], x_ptr, stride_xm, M, kc, z_ptr, grp, N, n_w + 16 * (ti // PLANES), di, sx,
                                   WARPS, FRAGS, FP16, MODE1 if ti == 0 else MODE2)
        dn = dn + di
    return dn, sx


@triton.jit
def _neg_zeros(zs, TILES: tl.constexpr, FP16: tl.constexpr):
    """``-z`` of each 16-row tile in x's dtype (the ``zero`` mode's A offsets)."""
    nzs = ()
    for ti in tl.static_range(TILES):
        nzs = nzs + ((-zs[ti].to(tl.float32)).to(tl.float16 if FP16 else tl.bfloat16),)
    return nzs


@triton.jit
def _group_rescale(acc, d, sx, ss, zs, RAWQ: tl.constexpr, PLANES: tl.constexpr, TILES: tl.constexpr,
                   FRAGS: tl.constexpr, OFFSET: tl.constexpr):
    """One group's products ``d`` (and x's sums ``sx``), scaled, into the accumulators."""
    if PLANES == 2:  # q = 16 h + l: s (16 d_h + d_l - (z + 17 offset) sum(x))
        s0 = ss[0].to(tl.float32)
        zs0 = s0 * (zs[0].to(tl.float32) + 17.0 * OFFSET)
        dhl = _rescale(d[FRAGS:], d[:FRAGS], d[:FRAGS], 16.0, 0.0, FRAGS, False)  # d_l + 16 d_h
        acc = _rescale(acc, dhl, sx, s0, zs0, FRAGS, True)
    else:  # rawq: s (d - (z + offset) sum(x)), the zeros in float32
        accn = ()
        for ti in tl.static_range(TILES):
            s_t = ss[ti].to(tl.float32)
            accn = accn + _rescale(acc[ti * FRAGS:(ti + 1) * FRAGS], d[ti * FRAGS:(ti + 1) * FRAGS], sx, s_t,
                                   s_t * (zs[ti].to(tl.float32) + OFFSET), FRAGS, RAWQ)
        acc = accn
    return acc


@triton.jit
def _ksum(acc, row, KSUM: tl.constexpr, KSUM_CONS: tl.constexpr):
    """The accumulators summed over the warps that split the program's K range, through shared memory with one
    barrier (Triton's ``tl.sum`` of the reshape converts layouts there and back: four barriers);
    every warp gets its tile slot's sums."""
    rows = tl.broadcast_to(row[:, None], acc[0].shape)
    return tl.inline_asm_elementwise(KSUM, KSUM_CONS, acc + (rows,), dtype=(tl.float32,) * len(acc), is_pure=False,
                                     pack=4)


@triton.jit
def _hold(aa, bb, metas, zero, HOLD: tl.constexpr, HOLD_CONS: tl.constexpr, NT: tl.constexpr):
    """The first chunk's A words, made to depend on every value loaded before the loop (``zero`` is 0, which
    ptxas cannot know): ptxas otherwise sinks each load next to its first use, one round trip per chunk."""
    args = ()
    for t in tl.static_range(len(aa)):
        args = args + aa[t]
    for t in tl.static_range(len(bb)):
        args = args + bb[t]
    for t in tl.static_range(len(metas)):
        for u in tl.static_range(len(metas[t][0])):
            args = args + (metas[t][0][u].to(tl.float32, bitcast=False).to(tl.int32, bitcast=True),
                           metas[t][1][u].to(tl.float32, bitcast=False).to(tl.int32, bitcast=True))
    first = tl.inline_asm_elementwise(HOLD, HOLD_CONS, args + (zero,), dtype=(tl.int32,) * NT, is_pure=True, pack=4)
    return (first,) + aa[1:]


@triton.jit
def _acc_coords(pid_n, ROWS: tl.constexpr, WN: tl.constexpr, NT: tl.constexpr, PLANES: tl.constexpr):
    """Where element j of each row (warp, lane (g, c)) of a (ROWS, 4) accumulator goes: out[m_c + 8f, n_c + 16i]
    for fragment f and tile i; warp w holds the tiles of slot w % WN (its K part is w // WN)."""
    row = tl.arange(0, ROWS)
    j = tl.arange(0, 4)
    lane = row % 32
    t = (pid_n * WN + (row // 32) % WN) * NT
    n_c = ((t // PLANES) * 16 + lane // 4)[:, None] + 8 * (j // 2)[None, :]
    m_c = (2 * (lane % 4))[:, None] + (j % 2)[None, :]
    return n_c, m_c


@triton.jit
def _finish(acc, m_c, n_c, M, N, pid_s, bias_ptr, out_ptr, stride_om, ws_ptr, WS_SPLIT, HAS_BIAS: tl.constexpr,
            PARTIAL: tl.constexpr):
    """Write one accumulator fragment: to out (plus bias), or (``PARTIAL``) as this program's partial sums."""
    mask = (m_c < M) & (n_c < N)
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_c).to(tl.float32)
        tl.store(out_ptr + m_c * stride_om + n_c, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_s * WS_SPLIT + m_c * N + n_c, acc, mask=mask)


@triton.jit
def _reduce(m_c, n_c, M, N, bias_ptr, out_ptr, stride_om, ws_ptr, WS_SPLIT, HAS_BIAS: tl.constexpr,
            SPLIT: tl.constexpr):
    """Sum one fragment's SPLIT partials (plus bias) into out (the last-arriving program does this)."""
    mask = (m_c < M) & (n_c < N)
    total = tl.zeros(m_c.shape, dtype=tl.float32)
    for s_i in range(SPLIT):
        total += tl.load(ws_ptr + s_i * WS_SPLIT + m_c * N + n_c, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        total += tl.load(bias_ptr + n_c).to(tl.float32)
    tl.store(out_ptr + m_c * stride_om + n_c, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_to_arrive(cnt_ptr, arrivals):
    """Whether this program is the last of ``arrivals`` counted at ``cnt_ptr`` (then reset for the next launch)."""
    tl.debug_barrier()  # (every warp's partials stored before the arrival is counted)
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _sum_token(cnt_ptr, pid_m, pid_n, programs_n, n_c, m_c, N, ws_ptr, WS_SPLIT, out_ptr, stride_om, ids_ptr, tw_ptr,
               E, SPLIT: tl.constexpr, TOPK: tl.constexpr, TILES: tl.constexpr):
    """Pair pid_m's arrival at its token's column tile pid_n; the last of the token's TOPK * SPLIT programs there
    writes the token's out row at the tile's columns: over its slots j with an expert in [0, E), their top-k weight
    times their SPLIT partial sums (the launch's ``ws_ptr``: pair p's row at p * N), rounded once."""
    token = pid_m // TOPK
    if last_to_arrive(cnt_ptr + token * programs_n + pid_n, TOPK * SPLIT):
        for ti in tl.static_range(TILES):
            cols = n_c + 16 * ti
            mask = (m_c < 1) & (cols < N)
            acc = tl.zeros(m_c.shape, dtype=tl.float32)
            for j in tl.static_range(TOPK):
                p = token * TOPK + j
                e = tl.load(ids_ptr + p)
                ok = (e >= 0) & (e < E)
                w = tl.where(ok, tl.load(tw_ptr + p).to(tl.float32), 0.0)
                m = mask & ((tl.zeros_like(m_c) + ok.to(tl.int32)) != 0)  # (the interpreter's & with a scalar flag)
                for s in tl.static_range(SPLIT):
                    acc += w * tl.load(ws_ptr + s * WS_SPLIT + p * N + cols, mask=m, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mma_gemv_kernel(x_ptr, qm_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, ids_ptr, tw_ptr,
                     M, N, K, stride_xm, stride_om, E, XDIV,
                     G: tl.constexpr, HAS_BIAS: tl.constexpr, FP16: tl.constexpr, USE_ASM: tl.constexpr,
                     ASM: tl.constexpr, CONS: tl.constexpr, ASM2: tl.constexpr, CONS2: tl.constexpr,
                     RAWQ: tl.constexpr, FRAGS: tl.constexpr, NT: tl.constexpr, PLANES: tl.constexpr,
                     DEPTH: tl.constexpr, WARPS: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr,
                     PDL: tl.constexpr, HOLD: tl.constexpr, HOLD_CONS: tl.constexpr, KW: tl.constexpr,
                     KSUM: tl.constexpr, KSUM_CONS: tl.constexpr, EXPERTS: tl.constexpr = 0, TOPK: tl.constexpr = 0):
    # NT packed tiles per warp: NT 16-row tiles of N (4-bit), or one tile's two nibble planes (8-bit, PLANES 2).
    # A program takes ROWS rows of x as FRAGS 8-row B fragments, all multiplied with each A fragment it
    # unpacks; with more rows than that, the programs of a column tile are adjacent, so the weight tile
    # they all read is in L2 for the later ones.
    # Experts (EXPERTS 1 or 2): each block of rows has its own weight, block b's expert ids[b] of E (one outside
    # [0, E) skips the block); the experts' layouts, scales and zeros are stacked. EXPERTS 1: M (token, slot) pairs,
    # a block of one row each, x's row b // XDIV, out's row b; EXPERTS 2: blocks of ROWS rows of x and out. Their
    # split-K partials stay in the workspace (SPLIT x M x N) for the next kernel to sum, or (EXPERTS 1, TOPK > 0)
    # for the last program to publish a token's column tile: it writes the token's TOPK rows times their weights
    # (tw), summed, to out (tokens x N); a skipped slot's programs count there too.
    ROWS: tl.constexpr = 16 if FRAGS <= 2 else 8 * FRAGS
    if EXPERTS == 1:
        blocks = M
    else:
        blocks = (M + ROWS - 1) // ROWS
    pid_m = tl.program_id(0) % blocks
    pid_n = tl.program_id(0) // blocks
    pid_s = tl.program_id(1)
    WS_SPLIT = M * N  # (workspace: SPLIT x M x N partials)
    WN: tl.constexpr = WARPS // KW  # (warps along N; KW warps split the program's K range, summed in shared memory)
    PARTIAL: tl.constexpr = SPLIT > 1 or TOPK > 0  # (partial sums to the workspace)
    TILES: tl.constexpr = NT // PLANES  # 16-row tiles of N per warp (each with its own scales and zeros)
    if EXPERTS == 0:
        x_ptr += pid_m * ROWS * stride_xm
        out_ptr += pid_m * ROWS * stride_om
        ws_ptr += pid_m * ROWS * N
        M = tl.minimum(M - pid_m * ROWS, ROWS)  # rows of this program
    else:
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        if (e < 0) | (e >= E):
            if TOPK > 0:  # (a skipped slot still counts at its token's tiles)
                n_c, m_c = _acc_coords(pid_n, 32 * WARPS, WN, NT, PLANES)
                _sum_token(cnt_ptr, pid_m, pid_n, tl.num_programs(0) // blocks, n_c, m_c, N, ws_ptr, WS_SPLIT,
                           out_ptr, stride_om, ids_ptr, tw_ptr, E, SPLIT, TOPK, TILES)
            return
        qm_ptr += e * (N // 16) * (K // 64) * 128
        s_ptr += e * (K // G) * N
        z_ptr += e * (K // G) * N
        if EXPERTS == 1:
            x_ptr += (pid_m // XDIV) * stride_xm
            if TOPK == 0:
                out_ptr += pid_m * stride_om
            ws_ptr += pid_m * N
            M = 1
        else:
            x_ptr += pid_m * ROWS * stride_xm
            out_ptr += pid_m * ROWS * stride_om
            ws_ptr += pid_m * ROWS * N
            M = ROWS
    CPG: tl.constexpr = G // 64  # chunks per group
    STEPS: tl.constexpr = GROUPS * CPG
    OFFSET: tl.constexpr = 1024.0 if FP16 else 128.0
    # chunk modes (see mma_ptx.chunk_asm): zeros subtracted in A, or raw q with x's sums taken by the first tile
    MODE1: tl.constexpr = 1 if RAWQ else 0
    MODE2: tl.constexpr = 2 if RAWQ else 0
    row = tl.arange(0, 32 * WARPS)  # (warp, lane): one row of every (32 * WARPS, 4) tensor per lane
    j = tl.arange(0, 4)
    lane = row % 32
    g = lane // 4
    c = lane % 4
    t = (pid_n * WN + (row // 32) % WN) * NT  # each warp owns NT adjacent packed tiles
    part = pid_s * KW + (row // 32) // WN  # this warp's K range, of SPLIT * KW
    kc0 = part * STEPS  # first chunk of this warp's K range
    a_ptrs = qm_ptr + ((t * (K // 64) + kc0) * 32 + lane)[:, None] * 4 + j[None, :]
    a_tile = (K // 64) * 128  # words from one tile to the next
    # B fragments: x[g, 16c .. 16c + 7] of each chunk (4 words of bf16/fp16 pairs, one per k-step)
    # for the first B register, x[g, 16c + 8 .. 16c + 15] for the second (rows g + 8f for fragment f);
    # rows >= M read as zero. Shared by the warp's NT tiles.
    xw = x_ptr.to(tl.pointer_type(tl.int32))
    b_ptrs = xw + (g * (stride_xm // 2) + kc0 * 32 + 8 * c)[:, None] + j[None, :]
    fstride = 8 * (stride_xm // 2)
    b_masks = ()
    for f in tl.static_range(FRAGS):
        b_masks = b_masks + ((g + 8 * f < M)[:, None] & (j < 4)[None, :],)
    # accumulator element j of lane (g, c): out[m_c + 8f, n_c + 16i] of fragment f and tile i
    n_c, m_c = _acc_coords(pid_n, 32 * WARPS, WN, NT, PLANES)
    # (emulation: each warp's first row, first chunk and first group)
    n_w = (pid_n * WN + tl.arange(0, WARPS) % WN) * (NT // PLANES) * 16
    part_w = pid_s * KW + tl.arange(0, WARPS) // WN
    kc0_w = part_w * STEPS
    grp0_w = part_w * GROUPS

    zero = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
    acc = (zero,) * (TILES * FRAGS)  # tile i, fragment f of x at i * FRAGS + f
    grp0 = (part * GROUPS)[:, None]
    if DEPTH == 0:
        # every chunk of the warp's K range and every group's scales and zeros issued before the first MMA (short
        # ranges: a warp then waits for one round trip instead of one per chunk); the weight words first
        # (PDL as below)
        aa = ()
        for i in tl.static_range(STEPS):
            aa = aa + (_load_a(a_ptrs, a_tile, i, NT),)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        bb = ()
        for i in tl.static_range(STEPS):
            bb = bb + (_load_b(b_ptrs, b_masks, fstride, i, FRAGS),)
        metas = ()
        for gi in tl.static_range(GROUPS):
            metas = metas + (_load_group_meta(s_ptr, z_ptr, grp0 + gi, N, n_c, TILES),)
        if USE_ASM:
            aa = _hold(aa, bb, metas, (N >> 31) + tl.zeros((32 * WARPS, 4), dtype=tl.int32), HOLD, HOLD_CONS, NT)
        for gi in tl.static_range(GROUPS):
            ss, zs = metas[gi]
            nzs = _neg_zeros(zs, TILES, FP16)
            d = (zero,) * (NT * FRAGS)
            sx = (zero,) * FRAGS
            for ci in tl.static_range(CPG):
                d, sx = _chunk_products(d, sx, aa[gi * CPG + ci], bb[gi * CPG + ci], nzs, x_ptr, stride_xm, M,
                                        kc0_w + gi * CPG + ci, z_ptr, grp0_w + gi, N, n_w, USE_ASM, ASM, CONS, ASM2,
                                        CONS2, MODE1, MODE2, NT, PLANES, TILES, FRAGS, WARPS, FP16)
            acc = _group_rescale(acc, d, sx, ss, zs, RAWQ, PLANES, TILES, FRAGS, OFFSET)
    else:
        # DEPTH chunks of loads in flight ahead of the MMAs (the last ones re-read the final chunk).
        # Programmatic dependent launch (PDL): this grid may start while the previous kernel in the stream
        # is still running; only the mma-ordered weight copy, which no other kernel writes (it is built
        # before a launch without PDL), is read before waiting for that kernel; x, scales, zeros, the
        # workspace and the output after.
        a0 = _load_a(a_ptrs, a_tile, 0, NT)
        a1 = a0
        if DEPTH == 2:
            a1 = _load_a(a_ptrs, a_tile, tl.minimum(1, STEPS - 1), NT)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()  # (the next grid may start once every program of this one is past its wait)
        p0 = (a0, _load_b(b_ptrs, b_masks, fstride, 0, FRAGS))
        p1 = p0
        if DEPTH == 2:
            p1 = (a1, _load_b(b_ptrs, b_masks, fstride, tl.minimum(1, STEPS - 1), FRAGS))
        s_nxt, z_nxt = _load_group_meta(s_ptr, z_ptr, grp0, N, n_c, TILES)
        for gi in range(GROUPS):
            ss = s_nxt
            zs = z_nxt
            nzs = _neg_zeros(zs, TILES, FP16)
            # the next group's scales and zeros, early
            s_nxt, z_nxt = _load_group_meta(s_ptr, z_ptr, grp0 + tl.minimum(gi + 1, GROUPS - 1), N, n_c, TILES)
            d = (zero,) * (NT * FRAGS)  # this group's products, packed tile i (8-bit: plane) at i * FRAGS + f
            sx = (zero,) * FRAGS  # x's sums (rawq), taken with the first tile
            for ci in range(CPG):
                i = gi * CPG + ci
                a, bs = p0
                nxt = _load_chunk(a_ptrs, a_tile, b_ptrs, b_masks, fstride, tl.minimum(i + DEPTH, STEPS - 1), FRAGS,
                                  NT)
                if DEPTH == 1:
                    p0 = nxt
                else:
                    p0 = p1
                    p1 = nxt
                d, sx = _chunk_products(d, sx, a, bs, nzs, x_ptr, stride_xm, M, kc0_w + i, z_ptr, grp0_w + gi, N, n_w,
                                        USE_ASM, ASM, CONS, ASM2, CONS2, MODE1, MODE2, NT, PLANES, TILES, FRAGS, WARPS,
                                        FP16)
            acc = _group_rescale(acc, d, sx, ss, zs, RAWQ, PLANES, TILES, FRAGS, OFFSET)

    if KW > 1:  # the K parts of each tile summed across warps (through shared memory)
        if USE_ASM:
            acc = _ksum(acc, row, KSUM, KSUM_CONS)
            m_c = tl.where((row < 32 * WN)[:, None], m_c, M)  # (the first K part's warps store; the rest hold copies)
        else:
            accr = ()
            for i in tl.static_range(TILES * FRAGS):
                accr = accr + (tl.sum(tl.reshape(acc[i], (KW, 32 * WN, 4)), axis=0),)
            acc = accr
            n_c, m_c = _acc_coords(pid_n, 32 * WN, WN, NT, PLANES)
    for ti in tl.static_range(TILES):
        for f in tl.static_range(FRAGS):
            _finish(acc[ti * FRAGS + f], m_c + 8 * f, n_c + 16 * ti, M, N, pid_s, bias_ptr, out_ptr, stride_om, ws_ptr,
                    WS_SPLIT, HAS_BIAS, PARTIAL)
    if SPLIT > 1 and EXPERTS == 0:
        # partials published: count arrivals; the last program of this column tile sums them all
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            for ti in tl.static_range(TILES):
                for f in tl.static_range(FRAGS):
                    _reduce(m_c + 8 * f, n_c + 16 * ti, M, N, bias_ptr, out_ptr, stride_om, ws_ptr, WS_SPLIT, HAS_BIAS,
                            SPLIT)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if TOPK > 0:  # (KW 1: the coordinates are every warp's)
        _sum_token(cnt_ptr, pid_m, pid_n, tl.num_programs(0) // blocks, n_c, m_c, N, ws_ptr - pid_m * N, WS_SPLIT,
                   out_ptr, stride_om, ids_ptr, tw_ptr, E, SPLIT, TOPK, TILES)


def mma_layout_fits(m: int, n: int, k: int, group_size: int, bits: int, axis: int, dtype: torch.dtype) -> bool:
    """Whether shapes fit the mma path: 4/8-bit, groups along K of 64k, N % 16 == 0, <= 64 rows of 16-bit x."""
    return (bits in (4, 8) and axis == 1 and group_size % CHUNK == 0 and n % 16 == 0 and k % group_size == 0
            and m <= MAX_M and dtype in (torch.float16, torch.bfloat16))


def mma_usable(x2: torch.Tensor, n: int, k: int, group_size: int, bits: int, axis: int) -> bool:
    """:func:`mma_layout_fits`, and x's rows 4-byte aligned."""
    return (mma_layout_fits(x2.shape[0], n, k, group_size, bits, axis, x2.dtype) and x2.stride(1) == 1
            and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0)


class MmaGrid(NamedTuple):
    warps: int  # per program, one tile slot each
    tiles_per_warp: int  # 16-row tiles of N per warp (1, 2 or 4; 8-bit: 1, its two nibble planes take the slot)
    groups: int  # quantization groups per program
    split: int  # programs splitting K (partials summed by the last to finish)
    programs: int  # along N
    blocks: int = 1  # 16-row blocks of x per program, sharing each unpacked weight fragment (4-bit, 1 or 2)
    kwarps: int = 1  # warps of a program splitting its K range (x warps along N), summed in shared memory

    def row_blocks(self, m: int) -> int:
        """The 16-row blocks of x one program takes for ``m`` rows (no more than there are)."""
        return max(1, min(self.blocks, cdiv(m, 16)))

    def row_programs(self, m: int) -> int:
        """Programs along the rows of x for ``m`` rows (each program's counter slot is its own)."""
        return cdiv(m, 16 * self.row_blocks(m))


@functools.lru_cache(maxsize=4096)  # (per launch on the host: pure)
def mma_grid(n: int, k: int, group_size: int, warps: int, split: int, tiles_per_warp: int = 1, bits: int = 4,
             blocks: int = 1, kwarps: int = 1) -> MmaGrid:
    """The launch grid nearest to the one asked for that divides the problem: warps x tiles per
    warp (1, 2 or 4, 4-bit; the most up to the one asked) divide the tile count; ``kwarps`` more warps per
    program split its K range (1, 2, 4 or 8, dividing the group count, at most 8 warps in all; their sums meet in
    shared memory); split is the largest divisor of the remaining group count not above the one asked.
    ``blocks`` of 16 rows of x per program: 1 or 2, 4-bit only (8-bit planes run rawq, whose sums would
    need a register set per block)."""
    tiles, groups = n // 16, k // group_size
    blocks = 1 if bits == 8 else max(1, min(MAX_BLOCKS, blocks))
    nt = max(t for t in (1, 2, 4) if t <= max(1, tiles_per_warp) and tiles % t == 0) if bits == 4 else 1
    warps = max(w for w in (1, 2, 4, 8) if w <= max(1, warps) and tiles % (w * nt) == 0)
    kwarps = max(w for w in (1, 2, 4, 8) if w <= max(1, kwarps) and groups % w == 0 and warps * w <= 8)
    split = max(s for s in range(1, groups // kwarps + 1) if groups // kwarps % s == 0 and s <= max(1, split))
    return MmaGrid(warps, nt, groups // (kwarps * split), split, tiles // (warps * nt), blocks, kwarps)


def mma_depth(grid: MmaGrid, group_size: int, depth: int) -> int:
    """The depth a launch on ``grid`` runs for ``depth`` asked: 0 (every load of a warp's K range issued before
    its first MMA) only where a warp holds at most PRELOAD_CHUNKS chunks (registers), else 2; 1 and 2 as asked."""
    if depth > 0:
        return min(depth, 2)
    return 0 if grid.groups * group_size // CHUNK <= PRELOAD_CHUNKS else 2


def launch_mma_gemv(x2, packed, scales, zeros, bias, out, workspace, counters, *, n: int, k: int, group_size: int,
                    grid: MmaGrid, depth: int, rawq: bool, use_asm: bool, bits: int = 4, pdl: bool = False) -> None:
    """``out = x2 @ W.T (+ bias)`` from the :func:`mma_pack` layout (of ``bits``), M <= 64. ``grid``
    must come from :func:`mma_grid` (for these bits); ``depth`` (1 or 2; 3 measured slower) chunks of
    loads are kept in flight per warp, or 0: all of a warp's loads are issued before its first MMA
    (at most PRELOAD_CHUNKS chunks per warp, :func:`mma_depth`); ``rawq`` runs the MMA on ``q + offset`` and applies
    the zeros per group through x's sums (fewer instructions), else the zeros are subtracted from
    the A fragments before the MMA (fewer MMAs; 4-bit only: 8-bit planes always run rawq; a program of
    two 16-row blocks always subtracts them: one unpack then serves four MMAs, and the sums would
    double those); ``workspace`` (split, M, N) float32 and ``counters`` (grid.programs x
    grid.row_programs(M)) int32, zero at rest, are used when split > 1. ``pdl`` (Hopper and later, with
    ``use_asm``) launches with programmatic dependent launch: the grid starts while the previous kernel in
    the stream finishes and reads ``packed`` before waiting for it, so no kernel may be writing ``packed``
    then (see :func:`_mma_gemv_kernel`)."""
    assert grid == mma_grid(n, k, group_size, grid.warps, grid.split, grid.tiles_per_warp, bits, grid.blocks,
                            grid.kwarps), \
        "grid must come from mma_grid"
    m = x2.shape[0]
    assert (depth in (1, 2) or mma_depth(grid, group_size, depth) == 0) and 1 <= m <= MAX_M and bits in (4, 8)
    launch_plan.launch(
        _mma_gemv_kernel, (grid.programs * grid.row_programs(m), grid.split),
        x2, packed, scales, zeros, bias if bias is not None else out, out, workspace, counters, counters, counters,
        m, n, k, x2.stride(0), out.stride(0), 0, 1,
        **kernel_constexprs(x2.dtype, m, grid, group_size=group_size, depth=depth, rawq=rawq, bits=bits,
                            has_bias=bias is not None, use_asm=use_asm, pdl=pdl),
        num_warps=grid.warps * grid.kwarps, num_stages=1, **({"launch_pdl": True} if pdl and use_asm else {}))


_MMA_EXPERTS = launch_plan.KernelReplays(_mma_gemv_kernel)


def launch_mma_experts(x2, words, scales, zeros, partials, ids, *, per_row: bool, x_div: int, n: int, k: int,
                       group_size: int, grid: MmaGrid, depth: int, rawq: bool, use_asm: bool, replay: bool = True,
                       out=None, counters=None, topk_weights=None, pdl: bool = False, release: bool = False) -> None:
    """Mixture-of-experts blocks of rows, each times its own expert's 4-bit weight: ``words`` (E, N/16, K/64, 32,
    4) stacks the experts' :func:`~quantpack.kernels.mma_layout.mma_pack` layouts, ``scales``/``zeros`` (E, K/g,
    N). ``per_row``: row b of ``partials`` is x's row ``b // x_div`` times expert ``ids[b]`` (decode: one (token,
    slot) pair a row); else ``x2``'s rows are blocks of 16, block b times expert ``ids[b]`` (pairs sorted by
    expert). An id outside [0, E) leaves its rows unwritten. ``partials`` (grid.split, rows, N) float32 receives
    each split's partial sums for the next kernel to add; or, ``per_row`` with ``out`` (tokens, N), for the last
    program of each token's column tile (``counters``: tokens x grid.programs int32, zero at rest), which writes
    the token's rows times ``topk_weights`` (tokens, top-k), summed over its used slots, to ``out``. ``grid``
    from :func:`mma_grid` (one 16-row block a program; one K warp with ``out``). ``replay``: launches after a
    key's first go straight to the compiled kernel (launch_plan.KernelReplays; the caller passes whether launch
    plans are on). ``pdl``: launched with PDL (as :func:`launch_mma_gemv`; the ids too are read before the wait, so
    no kernel may be writing them then); ``release``: launched without, but the next grid may start once every
    program is past its (then empty) wait."""
    assert grid == mma_grid(n, k, group_size, grid.warps, grid.split, grid.tiles_per_warp, 4, 1, grid.kwarps), \
        "grid must come from mma_grid"
    rows = partials.shape[1]
    assert partials.shape == (grid.split, rows, n) and partials.dtype == torch.float32 and partials.is_contiguous()
    assert per_row or rows == 16 * ids.numel()
    top_k = 0 if out is None else topk_weights.shape[1]
    if top_k:
        assert per_row and grid.kwarps == 1 and out.is_contiguous() and counters.numel() >= out.shape[0] * grid.programs
    else:
        out, counters, topk_weights = partials, partials, ids
    m = 1 if per_row else 16
    # (a mixture-of-experts layer launches it twice a call, eagerly at prefill and in eager decode: binding its
    # thirty-odd arguments through Triton would be most of the call's host time)
    key = ((launch_plan.tensor_key(x2, words, scales, zeros, partials, ids, out, counters, topk_weights), per_row,
            x_div, group_size, grid, depth, rawq, use_asm, pdl, release) if replay else None)
    _MMA_EXPERTS(key, (grid.programs * ids.numel(), grid.split, 1), x2,
                 x2, words, scales, zeros, partials, out, partials, counters, ids, topk_weights,
                 rows, n, k, x2.stride(0), out.stride(0) if top_k else n, words.shape[0], x_div,
                 **kernel_constexprs(x2.dtype, m, grid, group_size=group_size, depth=depth, rawq=rawq, bits=4,
                                     has_bias=False, use_asm=use_asm, pdl=pdl or release),
                 EXPERTS=1 if per_row else 2, TOPK=top_k, num_warps=grid.warps * grid.kwarps, num_stages=1,
                 **({"launch_pdl": True} if pdl and use_asm else {}))


@functools.lru_cache(maxsize=4096)  # (pure; building the PTX strings costs more than a launch: callers never mutate it)
def kernel_constexprs(dtype: torch.dtype, m: int, grid: MmaGrid, *, group_size: int, depth: int, rawq: bool,
                      bits: int, has_bias: bool, use_asm: bool, pdl: bool = False) -> dict:
    """The compile-time arguments of :func:`_mma_gemv_kernel` for ``m`` rows of x of ``dtype`` on ``grid``
    (what :func:`launch_mma_gemv` passes; tests/kernels/sm90_compile.py compiles the same for sm_90)."""
    frags = 1 if m <= 8 else 2 * grid.row_blocks(m)  # 8-row fragments of x per program
    planes = 2 if bits == 8 else 1
    rawq = (rawq and grid.row_blocks(m) == 1) or planes == 2
    asm, cons = chunk_asm(dtype, frags, "raw_sum" if rawq else "zero")
    asm2, cons2 = chunk_asm(dtype, frags, "raw" if rawq else "zero")
    return dict(G=group_size, HAS_BIAS=has_bias, FP16=dtype == torch.float16, USE_ASM=use_asm, ASM=asm, CONS=cons,
                ASM2=asm2, CONS2=cons2, RAWQ=rawq, FRAGS=frags, NT=grid.tiles_per_warp * planes, PLANES=planes,
                DEPTH=depth, WARPS=grid.warps * grid.kwarps, KW=grid.kwarps, GROUPS=grid.groups, SPLIT=grid.split,
                PDL=pdl and use_asm,
                **_hold_constexprs(grid, group_size, frags, planes, depth), **_ksum_constexprs(grid, frags))


def _ksum_constexprs(grid: MmaGrid, frags: int) -> dict:
    """:func:`_ksum`'s PTX for a program whose warps split its K range, else nothing."""
    if grid.kwarps == 1:
        return dict(KSUM="", KSUM_CONS="")
    asm, cons = ksum_asm(grid.tiles_per_warp * frags, grid.kwarps, 32 * grid.warps)
    return dict(KSUM=asm, KSUM_CONS=cons)


def _hold_constexprs(grid: MmaGrid, group_size: int, frags: int, planes: int, depth: int) -> dict:
    """:func:`_hold`'s PTX for a program that loads everything up front (depth 0), else nothing."""
    if depth:
        return dict(HOLD="", HOLD_CONS="")
    nt = grid.tiles_per_warp * planes
    steps = grid.groups * group_size // CHUNK
    asm, cons = hold_asm(nt, steps * (nt + 2 * frags) + 2 * grid.groups * grid.tiles_per_warp + 1)
    return dict(HOLD=asm, HOLD_CONS=cons)
