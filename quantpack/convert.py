"""``convert()``: turn a Hugging Face checkpoint into a packed quantpack checkpoint, streaming.

The conversion never holds the model: it reads one source tensor at a time, quantizes it (on a GPU
when there is one), and writes one output shard at a time, so peak memory is about the largest
tensor plus one output shard. Which tensors are quantized comes from the model's own structure
(its transformers class built on the meta device: the ``nn.Linear`` modules), not from names.

Crash safety: the output is built in ``<parent>/.<name>.qp-partial`` and renamed when complete; the
manifest is written last. ``progress.json`` there records each finished shard's sha256 (and its
tensors' digests), so a re-run with the same source and settings re-checks those shards and resumes
after them, producing a byte-identical result. See docs/format.md for everything written.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__
from .card import CARD_NAME, write_model_card
from .checkpoint import (
    CONFIG_NAME, MANIFEST_NAME, MANIFEST_VERSION, SAFE_INDEX_NAME, SHARD_METADATA, W8A8_CONFIG, WEIGHT_ONLY_SCHEMES,
    CheckpointError, SourceCheckpoint, dtype_name, is_disk_full, make_index, make_quantization_config, parse_size,
    read_manifest, safetensors_size, sha256_file, shard_name, weight_only_scheme, write_json, write_safetensors,
)
from .format import (
    LAYOUT_VERSION, MAX_GROUP_SIZE, MIN_GROUP_SIZE, SUPPORTED_AXES, SUPPORTED_BITS, check_layout_args, packed_shapes,
)
from .hub import resolve_source
from .nn import linear_dims
from .quantize import METHODS, quantize, resolve_group_size
from .quantize_w8a8 import MAX_IN_FEATURES as W8A8_MAX_IN_FEATURES, dequantize_w8a8, quantize_weight_w8a8
from .reference import dequantize

# sinq: hqq's solver after Sinkhorn column scales moved into the norms and producing rows (quantpack.sinq)
CONVERT_METHODS = (*METHODS, "sinq")

PARTIAL_SUFFIX = ".qp-partial"
GROUP_SIZE_MISFIT = "group size does not fit its shape"
LOCK_SUFFIX = ".qp-lock"
SCHEMES = WEIGHT_ONLY_SCHEMES + ("w8a8",)
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 128
DEFAULT_METHOD = "hqq"
PROGRESS_NAME = "progress.json"
OUTPUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)
_ROUTER_NAME = re.compile(r"(^|\.)(gate|router)$")
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


# ----------------------------------------------------------------------------------------------
# Results


@dataclass
class LayerResult:
    """One linear module: quantized (with its reconstruction error) or skipped (with the reason)."""

    name: str
    shape: tuple[int, int]  # (out_features, in_features), as quantized and stored
    bits: int | None = None
    group_size: int | None = None
    rel_error: float | None = None
    skipped: str | None = None  # the reason, when not quantized
    transposed: bool = False  # the source stores the weight (in, out) (GPT-2's Conv1D)
    source: str | None = None  # the checkpoint's module name, where it differs (e.g. one expert's matrix)


@dataclass
class ConvertSummary:
    source: str
    revision: str | None
    output: str
    dry_run: bool
    settings: dict
    layers: list[LayerResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    num_tensors: int = 0
    num_shards: int = 0
    resumed_shards: int = 0
    source_bytes: int = 0  # tensor data of the source weights
    output_bytes: int = 0  # size of the output shards (exact, also for a dry run)
    disk_free: int | None = None
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)  # seconds per phase: plan, read_wait, quantize, write, finish

    @property
    def quantized(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.skipped is None]

    @property
    def skipped(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.skipped is not None]

    @property
    def ratio(self) -> float:
        return self.source_bytes / self.output_bytes if self.output_bytes else float("nan")

    @property
    def mean_error(self) -> float | None:
        errs = [layer.rel_error for layer in self.quantized if layer.rel_error is not None]
        return sum(errs) / len(errs) if errs else None

    @property
    def worst(self) -> LayerResult | None:
        done = [layer for layer in self.quantized if layer.rel_error is not None]
        return max(done, key=lambda layer: layer.rel_error) if done else None

    @property
    def throughput(self) -> float | None:
        """Source bytes converted per second (None for a dry run)."""
        return self.source_bytes / self.seconds if self.seconds and not self.dry_run else None

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "source": self.source, "revision": self.revision, "output": self.output, "dry_run": self.dry_run,
            "settings": self.settings, "num_tensors": self.num_tensors, "num_shards": self.num_shards,
            "resumed_shards": self.resumed_shards,
            "layers_quantized": len(self.quantized), "layers_skipped": len(self.skipped),
            "source_bytes": self.source_bytes, "output_bytes": self.output_bytes,
            "compression_ratio": round(self.ratio, 4) if self.output_bytes else None,
            "mean_rel_error": self.mean_error, "worst_rel_error": worst.rel_error if worst else None,
            "worst_layer": worst.name if worst else None, "seconds": round(self.seconds, 3),
            "throughput_bytes_per_s": round(self.throughput) if self.throughput else None,
            "disk_free": self.disk_free, "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "warnings": self.warnings,
            "layers": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(layer).items()}
                       for layer in self.layers],
        }

    def format_plan(self) -> str:
        """One line per linear module: what a conversion does with it (``--dry-run`` prints this)."""
        width = max((len(layer.name) for layer in self.layers), default=0)
        lines = []
        for layer in self.layers:
            shape = f"{layer.shape[0]}x{layer.shape[1]}"
            if layer.skipped is None and self.settings.get("scheme") == "w8a8":
                lines.append(f"quantize  {layer.name:<{width}}  {shape:>11}  w8a8: int8 per output channel")
            elif layer.skipped is None:
                lines.append(f"quantize  {layer.name:<{width}}  {shape:>11}  {layer.bits}-bit, group {layer.group_size}")
            else:
                lines.append(f"keep      {layer.name:<{width}}  {shape:>11}  {layer.skipped}")
        lines.append(f"{self.num_tensors} output tensors in {self.num_shards} shard(s); other tensors are copied "
                     f"as {self.settings['dtype']}")
        return "\n".join(lines)

    def format_table(self) -> str:
        """The human summary printed at the end of ``quantpack convert`` (``warnings`` are apart: the
        command prints them on stderr)."""
        size = format_size

        rows = [("source", self.source + (f" @ {self.revision[:12]}" if self.revision else "")),
                ("output", self.output + ("  (dry run: nothing written)" if self.dry_run else "")),
                ("settings", ", ".join(f"{k}={v}" for k, v in self.settings.items() if k in
                                       ("scheme", "bits", "group_size", "axis", "method", "dtype", "device"))),
                ("layers quantized", str(len(self.quantized)))]
        reasons: dict[str, int] = {}
        for layer in self.skipped:
            reasons[layer.skipped] = reasons.get(layer.skipped, 0) + 1
        rows.append(("layers skipped", str(len(self.skipped))))
        for reason, count in sorted(reasons.items()):
            rows.append(("", f"{count} x {reason}"))
        rows += [("size before", size(self.source_bytes)),
                 ("size after", size(self.output_bytes) + (" (estimated)" if self.dry_run else "")),
                 ("compression", f"{self.ratio:.2f}x" if self.output_bytes else "-"),
                 ("shards", f"{self.num_shards}" + (f" ({self.resumed_shards} resumed)" if self.resumed_shards else ""))]
        if self.disk_free is not None:
            rows.append(("disk free", size(self.disk_free)))
        if self.mean_error is not None:
            worst = self.worst
            rows += [("mean layer error", f"{self.mean_error:.4f}"),
                     ("worst layer error", f"{worst.rel_error:.4f} ({worst.name})")]
        if not self.dry_run:
            rows.append(("time", f"{self.seconds:.1f} s"))
            if self.throughput:
                rows.append(("throughput", f"{size(self.throughput)}/s of source weights"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ----------------------------------------------------------------------------------------------
# Planning


@dataclass
class _Unit:
    """One step of the conversion: a source tensor copied (cast) or a linear weight quantized."""

    source: str  # source tensor name
    outputs: dict  # output name -> (shape, dtype)
    layer: LayerResult | None = None  # set when quantized

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.outputs.values())


def _parse_bits_for(bits_for) -> list[tuple[re.Pattern, int]]:
    items = bits_for.items() if isinstance(bits_for, dict) else bits_for
    out = []
    for item in items:
        if isinstance(item, str):
            pattern, sep, bits = item.rpartition("=")
            if not sep or not pattern:
                raise ValueError(f"bits_for={item!r}: expected REGEX=BITS, e.g. 'down_proj=8'")
        else:
            pattern, bits = item
        try:
            bits = int(bits)
        except ValueError:
            raise ValueError(f"bits_for={item!r}: bits must be 4 or 8") from None
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits_for={item!r}: bits must be 4 or 8")
        out.append((_compile(pattern, "bits_for"), bits))
    return out


def _compile(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what}={pattern!r} is not a valid regular expression ({e})") from None


def _model_structure(config_dict: dict, path: Path, weight_names, trust_remote_code: bool = False):
    """Build the model on the meta device from its config; return (model, config, head): ``head`` is
    the class name the config asks for when the checkpoint holds only that model's base model
    (unprefixed, no head weights: many sentence-embedding checkpoints), which is then what is built, as
    transformers' ``AutoModel`` does; else None."""
    import transformers

    from .hf_config import auto_config, model_class

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

    from .loader import _tied_targets

    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, PreTrainedModel) or base is model:
        return None
    if any(n.startswith(prefix + ".") for n in names):
        return None
    tied = _tied_targets(model)
    head = [k for k in model.state_dict() if not k.startswith(prefix + ".") and k not in tied]
    if not head or any(k in names for k in head) or not names & set(base.state_dict()):
        return None
    return base


