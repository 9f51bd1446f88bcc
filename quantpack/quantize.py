"""Group-wise asymmetric quantization of linear weights: ``W ~= (q - zero) * scale``.

``q`` is unsigned in [0, 2**bits - 1]; ``zero`` is a float in the integer domain (as in hqq);
scale and zero are stored in the compute dtype. Two methods:

* ``rtn``: min/max round-to-nearest.
* ``hqq``: HQQ's half-quadratic optimization of the zero point, solved by the hqq library's
  own ``optimize_weights_proximal``.
"""
from __future__ import annotations

import torch

from .format import PackedWeight, check_layout_args, pack

METHODS = ("hqq", "rtn")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point() or weight.dtype.itemsize < 2:
        raise ValueError(f"weight: dtype {weight.dtype} cannot be quantized; pass a float16, bfloat16 or float32 tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D (out_features, in_features) tensor, got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight: contains NaN or inf values; fix the checkpoint before quantizing")


def resolve_group_size(group_size: int | None, shape, axis: int) -> int:
    """``None`` means per-channel: one group spanning the whole grouped axis."""
    if group_size is None:
        return shape[1] if axis == 1 else shape[0]
    return group_size


def grouped(w: torch.Tensor, group_size: int, axis: int) -> torch.Tensor:
    """View of ``w`` (N, K) as (groups, group_size), one group per row, in storage order."""
    n, k = w.shape
    if axis == 1:
        return w.reshape(n * (k // group_size), group_size)  # group index = n * (K/g) + k // g
    return w.t().reshape(k * (n // group_size), group_size)  # group index = k * (N/g) + n // g


def ungrouped(g: torch.Tensor, shape, axis: int) -> torch.Tensor:
    n, k = shape
    return g.reshape(n, k) if axis == 1 else g.reshape(k, n).t()


def _meta_layout(v: torch.Tensor, shape, group_size: int, axis: int) -> torch.Tensor:
    """Per-group values (groups, 1) in grouping order -> the packed (.., N) layout."""
    n, k = shape
    if axis == 1:
        return v.reshape(n, k // group_size).t().contiguous()
    return v.reshape(k, n // group_size).contiguous()


@torch.no_grad()
def quantize(weight: torch.Tensor, *, bits: int = 4, group_size: int | None = 128, axis: int = 1,
             method: str = "hqq", dtype: torch.dtype | None = None) -> PackedWeight:
    """Quantize a (N, K) linear weight and return it packed (see :mod:`quantpack.format`).

    ``dtype`` is the dtype of scales/zeros (the compute dtype): float16 or bfloat16, or float32
    when asked for. Default: the weight's dtype for float16/bfloat16 weights, bfloat16 for float32.
    ``group_size=None`` quantizes per channel (one group spanning the grouped axis).
    """
    _check_weight(weight)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not supported; use one of {METHODS}")
    dtype = dtype or (weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    shape = tuple(weight.shape)
    group_size = resolve_group_size(group_size, shape, axis)
    check_layout_args(shape, bits, group_size, axis)

    qmax = (1 << bits) - 1
    wg = grouped(weight.float(), group_size, axis)
    wmin = wg.amin(dim=1, keepdim=True)
    wmax = wg.amax(dim=1, keepdim=True)
    # Inverse scale, as hqq works with it. The scale is range/qmax, with two floors and no absolute
    # one (a fixed floor blurred small weights: 8-bit groups narrower than ~0.013, 4-bit narrower
    # than ~1e-3): the smallest scale the storage dtype holds with full precision (float16: 2**-15,
    # a subnormal with 9 significant bits), and absmax * 2**-15 so that the zero point
    # (-wmin/scale, in the integer domain) stays within +-2**15 even for a flat or offset group
    # (finite in float16, exact enough in float32 arithmetic). Where a floor holds, the group's
    # midpoint lands on the middle integer (a flat group then reconstructs exactly).
    floor = 2.0 ** -15 if dtype == torch.float16 else torch.finfo(dtype).tiny
    absmax = torch.maximum(wmin.abs(), wmax.abs())
    min_scale = torch.clamp(absmax * 2.0 ** -15, min=floor)
    floored = wmax - wmin < min_scale * qmax
    inv_scale = qmax / torch.where(floored, min_scale * qmax, wmax - wmin)
    zero = torch.where(floored, (qmax // 2) - (wmin + wmax) / 2 * inv_scale, -wmin * inv_scale)
    if method == "hqq":
        from hqq.core.optimize import optimize_weights_proximal

        _, inv_scale, zero = optimize_weights_proximal(tensor=wg, scale=inv_scale, zero=zero,
                                                        min_max=[0, qmax], axis=1, device=wg.device)
        inv_scale, zero = inv_scale.float(), zero.float()
    # Round scale/zero to the storage dtype first, then pick q against the stored values, so the
    # integers are optimal for what the kernel will actually see.
    scale = (1.0 / inv_scale).to(dtype)
    zero = zero.to(dtype)
    q = torch.round(wg / scale.float() + zero.float()).clamp_(0, qmax).to(torch.uint8)
    q = ungrouped(q, shape, axis)
    return PackedWeight(
        qweight=pack(q, bits),
        scales=_meta_layout(scale, shape, group_size, axis),
        zeros=_meta_layout(zero, shape, group_size, axis),
        bits=bits, group_size=group_size, axis=axis, shape=shape,
    )
