"""Reference dequantize/matmul against an independent float64 computation."""
import pytest
import torch

from quantpack import quantize, unpack
from quantpack.reference import dequantize, matmul


def _dequant_float64(pw):
    """Element-wise float64 dequantization by explicit group indexing (independent of reference.py)."""
    n, k = pw.shape
    q = unpack(pw.qweight, pw.bits).double()
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    if pw.axis == 1:
        s, z = pw.scales.double()[kk // pw.group_size, nn_], pw.zeros.double()[kk // pw.group_size, nn_]
    else:
        s, z = pw.scales.double()[kk, nn_ // pw.group_size], pw.zeros.double()[kk, nn_ // pw.group_size]
    return (q - z) * s


@pytest.mark.parametrize("shape", [(16, 64), (3, 32), (48, 1024), (80, 96)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_matches_float64(shape, bits, axis, dtype):
    w = torch.randn(*shape)
    gs = 16 if (shape[1 if axis == 1 else 0] % 16 == 0) else None
    pw = quantize(w, bits=bits, group_size=gs, axis=axis, method="rtn", dtype=dtype)
    ref = _dequant_float64(pw)
    out = dequantize(pw, torch.float32).double()
    assert (out - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
    assert dequantize(pw).dtype == dtype


@pytest.mark.parametrize("lead", [(), (1,), (2, 3)])
def test_matmul_matches_float64(lead):
    w = torch.randn(24, 64)
    pw = quantize(w, group_size=32, dtype=torch.float32)
    x = torch.randn(*lead, 5, 64)
    bias = torch.randn(24)
    out = matmul(x, pw, bias)
    ref = x.double() @ _dequant_float64(pw).t() + bias.double()
    assert out.shape == (*lead, 5, 24)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_matmul_rejects_wrong_in_features():
    pw = quantize(torch.randn(8, 64), group_size=32)
    with pytest.raises(ValueError, match="in_features=64"):
        matmul(torch.randn(2, 32), pw)
