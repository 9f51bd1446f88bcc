"""The transformers side of :mod:`quantpack.hf_integration`: the quantization config and quantizer.

Kept apart because importing it imports transformers' quantizer registry (seconds): ``import
quantpack`` registers these classes only once transformers loads that registry (see
:func:`quantpack._registry_hook.register_when_transformers_loads`). Importing this module
registers them.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch
# Submodules, not the `transformers.quantizers` package: this module is imported right after
# `transformers.quantizers.auto` executes, possibly while the package's __init__ is still running.
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import checkpoint
from .loader import QUANT_METHOD, linear_modules_to_convert, read_quantization_config, replace_linear_layers
from .nn_merged import merge_projections

logger = logging.getLogger(__name__)

_CONFIG_FIELDS = ("layout_version", "bits", "group_size", "axis", "method", "modules_not_converted",
                  "bits_overrides", "quantpack_version", "scheme", "quantized_experts")


class QuantpackConfig(QuantizationConfigMixin):
    """``config.json["quantization_config"]`` of a quantpack checkpoint, as transformers sees it.

    Validated on construction (layout version, bits, axis, scheme), with the message of
    :class:`~quantpack.checkpoint.CheckpointError`.
    """

    def __init__(self, quant_method: str = QUANT_METHOD, **fields: Any):
        self.quant_method = quant_method
        extra = sorted(set(fields) - set(_CONFIG_FIELDS))
        if extra:
            raise checkpoint.CheckpointError(f"config.json: quantization_config has unknown field {extra[0]!r}; "
                                             f"this quantpack does not know it: upgrade quantpack")
        self.validated = read_quantization_config({"quantization_config": {"quant_method": quant_method, **fields}})
        self._stored = dict(fields)  # serialized back exactly as read
        for key in _CONFIG_FIELDS:
            setattr(self, key, self.validated.get(key))

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **json.loads(json.dumps(self._stored))}


class QuantpackHfQuantizer(HfQuantizer):
    """Loads pre-quantized quantpack checkpoints: swaps converted linear layers for
    :class:`~quantpack.nn.QuantLinear` before transformers reads the weights."""

    requires_calibration = True  # quantpack checkpoints come from `quantpack convert`, not on-the-fly quantization
    quantization_config: QuantpackConfig

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("device_map: disk offload is not supported for quantpack checkpoints; give the model "
                             "more GPU or CPU memory (max_memory)")

    def _process_model_before_weight_loading(self, model, **kwargs):
        qc = self.quantization_config.validated
        dtype = kwargs.get("dtype") or getattr(model.config, "dtype", None) or torch.float32
        # transformers casts each stored scale to the dtype of the module buffer it fills; build the
        # buffers in the dtype the checkpoint stores them in (when the shard headers say), so that a
        # float32 model keeps its bf16 scales exact, and an explicit `dtype=` still applies to the rest.
        scales_dtypes = _stored_scales_dtypes(kwargs.get("checkpoint_files"))
        names = linear_modules_to_convert(model, qc)
        replace_linear_layers(model, qc, names, lambda name: scales_dtypes.get(name, dtype))
        # A parent's _init_weights may re-initialize its linear children's `.weight` by attribute (GPT-2
        # scales c_proj.weight): every tensor of a packed checkpoint is stored, so nothing there needs init.
        for parent in {name.rpartition(".")[0] for name in names} - {""}:
            model.get_submodule(parent)._is_hf_initialized = True
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        merge_projections(model)  # (as quantpack.load does: decode runs each block's q/k/v and gate/up as one GEMV)
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


def _stored_scales_dtypes(checkpoint_files) -> dict[str, torch.dtype]:
    """Module name -> the compute dtype its checkpoint stores: that of ``.scales``, or for W8A8
    layers (whose ``weight_scale`` is always float32) that of ``.bias``."""
    infos: dict = {}
    for f in checkpoint_files or []:
        if str(f).endswith(".safetensors"):
            infos.update(checkpoint.read_safetensors_header(f)[0])
    out: dict[str, torch.dtype] = {}
    for name, info in infos.items():
        if name.endswith(".scales"):
            out[name[: -len(".scales")]] = info.dtype
        elif name.endswith(".weight_scale") and name[: -len("weight_scale")] + "bias" in infos:
            out[name[: -len(".weight_scale")]] = infos[name[: -len("weight_scale")] + "bias"].dtype
    return out


def register() -> None:
    """Write the ``quantpack`` entries into transformers' quantizer registry (idempotent)."""
    # transformers' register_* decorators refuse a second registration: write the mappings directly.
    AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = QuantpackConfig
    AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = QuantpackHfQuantizer


register()  # importing this module registers it (the import hook relies on that)