def _linear_modules(model, weight_names: set[str]) -> tuple[dict[str, tuple], set[str], list]:
    """The model's linear modules (``nn.Linear`` and GPT-2's ``Conv1D``, see
    :func:`quantpack.nn.linear_dims`) with a weight in the checkpoint.

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


_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+)\.(?P<block>[^.]+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "gate_proj": "gate_proj", "w3": "up_proj", "up_proj": "up_proj",
                "w2": "down_proj", "down_proj": "down_proj"}


def _expert_tensors(model, names) -> tuple[dict[str, tuple[str, str, int]], dict[str, str]]:
    """Checkpoint tensors that are one expert's matrix of a fused experts block of the model (see
    :func:`quantpack.nn_experts.fused_experts_dims`): {tensor: (block path, projection, expert)},
    plus the renames of the blocks' parents ({``model.layers.0.block_sparse_moe.``:
    ``model.layers.0.mlp.``}) that the block's other tensors (the router) follow. A block is found
    by the decoder layer that holds it, so the checkpoint may name its parent differently."""
    from .nn_experts import fused_experts_dims

    by_layer: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if fused_experts_dims(module) is not None:
            by_layer.setdefault(path.rpartition(".")[0].rpartition(".")[0], []).append(path)
    experts, renames = {}, {}
    for name in names:
        m = _EXPERT_TENSOR.match(name)
        blocks = by_layer.get(m["layer"], []) if m and m["proj"] in _EXPERT_PROJ else []
        if len(blocks) == 1:
            experts[name] = (blocks[0], _EXPERT_PROJ[m["proj"]], int(m["e"]))
            renames[f"{m['layer']}.{m['block']}."] = blocks[0].rpartition(".")[0] + "."
    return experts, renames


def _canonical_names(model, names, experts=None, renames=None) -> tuple[dict[str, str], list[str]]:
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
        if name in experts:  # quantized into <block>.<projection>.<expert>
            block, proj, e = experts[name]
            mapping[name] = f"{block}.{proj}.{e}.weight"
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


def _check_complete(model, canonical: dict[str, str], expert_blocks) -> None:
    """Every tensor the model needs is in the checkpoint (by the loader's rule: its persistent
    parameters and buffers, a shared tensor once, tied weights excepted); a packed checkpoint without
    one would be refused by ``quantpack.load`` and ``verify``."""
    from .loader import _expected_tensors, _tied_targets

    expected, _ = _expected_tensors(model)
    provided, tied = set(canonical.values()), _tied_targets(model)
    blocks = tuple(f"{b}." for b in expert_blocks)  # a quantized experts block: checked in _plan_experts
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


def _plan_experts(model, src, expert_sources, summary, quant_plan, bits_overrides, skip_patterns, bits_rules,
                  bits, group_size, axis, w8a8) -> list[str]:
    """Plan every expert matrix of the model's fused experts blocks as a quantized layer
    ``<block>.<projection>.<expert>``; returns the blocks. A block is quantized whole (its
    replacement holds packed matrices only), so a --skip that selects part of it, a group size that
    does not fit, or a missing matrix is an error."""
    from .nn_experts import PROJECTIONS, fused_experts_dims

    found: dict[str, dict] = {}
    for tname, (block, proj, e) in expert_sources.items():
        found.setdefault(block, {})[(proj, e)] = tname
    for block, parts in sorted(found.items()):
        n_exp, hidden, inter = fused_experts_dims(model.get_submodule(block))
        want = {(p, e) for p in PROJECTIONS for e in range(n_exp)}
        if set(parts) != want:
            gap = sorted(want - set(parts)) or sorted(set(parts) - want)
            raise CheckpointError(f"source: the experts of {block} are incomplete or extra ({gap[0][0]} of expert "
                                  f"{gap[0][1]}); the checkpoint does not match its config.json")
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


def _nothing_to_quantize(layers: list[LayerResult], bits: int, group_size: int | None, axis: int) -> str:
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


def _expert_count(config) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        for key in _EXPERT_COUNT_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and value > 1:
                return value
    return None


def _tied(config) -> bool:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
            return True
    return False


def _resolve_dtype(dtype, src: SourceCheckpoint, linear_names) -> torch.dtype:
    if dtype in (None, "auto"):
        for name in linear_names:
            d = src.info(name + ".weight").dtype
            if d in (torch.float16, torch.bfloat16):
                return d
        return torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in OUTPUT_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use bfloat16 or float16")
        return OUTPUT_DTYPES[dtype]
    if dtype not in OUTPUT_DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; use torch.bfloat16 or torch.float16")
    return dtype


def _resolve_device(device: str) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"device={device!r} is not supported; use auto, cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(device)


def _natural_key(name: str) -> list:
    """``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def format_size(n: float) -> str:
    """Bytes for people: 512 B, 354.51 KB, 5.81 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000


def default_output_name(model_name: str, bits: int, group_size: int | None, scheme: str | None = None) -> str:
    if scheme == "w8a8":
        return f"{model_name}-qpw8a8"
    return f"{model_name}-qp{bits}" + (f"g{group_size}" if group_size else "pc")


def resolve_scheme(scheme: str | None, bits: int | None, group_size, axis: int, method: str | None,
                   bits_for) -> tuple[str, int, int | None, int, str]:
    """``(scheme, bits, group_size, axis, method)`` from :func:`convert`'s arguments.

    No scheme: ``w<bits>a16`` (bits default 4). ``w4a16``/``w8a16`` must agree with ``bits``. ``w8a8``
    fixes the weight quantization (8-bit, symmetric, one scale per output channel), so the
    weight-only arguments must be left at their defaults or name exactly that: ``bits`` None or 8,
    ``group_size`` the default 128 or None, ``axis`` 1, ``method`` None or ``"absmax"``, no ``bits_for``.
    """
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not supported; use one of {', '.join(SCHEMES)}")
    if scheme == "w8a8":
        if bits not in (None, 8):
            raise ValueError(f"bits={bits!r} does not apply to scheme='w8a8' (always int8); leave bits out")
        if group_size not in (DEFAULT_GROUP_SIZE, None):
            raise ValueError(f"group_size={group_size!r} does not apply to scheme='w8a8' (one scale per output "
                             f"channel); leave group_size out")
        if axis != 1:
            raise ValueError(f"axis={axis!r} does not apply to scheme='w8a8' (one scale per output channel); "
                             f"leave axis out")
        if method not in (None, W8A8_CONFIG["method"]):
            raise ValueError(f"method={method!r} does not apply to scheme='w8a8' (symmetric absmax rounding); "
                             f"leave method out")
        if bits_for:
            raise ValueError("bits_for does not apply to scheme='w8a8' (every quantized layer is int8); use skip "
                             "to leave layers unquantized")
        return scheme, W8A8_CONFIG["bits"], W8A8_CONFIG["group_size"], W8A8_CONFIG["axis"], W8A8_CONFIG["method"]
    if bits is None:
        bits = int(scheme[1]) if scheme is not None else DEFAULT_BITS
    if scheme is not None and scheme != weight_only_scheme(bits):
        raise ValueError(f"scheme={scheme!r} and bits={bits!r} disagree; pass one of them")
    return weight_only_scheme(bits), bits, group_size, axis, method or DEFAULT_METHOD


# ----------------------------------------------------------------------------------------------
# The conversion


def convert(source, output=None, *, bits: int | None = None, group_size: int | None = DEFAULT_GROUP_SIZE,
            axis: int = 1, method: str | None = None, scheme: str | None = None, dtype=None, device: str = "auto",
            skip=(), bits_for=(), quantize_lm_head: bool = False, max_shard_size="5GB", dry_run: bool = False,
            overwrite: bool = False, strict: bool = False, revision: str | None = None, token: str | None = None,
            allow_pickle: bool = False, progress: bool = True, trust_remote_code: bool = False) -> ConvertSummary:
    """Convert ``source`` (hub repo id or local directory) into a packed checkpoint at ``output``.

    ``scheme``: ``None`` (weight-only ``w<bits>a16``: ``bits`` 4 by default, ``method`` hqq by
    default; ``"sinq"`` first moves Sinkhorn column scales into the norms and producing rows of
    Llama-style decoder blocks where they lower the estimated error, see :mod:`quantpack.sinq`),
    ``"w4a16"``, ``"w8a16"``, or ``"w8a8"`` (int8 weights, one float32 scale per output channel, for
    the int8 x int8 kernels; the weight-only arguments ``bits``, ``group_size``,
    ``axis``, ``method`` and ``bits_for`` must then be left out, see :func:`resolve_scheme`).
    ``output`` defaults to ``<model-name>-qp<bits>g<group_size>`` (``<model-name>-qpw8a8``) in the
    current directory.
    ``skip``: regexes (``re.search`` on module names) of linear modules to leave unquantized;
    ``bits_for``: ``"REGEX=BITS"`` strings (or (regex, bits) pairs), first match wins.
    ``dtype`` (bfloat16/float16) is the output dtype of scales, zeros and every unquantized floating
    tensor; default: the source weights' dtype if half precision, else bfloat16.
    ``trust_remote_code``: let transformers run the Python code the checkpoint ships for its config and
    model (``auto_map``); off by default, so such a checkpoint is refused and nothing ever prompts.
    Raises ``ValueError`` (:class:`~quantpack.checkpoint.CheckpointError` for checkpoint and disk
    problems) with a one-line message on bad input, before anything is written when it can.
    """
    t0 = time.perf_counter()
    # -- arguments, cheapest checks first
    scheme, bits, group_size, axis, method = resolve_scheme(scheme, bits, group_size, axis, method, bits_for)
    w8a8 = scheme == "w8a8"
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use 4 or 8")
    if axis not in SUPPORTED_AXES:
        raise ValueError(f"axis={axis!r} is not supported; use 1 (groups along in-features) or 0")
    if method not in CONVERT_METHODS and not w8a8:
        raise ValueError(f"method={method!r} is not supported; use one of {', '.join(CONVERT_METHODS)}")
    if method == "sinq" and axis != 1:
        raise ValueError("method='sinq' balances input features, for groups along them; use axis=1")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size={group_size!r} must be a positive integer, or None for per-channel")
    if group_size is not None and not (group_size & (group_size - 1) == 0 and MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE):
        raise ValueError(f"group_size={group_size} must be a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}], "
                         f"or None for per-channel")
    if isinstance(skip, str):
        skip = (skip,)
    skip_patterns = [_compile(p, "skip") for p in skip]
    bits_rules = _parse_bits_for((bits_for,) if isinstance(bits_for, str) else bits_for)
    shard_limit = parse_size(max_shard_size)
    dev = _resolve_device(device)

    resolved = resolve_source(source, revision=revision, token=token, allow_pickle=allow_pickle)
    src = SourceCheckpoint(resolved.path, allow_pickle=allow_pickle)
    held = ExitStack()  # the output lock, once taken
    try:
        config_dict = src.config()
        if config_dict.get("quantization_config"):
            qm = config_dict["quantization_config"].get("quant_method", "unknown")
            raise CheckpointError(f"source: is already quantized (quant_method={qm!r}); convert from the original "
                                  f"floating-point checkpoint")
        weight_names = set(src.tensors)
        model, config, head = _model_structure(config_dict, resolved.path, weight_names, trust_remote_code)
        expert_sources, block_renames = _expert_tensors(model, src.tensors)
        canonical, dropped = _canonical_names(model, src.tensors, expert_sources, block_renames)
        linears, output_names, absent = _linear_modules(model, weight_names)
        out_dtype = _resolve_dtype(dtype, src, [found for _, found in linears.values()])
        settings = {"scheme": scheme, "bits": bits, "group_size": group_size, "axis": axis, "method": method,
                    "dtype": dtype_name(out_dtype), "skip": list(skip),
                    "bits_for": {p.pattern: b for p, b in bits_rules}, "quantize_lm_head": quantize_lm_head,
                    "max_shard_size": shard_limit}
        out_path = Path(output) if output is not None else Path(default_output_name(resolved.name, bits, group_size, scheme))
        out_path = out_path.expanduser().absolute()
        summary = ConvertSummary(source=resolved.repo, revision=resolved.revision, output=str(out_path),
                                 dry_run=dry_run, settings={**settings, "device": dev.type})

        # -- decide each linear module
        tied = _tied(config)
        for name, is_output in absent:
            module = model.get_submodule(name)
            reason = ("tied to the input embeddings (not stored)" if is_output and tied
                      else "no weight in the checkpoint")
            summary.layers.append(LayerResult(name, linear_dims(module)[:2], skipped=reason))
        experts = _expert_count(config)
        quant_plan: dict[str, LayerResult] = {}
        bits_overrides: dict[str, int] = {}
        if head:
            summary.warnings.append(f"{CONFIG_NAME} asks for {head}, but the checkpoint holds "
                                    f"only its base model's weights: converted as {type(model).__name__}, as "
                                    f"transformers' AutoModel loads it (recorded in the output's architectures)")
        if dropped:
            summary.warnings.append(f"dropped {len(dropped)} stored tensors that are not parameters of "
                                    f"{type(model).__name__} (transformers skips them too): "
                                    f"{', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}")
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
            elif _ROUTER_NAME.search(name) or (experts and out_features == experts):
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
        quantized_experts = _plan_experts(model, src, expert_sources, summary, quant_plan, bits_overrides,
                                          skip_patterns, bits_rules, bits, group_size, axis, w8a8)
        _check_complete(model, canonical, quantized_experts)
        summary.layers.sort(key=lambda layer: _natural_key(layer.name))
        # A pattern that selects nothing is almost always a typo: say so (and stop under --strict).
        for option, patterns in (("--skip", skip_patterns), ("--bits-for", [p for p, _ in bits_rules])):
            for pattern in patterns:
                if not any(pattern.search(name) for name in [*linears, *quant_plan]):
                    message = f"{option} {pattern.pattern} matches no linear layer"
                    if strict:
                        raise ValueError(f"{message} (--strict); check the pattern against the layer names "
                                         f"(--dry-run lists them)")
                    summary.warnings.append(message)
        if not quant_plan:
            raise ValueError(_nothing_to_quantize(summary.layers, bits, group_size, axis))

        # -- units in source order, then shards
        units = []
        for tname, info in src.tensors.items():
            if tname not in canonical:
                continue  # dropped: the model ignores it
            out_name = canonical[tname]
            module = out_name[: -len(".weight")] if out_name.endswith(".weight") else None
            if module in quant_plan and w8a8:
                layer = quant_plan[module]
                units.append(_Unit(tname, {f"{module}.qweight": (layer.shape, torch.int8),
                                           f"{module}.weight_scale": ((layer.shape[0],), torch.float32)}, layer))
            elif module in quant_plan:
                layer = quant_plan[module]
                shapes = packed_shapes(layer.shape, layer.bits, layer.group_size, axis)
                units.append(_Unit(tname, {f"{module}.qweight": (shapes["qweight"], torch.uint8),
                                           f"{module}.scales": (shapes["scales"], out_dtype),
                                           f"{module}.zeros": (shapes["zeros"], out_dtype)}, layer))
            else:
                out_t = out_dtype if info.dtype.is_floating_point else info.dtype
                units.append(_Unit(tname, {out_name: (info.shape, out_t)}))
        shards: list[list[_Unit]] = [[]]
        running = 0
        for unit in units:
            if shards[-1] and running + unit.nbytes > shard_limit:
                shards.append([])
                running = 0
            shards[-1].append(unit)
            running += unit.nbytes
        names = [shard_name(i + 1, len(shards)) for i in range(len(shards))]
        shard_sizes = [safetensors_size({n: sd for u in s for n, sd in u.outputs.items()}, SHARD_METADATA)
                       for s in shards]
        summary.num_tensors = sum(len(u.outputs) for u in units)
        summary.num_shards = len(shards)
        summary.source_bytes = src.total_bytes
        summary.output_bytes = sum(shard_sizes)
        other_files = src.other_files()
        needed = summary.output_bytes + sum((resolved.path / f).stat().st_size for f in other_files) + (1 << 20)

        # -- output location, disk space
        partial = out_path.parent / f".{out_path.name}{PARTIAL_SUFFIX}"
        check_replaceable_output(out_path, resolved.path, overwrite)
        probe = out_path.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise CheckpointError(f"output: cannot create {out_path}: {probe} is not a directory; choose another --output")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise CheckpointError(f"output: cannot create {out_path}: {probe} is not writable; choose another --output")
        if resolved.local and out_path.resolve().is_relative_to(resolved.path):
            raise CheckpointError(f"output: {out_path} is inside the source checkpoint {resolved.path}; "
                                  f"choose an --output outside it")
        summary.disk_free = shutil.disk_usage(probe).free
        already = sum(f.stat().st_size for f in partial.glob("*.safetensors")) if partial.is_dir() else 0
        if summary.disk_free + already < needed:
            raise CheckpointError(f"output: needs about {format_size(needed)} free on {probe} but only "
                                  f"{format_size(summary.disk_free)} is available; free space or choose another --output")
        summary.timings["plan"] = time.perf_counter() - t0
        if dry_run:
            summary.seconds = time.perf_counter() - t0
            return summary

        created = not partial.exists()
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(OutputLock(out_path))
            check_replaceable_output(out_path, resolved.path, overwrite)  # again: another run may have finished
            partial.mkdir(exist_ok=True)
            if not os.access(partial, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise CheckpointError(f"output: cannot create {e.filename or partial}: {e.strerror or e}; choose a "
                                  f"writable --output") from None

        # -- inputs are hashed in the background while converting
        input_files = sorted(set(src.weight_files) | set(other_files) | {CONFIG_NAME} |
                             ({src.index_file} if src.index_file else set()))
        hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qp-hash")
        input_hashes = {f: hasher.submit(sha256_file, resolved.path / f) for f in input_files}

        fingerprint = _fingerprint(resolved, src, settings, dev, names)
        done = _resume_state(partial, fingerprint, names, summary.settings)
        summary.resumed_shards = len(done)
        rescale = {}
        if method == "sinq":
            from . import sinq

            source_of = {v: k for k, v in canonical.items()}
            rescale, kept = sinq.plan(source_of, lambda n: src.get(source_of[n]), config, bits=bits,
                                      group_size=group_size, device=dev)
            rescale = {source_of[n]: v for n, v in rescale.items()}
            settings["sinq_scales"] = kept  # recorded (not fingerprinted: derived), so verify can redo them
        try:
            _write_shards(src, shards, names, partial, done, fingerprint, scheme, axis,
                          "hqq" if method == "sinq" else method, dev, out_dtype, progress, summary, rescale)
            t_finish = time.perf_counter()
            # -- the small files, then the manifest last
            for rel in other_files:
                target = partial / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(resolved.path / rel, target)
            write_model_card(partial, resolved=resolved, settings=settings, summary=summary,
                             name=default_output_name(resolved.name, bits, group_size, scheme))
            quant_config = make_quantization_config(
                bits=bits, group_size=group_size, axis=axis, method=method,
                modules_not_converted=[layer.name for layer in summary.skipped if layer.name in linears],
                bits_overrides=bits_overrides, version=__version__, scheme=scheme, quantized_experts=quantized_experts)
            new_config = {**config_dict, "quantization_config": quant_config}
            if head:  # what was built, so that loading and verifying build the same
                new_config["architectures"] = [type(model).__name__]
            for key in ("dtype", "torch_dtype"):
                if key in new_config or key == "dtype":
                    new_config[key] = dtype_name(out_dtype)
            write_json(partial / CONFIG_NAME, new_config)
            weight_map = {n: names[i] for i, shard in enumerate(shards) for u in shard for n in u.outputs}
            data_bytes = sum(u.nbytes for u in units)
            write_json(partial / SAFE_INDEX_NAME, make_index(weight_map, data_bytes))
            outputs = {name: done[name] for name in names}
            for rel in sorted(set(other_files) | {CONFIG_NAME, SAFE_INDEX_NAME, CARD_NAME}):
                outputs[rel] = {"sha256": sha256_file(partial / rel), "size": (partial / rel).stat().st_size}
            inputs = {}
            for rel, fut in input_hashes.items():
                inputs[rel] = {"sha256": fut.result(), "size": (resolved.path / rel).stat().st_size}
            manifest = {
                "manifest_version": MANIFEST_VERSION, "quantpack_version": __version__,
                "layout_version": LAYOUT_VERSION,
                "source": {"repo": resolved.repo, "revision": resolved.revision, "local": resolved.local},
                "settings": {**settings, "device": dev.type},  # the device kind the codes were computed on
                "files": {"inputs": inputs, "outputs": dict(sorted(outputs.items()))},
                "layers": [{"name": layer.name, "bits": layer.bits, "group_size": layer.group_size,
                            "shape": list(layer.shape), "rel_error": layer.rel_error,
                            **({"source_transposed": True} if layer.transposed else {}),
                            **({"source": layer.source} if layer.source else {})}
                           for layer in summary.quantized],
                "skipped": [{"name": layer.name, "reason": layer.skipped} for layer in summary.skipped],
                "totals": {"source_bytes": summary.source_bytes, "output_bytes": summary.output_bytes,
                           "params_quantized": sum(layer.shape[0] * layer.shape[1] for layer in summary.quantized)},
            }
            (partial / PROGRESS_NAME).unlink(missing_ok=True)
            write_json(partial / MANIFEST_NAME, manifest)
            _fsync_dir(partial)
            _publish(partial, out_path, resolved.path, overwrite)
            summary.timings["finish"] = time.perf_counter() - t_finish
        except CheckpointError:  # a bad source value: nothing of this run is worth keeping for a resume
            if created:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        except OSError as e:
            if is_disk_full(e):
                raise CheckpointError(f"output: disk full while writing {partial} ({e.strerror}); free space and "
                                      f"re-run the same command to resume") from None
            raise CheckpointError(f"output: cannot write {partial}: {e.strerror or e}") from None
        finally:
            hasher.shutdown(wait=True, cancel_futures=True)
        summary.seconds = time.perf_counter() - t0
        return summary
    finally:
        held.close()
        src.close()


def _fingerprint(resolved, src: SourceCheckpoint, settings: dict, dev: torch.device, names: list[str]) -> str:
    """What a resumed run must share with the interrupted one: quantpack version, settings, device
    kind, the shard plan, and the source weight files' names, sizes and modification times."""
    files = []
    for rel in src.weight_files:
        st = (resolved.path / rel).stat()
        files.append([rel, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"version": __version__, "settings": settings, "device": dev.type, "shards": names,
                       "files": files, "source": resolved.repo, "revision": resolved.revision}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _resume_state(partial: Path, fingerprint: str, names: list[str], settings: dict) -> dict:
    """Finished shards of an interrupted run with the same fingerprint, re-hashed; anything else in
    the partial directory is discarded (after saying so, when it is finished work made otherwise)."""
    progress_file = partial / PROGRESS_NAME
    done = {}
    try:
        state = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    except ValueError:
        state = {}
    if not isinstance(state, dict):
        state = {}
    if state.get("fingerprint") == fingerprint:
        for name, entry in state.get("shards", {}).items():
            f = partial / name
            # A shard without its tensors' digests (progress written before they existed) is redone.
            if (name in names and isinstance(entry.get("tensors"), dict) and f.is_file()
                    and f.stat().st_size == entry["size"] and sha256_file(f) == entry["sha256"]):
                done[name] = entry
    elif state.get("shards"):
        before = state.get("settings")
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k)) \
            if isinstance(before, dict) else []
        what = (", ".join(f"{k} {before.get(k)!r} -> {settings.get(k)!r}" for k in changed) if changed
                else "other settings, source files or quantpack version")
        logger.warning(f"discarding the earlier partial conversion in {partial} ({len(state['shards'])} finished "
                       f"shard(s)), made with {'other settings: ' if changed else ''}{what}")
    for f in partial.iterdir():
        if f.name not in done and f.name != PROGRESS_NAME:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    return done


