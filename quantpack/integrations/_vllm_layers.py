"""vLLM's side of the quantpack plugin: the ``quantpack`` quantization config, linear method and experts method.

Imported (hence vLLM imported) only by :func:`quantpack.integrations.vllm.register`, which vLLM calls
through the ``vllm.general_plugins`` entry point. The packed tensors load shard by shard through
vLLM's parameter classes (docs/serving.md has the mapping); the layers run quantpack's fused
kernels wherever Triton runs (CUDA, with the custom op ``torch.ops.quantpack.mixed_mm`` while vLLM compiles; the
CPU under ``TRITON_INTERPRET=1``, how the tests run this path without a GPU) and the reference path elsewhere.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe import GateLinear, RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase, QKVParallelLinear, ReplicatedLinear,
                                               RowParallelLinear, UnquantizedLinearMethod,
                                               register_weight_loader_v2_supported_method)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import WeightsMapper
from vllm.model_executor.parameter import (ChannelQuantScaleParameter, GroupQuantScaleParameter,
                                           ModelWeightParameter, PackedvLLMParameter)
from vllm.model_executor.utils import set_weight_attrs

from .. import kernels, reference
from ..checkpoint import QUANT_METHOD, WEIGHT_ONLY_SCHEMES, CheckpointError, read_quantization_config
from ..format import PackedExperts, PackedWeight
from ..kernels.dequant import triton_usable
from ..kernels.launch_plan import PlanCache
from ..kernels.moe import fused_experts
from ..kernels.moe.mma_experts import MmaExperts, mma_layout_usable
from .vllm_sharding import partition


def _refuse(message: str) -> CheckpointError:
    return CheckpointError(f"quantpack: {message}")


# quantpack stores an experts block one matrix per expert and projection as ``<block>.<proj>.<e>.<tensor>``; vLLM's
# expert loaders (``make_expert_params_mapping``) look for ``<block>.<e>.<proj>.<tensor>``.
_EXPERT_TENSOR = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)\.(\d+)\.")
# Blocks that quantpack names as transformers 5 holds them in memory while vLLM keeps the hub's module name.
_BLOCK_RENAMES = {"MixtralForCausalLM": {re.compile(r"\.mlp\.(experts|gate)\."): r".block_sparse_moe.\1."}}
# Expert activations quantpack's expert kernels and reference run (vLLM's names are the same).
_EXPERT_ACTIVATIONS = {"silu", "gelu", "gelu_tanh"}


def _block_renames() -> dict:
    architectures = getattr(get_current_vllm_config().model_config, "architectures", None) or []
    return {k: v for arch in architectures for k, v in _BLOCK_RENAMES.get(arch, {}).items()}


def _vllm_block_name(name: str, renames: dict) -> str:
    """vLLM's module name of the checkpoint's experts block ``name``."""
    name += "."
    for pattern, new in renames.items():
        name = pattern.sub(new, name)
    return name[:-1]


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
        if qc["axis"] != 1:
            raise _refuse("axis=0 checkpoints (groups along out-features) are not served by the vLLM plugin; "
                          "re-convert with --axis 1 (the default)")
        return cls(qc)

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:
        """Checkpoint tensor names vLLM's model loaders expect (applied to every tensor before the model's own
        mapper): each expert's ``<block>.<proj>.<e>.`` as ``<block>.<e>.<proj>.``, and the block renames above."""
        return WeightsMapper(orig_to_new_regex={_EXPERT_TENSOR: r".experts.\2.\1.", **_block_renames()})

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
            return QuantpackExpertsMethod(self, prefix, layer.moe_config)
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
        if skipped or isinstance(layer, GateLinear):  # (quantpack never quantizes a router)
            return UnquantizedLinearMethod()
        permute = False
        if isinstance(layer, QKVParallelLinear):  # (a layer built outside an engine has no model config)
            hf_config = getattr(get_current_vllm_config().model_config, "hf_config", None)
            permute = bool(_ROTARY_PERMUTED.intersection(getattr(hf_config, "architectures", None) or []))
        return QuantpackLinearMethod(self, prefix, self.bits_for(prefix), permute_qk=permute)


# Models whose vLLM loader reorders q_proj's and k_proj's out-features within each head (pairs (2i, 2i + 1) to
# (i, i + head_dim / 2)) for its rotary embedding, on tensors named ``weight`` only: the plugin reorders the columns of
# quantpack's q/k tensors the same way once they are loaded (quantpack.load runs transformers' own order).
_ROTARY_PERMUTED = {"Llama4ForCausalLM", "Llama4ForConditionalGeneration"}


