"""QuantLinear: the kernel path (interpreter on CPU, CUDA on a GPU) equals the reference path,
forward and input gradient; buffers and state-dict keys are the packed checkpoint's names."""
import os

import pytest
import torch
from torch import nn

from quantpack import reference
from quantpack.modules.linear import QuantLinear

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() and not INTERP else "cpu"


def make(bits=4, bias=True, k=160, n=72, gs=32, axis=1, dtype=torch.float16):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias)
    return QuantLinear.from_linear(lin, bits=bits, group_size=gs, axis=axis, method="rtn", dtype=dtype).to(DEV)


def test_state_dict_keys_and_buffers():
    m = make()
    assert set(m.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    assert m.qweight.dtype == torch.uint8 and tuple(m.qweight.shape) == (80, 72)
    assert set(make(bias=False).state_dict()) == {"qweight", "scales", "zeros"}


def test_cpu_auto_backend_is_the_reference():
    m = make().cpu()
    x = torch.randn(2, 5, 160, dtype=torch.float16)
    assert torch.equal(m(x), reference.matmul(x, m.packed, m.bias))


def test_unknown_backend_refused():
    m = make()
    m.backend = "cuda-magic"
    with pytest.raises(ValueError, match="backend"):
        m(torch.randn(1, 160, dtype=torch.float16, device=DEV))


def test_wrong_width_refused():
    with pytest.raises(ValueError, match="in_features"):
        make()(torch.randn(1, 100, dtype=torch.float16, device=DEV))


@needs_triton
@pytest.mark.parametrize("bits,axis,gs", [(4, 1, 32), (8, 1, 64), (4, 0, 16)])
@pytest.mark.parametrize("m_rows", [1, 17])
def test_kernel_forward_and_grad_match_reference(bits, axis, gs, m_rows):
    k, n = (192, 72) if axis == 1 else (64, 80)
    layer = make(bits=bits, k=k, n=n, gs=gs, axis=axis)
    layer.backend = "triton"
    ref_layer = make(bits=bits, k=k, n=n, gs=gs, axis=axis)
    ref_layer.backend = "reference"
    x = torch.randn(2, m_rows, k, dtype=torch.float16, device=DEV)
    grad_out = torch.randn(2, m_rows, n, dtype=torch.float16, device=DEV)

    xa = x.clone().requires_grad_(True)
    out = layer(xa)
    out.backward(grad_out)
    xb = x.clone().requires_grad_(True)
    ref = ref_layer(xb)
    ref.backward(grad_out)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert out.shape == ref.shape == (2, m_rows, n)
    assert rel(out, ref) <= 1e-3
    assert xa.grad is not None and xa.grad.shape == x.shape
    assert rel(xa.grad, xb.grad) <= 1e-3
    assert layer.qweight.grad is None


@needs_triton
def test_inference_calls_the_kernel_without_the_autograd_function(monkeypatch):
    """Without a gradient to compute (no_grad, or an x that does not require one) the layer calls mixed_mm directly
    (the autograd Function's bookkeeping is host time on every decode step) and gives the same output, bit for bit,
    as the path that records the graph."""
    from quantpack import kernels

    layer = make()
    layer.backend = "triton"
    x = torch.randn(3, 160, dtype=torch.float16, device=DEV)
    applied = []
    real = kernels.MixedMatmul.apply
    monkeypatch.setattr(kernels.MixedMatmul, "apply", lambda *a: applied.append(1) or real(*a))
    with torch.no_grad():
        plain = layer(x)
    direct = layer(x)  # grad enabled, but x needs none
    assert applied == [] and not direct.requires_grad
    tracked = layer(x.clone().requires_grad_(True))
    assert applied == [1] and tracked.requires_grad
    assert torch.equal(plain, direct) and torch.equal(plain, tracked.detach())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_dequantize_matches_reference(bits, dtype):
    """QuantLinear.dequantize: the kernel on CUDA, the reference elsewhere; the same values either way
    (this used to assert nothing off a GPU)."""
    layer = make(bits=bits)
    got = layer.dequantize(dtype)
    assert got.shape == (layer.out_features, layer.in_features)
    assert torch.equal(got, reference.dequantize(layer.packed, dtype))
