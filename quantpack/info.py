"""``info()``: what a packed checkpoint is, from its manifest and config, without loading or verifying it. It reads
JSON only, so nothing it imports imports torch (``quantpack info`` starts as fast as ``--help``)."""
from __future__ import annotations

import json

from .checkpoint import metadata
from .checkpoint.metadata import BUILT_IN_SCHEMES, CheckpointError, read_quantization_config
from .sizes import format_size


def _fail(message: str) -> CheckpointError:
    return CheckpointError(" ".join(str(message).split()))


def info(packed, *, revision: str | None = None, token: str | None = None) -> dict:
    """A summary of the packed checkpoint ``packed`` (directory or hub repo id), read from ``quantpack.json``
    and ``config.json`` only (no tensor data, no checksums: ``quantpack verify`` checks those).

    Keys: ``path``, ``quantpack_version``, ``layout_version``, ``scheme``, ``bits``, ``group_size``,
    ``axis``, ``method``, ``dtype``, ``bits_overrides``, ``source`` (``repo``, ``revision``,
    ``local``), ``architecture``, ``model_layers`` (``num_hidden_layers``), ``quantized_layers``,
    ``skipped_layers`` (``name``, ``reason``), ``size_bytes`` (the weight shards, as convert's summary counts them),
    ``source_bytes``. Nothing is checked (``quantpack verify`` does that; its results are not stored).
    Raises :class:`~quantpack.checkpoint.CheckpointError` (one line) when ``packed`` is not a packed
    checkpoint.
    """
    from .checkpoint.hub import resolve_checkpoint

    try:
        root = resolve_checkpoint(packed, revision=revision, token=token)
    except CheckpointError as e:
        raise _fail("packed" + str(e).removeprefix("path_or_repo_id")) from None
    manifest = metadata.read_manifest(root)
    if not isinstance(manifest, dict):
        raise _fail(f"{root / metadata.MANIFEST_NAME}: not a quantpack manifest (a JSON object); re-convert")
    try:
        config = json.loads((root / metadata.CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise _fail(f"{root}: no config.json; not a packed checkpoint directory") from None
    except ValueError:
        raise _fail(f"{root / metadata.CONFIG_NAME}: not valid JSON") from None
    if not isinstance(config, dict):
        raise _fail(f"{root / metadata.CONFIG_NAME}: not a JSON object; not a packed checkpoint")
    qc = read_quantization_config(config)
    if qc["scheme"] not in BUILT_IN_SCHEMES:  # one registered later: only the registry (which imports torch) knows it
        from .schemes import get

        get(qc["scheme"])
    settings = manifest.get("settings") or {}
    source = manifest.get("source") or {}
    outputs = (manifest.get("files") or {}).get("outputs") or {}
    totals = manifest.get("totals") or {}
    size = totals.get("output_bytes")  # the shards, as convert's summary and the model card count them
    if not isinstance(size, int):
        size = sum((root / rel).stat().st_size for rel in outputs
                   if rel.endswith(".safetensors") and (root / rel).is_file())
    return {
        "path": str(root),
        "quantpack_version": manifest.get("quantpack_version"),
        "layout_version": qc["layout_version"],
        "scheme": qc["scheme"],
        "bits": qc["bits"],
        "group_size": qc["group_size"],
        "axis": qc["axis"],
        "method": qc.get("method") or settings.get("method"),
        "dtype": settings.get("dtype"),
        "bits_overrides": qc["bits_overrides"],
        "source": {"repo": source.get("repo"), "revision": source.get("revision"), "local": source.get("local")},
        "architecture": (config.get("architectures") or [None])[0],
        "model_layers": config.get("num_hidden_layers"),
        "quantized_layers": len(manifest.get("layers") or []),
        "skipped_layers": [{"name": s.get("name"), "reason": s.get("reason")} for s in manifest.get("skipped") or []],
        "size_bytes": size,
        "source_bytes": totals.get("source_bytes"),
    }


def _size(n: int | None) -> str:
    return "unknown" if n is None else format_size(n)


def format_info(doc: dict) -> str:
    """The human-readable form ``quantpack info`` prints."""
    src = doc["source"]
    source = (src["repo"] or "not recorded") + (f" @ {src['revision']}" if src.get("revision") else "")
    group = "per-channel" if doc["group_size"] is None else str(doc["group_size"])
    overrides = ", ".join(f"{k}={v}" for k, v in sorted(doc["bits_overrides"].items()))
    lines = [
        f"path            {doc['path']}",
        f"scheme          {doc['scheme']}, {doc['bits']}-bit, group size {group}, axis {doc['axis']}, "
        f"method {doc['method'] or '-'}, dtype {doc['dtype'] or '-'}",
    ]
    if overrides:
        lines.append(f"bits overrides  {overrides}")
    lines += [
        f"source          {source}",
        f"model           {doc['architecture'] or 'unknown'}, {doc['model_layers'] or '?'} layers",
        f"quantized       {doc['quantized_layers']} linear layers",
        f"skipped         {len(doc['skipped_layers'])}",
    ]
    lines += [f"  {s['name']}: {s['reason']}" for s in doc["skipped_layers"]]
    ratio = f" (the source's weights: {_size(doc['source_bytes'])})" if doc["source_bytes"] else ""
    lines.append(f"size            {_size(doc['size_bytes'])}{ratio}")
    lines.append(f"layout          version {doc['layout_version']}, written by quantpack {doc['quantpack_version']}")
    lines.append(f"checked         nothing (info reads JSON only): `quantpack verify {doc['path']}` checks it")
    return "\n".join(lines)
