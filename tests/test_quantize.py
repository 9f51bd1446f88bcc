"""Group-wise quantization: reconstruction quality (against the hqq library itself), layout, bad input."""
import pytest
import torch

from quantpack import quantize, dequantize, unpack


def _weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    # LLM-like outliers so min/max is a poor fit and HQQ has something to optimize
    w[torch.rand(n, k, generator=g) < 0.002] *= 12
    return w.to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _hqq_library_error(w, bits, group_size, dtype):
    from hqq.core.quantize import Quantizer

    wq, meta = Quantizer.quantize(w, nbits=bits, group_size=group_size, axis=1, optimize=True, bitpack=False,
                                  round_zero=bits == 4, compute_dtype=dtype, device="cpu")
    # HQQLinear (BaseQuantizeConfig) rounds the zero at 4 bits and stores scale and zero in the compute dtype
    meta.update(scale=meta["scale"].to(dtype), zero=meta["zero"].to(dtype), compute_dtype=torch.float32)
    return _rel(Quantizer.dequantize(wq.float(), meta).reshape(w.shape).float(), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hqq_matches_hqq_library_and_beats_rtn(bits, group_size, dtype):
    w = _weight(96, 512, seed=bits * group_size)
    ours = _rel(dequantize(quantize(w, bits=bits, group_size=group_size, method="hqq", dtype=dtype)).float(), w)
    lib = _hqq_library_error(w, bits, group_size, dtype)
    rtn = _rel(dequantize(quantize(w, bits=bits, group_size=group_size, method="rtn", dtype=dtype)).float(), w)
    assert ours <= lib * 1.01, (ours, lib)
    assert ours <= rtn, (ours, rtn)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_hqq_never_worse_than_rtn_both_axes(axis, bits):
    w = _weight(128, 256, seed=7)
    errs = {m: _rel(dequantize(quantize(w, bits=bits, group_size=64, axis=axis, method=m)).float(), w)
            for m in ("hqq", "rtn")}
    assert errs["hqq"] <= errs["rtn"]
    assert errs["rtn"] < (0.12 if bits == 4 else 0.008)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_refit_lowers_hqqs_error_in_every_group(axis, bits):
    """Least-squares scales and zeros: below hqq's squared error overall, and never above it in a group."""
    from quantpack.quantization.groupwise import grouped

    w = _weight(128, 256, seed=11)
    deq = {m: dequantize(quantize(w, bits=bits, group_size=64, axis=axis, method=m, dtype=torch.float32))
           for m in ("hqq", "refit")}
    err = {m: grouped((d - w).square(), 64, axis).sum(1) for m, d in deq.items()}
    assert bool((err["refit"] <= err["hqq"] * (1 + 1e-5)).all())
    assert float(err["refit"].sum()) < (0.95 if bits == 4 else 0.99) * float(err["hqq"].sum())


@pytest.mark.parametrize("bits", [4, 8])
def test_refit_weighted_by_input_moments_lowers_the_weighted_error(bits):
    """With per-input-feature weights (activation second moments), refit minimizes the error those inputs see:
    below hqq's and the unweighted refit's weighted error overall, and never above hqq's in a group."""
    from quantpack.quantization.groupwise import grouped

    w = _weight(64, 256, seed=5)
    g = torch.Generator().manual_seed(6)
    moments = torch.rand(256, generator=g).pow(4) * 10 + 1e-3  # a few busy features, as real activations have
    deq = {m: dequantize(quantize(w, bits=bits, group_size=64, method=m, dtype=torch.float32))
           for m in ("hqq", "refit")}
    deq["weighted"] = dequantize(quantize(w, bits=bits, group_size=64, method="refit", dtype=torch.float32,
                                          input_weights=moments))
    err = {m: grouped((d - w).square() * moments, 64, 1).sum(1) for m, d in deq.items()}
    assert bool((err["weighted"] <= err["hqq"] * (1 + 1e-5)).all())
    assert float(err["weighted"].sum()) < 0.95 * min(float(err["hqq"].sum()), float(err["refit"].sum()))


def test_refit_with_uniform_input_weights_is_plain_refit():
    w = _weight(32, 128, seed=8)
    plain = quantize(w, bits=4, group_size=64, method="refit")
    uniform = quantize(w, bits=4, group_size=64, method="refit", input_weights=torch.full((128,), 3.0))
    assert torch.equal(plain.qweight, uniform.qweight)
    assert torch.equal(plain.scales, uniform.scales) and torch.equal(plain.zeros, uniform.zeros)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "hqq", "input_weights": torch.ones(128)}, "used by method='refit' only"),
    ({"method": "refit", "axis": 0, "input_weights": torch.ones(128)}, "use axis=1"),
    ({"method": "refit", "input_weights": torch.ones(64)}, "shape (128,)"),
    ({"method": "refit", "input_weights": torch.ones(128, dtype=torch.long)}, "shape (128,)"),
    ({"method": "refit", "input_weights": [1.0] * 128}, "got list"),
    ({"method": "refit", "input_weights": torch.zeros(128)}, "not all zero"),
    ({"method": "refit", "input_weights": torch.full((128,), -1.0)}, "non-negative"),
    ({"method": "refit", "input_weights": torch.full((128,), float("nan"))}, "finite"),
])
def test_input_weights_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        quantize(_weight(64, 128), bits=4, group_size=64, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["hqq", "rtn", "refit"])
@pytest.mark.parametrize("axis", [0, 1])
def test_reconstruction_is_exact_on_the_grid(method, axis):
    """A weight that already lies on a per-group 4-bit grid is reproduced to the dtype's precision."""
    g = torch.Generator().manual_seed(3)
    n, k, gs = 32, 64, 16
    q = torch.randint(0, 16, (n, k), generator=g).float()
    q[:, 0::gs], q[:, 1::gs] = 0, 15  # every group along K spans the full range...
    q[0::gs, :], q[1::gs, :] = 0, 15  # ...and every group along N too
    w = (q - 7.5) * 0.01
    pw = quantize(w, bits=4, group_size=gs, axis=axis, method=method, dtype=torch.float32)
    assert _rel(dequantize(pw), w) < 1e-5


