"""convert --method refit: recorded, verified, and its codes through the reference path and the kernels."""
from __future__ import annotations

import json
import os

import pytest
import torch


@pytest.fixture(scope="module")
def refit_converted(tiny_llama_dir, tmp_path_factory):
    from click.testing import CliRunner

    from quantpack.cli import cli

    out = tmp_path_factory.mktemp("refit") / "out"
    result = CliRunner().invoke(cli, ["convert", str(tiny_llama_dir), "--output", str(out), "--method", "refit",
                                      "--group-size", "32", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


def _stored(path):
    from safetensors.torch import load_file

    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
    return tensors


def test_convert_method_refit_is_recorded_and_verifies(refit_converted):
    from quantpack.verify import verify

    qc = json.loads((refit_converted / "config.json").read_text())["quantization_config"]
    manifest = json.loads((refit_converted / "quantpack.json").read_text())
    assert qc["method"] == "refit" and manifest["settings"]["method"] == "refit"
    report = verify(refit_converted, device="cpu")
    assert not [c for c in report.checks if not c.passed] and not report.warnings
    recorded = {x["name"]: x["rel_error"] for x in manifest["layers"]}
    for item in report.layers["items"]:
        assert item["rel_error"] == pytest.approx(recorded[item["name"]], rel=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py) unwritten outputs are NaN
def test_refit_codes_through_reference_and_kernels_match_the_float_product(refit_converted):
    from quantpack import reference
    from quantpack.format import PackedWeight
    from quantpack.kernels import KernelConfig, mixed_mm

    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    qc = json.loads((refit_converted / "config.json").read_text())["quantization_config"]
    t = _stored(refit_converted)
    layer = "model.layers.1.mlp.down_proj"
    scales = t[f"{layer}.scales"]
    k = scales.shape[0] * qc["group_size"]
    pw = PackedWeight(t[f"{layer}.qweight"], scales, t[f"{layer}.zeros"], qc["bits"], qc["group_size"], 1,
                      (scales.shape[1], k)).to(dev)
    w = reference.dequantize(pw, torch.float32)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).to(scales.dtype).to(dev)
    want = x.float() @ w.t()
    torch.testing.assert_close(reference.matmul(x, pw).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    for rows, cfg in ((1, KernelConfig("gemv", block_n=32, block_r=16, split=1, num_warps=1)),
                      (5, KernelConfig("dot", block_m=16, block_n=32, block_r=16, split=1))):
        got = mixed_mm(x[:rows], pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=pw.bits,
                       config=cfg, out_dtype=torch.float32)
        assert not torch.isnan(got).any()
        assert float((got - want[:rows]).norm() / want[:rows].norm()) < 1e-2, cfg.path
