"""``QuantLinear``: a drop-in ``nn.Linear`` replacement holding a packed quantized weight."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..format import PackedWeight, packed_shapes, check_layout_args
from ..quantization.groupwise import quantize, resolve_group_size
from .. import kernels, reference
from ..kernels.launch_plan import PlanCache
from ..kernels.dispatch import w4a8_reference
from ..kernels.mixed_mm import MIXED_MM


def linear_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    """``(out_features, in_features, stored_transposed)`` of a module quantpack converts: an
    ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2 and its relatives: ``y = x @ weight + bias``
    with ``weight`` stored (in, out), i.e. transposed); ``None`` for anything else."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features, False
    # Conv1D only exists once transformers is imported: no import here (import quantpack stays fast)
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None and isinstance(module, conv1d):
        return module.nf, module.nx, True
    return None


class QuantLinear(nn.Module):
    """Linear layer over a frozen packed weight (buffers ``qweight``, ``scales``, ``zeros``, ``bias``).

    The state-dict keys are exactly the tensor names of a packed checkpoint
    (``<module>.qweight``, ``<module>.scales``, ``<module>.zeros``, ``<module>.bias``).

    ``backend`` picks the forward: ``"auto"`` (default) runs the fused Triton kernel on CUDA and
    the pure-torch reference elsewhere; ``"triton"`` forces the kernel (on CPU it needs
    TRITON_INTERPRET=1: slow, for tests); ``"reference"`` forces the reference. Set it on the
    class or on one instance. The backward returns the input gradient only (weights are frozen).
    """

    backend = "auto"
    _merged = None  # (MergedProjections, index) when linked to siblings reading the same input (modules/merged.py)

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4, group_size: int | None = 128,
                 axis: int = 1, bias: bool = False, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        shape = (out_features, in_features)
        group_size = resolve_group_size(group_size, shape, axis)
        check_layout_args(shape, bits, group_size, axis)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.axis = bits, group_size, axis
        shapes = packed_shapes(shape, bits, group_size, axis)
        self.register_buffer("qweight", torch.empty(shapes["qweight"], dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(shapes["scales"], dtype=dtype, device=device))
        self.register_buffer("zeros", torch.empty(shapes["zeros"], dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        # the fused kernel's launch plans for this layer's buffers (kernels/launch_plan.py): a repeated input shape
        # skips the host-side dispatch
        self._plans = PlanCache()

    @classmethod
    def from_packed(cls, pw: PackedWeight, bias: torch.Tensor | None = None) -> "QuantLinear":
        pw.validate()
        n, k = pw.shape
        m = cls(k, n, bits=pw.bits, group_size=pw.group_size, axis=pw.axis, bias=bias is not None,
                dtype=pw.scales.dtype, device="meta")
        m.qweight, m.scales, m.zeros = pw.qweight, pw.scales, pw.zeros
        if bias is not None:
            m.bias = bias.detach().to(pw.scales.dtype)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, bits: int = 4, group_size: int | None = 128, axis: int = 1,
                    method: str = "hqq", dtype: torch.dtype | None = None) -> "QuantLinear":
        pw = quantize(linear.weight.detach(), bits=bits, group_size=group_size, axis=axis, method=method, dtype=dtype)
        return cls.from_packed(pw, linear.bias)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.axis,
                            (self.out_features, self.in_features))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.qweight.is_cuda:
            return kernels.dequantize(self.qweight, self.scales, self.zeros, group_size=self.group_size,
                                      bits=self.bits, axis=self.axis, out_dtype=dtype)
        return reference.dequantize(self.packed, dtype)

    def _apply(self, fn, *args, **kwargs):
        if "_plans" in self.__dict__:  # (moved or cast: the plans hold the old tensors)
            self._plans.clear()
        return super()._apply(fn, *args, **kwargs)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_plans", PlanCache())  # (a layer pickled before launch plans existed)

    def _use_kernel(self, x: torch.Tensor, qweight: torch.Tensor) -> bool:
        if self.backend == "reference":
            return False
        if self.backend == "triton":
            return True
        if self.backend != "auto":
            raise ValueError(f"backend={self.backend!r}; use 'auto', 'triton' or 'reference'")
        return x.is_cuda and qweight.is_cuda

    def _tensors(self, compiling: bool | None = None) -> tuple:
        """``(qweight, scales, zeros, bias)``, read from the buffers dict where they are buffers (as registered) in
        eager calls: an ``nn.Module`` attribute lookup of a buffer costs about 0.5 us on a CPU like CI's, three times
        that on some GPU hosts, and a decode call needs five. The attribute path while torch.compile traces
        (``compiling``, when the caller knows), and for a tensor that is not a buffer (say, re-registered as a
        parameter)."""
        b = self._buffers
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        if not compiling and "qweight" in b and "scales" in b and "zeros" in b:
            return b["qweight"], b["scales"], b["zeros"], b["bias"] if "bias" in b else self.bias
        return self.qweight, self.scales, self.zeros, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self._merged
        if merged is not None and merged[1] and self.backend != "reference":
            # a sibling: its columns of the product the first member's call computed (modules/merged.py), taken
            # before any other work, a decode step makes three such calls a layer
            out = merged[0].take(merged[1], x, torch.compiler.is_compiling())
            if out is not None:
                return out
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={self.in_features}")
        compiling = torch.compiler.is_compiling()
        qweight, scales, zeros, bias = self._tensors(compiling)
        if self._use_kernel(x, qweight):
            if merged is not None and not merged[1]:  # the first member: all the members' product in one launch
                out = merged[0].compute(x, compiling)
                if out is not None:
                    return out
            # the custom op while torch.compile traces, the autograd Function when adapters below train (kernels/
            # fused_call.py); else the direct call: the Function's own bookkeeping cost 15-30 us a call on an H200 host
            if compiling or (torch.is_grad_enabled() and x.requires_grad):
                return MIXED_MM.call(x, qweight, scales, zeros, bias, self.group_size, self.bits, self.axis, False,
                                     self._plans)
            return kernels.mixed_mm(x, qweight, scales, zeros, group_size=self.group_size, bits=self.bits,
                                    axis=self.axis, bias=bias, plans=self._plans)
        if w4a8_reference(self.out_features, self.in_features, self.group_size, self.bits, self.axis):
            return reference.matmul_fp8_activations(x, self.packed, bias)
        return reference.matmul(x, self.packed, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, axis={self.axis}, bias={self.bias is not None}")
