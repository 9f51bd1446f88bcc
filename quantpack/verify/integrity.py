"""The integrity section of verify: a packed checkpoint's files against its config, manifest, index and the model
the config describes, without loading the model; a changed file is searched for the tensors that changed."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint, schemes
from ..checkpoint import CheckpointError, TensorInfo
from ..format import LAYOUT_VERSION
from .report import PROBLEM_KINDS, Problem


# Quantized modules: each scheme says how its modules are checked (quantpack.schemes)


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every quantized layer by its checkpoint name; one expert's matrix of a stacked experts block as a
    ``QuantLinear`` over its slot (views, no copy)."""
    from ..modules.experts import ExpertMatrix
    from ..modules.linear import QuantLinear

    out = []
    for n, m in model.named_modules():
        if isinstance(m, ExpertMatrix):
            out.append((n, QuantLinear.from_packed(m.packed())))
        elif schemes.module_check(m) is not None:
            out.append((n, m))
    return out


# ----------------------------------------------------------------------------------------------
# Integrity


def _skeleton(root: Path, qc: dict, tensors: dict[str, TensorInfo], trust_remote_code: bool = False):
    """The model the config describes, on meta, with quantized layers swapped in as the loader does.
    Returns (model, {state-dict name: meta tensor} with shared tensors once, tied names, quantized names)."""
    from accelerate import init_empty_weights

    from ..hf_config import auto_config
    from ..integrity import expected_tensors, tied_targets
    from ..loader import model_class_for
    from ..modules.replace import linear_modules_to_convert, replace_linear_layers

    config = auto_config(root, trust_remote_code=trust_remote_code)
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    with init_empty_weights(include_buffers=False):
        model = model_class_for(config, trust_remote_code=trust_remote_code)._from_config(plain, dtype=torch.float32)

    def compute_dtype(module: str) -> torch.dtype:
        info = tensors.get(module + ".scales")
        return info.dtype if info is not None and info.dtype.is_floating_point else torch.float32

    names = linear_modules_to_convert(model, qc)
    replace_linear_layers(model, qc, names, compute_dtype)
    expected, aliases = expected_tensors(model)
    return model, expected, aliases | tied_targets(model), set(names)


def _file_list(root: Path) -> tuple[list[str], dict[str, str] | None, list[Problem]]:
    """Shard file names and the index's weight map (None without an index)."""
    index = root / checkpoint.SAFE_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return [], None, [Problem("index", f"file {index.name}: not a valid index (needs a \"weight_map\" object); "
                                               f"download it again", file=index.name)]
        return sorted(set(weight_map.values())), weight_map, []
    if (root / checkpoint.SAFE_SINGLE_NAME).is_file():
        return [checkpoint.SAFE_SINGLE_NAME], None, []
    return [], None, [Problem("index", f"{root}: no {checkpoint.SAFE_INDEX_NAME} or {checkpoint.SAFE_SINGLE_NAME}; "
                                       f"not a packed checkpoint directory", file=checkpoint.SAFE_INDEX_NAME)]


