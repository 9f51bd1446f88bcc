"""Split-KV (flash-decoding) attention for decode steps: a few query tokens over a static KV cache.

At long context a decode step's time goes to attention: one query token reads the whole KV cache, and torch's sdpa
over transformers' static cache attends over all ``max_cache_len`` positions (the unused ones masked).
:func:`decode_attention` reads only the valid positions and spreads them over the GPU:

* stage 1, grid ``(batch * kv_heads, splits)``: each program takes one KV head (every query head of its GQA group
  and every query token at once, so each key and value is read once) and one contiguous share of the valid
  positions, and writes its softmax-normalized partial output and log-sum-exp (with one split, the output itself,
  and stage 2 does not run: :func:`default_splits` picks one for a short cache when the heads alone fill the GPU);
* stage 2, grid ``(batch * q_heads * q_len,)``: combines the splits' partials by their log-sum-exp.

The number of valid positions is read on the device (``kv_len``: transformers' ``StaticLayer.cumulative_length``
after the step's update), and the grid depends only on the shapes, so a step runs the same launches whatever the
context: capturable in a CUDA graph, no host sync. Each split's share is cut at run time from ``kv_len``, in whole
blocks of ``BLOCK_N`` positions (splits past the last position have none). Query ``i`` of ``q_len`` sees
positions ``< kv_len - q_len + i + 1`` (causal within the new tokens), further restricted by a boolean ``mask``
where given (padding).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import dequant as _dq  # (module attribute lookups: tests swap ``_alloc`` for a NaN-filling one)
from .dequant import cdiv, interpreting, next_power_of_2, on_device, triton_usable

GPU_DTYPES = (torch.float16, torch.bfloat16)  # (float32 would run tl.dot in TF32 on a GPU: sdpa keeps those)
MAX_HEAD_DIM = 256
MAX_ROWS = 128  # query heads per KV head x query tokens: one program's tile of rows
MAX_SPLITS = 128
BLOCK_N = 64  # KV positions per loop iteration
SINGLE_SPLIT_MAX_LEN = 4 * BLOCK_N  # a cache this short takes one split where the heads fill half the GPU (H200,
# batch 16, 8 KV heads, a cache of 256: 5.1 against 8.4 us a call at 64 valid positions, 10.7 against 11.8 at 200)
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, len_ptr, part_ptr, lse_ptr, o_ptr,
                  sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_m, sm_n, so_b, so_m, so_h,
                  H_KV, Q_LEN, qk_scale,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H_KV).to(tl.int64)
    hk = pid % H_KV
    rows = tl.arange(0, BLOCK_M)  # row r: query head hk * GROUP + r // Q_LEN, query token r % Q_LEN
    qi = rows % Q_LEN
    row_ok = rows < GROUP * Q_LEN
    h = hk * GROUP + rows // Q_LEN
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + qi[:, None] * sq_m + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # (Triton's interpreter computes tl.dot of 16-bit inputs wrongly)
        q = q.to(tl.float32)
    kv_len = tl.load(len_ptr).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), SPLITS) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    last = kv_len - Q_LEN + qi  # the last position query qi sees
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        k = tl.load(k_base + n[:, None] * sk_n + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * sv_n + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (log2 units: exp2 below)
        allowed = n_ok[None, :] & (n[None, :] <= last[:, None])
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * sm_b + qi[:, None] * sm_m + n[None, :] * sm_n,
                           mask=row_ok[:, None] & n_ok[None, :], other=0)
            allowed = allowed & (keep != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row with nothing seen yet: no NaN from -inf - -inf)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLITS == 1:  # (one split: its result is the output, and no combine kernel runs)
        tl.store(o_ptr + b * so_b + qi[:, None] * so_m + h[:, None] * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        # partials: (batch, q_heads, q_len, SPLITS, HEAD_DIM) and (batch, q_heads, q_len, SPLITS), contiguous
        H_Q = H_KV * GROUP
        slot = ((b * H_Q + h) * Q_LEN + qi) * SPLITS + split
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + slot, lse, mask=row_ok)


@triton.jit
def _decode_attention_combine_kernel(part_ptr, lse_ptr, o_ptr, so_b, so_m, so_h, H_Q, Q_LEN,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * H_Q + h) * Q_LEN + qi
    qi = row % Q_LEN
    h = (row // Q_LEN) % H_Q
    b = row // (Q_LEN * H_Q)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)))
    # (every split wrote its partial, zeros where it saw no position: loaded with the weights, one round trip)
    parts = tl.load(part_ptr + (row * SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * so_b + qi * so_m + h * so_h + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: torch.Tensor,
                mask: torch.Tensor | None = None) -> str | None:
    """Why :func:`decode_attention` cannot take these inputs, or ``None`` when it can."""
    tensors = (query, key, value, kv_len) + (() if mask is None else (mask,))
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key, value, kv_len (and mask) must be tensors"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"query/key/value: expected 4-D (batch, heads, tokens, head_dim), got {query.dim()}/{key.dim()}/" \
               f"{value.dim()} dimensions"
    b, hq, q_len, dim = query.shape
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != dim:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query {tuple(query.shape)}"
    hkv = key.shape[1]
    if hkv == 0 or hq % hkv or q_len == 0 or key.shape[2] == 0 or b == 0:
        return f"query heads {hq} must be a non-zero multiple of key/value heads {hkv}, with tokens in each"
    if (hq // hkv) * q_len > MAX_ROWS:
        return f"{hq // hkv} query heads per key/value head x {q_len} tokens: the kernel takes at most {MAX_ROWS}"
    if dim > MAX_HEAD_DIM:
        return f"head_dim {dim}: the kernel takes at most {MAX_HEAD_DIM}"
    if not (query.dtype == key.dtype == value.dtype):
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} differ"
    devices = {t.device for t in tensors}
    if len(devices) != 1 or not triton_usable(query):
        return "every tensor must be on one GPU (or the CPU under TRITON_INTERPRET=1)"
    if query.device.type == "cpu" and query.dtype != torch.float32:
        # (the interpreter rounds float32 -> bfloat16 toward zero: 16-bit results would not be torch's)
        return f"dtype {query.dtype}: on the CPU (Triton's interpreter, for tests) the kernel takes float32"
    if query.device.type != "cpu" and query.dtype not in GPU_DTYPES:
        return f"dtype {query.dtype}: the kernel takes float16 and bfloat16"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "query/key/value: the head dimension must be contiguous"
    if kv_len.numel() != 1 or kv_len.dtype not in (torch.int32, torch.int64):
        return "kv_len: expected one integer element"
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4:
            return "mask: expected a 4-D boolean mask (batch, 1, q_len, kv positions)"
        if mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] not in (1, q_len) \
                or mask.shape[3] != key.shape[2]:
            return f"mask {tuple(mask.shape)} does not broadcast to (batch, 1, {q_len}, {key.shape[2]})"
    return None


@functools.lru_cache(maxsize=None)
def _programs_wanted(device_index: int) -> int:
    """Stage-1 programs to aim for on a GPU: two per SM."""
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per (batch row, KV head): enough programs to fill the GPU, never more than blocks of the cache; one
    (a single launch, no combine kernel) where a short cache's heads alone give programs to half the SMs."""
    wanted = _programs_wanted(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    sms = wanted // 2  # (wanted: two programs an SM)
    if 2 * batch * kv_heads >= sms and max_len <= SINGLE_SPLIT_MAX_LEN:
        return 1
    return max(1, min(cdiv(wanted, batch * kv_heads), cdiv(max_len, BLOCK_N), MAX_SPLITS))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: torch.Tensor,
                     mask: torch.Tensor | None = None, scale: float | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """Attention of ``query`` (batch, q_heads, q_len, head_dim) over the first ``kv_len`` positions of ``key`` and
    ``value`` (batch, kv_heads, max_len, head_dim; ``q_heads`` a multiple of ``kv_heads``), causal within the
    ``q_len`` new tokens (the last ``q_len`` of the ``kv_len``) and where ``mask`` (boolean, broadcasting to
    (batch, 1, q_len, max_len)) is true. ``kv_len``: a one-element integer tensor on the device. Returns
    (batch, q_len, q_heads, head_dim) in the query's dtype, as transformers' attention functions do."""
    reason = unsupported(query, key, value, kv_len, mask)
    if reason is not None:
        raise ValueError(reason)
    return decode_attention_unchecked(query, key, value, kv_len, mask, scale, splits)


def decode_attention_unchecked(query, key, value, kv_len, mask=None, scale=None, splits=None) -> torch.Tensor:
    """:func:`decode_attention` for inputs :func:`unsupported` has passed."""
    b, hq, q_len, dim = query.shape
    hkv, max_len = key.shape[1], key.shape[2]
    group = hq // hkv
    splits = splits or default_splits(b, hkv, max_len, query.device)
    scale = dim ** -0.5 if scale is None else scale
    out = _dq._alloc((b, q_len, hq, dim), query.dtype, query.device)
    part = lse = out  # (one split writes the output directly: no partials)
    if splits > 1:
        part = _dq._alloc((b, hq, q_len, splits, dim), torch.float32, query.device)
        lse = _dq._alloc((b, hq, q_len, splits), torch.float32, query.device)
    if mask is not None:
        sm_b, _, sm_m, sm_n = (0 if n == 1 else st for n, st in zip(mask.shape, mask.stride()))
        sm_n = mask.stride(3)
    else:
        sm_b = sm_m = sm_n = 0
    block_d = next_power_of_2(dim)
    with on_device(query):
        _decode_attention_split_kernel[(b * hkv, splits)](
            query, key, value, mask if mask is not None else query, kv_len, part, lse, out,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), sm_b, sm_m, sm_n,
            out.stride(0), out.stride(1), out.stride(2), hkv, q_len, scale * _LOG2E,
            GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=max(16, next_power_of_2(group * q_len)),
            BLOCK_N=BLOCK_N, SPLITS=splits, HAS_MASK=mask is not None,
            UPCAST=interpreting() and query.device.type == "cpu", num_warps=4)
        if splits == 1:
            return out
        _decode_attention_combine_kernel[(b * hq * q_len,)](
            part, lse, out, out.stride(0), out.stride(1), out.stride(2), hq, q_len,
            HEAD_DIM=dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=next_power_of_2(splits), num_warps=4)
    return out
