"""transformers integration: ``from_pretrained`` on a quantpack checkpoint just works.

This module holds the ``quantpack`` quantization method of transformers' quantizer registry
(``AutoHfQuantizer``): :class:`QuantpackConfig` and :class:`QuantpackHfQuantizer`. After ``import quantpack``::

    model = AutoModelForCausalLM.from_pretrained("Llama-3.1-8B-qp4g128", device_map="auto")

builds the model with :class:`~quantpack.modules.linear.QuantLinear` layers
(:class:`~quantpack.modules.w8a8.W8A8Linear` for ``w8a8`` checkpoints: the same ones :func:`quantpack.load`
builds) and transformers' own loader fills them from the shards.

Importing this module imports transformers' quantizer registry (seconds) and registers the method
(idempotent). ``import quantpack`` does not import it: it installs an import hook
(:func:`quantpack._registry_hook.register_when_transformers_loads`) that imports this module the moment
transformers loads that registry, so ``import quantpack`` (and ``quantpack --help``) stay fast.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch
import transformers
# Submodules, not the `transformers.quantizers` package: this module is imported right after
# `transformers.quantizers.auto` executes, possibly while the package's __init__ is still running.
import transformers.quantizers.auto as auto
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from pathlib import Path

from .. import checkpoint, generation
from ..checkpoint import QUANT_METHOD, CheckpointError, TensorInfo
from ..checkpoint.hub import resolve_checkpoint
from ..checkpoint.integrity import check_files, check_model, fail, read_checked, refuse, use_model
from ..modules import fused
from ..modules.experts import skip_experts_switch, use_mma_layouts
from ..modules.merged import merge_projections
from ..modules.replace import linear_modules_to_convert, replace_linear_layers
from ..schemes import read_quantization_config

logger = logging.getLogger(__name__)

_CONFIG_FIELDS = ("layout_version", "bits", "group_size", "axis", "method", "modules_not_converted",
                  "bits_overrides", "quantpack_version", "scheme", "quantized_experts")


class QuantpackConfig(QuantizationConfigMixin):
    """``config.json["quantization_config"]`` of a quantpack checkpoint, as transformers sees it.

    Validated on construction (layout version, bits, axis, scheme), with the message of
    :class:`~quantpack.checkpoint.CheckpointError`.

    ``verify`` is a loading option, as in :func:`quantpack.load`: check every tensor's bytes against the
    sha256 ``quantpack.json`` records (default ``True``). It is never read from ``config.json``; pass it as
    ``from_pretrained(path, quantization_config=QuantpackConfig(verify=False))``.
    """

    def __init__(self, quant_method: str = QUANT_METHOD, *, verify: bool = True, **fields: Any):
        if not isinstance(verify, bool):
            raise ValueError(f"verify={verify!r}: pass True or False")
        self.quant_method = quant_method
        self.verify = verify
        extra = sorted(set(fields) - set(_CONFIG_FIELDS))
        if extra:
            raise checkpoint.CheckpointError(f"config.json: quantization_config has unknown field {extra[0]!r}; "
                                             f"this quantpack does not know it: upgrade quantpack")
        self._stored = dict(fields)  # serialized back exactly as read
        if not verify and not fields and not passes_loading_options():
            generation.say_once("QuantpackConfig(verify=False) needs transformers >= 5.4 to reach the checkpoint (this is "
                      f"{transformers.__version__}): checksums stay on; use quantpack.load(path, verify=False) "
                      "or upgrade transformers to skip them")
        # With no fields this is only a carrier of loading options (QuantpackConfig(verify=False)); transformers
        # copies those onto the checkpoint's own config (get_loading_attributes), which is validated.
        self.validated = self._validate() if fields else None
        for key in _CONFIG_FIELDS:
            setattr(self, key, (self.validated or {}).get(key))

    def _validate(self) -> dict:
        return read_quantization_config({"quantization_config": {"quant_method": self.quant_method, **self._stored}})

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        if "verify" in config_dict:  # a checkpoint must not be able to switch its own checksums off
            raise CheckpointError("config.json: quantization_config has field 'verify', a loading option that a "
                                  "checkpoint cannot set; remove it (pass QuantpackConfig(verify=False) to "
                                  "from_pretrained to skip checksums)")
        return super().from_dict(config_dict, return_unused_kwargs, **kwargs)

    def get_loading_attributes(self) -> dict[str, Any]:
        return {"verify": self.verify}

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **json.loads(json.dumps(self._stored))}


class QuantpackHfQuantizer(HfQuantizer):
    """Loads pre-quantized quantpack checkpoints: swaps converted linear layers for
    :class:`~quantpack.modules.linear.QuantLinear` before transformers reads the weights."""

    requires_calibration = True  # quantpack checkpoints come from `quantpack convert`, not on-the-fly quantization
    quantization_config: QuantpackConfig

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("device_map: disk offload is not supported for quantpack checkpoints; give the model "
                             "more GPU or CPU memory (max_memory)")

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        qc = config.validated or config._validate()  # (a config without fields raises its one-line error)
        # The checks of quantpack.load and quantpack verify, before transformers reads any data: the files against
        # the index and manifest, every tensor against the model built here, and (verify) every tensor's data.
        root = _checkpoint_root(model, kwargs.get("checkpoint_files"))
        checked = check_files(root, verify=config.verify)
        refuse(checked.problems)
        dtype = kwargs.get("dtype") or getattr(model.config, "dtype", None) or torch.float32
        # transformers casts each stored scale to the dtype of the module buffer it fills; build the
        # buffers in the dtype the checkpoint stores them in, so that a float32 model keeps its bf16
        # scales exact, and an explicit `dtype=` still applies to the rest.
        scales_dtypes = _stored_scales_dtypes(checked.tensors)
        names = linear_modules_to_convert(model, qc)
        replace_linear_layers(model, qc, names, lambda name: scales_dtypes.get(name, dtype))
        use_model(checked, model, names)
        check_model(checked)
        refuse(checked.problems)
        if config.verify:
            refuse([problem for _, _, _, problem in read_checked(checked) if problem is not None])
        # A parent's _init_weights may re-initialize its linear children's `.weight` by attribute (GPT-2
        # scales c_proj.weight): every tensor of a packed checkpoint is stored, so nothing there needs init.
        for parent in {name.rpartition(".")[0] for name in names} - {""}:
            model.get_submodule(parent)._is_hf_initialized = True
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if still_meta:
            raise fail(f"tensor {still_meta[0]}: missing from the checkpoint")
        merge_projections(model)  # (as quantpack.load does: decode runs each block's q/k/v and gate/up as one GEMV)
        skip_experts_switch(model)
        if generation.on_cuda(model):  # (RMSNorm and rotary as one kernel each)
            fused.apply(model)
            use_mma_layouts(model)  # (experts in the tensor-core decode layout, where they fit it)
        generation.enable(model)  # (and generate() replays its decode steps from CUDA graphs)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # already quantized on disk

    def is_serializable(self, *args, **kwargs) -> bool:
        # save_pretrained would write shards but no manifest; `quantpack convert` makes checkpoints.
        # transformers' refusal says "check out the warnings from the logger": give it one.
        logger.warning("quantpack: save_pretrained cannot write a packed checkpoint (it would lack the "
                       "quantpack.json manifest); convert the original model with `quantpack convert`, or save "
                       "LoRA adapters with the peft model's save_pretrained")
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (peft LoRA) train on top of the frozen QuantLinear layers

    @property
    def is_qat_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _checkpoint_root(model, checkpoint_files) -> Path:
    """The packed checkpoint directory whose shards transformers is about to read. For a hub repository
    transformers fetches only the config and shards: the rest (manifest, tokenizer) comes into the same
    snapshot through :func:`quantpack.checkpoint.hub.resolve_checkpoint`, at the commit being loaded."""
    files = [Path(f) for f in checkpoint_files or []]
    if not files or not all(f.name.endswith(".safetensors") for f in files):
        raise fail("from_pretrained: a quantpack checkpoint loads from its safetensors shards; pass the packed "
                    "checkpoint's directory or hub repo id (not a state_dict or other weight files)")
    root = files[0].parent
    if not (root / checkpoint.MANIFEST_NAME).is_file() and root.parent.name == "snapshots":
        repo_id = getattr(model.config, "name_or_path", None)
        if repo_id and not Path(repo_id).exists():
            resolve_checkpoint(repo_id, revision=root.name)  # the same snapshot, now with every file
    return root


def _stored_scales_dtypes(infos: dict[str, TensorInfo]) -> dict[str, torch.dtype]:
    """Module name -> the compute dtype its checkpoint stores: that of ``.scales``, or for W8A8
    layers (whose ``weight_scale`` is always float32) that of ``.bias``."""
    out: dict[str, torch.dtype] = {}
    for name, info in infos.items():
        if name.endswith(".scales"):
            out[name[: -len(".scales")]] = info.dtype
        elif name.endswith(".weight_scale") and name[: -len("weight_scale")] + "bias" in infos:
            out[name[: -len(".weight_scale")]] = infos[name[: -len("weight_scale")] + "bias"].dtype
    return out


def register() -> None:
    """Register the ``quantpack`` quantization method with transformers (safe to call repeatedly; importing this
    module already did)."""
    # transformers' register_* decorators refuse a second registration: write the mappings directly.
    AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = QuantpackConfig
    AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = QuantpackHfQuantizer
    # Lets from_pretrained(..., quantization_config=QuantpackConfig(verify=False)) pass the loading option on
    # (transformers copies get_loading_attributes() only for the config types this tuple lists; before 5.4 the
    # tuple did not exist and the list was fixed: QuantpackConfig then says so when asked to skip checksums).
    types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if types is not None and QuantpackConfig not in types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*types, QuantpackConfig)


def passes_loading_options() -> bool:
    """Whether this transformers hands a ``quantization_config`` argument's loading options (``verify``) on to
    the checkpoint's config (5.4 and later)."""
    return hasattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES")


register()  # importing this module registers it (the import hook relies on that)
