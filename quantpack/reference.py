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


FP8_MAX = 448.0  # the largest finite float8 e4m3 (float8_e4m3fn) value
FP8_AMAX_FLOOR = 1e-30  # an all-zero row quantizes to zeros with a finite scale


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 e4m3 quantization of ``x`` (..., K), as the W4A8 path does it (kernels/w4a8.py): ``(xq,
    scale)`` with ``amax = max(max_k |x|, FP8_AMAX_FLOOR)``, ``scale = amax / 448`` (float32, ``x.shape[:-1]``) and
    ``xq = clamp(x * (448 / amax), -448, 448)`` rounded to float8_e4m3fn (``x ~ xq * scale``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    # (both divisions correctly rounded, as the kernel's: torch's float32 division of a scalar by a tensor is not)
    inv = (FP8_MAX / amax.double()).float()
    xq = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, (amax.double() / FP8_MAX).float().squeeze(-1)


def matmul_fp8_activations(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`matmul` with ``x`` first quantized per token to FP8 (:func:`quantize_activations_fp8`): the float
    reference of the W4A8 path, and what the CPU runs where that path is forced (``QUANTPACK_W4A8=force``)."""
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={pw.in_features}")
    xq, scale = quantize_activations_fp8(x)
    out = (xq.float() @ dequantize(pw, torch.float32).t()) * scale.unsqueeze(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
