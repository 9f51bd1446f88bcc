"""Checkpoint files: reading source checkpoints and packed ones, and validating them.

* Reading: :class:`SourceCheckpoint` opens a directory holding safetensors (one file, or shards
  with ``model.safetensors.index.json``) or, only when asked, PyTorch ``.bin`` files; it validates
  every header up front (truncation, LFS pointers, missing shards) and then reads one tensor at a
  time with plain positioned reads, so memory holds only the tensor asked for (no mmap pages of
  whole shards count against the process).
* Writing is :mod:`quantpack.checkpoint.writer`'s.
* Packed checkpoints: index validation (:func:`check_index`) and :class:`PackedCheckpoint` to get a layer back
  as a :class:`~quantpack.format.PackedWeight`. The JSON files (``config.json``, :func:`read_quantization_config`,
  the manifest ``quantpack.json``) are read by :mod:`quantpack.checkpoint.metadata`, without torch; its names are
  imported here.

docs/format.md is the written spec of everything here.
"""
from __future__ import annotations

import errno
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .metadata import (BIN_INDEX_NAME, BIN_SINGLE_NAME, CONFIG_NAME, MANIFEST_NAME, MANIFEST_VERSION,  # noqa: F401
                              QUANT_METHOD, SAFE_INDEX_NAME, SAFE_SINGLE_NAME, W8A8_CONFIG, WEIGHT_ONLY_SCHEMES,
                              CheckpointError, finite_or_none, read_config, read_manifest, read_quantization_config,
                              weight_only_scheme)
from ..format import LAYOUT_VERSION, PackedWeight, check_layout_args

SHARD_METADATA = {"format": "pt", "quantpack_layout_version": str(LAYOUT_VERSION)}
# Files that hold weights: never copied as "other files" of a source checkpoint.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_code] = getattr(torch, _attr)
DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path, chunk_size: int = 1 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def is_lfs_pointer(path) -> bool:
    """True for a git-LFS pointer file (what a clone without ``git lfs pull`` leaves in place of weights)."""
    path = Path(path)
    if path.stat().st_size > 1024:
        return False
    with open(path, "rb") as f:
        return f.read(len(LFS_POINTER_PREFIX)) == LFS_POINTER_PREFIX


