"""The W4A8-FP8 path (quantpack/kernels/w4a8.py) against the float reference of the same FP8-quantized activations and
4-bit codes (quantpack.reference.matmul_fp8_activations), in Triton's CPU interpreter (its dots run in float32, where
FP8 values and codes are exact); where it runs (dispatch), and what QUANTPACK_W4A8=force does on a CPU."""
from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from quantpack import reference
from quantpack.format import PackedWeight
from quantpack.kernels import KernelConfig, mixed_mm
from quantpack.kernels.dispatch import DeviceProps, Flags, choose, explain

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
H100 = DeviceProps("NVIDIA H100 80GB HBM3", (9, 0), 132)
W4A8 = KernelConfig("w4a8", block_m=64, block_n=128, block_r=64, num_warps=4, num_stages=4)
w4a8_mod = importlib.import_module("quantpack.kernels.w4a8")
interp = pytest.mark.skipif(not INTERPRET, reason="runs the kernels in Triton's interpreter (TRITON_INTERPRET=1)")


def packed(n, k, gs, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    qw = torch.randint(0, 256, (k // 2, n), dtype=torch.uint8, generator=g)
    s = (torch.rand((k // gs, n), generator=g) * 0.02 + 0.005).to(dtype)
    z = (torch.rand((k // gs, n), generator=g) * 15).to(dtype)
    return PackedWeight(qw, s, z, 4, gs, 1, (n, k))


def activations(m, k, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # (per-token scales matter)
    x[torch.arange(m), torch.randint(0, k, (m,), generator=g)] *= 30.0  # one outlier a row
    return x


CASES = [(1, 40, 128, 64, {}), (3, 33, 256, 128, {}), (17, 70, 384, 128, {}), (5, 48, 512, 256, {}),
         (2, 16, 512, 128, {"swap": True}), (2, 16, 512, 128, {"pair": True}),
         (17, 70, 512, 128, {"swap": True, "pair": True}), (3, 33, 256, 128, {"block_r": 32}),
         (2, 40, 256, 64, {"wgmma": True, "producer": True})]  # (the Gluon kernel's config: the Triton kernel here)


@interp
@pytest.mark.parametrize("m,n,k,gs,variant", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-g{c[3]}" + "".join(
    f"-{key}" for key in c[4]) for c in CASES])
def test_product_matches_the_float_reference(m, n, k, gs, variant, poisoned_outputs):
    pw, x = packed(n, k, gs, seed=m), activations(m, k, seed=n)
    bias = torch.randn(n)
    cfg = dataclasses.replace(W4A8, **variant)
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bias=bias, config=cfg)
    want = reference.matmul_fp8_activations(x, pw, bias)
    assert out.shape == (m, n) and not out.isnan().any()
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # and the FP8 rounding is what it computes: not the 16-bit product
    assert not torch.allclose(out, reference.matmul(x, pw, bias), rtol=1e-4, atol=1e-4 * want.abs().max().item())


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantizer_is_the_reference_bit_for_bit(dtype):
    m, k, gs = 4, 2304, 128  # (two quantizer chunks and a part)
    x = activations(m, k).to(dtype)
    x[1] = 0.0  # an all-zero row: zeros and a finite scale
    x[2, 5] = 1e30 if dtype != torch.float16 else 6e4  # an outlier that rounds most of its row to subnormals
    xq, scale, xsum = w4a8_mod.quantize_activations_fp8(x, gs)
    want_q, want_scale = reference.quantize_activations_fp8(x)
    even_then_odd = torch.cat([want_q[:, 0::2], want_q[:, 1::2]], 1)
    assert torch.equal(xq.view(torch.uint8), even_then_odd.view(torch.uint8))
    assert torch.equal(scale, want_scale) and scale[1] > 0
    assert torch.allclose(xsum, want_q.float().view(m, k // gs, gs).sum(-1), rtol=1e-6, atol=1e-6)
    xq_g, scale_g, xsum_g = w4a8_mod.quantize_activations_fp8(x, gs, sums_by_group=True)  # (the wgmma kernel's)
    assert torch.equal(xq_g.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(scale_g, scale)
    assert xsum_g.shape == (k // gs, m) and torch.equal(xsum_g, xsum.t())


@interp
def test_rounding_to_fp8_carries_into_the_next_power_of_two():
    # 124.33 rounds up to 128 (the interpreter's own conversion gives 64 there)
    x = torch.tensor([[448.0, 124.33, -124.33, 0.0], [1.0] * 4]).repeat(1, 16)
    xq, _, _ = w4a8_mod.quantize_activations_fp8(x, 64)
    assert xq.float()[0, [0, 32, 1]].tolist() == [448.0, 128.0, -128.0]  # (x0, x1, x2: even columns first)


def test_dispatch_takes_it_where_turned_on_from_256_rows_on_hopper_only():
    on, off = Flags(w4a8="on"), Flags()
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=off).path == "wgmma"  # (off by default)
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on).path == "w4a8"
    assert choose(H100, 255, 4096, 4096, 4, torch.bfloat16, flags=on).path != "w4a8"
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on, transposed=True).path != "w4a8"
    assert choose(H100, 1024, 4096, 4096, 8, torch.bfloat16, flags=on).path != "w4a8"
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on, axis=0).path != "w4a8"
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on, group_size=32).path != "w4a8"
    a100 = DeviceProps("NVIDIA A100-SXM4-80GB", (8, 0), 108)
    assert choose(a100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on).path == "dq"
    assert choose(H100, 1, 4096, 4096, 4, torch.bfloat16, flags=Flags(w4a8="force")).path == "w4a8"
    # on Hopper with Gluon the wgmma kernel (w4a8_wgmma.py), else (or with QUANTPACK_WGMMA=0) the Triton one
    from quantpack.kernels.wgmma_mm import HAVE_GLUON
    assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on).config.wgmma == HAVE_GLUON
    if HAVE_GLUON:  # (64 rows of x where 128 leave SMs without a program: 2 x 64 tiles on 132 SMs, not 2 x 128)
        assert choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=on).config.block_m == 128
        assert choose(H100, 256, 4096, 4096, 4, torch.bfloat16, flags=on).config.block_m == 64
        assert choose(H100, 256, 8192, 8192, 4, torch.bfloat16, flags=on).config.block_m == 128
    no_wgmma = Flags(w4a8="on", wgmma=False)
    assert not choose(H100, 1024, 4096, 4096, 4, torch.bfloat16, flags=no_wgmma).config.wgmma
    cpu = DeviceProps("interpreter", None, 8, gpu=False)
    assert choose(cpu, 1024, 64, 128, 4, torch.float32, flags=Flags(w4a8="on", interpret=True)).path != "w4a8"
    assert not choose(cpu, 1, 64, 128, 4, torch.float32, flags=Flags(w4a8="force", interpret=True)).config.wgmma
    assert choose(cpu, 1, 64, 128, 4, torch.float32, flags=Flags(w4a8="force", interpret=True)).path == "w4a8"


def test_explain_says_why_it_runs_or_not():
    assert "W4A8-FP8 kernel" in explain(1024, 4096, 4096, device=H100, flags=Flags(w4a8="on"))
    assert "not the W4A8-FP8 path: QUANTPACK_W4A8 is off" in explain(1024, 4096, 4096, device=H100, flags=Flags())
    assert "not the W4A8-FP8 path: M=16 < 256" in explain(16, 4096, 4096, device=H100, flags=Flags(w4a8="on"))
    a100 = explain(1024, 4096, 4096, device=DeviceProps("NVIDIA A100-SXM4-80GB", (8, 0), 108),
                   flags=Flags(w4a8="on"))
    assert "no FP8 tensor cores" in a100


@pytest.mark.parametrize("value,mode", [(None, "off"), ("0", "off"), ("1", "on"), ("force", "force")])
def test_the_switch(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("QUANTPACK_W4A8", raising=False)
    else:
        monkeypatch.setenv("QUANTPACK_W4A8", value)
    assert Flags.from_env().w4a8 == mode


def test_forced_on_a_cpu_the_reference_rounds_activations_to_fp8(monkeypatch):
    from quantpack.modules.linear import QuantLinear

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pw, x = packed(24, 128, 64), activations(3, 128)
    layer = QuantLinear.from_packed(pw)
    monkeypatch.setenv("QUANTPACK_W4A8", "force")
    fp8 = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64)
    assert torch.equal(fp8, reference.matmul_fp8_activations(x, pw))
    monkeypatch.setenv("QUANTPACK_W4A8", "0")
    assert torch.equal(mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64), reference.matmul(x, pw))
    assert torch.equal(layer(x), reference.matmul(x, pw))
    monkeypatch.setenv("QUANTPACK_W4A8", "force")
    assert torch.equal(layer(x), fp8)


def test_sm90_compile_of_the_wgmma_kernel():
    """Every variant of the Gluon kernel (w4a8_wgmma.py: tiles, 64- to 256-wide groups, bias, producer warp) gets
    through Gluon and ptxas for sm_90 with BLOCK_K / 32 FP8 (e4m3 x e4m3) wgmma per K step, asynchronous (no C7515),
    without spills, and with the codes built straight into the A fragment's registers (a non-trivial layout change
    to the operand is a compile error)."""
    pytest.importorskip("triton.backends.nvidia")
    from quantpack.kernels.wgmma_mm import HAVE_GLUON
    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from sm90_compile import run_script  # tests/kernels/sm90_compile.py
    from sm90_compile_w4a8 import TRITON_VARIANTS, VARIANTS  # tests/kernels/sm90_compile_w4a8.py

    lines = run_script("sm90_compile_w4a8.py", TRITON_VARIANTS + VARIANTS)
    for line in lines[:len(TRITON_VARIANTS)]:  # (the plain Triton kernel, as the GPU compiles it)
        assert "error" not in line and line["wgmma"] > 0 and line["fp8"], line
    for line in lines[len(TRITON_VARIANTS):]:
        assert "error" not in line, line
        assert line["wgmma"] == line["per_step"] and line["fp8"], line
        assert not line["serialized"] and line["spills"] == 0, line
