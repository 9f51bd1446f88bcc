"""A packed checkpoint's integrity: its files against its config, shard index and manifest, and every tensor against
the model the config describes. One check for every reader, so that every folder gets one verdict:
:func:`quantpack.load` and the transformers quantizer (:mod:`quantpack.integrations.transformers`) refuse the first
problem as a one-line :class:`~quantpack.checkpoint.CheckpointError`; ``quantpack verify`` reports them all.

* :func:`check_files`: config.json, ``quantization_config``, the manifest (layout version, sizes, the sha256 of
  each file that has no per-tensor digests), the index against the shard headers. No tensor data is read.
* :func:`build_model`: the model the config describes on the meta device, quantized layers swapped in.
* :func:`check_model`: every stored tensor against that model (names, shapes, dtypes) and the manifest's layers.
* :func:`read_checked`: each tensor's data, checked against its recorded sha256 and for NaN or infinity as it is
  read, so that a verified load reads every byte once.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from . import reading
from .reading import CheckpointError, TensorInfo
from ..format import LAYOUT_VERSION

# Kinds of problems, in the order they are reported (the first is the one a loader raises, and verify's error line).
# A stored tensor the model lacks comes before the model's tensors it leaves missing: it names what was stored.
PROBLEM_KINDS = ("layout", "config", "manifest", "missing_file", "checksum", "index", "unexpected_tensor",
                 "missing_tensor", "shape", "dtype", "values")
SCALE_SUFFIXES = (".scales", ".zeros", ".weight_scale")


@dataclass
class Problem:
    """Something wrong in the files: which file and (when it could be found) which tensor."""

    kind: str  # one of PROBLEM_KINDS
    message: str
    file: str | None = None
    tensor: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "file": self.file, "tensor": self.tensor, "message": self.message}


def fail(message: str) -> CheckpointError:
    """A :class:`CheckpointError` whose message is ``message`` on one line."""
    return CheckpointError(" ".join(str(message).split()))


def refuse(problems: list[Problem]) -> None:
    """Raise the first of ``problems`` (in :data:`PROBLEM_KINDS` order) as a one-line CheckpointError."""
    if problems:
        raise fail(min(problems, key=lambda p: PROBLEM_KINDS.index(p.kind)).message)


@dataclass
class Checked:
    """What the checks found: the problems, and what a reader needs next (the headers' tensors, the model)."""

    root: Path
    verify: bool
    problems: list[Problem] = field(default_factory=list)
    config: dict | None = None
    qc: dict | None = None
    manifest: dict | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # per-tensor sha256s still to compare with the data
    missing_files: set[str] = field(default_factory=set)
    changed_files: list[str] = field(default_factory=list)  # whole-file sha256 differs (no per-tensor digests)
    held_by_missing: set[str] = field(default_factory=set)  # tensors the index places in a missing file
    files_checked: int = 0
    model: nn.Module | None = None
    expected: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: set[str] = field(default_factory=set)  # names filled from another tensor (tied weights, aliases)
    quantized: set[str] = field(default_factory=set)
    _file_intact: dict[str, bool] = field(default_factory=dict)

    @property
    def outputs(self) -> dict:
        return ((self.manifest or {}).get("files") or {}).get("outputs") or {}

    def add(self, kind: str, message: str, file: str | None = None, tensor: str | None = None) -> None:
        self.problems.append(Problem(kind, " ".join(str(message).split()), file=file, tensor=tensor))

    def sort(self) -> None:
        self.problems.sort(key=lambda p: PROBLEM_KINDS.index(p.kind))  # stable: file order within a kind


def check_checkpoint(root, *, verify: bool = True, trust_remote_code: bool = False,
                     dtype: torch.dtype | None = None) -> Checked:
    """Every check short of reading tensor data (:func:`check_files`, :func:`build_model`, :func:`check_model`).
    ``verify``: also against the manifest (checksums, the recorded layers); shapes and dtypes are always checked."""
    checked = check_files(root, verify=verify)
    if checked.qc is not None:
        build_model(checked, dtype=dtype, trust_remote_code=trust_remote_code)
    if checked.model is not None:
        check_model(checked)
    checked.sort()
    return checked


# ----------------------------------------------------------------------------------------------
# Files


def check_files(root, *, verify: bool = True) -> Checked:
    """config.json and its quantization_config, the manifest (``verify``), the index and the shard headers."""
    from ..schemes import read_quantization_config

    checked = Checked(Path(root), verify)
    root = checked.root
    if not (root / reading.CONFIG_NAME).is_file():
        checked.add("config", f"{root}: no config.json; not a packed checkpoint directory", file=reading.CONFIG_NAME)
        return checked
    try:
        checked.config = reading.read_config(root)
        checked.qc = read_quantization_config(checked.config)
    except CheckpointError as e:
        checked.add("layout" if "layout_version" in str(e) else "config", str(e), file=reading.CONFIG_NAME)
    if verify:
        _check_manifest(checked)
    shard_files, weight_map = _shard_files(checked)
    _check_outputs(checked, shard_files)
    _check_shards(checked, shard_files, weight_map)
    checked.sort()
    return checked


def _check_manifest(checked: Checked) -> None:
    try:
        manifest = reading.read_manifest(checked.root)
    except CheckpointError as e:
        checked.add("manifest", str(e), file=reading.MANIFEST_NAME)
        return
    if not isinstance(manifest, dict):
        checked.add("manifest", f"{checked.root / reading.MANIFEST_NAME}: not a quantpack manifest (a JSON "
                                f"object); download it again or re-convert", file=reading.MANIFEST_NAME)
        return
    checked.manifest = manifest
    if manifest.get("layout_version") != LAYOUT_VERSION:
        checked.add("layout", f"{reading.MANIFEST_NAME}: layout_version={manifest.get('layout_version')!r}; this "
                              f"quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert",
                    file=reading.MANIFEST_NAME)


def _shard_files(checked: Checked) -> tuple[list[str], dict[str, str] | None]:
    """Shard file names and the index's weight map (None without an index)."""
    root = checked.root
    index = root / reading.SAFE_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            checked.add("index", f"file {index.name}: not a valid index (needs a \"weight_map\" object of file "
                                 f"names); download it again", file=index.name)
            return [], None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not f or Path(f).is_absolute() or ".." in Path(f).parts:
                checked.add("index", f"file {index.name}: names shard {f!r}, which is not a file name inside {root}; "
                                     f"the index is corrupt or crafted: download it again", file=index.name)
                return [], None
        return files, weight_map
    if (root / reading.SAFE_SINGLE_NAME).is_file():
        return [reading.SAFE_SINGLE_NAME], None
    checked.add("index", f"{root}: no {reading.SAFE_INDEX_NAME} or {reading.SAFE_SINGLE_NAME}; not a packed "
                         f"checkpoint directory", file=reading.SAFE_INDEX_NAME)
    return [], None


def _check_outputs(checked: Checked, shard_files: list[str]) -> None:
    """Every file the manifest lists: present and, unless the manifest records per-tensor digests for it (whose
    data :func:`read_checked` compares as it reads), of its size and sha256."""
    if checked.manifest is None:
        return
    outputs = checked.outputs
    for rel, entry in sorted(outputs.items()):
        f = checked.root / rel
        if not f.is_file():
            checked.missing_files.add(rel)
            continue
        checked.files_checked += 1
        if not isinstance(entry, dict):
            checked.add("manifest", f"{reading.MANIFEST_NAME}: the entry of {rel} is not an object; download the "
                                    f"checkpoint again", file=reading.MANIFEST_NAME)
        elif isinstance(entry.get("tensors"), dict):
            continue  # a shard with per-tensor digests: its header and every data byte are checked finer below
        elif f.stat().st_size != entry.get("size"):
            checked.add("checksum", f"file {rel}: {f.stat().st_size} bytes, {reading.MANIFEST_NAME} says "
                                    f"{entry.get('size')}; the file is truncated or modified: download it again",
                        file=rel)
        elif reading.sha256_file(f) != entry.get("sha256"):
            checked.changed_files.append(rel)
            checked.add("checksum", f"file {rel}: sha256 differs from {reading.MANIFEST_NAME}; the file is corrupt "
                                    f"or modified, download it again", file=rel)
    for name in shard_files:
        if name not in outputs and (checked.root / name).is_file():
            checked.add("manifest", f"file {name}: a shard that {reading.MANIFEST_NAME} does not list; the "
                                    f"checkpoint was modified after conversion", file=name)


def _check_shards(checked: Checked, shard_files: list[str], weight_map: dict[str, str] | None) -> None:
    """Each shard: present, parseable, its metadata what convert writes; the index against the headers; with
    per-tensor digests, the file's tensors are the ones the manifest records."""
    in_file: dict[str, list[str]] = {}
    for name, shard in (weight_map or {}).items():
        in_file.setdefault(shard, []).append(name)
    tensors = checked.tensors
    for fname in shard_files:
        f = checked.root / fname
        if not f.is_file():
            checked.missing_files.add(fname)
            continue
        try:
            infos, meta = reading.read_safetensors_header(f)
        except CheckpointError as e:
            checked.add("checksum", f"file {fname}: {str(e).removeprefix(str(f) + ': ')}", file=fname)
            continue
        version = meta.get("quantpack_layout_version")
        if version is not None and version != str(LAYOUT_VERSION):
            checked.add("layout", f"file {fname}: quantpack_layout_version={version!r} in its metadata; this quantpack "
                                  f"reads layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert", file=fname)
        elif meta.get("format") != "pt":
            checked.add("index", f"file {fname}: its __metadata__ lacks format=pt; not a shard quantpack wrote: "
                                 f"download it again", file=fname)
        for tname, info in infos.items():
            if tname in tensors:
                checked.add("index", f"tensor {tname}: stored in both {tensors[tname].file.name} and {fname}",
                            file=fname, tensor=tname)
            tensors[tname] = info
            if weight_map is not None and tname not in weight_map:
                checked.add("index", f"tensor {tname} in {fname}: missing from {reading.SAFE_INDEX_NAME}",
                            file=fname, tensor=tname)
        entry = checked.outputs.get(fname)
        recorded = entry.get("tensors") if isinstance(entry, dict) else None
        if isinstance(recorded, dict):
            # The digests cover every data byte; the header's names, shapes and dtypes are checked against the
            # model, and its metadata must be what convert wrote: a changed header is caught without hashing
            # the whole file.
            if meta != reading.SHARD_METADATA and meta.get("format") == "pt" and version in (None, str(LAYOUT_VERSION)):
                wrote = json.dumps(reading.SHARD_METADATA, sort_keys=True)
                checked.add("checksum", f"file {fname}: its header's metadata {json.dumps(meta, sort_keys=True)} is "
                                        f"not what quantpack wrote ({wrote}); the file was modified: download it again",
                            file=fname)
            for tname in sorted(set(infos) ^ set(recorded)):
                where = "is in the file but not" if tname in infos else "is missing from the file but listed"
                checked.add("checksum", f"tensor {tname} in {fname}: {where} in {reading.MANIFEST_NAME}; the file is "
                                        f"corrupt or modified: download it again", file=fname, tensor=tname)
            checked.digests.update({t: d for t, d in recorded.items() if t in infos})
    for fname in sorted(checked.missing_files):
        held = sorted(in_file.get(fname, []))
        checked.held_by_missing.update(held)
        what = f" (it holds {len(held)} tensors: {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})" if held else ""
        checked.add("missing_file", f"file {fname}: missing{what}; download it again", file=fname,
                    tensor=held[0] if held else None)
    for tname, shard in sorted((weight_map or {}).items()):
        info = tensors.get(tname)
        if shard not in checked.missing_files and (info is None or info.file.name != shard):
            checked.add("index", f"tensor {tname}: {reading.SAFE_INDEX_NAME} says it is in {shard}, but it is not; "
                                 f"the index does not match the shards", file=shard, tensor=tname)


# ----------------------------------------------------------------------------------------------
# The model the config describes


def expected_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(persistent parameters and buffers by state-dict name with each shared tensor once, the other names
    of shared tensors)."""
    seen, out, aliases = set(), {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
        else:
            seen.add(id(t))
            out[name] = t
    return out, aliases


def default_dtype(tensors: dict[str, TensorInfo]) -> torch.dtype:
    """The dtype a loader builds a checkpoint's model in: the most common stored floating-point dtype outside
    the quantized layers' scales (float32 if none)."""
    stored = [i.dtype for n, i in tensors.items() if i.dtype.is_floating_point and not n.endswith(SCALE_SUFFIXES)]
    return max(set(stored), key=stored.count) if stored else torch.float32


def build_model(checked: Checked, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> None:
    """``checked.model``: the model ``config.json`` describes (in ``dtype``, default :func:`default_dtype`) on the
    meta device, its converted layers swapped for the scheme's modules; a config that cannot be built is a problem."""
    from accelerate import init_empty_weights

    from ..hf_config import auto_config, model_class
    from ..modules.replace import linear_modules_to_convert, replace_linear_layers

    tensors, qc = checked.tensors, checked.qc
    build_dtype = dtype or default_dtype(tensors)
    try:
        config = auto_config(checked.root, trust_remote_code=trust_remote_code, config=checked.config)
        plain = copy.deepcopy(config)
        if hasattr(plain, "quantization_config"):
            del plain.quantization_config
        with init_empty_weights(include_buffers=False):
            model = model_class(config, trust_remote_code=trust_remote_code)._from_config(plain, dtype=build_dtype)

        def compute_dtype(module: str) -> torch.dtype:
            # Quantized layers keep the scales/zeros (and bias) dtype they were quantized with (W8A8 layers,
            # whose scales are always float32, the dtype of their bias).
            info = tensors.get(module + ".scales") or tensors.get(module + ".bias")
            return info.dtype if info is not None and info.dtype.is_floating_point else build_dtype

        names = linear_modules_to_convert(model, qc)
        replace_linear_layers(model, qc, names, compute_dtype)
    except CheckpointError as e:
        checked.add("config", str(e), file=reading.CONFIG_NAME)
        return
    except Exception as e:  # transformers raises many kinds for a config it cannot build
        checked.add("config", f"file config.json: transformers cannot build the model it describes "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})", file=reading.CONFIG_NAME)
        return
    use_model(checked, model, names)


def use_model(checked: Checked, model: nn.Module, converted: list[str]) -> None:
    """Check against ``model`` (its layers ``converted`` already swapped), one built elsewhere (transformers')."""
    from ..modules.experts import ExpertMatrix
    from ..modules.linear import QuantLinear
    from ..modules.replace import tied_targets

    checked.model = model
    checked.expected, aliases = expected_tensors(model)
    checked.tied = aliases | tied_targets(model)
    checked.quantized = set(converted) | {n for n, m in model.named_modules()
                                          if isinstance(m, (QuantLinear, ExpertMatrix))}


def check_model(checked: Checked) -> None:
    """Every stored tensor is one of the model's with its shape and dtype, every tensor of the model is stored,
    and (``verify``) each layer the manifest lists is stored quantized with the bits and shape it records."""
    from .. import schemes

    model, expected, tensors, qc = checked.model, checked.expected, checked.tensors, checked.qc
    out_dtype = ((checked.manifest or {}).get("settings") or {}).get("dtype")
    fixed_dtypes = {f"{name}.{key}": dt for name, module in model.named_modules()
                    if (check := schemes.module_check(module)) is not None for key, dt in check.stored_dtypes.items()}
    for name, info in sorted(tensors.items()):
        where = f"tensor {name} in {info.file.name}"
        module = name.rpartition(".")[0]
        want = expected.get(name)
        if want is None:
            if name in checked.tied:
                continue  # a second copy of a tied weight
            if module in checked.quantized:
                stores = sorted(k.rpartition(".")[2] for k in expected if k.rpartition(".")[0] == module)
                hint = f"; {module} is quantized, which stores {stores}"
            elif name.endswith((".qweight", ".scales", ".zeros")) and module in qc["modules_not_converted"]:
                hint = f"; config.json's quantization_config lists {module} in modules_not_converted"
            else:
                hint = ""
            checked.add("unexpected_tensor", f"{where}: not a tensor of {type(model).__name__}{hint}",
                        file=info.file.name, tensor=name)
            continue
        if tuple(info.shape) != tuple(want.shape):
            checked.add("shape", f"{where}: shape {list(info.shape)}, expected {list(want.shape)} from config.json and "
                                 f"quantization_config", file=info.file.name, tensor=name)
        stored = reading.dtype_name(info.dtype)
        if name in fixed_dtypes:
            wanted = None if info.dtype == fixed_dtypes[name] else reading.dtype_name(fixed_dtypes[name])
        elif not want.is_floating_point():
            wanted = None if info.dtype == want.dtype else reading.dtype_name(want.dtype)
        elif not info.dtype.is_floating_point:
            wanted = "a floating-point dtype"
        else:
            wanted = None if out_dtype in (None, stored) else f"{out_dtype}, the dtype {reading.MANIFEST_NAME} records"
        if wanted is not None:
            checked.add("dtype", f"{where}: dtype {stored}, expected {wanted}", file=info.file.name, tensor=name)
    missing = [n for n in expected if n not in tensors and n not in checked.tied and n not in checked.held_by_missing]
    for n in missing:
        module = n.rpartition(".")[0]
        hint = ""
        if module in checked.quantized and module + ".weight" in tensors:
            hint = f"; the file stores {module}.weight, so add {module} to quantization_config.modules_not_converted"
        checked.add("missing_tensor", f"tensor {n}: missing from the checkpoint{hint}", tensor=n)
    misshapen = {p.tensor for p in checked.problems if p.kind == "shape"}
    for layer in (checked.manifest or {}).get("layers") or []:
        _check_manifest_layer(checked, layer, misshapen)


def _check_manifest_layer(checked: Checked, layer, misshapen: set[str]) -> None:
    """One layer the manifest lists: stored quantized, with the bits, group size and shape it records (a ``qweight``
    in ``misshapen``, the wrong shape for the config already, is named as that)."""
    qc, tensors = checked.qc, checked.tensors
    name = layer.get("name") if isinstance(layer, dict) else None
    if not isinstance(name, str):
        checked.add("manifest", f"{reading.MANIFEST_NAME}: a layers entry without a name ({layer!r:.80}); download "
                                f"the checkpoint again", file=reading.MANIFEST_NAME)
        return
    qweight = tensors.get(name + ".qweight")
    if qweight is None:
        if name + ".qweight" not in checked.held_by_missing:
            checked.add("missing_tensor", f"tensor {name}.qweight: missing, but {reading.MANIFEST_NAME} lists "
                                          f"{name} as quantized", tensor=name + ".qweight")
        return
    bits = qc["bits_overrides"].get(name, qc["bits"])
    if "bits" in layer and layer["bits"] != bits:
        checked.add("manifest", f"module {name}: {reading.MANIFEST_NAME} says bits={layer['bits']} but "
                                f"quantization_config gives bits={bits}", file=reading.MANIFEST_NAME, tensor=name)
    shape = layer.get("shape")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(isinstance(d, int) for d in shape)):
        return
    n, k = shape
    # W8A8 keeps nn.Linear's (N, K); the weight-only layouts store (K/2, N) or (K, N).
    want = (n, k) if qc["scheme"] == "w8a8" else (k // 2, n) if bits == 4 else (k, n)
    if tuple(qweight.shape) != want and name + ".qweight" not in misshapen:
        checked.add("manifest", f"tensor {name}.qweight: shape {list(qweight.shape)} does not match the layer "
                                f"shape [{n}, {k}] in {reading.MANIFEST_NAME}", file=reading.MANIFEST_NAME,
                    tensor=name + ".qweight")
    # convert records the group size it used: quantization_config's, or the whole grouped axis (per-channel)
    group_size = qc["group_size"] or (k if qc["axis"] == 1 else n)
    if "group_size" in layer and layer["group_size"] != group_size:
        checked.add("manifest", f"module {name}: {reading.MANIFEST_NAME} says group_size={layer['group_size']} "
                                f"but quantization_config gives group_size={group_size}",
                    file=reading.MANIFEST_NAME, tensor=name)


# ----------------------------------------------------------------------------------------------
# Tensor data


def read_checked(checked: Checked, names=None) -> Iterator[tuple[str, TensorInfo, torch.Tensor, Problem | None]]:
    """Read each tensor of ``names`` (default: all), file by file in offset order, and check its data: the sha256
    the manifest records for it (``verify``), and NaN or infinity in a floating-point tensor. Yields (name, info,
    tensor as stored, the problem or None)."""
    tensors = checked.tensors
    order = sorted((n for n in (tensors if names is None else names) if n in tensors),
                   key=lambda n: (str(tensors[n].file), tensors[n].offset))
    handles: dict[Path, object] = {}
    try:
        for name in order:
            info = tensors[name]
            f = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
            tensor = reading.read_tensor(info, f)
            yield name, info, tensor, data_problem(checked, name, info, tensor)
    finally:
        for f in handles.values():
            f.close()


def data_problem(checked: Checked, name: str, info: TensorInfo, tensor: torch.Tensor) -> Problem | None:
    """What is wrong with one tensor's data (``tensor``, read as stored), or None."""
    where = f"tensor {name} in {info.file.name}"
    bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() and tensor.numel() else 0
    # NaN or infinity in any weight (a packed layer's scales or zeros above all) turns every output it touches into NaN
    values = f"{bad} of {tensor.numel()} values are NaN or infinite" if bad else None
    digest = checked.digests.get(name) if checked.verify else None
    if digest is not None and reading.sha256_of(tensor) != digest:
        if _file_intact(checked, info.file.name):
            return Problem("manifest", f"{where}: its data's sha256 differs from the one {reading.MANIFEST_NAME} "
                                       f"records; {reading.MANIFEST_NAME} is corrupt or modified: download the "
                                       f"checkpoint again", file=reading.MANIFEST_NAME, tensor=name)
        why = values or f"its data's sha256 differs from the one {reading.MANIFEST_NAME} records"
        return Problem("checksum", f"{where}: {why}; the file's sha256 differs from {reading.MANIFEST_NAME}: it is "
                                   f"corrupt or modified, download it again", file=info.file.name, tensor=name)
    if values:
        return Problem("values", f"{where}: {values}; the checkpoint is damaged: download it again or re-convert",
                       file=info.file.name, tensor=name)
    return None


def _file_intact(checked: Checked, fname: str) -> bool:
    """Whether shard ``fname`` is byte for byte the file the manifest records (hashed once, only when one of its
    tensors disagrees with its digest: to tell a changed file from a changed manifest)."""
    if fname not in checked._file_intact:
        entry = checked.outputs.get(fname) or {}
        checked._file_intact[fname] = reading.sha256_file(checked.root / fname) == entry.get("sha256")
    return checked._file_intact[fname]