def is_disk_full(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# ----------------------------------------------------------------------------------------------
# Reading safetensors


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from a file header (nothing read yet)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_safetensors_header(path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: returns ({name: TensorInfo}, ``__metadata__``).

    Raises :class:`CheckpointError` for an LFS pointer, a truncated or corrupt file, or an
    unknown dtype, naming the file.
    """
    path = Path(path)
    size = path.stat().st_size
    if is_lfs_pointer(path):
        raise CheckpointError(f"{path}: is a git-LFS pointer, not the weights; run `git lfs pull` in that "
                              f"repository or download it with huggingface_hub")
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes); download it again")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header; download the file again")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON); download the file again") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        # the safetensors library refuses such a file: so does quantpack, before anything reads it
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings); "
                              f"download the file again")
    data_start = 8 + header_len
    infos, spans = {}, []
    for name, entry in header.items():
        try:
            code, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not all(type(x) is int for x in (*shape, begin, stop)):  # (bools and floats are not offsets)
                raise TypeError
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}; download the file again") from None
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {code}, which quantpack cannot read")
        numel = 1
        for d in shape:
            numel *= d
        if begin < 0 or min(shape, default=0) < 0 or stop - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}] that do not match its "
                                  f"dtype {code} and shape {list(shape)}; the file is corrupt: download it again")
        infos[name] = TensorInfo(name, path, dtype, shape, data_start + begin, stop - begin)
        spans.append((begin, stop, name))
    # As safetensors itself requires: the tensors' data lie back to back, in offset order, with no
    # overlap and no gap, so no byte is read for two tensors or for none.
    end, last = 0, None
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = f"overlaps {last!r}" if begin < end else f"leaves a gap of {begin - end} bytes after " + (
                repr(last) if last else "the header")
            raise CheckpointError(f"{path}: tensor {name!r} (data_offsets [{begin}, {stop}]) {what}; the file is "
                                  f"corrupt or crafted: download it again")
        end, last = stop, name
    if data_start + end != size:
        what = "is truncated" if data_start + end > size else "has trailing bytes"
        raise CheckpointError(f"{path}: safetensors file {what} ({size} bytes, header says "
                              f"{data_start + end}); download the file again")
    return infos, metadata


def read_tensor(info: TensorInfo, handle=None) -> torch.Tensor:
    """Read one tensor from its file into a fresh CPU tensor (positioned read, no mmap)."""
    out = torch.empty(info.nbytes, dtype=torch.uint8, device="cpu")  # (also under a meta-device context)
    view = memoryview(out.numpy()) if info.nbytes else memoryview(b"")
    f = handle or open(info.file, "rb", buffering=0)
    try:
        f.seek(info.offset)
        got = 0
        while got < info.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{info.file}: ended early while reading {info.name!r}; the file is truncated")
            got += n
    finally:
        if handle is None:
            f.close()
    return out.view(info.dtype).reshape(info.shape)


class SourceCheckpoint:
    """The weights of a Hugging Face checkpoint directory, validated on open, read tensor by tensor.

    ``weight_files`` are the files holding weights (relative names); ``index_file`` the index if
    any; ``tensors`` maps tensor name -> :class:`TensorInfo` (safetensors) in file order.
    """

    def __init__(self, path, *, allow_pickle: bool = False):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"source: {self.path} is not a directory")
        self.allow_pickle = allow_pickle
        self.index_file: str | None = None
        self._bin_state: dict | None = None
        self._handles: dict[Path, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.format = self._find_weights()

    # -- discovery
    def _find_weights(self) -> str:
        p = self.path
        for name in (SAFE_SINGLE_NAME, SAFE_INDEX_NAME, BIN_SINGLE_NAME, BIN_INDEX_NAME, CONFIG_NAME):
            if (p / name).exists() and not (p / name).is_file():
                raise CheckpointError(f"source: {p / name} is a directory, not a file; download the checkpoint again")
        if (p / SAFE_INDEX_NAME).exists() and (p / SAFE_SINGLE_NAME).exists():
            # transformers reads the single file; converting the shards would pack other weights than it loads
            raise CheckpointError(f"source: {p} holds both {SAFE_SINGLE_NAME} and {SAFE_INDEX_NAME} (transformers "
                                  f"reads {SAFE_SINGLE_NAME}); remove the one that is not the model")
        if (p / SAFE_INDEX_NAME).exists():
            self.index_file = SAFE_INDEX_NAME
            self.weight_files = self._files_from_index(SAFE_INDEX_NAME)
            fmt = "safetensors"
        elif (p / SAFE_SINGLE_NAME).exists():
            self.weight_files = [SAFE_SINGLE_NAME]
            fmt = "safetensors"
        elif (p / BIN_INDEX_NAME).exists() or (p / BIN_SINGLE_NAME).exists():
            if not self.allow_pickle:
                raise CheckpointError(f"source: {p} has only PyTorch .bin weights, which load through pickle; pass "
                                      f"--allow-pickle (allow_pickle=True) if you trust it, or use a safetensors checkpoint")
            if (p / BIN_INDEX_NAME).exists():
                self.index_file = BIN_INDEX_NAME
                self.weight_files = self._files_from_index(BIN_INDEX_NAME)
            else:
                self.weight_files = [BIN_SINGLE_NAME]
            fmt = "bin"
        else:
            found = sorted(f.name for f in p.glob("*.safetensors"))
            hint = f" (found {', '.join(found[:3])} but no {SAFE_INDEX_NAME})" if found else ""
            raise CheckpointError(f"source: {p} is not a checkpoint: no {SAFE_SINGLE_NAME}, {SAFE_INDEX_NAME} "
                                  f"or {BIN_SINGLE_NAME}{hint}")
        if not (p / CONFIG_NAME).exists():
            raise CheckpointError(f"source: {p} has weights but no {CONFIG_NAME}; quantpack needs the model config")
        for name in [CONFIG_NAME, *([self.index_file] if self.index_file else []), *self.weight_files]:
            self._check_inside(name)
        for name in self.weight_files:
            f = p / name
            if is_lfs_pointer(f):
                raise CheckpointError(f"{f}: is a git-LFS pointer, not the weights; run `git lfs pull` in that "
                                      f"repository or download it with huggingface_hub")
        if fmt == "safetensors":
            for name in self.weight_files:
                infos, _ = read_safetensors_header(p / name)
                for tname, info in sorted(infos.items(), key=lambda kv: kv[1].offset):
                    if tname in self.tensors:
                        raise CheckpointError(f"source: tensor {tname!r} appears in both {self.tensors[tname].file.name} "
                                              f"and {name}; the checkpoint is inconsistent")
                    self.tensors[tname] = info
            if self.index_file:
                self._check_index_matches()
        else:
            self._load_bin()
        return fmt

    def _files_from_index(self, index_name: str) -> list[str]:
        index_path = self.path / index_name
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{index_path}: not a valid index (needs a \"weight_map\" object)") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
                raise CheckpointError(f"{index_path}: names shard {f!r}, which is not a file name inside {self.path}; "
                                      f"the index is corrupt or crafted: download it again")
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: names shard {missing[0]} which is missing from {self.path}; "
                                  f"download it again" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        self._index_map = weight_map
        return files

    def _check_inside(self, rel: str) -> None:
        """``rel`` (a file of this checkpoint) must not lead outside its folder through a link; in the
        Hugging Face cache a snapshot's files are links into the repository's ``blobs`` folder."""
        roots = [self.path.resolve()]
        if self.path.parent.name == "snapshots":
            roots.append((self.path.parent.parent / "blobs").resolve())
        real = (self.path / rel).resolve()
        if not any(real.is_relative_to(root) for root in roots):
            raise CheckpointError(f"{self.path / rel}: leads to {real}, outside the checkpoint folder {self.path}; "
                                  f"copy the file into the folder if you trust it")

    def _check_index_matches(self) -> None:
        for tname, fname in self._index_map.items():
            info = self.tensors.get(tname)
            if info is None or info.file.name != Path(fname).name:
                raise CheckpointError(f"{self.path / self.index_file}: says {tname!r} is in {fname}, but it is not; "
                                      f"the index does not match the shards")

    def _load_bin(self) -> None:
        # weights_only=True refuses arbitrary pickled objects; mmap keeps the tensors on disk until read.
        state = {}
        for name in self.weight_files:
            try:
                part = torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types for a bad pickle
                raise CheckpointError(f"{self.path / name}: cannot be loaded with weights_only=True "
                                      f"({type(e).__name__}); use a safetensors checkpoint") from None
            if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                raise CheckpointError(f"{self.path / name}: is not a state dict of tensors")
            for tname, t in part.items():
                state[tname] = t
                self.tensors[tname] = TensorInfo(tname, self.path / name, t.dtype, tuple(t.shape), 0,
                                                 t.numel() * t.element_size())
        self._bin_state = state

    # -- access
    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor."""
        if self._bin_state is not None:
            return self._bin_state[name].clone()
        info = self.tensors[name]
        return read_tensor(info, self._handle(info.file))

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """``name[index]`` (along its first dimension) as a fresh CPU tensor, reading only those bytes."""
        if self._bin_state is not None:
            return self._bin_state[name][index].clone()
        info = self.tensors[name]
        row = info.nbytes // info.shape[0]
        part = TensorInfo(name, info.file, info.dtype, tuple(info.shape[1:]), info.offset + index * row, row)
        return read_tensor(part, self._handle(info.file))

    def _handle(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = open(file, "rb", buffering=0)
        return handle

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._bin_state = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    def config(self) -> dict:
        return read_config(self.path)

    def other_files(self) -> list[str]:
        """Relative paths of every file to copy as-is to a converted checkpoint: everything but the
        weights, their index, config.json, weight-like files and hidden files."""
        skip = set(self.weight_files) | {CONFIG_NAME, SAFE_INDEX_NAME, BIN_INDEX_NAME, MANIFEST_NAME}
        out = []
        for f in sorted(self.path.rglob("*")):
            rel = f.relative_to(self.path).as_posix()
            if not f.is_file() or rel in skip or any(part.startswith(".") for part in Path(rel).parts):
                continue
            if f.name.endswith(WEIGHT_SUFFIXES) or f.name.endswith(".index.json"):
                continue
            self._check_inside(rel)  # copied into the output: never a file from elsewhere
            out.append(rel)
        for rel in out:
            check_small_file(self.path, rel)
        return out


def check_small_file(root: Path, rel: str) -> None:
    """Refuse (one line naming it) a file to copy that transformers could not read as it reads it:
    JSON that does not parse, a generation config it rejects, a tokenizer.json tokenizers rejects."""
    f = Path(root) / rel
    name = Path(rel).name
    if not name.endswith(".json"):
        return
    try:
        if name == "tokenizer.json":
            from tokenizers import Tokenizer

            Tokenizer.from_file(str(f))
            return
        json.loads(f.read_text(encoding="utf-8"))
        if rel == "generation_config.json":
            from transformers import GenerationConfig

            GenerationConfig.from_pretrained(root)
    except Exception as e:  # each reader raises its own kinds; all mean the same: unreadable
        first = " ".join(str(e).split())[:160] or type(e).__name__
        raise CheckpointError(f"source: {f} cannot be read as transformers reads it ({first}); fix or remove "
                              f"it, or download it again") from None


# ----------------------------------------------------------------------------------------------
# Hashing tensor data


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of(tensor: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes as stored (what :func:`write_safetensors` records per tensor)."""
    flat = tensor.reshape(-1)
    return sha256_bytes(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def sha256_tensor_data(info: TensorInfo, handle=None, chunk_size: int = 1 << 20) -> str:
    """sha256 of one tensor's data bytes as stored in its file (positioned reads, ``chunk_size`` at
    a time): what :func:`write_safetensors` records in ``digests``."""
    h = hashlib.sha256()
    buf = bytearray(min(chunk_size, max(info.nbytes, 1)))
    view = memoryview(buf)
    f = handle or open(info.file, "rb", buffering=0)
    try:
        f.seek(info.offset)
        left = info.nbytes
        while left:
            n = f.readinto(view[:min(left, len(buf))])
            if not n:
                raise CheckpointError(f"{info.file}: ended early while reading {info.name!r}; the file is truncated")
            h.update(view[:n])
            left -= n
    finally:
        if handle is None:
            f.close()
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Packed checkpoints


def check_index(path) -> dict[str, TensorInfo]:
    """Validate a packed (or any safetensors) checkpoint's index against its shards: every shard
    exists and parses, every indexed tensor is in the shard the index names, no shard has tensors
    the index lacks, and each shard's ``__metadata__`` says ``format: pt``. Returns name -> info."""
    path = Path(path)
    src = SourceCheckpoint(path)  # validates headers, missing shards and index-vs-shard agreement
    src.close()
    if src.index_file:
        indexed = set(src._index_map)
        extra = sorted(set(src.tensors) - indexed)
        if extra:
            raise CheckpointError(f"{path / src.index_file}: shard tensor {extra[0]!r} is missing from the index")
    for name in src.weight_files:
        _, meta = read_safetensors_header(path / name)
        if meta.get("format") != "pt":
            raise CheckpointError(f"{path / name}: __metadata__ lacks format=pt")
    return src.tensors


class PackedCheckpoint:
    """A packed checkpoint directory: config, quantization_config, and lazy access to its tensors.

    ``layer(name)`` returns the :class:`~quantpack.format.PackedWeight` (and bias) of a quantized
    linear module, validated against the declared bits / group size / axis.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.source = SourceCheckpoint(self.path)
        self.config = self.source.config()
        self.quantization_config = read_quantization_config(self.config)
        self.quantized_modules = sorted(n[: -len(".qweight")] for n in self.source.tensors if n.endswith(".qweight"))

    def bits_for(self, module: str) -> int:
        return self.quantization_config["bits_overrides"].get(module, self.quantization_config["bits"])

    def layer(self, module: str, device=None) -> tuple[PackedWeight, torch.Tensor | None]:
        qc = self.quantization_config
        if qc["scheme"] not in WEIGHT_ONLY_SCHEMES:
            raise CheckpointError(f"{self.path}: scheme {qc['scheme']!r} does not store PackedWeights"
                                  + ("; use w8a8_layer()" if qc["scheme"] == "w8a8" else ""))
        try:
            qweight = self.source.get(module + ".qweight")
            scales = self.source.get(module + ".scales")
            zeros = self.source.get(module + ".zeros")
        except KeyError as e:
            raise CheckpointError(f"{self.path}: quantized module {module!r} lacks tensor {e.args[0]!r}") from None
        bias = self.source.get(module + ".bias") if module + ".bias" in self.source.tensors else None
        bits, axis = self.bits_for(module), qc["axis"]
        k = qweight.shape[0] * (2 if bits == 4 else 1)
        n = qweight.shape[1]
        group_size = qc["group_size"] or (k if axis == 1 else n)
        shape = (n, k)
        try:
            check_layout_args(shape, bits, group_size, axis)
            pw = PackedWeight(qweight, scales, zeros, bits, group_size, axis, shape)
            pw.validate()
        except ValueError as e:
            raise CheckpointError(f"{self.path}: module {module!r}: {e}") from None
        if device is not None:
            pw = pw.to(device)
            bias = bias.to(device) if bias is not None else None
        return pw, bias

    def w8a8_layer(self, module: str, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight int8 (N, K), weight_scale float32 (N,), bias or None)`` of a module of a ``w8a8``
        checkpoint, validated (shapes, dtypes, codes in [-127, 127])."""
        if self.quantization_config["scheme"] != "w8a8":
            raise CheckpointError(f"{self.path}: scheme {self.quantization_config['scheme']!r} is not 'w8a8'; use layer()")
        try:
            qweight = self.source.get(module + ".qweight")
            weight_scale = self.source.get(module + ".weight_scale")
        except KeyError as e:
            raise CheckpointError(f"{self.path}: quantized module {module!r} lacks tensor {e.args[0]!r}") from None
        bias = self.source.get(module + ".bias") if module + ".bias" in self.source.tensors else None
        problem = None
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            problem = f"qweight: dtype {dtype_name(qweight.dtype)}, shape {list(qweight.shape)}; expected a 2-D int8 tensor"
        elif weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (qweight.shape[0],):
            problem = (f"weight_scale: dtype {dtype_name(weight_scale.dtype)}, shape {list(weight_scale.shape)}; "
                       f"expected float32 [{qweight.shape[0]}]")
        elif bias is not None and tuple(bias.shape) != (qweight.shape[0],):
            problem = f"bias: shape {list(bias.shape)}; expected [{qweight.shape[0]}]"
        elif qweight.numel() and int(qweight.min()) < -127:
            problem = "qweight: holds -128; W8A8 codes lie in [-127, 127]"
        if problem:
            raise CheckpointError(f"{self.path}: module {module!r}: {problem}")
        if device is not None:
            qweight, weight_scale = qweight.to(device), weight_scale.to(device)
            bias = bias.to(device) if bias is not None else None
        return qweight, weight_scale, bias

    def close(self) -> None:
        self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_manifest_files(path) -> list[str]:
    """Re-hash every output file listed in the manifest; return the relative paths that differ or
    are missing (empty list: all match)."""
    path = Path(path)
    bad = []
    for rel, entry in read_manifest(path)["files"]["outputs"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != entry["size"] or sha256_file(f) != entry["sha256"]:
            bad.append(rel)
    return bad
