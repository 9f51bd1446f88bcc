"""transformers (and peft) integration: ``from_pretrained`` on a quantpack checkpoint just works.

Importing this module registers the ``quantpack`` quantization method with transformers'
quantizer registry (``AutoHfQuantizer``), so after ``import quantpack``::

    model = AutoModelForCausalLM.from_pretrained("Llama-3.1-8B-qp4g128", device_map="auto")

builds the model with :class:`~quantpack.nn.QuantLinear` layers (:class:`~quantpack.nn_w8a8.W8A8Linear`
for ``w8a8`` checkpoints: the same ones :func:`quantpack.load` builds) and transformers' own loader
fills them from the shards.
Registration is idempotent. :class:`QuantLinearLora` and :func:`lora_config` let peft put LoRA
adapters on a frozen quantized base.
"""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import checkpoint
from .loader import QUANT_METHOD, linear_modules_to_convert, read_quantization_config, replace_linear_layers
from .nn import QuantLinear

_CONFIG_FIELDS = ("layout_version", "bits", "group_size", "axis", "method", "modules_not_converted",
                  "bits_overrides", "quantpack_version", "scheme")


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
        replace_linear_layers(model, qc, linear_modules_to_convert(model, qc),
                              lambda name: scales_dtypes.get(name, dtype))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # already quantized on disk

    def is_serializable(self, *args, **kwargs) -> bool:
        # save_pretrained would write shards but no manifest; `quantpack convert` makes checkpoints.
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
    """Register the ``quantpack`` quantization method with transformers (safe to call repeatedly)."""
    # transformers' register_* decorators refuse a second registration: write the mappings directly.
    AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = QuantpackConfig
    AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = QuantpackHfQuantizer


register()


# --------------------------------------------------------------------------------------------------
# peft: LoRA adapters on a frozen quantized base
# --------------------------------------------------------------------------------------------------

def _lora_layer_class():
    from peft.tuners.lora import LoraLayer

    class QuantLinearLora(nn.Module, LoraLayer):
        """LoRA adapter around a frozen :class:`QuantLinear`: ``base(x) + B(A(dropout(x))) * scaling``.

        The base weight is packed and stays frozen; gradients reach ``x`` through QuantLinear's
        backward and the adapters through plain linear layers. Merging into the packed weight is
        not supported (it would need re-quantization): keep adapters separate.
        """

        def __init__(self, base_layer: QuantLinear, adapter_name: str, config=None, r: int = 0,
                     lora_alpha: int = 1, **kwargs):
            if config is not None and getattr(config, "lora_bias", False):
                raise ValueError("lora_bias=True is not supported on quantpack QuantLinear layers; set it to False")
            if config is not None and getattr(config, "use_dora", False):
                raise ValueError("use_dora=True is not supported on quantpack QuantLinear layers; set it to False")
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def resolve_lora_variant(self, *, config, **kwargs):
            return None

        def merge(self, *args, **kwargs):
            raise NotImplementedError("merging LoRA adapters into a packed quantpack weight is not supported; "
                                      "keep the adapters separate (or merge into the source model and re-convert)")

        def unmerge(self, *args, **kwargs):
            raise NotImplementedError("quantpack QuantLinear layers never hold merged adapters")

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("adapter_names (mixed-adapter batches) is not supported on quantpack layers")
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters:
                return result
            out_dtype = result.dtype
            for active in self.active_adapters:
                if active not in self.lora_A.keys():
                    continue
                lora_A, lora_B = self.lora_A[active], self.lora_B[active]
                h = self._cast_input_dtype(x, lora_A.weight.dtype)
                result = result + lora_B(lora_A(self.lora_dropout[active](h))) * self.scaling[active]
            return result.to(out_dtype)

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    return QuantLinearLora


_LORA_CLASS = None


def __getattr__(name: str):
    # peft is optional: build the LoRA layer class on first use only.
    global _LORA_CLASS
    if name == "QuantLinearLora":
        if _LORA_CLASS is None:
            _LORA_CLASS = _lora_layer_class()
        return _LORA_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lora_config(**kwargs):
    """A ``peft.LoraConfig(**kwargs)`` that knows how to wrap :class:`QuantLinear` layers.

    Use it in place of ``LoraConfig`` for a model loaded with :func:`quantpack.load` or
    ``from_pretrained``; ``target_modules`` names the (quantized or not) linear layers as usual.
    """
    from peft import LoraConfig

    config = LoraConfig(**kwargs)
    config._register_custom_module({QuantLinear: __getattr__("QuantLinearLora")})
    return config
