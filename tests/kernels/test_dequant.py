"""Standalone dequant kernel against the reference: bits 4/8, axis 0/1, group sizes, per-channel,
hqq-style 8-bit quantized zeros; output poisoned with NaN first."""
import importlib
import os

import pytest
import torch

from quantpack import reference
from quantpack.format import PackedWeight
from quantpack.kernels import dequantize
from quantpack.quantization.groupwise import quantize

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 or a GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]  # (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
dq_mod = importlib.import_module("quantpack.kernels.dequant")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis,n,k,gs", [(1, 72, 160, 32), (1, 100, 192, 64), (1, 40, 256, 128), (1, 24, 200, None),
                                         (0, 96, 80, 32), (0, 128, 48, 64), (0, 40, 64, None)])
def test_dequant_matches_reference(axis, n, k, gs, bits, dtype):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    pw = quantize(w, bits=bits, group_size=gs, axis=axis, method="rtn", dtype=dtype).to(DEV)
    out = dequantize(pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=bits, axis=axis)
    assert out.shape == (n, k) and out.dtype == dtype
    # same float32 formula, one rounding to the output dtype: bit-exact (the interpreter rounds
    # float32 -> bfloat16 toward zero instead of to nearest, so there allow one bf16 ulp)
    ref = reference.dequantize(pw, dtype)
    if dtype == torch.bfloat16 and DEV == "cpu":
        assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(out, ref)
    out32 = dequantize(pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=bits, axis=axis,
                       out_dtype=torch.float32)
    assert torch.equal(out32, reference.dequantize(pw, torch.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantized_zeros(bits, axis):
    n, k, gs = 64, 128, 32
    g = torch.Generator().manual_seed(bits + axis)
    qweight = torch.randint(0, 256, (k // 2 if bits == 4 else k, n), generator=g, dtype=torch.uint8)
    meta_shape = (k // gs, n) if axis == 1 else (k, n // gs)
    scales = (torch.rand(meta_shape, generator=g) * 0.1 + 0.01).to(torch.float16)
    zq = torch.randint(0, 256, meta_shape, generator=g, dtype=torch.uint8)
    zero_scale, zero_zero = 0.0625, 128.0
    out = dequantize(qweight.to(DEV), scales.to(DEV), zq.to(DEV), group_size=gs, bits=bits, axis=axis,
                     zero_scale=zero_scale, zero_zero=zero_zero, out_dtype=torch.float32)
    zeros = (zq.float() - zero_zero) * zero_scale
    ref = reference.dequantize(PackedWeight(qweight, scales.float(), zeros, bits, gs, axis, (n, k)), torch.float32)
    assert torch.allclose(out.cpu(), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="zero_scale"):
        dequantize(qweight.to(DEV), scales.to(DEV), zq.to(DEV), group_size=gs, bits=bits, axis=axis)


def test_bad_arguments():
    pw = quantize(torch.randn(32, 64), bits=4, group_size=32, method="rtn", dtype=torch.float16).to(DEV)
    with pytest.raises(ValueError, match="scales: shape"):
        dequantize(pw.qweight, pw.scales, pw.zeros, group_size=16)
    with pytest.raises(ValueError, match="axis"):
        dequantize(pw.qweight, pw.scales, pw.zeros, group_size=32, axis=2)
    with pytest.raises(ValueError, match="zero_scale/zero_zero"):
        dequantize(pw.qweight, pw.scales, pw.zeros, group_size=32, zero_scale=1.0, zero_zero=0.0)


def test_cpu_without_triton_uses_reference(monkeypatch):
    pw = quantize(torch.randn(32, 64), bits=8, group_size=32, method="rtn", dtype=torch.float16)
    monkeypatch.setattr(dq_mod, "triton_usable", lambda t: False)
    out = dequantize(pw.qweight, pw.scales, pw.zeros, group_size=32, bits=8)
    assert torch.equal(out, reference.dequantize(pw))


@pytest.mark.parametrize("a", [0, 1, 2, 15, 16, 17, 127, 128, 129, 4096, 14336, 1 << 20])
@pytest.mark.parametrize("b", [1, 2, 16, 64, 128, 132])
def test_host_cdiv_and_next_power_of_2_match_the_definitions(a, b):
    """The launchers' plain host helpers (Triton's own are constexpr functions, slow on the host)."""
    from quantpack.kernels.dequant import cdiv, next_power_of_2

    assert cdiv(a, b) == (a + b - 1) // b
    if a >= 1:
        p = next_power_of_2(a)
        assert p >= a and p & (p - 1) == 0 and (p == 1 or p // 2 < a)
