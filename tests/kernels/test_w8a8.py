"""W8A8 Triton kernels against the pure-torch reference (quantpack.quantization.w8a8).

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI) and on CUDA tensors where a GPU exists.
The interpreter does int8 ``tl.dot`` with exact int32 accumulation (checked below with sums past
2**24), so the same kernel code is tested in both places. One interpreter quirk: Triton 3.9's
interpreter casts float32 -> bfloat16 by truncation, not round-to-nearest, so a bfloat16 output
may be one bfloat16 ulp off there (half an ulp on the GPU).
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from quantpack.quantization.w8a8 import (
    ACT_AMAX_FLOOR, int8_matmul_exact, quantize_activations_reference, quantize_weight_w8a8,
    w8a8_linear_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

if ON_GPU or INTERPRET:
    from quantpack.kernels.w8a8 import quantize_activations, w8a8_linear, w8a8_matmul

# Unit roundoff of the final cast (a full ulp for bfloat16 under the interpreter, which truncates).
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7 if INTERPRET else 2.0**-8, torch.float32: 2.0**-24}
DTYPES = [torch.float16, torch.bfloat16]


def _activations(m: int, k: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes, each with one outlier, so per-token scales matter."""
    x = torch.randn(m, k, generator=gen)
    x *= torch.logspace(-3, 3, m)[torch.randperm(m, generator=gen)][:, None]
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] *= 20.0
    return x.to(dtype).to(DEVICE)


def _assert_matches_exact(out, acc, x_scale, weight_scale, bias, out_dtype):
    """``out`` equals the float64 epilogue on the exact accumulator up to the final cast and the
    float32 epilogue's own rounding (a few float32 ulps of the terms)."""
    terms = acc.double() * x_scale.double()[:, None] * weight_scale.double()[None, :]
    ref = terms + (bias.double() if bias is not None else 0.0)
    magnitude = terms.abs() + (bias.double().abs() if bias is not None else 0.0)
    bound = UNIT[out_dtype] * ref.abs() + 4 * 2.0**-24 * magnitude + 2.0**-24
    err = (out.double() - ref).abs()
    assert out.dtype == out_dtype
    assert bool(torch.isfinite(out).all())
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the final-cast bound by {worst:.2f}x"


