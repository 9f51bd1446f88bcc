"""The ``w8a8`` scheme: int8 weights with one float32 scale per output channel, int8 per-token activations
(docs/w8a8.md), loaded as :class:`~quantpack.modules.w8a8.W8A8Linear`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..modules.linear import linear_dims
from ..modules.w8a8 import W8A8Linear
from ..quantization.w8a8 import dequantize_w8a8, int8_matmul_exact, quantize_activations_reference, quantize_weight_w8a8
from .base import ModuleCheck, Scheme


def _build(name: str, linear: nn.Module, qc: dict, dtype: torch.dtype) -> nn.Module:
    """A :class:`W8A8Linear` (int8 ``qweight`` (N, K), float32 ``weight_scale`` (N,), bias in ``dtype``)."""
    out_features, in_features, _ = linear_dims(linear)
    return W8A8Linear(in_features, out_features, bias=linear.bias is not None, dtype=dtype, device="meta")


def _stored(shape, bits: int, group_size, axis: int, dtype: torch.dtype) -> dict:
    # nn.Linear's (N, K) layout; the scale stays float32 whatever the output dtype
    return {"qweight": (tuple(shape), torch.int8), "weight_scale": ((shape[0],), torch.float32)}


@torch.no_grad()
def _quantize(weight: torch.Tensor, bits: int, group_size, axis: int, method: str,
              dtype: torch.dtype, input_weights: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric int8 per output channel (docs/format.md, W8A8)."""
    if input_weights is not None:
        raise ValueError("input_weights: the w8a8 scheme rounds each channel by its absolute maximum and weighs "
                         "nothing; use a weight-only scheme")
    qweight, weight_scale = quantize_weight_w8a8(weight)
    return {"qweight": qweight, "weight_scale": weight_scale}, dequantize_w8a8(qweight, weight_scale)


def _oracle(module: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The exact result on the same quantized values, as float32: per-token int8 activations
    (:func:`quantize_activations_reference`, the definition the kernel reproduces bit for bit) times
    the int8 weight with exact integer accumulation, scaled in float64. The forward may differ from
    it only by its float32 epilogue and the final cast."""
    x_q, x_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]))
    out = int8_matmul_exact(x_q, module.qweight).double() * x_scale.double()[:, None]
    out = out * module.weight_scale.double()[None, :]
    if module.bias is not None:
        out = out + module.bias.double()
    return out.float().reshape(*x.shape[:-1], module.out_features)


def _tolerance(module: nn.Module, dtype: torch.dtype) -> float:
    # The output is cast to `dtype` (half an ulp) after a float32 epilogue of at most four roundings
    # (int32 -> float32, two scale products, the bias): for a float32 output 4 * 2**-24 = 2 eps.
    if dtype in (torch.float16, torch.bfloat16):
        return torch.finfo(dtype).eps / 2 + 2 * torch.finfo(torch.float32).eps
    return 2 * torch.finfo(torch.float32).eps


def _locate(read: Callable[[str], torch.Tensor], name: str, module: W8A8Linear, weight: torch.Tensor,
                 settings: dict) -> list[tuple[str, str]]:
    """Which of ``<name>.qweight`` / ``<name>.weight_scale`` changed since conversion from ``weight``.

    Both are pure functions of the weight, computed with correctly rounded float32 operations on
    every device (``weight_scale = max |W[n]| / 127``, ``qweight = clamp(round(W / weight_scale),
    -127, 127)``), so re-quantizing the reference weight reproduces the untouched one bit for bit.
    When both differ, the layer is named.
    """
    qweight, weight_scale = read(f"{name}.qweight"), read(f"{name}.weight_scale")
    n, k = module.out_features, module.in_features
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != (n, k) or weight_scale.dtype != torch.float32 \
            or tuple(weight_scale.shape) != (n,):
        return []  # the shape and dtype checks report it
    want_q, want_scale = quantize_weight_w8a8(weight)
    bad_codes = int((qweight != want_q).sum())
    bad_scales = int((weight_scale.view(torch.uint8) != want_scale.view(torch.uint8)).sum())
    if bad_scales and not bad_codes:
        return [(f"{name}.weight_scale", f"{bad_scales} of {weight_scale.numel() * 4} bytes differ from "
                                         f"max |W| / 127 of the reference weight")]
    if bad_codes and not bad_scales:
        return [(f"{name}.qweight", f"{bad_codes} of {qweight.numel()} codes differ from round(W / weight_scale) "
                                    f"of the reference weight")]
    if bad_codes:
        return [(name, f"{bad_codes} of {qweight.numel()} codes and {bad_scales} scale bytes disagree with the "
                       f"reference weight: {name}.qweight and .weight_scale changed")]
    return []


W8A8 = Scheme("w8a8", W8A8Linear, _build, _stored, _quantize, ModuleCheck(
    layout=lambda m: {"scheme": "w8a8", "bits": 8},
    dequantize=lambda m: m.dequantize(torch.float32),
    oracle=_oracle,
    tolerance=_tolerance,
    locate=_locate,
    stored_dtypes={"weight_scale": torch.float32},
))
