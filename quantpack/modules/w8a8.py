"""``W8A8Linear``: an ``nn.Linear`` replacement with int8 weights and per-token int8 activations."""
from __future__ import annotations

import torch
from torch import nn

from ..quantization.w8a8 import MAX_IN_FEATURES, dequantize_w8a8, quantize_weight_w8a8, w8a8_linear_reference


class W8A8Linear(nn.Module):
    """Linear layer over a frozen int8 weight (buffers ``qweight`` int8 (N, K), ``weight_scale`` float32 (N,),
    optional ``bias`` (N,) in the compute dtype).

    On CUDA the forward runs the Triton kernels (:func:`quantpack.kernels.w8a8.w8a8_linear`); elsewhere
    the pure-torch reference with the same math (exact int32 accumulation, float32 epilogue). The
    output has the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features={in_features}, out_features={out_features}: both must be positive")
        if in_features > MAX_IN_FEATURES:
            raise ValueError(f"in_features={in_features} exceeds {MAX_IN_FEATURES}, the most an int32 accumulator holds")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty((out_features, in_features), dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty((out_features,), dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> "W8A8Linear":
        """Wrap already-quantized tensors (as read from a checkpoint). ``dtype`` is the bias dtype."""
        if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError("qweight: expected a 2-D (out_features, in_features) int8 tensor")
        n, k = qweight.shape
        if not isinstance(weight_scale, torch.Tensor) or tuple(weight_scale.shape) != (n,):
            raise ValueError(f"weight_scale: expected a tensor of shape ({n},)")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected a tensor of shape ({n},) or None")
        dtype = dtype or (bias.dtype if bias is not None else torch.bfloat16)
        m = cls(k, n, bias=bias is not None, dtype=dtype, device="meta")
        m.qweight = qweight.contiguous()
        m.weight_scale = weight_scale.detach().to(torch.float32).contiguous()
        if bias is not None:
            m.bias = bias.detach().to(dtype)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> "W8A8Linear":
        """Quantize ``linear.weight`` per output channel. ``dtype``: bias dtype (default: the weight's
        dtype for float16/bfloat16 weights, bfloat16 otherwise)."""
        w = linear.weight.detach()
        dtype = dtype or (w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
        qweight, weight_scale = quantize_weight_w8a8(w)
        return cls.from_quantized(qweight, weight_scale, linear.bias, dtype=dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_w8a8(self.qweight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the custom op while torch.compile traces, the autograd Function when a gradient is wanted (frozen int8
        # weight; the input gradient passes straight through the activation rounding: kernels/fused_call.py)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
            from ..kernels.w8a8 import W8A8_LINEAR  # (imports triton only where it runs)

            return W8A8_LINEAR.call(x, self.qweight, self.weight_scale, self.bias)
        if x.is_cuda:
            from ..kernels.w8a8 import w8a8_linear

            return w8a8_linear(x, self.qweight, self.weight_scale, self.bias)
        return w8a8_linear_reference(x, self.qweight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme=w8a8, "
                f"bias={self.bias is not None}")
