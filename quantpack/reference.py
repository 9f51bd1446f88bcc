"""Pure-torch reference path: the oracle every kernel is tested against, and the CPU fallback."""
from __future__ import annotations

import torch

from .format import PackedWeight, unpack


def expand_meta(meta: torch.Tensor, shape, group_size: int, axis: int) -> torch.Tensor:
    """Broadcast packed-layout scales or zeros to the full (N, K) weight shape."""
    if axis == 1:  # (K/g, N) -> (N, K)
        return meta.t().repeat_interleave(group_size, dim=1)
    return meta.repeat_interleave(group_size, dim=1).t()  # (K, N/g) -> (N, K)


def dequantize(pw: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return the (N, K) weight ``(q - zero) * scale``, computed in float32, cast to ``dtype``
    (default: the dtype of the scales)."""
    q = unpack(pw.qweight, pw.bits).float()
    scale = expand_meta(pw.scales.float(), pw.shape, pw.group_size, pw.axis)
    zero = expand_meta(pw.zeros.float(), pw.shape, pw.group_size, pw.axis)
    return ((q - zero) * scale).to(dtype or pw.scales.dtype)


def matmul(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T (+ bias)``, accumulated in float32, returned in ``x.dtype``."""
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={pw.in_features}")
    out = x.float() @ dequantize(pw, torch.float32).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
