"""The weight-only schemes ``w4a16`` and ``w8a16``: packed 4/8-bit codes with per-group scales and zeros
(docs/format.md), loaded as :class:`~quantpack.modules.linear.QuantLinear`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..format import PackedWeight, packed_shapes, unpack
from ..modules.linear import QuantLinear, linear_dims
from ..quantization.groupwise import grouped, quantize, ungrouped
from .. import reference
from ..kernels.dispatch import w4a8_runs
from ..reference import dequantize, expand_meta
from .base import ModuleCheck, Scheme


def _build(name: str, linear: nn.Module, qc: dict, dtype: torch.dtype) -> nn.Module:
    """A :class:`QuantLinear` (packed weight; scales, zeros and bias in ``dtype``)."""
    out_features, in_features, _ = linear_dims(linear)
    return QuantLinear(in_features, out_features, bits=qc["bits_overrides"].get(name, qc["bits"]),
                       group_size=qc["group_size"], axis=qc["axis"], bias=linear.bias is not None, dtype=dtype,
                       device="meta")


def _stored(shape, bits: int, group_size: int, axis: int, dtype: torch.dtype) -> dict:
    shapes = packed_shapes(shape, bits, group_size, axis)
    return {"qweight": (shapes["qweight"], torch.uint8), "scales": (shapes["scales"], dtype),
            "zeros": (shapes["zeros"], dtype)}


@torch.no_grad()
def _quantize(weight: torch.Tensor, bits: int, group_size: int, axis: int, method: str,
              dtype: torch.dtype, input_weights: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    pw = quantize(weight, bits=bits, group_size=group_size, axis=axis, method=method, dtype=dtype,
                  input_weights=input_weights)
    return {"qweight": pw.qweight, "scales": pw.scales, "zeros": pw.zeros}, dequantize(pw, torch.float32)


def _oracle(module: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` in float32 with the module's dequantized weight; with x first rounded per token to FP8 where
    the forward runs the W4A8 path (kernels/w4a8.py)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    if w4a8_runs(m, module.out_features, module.in_features, module.bits, module.group_size, module.axis, x.device):
        return reference.matmul_fp8_activations(x.float(), module.packed, module.bias)
    out = x.float() @ module.dequantize(torch.float32).t()
    return out + module.bias.float() if module.bias is not None else out


def _tolerance(module: nn.Module, dtype: torch.dtype) -> float:
    # The output is rounded to `dtype` and (on a GPU) the dot runs on `dtype` operands, float32 as
    # tf32: a relative error of a few units of that precision's epsilon, never more.
    eps = torch.finfo(dtype).eps if dtype in (torch.float16, torch.bfloat16) else torch.finfo(torch.float16).eps
    return 2.0 * eps


def _locate(read: Callable[[str], torch.Tensor], name: str, module: QuantLinear, weight: torch.Tensor,
                         settings: dict) -> list[tuple[str, str]]:
    """Which of ``<name>.qweight/.scales/.zeros`` changed since conversion from ``weight``.

    The codes are a pure function of the weight and the stored scales and zeros
    (``round(W / scale + zero)`` clamped, see :func:`quantpack.quantization.groupwise.quantize`), so codes that
    disagree mean one of the three changed. Re-quantizing the weight with the recorded settings tells
    which: on the kind of device the conversion ran on (not recorded in the manifests that need this
    fallback, those without per-tensor digests: each available one is tried) it reproduces the
    untouched tensors bit for bit. When no re-quantization does, the layer is named.
    """
    from ..quantization.groupwise import quantize as requantize  # (looked up per call, as a stand-in for another device's rounding)

    pw = PackedWeight(read(f"{name}.qweight"), read(f"{name}.scales"), read(f"{name}.zeros"), module.bits,
                      module.group_size, module.axis, (module.out_features, module.in_features))
    pw.validate()
    qmax = (1 << pw.bits) - 1
    scale = expand_meta(pw.scales.float(), pw.shape, pw.group_size, pw.axis)
    zero = expand_meta(pw.zeros.float(), pw.shape, pw.group_size, pw.axis)
    w = ungrouped(grouped(weight.float(), pw.group_size, pw.axis), pw.shape, pw.axis)
    expected = torch.round(w / scale + zero).clamp_(0, qmax).to(torch.uint8)
    codes = unpack(pw.qweight, pw.bits)
    differing = int((codes != expected).sum())

    def differing_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())

    best = None  # (changed tensors, re-quantization) closest to what is stored
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            again = requantize(weight.to(device), bits=pw.bits, group_size=pw.group_size, axis=pw.axis,
                             method=settings.get("method", "hqq"), dtype=pw.scales.dtype).to("cpu")
        except (ValueError, RuntimeError, ImportError):
            continue
        changed = [sfx for sfx in ("qweight", "scales", "zeros") if differing_bytes(getattr(pw, sfx), getattr(again, sfx))]
        if best is None or len(changed) < len(best[0]):
            best = (changed, again)
    if best is not None and 0 < len(best[0]) < 3:
        changed, again = best
        return [(f"{name}.{sfx}", f"{differing_bytes(getattr(pw, sfx), getattr(again, sfx))} of "
                                  f"{getattr(pw, sfx).numel() * getattr(pw, sfx).element_size()} bytes differ from a "
                                  f"re-quantization of the reference weight") for sfx in changed]
    if differing:
        return [(name, f"{differing} of {codes.numel()} codes disagree with the reference weight and the stored "
                       f"scales and zeros: one of {name}.qweight, .scales, .zeros changed")]
    return []


CHECK = ModuleCheck(
    layout=lambda m: {"bits": m.bits, "group_size": m.group_size, "axis": m.axis},
    dequantize=lambda m: m.dequantize(torch.float32),
    oracle=_oracle,
    tolerance=_tolerance,
    locate=_locate,
)
W4A16 = Scheme("w4a16", QuantLinear, _build, _stored, _quantize, CHECK)
W8A16 = Scheme("w8a16", QuantLinear, _build, _stored, _quantize, CHECK)
