"""Full-size GPU matrix (skipped without CUDA): every dispatched path, forward and transposed,
bf16 and fp16, bits 4/8, group sizes 32/64/128, against an fp32 reference; outputs poisoned."""

import pytest
import torch

from quantpack import reference
from quantpack.format import PackedWeight
from quantpack.kernels import KernelConfig, dequantize, mixed_mm
from oracles import caches_mod  # tests/oracles.py

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]  # (tests/conftest.py)
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


_cache = {}


def packed(n, k, bits, gs, dtype):
    key = (n, k, bits, gs, dtype)
    if key not in _cache:
        g = torch.Generator(device="cuda").manual_seed(n + k + bits + gs)
        rows = k // 2 if bits == 4 else k
        qw = torch.randint(0, 256, (rows, n), device="cuda", dtype=torch.uint8, generator=g)
        scales = (torch.rand(k // gs, n, device="cuda", generator=g) * 0.02 + 0.002).to(dtype)
        zeros = (torch.rand(k // gs, n, device="cuda", generator=g) * (2 ** bits - 1)).to(dtype)
        pw = PackedWeight(qw, scales, zeros, bits, gs, 1, (n, k))
        _cache.clear()
        _cache[key] = (pw, reference.dequantize(pw, torch.float32))
    return _cache[key]


def rel(out, ref):
    assert not torch.isnan(out).any()
    return ((out.float() - ref).norm() / ref.norm()).item()


PATHS = {
    "default": None,
    "fma": KernelConfig("fma", 1, 128, 64, split=8),
    "dot_t": KernelConfig("dot_t", 16, 128, 64, split=4, num_stages=3),
    "dot": KernelConfig("dot", 128, 128, 32, split=1, num_warps=8, num_stages=3),
    "dot_split": KernelConfig("dot", 64, 128, 64, split=4, num_warps=4, num_stages=3),
    "rawq_t": KernelConfig("dot_t", 16, 128, 64, split=4, rawq=True),
    "rawq": KernelConfig("dot", 64, 128, 64, split=2, rawq=True),
    "gemv": KernelConfig("gemv", 1, 64, 32, split=16, num_warps=1),
    "gemv_words": KernelConfig("gemv", 1, 256, 16, split=32, num_warps=2, words=True),
    "mma": KernelConfig("mma", 8, num_warps=2, split=8),  # (CUDA-core gemv where its layout needs are not met)
    "dq": KernelConfig("dq"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4000, 1152)])  # N not a multiple of any tile
def test_full_size_forward_and_transposed(n, k, gs, bits, dtype):
    pw, w = packed(n, k, bits, gs, dtype)
    for m in (1, 3, 16, 17, 64, 1024):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = x.float() @ w.t()
        for name, cfg in PATHS.items():
            if name in ("fma", "gemv", "gemv_words", "mma") and m > 17:
                continue
            out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, config=cfg)
            assert rel(out, ref) <= TOL[dtype], (name, m)
        xt = torch.randn(m, n, device="cuda", dtype=dtype)
        reft = xt.float() @ w
        for name in ("default", "dot_t", "dot", "dot_split", "dq"):
            out = mixed_mm(xt, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, config=PATHS[name],
                           transposed=True)
            assert rel(out, reft) <= TOL[dtype], (name, m, "transposed")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("gs", [32, 64, 128])  # (each picks its own block: dequant.DEQUANT_BLOCKS)
def test_full_size_dequant_exact(bits, axis, gs):
    n = k = 4096
    g = torch.Generator(device="cuda").manual_seed(bits + axis)
    qw = torch.randint(0, 256, (k // 2 if bits == 4 else k, n), device="cuda", dtype=torch.uint8, generator=g)
    meta = (k // gs, n) if axis == 1 else (k, n // gs)
    s = (torch.rand(meta, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    z = (torch.rand(meta, device="cuda", generator=g) * 15).to(torch.bfloat16)
    out = dequantize(qw, s, z, group_size=gs, bits=bits, axis=axis)
    assert torch.equal(out, reference.dequantize(PackedWeight(qw, s, z, bits, gs, axis, (n, k))))


def test_dequant_exact_at_14336x4096():
    """A benchmark shape with more column tiles than 4096^2 (and 7168 programs): 4-bit axis 0 exact too."""
    n, k, gs = 14336, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    qw = torch.randint(0, 256, (k // 2, n), device="cuda", dtype=torch.uint8, generator=g)
    s = (torch.rand(k, n // gs, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    z = (torch.rand(k, n // gs, device="cuda", generator=g) * 15).to(torch.bfloat16)
    out = dequantize(qw, s, z, group_size=gs, bits=4, axis=0)
    assert torch.equal(out, reference.dequantize(PackedWeight(qw, s, z, 4, gs, 0, (n, k))))


def test_split_k_repeatable_and_counters_reset():
    pw, w = packed(4096, 4096, 4, 128, torch.float16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    outs = [mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=PATHS["fma"]) for _ in range(20)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    torch.cuda.synchronize()
    assert int(caches_mod.counter_buffer(x.device).abs().sum()) == 0
