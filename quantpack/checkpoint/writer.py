"""Writing a packed checkpoint's files: safetensors shards (:func:`write_safetensors` streams tensors to disk,
hashing as it writes: the file, and optionally each tensor's data for the manifest, under a temporary name that is
renamed when the file is complete), the shard index, JSON files and ``quantization_config``. docs/format.md is the
spec; :mod:`quantpack.checkpoint` reads and validates what this writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .reading import DTYPE_CODES, QUANT_METHOD, finite_or_none, sha256_bytes, weight_only_scheme
from ..format import LAYOUT_VERSION

_THREADED_DIGEST_BYTES = 1 << 20  # smaller tensors are hashed inline: a thread hand-off costs more


def shard_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (``index`` counts from 1), as transformers names shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      *, fsync: bool = True, digests: dict[str, str] | None = None) -> tuple[str, int]:
    """Write ``tensors`` as a safetensors file at ``path``, atomically (``<path>.tmp`` then rename).

    Tensors go largest-itemsize first (so every tensor's data is aligned to its element size) and by
    name, streaming each tensor's bytes straight from memory and hashing as they are written.
    Returns (sha256 hex digest, file size). The output is a pure function of the arguments.
    ``digests``: a dict to fill with name -> sha256 of each tensor's data bytes (what
    :func:`sha256_tensor_data` reads back), hashed from the same memory as it is written.
    """
    path = Path(path)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset = {}, 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header = {"__metadata__": dict(metadata), **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    # A tensor's own digest is computed on a second thread while the same bytes are written and
    # added to the file's hash (hashlib and file writes release the GIL), so it costs no extra time.
    digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qp-digest") if digests is not None else None
    try:
        with open(tmp, "wb") as f:
            for chunk in (struct.pack("<Q", len(raw)), raw):
                f.write(chunk)
                h.update(chunk)
            for name in order:
                t = tensors[name].detach().to("cpu").contiguous()
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
                pending = None
                if digester is not None and len(data) >= _THREADED_DIGEST_BYTES:
                    pending = digester.submit(sha256_bytes, data)
                elif digester is not None:
                    digests[name] = sha256_bytes(data)
                if len(data):
                    f.write(data)
                    h.update(data)
                if pending is not None:
                    digests[name] = pending.result()
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind (e.g. disk full)
        raise
    finally:
        if digester is not None:
            digester.shutdown(wait=True)
    os.replace(tmp, path)
    return h.hexdigest(), 8 + len(raw) + offset


def safetensors_size(shapes_dtypes: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata=None) -> int:
    """Exact size of the file :func:`write_safetensors` would write for these names/shapes/dtypes."""
    header, offset = {}, 0
    for name in sorted(shapes_dtypes, key=lambda n: (-shapes_dtypes[n][1].itemsize, n)):
        shape, dtype = shapes_dtypes[name]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header = {"__metadata__": dict(metadata), **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return 8 + len(raw) + (-len(raw) % 8) + offset


def write_json(path, obj) -> None:
    """Deterministic, human-readable, valid JSON (non-finite numbers as null) written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(finite_or_none(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def make_index(weight_map: dict[str, str], total_size: int) -> dict:
    return {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}


def make_quantization_config(*, bits: int, group_size: int | None, axis: int, method: str,
                             modules_not_converted, bits_overrides: dict[str, int], version: str,
                             scheme: str | None = None, quantized_experts=()) -> dict:
    """The ``config.json["quantization_config"]`` of a packed checkpoint (see docs/format.md).

    ``scheme`` is written only when it is not the weight-only default ``w<bits>a16`` (so weight-only
    checkpoints stay as they were before schemes existed)."""
    qc = {
        "quant_method": QUANT_METHOD,
        "layout_version": LAYOUT_VERSION,
        "bits": bits,
        "group_size": group_size,
        "axis": axis,
        "method": method,
        "modules_not_converted": sorted(modules_not_converted),
        "bits_overrides": dict(sorted(bits_overrides.items())),
        "quantpack_version": version,
    }
    if scheme is not None and scheme != weight_only_scheme(bits):
        qc["scheme"] = scheme
    if quantized_experts:  # mixture-of-experts blocks stored as one packed matrix per expert and projection
        qc["quantized_experts"] = sorted(quantized_experts)
    return qc
