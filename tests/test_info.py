"""``quantpack info``: the checkpoint's settings, source and size, read from its manifest without loading it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from quantpack import checkpoint
from quantpack.cli import cli
from quantpack.info import info
from quantpack.sizes import format_size
from test_loader import packed_mixed  # noqa: F401 (fixture)


def run(*args):
    return CliRunner().invoke(cli, ["info", *map(str, args)])


def test_info_json_describes_the_checkpoint(packed_mixed, tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(checkpoint.reading, "read_tensor", None)  # nothing is loaded: no tensor data read
    r = run(packed_mixed, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    manifest = checkpoint.read_manifest(packed_mixed)
    assert doc == info(packed_mixed)
    assert (doc["scheme"], doc["bits"], doc["group_size"], doc["axis"], doc["method"]) == ("w4a16", 4, None, 0, "rtn")
    assert doc["bits_overrides"] == {f"model.layers.{i}.mlp.down_proj": 8 for i in (0, 1)}
    assert doc["source"] == {"repo": str(tiny_llama_dir.resolve()), "revision": None, "local": True}
    assert doc["architecture"] == "LlamaForCausalLM" and doc["model_layers"] == 2
    assert doc["quantized_layers"] == len(manifest["layers"]) == 13
    assert {s["name"] for s in doc["skipped_layers"]} == {"model.layers.1.self_attn.o_proj", "lm_head"}
    # the shards, the size convert's summary and the model card report
    assert doc["size_bytes"] == manifest["totals"]["output_bytes"] == sum(
        p.stat().st_size for p in packed_mixed.glob("*.safetensors"))
    assert doc["source_bytes"] == manifest["totals"]["source_bytes"] and "verify" not in doc


def test_info_table(packed_mixed):
    r = run(packed_mixed)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "w4a16, 4-bit, group size per-channel, axis 0, method rtn" in out
    assert "model           LlamaForCausalLM, 2 layers" in out and "quantized       13 linear layers" in out
    assert "skipped         2\n" in out and "\n  model.layers.1.self_attn.o_proj: matches --skip" in out
    size = format_size(checkpoint.read_manifest(packed_mixed)["totals"]["output_bytes"])
    assert f"size            {size} (the source's weights: " in out
    assert (packed_mixed / "README.md").read_text().count(f"Size: {size} (the source's weights: ") == 1
    assert "checked         nothing (info reads JSON only): `quantpack verify " in out and "not recorded" not in out


def test_info_on_something_else_is_one_line_exit_2(tiny_llama_dir, tmp_path):
    for target, message in ((tiny_llama_dir, "no quantpack.json; not a complete quantpack output"),
                            (tmp_path / "missing", "no such directory")):
        r = run(target)
        assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("args", [["--json"], ["--help"]])
def test_info_imports_no_torch(packed_mixed, args):
    """info reads JSON only: it imports neither torch nor transformers, so it starts as fast as --help."""
    probe = ("import sys\nfrom quantpack.cli import cli\n"
             "try:\n    cli(['info', *sys.argv[1:]])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    target = [] if args == ["--help"] else [str(packed_mixed)]
    proc = subprocess.run([sys.executable, "-c", probe, *target, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out, _, heavy = proc.stdout.rstrip().rpartition("\n")
    assert heavy == "[]", proc.stdout[-2000:]
    if args == ["--json"]:
        assert json.loads(out) == info(packed_mixed)
    else:
        assert "Usage: " in out and "--json" in out