def rotary_order(heads: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Column indices of ``heads`` heads of ``head_dim`` from ``offset`` in the order vLLM's Llama 4 loader gives
    their rows: new column h d + j d/2 + i takes old column h d + 2 i + j."""
    return offset + torch.arange(heads * head_dim).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


@register_weight_loader_v2_supported_method
class QuantpackLinearMethod(LinearMethodBase):
    """Weight-only packed linear layer (any parallel kind) over quantpack's layout, split by vLLM's loaders.

    ``qweight`` (K/2 or K, N) splits along N for column-parallel layers and along K (packed rows) for
    row-parallel ones; grouped ``scales``/``zeros`` (K/g, N) the same way; per-channel ones (1, N)
    only along N (every rank of a row-parallel layer keeps the row)."""

    def __init__(self, config: QuantpackConfig, prefix: str, bits: int, permute_qk: bool = False):
        self.config, self.prefix, self.bits, self.permute_qk = config, prefix, bits, permute_qk

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
        columns = None
        if self.permute_qk:  # (this rank's q heads, then its k heads, then v: see _ROTARY_PERMUTED)
            q, k, d = layer.num_heads, layer.num_kv_heads, layer.head_size
            n = layer.qweight.shape[1]
            columns = torch.cat([rotary_order(q, d), rotary_order(k, d, q * d), torch.arange((q + k) * d, n)])
        for name in ("qweight", "scales", "zeros"):
            data = getattr(layer, name).data
            if columns is not None:
                data = data[:, columns.to(data.device)].contiguous()
            setattr(layer, name, torch.nn.Parameter(data, requires_grad=False))
        layer.quantpack_plans = PlanCache()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
        if triton_usable(x):
            if x.is_cuda and torch.compiler.is_compiling():  # (one opaque op for vLLM's compiled, captured step)
                return torch.ops.quantpack.mixed_mm(x, qweight, scales, zeros, bias, layer.quantpack_group_size,
                                                    self.bits, 1, False)
            return kernels.mixed_mm(x, qweight, scales, zeros, group_size=layer.quantpack_group_size, bits=self.bits,
                                    axis=1, bias=bias, plans=layer.quantpack_plans)
        pw = PackedWeight(qweight, scales, zeros, self.bits, layer.quantpack_group_size, 1, layer.quantpack_shape)
        return reference.matmul(x, pw, bias)


class QuantpackExpertsMethod(FusedMoEMethodBase):
    """A mixture-of-experts block (vLLM's ``FusedMoE``) over quantpack's stacked layout
    (:class:`~quantpack.format.PackedExperts`): ``w13_*`` holds each expert's gate and up matrices merged along N
    (gate rows first), ``w2_*`` its down matrix, as (E, K/2 or K, N) ``qweight`` and (E, K/g, N) ``scales``/
    ``zeros``. Tensor parallelism splits w13 along N and w2 along K (both the intermediate size), vLLM's loaders
    placing each expert's checkpoint matrix in its slot and shard; expert parallelism keeps this rank's experts.
    After loading, the qweights move into the tensor-core decode layout where it fits (``quantpack_mma``)."""

    def __init__(self, config: QuantpackConfig, prefix: str, moe):
        super().__init__(moe)
        self.config, self.prefix = config, prefix
        renames = _block_renames()
        blocks = [b for b in config.qc["quantized_experts"] if _vllm_block_name(b, renames) == prefix]
        if not blocks:
            raise _refuse(f"mixture-of-experts layer {prefix} is not among the checkpoint's quantized experts blocks "
                          f"(quantization_config.quantized_experts); the checkpoint does not match the model: "
                          f"re-convert it")
        self.block = blocks[0]
        if moe.activation.value not in _EXPERT_ACTIVATIONS:
            raise _refuse(f"mixture-of-experts layer {prefix}: activation {moe.activation.value!r} is not served by "
                          f"the vLLM plugin ({', '.join(sorted(_EXPERT_ACTIVATIONS))} are); serve it with "
                          f"quantpack.load")
        self.bits = {"w13": self._bits(("gate_proj", "up_proj"), moe.num_experts),
                     "w2": self._bits(("down_proj",), moe.num_experts)}

    def _bits(self, projections, num_experts: int) -> int:
        qc = self.config.qc
        bits = {qc["bits_overrides"].get(f"{self.block}.{p}.{e}", qc["bits"])
                for p in projections for e in range(num_experts)}
        if len(bits) > 1:
            raise _refuse(f"mixture-of-experts layer {self.prefix} stores {' and '.join(projections)} of its experts "
                          f"with different bits ({sorted(bits)}); re-convert with the same bits for all of them")
        return bits.pop()

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        moe = layer.moe_config
        tp, intermediate = moe.moe_parallel_config.tp_size, moe.intermediate_size
        group_size = self.config.group_size
        parts = {"w13": partition(f"{self.prefix}.gate_up_proj", input_size=hidden_size,
                                  output_sizes=[intermediate, intermediate], bits=self.bits["w13"],
                                  group_size=group_size, row_parallel=False, tp=tp),
                 "w2": partition(f"{self.prefix}.down_proj", input_size=intermediate, output_sizes=[hidden_size],
                                 bits=self.bits["w2"], group_size=group_size, row_parallel=True, tp=tp)}
        assert parts["w2"].in_features == intermediate_size_per_partition
        # (our tensors are (K, N): "transposed" to vLLM, so its loader splits w1/w3 along N and w2 along K; grouped
        # scales split with K, per-channel ones are replicated over w2's ranks)
        scheme = FusedMoeWeightScaleSupported.GROUP if group_size else FusedMoeWeightScaleSupported.CHANNEL
        attrs = {**extra_weight_attrs, "is_transposed": True, "quant_method": scheme.value}
        for stem, part in parts.items():
            shapes = part.shapes(self.bits[stem])
            for name, dtype in (("qweight", torch.uint8), ("scales", params_dtype), ("zeros", params_dtype)):
                param = torch.nn.Parameter(torch.empty(num_experts, *shapes[name], dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{stem}_{name}", param)
                set_weight_attrs(param, attrs)
            setattr(layer, f"quantpack_{stem}", (part.group_size, (part.out_features, part.in_features)))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # (plain tensors from here on: the kernels and torch.compile need no weight loaders)
        for stem in ("w13", "w2"):
            for name in ("qweight", "scales", "zeros"):
                full = f"{stem}_{name}"
                setattr(layer, full, torch.nn.Parameter(getattr(layer, full).data, requires_grad=False))
        # where it fits, the experts' 4-bit weights move into the tensor-core decode layout (same bytes, one stack
        # at a time), as quantpack.load keeps them on a GPU: decode runs the mma kernel per expert
        stacks = [self._packed(layer, stem) for stem in ("w13", "w2")]
        layer.quantpack_mma = mma_layout_usable(stacks, layer.w13_qweight.device,
                                                weight_on_input=layer.apply_router_weight_on_input)
        if layer.quantpack_mma:
            for stem, pe in zip(("w13", "w2"), stacks):
                setattr(layer, f"{stem}_qweight", torch.nn.Parameter(MmaExperts.from_packed(pe).words,
                                                                     requires_grad=False))

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # (apply runs quantpack's own kernels, not vLLM's modular ones)

    def _packed(self, layer: torch.nn.Module, stem: str) -> PackedExperts | MmaExperts:
        group_size, shape = getattr(layer, f"quantpack_{stem}")
        tensors = (getattr(layer, f"{stem}_qweight"), getattr(layer, f"{stem}_scales"), getattr(layer, f"{stem}_zeros"))
        if getattr(layer, "quantpack_mma", False):
            return MmaExperts(*tensors, group_size, shape)
        return PackedExperts(*tensors, self.bits[stem], group_size, shape)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if layer.expert_map is not None:  # (expert parallelism: global ids -> this rank's, -1 = another rank's)
            topk_ids = layer.expert_map[topk_ids.long()]
        # (the fused kernels wherever Triton runs, else the reference: fused_experts decides)
        return fused_experts(x, self._packed(layer, "w13"), self._packed(layer, "w2"), topk_ids, topk_weights,
                             activation=layer.activation.value, weight_on_input=layer.apply_router_weight_on_input)


def register() -> None:
    """Register :class:`QuantpackConfig` as vLLM's quantization method ``quantpack`` (idempotent)."""
    register_quantization_config(QUANT_METHOD)(QuantpackConfig)
