"""Tensor-core decode GEMV for 4-bit weights: ``out (M, N) = x (M, K) @ W.T`` for M <= 8 on
``mma.sync.m16n8k16`` (``mixed_mm``'s ``mma`` path).

The CUDA-core ``gemv`` spends about 3.4 instructions per weight on unpacking and multiply-adds;
here the tensor cores do the multiply-adds and the unpacking is one shift + one LOP3 per two
weights. For that every lane must hold exactly its MMA fragment, so the weight is repacked once
(:func:`mma_pack`, kept alongside the checkpoint's layout) into the order the fragments are read:

* ``(N/16, K/64, 32, 4)`` int32: for each 16-row tile of N and 64-in-feature chunk of K, lane ``l``
  reads one 16-byte vector; word ``j`` is its A fragment for k-step ``j`` of the chunk (8 nibbles:
  register ``r`` of the fragment takes the nibbles at bits ``4r`` and ``16 + 4r``). The MMA's k
  order inside a chunk is permuted so that each lane's B registers over the chunk are 16
  consecutive in-features of x (two 16-byte loads per chunk);
* a Triton tensor of shape ``(32 * warps, 4)`` is laid out one row per lane (checked on the compiled
  TTGIR), so each row is handed to inline PTX (``pack=4``) as that lane's registers;
* the MMA runs on ``q + 128`` (bf16) / ``q + 1024`` (fp16), built by OR-ing nibbles into the bits
  of the offset, and each group is rescaled once: ``s (d - (z + offset) sum(x))``, where ``sum(x)``
  comes from a second MMA with an all-ones A fragment, so it lands in the accumulator's layout;
* split-K over programs as in ``gemv.py`` (partials + the last-arriving program sums them).

Under TRITON_INTERPRET the inline PTX cannot run; the kernel then emulates the fragments with
reshapes and ``tl.dot`` (same packed layout, same arithmetic), which is what CI tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # in-features per packed chunk (4 MMA k-steps)


def mma_pack(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (K/2, N) uint8 4-bit layout (even k in the low nibble) repacked for :func:`launch_mma_gemv`:
    (N/16, K/64, 32, 4) int32 (same byte count). Needs N % 16 == 0 and K % 64 == 0."""
    if n % 16 or k % CHUNK:
        raise ValueError(f"mma layout needs N % 16 == 0 and K % {CHUNK} == 0, got N={n} K={k}")
    # nibbles as uint8 (one byte per weight: this runs once per weight, possibly on a full GPU)
    q = torch.stack([qweight & 15, qweight >> 4], dim=1).reshape(k, n).t()  # (N, K), q[n, k]
    # n = 16t + 8h + g, k = 64kc + 16c + 8kh + 2j + e  ->  word[t, kc, 4g + c, j], nibble at 4(h + 2kh) + 16e
    # (MMA row 2c + e + 8kh of k-step j is in-feature 16c + 8kh + 2j + e: each lane's first and
    # second B registers over a chunk are then 4 consecutive words of x each, one 16-byte load apiece)
    q = q.reshape(n // 16, 2, 8, k // CHUNK, 4, 2, 4, 2)  # (t, h, g, kc, c, kh, j, e)
    q = q.permute(0, 3, 2, 4, 6, 5, 1, 7).reshape(-1, 4, 2)  # (t, kc, g, c, j) x (r = h + 2kh) x e
    shift = 4 * torch.arange(4, device=q.device, dtype=torch.int32)
    lo = (q[..., 0].to(torch.int32) << shift).sum(-1, dtype=torch.int32)  # e = 0: bits 4r
    hi = (q[..., 1].to(torch.int32) << shift).sum(-1, dtype=torch.int32)  # e = 1: bits 16 + 4r
    words = lo.to(torch.int64) | (hi.to(torch.int64) << 16)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(n // 16, k // CHUNK, 32, 4).contiguous()


def _chunk_asm(fp16: bool) -> str:
    """PTX for one 64-in-feature chunk on each lane's fragments (row of a (32*W, 4) tensor, ``pack=4``):
    per k-step j, unpack word ``$8+j`` into 4 A registers (``q + offset``, one shift + LOP3 each),
    ``d += A . B`` and ``sx += 1 . B`` with B = ``($12+j, $24+j)``. Operands: ``$0-$3`` d out, ``$4-$7``
    sx out, ``$8-$11`` A words, ``$12-$15`` first B registers, ``$16-$19`` d in, ``$20-$23`` sx in,
    ``$24-$27`` second B registers. Inputs are copied to local registers first so no output can
    alias an input that is still to be read."""
    magic, one, ty = ("0x64006400", "0x3C003C00", "f16") if fp16 else ("0x43004300", "0x3F803F80", "bf16")
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    s = (f"{{ .reg .b32 a0, a1, a2, a3, t, one; .reg .f32 d<4>, e<4>; mov.b32 one, {one};"
         " mov.f32 d0, $16; mov.f32 d1, $17; mov.f32 d2, $18; mov.f32 d3, $19;"
         " mov.f32 e0, $20; mov.f32 e1, $21; mov.f32 e2, $22; mov.f32 e3, $23;")
    for j in range(4):
        w = f"${8 + j}"
        s += (f" lop3.b32 a0, {w}, 0x000F000F, {magic}, 0xEA; shr.b32 t, {w}, 4; lop3.b32 a1, t, 0x000F000F, {magic}, 0xEA;"
              f" shr.b32 t, {w}, 8; lop3.b32 a2, t, 0x000F000F, {magic}, 0xEA; shr.b32 t, {w}, 12; lop3.b32 a3, t, 0x000F000F, {magic}, 0xEA;"
              f" {mma} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{${12 + j}, ${24 + j}}}, {{d0, d1, d2, d3}};"
              f" {mma} {{e0, e1, e2, e3}}, {{one, one, one, one}}, {{${12 + j}, ${24 + j}}}, {{e0, e1, e2, e3}};")
    s += (" mov.f32 $0, d0; mov.f32 $1, d1; mov.f32 $2, d2; mov.f32 $3, d3;"
          " mov.f32 $4, e0; mov.f32 $5, e1; mov.f32 $6, e2; mov.f32 $7, e3; }")
    return s


CHUNK_ASM = {torch.bfloat16: _chunk_asm(False), torch.float16: _chunk_asm(True)}


@triton.jit
def _mma_chunk(a, b0, b1, d, sx, ASM: tl.constexpr):
    """Four MMA k-steps of one 64-in-feature chunk: ``d += (q + offset) . x``, ``sx += 1 . x``."""
    return tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f,f,f,f,f,r,r,r,r",
                                     [a, b0, d, sx, b1], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _emulate_chunk(a, xk, d, sx, WARPS: tl.constexpr, FP16: tl.constexpr):
    """What :func:`_mma_chunk` computes, from the same words, without inline PTX (interpreter):
    unpack each lane's nibbles into the warp's (16, 64) weight tile, multiply with x's (8, 64)
    chunk, and lay the (16, 8) result out as the accumulator fragments."""
    OFFSET: tl.constexpr = 1024.0 if FP16 else 128.0
    # nibble (h, kh, e) of each word sits at bit 4 (h + 2 kh) + 16 e
    n000 = (a & 15).to(tl.float32) + OFFSET
    n001 = ((a >> 16) & 15).to(tl.float32) + OFFSET
    n010 = ((a >> 8) & 15).to(tl.float32) + OFFSET
    n011 = ((a >> 24) & 15).to(tl.float32) + OFFSET
    n100 = ((a >> 4) & 15).to(tl.float32) + OFFSET
    n101 = ((a >> 20) & 15).to(tl.float32) + OFFSET
    n110 = ((a >> 12) & 15).to(tl.float32) + OFFSET
    n111 = ((a >> 28) & 15).to(tl.float32) + OFFSET
    # join order: e innermost, then kh, then h: (32W, 4j, 2e, 2kh, 2h)
    w = tl.join(tl.join(tl.join(n000, n001), tl.join(n010, n011)),
                tl.join(tl.join(n100, n101), tl.join(n110, n111)))
    w = tl.reshape(w, (WARPS, 8, 4, 4, 2, 2, 2))  # (w, g, c, j, e, kh, h)
    w = tl.reshape(tl.permute(w, (0, 6, 1, 2, 5, 3, 4)), (WARPS, 16, 64))  # n = 8h + g, k = 16c + 8kh + 2j + e
    r = tl.sum(w[:, :, None, :] * xk[None, None, :, :], axis=3)  # (W, 16 n, 8 m)
    ones = tl.sum(xk, axis=1)  # (8 m,)
    rs = r * 0.0 + ones[None, None, :]
    # accumulator element j of lane (g, c): n = g + 8 (j // 2), m = 2c + j % 2
    r = tl.reshape(tl.permute(tl.reshape(r, (WARPS, 2, 8, 4, 2)), (0, 2, 3, 1, 4)), (32 * WARPS, 4))
    rs = tl.reshape(tl.permute(tl.reshape(rs, (WARPS, 2, 8, 4, 2)), (0, 2, 3, 1, 4)), (32 * WARPS, 4))
    return d + r, sx + rs


@triton.jit
def _mma_gemv_kernel(x_ptr, qm_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                     M, N, K, stride_xm, stride_om,
                     G: tl.constexpr, HAS_BIAS: tl.constexpr, FP16: tl.constexpr, USE_ASM: tl.constexpr,
                     ASM: tl.constexpr, WARPS: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    CPG: tl.constexpr = G // 64  # chunks per group
    STEPS: tl.constexpr = GROUPS * CPG
    OFFSET: tl.constexpr = 1024.0 if FP16 else 128.0
    row = tl.arange(0, 32 * WARPS)  # (warp, lane): one row of every (32 * WARPS, 4) tensor per lane
    j = tl.arange(0, 4)
    lane = row % 32
    g = lane // 4
    c = lane % 4
    t = pid_n * WARPS + row // 32  # each warp owns a 16-row tile of N
    kc0 = pid_s * STEPS  # first chunk of this program's K range
    a_ptrs = qm_ptr + ((t * (K // 64) + kc0) * 32 + lane)[:, None] * 4 + j[None, :]
    # B fragments: x[g, 16c .. 16c + 7] of each chunk (4 words of bf16/fp16 pairs, one per k-step)
    # for the first B register, x[g, 16c + 8 .. 16c + 15] for the second; rows g >= M read as zero
    xw = x_ptr.to(tl.pointer_type(tl.int32))
    b_ptrs = xw + (g * (stride_xm // 2) + kc0 * 32 + 8 * c)[:, None] + j[None, :]
    b_mask = (g < M)[:, None] & (j < 4)[None, :]
    # accumulator element j of lane (g, c): out[m_c, n_c]
    n_c = (t * 16 + g)[:, None] + 8 * (j // 2)[None, :]
    m_c = (2 * c)[:, None] + (j % 2)[None, :]
    m8 = tl.arange(0, 8)

    acc = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
    nxt = (tl.load(a_ptrs), tl.load(b_ptrs, mask=b_mask, other=0), tl.load(b_ptrs + 4, mask=b_mask, other=0))
    for gi in range(GROUPS):
        d = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
        sx = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
        for ci in range(CPG):
            i = gi * CPG + ci
            a, b0, b1 = nxt
            # the next chunk's loads go out before this chunk's MMAs (the last re-reads itself)
            step = tl.minimum(i + 1, STEPS - 1)
            nxt = (tl.load(a_ptrs + step * 128), tl.load(b_ptrs + step * 32, mask=b_mask, other=0),
                   tl.load(b_ptrs + step * 32 + 4, mask=b_mask, other=0))
            if USE_ASM:
                d, sx = _mma_chunk(a, b0, b1, d, sx, ASM)
            else:
                kk = (kc0 + i) * 64 + tl.arange(0, 64)
                xk = tl.load(x_ptr + m8[:, None] * stride_xm + kk[None, :], mask=(m8 < M)[:, None], other=0.0)
                d, sx = _emulate_chunk(a, xk.to(tl.float32), d, sx, WARPS, FP16)
        grp = pid_s * GROUPS + gi
        s = tl.load(s_ptr + grp * N + n_c).to(tl.float32)
        z = tl.load(z_ptr + grp * N + n_c).to(tl.float32)
        acc += s * d - s * (z + OFFSET) * sx

    out_mask = (m_c < M) & (n_c < N)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_c).to(tl.float32)
        tl.store(out_ptr + m_c * stride_om + n_c, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # publish the partial, count arrivals; the last program of this column tile sums them all
        ws_off = m_c * N + n_c
        tl.store(ws_ptr + pid_s * M * N + ws_off, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
            for s_i in range(SPLIT):
                total += tl.load(ws_ptr + s_i * M * N + ws_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + n_c).to(tl.float32)
            tl.store(out_ptr + m_c * stride_om + n_c, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def mma_usable(x2: torch.Tensor, n: int, k: int, group_size: int, bits: int, axis: int) -> bool:
    """Whether this call fits the mma path: 4-bit, groups along K of a multiple of 64, N % 16 == 0,
    at most 8 rows of 16-bit activations with 4-byte aligned rows."""
    return (bits == 4 and axis == 1 and group_size % CHUNK == 0 and n % 16 == 0 and k % group_size == 0
            and x2.shape[0] <= 8 and x2.dtype in (torch.float16, torch.bfloat16) and x2.stride(1) == 1
            and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0)


def mma_grid(n: int, k: int, group_size: int, warps: int, split: int) -> tuple[int, int, int]:
    """(warps, groups per program, split): warps divides the 16-row tiles, split the groups (the
    largest divisor not above the one asked for)."""
    tiles, groups = n // 16, k // group_size
    warps = max(w for w in (1, 2, 4, 8) if w <= max(1, warps) and tiles % w == 0)
    split = max(s for s in range(1, groups + 1) if groups % s == 0 and s <= max(1, split))
    return warps, groups // split, split


def launch_mma_gemv(x2, packed, scales, zeros, bias, out, workspace, counters, *, n: int, k: int, group_size: int,
                    warps: int, split: int, use_asm: bool) -> None:
    """``out = x2 @ W.T (+ bias)`` from the :func:`mma_pack` layout. ``warps``/``split`` must come from
    :func:`mma_grid`; ``workspace`` (split, M, N) float32 and ``counters`` (N / (16 warps)) int32, zero
    at rest, are used when split > 1."""
    warps_, groups, split_ = mma_grid(n, k, group_size, warps, split)
    assert (warps_, split_) == (warps, split), "warps and split must come from mma_grid"
    _mma_gemv_kernel[(n // (16 * warps), split)](
        x2, packed, scales, zeros, bias if bias is not None else out, out, workspace, counters,
        x2.shape[0], n, k, x2.stride(0), out.stride(0),
        G=group_size, HAS_BIAS=bias is not None, FP16=x2.dtype == torch.float16, USE_ASM=use_asm,
        ASM=CHUNK_ASM[x2.dtype],
        WARPS=warps, GROUPS=groups, SPLIT=split, num_warps=warps, num_stages=1)
