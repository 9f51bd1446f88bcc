"""One verdict for every folder: ``quantpack.load`` and ``quantpack verify`` run the same integrity check
(quantpack/checkpoint/integrity.py), so a folder one refuses the other refuses, with the same first line."""
from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

import quantpack
from quantpack import checkpoint
from quantpack.checkpoint import writer as checkpoint_writer
from quantpack.checkpoint import CheckpointError
from quantpack.cli import cli
from quantpack.convert import convert

from hostile import claim_in_config, claim_in_manifest, zero_tensor_digest

LAYER = "model.layers.0.mlp.down_proj"  # (out 128, in 256) in the tiny Llama


@pytest.fixture(scope="module")
def packed(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "q4"
    convert(tiny_llama_dir, out, bits=4, group_size=32, progress=False)
    return out


@pytest.fixture
def copy(packed, tmp_path):
    out = tmp_path / "q4"
    shutil.copytree(packed, out)
    return out


def changed_header(out):
    """A shard rewritten with the same tensors and a note added to its metadata: every tensor digest matches."""
    shard = sorted(out.glob("*.safetensors"))[0]
    infos, meta = checkpoint.read_safetensors_header(shard)
    tensors = {n: checkpoint.read_tensor(i) for n, i in infos.items()}
    checkpoint_writer.write_safetensors(shard, tensors, {**meta, "note": "edited"}, fsync=False)


CASES = {
    # quantization_config or config.json declares what the tensors do not hold
    "config_bits": (lambda out: claim_in_config(out, bits=8, scheme="w8a16"), "quantpack.json says bits=4 but "
                                                                              "quantization_config gives bits=8"),
    "config_group_size": (lambda out: claim_in_config(out, group_size=64), "quantpack.json says group_size=32 but "
                                                                           "quantization_config gives group_size=64"),
    "config_shapes": (lambda out: claim_in_config(out, model_intermediate_size=512), r"shape \[128, 128\], expected "
                                                                                     r"\[256, 128\]"),
    # the manifest records other bits, group size or shape for a layer than its tensors and config hold
    "manifest_bits": (lambda out: claim_in_manifest(out, LAYER, bits=8), "quantpack.json says bits=8 but "
                                                                         "quantization_config gives bits=4"),
    "manifest_group_size": (lambda out: claim_in_manifest(out, LAYER, group_size=64), "quantpack.json says "
                            "group_size=64 but quantization_config gives group_size=32"),
    "manifest_shape": (lambda out: claim_in_manifest(out, LAYER, shape=[256, 128]), r"shape \[128, 128\] does not "
                       r"match the layer shape \[256, 128\] in quantpack.json"),
    # a tensor digest zeroed in the manifest (the files intact)
    "zeroed_digest": (zero_tensor_digest, "its data's sha256 differs from the one quantpack.json records; "
                                          "quantpack.json is corrupt or modified"),
    # a shard's header changed, every tensor's data intact
    "changed_header": (changed_header, r"its header's metadata .*\"note\": \"edited\".* is not what quantpack wrote"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_and_verify_refuse_with_one_line(copy, case):
    damage, match = CASES[case]
    damage(copy)
    with pytest.raises(CheckpointError, match=match) as refused:
        quantpack.load(copy, device="cpu")
    message = str(refused.value)
    assert "\n" not in message
    result = CliRunner().invoke(cli, ["verify", str(copy), "--no-reference", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {message}"), (lines, message)


def test_the_intact_checkpoint_loads_and_verifies(packed):
    """(What the damaged copies are compared with.)"""
    assert quantpack.load(packed, device="cpu", dtype=torch.float32) is not None
    result = CliRunner().invoke(cli, ["verify", str(packed), "--no-reference", "--device", "cpu"])
    assert result.exit_code == 0, result.output
