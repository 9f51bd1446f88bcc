"""kernels/fused_call.py: each fused op's input gradient is one function, which the autograd Function (a module
called with a gradient wanted) and the custom op's autograd (torch.compile, direct op calls) both run."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from quantpack.kernels.mixed_mm import MIXED_MM, mixed_mm_op
from quantpack.modules.linear import QuantLinear
from quantpack.modules.w8a8 import W8A8Linear

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not (ON_GPU or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")),
                                reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _counting(monkeypatch, fused):
    calls = []
    real = fused.input_grad

    def input_grad(call, grad_out, *args):
        calls.append(call)
        return real(call, grad_out, *args)

    monkeypatch.setattr(fused, "input_grad", input_grad)
    return calls


def _grad(fn, x, g):
    x = x.clone().requires_grad_(True)
    fn(x).backward(g)
    return x.grad


def test_quant_linear_input_gradient_is_one_function_on_both_routes(monkeypatch):
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(64, 48), bits=4, group_size=32, method="rtn", dtype=torch.float16)
    layer = layer.to(DEV)
    layer.backend = "triton"  # (the kernels; in the interpreter on the CPU)
    calls = _counting(monkeypatch, MIXED_MM)
    x, g = torch.randn(3, 64, dtype=torch.float16, device=DEV), torch.randn(3, 48, dtype=torch.float16, device=DEV)
    want = g.float() @ layer.dequantize(torch.float32)
    by_function = _grad(layer, x, g)
    by_op = _grad(lambda t: mixed_mm_op(t, layer.qweight, layer.scales, layer.zeros, layer.bias, layer.group_size,
                                        layer.bits, layer.axis, False), x, g)
    assert len(calls) == 2 and calls[0] is MIXED_MM and calls[1] is not MIXED_MM  # (the op's backward calls the op)
    torch.testing.assert_close(by_function.float(), want, rtol=2e-3, atol=2e-3)
    assert torch.equal(by_op, by_function)


def test_w8a8_input_gradient_is_one_function_on_both_routes(monkeypatch):
    from quantpack.kernels.w8a8 import W8A8_LINEAR, w8a8_linear_op

    torch.manual_seed(0)
    layer = W8A8Linear.from_linear(nn.Linear(64, 48, bias=True), dtype=torch.float32).to(DEV)
    calls = _counting(monkeypatch, W8A8_LINEAR)
    x, g = torch.randn(3, 64, device=DEV), torch.randn(3, 48, device=DEV)
    want = g @ layer.dequantize(torch.float32)
    by_function = _grad(layer, x, g)
    by_op = _grad(lambda t: w8a8_linear_op(t, layer.qweight, layer.weight_scale, layer.bias), x, g)
    assert len(calls) == 2 and calls[0] is W8A8_LINEAR and calls[1] is not W8A8_LINEAR
    torch.testing.assert_close(by_function, want)
    assert torch.equal(by_op, by_function)


def test_a_call_without_gradient_skips_the_function(monkeypatch):
    """The decode path: no autograd Function, no custom op, the eager launcher directly."""
    layer = QuantLinear.from_linear(nn.Linear(64, 48), bits=4, group_size=32, method="rtn", dtype=torch.float16)
    layer = layer.to(DEV)
    layer.backend = "triton"
    monkeypatch.setattr(MIXED_MM, "call", lambda *a: pytest.fail("the direct call went through FusedOp.call"))
    x = torch.randn(2, 64, dtype=torch.float16, device=DEV)
    with torch.no_grad():
        layer(x)
    layer(x)  # (gradients on, but x needs none)
