"""Builders of hostile inputs shared by the tests: links planted where quantpack writes, packed
tensors destroyed behind a manifest that still matches, and small files that are broken."""
from __future__ import annotations

import json
from pathlib import Path

from quantpack.checkpoint import MANIFEST_NAME, sha256_file

LOCK = ".{}.qp-lock"
PARTIAL = ".{}.qp-partial"


def plant_link(out: Path, kind: str, target: Path) -> Path:
    """A symbolic link at the lock (``kind="lock"``) or partial (``"partial"``) path of output ``out``."""
    link = out.parent / (LOCK if kind == "lock" else PARTIAL).format(out.name)
    link.symlink_to(target)
    return link


def user_folder(path: Path) -> dict:
    """A folder of a user's files; returns its contents, to compare with afterwards."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return snapshot(path)


def snapshot(path: Path) -> dict:
    """Every file and folder under ``path`` with its bytes."""
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file at ``path`` with ``change(data)`` applied (in place, or its return value)."""
    data = json.loads(path.read_text())
    data = change(data) or data
    path.write_text(json.dumps(data))


def rehash(out: Path) -> None:
    """Make the manifest's output digests (files' and tensors') match the files again, as an attacker who
    edits them would."""
    from quantpack.checkpoint import read_safetensors_header, sha256_tensor_data

    def update(manifest):
        for rel, entry in manifest["files"]["outputs"].items():
            entry.update(sha256=sha256_file(out / rel), size=(out / rel).stat().st_size)
            if isinstance(entry.get("tensors"), dict):
                infos, _ = read_safetensors_header(out / rel)
                entry["tensors"] = {name: sha256_tensor_data(info) for name, info in infos.items()}
    edit_json(out / MANIFEST_NAME, update)


def edit_tensors(out: Path, change) -> None:
    """Apply ``change(tensors)`` (a dict name -> tensor, edited in place) to every shard of the
    packed output ``out``, keeping each shard's metadata, then rehash the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        change(tensors)
        save_file(tensors, shard, metadata=meta)
    rehash(out)


def swap_scales_and_zeros(out: Path, layer: str) -> None:
    """Destroy one packed layer: its scales and zeros trade places; the manifest still matches."""
    def swap(tensors):
        s, z = f"{layer}.scales", f"{layer}.zeros"
        if s in tensors:
            tensors[s], tensors[z] = tensors[z].clone(), tensors[s].clone()
    edit_tensors(out, swap)


def poison_scales(out: Path, layer: str, value: float) -> None:
    """One non-finite ``value`` (NaN, inf) in a packed layer's scales; the manifest still matches."""
    def poison(tensors):
        if f"{layer}.scales" in tensors:
            tensors[f"{layer}.scales"].view(-1)[0] = value
    edit_tensors(out, poison)


def broken_source(src: Path, kind: str) -> None:
    """Break the source checkpoint folder ``src`` (a copy) in one way that a user or a bad download
    could: ``kind`` names it (see the cases below)."""
    config = src / "config.json"
    if kind == "quantization_config_list":
        edit_json(config, lambda d: d.update(quantization_config=[{"quant_method": "x"}]))
    elif kind == "layers_as_string":
        edit_json(config, lambda d: d.update(num_hidden_layers=str(d["num_hidden_layers"])))
    elif kind == "eps_nan":
        edit_json(config, lambda d: d.update(rms_norm_eps=float("nan")))
    elif kind == "nested_infinity":
        edit_json(config, lambda d: d.update(rope_scaling={"rope_type": "linear", "factor": float("inf")}))
    elif kind == "config_is_a_folder":
        config.unlink()
        config.mkdir()
    elif kind == "weights_file_is_a_folder":
        (src / "model.safetensors").mkdir()
    elif kind == "single_file_beside_shards":
        from safetensors.torch import load_file, save_file

        tensors = {}
        for shard in sorted(src.glob("model-*.safetensors")):
            tensors.update(load_file(shard))
        save_file({k: v * 2 for k, v in tensors.items()}, src / "model.safetensors")
    elif kind == "generation_config_not_json":
        (src / "generation_config.json").write_text('{"temperature": ')
    elif kind == "generation_config_invalid":
        edit_json(src / "generation_config.json", lambda d: d.update(max_new_tokens="many"))
    elif kind == "tokenizer_garbage":
        (src / "tokenizer.json").write_text('{"version": "1.0", "model": "no such model"}')
    elif kind == "metadata_not_strings":
        set_metadata(sorted(src.glob("*.safetensors"))[0], {"format": 1})
    else:
        raise ValueError(kind)


def set_metadata(shard: Path, metadata) -> None:
    """Write ``metadata`` (any JSON, even what the safetensors library refuses) as the shard's
    ``__metadata__``, keeping its tensors."""
    import struct

    blob = shard.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def claim_layers(src: Path, count: int) -> None:
    """A source whose config claims ``count`` decoder layers, whatever its weights hold."""
    edit_json(src / "config.json", lambda d: d.update(num_hidden_layers=count))


def zero_tensor_digest(out: Path) -> str:
    """Zero the digest the manifest records for one tensor (the files stay intact); returns its name."""
    zeroed = []

    def zero(manifest):
        for entry in manifest["files"]["outputs"].values():
            if isinstance(entry.get("tensors"), dict):
                name = sorted(entry["tensors"])[0]
                entry["tensors"][name] = "0" * 64
                zeroed.append(name)
                return
    edit_json(out / MANIFEST_NAME, zero)
    return zeroed[0]


def claim_in_config(out: Path, **fields) -> None:
    """``config.json`` of the packed output ``out`` claims other ``quantization_config`` fields (``bits``,
    ``group_size``...) or, with the prefix ``model_``, other model fields (``model_intermediate_size=512``) than its
    tensors hold; the manifest's digests are updated to match, as an attacker's would be."""
    def claim(config):
        for key, value in fields.items():
            if key.startswith("model_"):
                config[key.removeprefix("model_")] = value
            else:
                config["quantization_config"][key] = value
    edit_json(out / "config.json", claim)
    rehash(out)


def claim_in_manifest(out: Path, layer: str, **fields) -> None:
    """The manifest of ``out`` records other ``fields`` (``bits``, ``group_size``, ``shape``) for ``layer`` than
    its tensors and config hold."""
    def claim(manifest):
        entry = next(e for e in manifest["layers"] if e["name"] == layer)
        entry.update(fields)
    edit_json(out / MANIFEST_NAME, claim)
