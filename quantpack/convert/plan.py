"""Planning a conversion from the model's own structure (its transformers class on the meta device): which
linear modules and experts are quantized, the name each source tensor is stored under, and the units of work."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CONFIG_NAME, CheckpointError, dtype_name
from ..quantization.w8a8 import MAX_IN_FEATURES as W8A8_MAX_IN_FEATURES
from ..format import MAX_GROUP_SIZE, MIN_GROUP_SIZE, check_layout_args
from ..modules.linear import linear_dims
from ..quantization.groupwise import resolve_group_size
from .summary import LayerResult

GROUP_SIZE_MISFIT = "group size does not fit its shape"
ROUTER_NAME = re.compile(r"(^|\.)(gate|router)$")
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class Unit:
    """One step of the conversion: a source tensor copied (cast) or a linear weight quantized."""

    source: str  # source tensor name
    outputs: dict  # output name -> (shape, dtype)
    layer: LayerResult | None = None  # set when quantized

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.outputs.values())


# Blocks of a decoder or encoder stack, as transformers names them: "model.layers.3.", "transformer.h.3.",
# "encoder.layer.3.", "encoder.block.3." (every index in a name counts, so nested stacks never undercount)
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.)")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def check_layer_count(config_dict: dict, path: Path, weight_names) -> None:
    """Refuse a config that claims more layers than the weights hold, before building the model
    (a config claiming 100,000 layers would take minutes and gigabytes to build and then fail)."""
    stored = [int(i) for n in weight_names for i in _BLOCK_INDEX.findall(n)]
    if not stored:
        return  # no stack transformers names as above: the later completeness check judges
    found = max(stored) + 1
    for cfg in (config_dict, config_dict.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        for key in _LAYER_COUNT_KEYS:
            claimed = cfg.get(key)
            if type(claimed) is int and claimed > found:
                where = key if cfg is config_dict else f"text_config.{key}"
                raise CheckpointError(f"{path / CONFIG_NAME}: {where}={claimed} but the weights hold only {found} "
                                      f"layers; the config does not match the weights: download them again")


def model_structure(config_dict: dict, path: Path, weight_names, trust_remote_code: bool = False):
    """Build the model on the meta device from its config; return (model, config, head): ``head`` is
    the class name the config asks for when the checkpoint holds only that model's base model
    (unprefixed, no head weights: many sentence-embedding checkpoints), which is then what is built, as
    transformers' ``AutoModel`` does; else None."""
    import transformers

    from ..hf_config import auto_config, model_class

    check_layer_count(config_dict, path, weight_names)
    config = auto_config(path, trust_remote_code=trust_remote_code, config=config_dict)
    cls = model_class(config, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        try:
            model = cls(config)
        except Exception as e:  # transformers raises many kinds for a config it cannot build
            first = " ".join(str(e).split())[:160]
            raise CheckpointError(f"{path / CONFIG_NAME}: transformers {transformers.__version__} cannot build "
                                  f"{cls.__name__} from it ({type(e).__name__}: {first})") from None
        base = _stored_base_model(model, set(weight_names))
        if base is not None:
            return type(base)(config), config, cls.__name__
    return model, config, None


def _stored_base_model(model, names: set[str]):
    """``model``'s base model when the checkpoint ``names`` are that base model's weights without the
    ``base_model_prefix`` and hold none of the head's own (untied) weights; else None. A head whose
    weights are all tied to the base (GPT-2's lm_head) leaves nothing to tell, so it is kept."""
    from transformers import PreTrainedModel

    from ..modules.replace import tied_targets

    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, PreTrainedModel) or base is model:
        return None
    if any(n.startswith(prefix + ".") for n in names):
        return None
    tied = tied_targets(model)
    head = [k for k in model.state_dict() if not k.startswith(prefix + ".") and k not in tied]
    if not head or any(k in names for k in head) or not names & set(base.state_dict()):
        return None
    return base