# --- activation quantizer -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7), (3, 200), (17, 1000), (2, 3, 33)])
def test_quantize_activations_bitwise_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{shape}".encode()))
    x = _activations(int(torch.tensor(shape[:-1]).prod()), shape[-1], dtype, gen).reshape(shape)
    q, scale = quantize_activations(x)
    q_ref, scale_ref = quantize_activations_reference(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    # Each row uses the full range and reconstructs within half a step.
    assert bool((q.abs().amax(dim=-1) == 127).all())
    err = (q.float() * scale[..., None] - x.float()).abs()
    assert bool((err <= scale[..., None] * 0.5 * (1 + 1e-4)).all())  # x * (127 / amax) ~ x / scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_activations_zero_rows(dtype):
    x = torch.randn(5, 70).to(dtype).to(DEVICE)
    x[1] = 0
    x[4] = 0
    q, scale = quantize_activations(x)
    assert not bool(q[[1, 4]].any())
    floor = torch.full((2,), ACT_AMAX_FLOOR, device=DEVICE)
    assert torch.equal(scale[[1, 4]], floor / torch.full_like(floor, 127))
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    q_ref, scale_ref = quantize_activations_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_activations_outliers(dtype):
    # One huge value per row: it alone gets +-127, the rest collapse toward 0 but stay within half a step.
    big = 6e4 if dtype == torch.float16 else 1e30
    x = torch.randn(4, 300).to(dtype)
    x[:, 17] = torch.tensor([big, -big, big / 7, -1.0]).to(dtype)
    x[3] = 0
    x[3, 17] = -1.0
    x = x.to(DEVICE)
    q, scale = quantize_activations(x)
    assert q[:, 17].tolist() == [127, -127, 127, -127]
    amax = x.float().abs().amax(dim=1)
    assert torch.equal(scale, amax / torch.full_like(amax, 127))
    q_ref, scale_ref = quantize_activations_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_activations_rounds_half_to_even():
    # amax = 127 gives scale = 1, so x / scale is exactly x: ties must go to the even integer.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.4999998]]).to(DEVICE)
    q, scale = quantize_activations(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126, 3]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_activations_long_rows_two_passes(dtype):
    # Rows longer than the one-tile limit take the two-pass path; the max sits in the last block.
    x = torch.randn(2, 9000).to(dtype)
    x[0, 8999] = 50.0
    x[1, 5] = -70.0
    x = x.to(DEVICE)
    q, scale = quantize_activations(x)
    q_ref, scale_ref = quantize_activations_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert q[0, 8999].item() == 127 and q[1, 5].item() == -127


# --- int8 matmul ------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_w8a8_matmul_accumulates_exactly_in_int32(kernel):
    # Sums far past 2**24 with no structure: a float32 accumulator would lose the low bits.
    gen = torch.Generator().manual_seed(0)
    m, n, k = 17, 40, 4160
    a = torch.randint(60, 128, (m, k), generator=gen, dtype=torch.int8)
    sign = torch.where(torch.rand(k, generator=gen) < 0.5, -1, 1)
    a = a * sign.to(torch.int8)
    b = torch.randint(60, 128, (n, k), generator=gen, dtype=torch.int8) * sign.to(torch.int8)
    b[:3] = -127  # some large negative sums too
    a, b = a.to(DEVICE), b.to(DEVICE)
    ones_m = torch.ones(m, device=DEVICE)
    ones_n = torch.ones(n, device=DEVICE)
    out = w8a8_matmul(a, ones_m, b, ones_n, out_dtype=torch.float32, kernel=kernel)
    acc = (a.cpu().long() @ b.cpu().long().t())
    assert acc.abs().max() > 2**25 and acc.abs().min() < 2**24
    assert torch.equal(out.cpu(), acc.float())  # int -> float32 is the only rounding


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("n,k", [(100, 200), (33, 96), (64, 47), (72, 208)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_w8a8_matmul_matches_exact_reference(m, n, k, out_dtype, kernel):
    # TMA needs 16-byte aligned rows: K % 16 == 0 and N * itemsize % 16 == 0 (here only (72, 208)).
    tma_ok = k % 16 == 0 and (n * torch.empty(0, dtype=out_dtype).element_size()) % 16 == 0
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x_q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale = torch.rand(m, generator=gen) * 1e-2 + 1e-4
    weight_scale = torch.rand(n, generator=gen) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=gen).to(out_dtype) if m % 2 else None
    args = [t.to(DEVICE) for t in (x_q, x_scale, qweight, weight_scale)]
    bias = bias.to(DEVICE) if bias is not None else None
    if kernel == "tma" and not (tma_ok and (ON_GPU and torch.cuda.get_device_capability()[0] >= 9 or INTERPRET)):
        with pytest.raises(ValueError, match="kernel='tma' needs"):
            w8a8_matmul(*args, bias=bias, out_dtype=out_dtype, kernel=kernel)
        return
    out = w8a8_matmul(*args, bias=bias, out_dtype=out_dtype, kernel=kernel)
    assert out.shape == (m, n)
    acc = x_q.long() @ qweight.long().t()
    _assert_matches_exact(out.cpu(), acc, x_scale, weight_scale, bias.cpu() if bias is not None else None,
                          out_dtype)


def test_w8a8_matmul_handles_minus_128_and_strided_inputs():
    # -128 never comes out of the quantizers but is a valid int8; x_q given as a row slice (stride > K).
    gen = torch.Generator().manual_seed(3)
    big = torch.randint(-128, 128, (5, 160), generator=gen, dtype=torch.int8)
    big[:, :3] = -128
    x_q = big[:, :130]
    qweight = torch.randint(-128, 128, (50, 130), generator=gen, dtype=torch.int8)
    qweight[0] = -128
    x_scale, weight_scale = torch.rand(5, generator=gen), torch.rand(50, generator=gen)
    out = w8a8_matmul(x_q.to(DEVICE), x_scale.to(DEVICE), qweight.to(DEVICE), weight_scale.to(DEVICE),
                      out_dtype=torch.float32)
    acc = x_q.long() @ qweight.long().t()
    _assert_matches_exact(out.cpu(), acc, x_scale, weight_scale, None, torch.float32)


# --- end to end ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_w8a8_linear_matches_reference_and_float(dtype, m):
    gen = torch.Generator().manual_seed(m)
    n, k = 72, 136
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if m != 3 else None
    qweight, weight_scale = quantize_weight_w8a8(weight)
    qweight, weight_scale = qweight.to(DEVICE), weight_scale.to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    out = w8a8_linear(x, qweight, weight_scale, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    # Same quantized values, same math: the kernel and the reference differ at most by the cast.
    ref = w8a8_linear_reference(x, qweight, weight_scale, bias, out_dtype=torch.float32)
    assert bool(((out.float() - ref).abs() <= UNIT[dtype] * ref.abs() + 1e-6).all())
    # And the whole thing approximates the float layer to int8 accuracy.
    exact = torch.nn.functional.linear(x.float(), weight.to(DEVICE), bias.float() if bias is not None else None)
    rel = ((out.float() - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel


def test_w8a8_linear_3d_noncontiguous_input_and_out_dtype():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 64, generator=gen)
    qweight, weight_scale = (t.to(DEVICE) for t in quantize_weight_w8a8(weight))
    x = torch.randn(2, 64, 5, generator=gen).to(torch.float16).to(DEVICE).transpose(1, 2)  # (2, 5, 64), strided
    out = w8a8_linear(x, qweight, weight_scale, out_dtype=torch.float32)
    assert out.shape == (2, 5, 40) and out.dtype == torch.float32
    ref = w8a8_linear_reference(x.contiguous(), qweight, weight_scale, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=4 * 2.0**-24, atol=1e-6)


def test_w8a8_linear_zero_rows_give_the_bias_exactly():
    qweight, weight_scale = (t.to(DEVICE) for t in quantize_weight_w8a8(torch.randn(24, 48)))
    bias = torch.randn(24).to(torch.bfloat16).to(DEVICE)
    x = torch.zeros(3, 48, dtype=torch.bfloat16, device=DEVICE)
    x[1] = torch.randn(48).to(torch.bfloat16)
    out = w8a8_linear(x, qweight, weight_scale, bias)
    assert torch.equal(out[0], bias) and torch.equal(out[2], bias)


def test_w8a8_linear_bad_input():
    qweight, weight_scale = (t.to(DEVICE) for t in quantize_weight_w8a8(torch.randn(8, 32)))
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="does not match qweight in_features"):
        w8a8_linear(torch.randn(2, 31, device=DEVICE), qweight, weight_scale)
    with pytest.raises(ValueError, match="qweight: expected"):
        w8a8_linear(x, qweight.to(torch.uint8), weight_scale)
    with pytest.raises(ValueError, match="weight_scale: expected"):
        w8a8_linear(x, qweight, weight_scale[:4])
    with pytest.raises(ValueError, match="bias: expected"):
        w8a8_linear(x, qweight, weight_scale, torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_linear(x, qweight, weight_scale, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="x: dtype"):
        w8a8_linear(x.to(torch.int32), qweight, weight_scale)
    with pytest.raises(ValueError, match="x_scale: expected"):
        w8a8_matmul(qweight, torch.ones(3, device=DEVICE), qweight, weight_scale)


# --- GPU only: full sizes through the autotuned kernel --------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (without TRITON_INTERPRET)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1024, 4096, 4096), (272, 14336, 4096), (3, 4096, 4096), (17, 1000, 4104)])
def test_w8a8_gpu_full_size(dtype, m, n, k):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    qweight, weight_scale = quantize_weight_w8a8(torch.randn(n, k, device="cuda") / k**0.5)
    bias = torch.randn(n, device="cuda").to(dtype) if dtype == torch.float16 else None
    x_q, x_scale = quantize_activations(x)
    q_ref, scale_ref = quantize_activations_reference(x)
    assert torch.equal(x_q, q_ref) and torch.equal(x_scale, scale_ref)
    poison = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    del poison  # the output allocated next reuses this block: unwritten elements stay NaN
    out = w8a8_matmul(x_q, x_scale, qweight, weight_scale, bias, out_dtype=dtype)
    acc = int8_matmul_exact(x_q, qweight)
    _assert_matches_exact(out, acc, x_scale, weight_scale, bias, dtype)
    assert torch.equal(w8a8_linear(x, qweight, weight_scale, bias), out)
