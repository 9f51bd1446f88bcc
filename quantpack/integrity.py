"""Checks of a packed checkpoint's files against its index, its manifest and the model built for it, shared by
:func:`quantpack.load` and the transformers quantizer (:mod:`quantpack.integrations.transformers`): each refusal
is a one-line :class:`~quantpack.checkpoint.CheckpointError` naming the file or tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import checkpoint
from .checkpoint import CheckpointError, TensorInfo
from .format import LAYOUT_VERSION


def fail(message: str) -> CheckpointError:
    """A :class:`CheckpointError` whose message is ``message`` on one line."""
    return CheckpointError(" ".join(str(message).split()))


def tied_targets(model) -> set[str]:
    """Parameters that ``tie_weights`` points at another parameter (e.g. ``lm_head.weight``)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and hasattr(model, "get_expanded_tied_weights_keys"):
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return set(keys or {})


def read_checkpoint_files(root: Path, *, verify: bool = True) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Every tensor of a packed checkpoint from the shard headers (no tensor data read), after checking
    the shards against the index, their layout version, and (``verify``) the manifest: sizes, and the
    sha256 of each file that the manifest has no per-tensor digests for. Returns the tensors and the
    per-tensor digests still to check ({name: sha256}); the loader checks those as it reads each
    tensor, so a verified load reads every byte once and a mismatch names the tensor."""
    if not (root / checkpoint.SAFE_INDEX_NAME).exists() and not (root / checkpoint.SAFE_SINGLE_NAME).exists():
        raise fail(f"{root}: no {checkpoint.SAFE_INDEX_NAME} or {checkpoint.SAFE_SINGLE_NAME}; "
                    f"not a packed checkpoint directory")
    outputs = {}
    if verify:
        manifest = checkpoint.read_manifest(root)
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise fail(f"{checkpoint.MANIFEST_NAME}: layout_version={manifest.get('layout_version')!r}; this "
                        f"quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert")
        outputs = manifest.get("files", {}).get("outputs") or {}
        for rel, entry in outputs.items():
            f = root / rel
            if not f.is_file():
                raise fail(f"file {rel}: listed in {checkpoint.MANIFEST_NAME} but missing; download it again")
            if f.stat().st_size != entry["size"]:
                raise fail(f"file {rel}: {f.stat().st_size} bytes, {checkpoint.MANIFEST_NAME} says {entry['size']}; "
                            f"the file is truncated or modified: download it again")
            if not isinstance(entry.get("tensors"), dict) and checkpoint.sha256_file(f) != entry["sha256"]:
                raise fail(f"file {rel}: sha256 differs from {checkpoint.MANIFEST_NAME}; the file is corrupt or "
                            f"modified: download it again (or pass verify=False to skip checksums)")
    tensors = checkpoint.check_index(root)
    digests = {}
    for fname in sorted({info.file.name for info in tensors.values()}):
        _, meta = checkpoint.read_safetensors_header(root / fname)
        version = meta.get("quantpack_layout_version")
        if version is not None and version != str(LAYOUT_VERSION):
            raise fail(f"file {fname}: quantpack_layout_version={version!r} in its metadata; this quantpack reads "
                        f"layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert")
        recorded = (outputs.get(fname) or {}).get("tensors")
        if isinstance(recorded, dict):
            stored = {n for n, info in tensors.items() if info.file.name == fname}
            for name in sorted(stored ^ set(recorded)):
                where = "is in the file but not" if name in stored else "is missing from the file but listed"
                raise fail(f"tensor {name} in {fname}: {where} in {checkpoint.MANIFEST_NAME}; the file is corrupt "
                            f"or modified: download it again")
            digests.update(recorded)
    return tensors, digests


def digest_mismatch(name: str, info: TensorInfo) -> CheckpointError:
    return fail(f"tensor {name} in {info.file.name}: its data's sha256 differs from the one {checkpoint.MANIFEST_NAME} "
                 f"records; the file is corrupt or modified: download it again (or pass verify=False to skip checksums)")


def check_tensor_digests(tensors: dict[str, TensorInfo], digests: dict[str, str]) -> None:
    """Hash each tensor's stored bytes against the digest :func:`read_checkpoint_files` returned for it, for a
    reader that does not read the data itself (transformers' ``from_pretrained``); a mismatch names the tensor."""
    handles: dict[Path, object] = {}
    try:
        for name in sorted(digests, key=lambda n: (str(tensors[n].file), tensors[n].offset) if n in tensors else ("", 0)):
            info = tensors.get(name)
            if info is None:
                continue  # read_checkpoint_files already refused a tensor the manifest lists but the file lacks
            f = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
            if checkpoint.sha256_tensor_data(info, f) != digests[name]:
                raise digest_mismatch(name, info)
    finally:
        for f in handles.values():
            f.close()


def check_manifest_layers(root: Path, qc: dict, tensors: dict[str, TensorInfo]) -> None:
    """Each layer the manifest lists is stored quantized with the bits and shape it records."""
    for layer in checkpoint.read_manifest(root).get("layers") or []:
        name = layer["name"]
        if name + ".qweight" not in tensors:
            raise fail(f"tensor {name}.qweight: missing, but {checkpoint.MANIFEST_NAME} lists {name} as quantized")
        bits = qc["bits_overrides"].get(name, qc["bits"])
        if "bits" in layer and layer["bits"] != bits:
            raise fail(f"module {name}: {checkpoint.MANIFEST_NAME} says bits={layer['bits']} but "
                        f"quantization_config gives bits={bits}")
        n, k = layer.get("shape", (None, None))
        qshape = tensors[name + ".qweight"].shape
        # W8A8 keeps nn.Linear's (N, K); the weight-only layouts store (K/2, N) or (K, N).
        want = (n, k) if qc["scheme"] == "w8a8" else (k // 2, n) if bits == 4 else (k, n)
        if n is not None and qshape != want:
            raise fail(f"tensor {name}.qweight: shape {list(qshape)} does not match the layer shape [{n}, {k}] "
                        f"in {checkpoint.MANIFEST_NAME}")


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


def check_tensors(model, expected: dict[str, torch.Tensor], aliases: set[str], tensors: dict[str, TensorInfo],
                   quantized: set[str], qc: dict) -> None:
    for name, info in tensors.items():
        module = name.rpartition(".")[0]
        if name not in expected:
            if name in aliases:
                continue  # a second copy of a tied weight
            if module in quantized:
                stores = sorted(k.rpartition(".")[2] for k in expected if k.rpartition(".")[0] == module)
                hint = f"; {module} is quantized, which stores {stores}"
            elif name.endswith((".qweight", ".scales", ".zeros")) and module in qc["modules_not_converted"]:
                hint = f"; config.json's quantization_config lists {module} in modules_not_converted"
            else:
                hint = ""
            raise fail(f"tensor {name} in {info.file.name}: not a tensor of {type(model).__name__}{hint}")
        want = expected[name]
        if tuple(info.shape) != tuple(want.shape):
            raise fail(f"tensor {name} in {info.file.name}: shape {list(info.shape)}, expected {list(want.shape)} "
                        f"from config.json and quantization_config")
        if want.is_floating_point():
            if not info.dtype.is_floating_point:
                raise fail(f"tensor {name} in {info.file.name}: dtype {checkpoint.dtype_name(info.dtype)}, "
                            f"expected a floating-point dtype")
        elif info.dtype != want.dtype:
            raise fail(f"tensor {name} in {info.file.name}: dtype {checkpoint.dtype_name(info.dtype)}, expected "
                        f"{checkpoint.dtype_name(want.dtype)}")
    tied = tied_targets(model)
    missing = [n for n in expected if n not in tensors and n not in tied]
    if missing:
        module = missing[0].rpartition(".")[0]
        hint = ""
        if module in quantized and module + ".weight" in tensors:
            hint = f"; the file stores {module}.weight, so add {module} to quantization_config.modules_not_converted"
        raise fail(f"tensor {missing[0]}: missing from the checkpoint{hint}" +
                    (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))
