"""W8A8 weight quantizer and ``W8A8Linear`` (CPU reference path; the kernel path under the interpreter/GPU)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from quantpack.modules.w8a8 import W8A8Linear
from quantpack.quantization.w8a8 import (
    MAX_IN_FEATURES, dequantize_w8a8, quantize_activations_reference, quantize_weight_w8a8,
    w8a8_linear_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- weight quantizer ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_weight_per_channel_symmetric(dtype):
    torch.manual_seed(0)
    w = (torch.randn(37, 53) * torch.logspace(-2, 2, 37)[:, None]).to(dtype)
    q, scale = quantize_weight_w8a8(w)
    assert q.dtype == torch.int8 and q.shape == (37, 53) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    amax = w.float().abs().amax(dim=1)
    assert torch.equal(scale, amax / torch.full_like(amax, 127))
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(dim=1) == 127).all())
    err = (dequantize_w8a8(q, scale) - w.float()).abs()
    assert bool((err <= scale[:, None] * 0.5 * (1 + 1e-5)).all())


def test_quantize_weight_zero_row_and_outlier():
    w = torch.randn(4, 64)
    w[1] = 0
    w[2, 5] = 1e4  # the outlier takes 127, the rest of its row rounds to small integers
    q, scale = quantize_weight_w8a8(w)
    assert scale[1].item() == 1.0 and not bool(q[1].any())
    assert q[2, 5].item() == 127 and int(q[2].abs().topk(2).values[1]) <= 1


@pytest.mark.parametrize("bad,match", [
    (torch.randint(0, 5, (4, 4)), "dtype"),
    (torch.randn(8), "2-D"),
    (torch.tensor([[1.0, float("nan")]]), "NaN"),
    (torch.zeros(1, MAX_IN_FEATURES + 1), "int32 accumulator"),
    ("weights", "torch.Tensor"),
])
def test_quantize_weight_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize_weight_w8a8(bad)


# --- W8A8Linear ----------------------------------------------------------------------------------

def _linear(k=96, n=40, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_w8a8_linear_module_cpu_forward(dtype, bias):
    lin = _linear(bias=bias, dtype=dtype)
    mod = W8A8Linear.from_linear(lin)
    assert mod.qweight.dtype == torch.int8 and mod.qweight.shape == (40, 96)
    assert mod.weight_scale.dtype == torch.float32 and mod.weight_scale.shape == (40,)
    if bias:
        want = dtype if dtype != torch.float32 else torch.bfloat16
        assert mod.bias.dtype == want
    x = torch.randn(2, 5, 96).to(dtype)
    out = mod(x)
    assert out.shape == (2, 5, 40) and out.dtype == dtype
    assert torch.equal(out, w8a8_linear_reference(x, mod.qweight, mod.weight_scale, mod.bias))
    exact = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float() if bias else None)
    assert ((out.float() - exact).norm() / exact.norm()).item() < 0.02


def test_w8a8_reference_is_exact_int_math():
    # The CPU path: int8 activations and weights, exact integer products, float32 epilogue.
    mod = W8A8Linear.from_linear(_linear(k=300, n=7, bias=True))
    x = torch.randn(3, 300)
    x_q, x_scale = quantize_activations_reference(x)
    acc = x_q.long() @ mod.qweight.long().t()
    want = (acc.float() * x_scale[:, None] * mod.weight_scale[None, :] + mod.bias.float()).to(torch.float32)
    assert torch.equal(mod(x), want)


def test_w8a8_state_dict_round_trip():
    mod = W8A8Linear.from_linear(_linear(dtype=torch.bfloat16))
    sd = mod.state_dict()
    assert set(sd) == {"qweight", "weight_scale", "bias"}
    fresh = W8A8Linear(96, 40, bias=True, dtype=torch.bfloat16)
    fresh.load_state_dict(sd)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), mod(x))
    assert "scheme=w8a8" in repr(fresh)


def test_w8a8_from_quantized_bad_input():
    q, s = quantize_weight_w8a8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="qweight"):
        W8A8Linear.from_quantized(q.to(torch.uint8), s)
    with pytest.raises(ValueError, match="weight_scale"):
        W8A8Linear.from_quantized(q, s[:3])
    with pytest.raises(ValueError, match="bias"):
        W8A8Linear.from_quantized(q, s, torch.zeros(9))
    with pytest.raises(ValueError, match="in_features"):
        W8A8Linear(0, 4)


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel on CPU tensors under TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a8_module_reference_matches_kernel_under_interpreter(dtype):
    from quantpack.kernels.w8a8 import w8a8_linear

    mod = W8A8Linear.from_linear(_linear(k=70, n=33, dtype=dtype, seed=3))
    x = torch.randn(17, 70).to(dtype)
    ref, out = mod(x), w8a8_linear(x, mod.qweight, mod.weight_scale, mod.bias)
    if dtype == torch.float16:
        assert torch.equal(out, ref)
    else:  # the interpreter truncates float32 -> bfloat16: at most one ulp apart
        assert bool(((out.float() - ref.float()).abs() <= 2.0**-7 * ref.float().abs()).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a8_module_cuda_matches_cpu_reference(dtype):
    mod = W8A8Linear.from_linear(_linear(k=512, n=384, dtype=dtype, seed=5))
    x = torch.randn(1, 5, 512).to(dtype)
    ref = mod(x)  # CPU reference
    out = mod.cuda()(x.cuda()).cpu()
    assert out.shape == ref.shape and out.dtype == dtype
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    # Both round the same float32 value; only FMA contraction on the GPU can move it by a float32 ulp.
    assert bool(((out.float() - ref.float()).abs() <= 2 * unit * ref.float().abs() + 1e-5).all())


# --- a tiny real model: W8A8 vs the 4-bit scheme ---------------------------------------------------

def _swap_linears(model: nn.Module, make) -> None:
    for name, child in model.named_children():
        if isinstance(child, nn.Linear) and name != "lm_head":
            setattr(model, name, make(child))
        else:
            _swap_linears(child, make)


def test_w8a8_tiny_llama_kl_below_4bit():
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantpack.modules.linear import QuantLinear

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    source = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread the weights beyond init so the logits are far from uniform
        for p in source.parameters():
            p.mul_(2.0)
    ids = torch.randint(0, 256, (2, 32))

    def kl(model):
        with torch.no_grad():
            p = source(ids).logits.float().log_softmax(-1)
            q = model(ids).logits.float().log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1).mean().item()

    w8a8 = LlamaForCausalLM(config).eval()
    w8a8.load_state_dict(source.state_dict())
    _swap_linears(w8a8, W8A8Linear.from_linear)
    w4 = LlamaForCausalLM(config).eval()
    w4.load_state_dict(source.state_dict())
    _swap_linears(w4, lambda lin: QuantLinear.from_linear(lin, bits=4, group_size=128, dtype=torch.float32))
    kl_w8a8, kl_w4 = kl(w8a8), kl(w4)
    assert 0 < kl_w8a8 < kl_w4, (kl_w8a8, kl_w4)


def test_w8a8_input_gradient_is_straight_through():
    """The weight is frozen; the input gradient passes straight through the activation rounding."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 24, bias=True)
    layer = W8A8Linear.from_linear(lin, dtype=torch.float32)
    x = torch.randn(2, 5, 48, requires_grad=True)
    out = layer(x)
    assert out.requires_grad
    with torch.no_grad():
        assert torch.equal(out, layer(x))  # same forward with and without autograd
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = grad_out @ layer.dequantize(torch.float32)
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-6)
    assert not any(b.requires_grad for b in layer.buffers())
