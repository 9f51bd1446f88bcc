"""Load a packed checkpoint as a ready-to-run transformers model: ``quantpack.load(path_or_repo_id)``.

The model is built on the meta device, every converted linear layer is swapped for a
:class:`~quantpack.nn.QuantLinear` (still on meta), then each tensor is read from its shard and
put on the device it belongs to, one tensor at a time. Full-precision linear weights never exist.

Before any tensor data is read, the files are checked against ``config.json``, the shard index and
the manifest ``quantpack.json``: a tensor with the wrong shape or dtype, a missing or unexpected
tensor, a file whose checksum differs, or an unsupported layout version raises
:class:`~quantpack.checkpoint.CheckpointError` (a ``ValueError``) naming the tensor or file.
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import checkpoint, fused_ops, generation
from .checkpoint import CheckpointError, TensorInfo
from .format import LAYOUT_VERSION
from .nn import QuantLinear, linear_dims
from .nn_merged import merge_projections

QUANT_METHOD = checkpoint.QUANT_METHOD


def _fail(message: str) -> CheckpointError:
    return CheckpointError(" ".join(str(message).split()))


# --------------------------------------------------------------------------------------------------
# Module construction by scheme: the one place that decides what replaces an nn.Linear.
# --------------------------------------------------------------------------------------------------

# A builder gets (module name, the nn.Linear (or Conv1D, see nn.linear_dims) being replaced (on meta), the validated
# quantization_config, the compute dtype) and returns the replacement module on the meta device.
# Its state-dict keys are the tensor names the checkpoint stores for that module.
ModuleBuilder = Callable[[str, nn.Module, dict, torch.dtype], nn.Module]


def build_weight_only(name: str, linear: nn.Module, qc: dict, dtype: torch.dtype) -> nn.Module:
    """``w4a16`` / ``w8a16``: a :class:`QuantLinear` (packed weight; scales, zeros and bias in ``dtype``)."""
    out_features, in_features, _ = linear_dims(linear)
    return QuantLinear(in_features, out_features, bits=qc["bits_overrides"].get(name, qc["bits"]),
                       group_size=qc["group_size"], axis=qc["axis"], bias=linear.bias is not None, dtype=dtype,
                       device="meta")


def build_w8a8(name: str, linear: nn.Linear, qc: dict, dtype: torch.dtype) -> nn.Module:
    """``w8a8``: a :class:`~quantpack.nn_w8a8.W8A8Linear` (int8 ``qweight`` (N, K), float32
    ``weight_scale`` (N,), bias in ``dtype``)."""
    from .nn_w8a8 import W8A8Linear

    out_features, in_features, _ = linear_dims(linear)
    return W8A8Linear(in_features, out_features, bias=linear.bias is not None, dtype=dtype, device="meta")


SCHEMES: dict[str, ModuleBuilder] = {"w4a16": build_weight_only, "w8a16": build_weight_only, "w8a8": build_w8a8}


def register_scheme(scheme: str, builder: ModuleBuilder) -> None:
    """Teach the loader (and the transformers integration) the ``quantization_config.scheme`` ``scheme``."""
    SCHEMES[scheme] = builder


def read_quantization_config(config: dict) -> dict:
    """``checkpoint.read_quantization_config`` plus: the scheme must be one this quantpack can build."""
    qc = checkpoint.read_quantization_config(config)
    if qc["scheme"] not in SCHEMES:
        raise _fail(f"config.json: quantization_config.scheme={qc['scheme']!r} is not supported by this quantpack "
                    f"(known: {', '.join(sorted(SCHEMES))}); upgrade quantpack")
    return qc


def linear_modules_to_convert(model: nn.Module, qc: dict) -> list[str]:
    """Names of the linear modules (``nn.Linear``, GPT-2's ``Conv1D``) a packed checkpoint stores
    quantized: all but those in ``modules_not_converted`` and those whose weight is tied to another (a
    tied ``lm_head`` is never quantized, nor stored)."""
    skip = set(qc["modules_not_converted"]) | {n.removesuffix(".weight") for n in _tied_targets(model)}
    return [n for n, m in model.named_modules() if linear_dims(m) is not None and n not in skip]


def _tied_targets(model) -> set[str]:
    """Parameters that ``tie_weights`` points at another parameter (e.g. ``lm_head.weight``)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and hasattr(model, "get_expanded_tied_weights_keys"):
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return set(keys or {})


def replace_linear_layers(model: nn.Module, qc: dict, names: list[str],
                          dtype_for: Callable[[str], torch.dtype]) -> None:
    """Swap each linear module in ``names`` for the module of ``qc``'s scheme, built on meta.
    ``dtype_for(name)`` is that module's compute dtype (its scales/zeros/bias). A replaced ``Conv1D``
    becomes the same ``x @ W.T + b`` module (the checkpoint stores W as (out, in) like any linear);
    ``source_transposed`` on it records that the source stored (in, out)."""
    builder = SCHEMES[qc["scheme"]]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = builder(name, old, qc, dtype_for(name))
        new.source_transposed = linear_dims(old)[2]
        setattr(parent, child, new)
    for name in qc.get("quantized_experts") or []:
        _replace_experts(model, name, qc, dtype_for(f"{name}.gate_proj.0"))


def _replace_experts(model: nn.Module, name: str, qc: dict, dtype: torch.dtype) -> None:
    """Swap the experts block ``name`` for a :class:`~quantpack.nn_experts.QuantExperts` on meta."""
    from .nn_experts import PROJECTIONS, QuantExperts, fused_experts_dims

    try:
        old = model.get_submodule(name)
    except AttributeError:
        old = None
    dims = fused_experts_dims(old) if old is not None else None
    if dims is None:
        raise _fail(f"config.json: quantization_config.quantized_experts lists {name}, which is not an experts "
                    f"block of {type(model).__name__}; the checkpoint does not match its config: re-convert")
    new = QuantExperts(*dims, old.act_fn, bits=qc["bits"], group_size=qc["group_size"], axis=qc["axis"],
                       dtype=dtype, device="meta")
    for proj in PROJECTIONS:
        for e, layer in enumerate(getattr(new, proj)):
            bits = qc["bits_overrides"].get(f"{name}.{proj}.{e}")
            if bits is not None and bits != layer.bits:
                getattr(new, proj)[e] = QuantLinear(layer.in_features, layer.out_features, bits=bits,
                                                    group_size=qc["group_size"], axis=qc["axis"], bias=False,
                                                    dtype=dtype, device="meta")
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------

def resolve_checkpoint(path_or_repo_id, *, revision: str | None = None, token: str | None = None) -> Path:
    """A local directory as is; otherwise a hub repository id, fetched (or found in the local cache,
    e.g. with ``HF_HUB_OFFLINE=1``) by huggingface_hub."""
    from .hub import resolve_source

    try:
        return resolve_source(os.fspath(path_or_repo_id), revision=revision, token=token).path
    except CheckpointError as exc:  # the resolver names its argument "source"; here it is path_or_repo_id
        message = str(exc)
        raise _fail("path_or_repo_id" + message[len("source"):] if message.startswith("source:") else message) from None


def read_checkpoint_files(root: Path, *, verify: bool = True) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Every tensor of a packed checkpoint from the shard headers (no tensor data read), after checking
    the shards against the index, their layout version, and (``verify``) the manifest: sizes, and the
    sha256 of each file that the manifest has no per-tensor digests for. Returns the tensors and the
    per-tensor digests still to check ({name: sha256}); the loader checks those as it reads each
    tensor, so a verified load reads every byte once and a mismatch names the tensor."""
    if not (root / checkpoint.SAFE_INDEX_NAME).exists() and not (root / checkpoint.SAFE_SINGLE_NAME).exists():
        raise _fail(f"{root}: no {checkpoint.SAFE_INDEX_NAME} or {checkpoint.SAFE_SINGLE_NAME}; "
                    f"not a packed checkpoint directory")
    outputs = {}
    if verify:
        manifest = checkpoint.read_manifest(root)
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise _fail(f"{checkpoint.MANIFEST_NAME}: layout_version={manifest.get('layout_version')!r}; this "
                        f"quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert")
        outputs = manifest.get("files", {}).get("outputs") or {}
        for rel, entry in outputs.items():
            f = root / rel
            if not f.is_file():
                raise _fail(f"file {rel}: listed in {checkpoint.MANIFEST_NAME} but missing; download it again")
            if f.stat().st_size != entry["size"]:
                raise _fail(f"file {rel}: {f.stat().st_size} bytes, {checkpoint.MANIFEST_NAME} says {entry['size']}; "
                            f"the file is truncated or modified: download it again")
            if not isinstance(entry.get("tensors"), dict) and checkpoint.sha256_file(f) != entry["sha256"]:
                raise _fail(f"file {rel}: sha256 differs from {checkpoint.MANIFEST_NAME}; the file is corrupt or "
                            f"modified: download it again (or pass verify=False to skip checksums)")
    tensors = checkpoint.check_index(root)
    digests = {}
    for fname in sorted({info.file.name for info in tensors.values()}):
        _, meta = checkpoint.read_safetensors_header(root / fname)
        version = meta.get("quantpack_layout_version")
        if version is not None and version != str(LAYOUT_VERSION):
            raise _fail(f"file {fname}: quantpack_layout_version={version!r} in its metadata; this quantpack reads "
                        f"layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert")
        recorded = (outputs.get(fname) or {}).get("tensors")
        if isinstance(recorded, dict):
            stored = {n for n, info in tensors.items() if info.file.name == fname}
            for name in sorted(stored ^ set(recorded)):
                where = "is in the file but not" if name in stored else "is missing from the file but listed"
                raise _fail(f"tensor {name} in {fname}: {where} in {checkpoint.MANIFEST_NAME}; the file is corrupt "
                            f"or modified: download it again")
            digests.update(recorded)
    return tensors, digests


def _digest_mismatch(name: str, info: TensorInfo) -> CheckpointError:
    return _fail(f"tensor {name} in {info.file.name}: its data's sha256 differs from the one {checkpoint.MANIFEST_NAME} "
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
                raise _digest_mismatch(name, info)
    finally:
        for f in handles.values():
            f.close()


def _check_manifest_layers(root: Path, qc: dict, tensors: dict[str, TensorInfo]) -> None:
    """Each layer the manifest lists is stored quantized with the bits and shape it records."""
    for layer in checkpoint.read_manifest(root).get("layers") or []:
        name = layer["name"]
        if name + ".qweight" not in tensors:
            raise _fail(f"tensor {name}.qweight: missing, but {checkpoint.MANIFEST_NAME} lists {name} as quantized")
        bits = qc["bits_overrides"].get(name, qc["bits"])
        if "bits" in layer and layer["bits"] != bits:
            raise _fail(f"module {name}: {checkpoint.MANIFEST_NAME} says bits={layer['bits']} but "
                        f"quantization_config gives bits={bits}")
        n, k = layer.get("shape", (None, None))
        qshape = tensors[name + ".qweight"].shape
        # W8A8 keeps nn.Linear's (N, K); the weight-only layouts store (K/2, N) or (K, N).
        want = (n, k) if qc["scheme"] == "w8a8" else (k // 2, n) if bits == 4 else (k, n)
        if n is not None and qshape != want:
            raise _fail(f"tensor {name}.qweight: shape {list(qshape)} does not match the layer shape [{n}, {k}] "
                        f"in {checkpoint.MANIFEST_NAME}")


# --------------------------------------------------------------------------------------------------
# load()
# --------------------------------------------------------------------------------------------------

def model_class_for(config, *, trust_remote_code: bool = False):
    """The transformers class to build for ``config`` (see :func:`quantpack.hf_config.model_class`)."""
    from .hf_config import model_class

    return model_class(config, trust_remote_code=trust_remote_code)


def _expected_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
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


def _check_tensors(model, expected: dict[str, torch.Tensor], aliases: set[str], tensors: dict[str, TensorInfo],
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
            raise _fail(f"tensor {name} in {info.file.name}: not a tensor of {type(model).__name__}{hint}")
        want = expected[name]
        if tuple(info.shape) != tuple(want.shape):
            raise _fail(f"tensor {name} in {info.file.name}: shape {list(info.shape)}, expected {list(want.shape)} "
                        f"from config.json and quantization_config")
        if want.is_floating_point():
            if not info.dtype.is_floating_point:
                raise _fail(f"tensor {name} in {info.file.name}: dtype {checkpoint.dtype_name(info.dtype)}, "
                            f"expected a floating-point dtype")
        elif info.dtype != want.dtype:
            raise _fail(f"tensor {name} in {info.file.name}: dtype {checkpoint.dtype_name(info.dtype)}, expected "
                        f"{checkpoint.dtype_name(want.dtype)}")
    tied = _tied_targets(model)
    missing = [n for n in expected if n not in tensors and n not in tied]
    if missing:
        module = missing[0].rpartition(".")[0]
        hint = ""
        if module in quantized and module + ".weight" in tensors:
            hint = f"; the file stores {module}.weight, so add {module} to quantization_config.modules_not_converted"
        raise _fail(f"tensor {missing[0]}: missing from the checkpoint{hint}" +
                    (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))


def _device_of(placement: dict, name: str) -> torch.device:
    """The device of a tensor or module under a device map (longest matching module prefix)."""
    key = name
    while key not in placement:
        if not key:
            raise ValueError(f"device_map: no entry covers {name!r}; add one for it or a '' entry")
        key = key.rpartition(".")[0]
    dev = placement[key]
    return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)


def _resolve_device_map(model, device_map, max_memory) -> dict:
    if isinstance(device_map, (torch.device, int)) or (isinstance(device_map, str) and (
            device_map in ("cpu", "cuda", "meta") or re.fullmatch(r"cuda:\d+", device_map))):
        return {"": device_map}
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"device_map={device_map!r}: use 'auto', 'balanced', 'balanced_low_0', 'sequential', "
                             f"a device, or a {{module name: device}} dict")
        from accelerate.utils import get_balanced_memory, infer_auto_device_map

        no_split = list(getattr(model, "_no_split_modules", None) or [])
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    if not isinstance(device_map, dict):
        raise ValueError(f"device_map: expected 'auto' or a {{module name: device}} dict, "
                         f"got {type(device_map).__name__}")
    if "disk" in device_map.values() or "meta" in device_map.values():
        raise ValueError("device_map: disk offload is not supported for packed checkpoints; give the model more "
                         "GPU or CPU memory (max_memory) or use a smaller model")
    return device_map


def _check_device(device, what: str = "device") -> torch.device:
    """``device`` as a torch.device that exists here; else a one-line ValueError naming ``what``
    (torch's own errors are an AssertionError or a RuntimeError listing every backend)."""
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) else \
            torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what}={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type in ("meta", "disk"):
        raise ValueError(f"{what}={device!r}: the model needs real memory; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}={device!r}: no CUDA GPU is available here; use 'cpu' (the reference path)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what}={device!r}: there are only {torch.cuda.device_count()} CUDA device(s); "
                             f"use 'cuda:0' to 'cuda:{torch.cuda.device_count() - 1}'")
    return dev


def load(path_or_repo_id, *, device=None, dtype: torch.dtype | None = None, device_map=None,
         revision: str | None = None, token: str | None = None, max_memory: dict | None = None,
         verify: bool = True, merge: bool = True, decode: str = "graphs",
         trust_remote_code: bool = False) -> nn.Module:
    """Load a quantpack checkpoint (a directory or a hub repository id) as a transformers model.

    * ``device``: where the model goes (default: the current CUDA device if there is one, else the
      CPU). On the CPU the quantized layers run quantpack's reference path.
    * ``dtype``: the dtype of every non-quantized floating-point weight (embeddings, norms,
      ``lm_head``...), hence of the activations. Default: as stored in the checkpoint. Quantized
      layers keep the scales/zeros/bias dtype they were converted with (the kernels accept any
      activation dtype).
    * ``device_map``: ``"auto"`` (GPUs first, then CPU, by accelerate; ``max_memory`` as in
      accelerate), ``"balanced"``, ``"sequential"``, or a ``{module name: device}`` dict. Use
      either ``device`` or ``device_map``.
    * ``revision``, ``token``: for hub repositories.
    * ``verify``: check every tensor's bytes against the manifest's sha256 as it is read (whole files
      for manifests without per-tensor digests); shapes and dtypes are always checked.
    * ``merge``: link each block's sibling projections (q/k/v, gate/up) so that at decode they run as one
      GEMV (:func:`~quantpack.nn_merged.merge_projections`); ``False`` keeps every layer separate.
    * ``decode``: how ``model.generate`` decodes on a GPU (:mod:`quantpack.generation`): ``"graphs"`` (default: a
      static KV cache, each decode step captured once as a CUDA graph and replayed), ``"compile"`` (a static cache
      and transformers' torch.compile of the step) or ``"eager"`` (transformers' defaults, unchanged). On a GPU,
      Llama-style RMSNorms and rotary embeddings run as one kernel each in every mode (:mod:`quantpack.fused_ops`;
      ``quantpack.fused_ops.remove(model)`` undoes it).
    * ``trust_remote_code``: run the Python code the checkpoint ships for its config and model
      (``auto_map``). Off by default: such a checkpoint is refused, and nothing ever prompts.

    Returns the model of the class ``config.json``'s ``architectures`` names, in eval mode, with
    ``model.config.quantization_config`` and ``model.hf_quantizer`` set as ``from_pretrained`` sets
    them. Raises :class:`~quantpack.checkpoint.CheckpointError` (a ``ValueError``) when the files
    disagree with the config, index or manifest.
    """
    from accelerate import init_empty_weights

    from .hf_config import auto_config

    if device is not None and device_map is not None:
        raise ValueError("device and device_map: pass one of them, not both")
    if decode not in generation.MODES:
        raise ValueError(f"decode={decode!r}: use one of {', '.join(generation.MODES)}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: pass a floating-point torch.dtype such as torch.bfloat16")
    if device is not None:
        device = _check_device(device)
    if isinstance(device_map, dict):
        for module, dev in device_map.items():
            if dev not in ("disk", "meta"):  # refused below with the offload message
                _check_device(dev, f"device_map[{module!r}]")
    elif device_map is not None and (not isinstance(device_map, str) or device_map in ("cpu", "cuda")
                                     or device_map.startswith("cuda:")):
        _check_device(device_map, "device_map")
    root = resolve_checkpoint(path_or_repo_id, revision=revision, token=token)
    if not (root / checkpoint.CONFIG_NAME).is_file():
        raise _fail(f"{root}: no config.json; not a packed checkpoint directory")
    config_dict = checkpoint.read_config(root)
    qc = read_quantization_config(config_dict)
    config = auto_config(root, trust_remote_code=trust_remote_code, config=config_dict)
    tensors, digests = read_checkpoint_files(root, verify=verify)
    if verify:
        _check_manifest_layers(root, qc, tensors)

    # The skeleton on meta. Buffers computed in __init__ (rotary tables) are real, on the CPU.
    stored_floats = [i.dtype for n, i in tensors.items() if i.dtype.is_floating_point
                     and not n.endswith((".scales", ".zeros", ".weight_scale"))]
    build_dtype = dtype or (max(set(stored_floats), key=stored_floats.count) if stored_floats else torch.float32)
    plain_config = copy.deepcopy(config)
    if hasattr(plain_config, "quantization_config"):
        del plain_config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = model_class_for(config, trust_remote_code=trust_remote_code)._from_config(plain_config,
                                                                                         dtype=build_dtype)

    def compute_dtype(module: str) -> torch.dtype:
        # Quantized layers keep the scales/zeros (and bias) dtype they were quantized with (W8A8 layers,
        # whose scales are always float32, the dtype of their bias).
        info = tensors.get(module + ".scales") or tensors.get(module + ".bias")
        return info.dtype if info is not None and info.dtype.is_floating_point else build_dtype

    quantized = linear_modules_to_convert(model, qc)
    replace_linear_layers(model, qc, quantized, compute_dtype)
    quantized = set(quantized) | {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}  # + experts
    expected, aliases = _expected_tensors(model)
    _check_tensors(model, expected, aliases, tensors, quantized, qc)

    if device_map is None:
        placement = {"": device if device is not None else
                     (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))}
    else:
        placement = _resolve_device_map(model, device_map, max_memory)

    # One tensor at a time: read it from its shard (positioned read, no mmap), cast it to the dtype its
    # module wants, move it to its device. Peak extra memory is one tensor.
    handles: dict[Path, object] = {}
    try:
        for name, want in expected.items():
            info = tensors.get(name)
            if info is None:
                continue  # tied: filled by tie_weights below
            f = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
            tensor = checkpoint.read_tensor(info, f)
            if name in digests and checkpoint.sha256_of(tensor) != digests[name]:
                raise _digest_mismatch(name, info)
            module = name.rpartition(".")[0]
            if tensor.is_floating_point():
                to_dtype = want.dtype if module in quantized else (dtype or tensor.dtype)
                tensor = tensor.to(to_dtype)
            _set_tensor(model, name, tensor.to(_device_of(placement, name)))
    finally:
        for f in handles.values():
            f.close()
    model.tie_weights()
    for name, buf in list(model.named_buffers()):
        if not buf.is_meta:  # non-persistent buffers made in __init__ (rotary inv_freq, position ids)
            _set_tensor(model, name, buf.to(_device_of(placement, name)))
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise _fail(f"tensor {still_meta[0]}: missing from the checkpoint")
    if len({str(_device_of(placement, n)) for n in expected}) > 1:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=placement)

    # The same quantization bookkeeping as transformers' from_pretrained route, so Trainer and peft
    # treat the model as a quantized base that supports adapter training.
    from .hf_integration import QuantpackConfig, QuantpackHfQuantizer

    stored_qc = config_dict["quantization_config"]
    model.config.quantization_config = QuantpackConfig.from_dict(stored_qc)
    model.hf_quantizer = QuantpackHfQuantizer(model.config.quantization_config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    if (root / "generation_config.json").is_file() and model.can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(root)
    if merge:
        merge_projections(model)
    if generation.on_cuda(model):  # (RMSNorm and rotary as one kernel each; the rotary replacement is process-wide)
        fused_ops.apply(model)
    generation.enable(model, decode)
    return model.eval()


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent_name) if parent_name else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad and tensor.is_floating_point())
    else:
        module._buffers[leaf] = tensor
