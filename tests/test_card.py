"""The packed checkpoint's own model card (README.md) replaces the source's."""
from __future__ import annotations

import shutil

from huggingface_hub.repocard import metadata_load

import quantpack
from quantpack import checkpoint
from quantpack.convert import convert


def test_card_describes_the_packed_checkpoint_not_the_source(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags: [original]\n---\n# The original model\n"
                                   "Its own description.\n\n```\n# a comment, not a heading\n```\n")
    out = tmp_path / "tiny-qp4"
    convert(src, out, group_size=32, method="rtn", skip=[r"layers\.1\.mlp"], progress=False)
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "original" not in card.split("\n---\n")[0]  # its own front matter
    # the source card's prose follows quantpack's own section, its headings one level down
    assert card.endswith("\n## The source model's card\n\n## The original model\nIts own description.\n\n```\n"
                         "# a comment, not a heading\n```\n")
    meta = metadata_load(out / "README.md")
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # a local path is no model id
    assert meta["tags"] == ["quantpack", "4-bit", "w4a16", "quantized"] and meta["library_name"] == "transformers"
    assert meta["quantization"] == {"scheme": "w4a16", "bits": 4, "group_size": 32, "axis": 1, "method": "rtn",
                                    "dtype": "bfloat16", "quantpack_version": quantpack.__version__}
    # named as convert names an output by default, whatever -o says: the card depends only on source and settings
    assert card.splitlines()[len(card.split("\n---\n")[0].splitlines()) + 2] == "# src-qp4g32"
    assert 'quantpack.load("src-qp4g32")' in card and 'AutoModelForCausalLM.from_pretrained("src-qp4g32")' in card
    assert f"quantpack convert {src} --bits 4 --group-size 32 --axis 1 --method rtn" in card
    assert "--skip 'layers\\.1\\.mlp'" in card and "- `model.layers.1.mlp.up_proj`: matches --skip" in card
    assert (out / "LICENSE").read_bytes() == (src / "LICENSE").read_bytes()
    # the card is part of the checkpoint: listed with its checksum, so verify and load check it
    assert checkpoint.read_manifest(out)["files"]["outputs"]["README.md"]["size"] == len(card.encode())
    assert checkpoint.check_manifest_files(out) == []


def test_card_of_a_hub_source_names_its_base_model(hub_cache, tmp_path):
    out = tmp_path / "packed"
    convert(hub_cache.repo_id, out, bits=8, group_size=None, method="rtn", progress=False)
    meta = metadata_load(out / "README.md")
    assert meta["base_model"] == hub_cache.repo_id and meta["base_model_relation"] == "quantized"
    assert "8-bit" in meta["tags"] and meta["quantization"]["group_size"] is None
    card = (out / "README.md").read_text()
    assert f"quantpack convert {hub_cache.repo_id} --revision {hub_cache.commit} --bits 8 --group-size none" in card
    assert f"(https://huggingface.co/{hub_cache.repo_id}) at revision `{hub_cache.commit}`" in card


def test_card_and_summary_name_bits_for_and_the_lm_head(tiny_llama_dir, tmp_path):
    out = tmp_path / "tiny-qp4"
    summary = convert(tiny_llama_dir, out, group_size=32, method="rtn", skip=[r"layers\.1\.self_attn\.q_proj"],
                      bits_for=["down_proj=8"], quantize_lm_head=True, progress=False)
    card = (out / "README.md").read_text()
    assert "; 8-bit where `down_proj` matches; the output embeddings (lm_head) quantized too." in card
    assert "1 layer is kept as in the source:" in card and "linear layers are quantized" in card
    settings = next(line for line in summary.format_table().splitlines() if line.startswith("settings"))
    assert settings.endswith(", bits_for down_proj=8, quantize_lm_head=True"), settings