def _write_progress(partial: Path, fingerprint: str, done: dict, settings: dict) -> None:
    write_json(partial / PROGRESS_NAME, {"fingerprint": fingerprint, "settings": settings, "shards": done})


class OutputLock:
    """An exclusive lock on converting into one output directory: ``.<name>.qp-lock`` beside it,
    holding the owner's pid. The lock is the kernel's (``flock``), so it ends with its process
    and a crashed run never blocks the next one."""

    def __init__(self, out_path: Path):
        self.out_path = out_path
        self.path = out_path.parent / f".{out_path.name}{LOCK_SUFFIX}"
        self.fd: int | None = None

    def __enter__(self):
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                raise CheckpointError(f"output: another conversion (pid {holder if holder.isdigit() else 'unknown'}) "
                                      f"is writing {self.out_path}; wait for it to finish or choose another "
                                      f"--output") from None
            try:  # the holder before us unlinks the file on release: lock the file at the path, not an old one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc):
        try:
            self.path.unlink(missing_ok=True)  # still held: a waiter's inode check sees it gone
        finally:
            os.close(self.fd)
            self.fd = None


def _write_shards(src, shards, names, partial, done, fingerprint, scheme, axis, method, dev, out_dtype, progress,
                  summary, rescale=None):
    """``rescale``: {source tensor: (row, column factors)} applied before quantizing or copying."""
    from tqdm.auto import tqdm

    todo_bytes = sum(src.info(u.source).nbytes for i, s in enumerate(shards) if names[i] not in done for u in s)
    bar = tqdm(total=todo_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    # Finished shards carry their layers' errors, so a resumed manifest equals an uninterrupted one.
    for name in names:
        for rec in done.get(name, {}).get("layers", []):
            layer = next(l for l in summary.layers if l.name == rec["name"])
            layer.rel_error = rec["rel_error"]
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qp-read")  # read the next tensor meanwhile
    timings = summary.timings
    for key in ("read_wait", "quantize", "write"):
        timings[key] = 0.0
    try:
        for i, shard in enumerate(shards):
            if names[i] in done:
                continue
            bar.set_postfix_str(f"shard {i + 1}/{len(shards)}")
            tensors, layers = {}, []
            pending = reader.submit(src.get, shard[0].source)
            for j, unit in enumerate(shard):
                t = time.perf_counter()
                tensor = pending.result()
                timings["read_wait"] += time.perf_counter() - t
                if j + 1 < len(shard):
                    pending = reader.submit(src.get, shard[j + 1].source)
                _check_finite(src, unit.source, tensor)
                if rescale and unit.source in rescale:
                    from .sinq import scale_tensor

                    tensor = scale_tensor(tensor.float(), *rescale[unit.source])  # one rounding, at the end
                if unit.layer is None:
                    (out_name, (_, out_t)), = unit.outputs.items()
                    out = tensors[out_name] = tensor.to(out_t) if tensor.dtype != out_t else tensor
                    if out is not tensor and out.is_floating_point() and not bool(torch.isfinite(out).all()):
                        raise CheckpointError(f"source: tensor {unit.source}: values up to "
                                              f"{float(tensor.abs().max()):.3g} do not fit in {dtype_name(out_t)}; "
                                              f"pass --dtype bfloat16, or fix the checkpoint")
                else:
                    t = time.perf_counter()
                    layer = unit.layer
                    quantize_layer = _quantize_layer_w8a8 if scheme == "w8a8" else _quantize_layer
                    weight = tensor.t().contiguous() if layer.transposed else tensor  # stored as (out, in)
                    packed = quantize_layer(weight, layer, axis, method, dev, out_dtype)
                    if not math.isfinite(layer.rel_error) or not all(bool(torch.isfinite(v).all()) for v in
                                                                    packed.values() if v.is_floating_point()):
                        raise CheckpointError(f"source: tensor {unit.source}: values up to "
                                              f"{float(tensor.abs().max()):.3g} overflow the {dtype_name(out_dtype)} "
                                              f"scales when quantized; pass --dtype bfloat16, --skip the layer, or "
                                              f"fix the checkpoint")
                    tensors.update(packed)
                    layers.append({"name": layer.name, "rel_error": layer.rel_error})
                    timings["quantize"] += time.perf_counter() - t
                bar.update(src.info(unit.source).nbytes)
                del tensor
            t = time.perf_counter()
            digests: dict[str, str] = {}
            sha, size = write_safetensors(partial / names[i], tensors, SHARD_METADATA, digests=digests)
            timings["write"] += time.perf_counter() - t
            del tensors
            done[names[i]] = {"sha256": sha, "size": size, "tensors": dict(sorted(digests.items())), "layers": layers}
            _write_progress(partial, fingerprint, done, summary.settings)
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        bar.close()
    for entry in done.values():
        entry.pop("layers", None)


def _check_finite(src: SourceCheckpoint, name: str, tensor: torch.Tensor) -> None:
    """A NaN or infinity in a source tensor would be copied or quantized into garbage: refuse it, by name."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"source: tensor {name} in {src.info(name).file.name}: {bad} of {tensor.numel()} "
                              f"values are NaN or infinite; the checkpoint is damaged: download it again")


def _rel_error(deq: torch.Tensor, w: torch.Tensor) -> float:
    """``||deq - w|| / ||w||`` in float32, both scaled by a power of two near ``max |w|`` first: exact the
    same for ordinary weights, and finite for huge ones (3e38) whose squares overflow float32."""
    scale = torch.exp2(torch.floor(torch.log2(w.abs().amax().clamp_min(1e-30))))
    err = torch.linalg.vector_norm((deq - w) / scale) / torch.linalg.vector_norm(w / scale).clamp_min(1e-30)
    return float(f"{float(err):.6g}")


@torch.no_grad()
def _quantize_layer(weight, layer: LayerResult, axis, method, dev, out_dtype) -> dict[str, torch.Tensor]:
    w = weight.to(dev, non_blocking=False)
    pw = quantize(w, bits=layer.bits, group_size=layer.group_size, axis=axis, method=method, dtype=out_dtype)
    layer.rel_error = _rel_error(dequantize(pw, torch.float32), w.float())
    module = layer.name
    return {f"{module}.qweight": pw.qweight.cpu(), f"{module}.scales": pw.scales.cpu(), f"{module}.zeros": pw.zeros.cpu()}


@torch.no_grad()
def _quantize_layer_w8a8(weight, layer: LayerResult, axis, method, dev, out_dtype) -> dict[str, torch.Tensor]:
    """Symmetric int8 per output channel (docs/format.md, W8A8); the scale stays float32."""
    w = weight.to(dev, non_blocking=False)
    qweight, weight_scale = quantize_weight_w8a8(w)
    layer.rel_error = _rel_error(dequantize_w8a8(qweight, weight_scale), w.float())
    return {f"{layer.name}.qweight": qweight.cpu(), f"{layer.name}.weight_scale": weight_scale.cpu()}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_quantpack_output(path: Path) -> bool:
    """Whether ``path`` is a finished quantpack output: its manifest says so."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return False
    return isinstance(manifest, dict) and "manifest_version" in manifest and "quantpack_version" in manifest


def check_replaceable_output(out_path: Path, source: Path, overwrite: bool) -> None:
    """Refuse an existing ``out_path`` that a conversion may not replace (one-line CheckpointError).

    An empty directory is used as is; a finished quantpack output is replaced only with ``overwrite``;
    anything else (a file, a symbolic link, a folder quantpack did not write, the current directory or
    one above it, the source or a folder holding it) is never replaced: replacing deletes it.
    """
    if not out_path.exists() and not out_path.is_symlink():
        return
    real = out_path.resolve()
    if out_path.is_symlink():
        raise CheckpointError(f"output: {out_path} is a symbolic link (to {real}); pass a directory path, or "
                              f"choose another --output")
    if not out_path.is_dir():
        raise CheckpointError(f"output: {out_path} is a file, not a directory; choose another --output")
    cwd = Path.cwd().resolve()
    source = Path(source).resolve()
    if real == cwd or cwd.is_relative_to(real):
        what = "is the current directory" if real == cwd else "contains the current directory"
        raise CheckpointError(f"output: {out_path} {what}, which quantpack never replaces; choose another --output")
    if real == source or source.is_relative_to(real):
        what = "is the source checkpoint" if real == source else f"contains the source checkpoint {source}"
        raise CheckpointError(f"output: {out_path} {what}, which quantpack never replaces; choose another --output")
    if not any(out_path.iterdir()):
        return
    if not is_quantpack_output(out_path):
        raise CheckpointError(f"output: {out_path} already exists and is not a quantpack output (no valid "
                              f"{MANIFEST_NAME}); quantpack replaces only its own outputs: choose another --output")
    if not overwrite:
        raise CheckpointError(f"output: {out_path} already exists (a finished conversion); pass --overwrite to "
                              f"replace it or choose another --output")


def _publish(partial: Path, out_path: Path, source: Path, overwrite: bool) -> None:
    """Rename the finished directory into place: an existing output is checked again (something may
    have appeared while converting), then swapped out so that it survives a crash until the new one
    is in place."""
    check_replaceable_output(out_path, source, overwrite)
    if out_path.exists() and any(out_path.iterdir()):
        old = out_path.parent / f".{out_path.name}.qp-old"
        if old.exists() and is_quantpack_output(old):  # left by a crash between the renames below
            shutil.rmtree(old)
        os.rename(out_path, old)
        os.rename(partial, out_path)
        shutil.rmtree(old)
    else:
        os.rename(partial, out_path)  # replaces an empty directory atomically
    _fsync_dir(out_path.parent)
