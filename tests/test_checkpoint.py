"""checkpoint.py: reading sources (and refusing bad ones), writing safetensors, config/manifest schema."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantpack.sizes import parse_size
from quantpack.checkpoint import (SHARD_METADATA, CheckpointError, PackedCheckpoint, SourceCheckpoint,
                                  read_quantization_config, read_safetensors_header, sha256_file, sha256_tensor_data)
from quantpack.checkpoint.writer import make_quantization_config, safetensors_size, shard_name, write_safetensors


@pytest.fixture
def src(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "src")


def test_reads_every_tensor_like_safe_open(tiny_llama_dir):
    with SourceCheckpoint(tiny_llama_dir) as ckpt:
        assert ckpt.format == "safetensors" and ckpt.index_file == "model.safetensors.index.json"
        assert ckpt.weight_files == [shard_name(1, 2), shard_name(2, 2)]
        seen = 0
        for shard in ckpt.weight_files:
            with safe_open(tiny_llama_dir / shard, framework="pt") as f:
                for name in f.keys():
                    t = ckpt.get(name)
                    assert t.dtype == f.get_tensor(name).dtype and torch.equal(t, f.get_tensor(name))
                    assert ckpt.info(name).nbytes == t.numel() * t.element_size()
                    seen += 1
        assert seen == len(ckpt.tensors)
        assert ckpt.other_files() == ["LICENSE", "README.md", "chat_template.jinja", "generation_config.json",
                                      "tokenizer.json", "tokenizer_config.json"]


def test_single_file_source(tiny_llama_tied_dir):
    with SourceCheckpoint(tiny_llama_tied_dir) as ckpt:
        assert ckpt.weight_files == ["model.safetensors"] and ckpt.index_file is None
        assert ckpt.get("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool,
                                   torch.float8_e4m3fn])
def test_write_safetensors_roundtrip_and_alignment(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 7, generator=g).to(dtype), "b": torch.randn(3, generator=g).to(torch.float16),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "q": torch.arange(9, dtype=torch.uint8)}
    path = tmp_path / "x.safetensors"
    sha, size = write_safetensors(path, tensors, SHARD_METADATA)
    assert size == path.stat().st_size == safetensors_size({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                                                           SHARD_METADATA)
    assert sha == sha256_file(path)
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    infos, meta = read_safetensors_header(path)
    assert meta == {"format": "pt", "quantpack_layout_version": "1"}
    for info in infos.values():
        assert info.offset % info.dtype.itemsize == 0
    # Deterministic: the same tensors give the same bytes.
    sha2, _ = write_safetensors(tmp_path / "y.safetensors", dict(reversed(list(tensors.items()))), SHARD_METADATA)
    assert sha2 == sha
    assert not list(tmp_path.glob("*.tmp"))


def test_write_safetensors_digests_are_the_sha256_of_each_tensors_stored_bytes(tmp_path, monkeypatch):
    import hashlib

    import quantpack.checkpoint.writer as checkpoint_writer

    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(300, 1000, generator=g).to(torch.bfloat16),  # 600 KB: hashed on the second thread
               "strided": torch.randn(6, 8, generator=g).t(),  # not contiguous: stored (and hashed) contiguous
               "codes": torch.randint(0, 256, (33, 5), dtype=torch.uint8, generator=g),
               "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}
    monkeypatch.setattr(checkpoint_writer, "_THREADED_DIGEST_BYTES", 1 << 19)
    digests = {}
    sha, size = write_safetensors(tmp_path / "d.safetensors", tensors, SHARD_METADATA, digests=digests)
    # The file is the one written without digests.
    assert (sha, size) == write_safetensors(tmp_path / "plain.safetensors", tensors, SHARD_METADATA)
    assert set(digests) == set(tensors)
    infos, _ = read_safetensors_header(tmp_path / "d.safetensors")
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert digests[name] == hashlib.sha256(raw).hexdigest() == sha256_tensor_data(infos[name]), name
    assert digests["empty"] == hashlib.sha256(b"").hexdigest()
    # One flipped byte changes that tensor's digest and no other.
    info = infos["codes"]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 7)
        byte = f.read(1)[0]
        f.seek(info.offset + 7)
        f.write(bytes([byte ^ 0x40]))
    assert [n for n, i in infos.items() if sha256_tensor_data(i) != digests[n]] == ["codes"]


def test_reader_reads_files_written_by_safetensors(tmp_path):
    tensors = {"a": torch.randn(4, 4, dtype=torch.bfloat16), "b": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text("{}")
    with SourceCheckpoint(tmp_path) as ckpt:
        for k, v in tensors.items():
            assert torch.equal(ckpt.get(k), v)


def test_truncated_safetensors(src):
    shard = src / shard_name(2, 2)
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SourceCheckpoint(src)


def test_corrupt_header(src):
    shard = src / shard_name(1, 2)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        SourceCheckpoint(src)


def test_garbage_header_length(src):
    shard = src / shard_name(1, 2)
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        SourceCheckpoint(src)


def test_lfs_pointer(src):
    (src / shard_name(1, 2)).write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    with pytest.raises(CheckpointError, match="git-LFS pointer"):
        SourceCheckpoint(src)


def test_index_names_missing_shard(src):
    (src / shard_name(2, 2)).unlink()
    with pytest.raises(CheckpointError, match=r"names shard model-00002-of-00002.safetensors which is missing"):
        SourceCheckpoint(src)


def test_index_disagrees_with_shards(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard_name(1, 2)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="index does not match"):
        SourceCheckpoint(src)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "README.md").write_text("hello")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        SourceCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        SourceCheckpoint(tmp_path / "README.md")


def test_missing_config(src):
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        SourceCheckpoint(src)


def test_bin_needs_allow_pickle_and_loads_weights_only(tmp_path, tiny_llama_dir):
    ref = SourceCheckpoint(tiny_llama_dir)
    state = {n: ref.get(n) for n in ref.tensors}
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        SourceCheckpoint(tmp_path)
    with SourceCheckpoint(tmp_path, allow_pickle=True) as ckpt:
        assert ckpt.format == "bin" and set(ckpt.tensors) == set(state)
        assert torch.equal(ckpt.get("model.norm.weight"), state["model.norm.weight"])
    # A pickle carrying an arbitrary object is refused by weights_only=True.
    torch.save({"x": torch.zeros(1), "obj": shutil.copy}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        SourceCheckpoint(tmp_path, allow_pickle=True)


@pytest.mark.parametrize("text,expected", [("5GB", 5_000_000_000), ("500MB", 500_000_000), ("2GiB", 2 << 30),
                                           ("1.5kb", 1500), (1234, 1234), ("100", 100)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["five", "-1GB", "0", "1XB", 0])
def test_parse_size_bad(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(bad)


def test_quantization_config_roundtrip_and_validation():
    qc = make_quantization_config(bits=4, group_size=128, axis=1, method="hqq", modules_not_converted=["lm_head"],
                                  bits_overrides={"model.layers.0.mlp.down_proj": 8}, version="0.1.0")
    read = read_quantization_config({"quantization_config": qc})
    assert read["scheme"] == "w4a16" and read["group_size"] == 128 and read["layout_version"] == 1
    for field, value, match in [("quant_method", "gptq", "quant_method"), ("layout_version", 2, "layout_version"),
                                ("bits", 3, "bits"), ("axis", 2, "axis"), ("group_size", "big", "group_size"),
                                ("bits_overrides", {"x": 5}, "bits_overrides")]:
        with pytest.raises(CheckpointError, match=match):
            read_quantization_config({"quantization_config": {**qc, field: value}})
    with pytest.raises(CheckpointError, match="not a quantpack checkpoint"):
        read_quantization_config({})


def test_packed_checkpoint_rejects_bad_shapes(tmp_path):
    from quantpack import quantize

    pw = quantize(torch.randn(32, 64), bits=4, group_size=32, method="rtn", dtype=torch.float16)
    tensors = {"l.qweight": pw.qweight, "l.scales": pw.scales, "l.zeros": pw.zeros}
    qc = make_quantization_config(bits=4, group_size=32, axis=1, method="rtn", modules_not_converted=[],
                                  bits_overrides={}, version="0")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    write_safetensors(tmp_path / "model.safetensors", tensors, SHARD_METADATA)
    with PackedCheckpoint(tmp_path) as packed:
        got, bias = packed.layer("l")
        assert bias is None and got.shape == (32, 64) and torch.equal(got.qweight, pw.qweight)
    write_safetensors(tmp_path / "model.safetensors", {**tensors, "l.scales": pw.scales[:1]}, SHARD_METADATA)
    with PackedCheckpoint(tmp_path) as packed, pytest.raises(CheckpointError, match="scales: shape"):
        packed.layer("l")
