"""The ``fma``, ``dot`` and ``dot_t`` kernels of the fused matmul (forward) and its transposed kernel: tiles of x
times the packed weight dequantized in registers, with split-K (partials to an fp32 workspace, summed by the last
program to finish each tile). The launcher (launcher.py) picks their compile-time arguments."""
from __future__ import annotations

import triton
import triton.language as tl

from .dequant import dequant_pair_tile, int_to_f32, load_pair_bytes, split_pair_rows



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
def forward_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
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
def transposed_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
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