def check_integrity(root, *, reference: Path | None = None,
                    allow_pickle: bool = False, trust_remote_code: bool = False) -> tuple[dict, list[Problem], dict | None]:
    """Check a packed checkpoint's files without loading the model.

    Returns (summary counts, problems, validated quantization_config or None). With ``reference``
    (the source checkpoint directory), a file whose checksum differs is searched for the tensors
    that changed (in a reference holding only PyTorch .bin weights when ``allow_pickle``). ``trust_remote_code``: let transformers run the
    checkpoint's own code to build its model (off: such a checkpoint is a config problem).
    """
    from ..schemes import read_quantization_config

    root = Path(root)
    problems: list[Problem] = []
    summary = {"files_checked": 0, "tensors_checked": 0}

    # -- config and quantization_config: without them nothing else can be judged
    if not (root / checkpoint.CONFIG_NAME).is_file():
        return summary, [Problem("config", f"{root}: no config.json; not a packed checkpoint directory",
                                 file=checkpoint.CONFIG_NAME)], None
    try:
        config = checkpoint.read_config(root)
    except CheckpointError as e:
        return summary, [Problem("config", f"file config.json: {str(e).partition(': ')[2]}",
                                 file=checkpoint.CONFIG_NAME)], None
    qc = None
    try:
        qc = read_quantization_config(config)
    except CheckpointError as e:
        problems.append(Problem("layout" if "layout_version" in str(e) else "config", str(e), file=checkpoint.CONFIG_NAME))

    # -- manifest: checksums of every output file
    manifest = None
    try:
        manifest = checkpoint.read_manifest(root)
    except CheckpointError as e:
        problems.append(Problem("manifest", str(e), file=checkpoint.MANIFEST_NAME))
    if manifest is not None and manifest.get("layout_version") != LAYOUT_VERSION:
        problems.append(Problem("layout", f"{checkpoint.MANIFEST_NAME}: layout_version={manifest.get('layout_version')!r}; "
                                          f"this quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or "
                                          f"re-convert", file=checkpoint.MANIFEST_NAME))
    shard_files, weight_map, index_problems = _file_list(root)
    problems += index_problems
    missing_files: set[str] = set()
    bad_checksum: list[str] = []
    outputs = ((manifest or {}).get("files") or {}).get("outputs") or {}
    for rel, entry in sorted(outputs.items()):
        f = root / rel
        if not f.is_file():
            missing_files.add(rel)
            continue
        summary["files_checked"] += 1
        if f.stat().st_size != entry.get("size") or checkpoint.sha256_file(f) != entry.get("sha256"):
            bad_checksum.append(rel)
    if manifest is not None:
        for name in shard_files:
            if name not in outputs and (root / name).is_file():
                problems.append(Problem("manifest", f"file {name}: a shard that {checkpoint.MANIFEST_NAME} does not list; "
                                                    f"the checkpoint was modified after conversion", file=name))

    # -- shards: present, parseable, layout version in their metadata; index against headers
    tensors: dict[str, TensorInfo] = {}
    file_tensors: dict[str, dict[str, TensorInfo]] = {}  # shard -> its header's tensors
    in_file: dict[str, list[str]] = {}
    for name, shard in (weight_map or {}).items():
        in_file.setdefault(shard, []).append(name)
    for fname in shard_files:
        f = root / fname
        if not f.is_file():
            missing_files.add(fname)
            continue
        try:
            infos, meta = checkpoint.read_safetensors_header(f)
        except CheckpointError as e:
            problems.append(Problem("checksum", f"file {fname}: {str(e).removeprefix(str(f) + ': ')}", file=fname))
            bad_checksum = [b for b in bad_checksum if b != fname]
            continue
        file_tensors[fname] = infos
        version = meta.get("quantpack_layout_version")
        if version is not None and version != str(LAYOUT_VERSION):
            problems.append(Problem("layout", f"file {fname}: quantpack_layout_version={version!r} in its metadata; this "
                                              f"quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or "
                                              f"re-convert", file=fname))
        for tname, info in infos.items():
            if tname in tensors:
                problems.append(Problem("index", f"tensor {tname}: stored in both {tensors[tname].file.name} and {fname}",
                                        file=fname, tensor=tname))
            tensors[tname] = info
            if weight_map is not None and tname not in weight_map:
                problems.append(Problem("index", f"tensor {tname} in {fname}: missing from {checkpoint.SAFE_INDEX_NAME}",
                                        file=fname, tensor=tname))
    for fname in sorted(missing_files):
        held = sorted(in_file.get(fname, []))
        what = f" (it holds {len(held)} tensors: {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})" if held else ""
        problems.append(Problem("missing_file", f"file {fname}: missing{what}; download it again", file=fname,
                                tensor=held[0] if held else None))
    for tname, shard in sorted((weight_map or {}).items()):
        info = tensors.get(tname)
        if shard not in missing_files and (info is None or info.file.name != shard):
            problems.append(Problem("index", f"tensor {tname}: {checkpoint.SAFE_INDEX_NAME} says it is in {shard}, "
                                             f"but it is not; the index does not match the shards", file=shard, tensor=tname))

    # -- every tensor against the model the config describes
    expected, skeleton = None, None
    if qc is not None:
        try:
            skeleton, expected, tied, quantized = _skeleton(root, qc, tensors, trust_remote_code)
        except CheckpointError as e:
            problems.append(Problem("config", str(e), file=checkpoint.CONFIG_NAME))
        except Exception as e:  # transformers raises many kinds for a config it cannot build
            problems.append(Problem("config", f"file config.json: transformers cannot build the model it describes "
                                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})",
                                    file=checkpoint.CONFIG_NAME))
    if expected is not None:
        out_dtype = ((manifest or {}).get("settings") or {}).get("dtype")
        fixed_dtypes = {f"{name}.{key}": dt for name, module in quantized_modules(skeleton)
                        for key, dt in schemes.module_check(module).stored_dtypes.items()}
        held_by_missing = {t for f in missing_files for t in in_file.get(f, [])}
        for tname, info in sorted(tensors.items()):
            want = expected.get(tname)
            if want is None:
                if tname not in tied:
                    problems.append(Problem("unexpected_tensor", f"tensor {tname} in {info.file.name}: not a tensor of "
                                                                 f"the model config.json describes", file=info.file.name,
                                            tensor=tname))
                continue
            if tuple(info.shape) != tuple(want.shape):
                problems.append(Problem("shape", f"tensor {tname} in {info.file.name}: shape {list(info.shape)}, expected "
                                                 f"{list(want.shape)} from config.json and quantization_config",
                                        file=info.file.name, tensor=tname))
            if tname in fixed_dtypes:
                ok, wanted = info.dtype == fixed_dtypes[tname], checkpoint.dtype_name(fixed_dtypes[tname])
            elif want.is_floating_point():
                ok = info.dtype.is_floating_point and (out_dtype is None or checkpoint.dtype_name(info.dtype) == out_dtype)
                wanted = out_dtype or "a floating-point dtype"
            else:
                ok, wanted = info.dtype == want.dtype, checkpoint.dtype_name(want.dtype)
            if not ok:
                problems.append(Problem("dtype", f"tensor {tname} in {info.file.name}: dtype "
                                                 f"{checkpoint.dtype_name(info.dtype)}, expected {wanted}",
                                        file=info.file.name, tensor=tname))
        for tname in sorted(expected):
            if tname not in tensors and tname not in tied and tname not in held_by_missing:
                problems.append(Problem("missing_tensor", f"tensor {tname}: missing from the checkpoint", tensor=tname))
        for layer in (manifest or {}).get("layers") or []:
            if layer.get("name") + ".qweight" not in tensors and layer.get("name") + ".qweight" not in held_by_missing:
                problems.append(Problem("missing_tensor", f"tensor {layer['name']}.qweight: missing, but "
                                                          f"{checkpoint.MANIFEST_NAME} lists {layer['name']} as quantized",
                                        tensor=layer["name"] + ".qweight"))

    # -- values: every floating-point number finite
    nonfinite: dict[str, str] = {}
    handles: dict[Path, object] = {}
    try:
        for tname, info in tensors.items():
            summary["tensors_checked"] += 1
            if not info.dtype.is_floating_point or not info.numel:
                continue
            f = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
            t = checkpoint.read_tensor(info, f)
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                nonfinite[tname] = f"{bad} of {t.numel()} values are NaN or infinite"
    finally:
        for f in handles.values():
            f.close()

    # -- a changed file: say which tensor changed
    reported: set[str] = set()
    for fname in bad_checksum:
        recorded = outputs[fname].get("tensors")
        if isinstance(recorded, dict) and fname in file_tensors:  # per-tensor digests: exact, and no reference needed
            located = _changed_by_digest(file_tensors[fname], recorded)
            located = {t: nonfinite.get(t, why) for t, why in located.items()}
            hint = " (every tensor's data matches its sha256 there: the header changed)"
        else:  # a manifest from before per-tensor digests
            located = {t: why for t, why in nonfinite.items() if tensors[t].file.name == fname}
            if reference is not None and skeleton is not None and not located:
                located = _locate_changes(skeleton, fname, tensors, reference, (manifest or {}).get("settings") or {},
                                          allow_pickle=allow_pickle)
            hint = "" if reference is not None else " (verify with a reference to find the tensor)"
        if located:
            for tname, why in located.items():
                reported.add(tname)
                problems.append(Problem("checksum", f"tensor {tname} in {fname}: {why}; the file's sha256 differs from "
                                                    f"{checkpoint.MANIFEST_NAME}: it is corrupt or modified, download it "
                                                    f"again", file=fname, tensor=tname))
        else:
            problems.append(Problem("checksum", f"file {fname}: sha256 differs from {checkpoint.MANIFEST_NAME}; the file is "
                                                f"corrupt or modified, download it again{hint}", file=fname))
    # An intact file whose manifest records other tensor digests: load compares those digests, so
    # verify must too (one verdict for every folder).
    for fname, infos in file_tensors.items():
        entry = outputs.get(fname) if fname not in bad_checksum else None
        recorded = entry.get("tensors") if isinstance(entry, dict) else None
        if isinstance(recorded, dict):
            for tname, why in _changed_by_digest(infos, recorded).items():
                reported.add(tname)
                problems.append(Problem("manifest", f"tensor {tname} in {fname}: {why}; {checkpoint.MANIFEST_NAME} "
                                                    f"is corrupt or modified: download the checkpoint again",
                                        file=checkpoint.MANIFEST_NAME, tensor=tname))
    for tname, why in nonfinite.items():
        if tname not in reported:
            problems.append(Problem("values", f"tensor {tname} in {tensors[tname].file.name}: {why}",
                                    file=tensors[tname].file.name, tensor=tname))

    problems.sort(key=lambda p: PROBLEM_KINDS.index(p.kind))  # stable: file order within a kind
    summary["tensors_checked"] = len(tensors)
    return summary, problems, qc


