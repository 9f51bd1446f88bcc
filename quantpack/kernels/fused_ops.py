"""One-launch Triton versions of small decode-step ops that torch runs as several tiny kernels.

* :func:`rms_norm`: transformers' ``LlamaRMSNorm.forward`` (about 8 kernels in torch).
* :func:`rotary`: transformers' ``apply_rotary_pos_emb`` for q and k together (about 10 kernels in torch).
* :func:`silu_mul`: ``silu(gate) * up`` of a gated MLP (2 kernels in torch), reading gate and up where the merged
  gate/up projection left them.
* :func:`kv_write`: a static KV cache's update, keys and values written at its count and the count advanced
  (5 kernels in torch).

Both compute in float32 and round exactly where torch rounds, so results match torch's to the bit (rotary) or
within a float32 rounding of the mean (RMSNorm). ``*_unsupported`` say why an input cannot take the kernel
(``None`` when it can); the launchers raise ``ValueError`` with that reason.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dequant as _dq  # (module attribute lookups: tests swap ``_alloc`` for a NaN-filling one)
from .dequant import cdiv, next_power_of_2, on_device, triton_usable
from .dispatch import launch_plans_enabled
from .launch_plan import KernelReplays

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NORM_DIM = 16384  # one program holds a whole row in registers
MAX_HEAD_DIM = 512


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(h * h, axis=0) / N
    # h.to(input dtype) before the weight multiplies, as in torch; the product is rounded once
    h = (h * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``rms_norm(x, weight, eps)`` cannot run the kernel, or ``None`` when it can."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x and weight must be tensors"
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"dtypes {x.dtype}/{weight.dtype}: the kernel takes float32, float16 and bfloat16"
    if not (x.is_cuda or triton_usable(x)) or x.device != weight.device:
        return f"x on {x.device}, weight on {weight.device}: the kernel needs both on one GPU (or TRITON_INTERPRET=1)"
    n = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != n or weight.stride(0) != 1:
        return f"weight: expected a contiguous 1-D tensor of {n} elements, got shape {tuple(weight.shape)}"
    if not 0 < n <= MAX_NORM_DIM or x.numel() == 0:
        return f"x: shape {tuple(x.shape)}; the kernel takes a non-empty last dimension of at most {MAX_NORM_DIM}"
    if x.stride(-1) != 1:
        return "x: the last dimension must be contiguous"
    if _row_stride(x) is None:
        return "x: the leading dimensions do not flatten into rows of one stride without a copy"
    return None


def _row_stride(x: torch.Tensor) -> int | None:
    """The stride between consecutive rows of ``x`` flattened to (rows, last dim), or None where its leading
    dimensions do not collapse into one stride (that would need a copy)."""
    if x.is_contiguous():  # (a cached flag: the common case costs no loop)
        return x.shape[-1]
    row = expected = None
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return None
        row = stride if row is None else row
        expected = stride * size
    return x.shape[-1] if row is None else row


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension (computed in float32) in one
    launch, exactly transformers' ``LlamaRMSNorm.forward``. The result has ``x``'s shape and the dtype torch promotes
    ``weight`` and ``x`` to. ``x`` may have any leading shape whose dimensions flatten into rows of one stride; its
    last dimension must be contiguous."""
    reason = rms_norm_unsupported(x, weight)
    if reason is not None:
        raise ValueError(f"rms_norm: {reason}")
    return rms_norm_unchecked(x, weight, eps)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` for inputs :func:`rms_norm_unsupported` passed (no second check on the hot path)."""
    n = x.shape[-1]
    rows = x.numel() // n
    y = _dq._alloc((rows, n), torch.promote_types(weight.dtype, x.dtype), x.device)
    block = next_power_of_2(n)
    # (every integer argument follows from x's shape and strides; y is a fresh, aligned allocation)
    key = ((x.shape, x.stride(), x.dtype, weight.dtype, x.device, x.data_ptr() % 16, weight.data_ptr() % 16)
           if launch_plans_enabled() else None)
    with on_device(x):
        _RMS_NORM(key, (rows, 1, 1), x, x, weight, y, _row_stride(x), n, n, float(eps), BLOCK=block,
                  num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return y.view(x.shape)


_RMS_NORM = KernelReplays(_rms_norm_kernel)  # (a decode step calls it twice a layer: Triton's binding is most of a call)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, x_base, o_base, x_sh, o_sh, h0, H, c1, c2, s1, s2, HALF,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads ``h0 .. h0 + BLOCK_H`` of one (batch, position): both halves of each head rotated."""
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < H)[:, None] & (d < HALF)[None, :]
    xp = x_ptr + x_base + h.to(tl.int64)[:, None] * x_sh + d[None, :]
    op = o_ptr + o_base + h.to(tl.int64)[:, None] * o_sh + d[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    # torch rounds each product and the sum to the dtype (rotate_half's negation is exact)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(op, o1.to(dt), mask=mask)
    tl.store(op + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, c_ptr, s_ptr, qo_ptr, ko_ptr, S, HQ, HK, HALF, NQB,
                   q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss, c_sb, c_ss, s_sb, s_ss,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    blk = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < HALF)[None, :]
    cp = c_ptr + b * c_sb + s * c_ss + d[None, :]
    sp = s_ptr + b * s_sb + s * s_ss + d[None, :]
    c1 = tl.load(cp, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cp + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sp, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sp + HALF, mask=dmask, other=0.0).to(tl.float32)
    if blk < NQB:
        _rotate_heads(q_ptr, qo_ptr, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, q_sh, qo_sh, blk * BLOCK_H, HQ,
                      c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_D)
    else:
        _rotate_heads(k_ptr, ko_ptr, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, k_sh, ko_sh, (blk - NQB) * BLOCK_H,
                      HK, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_D)


def _alloc_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor like ``t`` in ``t``'s memory order (as ``torch.empty_like`` and torch's elementwise
    ops give), through the kernels' allocator."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    out = _dq._alloc([t.shape[i] for i in order], t.dtype, t.device)
    return out.permute([order.index(i) for i in range(t.dim())])


# unsqueeze_dim -> (heads dim, sequence dim) of q/k, for cos/sin of shape (B, S, D)
_HEAD_SEQ_DIMS = {1: (1, 2), -3: (1, 2), 2: (2, 1), -2: (2, 1)}


def _bhs(t: torch.Tensor, hd: int, sd: int) -> tuple[int, int, int]:
    """(batch, head, position) strides of q/k."""
    return t.stride(0), t.stride(hd), t.stride(sd)


def _bs(t: torch.Tensor) -> tuple[int, int]:
    """(batch, position) strides of cos/sin; a batch of 1 broadcasts."""
    return t.stride(0) if t.shape[0] > 1 else 0, t.stride(1)


def rotary_unsupported(q, k, cos, sin, unsqueeze_dim=1) -> str | None:
    """Why ``rotary(q, k, cos, sin, unsqueeze_dim)`` cannot run the kernel, or ``None`` when it can."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(cos, torch.Tensor)
            and isinstance(sin, torch.Tensor)):
        return "q, k, cos and sin must be tensors"
    dims = _HEAD_SEQ_DIMS.get(unsqueeze_dim) if type(unsqueeze_dim) is int else None
    if dims is None:
        return f"unsqueeze_dim={unsqueeze_dim!r}: the kernel takes 1 (q/k as B,H,S,D) or 2 (B,S,H,D)"
    dt = q.dtype
    if dt not in DTYPES or k.dtype != dt or cos.dtype != dt or sin.dtype != dt:
        return "q, k, cos and sin must share one dtype: float32, float16 or bfloat16"
    dev = q.device
    if not (q.is_cuda or triton_usable(q)) or k.device != dev or cos.device != dev or sin.device != dev:
        return "q, k, cos and sin must be on one GPU (or the CPU under TRITON_INTERPRET=1)"
    qs, ks, cs = q.shape, k.shape, cos.shape
    if len(qs) != 4 or len(ks) != 4 or len(cs) != 3 or sin.shape != cs:
        return "expected 4-D q and k, and cos and sin of one 3-D shape (B, S, D)"
    sd = dims[1]
    b, seq, d = qs[0], qs[sd], qs[3]
    if ks[0] != b or ks[sd] != seq or ks[3] != d or cs[1] != seq or cs[2] != d or cs[0] not in (1, b):
        return (f"shapes q {tuple(qs)}, k {tuple(ks)}, cos {tuple(cs)} do not match "
                "(batch, sequence and head size must agree)")
    if d % 2 or not 0 < d <= MAX_HEAD_DIM or q.numel() == 0 or k.numel() == 0:
        return f"head size {d}: the kernel takes an even head size up to {MAX_HEAD_DIM} and non-empty q, k"
    if q.stride(3) != 1 or k.stride(3) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1:
        return "q, k, cos and sin must be contiguous in the last dimension"
    return None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` with cos/sin unsqueezed at
    ``unsqueeze_dim``: transformers' ``apply_rotary_pos_emb`` (Llama's), q and k in one launch and bit-exact to torch
    (each product and the sum rounded to the dtype). q (B, Hq, S, D) and k (B, Hk, S, D) for ``unsqueeze_dim=1``
    ((B, S, H, D) for 2) in any strides with a contiguous last dimension, as attention's view + transpose gives;
    cos and sin (B or 1, S, D). The outputs are new tensors in q's and k's memory order."""
    reason = rotary_unsupported(q, k, cos, sin, unsqueeze_dim)
    if reason is not None:
        raise ValueError(f"rotary: {reason}")
    return rotary_unchecked(q, k, cos, sin, unsqueeze_dim)


def rotary_unchecked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary` for inputs :func:`rotary_unsupported` passed (no second check on the hot path)."""
    hd, sd = _HEAD_SEQ_DIMS[unsqueeze_dim]
    b, seq, d = q.shape[0], q.shape[sd], q.shape[3]
    hq, hk, half = q.shape[hd], k.shape[hd], d // 2
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(max(hq, hk)), max(1, 2048 // block_d))
    nqb = cdiv(hq, block_h)
    qo, ko = _alloc_like(q), _alloc_like(k)
    # (the outputs' strides follow from q's and k's; every integer argument from the four inputs' shapes and strides)
    key = ((q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.stride(), q.dtype, q.device,
            unsqueeze_dim, q.data_ptr() % 16, k.data_ptr() % 16, cos.data_ptr() % 16, sin.data_ptr() % 16)
           if launch_plans_enabled() else None)
    with on_device(q):
        # no fused multiply-add: torch rounds the float32 products before adding them
        _ROTARY(key, (b * seq, nqb + cdiv(hk, block_h), 1), q,
                q, k, cos, sin, qo, ko, seq, hq, hk, half, nqb, *_bhs(q, hd, sd), *_bhs(k, hd, sd), *_bhs(qo, hd, sd),
                *_bhs(ko, hd, sd), *_bs(cos), *_bs(sin),
                BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
    return qo, ko


_ROTARY = KernelReplays(_rotary_kernel)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    # torch rounds silu's result to the dtype before the product, and the product once
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (s * u).to(dt), mask=mask)


SILU_MUL_BLOCK = 1024


def silu_mul_unsupported(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why ``silu_mul(gate, up)`` cannot run the kernel, or ``None`` when it can."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        return "gate and up must be tensors"
    if gate.dtype not in DTYPES or up.dtype != gate.dtype:
        return f"dtypes {gate.dtype}/{up.dtype}: the kernel takes one of float32, float16 and bfloat16 for both"
    if not (gate.is_cuda or triton_usable(gate)) or up.device != gate.device:
        return f"gate on {gate.device}, up on {up.device}: the kernel needs both on one GPU (or TRITON_INTERPRET=1)"
    if gate.shape != up.shape or gate.dim() == 0 or gate.numel() == 0:
        return f"shapes {tuple(gate.shape)} and {tuple(up.shape)}: expected one non-empty shape"
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return "gate and up: the last dimension must be contiguous"
    if _row_stride(gate) is None or _row_stride(up) is None:
        return "gate/up: the leading dimensions do not flatten into rows of one stride without a copy"
    return None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch, as torch computes it (silu in float32 rounded to the dtype, then the
    product rounded once; the exponential may differ from torch's in the last float32 bit). ``gate`` and ``up``
    share a shape and dtype, and may be column slices of one tensor (the merged gate/up product); the result is a
    new contiguous tensor."""
    reason = silu_mul_unsupported(gate, up)
    if reason is not None:
        raise ValueError(f"silu_mul: {reason}")
    return silu_mul_unchecked(gate, up)


def silu_mul_unchecked(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` for inputs :func:`silu_mul_unsupported` passed (no second check on the hot path)."""
    n = gate.shape[-1]
    rows = gate.numel() // n
    y = _dq._alloc((rows, n), gate.dtype, gate.device)
    key = ((gate.shape, gate.stride(), up.stride(), gate.dtype, gate.device, gate.data_ptr() % 16,
            up.data_ptr() % 16) if launch_plans_enabled() else None)
    with on_device(gate):
        _SILU_MUL(key, (rows, cdiv(n, SILU_MUL_BLOCK), 1), gate, gate, up, y, _row_stride(gate), _row_stride(up), n,
                  BLOCK=SILU_MUL_BLOCK, num_warps=4)
    return y.view(gate.shape)


_SILU_MUL = KernelReplays(_silu_mul_kernel)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, len_ptr, H, S, L, ROWS, DK, DV,
                     k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program: it reads the count before it advances it, so no other program can see it half-way. A block
    # of rows is loaded (keys and values at once) before it is stored: each block costs one round trip.
    pos0 = tl.load(len_ptr)
    d = tl.arange(0, BLOCK_D)
    for r0 in range(0, ROWS, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        s = r % S
        b = r // S // H
        h = r // S % H
        row_in = r < ROWS
        key = tl.load(k_ptr + (b * k_sb + h * k_sh + s * k_ss)[:, None] + d[None, :],
                      mask=row_in[:, None] & (d < DK)[None, :])
        value = tl.load(v_ptr + (b * v_sb + h * v_sh + s * v_ss)[:, None] + d[None, :],
                        mask=row_in[:, None] & (d < DV)[None, :])
        pos = pos0 + s
        row_ok = row_in & (pos < L)
        tl.store(kc_ptr + (b * kc_sb + h * kc_sh + pos * kc_ss)[:, None] + d[None, :], key,
                 mask=row_ok[:, None] & (d < DK)[None, :])
        tl.store(vc_ptr + (b * vc_sb + h * vc_sh + pos * vc_ss)[:, None] + d[None, :], value,
                 mask=row_ok[:, None] & (d < DV)[None, :])
    tl.store(len_ptr, pos0 + S)


KV_WRITE_MAX_ROWS = 2048  # (batch x heads x tokens) rows one program copies quickly; a longer write takes torch's ops
KV_WRITE_BLOCK = 16384  # elements of keys (and as many of values) a block: batch 16's 8 heads of 128 in one round trip


def kv_write_unsupported(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         length: torch.Tensor) -> str | None:
    """Why ``kv_write(key, value, keys, values, length)`` cannot run the kernel, or ``None`` when it can."""
    tensors = (key, value, keys, values, length)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "key, value, keys, values and length must be tensors"
    if any(t.dim() != 4 for t in tensors[:4]):
        return "expected 4-D key/value (batch, heads, tokens, head_dim) and caches (batch, heads, positions, head_dim)"
    b, h, s, dk = key.shape
    if tuple(value.shape[:3]) != (b, h, s) or tuple(keys.shape[:2]) != (b, h) or keys.shape[3] != dk:
        return f"shapes key {tuple(key.shape)}, value {tuple(value.shape)}, keys {tuple(keys.shape)} do not match"
    if tuple(values.shape[:3]) != tuple(keys.shape[:3]) or values.shape[3] != value.shape[3]:
        return f"shapes value {tuple(value.shape)} and values {tuple(values.shape)} do not match"
    if key.dtype != keys.dtype or value.dtype != values.dtype or key.dtype not in DTYPES or value.dtype not in DTYPES:
        return f"dtypes {key.dtype}/{keys.dtype} and {value.dtype}/{values.dtype}: each pair must be one float dtype"
    if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64):
        return f"length: expected one int32 or int64 element, got {tuple(length.shape)} {length.dtype}"
    if not (key.is_cuda or triton_usable(key)) or any(t.device != key.device for t in tensors):
        return "every tensor must be on one GPU (or the CPU under TRITON_INTERPRET=1)"
    if b * h * s == 0 or b * h * s > KV_WRITE_MAX_ROWS or max(dk, value.shape[3]) > MAX_HEAD_DIM:
        return (f"{b * h * s} rows of head size {max(dk, value.shape[3])}: the kernel takes 1 to "
                f"{KV_WRITE_MAX_ROWS} rows of at most {MAX_HEAD_DIM}")
    if any(t.stride(-1) != 1 for t in tensors[:4]):
        return "key/value and the caches must be contiguous in the head dimension"
    return None


def kv_write(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             length: torch.Tensor) -> None:
    """Write ``key`` and ``value`` (B, H, S, D) into the caches ``keys`` and ``values`` (B, H, L, D) at positions
    ``length .. length + S - 1``, then advance ``length`` (a one-element device tensor) by S, in one launch:
    transformers' ``StaticLayer.update`` (an arange, two adds and two ``index_copy_``). Positions at or beyond L are
    not written (``index_copy_`` would raise there)."""
    reason = kv_write_unsupported(key, value, keys, values, length)
    if reason is not None:
        raise ValueError(f"kv_write: {reason}")
    kv_write_unchecked(key, value, keys, values, length)


def kv_write_unchecked(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       length: torch.Tensor) -> None:
    """:func:`kv_write` for inputs :func:`kv_write_unsupported` passed (no second check on the hot path)."""
    b, h, s, dk = key.shape
    dv = value.shape[3]
    block_d = next_power_of_2(max(dk, dv))
    block_r = max(1, min(next_power_of_2(b * h * s), KV_WRITE_BLOCK // block_d))
    key_ = ((key.shape, key.stride(), value.shape, value.stride(), keys.shape, keys.stride(), values.stride(),
             key.dtype, value.dtype, length.dtype, key.device, key.data_ptr() % 16, value.data_ptr() % 16,
             keys.data_ptr() % 16, values.data_ptr() % 16, length.data_ptr() % 16) if launch_plans_enabled() else None)
    with on_device(key):
        _KV_WRITE(key_, (1, 1, 1), key, key, value, keys, values, length, h, s, keys.shape[2], b * h * s, dk, dv,
                  *key.stride()[:3], *value.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
                  BLOCK_R=block_r, BLOCK_D=block_d, num_warps=kv_write_warps(block_r, block_d))


_KV_WRITE = KernelReplays(_kv_write_kernel)


def kv_write_warps(block_r: int, block_d: int) -> int:
    """Warps of the KV write's program for blocks of ``block_r`` rows of ``block_d``: eight past 4096 elements."""
    return 8 if block_r * block_d > 4096 else 4
