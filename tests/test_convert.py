"""convert(): end to end on tiny real checkpoints, layer selection, options, resume, bad input."""
import json
import os
import shutil

import pytest
import torch

import quantpack
from quantpack.checkpoint import (CheckpointError, PackedCheckpoint, SourceCheckpoint, check_index,
                                  check_manifest_files, read_safetensors_header, sha256_file, sha256_tensor_data)
from quantpack.checkpoint.writer import shard_name, write_safetensors
from quantpack.convert import convert
from quantpack.reference import dequantize
from quantpack.tiny import make_tiny_llama

LLAMA_LINEARS = {f"model.layers.{i}.{m}" for i in range(2) for m in
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def rel_error(a, b):
    return float(torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float()))


def same_tree(a, b):
    files_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def check_output(src_dir, out, *, dtype=torch.bfloat16, max_error=0.15):
    """Every output file is consistent and every layer dequantizes back close to the source."""
    tensors = check_index(out)  # index vs shards, shard metadata format=pt
    for shard in {info.file for info in tensors.values()}:
        assert read_safetensors_header(shard)[1]["quantpack_layout_version"] == "1"
    assert check_manifest_files(out) == []
    manifest = json.loads((out / "quantpack.json").read_text())
    src = SourceCheckpoint(src_dir, allow_pickle=True)
    for rel, entry in manifest["files"]["inputs"].items():
        assert sha256_file(src_dir / rel) == entry["sha256"]
    for rel in src.other_files():
        if rel != "README.md":  # the packed checkpoint's own model card (tests/test_card.py)
            assert (out / rel).read_bytes() == (src_dir / rel).read_bytes()
    for rel, entry in manifest["files"]["outputs"].items():  # each shard's per-tensor digests
        if rel.endswith(".safetensors"):
            infos, _ = read_safetensors_header(out / rel)
            assert entry["tensors"] == {n: sha256_tensor_data(i) for n, i in infos.items()}, rel
        else:
            assert "tensors" not in entry, rel
    assert manifest["settings"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # (device="auto")
    errors = {layer["name"]: layer["rel_error"] for layer in manifest["layers"]}
    with PackedCheckpoint(out) as packed:
        assert sorted(packed.quantized_modules) == sorted(errors)
        for module in packed.quantized_modules:
            assert module + ".weight" not in tensors
            pw, bias = packed.layer(module)
            assert pw.scales.dtype == dtype and pw.zeros.dtype == dtype
            w = src.get(module + ".weight")
            err = rel_error(dequantize(pw, torch.float32), w)
            assert err == pytest.approx(errors[module], rel=1e-3)
            assert err < max_error
            if module + ".bias" in src.tensors:
                assert torch.equal(bias, src.get(module + ".bias").to(dtype))
        # Everything else is the source tensor cast to the output dtype.
        quantized = set(packed.quantized_modules)
        for name in src.tensors:
            if name.endswith(".weight") and name[:-7] in quantized:
                continue
            t = src.get(name)
            assert torch.equal(packed.source.get(name), t.to(dtype) if t.is_floating_point() else t), name
    src.close()
    return manifest


def test_convert_tiny_llama(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    summary = convert(tiny_llama_dir, out, group_size=64, max_shard_size="100KB", progress=False)
    assert summary.num_shards >= 3 and not summary.dry_run
    assert {layer.name for layer in summary.quantized} == LLAMA_LINEARS
    assert [(layer.name, layer.skipped) for layer in summary.skipped] == [
        ("lm_head", "output embeddings (pass --quantize-lm-head to quantize)")]
    files = {p.name for p in out.iterdir()}
    assert {shard_name(i + 1, summary.num_shards) for i in range(summary.num_shards)} <= files
    assert {"config.json", "model.safetensors.index.json", "quantpack.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "chat_template.jinja", "LICENSE", "README.md"} <= files
    assert not list(tmp_path.glob(".*"))  # the partial directory is gone
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "quantpack", "layout_version": 1, "bits": 4, "group_size": 64, "axis": 1, "method": "hqq",
        "modules_not_converted": ["lm_head"], "bits_overrides": {}, "quantpack_version": quantpack.__version__}
    assert config["dtype"] == "bfloat16"
    manifest = check_output(tiny_llama_dir, out)
    assert manifest["source"] == {"repo": str(tiny_llama_dir), "revision": None, "local": True}
    assert manifest["settings"]["group_size"] == 64
    assert summary.output_bytes == sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert summary.ratio > 2.5
    assert summary.mean_error == pytest.approx(sum(l["rel_error"] for l in manifest["layers"]) / 14)
    assert summary.throughput > 0
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(out)("Hello").input_ids == AutoTokenizer.from_pretrained(tiny_llama_dir)(
        "Hello").input_ids


def test_convert_encoder_with_biases(tiny_encoder_dir, tmp_path):
    summary = convert(tiny_encoder_dir, tmp_path / "enc", method="rtn", dtype="float16", progress=False)
    names = {layer.name for layer in summary.quantized}
    assert "pooler.dense" in names and "encoder.layer.1.output.dense" in names and len(names) == 13
    assert not summary.skipped
    check_output(tiny_encoder_dir, tmp_path / "enc", dtype=torch.float16)


def test_convert_tied_single_file(tiny_llama_tied_dir, tmp_path):
    summary = convert(tiny_llama_tied_dir, tmp_path / "tied", quantize_lm_head=True, progress=False)
    assert [(l.name, l.skipped) for l in summary.skipped] == [("lm_head", "tied to the input embeddings (not stored)")]
    check_output(tiny_llama_tied_dir, tmp_path / "tied")
    assert "lm_head.weight" not in SourceCheckpoint(tmp_path / "tied").tensors


def test_options_skip_bits_for_lm_head_axis0(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    summary = convert(tiny_llama_dir, out, method="rtn", axis=0, group_size=32, skip=[r"layers\.1\.self_attn"],
                      bits_for=[r"down_proj=8", "v_proj=8"], quantize_lm_head=True, progress=False)
    by_name = {l.name: l for l in summary.layers}
    assert by_name["lm_head"].bits == 4
    assert by_name["model.layers.0.mlp.down_proj"].bits == 8 and by_name["model.layers.1.self_attn.v_proj"].skipped
    assert by_name["model.layers.1.self_attn.q_proj"].skipped == r"matches --skip layers\.1\.self_attn"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["axis"] == 0 and qc["bits_overrides"] == {"model.layers.0.mlp.down_proj": 8,
                                                        "model.layers.0.self_attn.v_proj": 8,
                                                        "model.layers.1.mlp.down_proj": 8}
    assert qc["modules_not_converted"] == [f"model.layers.1.self_attn.{p}_proj" for p in "koqv"]
    manifest = check_output(tiny_llama_dir, out)
    errors = {l["name"]: l["rel_error"] for l in manifest["layers"]}
    assert errors["model.layers.0.mlp.down_proj"] < errors["model.layers.0.mlp.up_proj"] / 5  # 8 bits is far better


def test_per_channel_8bit(tiny_llama_dir, tmp_path):
    summary = convert(tiny_llama_dir, tmp_path / "pc", bits=8, group_size=None, method="rtn", progress=False)
    assert all(l.group_size == l.shape[1] for l in summary.quantized)
    assert json.loads((tmp_path / "pc" / "config.json").read_text())["quantization_config"]["group_size"] is None
    check_output(tiny_llama_dir, tmp_path / "pc", max_error=0.02)


def test_default_output_name(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = convert(tiny_llama_dir, method="rtn", progress=False)
    assert summary.output == str(tmp_path / "tiny-llama-qp4g128")
    assert (tmp_path / "tiny-llama-qp4g128" / "quantpack.json").exists()
    assert convert(tiny_llama_dir, bits=8, group_size=None, dry_run=True, progress=False).output.endswith(
        "tiny-llama-qp8pc")


def test_group_size_not_dividing_is_skipped_or_strict_error(tmp_path):
    src = make_tiny_llama(tmp_path / "odd", intermediate_size=192)  # down_proj in-features 192 % 128 != 0
    summary = convert(src, tmp_path / "out", method="rtn", progress=False)
    skipped = {l.name: l.skipped for l in summary.skipped}
    assert skipped["model.layers.0.mlp.down_proj"] == "group size does not fit its shape"
    assert any("model.layers.1.mlp.down_proj" in w and "192" in w for w in summary.warnings)
    assert "model.layers.0.mlp.down_proj" in json.loads(
        (tmp_path / "out" / "config.json").read_text())["quantization_config"]["modules_not_converted"]
    check_output(src, tmp_path / "out")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: group_size=128 does not divide .*--strict"):
        convert(src, tmp_path / "strict", method="rtn", strict=True, progress=False)
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize("kwargs, match", [
    ({"skip": [".*"]}, r"^nothing to quantize: --skip leaves no linear layer \(e.g. model.layers.0.mlp.down_proj "
                       r"matches --skip \.\*; layers kept: 14 x matches --skip .*; 1 x output embeddings .*\); "
                       r"narrow the --skip patterns"),
    ({"group_size": 512}, r"^nothing to quantize: --group-size 512 fits no linear layer \(e.g. "
                          r"model.layers.0.mlp.down_proj, in_features=256\); --group-size 256 \(or none\) fits it"),
])
def test_nothing_to_quantize_names_the_real_reason(tiny_llama_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        convert(tiny_llama_dir, tmp_path / "out", method="rtn", progress=False, **kwargs)
    assert "output embeddings" not in str(info.value).split("(")[0]
    assert not (tmp_path / "out").exists()


def test_dry_run_writes_nothing_and_estimates_exactly(tiny_llama_dir, tmp_path):
    plan = convert(tiny_llama_dir, tmp_path / "d", max_shard_size="300KB", dry_run=True, progress=False)
    assert plan.dry_run and plan.disk_free > 0 and plan.num_shards >= 2
    assert list(tmp_path.iterdir()) == []
    real = convert(tiny_llama_dir, tmp_path / "d", max_shard_size="300KB", method="rtn", progress=False)
    assert real.output_bytes == plan.output_bytes and real.num_shards == plan.num_shards


def test_dry_run_checks_disk_space(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(CheckpointError, match=r"output: needs about [\d.]+ MB free on .* but only 1.00 KB is available"):
        convert(tiny_llama_dir, tmp_path / "x", dry_run=True, progress=False)


def test_output_inside_the_source_is_refused(tiny_llama_dir, tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    before = sorted(p.name for p in src.iterdir())
    monkeypatch.chdir(src)  # `quantpack convert .` from inside the model directory
    with pytest.raises(CheckpointError, match=r"output: .*src/src-qp4g128 is inside the source checkpoint .*src; "
                                              r"choose an --output outside it"):
        convert(".", progress=False)
    assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_parent_is_refused_before_work(tiny_llama_dir, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(CheckpointError, match=r"output: cannot create .* is not writable"):
        convert(tiny_llama_dir, locked / "out", progress=False)


def test_existing_output_needs_overwrite(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    convert(tiny_llama_dir, out, method="rtn", progress=False)
    before = (out / "quantpack.json").read_bytes()
    with pytest.raises(CheckpointError, match="already exists .*finished conversion.*--overwrite"):
        convert(tiny_llama_dir, out, method="rtn", bits=8, progress=False)
    assert (out / "quantpack.json").read_bytes() == before
    convert(tiny_llama_dir, out, method="rtn", bits=8, overwrite=True, progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_interrupted_run_resumes_to_identical_output(tiny_llama_dir, tmp_path, convert_interrupted):
    fresh = tmp_path / "fresh"
    n = convert(tiny_llama_dir, fresh, max_shard_size="60KB", method="rtn", progress=False).num_shards
    assert n >= 4

    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, max_shard_size="60KB", method="rtn", progress=False, at=3)
    assert not out.exists()  # nothing that looks complete
    partial = tmp_path / ".out.qp-partial"
    assert sorted(p.name for p in partial.iterdir()) == [shard_name(1, n), shard_name(2, n), "progress.json"]
    # progress.json carries the finished shards' tensor digests, so the resumed manifest has them too.
    finished = json.loads((partial / "progress.json").read_text())["shards"]
    fresh_outputs = json.loads((fresh / "quantpack.json").read_text())["files"]["outputs"]
    assert [finished[shard_name(i, n)]["tensors"] for i in (1, 2)] == \
        [fresh_outputs[shard_name(i, n)]["tensors"] for i in (1, 2)]
    # A corrupted finished shard is detected by its checksum and redone.
    data = bytearray((partial / shard_name(2, n)).read_bytes())
    data[-1] ^= 0xFF
    (partial / shard_name(2, n)).write_bytes(bytes(data))
    summary = convert(tiny_llama_dir, out, max_shard_size="60KB", method="rtn", progress=False)
    assert summary.num_shards == n and summary.resumed_shards == 1
    same_tree(fresh, out)
    assert not partial.exists()


def test_progress_without_tensor_digests_redoes_the_shard(tiny_llama_dir, tmp_path, convert_interrupted):
    """A finished shard recorded by a quantpack that wrote no per-tensor digests is converted again
    (its manifest entry would lack them), the others resume."""
    fresh = tmp_path / "fresh"
    convert(tiny_llama_dir, fresh, max_shard_size="150KB", method="rtn", progress=False)
    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, max_shard_size="150KB", method="rtn", progress=False, at=3)
    progress_file = tmp_path / ".out.qp-partial" / "progress.json"
    progress = json.loads(progress_file.read_text())
    first = sorted(progress["shards"])[0]
    del progress["shards"][first]["tensors"]
    progress_file.write_text(json.dumps(progress))
    summary = convert(tiny_llama_dir, out, max_shard_size="150KB", method="rtn", progress=False)
    assert summary.resumed_shards == 1
    same_tree(fresh, out)


def test_changed_settings_do_not_resume(tiny_llama_dir, tmp_path, convert_interrupted):
    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, max_shard_size="150KB", method="rtn", progress=False, at=2)
    summary = convert(tiny_llama_dir, out, max_shard_size="150KB", method="rtn", bits=8, progress=False)
    assert summary.resumed_shards == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8


def test_hub_source_offline_cache(hub_cache, tmp_path, tiny_llama_dir):
    summary = convert(hub_cache.repo_id, tmp_path / "hub", method="rtn", progress=False)
    manifest = json.loads((tmp_path / "hub" / "quantpack.json").read_text())
    assert manifest["source"] == {"repo": hub_cache.repo_id, "revision": hub_cache.commit, "local": False}
    assert summary.revision == hub_cache.commit
    # Same bytes as converting the local copy, except for the manifest's source field.
    local = tmp_path / "local"
    convert(tiny_llama_dir, local, method="rtn", progress=False)
    for f in local.glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "hub" / f.name).read_bytes()


def test_hub_offline_not_cached(hub_cache, tmp_path):
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        convert("someone/not-cached", tmp_path / "x", progress=False)
    with pytest.raises(CheckpointError, match="no such directory"):
        convert("./no/such/dir", tmp_path / "x", progress=False)
    assert list(tmp_path.iterdir()) == [hub_cache.cache_dir]


def test_bin_source_with_allow_pickle(tiny_llama_dir, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    ref = SourceCheckpoint(tiny_llama_dir)
    torch.save({n: ref.get(n) for n in ref.tensors}, src / "pytorch_model.bin")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, src / f)
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        convert(src, tmp_path / "out", progress=False)
    convert(src, tmp_path / "out", method="rtn", allow_pickle=True, progress=False)
    check_output(src, tmp_path / "out")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_integer_or_fp8_source_weights(tiny_llama_dir, tmp_path, dtype):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    shard = src / shard_name(1, 2)
    infos, meta = read_safetensors_header(shard)
    ckpt = SourceCheckpoint(src)
    tensors = {n: ckpt.get(n) for n in infos}
    ckpt.close()
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(dtype)
    write_safetensors(shard, tensors, meta)
    with pytest.raises(CheckpointError, match="up_proj.weight has dtype .*not integer or fp8"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.qp-partial").exists()


def test_already_quantized_source(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="already quantized"):
        convert(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 3}, "bits=3"), ({"axis": 2}, "axis=2"), ({"method": "gptq"}, "method='gptq'"),
    ({"group_size": 0}, "group_size=0"), ({"dtype": "float32"}, "dtype='float32'"),
    ({"skip": ["(unclosed"]}, "skip='\\(unclosed'"), ({"bits_for": ["down_proj=3"]}, "bits_for='down_proj=3'"),
    ({"bits_for": ["down_proj"]}, "REGEX=BITS"), ({"max_shard_size": "lots"}, "max_shard_size='lots'"),
    ({"device": "tpu"}, "device='tpu'"),
])
def test_bad_arguments(tiny_llama_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert(tiny_llama_dir, tmp_path / "out", progress=False, **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source,is_path", [("gpt2", False), ("meta-llama/Llama-3.1-8B", False), ("./model", True),
                                            ("/abs/model", True), ("a/b/c", True), ("~/models/x", True),
                                            ("bad repo/name", True)])
def test_source_path_or_repo_id(source, is_path):
    from quantpack.checkpoint.hub import looks_like_path

    assert looks_like_path(source) is is_path


def test_patterns_that_match_no_layer_warn_or_fail_under_strict(tiny_llama_dir, tmp_path):
    plan = convert(tiny_llama_dir, tmp_path / "d", skip=["q_prj"], bits_for=["down_proj=8", "dwn=8"],
                   dry_run=True, progress=False)
    assert "--skip q_prj matches no linear layer" in plan.warnings
    assert "--bits-for dwn matches no linear layer" in plan.warnings
    assert not any("down_proj" in w for w in plan.warnings)
    with pytest.raises(ValueError, match=r"--skip q_prj matches no linear layer \(--strict\)"):
        convert(tiny_llama_dir, tmp_path / "d", skip=["q_prj"], strict=True, dry_run=True, progress=False)


def test_architectures_whose_names_transformers_converts_are_refused(tmp_path, monkeypatch):
    """Where transformers renames or merges stored tensors at load in a way quantpack does not follow
    (here: an experts block quantpack does not recognize), convert says so before writing anything,
    instead of writing a checkpoint that would not load."""
    import quantpack.convert.run
    import quantpack.modules.experts
    from quantpack.tiny import make_tiny_mixtral

    src = make_tiny_mixtral(tmp_path / "mixtral", num_hidden_layers=1, num_local_experts=2)
    monkeypatch.setattr(quantpack.modules.experts, "fused_experts_dims", lambda module: None)
    monkeypatch.setattr(quantpack.convert.run, "check_expert_blocks", lambda model: None)  # (refuses such blocks first)
    with pytest.raises(CheckpointError, match=r"^source: tensor model\.layers\.0\.block_sparse_moe\.experts\.0\.w1"
                                              r"\.weight \(and \d+ more\) is not a parameter of MixtralForCausalLM"):
        convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixtral"]


def test_stored_tensors_the_model_does_not_have_are_dropped(tmp_path):
    """Old Llama checkpoints store ``rotary_emb.inv_freq``; transformers skips it when loading, and so
    does the packed checkpoint (with a warning), which then loads."""
    from safetensors.torch import load_file, save_file

    import quantpack

    src = make_tiny_llama(tmp_path / "old-llama", num_shards=1, num_hidden_layers=1)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    summary = convert(src, tmp_path / "out", group_size=32, method="rtn")
    assert summary.warnings == ["dropped 1 stored tensors that are not parameters of LlamaForCausalLM (transformers "
                                "skips them too): model.layers.0.self_attn.rotary_emb.inv_freq"]
    with PackedCheckpoint(tmp_path / "out") as pc:
        assert not any("inv_freq" in name for name in pc.source.tensors)
    assert quantpack.load(tmp_path / "out", device="cpu") is not None
