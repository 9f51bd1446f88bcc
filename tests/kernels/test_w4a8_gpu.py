"""The W4A8-FP8 path at full size on a GPU with FP8 tensor cores (compute capability >= 9.0): every shape class (decode
rows when forced, the M = 256 and M >= 1024 tiles, N and K off the tile), groups of 64 and 128, against the float
reference of the same FP8 activations and codes; outputs poisoned. Hopper's FP8 MMAs accumulate a group's products
with about 14 bits before the float32 promotion, so the product is within ~2e-4 of that reference, not 1e-6."""
import importlib

import pytest
import torch

from quantpack import reference
from quantpack.format import PackedWeight
from quantpack.kernels import KernelConfig, mixed_mm
from quantpack.kernels.dispatch import Flags, choose, device_props
from quantpack.kernels.wgmma_mm import HAVE_GLUON
from quantpack.modules.linear import QuantLinear

FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FP8, reason="needs a GPU with FP8 tensor cores (cc >= 9.0)"),
              pytest.mark.usefixtures("poisoned_outputs")]  # (tests/conftest.py)
w4a8_mod = importlib.import_module("quantpack.kernels.w4a8")


def packed(n, k, gs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qw = torch.randint(0, 256, (k // 2, n), device="cuda", dtype=torch.uint8, generator=g)
    s = (torch.rand((k // gs, n), device="cuda", generator=g) * 0.02 + 0.002).bfloat16()
    z = (torch.rand((k // gs, n), device="cuda", generator=g) * 15).bfloat16()
    return PackedWeight(qw, s, z, 4, gs, 1, (n, k))


def rel(out, want):
    assert not out.isnan().any()
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (4000, 4160)])
@pytest.mark.parametrize("gs", [64, 128])
@pytest.mark.parametrize("m", [1, 17, 256, 1024, 1500])
def test_product_matches_the_fp8_reference(monkeypatch, n, k, gs, m):
    if k % gs:
        pytest.skip("group does not divide K")
    monkeypatch.setenv("QUANTPACK_W4A8", "force")
    pw = packed(n, k, gs, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x *= torch.logspace(-1, 1, m, device="cuda")[:, None].bfloat16()  # (per-token scales matter)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert choose(device_props(x.device), m, n, k, 4, x.dtype, group_size=gs, flags=Flags.from_env()).path == "w4a8"
    out32 = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bias=bias, out_dtype=torch.float32)
    want = reference.matmul_fp8_activations(x.float(), pw, bias)
    assert rel(out32, want) < 5e-4
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bias=bias)
    assert out.dtype == torch.bfloat16 and rel(out, want) < 8e-3


@pytest.mark.parametrize("swap,pair,bm,bn,br,warps,stages", [
    (False, False, 128, 128, 64, 8, 3), (False, True, 128, 64, 64, 4, 2), (True, False, 128, 128, 64, 8, 3),
    (True, True, 64, 128, 64, 4, 2), (False, False, 128, 128, 32, 8, 4)])
@pytest.mark.parametrize("gs", [64, 128])
def test_every_tile_variant(swap, pair, bm, bn, br, warps, stages, gs):
    n, k, m = 4000, 4096, 300  # (N and M off the tiles)
    cfg = KernelConfig("w4a8", block_m=bm, block_n=bn, block_r=br, num_warps=warps, num_stages=stages, swap=swap,
                       pair=pair)
    pw = packed(n, k, gs, seed=7)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, config=cfg, out_dtype=torch.float32)
    assert rel(out, reference.matmul_fp8_activations(x.float(), pw)) < 5e-4


def test_quantizer_matches_torch_bit_for_bit():
    x = torch.randn(300, 14336, device="cuda", dtype=torch.bfloat16) * 5
    x[3] = 0
    xq, scale, xsum = w4a8_mod.quantize_activations_fp8(x, 128)
    want_q, want_scale = reference.quantize_activations_fp8(x)
    assert torch.equal(xq.view(torch.uint8), torch.cat([want_q[:, 0::2], want_q[:, 1::2]], 1).view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert torch.allclose(xsum, want_q.float().view(300, -1, 128).sum(-1), rtol=1e-6, atol=1e-3)


def test_quantlinear_takes_it_from_256_rows_where_turned_on(monkeypatch):
    monkeypatch.setenv("QUANTPACK_W4A8", "1")
    pw = packed(4096, 4096, 128)
    layer = QuantLinear.from_packed(pw).cuda()
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    fp8, bf16 = reference.matmul_fp8_activations(x.float(), pw), reference.matmul(x.float(), pw)
    on = layer(x)
    assert rel(on, fp8) < 8e-3 and rel(on, fp8) < rel(on, bf16) / 2
    monkeypatch.delenv("QUANTPACK_W4A8")  # (off by default)
    off = layer(x)
    assert rel(off, bf16) < 8e-3 and rel(off, bf16) < rel(off, fp8) / 2


HOPPER_GLUON = FP8 and HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER_GLUON, reason="the wgmma kernel needs Hopper and Gluon")
@pytest.mark.parametrize("n,k,gs,m", [(4096, 4096, 128, 4096), (14336, 4096, 128, 1024), (4096, 14336, 64, 256),
                                      (4000, 4160, 64, 300), (4096, 4096, 256, 17), (8192, 8192, 128, 1)])
@pytest.mark.parametrize("block_m,block_n,stages,producer", [(128, 64, 4, False), (128, 64, 4, True),
                                                              (128, 128, 3, False), (64, 64, 2, True)])
def test_wgmma_kernel_matches_the_fp8_reference(monkeypatch, n, k, gs, m, block_m, block_n, stages, producer):
    """The Gluon kernel (dispatched on Hopper) at full shapes, N, M and K off its tiles, groups of 64-256."""
    ran = []
    real = w4a8_mod.w4a8_wgmma_matmul
    monkeypatch.setattr(w4a8_mod, "w4a8_wgmma_matmul", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    cfg = KernelConfig("w4a8", block_m=block_m, block_n=block_n, block_r=64, num_warps=block_n // 16,
                       num_stages=stages, wgmma=True, producer=producer)
    pw = packed(n, k, gs, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x *= torch.logspace(-1, 1, m, device="cuda")[:, None].bfloat16()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = reference.matmul_fp8_activations(x.float(), pw, bias)
    out32 = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bias=bias, config=cfg, out_dtype=torch.float32)
    assert ran and rel(out32, want) < 5e-4
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, config=cfg)
    assert out.dtype == torch.bfloat16 and rel(out, reference.matmul_fp8_activations(x.float(), pw)) < 8e-3


@pytest.mark.skipif(not HOPPER_GLUON, reason="the wgmma kernel needs Hopper and Gluon")
def test_hopper_dispatches_the_wgmma_kernel(monkeypatch):
    monkeypatch.setenv("QUANTPACK_W4A8", "1")
    assert choose(device_props(torch.device("cuda")), 1024, 4096, 4096, 4, torch.bfloat16, group_size=128,
                  flags=Flags.from_env()).config.wgmma
    monkeypatch.setenv("QUANTPACK_WGMMA", "0")  # (the Triton kernel where the wgmma kernels are turned off)
    assert not choose(device_props(torch.device("cuda")), 1024, 4096, 4096, 4, torch.bfloat16, group_size=128,
                      flags=Flags.from_env()).config.wgmma
