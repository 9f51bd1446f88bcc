"""Group-wise asymmetric quantization of linear weights: ``W ~= (q - zero) * scale``.

``q`` is unsigned in [0, 2**bits - 1]; ``zero`` is a float in the integer domain (as in hqq);
scale and zero are stored in the compute dtype. Three methods:

* ``rtn``: min/max round-to-nearest.
* ``hqq``: HQQ's half-quadratic optimization of the zero point, solved by the hqq library's
  own ``optimize_weights_proximal``.
* ``refit``: least-squares scale *and* zero per group, alternating with rounding (:func:`refit`),
  started from hqq's and min/max solutions; each group keeps the lowest squared weight error
  found, so it is never above hqq's (before the storage dtype's rounding).
"""
from __future__ import annotations

import torch

from ..format import PackedWeight, check_layout_args, pack

METHODS = ("hqq", "rtn", "refit")
REFIT_ITERS = 10
REFIT_SHRINK = (0.9, 0.8, 0.7)  # min/max ranges tried besides the full one (outliers clipped)
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
def refit(wg: torch.Tensor, qmax: int, starts, *, floor: torch.Tensor, dtype: torch.dtype = torch.float32,
          iters: int = REFIT_ITERS, shrink=REFIT_SHRINK,
          weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per group (row of ``wg``) minimising ``||w - scale * (q - zero)||^2``, or with
    ``weights`` (positive, shaped like ``wg``) ``sum(weights * (w - scale * (q - zero))^2)``.

    Lloyd-style: the codes by rounding, then (scale, zero) by least squares on those codes (a
    line fit of ``w`` against ``q``), repeated; each group keeps the best pair seen. Run from each of
    ``starts`` (``(inverse scale, zero)`` pairs) and from min/max ranges shrunk by ``shrink``
    about their midpoint. Returns ``(inverse scale, zero)``.
    Scale and zero are rounded to ``dtype`` (their storage dtype) as they are found, so the pairs are
    compared as the kernel will see them: at 8 bits a bfloat16 scale's rounding (2**-9 relative, times
    codes up to 255) is as large as what the fit gains. All groups at once: a few passes per step.
    """
    def stored(x):
        return x.to(dtype).float()

    wmin = wg.amin(dim=1, keepdim=True)
    wmax = wg.amax(dim=1, keepdim=True)
    mid = (wmin + wmax) / 2
    candidates = [(stored(1 / inv), stored(z)) for inv, z in starts]
    for f in shrink:
        s = stored(torch.maximum((wmax - wmin) * f / qmax, floor))
        candidates.append((s, stored(qmax / 2 - mid / s)))
    n = wg.shape[1]
    # weights normalized to mean 1 per group: the fit's floor on the code variance keeps its meaning
    wt = torch.ones_like(wg) if weights is None else weights / weights.mean(1, keepdim=True)
    best_e = best_s = best_z = None
    for s, z in candidates:
        for step in range(iters + 1):
            q = torch.round(wg / s + z).clamp_(0, qmax)
            e = (wg - s * (q - z)).square_().mul_(wt).sum(1, keepdim=True)
            if best_e is None:
                best_e, best_s, best_z = e, s, z
            else:
                better = e < best_e
                best_e, best_s, best_z = (torch.where(better, e, best_e), torch.where(better, s, best_s),
                                          torch.where(better, z, best_z))
            if step == iters:
                break
            mq = (wt * q).mean(1, keepdim=True)
            mw = (wt * wg).mean(1, keepdim=True)
            dq = q - mq
            var = (wt * dq.square()).sum(1, keepdim=True)
            a = (wt * dq * wg).sum(1, keepdim=True) / var.clamp_min(1.0 / n)
            ok = (var > 0) & (a >= floor)  # a flat code group keeps its scale; never below the floor
            s = torch.where(ok, stored(a), s)
            z = torch.where(ok, stored(mq - mw / s), z)  # w = s q + b, b = mw - s mq = -s z: the zero for the stored s
    return 1 / best_s, best_z


def _check_input_weights(v, shape, method: str, axis: int) -> None:
    if method != "refit":
        raise ValueError(f"input_weights: used by method='refit' only, not method={method!r}; drop input_weights "
                         f"or pass method='refit'")
    if axis != 1:
        raise ValueError("input_weights: weigh input features, which needs groups along them; use axis=1")
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or tuple(v.shape) != (shape[1],):
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"input_weights: expected a float tensor of shape ({shape[1]},), one weight per input "
                         f"feature, got {got}")
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()) or not bool((v > 0).any()):
        raise ValueError("input_weights: must be finite, non-negative and not all zero (second moments of the "
                         "layer's inputs)")


@torch.no_grad()
def quantize(weight: torch.Tensor, *, bits: int = 4, group_size: int | None = 128, axis: int = 1,
             method: str = "hqq", dtype: torch.dtype | None = None,
             input_weights: torch.Tensor | None = None) -> PackedWeight:
    """Quantize a (N, K) linear weight and return it packed (see :mod:`quantpack.format`).

    ``dtype`` is the dtype of scales/zeros (the compute dtype): float16 or bfloat16, or float32
    when asked for. Default: the weight's dtype for float16/bfloat16 weights, bfloat16 for float32.
    ``group_size=None`` quantizes per channel (one group spanning the grouped axis).
    ``input_weights`` (``refit`` only, axis 1): a positive weight per input feature (K,), e.g. the second
    moments of the layer's inputs, so that ``refit`` minimizes the output error those inputs would see
    (its diagonal part) instead of the plain weight error.
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
    if input_weights is not None:
        _check_input_weights(input_weights, shape, method, axis)

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
    if method in ("hqq", "refit"):
        from hqq.core.optimize import optimize_weights_proximal

        start = (inv_scale, zero)
        _, inv_scale, zero = optimize_weights_proximal(tensor=wg, scale=inv_scale, zero=zero,
                                                        min_max=[0, qmax], axis=1, device=wg.device)
        inv_scale, zero = inv_scale.float(), zero.float()
        if bits == 4:
            # the hqq library starts 4-bit groups from an integer zero, which settles in better minima on
            # real weights (Qwen2.5-Coder-0.5B's late layers); the fractional start is exact on a
            # half-integer grid: keep, per group, whichever reconstructs better
            int_zero = torch.where(floored, start[1], torch.round(start[1]))
            _, s2, z2 = optimize_weights_proximal(tensor=wg, scale=start[0], zero=int_zero,
                                                  min_max=[0, qmax], axis=1, device=wg.device)
            s2, z2 = s2.float(), z2.float()

            def err(inv, z):
                sc, zz = (1.0 / inv).to(dtype).float(), z.to(dtype).float()
                return ((torch.round(wg / sc + zz).clamp(0, qmax) - zz) * sc - wg).square().sum(1, keepdim=True)

            better = err(s2, z2) < err(inv_scale, zero)
            inv_scale, zero = torch.where(better, s2, inv_scale), torch.where(better, z2, zero)
        if method == "refit":
            wts = None
            if input_weights is not None:
                # a tiny floor: a feature never seen active still gets rounded sensibly
                v = input_weights.to(wg.device, torch.float32)
                v = v + 1e-6 * float(v.mean()) + 1e-30
                wts = grouped(v.expand(shape[0], -1), group_size, axis)
            inv_scale, zero = refit(wg, qmax, [start, (inv_scale, zero)], floor=min_scale, dtype=dtype, weights=wts)
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
