"""vLLM's side of the quantpack plugin: the ``quantpack`` quantization config and linear method.

Imported (hence vLLM imported) only by :func:`quantpack.integrations.vllm.register`, which vLLM calls
through the ``vllm.general_plugins`` entry point. The packed tensors load shard by shard through
vLLM's parameter classes (docs/serving.md has the mapping); the layers run quantpack's fused
kernels on CUDA (the custom op ``torch.ops.quantpack.mixed_mm`` while vLLM compiles) and the
reference path elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase, ReplicatedLinear, RowParallelLinear,
                                               UnquantizedLinearMethod, register_weight_loader_v2_supported_method)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.parameter import (ChannelQuantScaleParameter, GroupQuantScaleParameter,
                                           ModelWeightParameter, PackedvLLMParameter)

from .. import kernels, reference
from ..checkpoint import QUANT_METHOD, WEIGHT_ONLY_SCHEMES, CheckpointError, read_quantization_config
from ..format import PackedWeight
from ..kernels.launch_plan import PlanCache
from .vllm_sharding import partition


def _refuse(message: str) -> CheckpointError:
    return CheckpointError(f"quantpack: {message}")


class QuantpackConfig(QuantizationConfig):
    """``config.json["quantization_config"]`` of a quantpack checkpoint, as vLLM reads it."""

    def __init__(self, qc: dict):
        super().__init__()
        self.qc = qc
        self.bits: int = qc["bits"]
        self.group_size: int | None = qc["group_size"]
        self.modules_not_converted: list[str] = list(qc["modules_not_converted"])
        self.bits_overrides: dict[str, int] = dict(qc["bits_overrides"])

    def __repr__(self) -> str:
        return f"QuantpackConfig(bits={self.bits}, group_size={self.group_size}, scheme={self.qc['scheme']!r})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # (the fused kernels' bf16 tensor-core paths: Ampere and newer)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # (the block is config.json's quantization_config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantpackConfig":
        qc = read_quantization_config({"quantization_config": config})
        if qc["scheme"] not in WEIGHT_ONLY_SCHEMES:
            raise _refuse(f"scheme {qc['scheme']!r} is not served by the vLLM plugin (weight-only w4a16 and w8a16 "
                          f"are); serve it with quantpack.load, or convert the model without --scheme")
        if qc["quantized_experts"]:
            raise _refuse(f"mixture-of-experts blocks ({qc['quantized_experts'][0]}, ...) are not served by the vLLM "
                          f"plugin; serve it with quantpack.load")
        if qc["axis"] != 1:
            raise _refuse("axis=0 checkpoints (groups along out-features) are not served by the vLLM plugin; "
                          "re-convert with --axis 1 (the default)")
        return cls(qc)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        # (module names in the config are transformers'; the model may rename them)
        self.modules_not_converted = hf_to_vllm_mapper.apply_list(self.modules_not_converted)
        self.bits_overrides = hf_to_vllm_mapper.apply_dict(self.bits_overrides)

    def _parts(self, prefix: str) -> list[str]:
        """The checkpoint modules vLLM fuses into layer ``prefix`` (q/k/v into qkv_proj, ...), or itself."""
        head, _, proj = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(proj)
        return [f"{head}.{s}" if head else s for s in shards] if shards else [prefix]

    def bits_for(self, prefix: str) -> int:
        parts = self._parts(prefix)
        bits = {self.bits_overrides.get(p, self.bits) for p in parts}
        if len(bits) > 1:
            raise _refuse(f"layer {prefix} fuses {', '.join(parts)}, stored with different bits "
                          f"({sorted(bits)}); re-convert with the same bits for all of them")
        return bits.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            raise _refuse(f"mixture-of-experts layer {prefix} is not served by the vLLM plugin; serve it with "
                          f"quantpack.load")
        skipped = is_layer_skipped(prefix, self.modules_not_converted, self.packed_modules_mapping)
        if isinstance(layer, ParallelLMHead):
            # (a tied lm_head is never quantized, nor listed as skipped: it is not stored)
            text_config = get_current_vllm_config().model_config.hf_text_config
            if not skipped and not getattr(text_config, "tie_word_embeddings", False):
                raise _refuse(f"a quantized {prefix} (--quantize-lm-head) is not served by the vLLM plugin; "
                              f"re-convert without --quantize-lm-head")
            return None  # (vLLM's unquantized embedding method)
        if not isinstance(layer, LinearBase):
            return None
        if skipped:
            return UnquantizedLinearMethod()
        return QuantpackLinearMethod(self, prefix, self.bits_for(prefix))


@register_weight_loader_v2_supported_method
class QuantpackLinearMethod(LinearMethodBase):
    """Weight-only packed linear layer (any parallel kind) over quantpack's layout, split by vLLM's loaders.

    ``qweight`` (K/2 or K, N) splits along N for column-parallel layers and along K (packed rows) for
    row-parallel ones; grouped ``scales``/``zeros`` (K/g, N) the same way; per-channel ones (1, N)
    only along N (every rank of a row-parallel layer keeps the row)."""

    def __init__(self, config: QuantpackConfig, prefix: str, bits: int):
        self.config, self.prefix, self.bits = config, prefix, bits

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        row_parallel = isinstance(layer, RowParallelLinear) and not getattr(layer, "disable_tp", False)
        tp = 1 if isinstance(layer, ReplicatedLinear) else getattr(layer, "tp_size", 1)
        # (vLLM hands over each rank's output partitions; the full sizes are what the checkpoint holds)
        output_sizes = [n if row_parallel else n * tp for n in output_partition_sizes]
        part = partition(self.prefix, input_size=input_size, output_sizes=output_sizes, bits=self.bits,
                         group_size=self.config.group_size, row_parallel=row_parallel, tp=tp)
        assert part.in_features == input_size_per_partition and part.out_features == sum(output_partition_sizes)
        shapes = part.shapes(self.bits)
        loader = extra_weight_attrs["weight_loader"]
        q = torch.empty(shapes["qweight"], dtype=torch.uint8)
        if self.bits == 4:
            qweight = PackedvLLMParameter(data=q, input_dim=0, output_dim=1, packed_dim=0, packed_factor=2,
                                          weight_loader=loader)
        else:
            qweight = ModelWeightParameter(data=q, input_dim=0, output_dim=1, weight_loader=loader)
        layer.register_parameter("qweight", qweight)
        for name in ("scales", "zeros"):
            data = torch.empty(shapes[name], dtype=params_dtype)
            if part.meta_split_k:
                meta = GroupQuantScaleParameter(data=data, input_dim=0, output_dim=1, weight_loader=loader)
            else:
                meta = ChannelQuantScaleParameter(data=data, output_dim=1, weight_loader=loader)
            layer.register_parameter(name, meta)
        layer.quantpack_group_size = part.group_size
        layer.quantpack_shape = (part.out_features, part.in_features)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # (plain tensors from here on: the kernels and torch.compile need no weight loaders)
        for name in ("qweight", "scales", "zeros"):
            setattr(layer, name, torch.nn.Parameter(getattr(layer, name).data, requires_grad=False))
        layer.quantpack_plans = PlanCache()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
        if x.is_cuda:
            if torch.compiler.is_compiling():  # (one opaque op for vLLM's compiled and CUDA-graph-captured step)
                return torch.ops.quantpack.mixed_mm(x, qweight, scales, zeros, bias, layer.quantpack_group_size,
                                                    self.bits, 1, False)
            return kernels.mixed_mm(x, qweight, scales, zeros, group_size=layer.quantpack_group_size, bits=self.bits,
                                    axis=1, bias=bias, plans=layer.quantpack_plans)
        pw = PackedWeight(qweight, scales, zeros, self.bits, layer.quantpack_group_size, 1, layer.quantpack_shape)
        return reference.matmul(x, pw, bias)


def register() -> None:
    """Register :class:`QuantpackConfig` as vLLM's quantization method ``quantpack`` (idempotent)."""
    register_quantization_config(QUANT_METHOD)(QuantpackConfig)