def _changed_by_digest(infos: dict[str, TensorInfo], recorded: dict[str, str]) -> dict[str, str]:
    """Tensors of one shard (``infos``, from its header) whose data's sha256 differs from the digest
    the manifest records for it (``recorded``), or that only one side has: {name: why}."""
    changed = {}
    handle = open(next(iter(infos.values())).file, "rb", buffering=0) if infos else None
    try:
        for tname, info in sorted(infos.items(), key=lambda kv: kv[1].offset):
            want = recorded.get(tname)
            if want is None:
                changed[tname] = f"not among the tensors {checkpoint.MANIFEST_NAME} records for this file"
            elif checkpoint.sha256_tensor_data(info, handle) != want:
                changed[tname] = f"its data's sha256 differs from the one {checkpoint.MANIFEST_NAME} records"
    finally:
        if handle is not None:
            handle.close()
    for tname in sorted(set(recorded) - set(infos)):
        changed[tname] = f"{checkpoint.MANIFEST_NAME} records it in this file, but the file no longer holds it"
    return changed


def reference_name(ref: checkpoint.SourceCheckpoint, name: str, prefix: str = "") -> str | None:
    """The reference tensor that holds checkpoint tensor ``name`` (names agree up to the base-model prefix)."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(prefix + ".")]
    return next((c for c in candidates if c in ref.tensors), None)


def _locate_changes(skeleton: nn.Module, fname: str, tensors: dict[str, TensorInfo], reference: Path,
                    settings: dict, *, allow_pickle: bool = False) -> dict[str, str]:
    """Tensors of shard ``fname`` that differ from what converting ``reference`` stores: other
    tensors bit for bit against the reference cast to the stored dtype, quantized modules by their
    scheme's ``locate``."""
    try:
        ref = checkpoint.SourceCheckpoint(reference, allow_pickle=allow_pickle)
    except CheckpointError:
        return {}

    def read(tname: str) -> torch.Tensor:
        return checkpoint.read_tensor(tensors[tname])

    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    located: dict[str, str] = {}
    try:
        modules = {}  # quantized module name -> its stored tensor names
        for name, module in quantized_modules(skeleton):
            names = [f"{name}.{k}" for k in module.state_dict(keep_vars=True)]
            if any(n in tensors and tensors[n].file.name == fname for n in names):
                modules[name] = (module, names)
        for tname, info in tensors.items():
            ref_name = reference_name(ref, tname, prefix) if info.file.name == fname else None
            if ref_name is None:  # packed tensors (qweight, scales...) have no reference namesake
                continue
            stored = read(tname)
            want = ref.get(ref_name)
            if want.is_floating_point() and stored.is_floating_point():
                want = want.to(stored.dtype)
            same = want.shape == stored.shape and want.dtype == stored.dtype and (
                not stored.numel() or torch.equal(want.reshape(-1).view(torch.uint8), stored.reshape(-1).view(torch.uint8)))
            if not same:
                located[tname] = "differs from the reference tensor it was converted from"
        for name, (module, names) in sorted(modules.items()):
            locate = schemes.module_check(module).locate
            ref_name = reference_name(ref, name + ".weight", prefix)
            if locate is None or ref_name is None or not all(n in tensors for n in names if not n.endswith(".bias")):
                continue
            try:
                found = locate(read, name, module, reference_weight(ref, ref_name, module), settings)
            except (CheckpointError, ValueError):
                continue
            located.update(dict(found))
    finally:
        ref.close()
    return located


def reference_weight(reference: checkpoint.SourceCheckpoint, ref_name: str, module: nn.Module) -> torch.Tensor:
    """The source weight of a quantized module as (out, in): GPT-2's Conv1D stored it (in, out)."""
    w = reference.get(ref_name)
    return w.t() if getattr(module, "source_transposed", False) else w
