"""Outputs under attack: links planted at the lock and partial paths, and a finished output the user
added files to. quantpack writes and deletes only what it made (one line, exit 2 otherwise)."""
import json

import pytest
from click.testing import CliRunner

from quantpack.cli import cli

from hostile import plant_link, snapshot, user_folder


def convert(*args):
    return CliRunner().invoke(cli, ["convert", *map(str, args), "--method", "rtn", "--no-progress"])


def refused(result, match):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], result.stderr


def test_a_link_at_the_lock_path_is_refused_and_its_target_kept(tiny_llama_dir, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's file")
    out = tmp_path / "out"
    link = plant_link(out, "lock", precious)
    refused(convert(tiny_llama_dir, "-o", out), "is a symbolic link, not quantpack's lock")
    assert precious.read_text() == "the user's file" and link.is_symlink() and not out.exists()


def test_a_foreign_file_at_the_lock_path_is_refused(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.qp-lock"
    lock.write_text("a user's notes\n")
    refused(convert(tiny_llama_dir, "-o", out), "is not quantpack's lock (it holds other data)")
    assert lock.read_text() == "a user's notes\n"
    lock.write_text("12345\n")  # what a killed run leaves: taken over
    assert convert(tiny_llama_dir, "-o", out).exit_code == 0
    assert not lock.exists()


def test_a_link_at_the_partial_path_is_refused_and_its_target_kept(tiny_llama_dir, tmp_path):
    folder = tmp_path / "photos"
    before = user_folder(folder)
    out = tmp_path / "out"
    link = plant_link(out, "partial", folder)
    refused(convert(tiny_llama_dir, "-o", out), "is a symbolic link, not quantpack's partial output")
    assert snapshot(folder) == before and link.is_symlink() and not out.exists()


@pytest.fixture
def finished(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    assert convert(tiny_llama_dir, "-o", out).exit_code == 0
    return out


def test_overwrite_refuses_an_output_the_user_added_files_to(tiny_llama_dir, finished):
    (finished / "adapter").mkdir()
    (finished / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (finished / "notes.md").write_text("mine")
    before = snapshot(finished)
    refused(convert(tiny_llama_dir, "-o", finished, "--overwrite", "--bits", "8"),
            "holds files quantpack did not write (adapter/, notes.md)")
    assert snapshot(finished) == before
    (finished / "notes.md").unlink()
    (finished / "adapter" / "adapter_model.safetensors").unlink()
    (finished / "adapter").rmdir()
    assert convert(tiny_llama_dir, "-o", finished, "--overwrite", "--bits", "8").exit_code == 0
    assert json.loads((finished / "config.json").read_text())["quantization_config"]["bits"] == 8


def test_overwrite_refuses_a_folder_whose_manifest_has_only_the_version_keys(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "quantpack.json").write_text(json.dumps({"manifest_version": 1, "quantpack_version": "0.1.0"}))
    (out / "thesis.txt").write_text("mine")
    before = snapshot(out)
    refused(convert(tiny_llama_dir, "-o", out, "--overwrite"), "is not a quantpack output")
    assert snapshot(out) == before
