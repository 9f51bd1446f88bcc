"""peft integration: LoRA adapters on a frozen quantized base.

:func:`lora_config` is a ``peft.LoraConfig`` that wraps :class:`~quantpack.modules.linear.QuantLinear` layers in
:class:`QuantLinearLora` (built on first use: importing peft takes seconds).
"""
from __future__ import annotations

import torch
from torch import nn

from ..modules.experts import ExpertMatrices, ExpertMatrix, QuantExperts
from ..modules.linear import QuantLinear


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
    # peft loads slowly: the class is built on first use only
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
    config._register_custom_module({QuantLinear: __getattr__("QuantLinearLora"), ExpertMatrix: _refuse_experts,
                                    ExpertMatrices: _refuse_experts, QuantExperts: _refuse_experts})
    return config


def _refuse_experts(target, adapter_name, **kwargs):
    """What peft calls to wrap a module of a packed mixture-of-experts block: adapters there are not supported (the
    experts' kernels have no backward)."""
    what = (f"{target.proj}.{target.expert}" if isinstance(target, ExpertMatrix) else
            target[0].proj if isinstance(target, ExpertMatrices) else "experts")
    raise ValueError(f"LoRA on a mixture-of-experts block ({what}) is not supported on packed experts; leave the "
                     f"experts out of target_modules (e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])")