def test_layout_matches_format():
    w = _weight(48, 256)
    pw = quantize(w, bits=4, group_size=64, axis=1, dtype=torch.bfloat16)
    assert pw.qweight.shape == (128, 48) and pw.qweight.dtype == torch.uint8
    assert pw.scales.shape == (4, 48) and pw.scales.dtype == torch.bfloat16 and pw.scales.is_contiguous()
    assert pw.zeros.shape == (4, 48) and pw.zeros.dtype == torch.bfloat16
    pw0 = quantize(w, bits=8, group_size=16, axis=0, dtype=torch.float16)
    assert pw0.qweight.shape == (256, 48) and pw0.scales.shape == (256, 3) and pw0.zeros.dtype == torch.float16
    q = unpack(pw0.qweight, 8)
    assert int(q.max()) <= 255 and q.shape == (48, 256)


def test_default_dtype_follows_weight():
    assert quantize(_weight(16, 64, dtype=torch.float16), group_size=32).scales.dtype == torch.float16
    assert quantize(_weight(16, 64, dtype=torch.bfloat16), group_size=32).scales.dtype == torch.bfloat16
    assert quantize(_weight(16, 64), group_size=32).scales.dtype == torch.bfloat16


@pytest.mark.parametrize("shape,axis", [((3, 50), 1), ((5, 2), 1), ((7, 64), 0)])
def test_per_channel_odd_shapes(shape, axis):
    w = _weight(*shape)
    pw = quantize(w, bits=4, group_size=None, axis=axis, dtype=torch.float32)
    assert pw.group_size == (shape[1] if axis == 1 else shape[0])
    assert _rel(dequantize(pw), w) < 0.2


def test_constant_group_is_reproduced():
    w = torch.full((4, 32), 0.5)
    for method in ("hqq", "rtn", "refit"):
        assert torch.allclose(dequantize(quantize(w, group_size=16, method=method, dtype=torch.float32)), w, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"group_size": 48}, "group_size"),
    ({"group_size": 100}, "group_size"),
    ({"group_size": 0}, "group_size=0"),
    ({"group_size": -1}, "group_size=-1"),
    ({"bits": 3}, "bits"),
    ({"method": "gptq"}, "method"),
    ({"axis": 3}, "axis"),
    ({"dtype": torch.int8}, "dtype"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(_weight(16, 64), **kwargs)


def test_invalid_weights():
    with pytest.raises(ValueError, match="weight: dtype"):
        quantize(torch.ones(8, 64, dtype=torch.int32), group_size=32)
    with pytest.raises(ValueError, match="K=63 is odd"):
        quantize(_weight(8, 63), group_size=None)
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = _weight(8, 64)
        w[3, 5] = bad
        with pytest.raises(ValueError, match="weight: contains NaN or inf"):
            quantize(w, group_size=32)
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        quantize(torch.randn(4, 8, 16), group_size=16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("power", [-7, -14])
def test_rtn_is_scale_equivariant_for_small_weights(bits, axis, power):
    """Scaling a weight by 2**power scales its bf16 scales by 2**power and changes no q (no
    absolute floor on the scale: it used to blur 8-bit groups narrower than 0.013, 4-bit ones
    narrower than 7.5e-4, and collapse groups narrower than 1e-4 to a single value)."""
    w = _weight(64, 128, seed=11)
    big = quantize(w, bits=bits, group_size=32, axis=axis, method="rtn", dtype=torch.bfloat16)
    small = quantize(w * 2.0 ** power, bits=bits, group_size=32, axis=axis, method="rtn", dtype=torch.bfloat16)
    assert torch.equal(small.qweight, big.qweight)
    assert torch.equal(small.zeros, big.zeros)
    assert torch.equal(small.scales, big.scales * 2.0 ** power)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("std", [1e-3, 1e-5])
def test_hqq_error_does_not_grow_for_small_weights(bits, std):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    ref = _rel(dequantize(quantize(w * 0.02, bits=bits, group_size=32, dtype=torch.bfloat16)).float(), w * 0.02)
    got = _rel(dequantize(quantize(w * std, bits=bits, group_size=32, dtype=torch.bfloat16)).float(), w * std)
    assert got <= ref * 1.1, (got, ref)


@pytest.mark.parametrize("method", ["hqq", "rtn", "refit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_offset_and_flat_groups_stay_finite_and_accurate(method, dtype):
    """Groups far from zero (|w| / range large): the zero point must stay finite in the storage dtype
    (float16 used to overflow to inf), and a flat group is reproduced exactly."""
    g = torch.Generator().manual_seed(2)
    w = 10 + torch.rand(8, 64, generator=g) * 1e-3
    w[:, :32] = 0.75  # flat groups
    pw = quantize(w, bits=4, group_size=32, method=method, dtype=dtype)
    got = dequantize(pw, torch.float32)
    assert bool(torch.isfinite(pw.zeros).all()) and bool(torch.isfinite(got).all())
    assert torch.equal(got[:, :32], w[:, :32])
    assert _rel(got[:, 32:], w[:, 32:]) < 1e-4
    zero = torch.zeros(4, 32)
    assert torch.equal(dequantize(quantize(zero, group_size=32, method=method, dtype=dtype), torch.float32), zero)
