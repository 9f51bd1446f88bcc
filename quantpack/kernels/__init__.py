"""Fused Triton kernels for quantpack's packed weights (see docs/kernels.md).

* :func:`mixed_mm`: ``x @ W.T`` (or ``x @ W`` with ``transposed=True``) with W dequantized in
  registers; tuned configs per GPU are read from ``configs/*.json``.
* :func:`dequantize`: the dense (N, K) weight, bits 4/8, axis 0/1, optional 8-bit zeros.
* :func:`explain`: which kernel and config a call runs on a GPU, and why (dispatch.py decides).
* :mod:`quantpack.kernels.moe`: ``fused_experts``, a mixture-of-experts block's experts on stacked packed weights.
"""
from .dequant import dequantize
from .dispatch import explain
from .mixed_mm import KernelConfig, MixedMatmul, mixed_mm

__all__ = ["mixed_mm", "dequantize", "explain", "MixedMatmul", "KernelConfig"]
