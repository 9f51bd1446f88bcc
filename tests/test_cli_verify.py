"""``quantpack verify``: CliRunner for the exit codes and output forms, a real subprocess end to end.

The checkpoints come from tests/test_verify.py (built once per session, shared).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from quantpack import verify as verify_mod
from quantpack.cli import cli
from test_verify import (TRAIN_TOKENS, altered_reference, assert_matches_schema, ckpt,  # noqa: F401 (fixture)
                         copy_of, flip_byte)


def run(*args):
    return CliRunner().invoke(cli, ["verify", *map(str, args)])


@pytest.fixture
def text_file(ckpt, tmp_path):
    f = tmp_path / "eval.txt"
    f.write_text(ckpt("train_text"), encoding="utf-8")
    return f


def test_pass_prints_table_and_exits_0(ckpt, text_file):
    r = run(ckpt("q4"), "--text-file", text_file, "--device", "cpu")
    assert r.exit_code == 0, r.output + r.stderr
    for needle in ("integrity  ok", "worst layers", "kernels    reference path", "perplexity  reference",
                   "KL          mean", "top-1", f"{TRAIN_TOKENS} tokens", f"text {text_file}", "verdict    PASS"):
        assert needle in r.stdout
    assert r.stderr == ""


def test_json_output_matches_schema(ckpt, text_file):
    r = run(ckpt("q8"), "--text-file", text_file, "--json", "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert_matches_schema(doc)
    assert doc["verdict"] == "pass" and doc["end_to_end"]["settings"]["text"] == str(text_file)
    assert doc["thresholds"] == {"max_kl": 0.1, "min_top1": 0.8, "min_cosine": 0.99, "max_layer_error": None}


def test_cli_defaults_are_the_library_defaults():
    params = {p.name: p.default for p in cli.commands["verify"].params}
    assert params["max_kl"] == verify_mod.DEFAULT_MAX_KL
    assert params["min_top1"] == verify_mod.DEFAULT_MIN_TOP1
    assert params["min_cosine"] == verify_mod.DEFAULT_MIN_COSINE
    assert params["context_length"] == verify_mod.DEFAULT_CONTEXT_LENGTH
    assert params["max_tokens"] == verify_mod.DEFAULT_MAX_TOKENS


def test_failed_threshold_exits_1(ckpt, text_file):
    r = run(ckpt("q4"), "--text-file", text_file, "--max-kl", "1e-9", "--min-top1", "0.5", "--device", "cpu")
    assert r.exit_code == 1
    assert "check      kl_mean" in r.stdout and "verdict    FAIL" in r.stdout
    assert r.stderr.startswith("Failed: kl_mean = ") and "(must be <= 1e-09)" in r.stderr
    assert "top1_agreement" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(ckpt("q4"), "--text-file", text_file, "--max-layer-error", "0.01", "--json", "--device", "cpu")
    assert r.exit_code == 1 and json.loads(r.stdout)["verdict"] == "fail"
    assert r.stderr.startswith("Failed: max_layer_error = ")


def test_quiet_prints_nothing_but_what_failed(ckpt, text_file):
    r = run(ckpt("q4"), "--no-reference", "--device", "cpu", "--quiet")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == "", r.output
    r = run(ckpt("q4"), "--text-file", text_file, "--max-kl", "1e-9", "--device", "cpu", "--quiet")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith("Failed: kl_mean = ") and len(r.stderr.strip().splitlines()) == 1


def test_warnings_go_to_stderr(ckpt, tmp_path):
    other = altered_reference(ckpt("llama"), tmp_path / "other")
    r = run(ckpt("q8"), "--reference", other, "--device", "cpu", "--json")
    assert json.loads(r.stdout)["warnings"]  # stdout stays valid JSON
    assert r.stderr.startswith("warning: the reference differs from the files quantpack.json says"), r.stderr
    r = run(ckpt("q8"), "--reference", other, "--device", "cpu")
    assert "warning:" not in r.stdout and r.stderr.startswith("warning: the reference differs")


def test_flipped_byte_exits_2_naming_the_tensor(ckpt, tmp_path):
    root = copy_of(ckpt("q4"), tmp_path)
    tensor = "model.layers.1.mlp.gate_proj.qweight"
    shard = flip_byte(root, tensor, 17, 0x10)
    r = run(root, "--device", "cpu")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"Error: tensor {tensor} in {shard}: ") and "sha256 differs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output + r.stderr
    assert "integrity  PROBLEMS" in r.stdout and "verdict    CORRUPT" in r.stdout
    r = run(root, "--json", "--device", "cpu")
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["verdict"] == "corrupt" and doc["integrity"]["problems"][0]["tensor"] == tensor
    assert_matches_schema(doc)


def test_missing_shard_exits_2(ckpt, tmp_path):
    root = copy_of(ckpt("q8"), tmp_path)
    gone = sorted(root.glob("model-*.safetensors"))[-1]
    gone.unlink()
    r = run(root, "--no-reference", "--device", "cpu")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"Error: file {gone.name}: missing (it holds ") and "download it again" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_wrong_layout_version_exits_2(ckpt, tmp_path):
    root = copy_of(ckpt("q4"), tmp_path)
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["layout_version"] = 99
    (root / "config.json").write_text(json.dumps(config))
    r = run(root, "--device", "cpu")
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: config.json: quantization_config.layout_version=99; this quantpack reads "
                               "layout version 1: upgrade quantpack or re-convert")


@pytest.mark.parametrize("args, message", [
    (["--reference", "/nonexistent/model"], "Error: reference: /nonexistent/model is not available: no such directory"),
    (["--reference", "x", "--no-reference"], "Error: --reference and --no-reference: pass one of them"),
    (["--min-top1", "2"], "Error: min_top1=2.0 must be in [0, 1]"),
    (["--text-file", "/nonexistent/t.txt"], "Error: text_file: cannot read /nonexistent/t.txt"),
    (["--device", "tpu"], "Error: device='tpu' is not supported"),
])
def test_bad_input_exits_2_with_one_line(ckpt, args, message):
    r = run(ckpt("q8"), *args)
    assert r.exit_code == 2 and r.stderr.startswith(message), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_real_subprocess(ckpt, tmp_path, text_file):
    """The installed entry point end to end: JSON on stdout and exit 0, then a corrupted copy: exit 2."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", "from quantpack.cli import main; main()", "verify"]
    p = subprocess.run(cmd + [str(ckpt("q4")), "--text-file", str(text_file), "--json", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert_matches_schema(doc)
    assert doc["verdict"] == "pass" and doc["end_to_end"]["metrics"]["top1_agreement"] > 0.9
    root = copy_of(ckpt("q4"), tmp_path)
    tensor = "model.layers.0.self_attn.o_proj.scales"
    flip_byte(root, tensor, 4, 0x02)
    p = subprocess.run(cmd + [str(root), "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: tensor {tensor} in ") and "Traceback" not in p.stderr


def test_allow_pickle_verifies_against_a_bin_reference(tiny_llama_dir, tmp_path):
    """A checkpoint converted from a .bin source verifies against it with --allow-pickle, the flag the refusal names."""
    import shutil

    import torch

    from quantpack.checkpoint import SourceCheckpoint
    from quantpack.convert import convert

    src = tmp_path / "bin"
    src.mkdir()
    with SourceCheckpoint(tiny_llama_dir) as ref:
        torch.save({n: ref.get(n) for n in ref.tensors}, src / "pytorch_model.bin")
    for f in tiny_llama_dir.iterdir():
        if f.suffix in (".json", ".txt", ".model") and not f.name.endswith("index.json"):
            shutil.copy(f, src / f.name)
    out = tmp_path / "out"
    convert(src, out, method="rtn", bits=8, allow_pickle=True, progress=False)
    refused = run(out, "--device", "cpu")
    assert refused.exit_code == 2 and "pass --allow-pickle" in refused.stderr and "\n" not in refused.stderr.strip()
    r = run(out, "--device", "cpu", "--allow-pickle", "--max-kl", "1", "--min-top1", "0")
    assert r.exit_code == 0, r.output + r.stderr
    assert "integrity  ok" in r.stdout and "worst layers" in r.stdout and "KL          mean" in r.stdout