def linear_modules(model, weight_names: set[str]) -> tuple[dict[str, tuple], set[str], list]:
    """The model's linear modules (``nn.Linear`` and GPT-2's ``Conv1D``, see
    :func:`quantpack.modules.linear.linear_dims`) with a weight in the checkpoint.

    Returns (linears, output_embedding_names, absent): linears maps the model's module name to
    (module, the checkpoint's name for it: the same, or with/without ``base_model_prefix``);
    absent lists (name, is_output_embeddings) of linear modules with no weight in the checkpoint
    (e.g. a tied lm_head).
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears, output_names, absent = {}, set(), []
    for name, module in model.named_modules():
        if linear_dims(module) is None:
            continue
        found = next((c for c in _prefix_variants(name, prefix) if f"{c}.weight" in weight_names), None)
        if found is None:
            absent.append((name, module is out_emb))
            continue
        linears[name] = (module, found)
        if module is out_emb:
            output_names.add(name)
    return linears, output_names, absent


def _prefix_variants(name: str, prefix: str) -> list[str]:
    """``name`` and its spellings with ``base_model_prefix`` added or removed (checkpoints of a
    base model and of a model with a head name the same weights differently)."""
    out = [name]
    if prefix:
        out.append(f"{prefix}.{name}")
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1:])
    return out


_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+)\.(?P<block>[^.]+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\."
                            r"(?P<field>weight|bias)$")
_EXPERT_PROJ = {"w1": "gate_proj", "gate_proj": "gate_proj", "w3": "up_proj", "up_proj": "up_proj",
                "w2": "down_proj", "down_proj": "down_proj"}


def expert_tensors(model, names) -> tuple[dict[str, tuple[str, str, int]], dict[str, str]]:
    """Checkpoint tensors that are one expert's matrix (``.weight``) or bias (``.bias``) of an experts block of the
    model (see :func:`quantpack.modules.experts.experts_block`; a stacked block's tensors as
    quantpack.checkpoint.experts splits them): {tensor: (block path, projection, expert)}, plus the renames of
    the blocks' parents ({``model.layers.0.block_sparse_moe.``: ``model.layers.0.mlp.``}) that the block's other
    tensors (the router) follow. A block is found by the decoder layer that holds it, so the checkpoint may name its
    parent differently."""
    from ..modules.experts import experts_block

    by_layer: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if experts_block(module) is not None:
            by_layer.setdefault(path.rpartition(".")[0].rpartition(".")[0], []).append(path)
    experts, renames = {}, {}
    for name in names:
        m = _EXPERT_TENSOR.match(name)
        blocks = by_layer.get(m["layer"], []) if m and m["proj"] in _EXPERT_PROJ else []
        if len(blocks) == 1:
            experts[name] = (blocks[0], _EXPERT_PROJ[m["proj"]], int(m["e"]))
            renames[f"{m['layer']}.{m['block']}."] = blocks[0].rpartition(".")[0] + "."
    return experts, renames


def canonical_names(model, names, experts=None, renames=None) -> tuple[dict[str, str], list[str]]:
    """Map each checkpoint tensor name to the model's state-dict name (the packed checkpoint always
    uses those, so loaders need no renaming). Returns (mapping, dropped): dropped are tensors that are
    not parameters of the model, which transformers skips when loading too (GPT-2's stored causal
    masks, old checkpoints' ``rotary_emb.inv_freq``). Where transformers has a conversion for this
    architecture instead (it renames or merges such tensors at load: per-expert MoE weights fused
    into 3-D tensors), quantpack cannot follow it yet and refuses: a packed checkpoint without them
    would be a different model."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys = set(model.state_dict(keep_vars=True))
    experts, renames = experts or {}, renames or {}
    mapping, unknown = {}, []
    for name in names:
        if name in experts:  # quantized into <block>.<projection>.<expert> (a bias stored beside it)
            block, proj, e = experts[name]
            mapping[name] = f"{block}.{proj}.{e}.{name.rpartition('.')[2]}"
            continue
        renamed = next((new + name[len(old):] for old, new in renames.items() if name.startswith(old)), name)
        key = next((c for c in _prefix_variants(renamed, prefix) if c in keys), None)
        if key is not None:
            mapping[name] = key
        else:
            unknown.append(name)
    if unknown and _load_time_conversion(model):
        import transformers

        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"source: tensor {unknown[0]}{more} is not a parameter of {type(model).__name__}: "
                              f"transformers {transformers.__version__} renames or merges such tensors when it loads "
                              f"this architecture (e.g. per-expert MoE weights into 3-D tensors), which quantpack "
                              f"does not support yet; convert a model whose stored names match its parameters")
    return mapping, unknown


