"""convert --method refit: recorded, verified, and its codes through the reference path and the kernels."""
from __future__ import annotations

import json
import os

import pytest
import torch

from oracles import assert_stored_layer_matches_float_product


@pytest.fixture(scope="module")
def refit_converted(tiny_llama_dir, tmp_path_factory):
    from click.testing import CliRunner

    from quantpack.cli import cli

    out = tmp_path_factory.mktemp("refit") / "out"
    result = CliRunner().invoke(cli, ["convert", str(tiny_llama_dir), "--output", str(out), "--method", "refit",
                                      "--group-size", "32", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


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
    assert_stored_layer_matches_float_product(refit_converted, "model.layers.1.mlp.down_proj")
