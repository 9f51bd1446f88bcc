"""Load a packed checkpoint as a ready-to-run transformers model: ``quantpack.load(path_or_repo_id)``.

The model is built on the meta device, every converted linear layer is swapped for a
:class:`~quantpack.modules.linear.QuantLinear` (still on meta), then each tensor is read from its shard and
put on the device it belongs to, one tensor at a time. Full-precision linear weights never exist.

Before any tensor data is read, the files are checked against ``config.json``, the shard index and
the manifest ``quantpack.json`` by the checks ``quantpack verify`` runs (:mod:`quantpack.checkpoint.integrity`): a tensor
with the wrong shape or dtype, a missing or unexpected tensor, a file whose checksum differs, or an unsupported
layout version raises :class:`~quantpack.checkpoint.CheckpointError` (a ``ValueError``) naming the tensor or
file; so does a tensor whose data differs from its recorded sha256 or holds NaN or infinity, as it is read.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from . import checkpoint, generation
from .checkpoint.hub import resolve_checkpoint
from .checkpoint.integrity import check_checkpoint, fail, read_checked, refuse
from .modules import fused
from .modules.experts import QuantExperts, skip_experts_switch, use_mma_layouts
from .modules.merged import merge_projections

QUANT_METHOD = checkpoint.QUANT_METHOD


# --------------------------------------------------------------------------------------------------
# load()
# --------------------------------------------------------------------------------------------------

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
      GEMV (:func:`~quantpack.modules.merged.merge_projections`); ``False`` keeps every layer separate.
    * ``decode``: how ``model.generate`` decodes on a GPU (:mod:`quantpack.generation`): ``"graphs"`` (default: a
      static KV cache, each decode step captured once as a CUDA graph and replayed), ``"compile"`` (a static cache
      and transformers' torch.compile of the step) or ``"eager"`` (transformers' defaults, unchanged). On a GPU,
      Llama-style RMSNorms, rotary embeddings and MLPs' SiLU * up run as one kernel each in every mode
      (:mod:`quantpack.modules.fused`; ``quantpack.modules.fused.remove(model)`` undoes it).
    * ``trust_remote_code``: run the Python code the checkpoint ships for its config and model
      (``auto_map``). Off by default: such a checkpoint is refused, and nothing ever prompts.

    Returns the model of the class ``config.json``'s ``architectures`` names, in eval mode, with
    ``model.config.quantization_config`` and ``model.hf_quantizer`` set as ``from_pretrained`` sets
    them. Raises :class:`~quantpack.checkpoint.CheckpointError` (a ``ValueError``) when the files
    disagree with the config, index or manifest.
    """
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
    # The checks quantpack verify runs (one verdict for every folder), before any tensor data is read
    checked = check_checkpoint(root, verify=verify, trust_remote_code=trust_remote_code, dtype=dtype)
    refuse(checked.problems)
    model, expected, quantized = checked.model, checked.expected, checked.quantized

    if device_map is None:
        placement = {"": device if device is not None else
                     (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))}
    else:
        placement = _resolve_device_map(model, device_map, max_memory)

    # One tensor at a time: read it from its shard (positioned read, no mmap), check it (its sha256, no NaN), cast
    # it to the dtype its module wants, move it to its device. Peak extra memory is one tensor.
    modules = dict(model.named_modules())  # (one walk of the tree: a MoE model has a module per expert matrix)
    for name, module in modules.items():  # experts bound for a GPU are packed into its decode layout as they load
        if isinstance(module, QuantExperts):
            dev = _device_of(placement, f"{name}.gate_up_qweight")
            if dev.type == "cuda":
                module.use_mma_layout(dev)
    for name, _, tensor, problem in read_checked(checked, expected):
        if problem is not None:
            raise fail(problem.message)
        module = name.rpartition(".")[0]
        if tensor.is_floating_point():
            to_dtype = expected[name].dtype if module in quantized else (dtype or tensor.dtype)
            tensor = tensor.to(to_dtype)
        _set_tensor(model, name, tensor.to(_device_of(placement, name)), modules)
    model.tie_weights()
    for name, buf in list(model.named_buffers()):
        if not buf.is_meta:  # non-persistent buffers made in __init__ (rotary inv_freq, position ids)
            _set_tensor(model, name, buf.to(_device_of(placement, name)))
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise fail(f"tensor {still_meta[0]}: missing from the checkpoint")
    if len({str(_device_of(placement, n)) for n in expected}) > 1:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=placement)

    # The same quantization bookkeeping as transformers' from_pretrained route, so Trainer and peft
    # treat the model as a quantized base that supports adapter training.
    from .integrations.transformers import QuantpackConfig, QuantpackHfQuantizer

    stored_qc = checked.config["quantization_config"]
    model.config.quantization_config = QuantpackConfig.from_dict(stored_qc)
    model.hf_quantizer = QuantpackHfQuantizer(model.config.quantization_config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    if (root / "generation_config.json").is_file() and model.can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(root)
    if merge:
        merge_projections(model)
    skip_experts_switch(model)
    if generation.on_cuda(model):  # (RMSNorm and rotary as one kernel each; the rotary replacement is process-wide)
        fused.apply(model)
        use_mma_layouts(model)  # (experts in the tensor-core decode layout, where they fit it)
    generation.enable(model, decode)
    return model.eval()


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor, modules: dict | None = None) -> None:
    parent_name, _, leaf = name.rpartition(".")
    module = modules[parent_name] if modules is not None else model.get_submodule(parent_name) if parent_name else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad and tensor.is_floating_point())
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:  # one expert's matrix: copied into its slot of the block's stacked buffers (modules/experts.py)
        setattr(module, leaf, tensor)