def check_complete(model, canonical: dict[str, str], expert_blocks) -> None:
    """Every tensor the model needs is in the checkpoint (by the loader's rule: its persistent
    parameters and buffers, a shared tensor once, tied weights excepted); a packed checkpoint without
    one would be refused by ``quantpack.load`` and ``verify``."""
    from ..checkpoint.integrity import expected_tensors
    from ..modules.replace import tied_targets

    expected, _ = expected_tensors(model)
    provided, tied = set(canonical.values()), tied_targets(model)
    blocks = tuple(f"{b}." for b in expert_blocks)  # a quantized experts block: checked in plan_experts
    missing = [n for n in expected if n not in provided and n not in tied and not n.startswith(blocks)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"source: tensor {missing[0]}{more} of {type(model).__name__} is missing from the "
                              f"checkpoint; it is incomplete or does not match its {CONFIG_NAME}: download it again")


def _load_time_conversion(model) -> bool:
    """Whether transformers renames or merges this architecture's checkpoint tensors when loading."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers without load-time conversions
        return False
    return bool(get_checkpoint_conversion_mapping(getattr(model.config, "model_type", None)))


def check_expert_blocks(model) -> None:
    """Refuse, naming it, a mixture-of-experts block that quantpack cannot quantize (one that holds its experts as
    stacked parameters other than :func:`quantpack.modules.experts.experts_block`'s): converting would keep its
    experts, nearly all the weights, in full precision."""
    from ..modules.experts import experts_block, llama4_moe_form

    for name, module in model.named_modules():
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if not stacked or "expert" not in (name.rpartition(".")[2] + type(module).__name__).lower():
            continue
        spec = experts_block(module)
        if spec is not None and spec.form == "llama4" and not llama4_moe_form(model.get_submodule(
                name.rpartition(".")[0])):
            spec = None  # (its parent must route the top-k as Llama 4's does)
        if spec is None:
            raise ValueError(f"{name}: quantpack does not quantize this mixture-of-experts block "
                             f"({type(module).__name__}) yet; the blocks it does are Mixtral's, Qwen2/3-MoE's, "
                             f"OLMoE's, DeepSeek-V2/V3's (gate_up_proj (E, 2I, H), down_proj (E, H, I)), "
                             f"gpt-oss's and Llama 4's")


def plan_experts(model, src, expert_sources, summary, quant_plan, bits_overrides, skip_patterns, bits_rules,
                  bits, group_size, axis, w8a8) -> list[str]:
    """Plan every expert matrix of the model's fused experts blocks as a quantized layer
    ``<block>.<projection>.<expert>``; returns the blocks. A block is quantized whole (its
    replacement holds packed matrices only), so a --skip that selects part of it, a group size that
    does not fit, or a missing matrix is an error."""
    from ..modules.experts import PROJECTIONS, experts_block

    found: dict[str, dict] = {}
    biases: dict[str, set] = {}
    for tname, (block, proj, e) in expert_sources.items():
        if tname.endswith(".bias"):
            biases.setdefault(block, set()).add((proj, e))
        else:
            found.setdefault(block, {})[(proj, e)] = tname
    for block, parts in sorted(found.items()):
        spec = experts_block(model.get_submodule(block))
        n_exp, hidden, inter = spec.num_experts, spec.hidden, spec.intermediate
        want = {(p, e) for p in PROJECTIONS for e in range(n_exp)}
        for what, got in (("", set(parts)), (" biases", biases.get(block, set()) if spec.bias else set())):
            if got != want and (what == "" or spec.bias):
                gap = sorted(want - got) or sorted(got - want)
                raise CheckpointError(f"source: the experts{what} of {block} are incomplete or extra ({gap[0][0]} "
                                      f"of expert {gap[0][1]}); the checkpoint does not match its config.json")
        if w8a8:
            raise ValueError(f"{block}: --scheme w8a8 does not quantize mixture-of-experts blocks yet; use the "
                             f"weight-only schemes (w4a16, w8a16)")
        for (proj, e), tname in sorted(parts.items(), key=lambda kv: (kv[0][1], PROJECTIONS.index(kv[0][0]))):
            name = f"{block}.{proj}.{e}"
            shape = (inter, hidden) if proj != "down_proj" else (hidden, inter)
            info = src.info(tname)
            if tuple(info.shape) != shape:
                raise CheckpointError(f"source: {tname} has shape {tuple(info.shape)} but the config says {shape}; "
                                      f"the checkpoint does not match its config.json")
            matched = next((p for p in skip_patterns if p.search(name)), None)
            if matched is not None:
                raise ValueError(f"--skip {matched.pattern} selects {name}, one matrix of the experts block {block}; "
                                 f"a block is quantized whole: skip none or all of it is not supported yet")
            layer_bits = next((b for p, b in bits_rules if p.search(name)), bits)
            if (proj, e) == (PROJECTIONS[0], 0):  # (first in this order: the block's width)
                block_bits = layer_bits
            if layer_bits != block_bits:
                raise ValueError(f"--bits-for gives {name} {layer_bits} bits but {block}.gate_proj.0 {block_bits}; "
                                 f"an experts block is quantized whole with one bit width: select all of it or none")
            if axis != 1:
                raise ValueError(f"{block}: --axis {axis}: experts are packed with groups along in-features; use "
                                 f"--axis 1 for a model with experts")
            gs = resolve_group_size(group_size, shape, axis)
            try:
                check_layout_args(shape, layer_bits, gs, axis)
            except ValueError as e:
                raise ValueError(f"{name}: {e} (an experts block is quantized whole)") from None
            layer = LayerResult(name, shape, bits=layer_bits, group_size=gs, source=tname[: -len(".weight")])
            summary.layers.append(layer)
            quant_plan[name] = layer
            if layer_bits != bits:
                bits_overrides[name] = layer_bits
    return sorted(found)


def nothing_to_quantize(layers: list[LayerResult], bits: int, group_size: int | None, axis: int) -> str:
    """Why no layer is quantized, naming the option to change and one layer it applies to."""
    if not layers:
        return "nothing to quantize: the model has no linear layers (nn.Linear, Conv1D) with weights in the checkpoint"
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.skipped] = counts.get(layer.skipped, 0) + 1
    kept = "; ".join(f"{n} x {reason}" for reason, n in sorted(counts.items()))
    misfit = next((layer for layer in layers if layer.skipped == GROUP_SIZE_MISFIT), None)
    if misfit is not None:
        length = misfit.shape[1] if axis == 1 else misfit.shape[0]
        dim = "in_features" if axis == 1 else "out_features"
        fits = []
        for g in [2 ** i for i in range(MAX_GROUP_SIZE.bit_length() - 1, MIN_GROUP_SIZE.bit_length() - 2, -1)]:
            try:
                check_layout_args(misfit.shape, bits, g, axis)
                fits.append(g)
            except ValueError:
                pass
        hint = f"--group-size {fits[0]} (or none)" if fits else "--bits 8 --group-size none"
        return (f"nothing to quantize: --group-size {group_size} fits no linear layer (e.g. {misfit.name}, "
                f"{dim}={length}); {hint} fits it (layers kept: {kept})")
    skipped = next((layer for layer in layers if layer.skipped.startswith("matches --skip ")), None)
    if skipped is not None:
        return (f"nothing to quantize: --skip leaves no linear layer (e.g. {skipped.name} {skipped.skipped}; layers "
                f"kept: {kept}); narrow the --skip patterns (--dry-run lists the layers)")
    return f"nothing to quantize: every linear layer is kept ({kept})"


def expert_count(config) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        for key in EXPERT_COUNT_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and value > 1:
                return value
    return None


def tied_word_embeddings(config) -> bool:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
            return True
    return False


def natural_key(name: str) -> list:
    """``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_linears(linears: dict, src, summary, args, *, output_names, tied: bool, experts: int | None,
                 quantize_lm_head: bool, strict: bool) -> tuple[dict[str, LayerResult], dict[str, int]]:
    """Decide each linear module: quantized (with its bits and group size) or skipped (with the reason, in
    ``summary.layers``). Returns the quantized layers by name and the bits that differ from ``args.bits``."""
    skip_patterns, bits_rules, bits, group_size, axis = (args.skip_patterns, args.bits_rules, args.bits,
                                                        args.group_size, args.axis)
    w8a8 = args.scheme == "w8a8"
    quant_plan: dict[str, LayerResult] = {}
    bits_overrides: dict[str, int] = {}
    for name, (module, src_name) in linears.items():
        info = src.info(src_name + ".weight")
        out_features, in_features, transposed = linear_dims(module)
        shape = (out_features, in_features)
        layer = LayerResult(name, shape, transposed=transposed)
        summary.layers.append(layer)
        stored = shape[::-1] if transposed else shape
        if tuple(info.shape) != stored:
            raise CheckpointError(f"source: {src_name}.weight has shape {tuple(info.shape)} but the config says "
                                  f"{stored}; the checkpoint does not match its config.json")
        matched = next((p for p in skip_patterns if p.search(name)), None)
        if name in output_names and not quantize_lm_head:
            layer.skipped = "output embeddings (pass --quantize-lm-head to quantize)"
        elif name in output_names and tied:
            layer.skipped = "output embeddings tied to the input embeddings"
        elif matched is not None:
            layer.skipped = f"matches --skip {matched.pattern}"
        elif ROUTER_NAME.search(name) or (experts and out_features == experts):
            layer.skipped = "MoE router"
        if layer.skipped:
            continue
        if not info.dtype.is_floating_point or info.dtype.itemsize < 2:
            raise CheckpointError(f"source: {name}.weight has dtype {dtype_name(info.dtype)}; quantpack converts "
                                  f"floating-point (fp32/bf16/fp16) weights, not integer or fp8 ones; use the "
                                  f"original checkpoint")
        layer_bits = next((b for p, b in bits_rules if p.search(name)), bits)
        gs = resolve_group_size(group_size, shape, axis)
        if w8a8 and shape[1] > W8A8_MAX_IN_FEATURES:
            message = (f"{name}: in_features={shape[1]} exceeds {W8A8_MAX_IN_FEATURES}, the most the W8A8 "
                       f"kernel's int32 accumulator holds")
            if strict:
                raise ValueError(f"{message} (--strict); pass --skip for it") from None
            layer.skipped = "too many in-features for int32 accumulation (w8a8)"
            summary.warnings.append(f"skipped {message}")
            continue
        try:
            check_layout_args(shape, layer_bits, gs, axis)
        except ValueError as e:
            message = f"{name}: {e}"
            if strict:
                raise ValueError(f"{message} (--strict); pass --skip for it or choose another group size") from None
            layer.skipped = GROUP_SIZE_MISFIT
            summary.warnings.append(f"skipped {message}")
            continue
        layer.bits, layer.group_size = layer_bits, gs
        quant_plan[name] = layer
        if layer_bits != bits:
            bits_overrides[name] = layer_bits
    return quant_plan, bits_overrides
