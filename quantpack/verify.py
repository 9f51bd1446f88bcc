"""``verify()``: what a packed checkpoint cost, and whether its files can be trusted.

A report in four sections, each building on the one before:

* **integrity**: ``config.json`` and its ``quantization_config`` (layout version, scheme), the
  manifest ``quantpack.json`` (every output file's size and sha256), the shard index against the
  shard headers, every tensor's shape and dtype against the model the config describes, and every
  floating-point value finite. A file whose checksum differs is searched for the tensors that
  changed: by the per-tensor sha256 the manifest records (no reference needed), or, for manifests
  written before those existed, by comparing with the reference weights when there is a reference.
* **layers**: each quantized layer dequantized and compared with the reference weight
  (relative Frobenius error), worst layers first.
* **kernels**: for each distinct quantized layer layout, the module's forward on the device (the
  fused Triton kernel on a GPU, the reference path on the CPU) on random inputs against its
  scheme's float32 oracle (a float32 matmul with the dequantized weight; for W8A8 the exact
  result on the same int8 values).
* **end_to_end**: the packed and the reference model on the same text: for causal LMs the
  perplexity of both, mean and 99th-percentile KL divergence of the next-token distributions and
  top-1 agreement; for encoders the cosine similarity of mean-pooled embeddings.

Thresholds turn numbers into a verdict: ``pass`` (exit code 0), ``fail`` (a check failed: 1) or
``corrupt`` (problems in the files: 2). docs/verify.md documents the JSON schema
(:data:`REPORT_SCHEMA`).

Schemes plug in through :func:`register_module_type`: a quantized module class says how to
dequantize it, what float32 result its forward must match, with what tolerance, and (optionally)
how to find which of its stored tensors changed.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import __version__, checkpoint, sinq
from .checkpoint import CheckpointError, TensorInfo
from .format import LAYOUT_VERSION, unpack
from .nn import QuantLinear
from .nn_w8a8 import W8A8Linear
from .tiny import quiet_transformers

SCHEMA_VERSION = 1
# Kinds of problems in the files, in the order they are reported (the first is the CLI's error line).
PROBLEM_KINDS = ("layout", "config", "manifest", "missing_file", "checksum", "index", "missing_tensor", "shape",
                 "dtype", "unexpected_tensor", "values")
DEFAULT_MAX_KL = 0.1
DEFAULT_MIN_TOP1 = 0.8
DEFAULT_MIN_COSINE = 0.99
# Top-1 agreement is judged only where the reference is confident: its top token's probability at least this much
# above the second's. A flip there needs the packed distribution to move by half this margin in total variation,
# hence (Pinsker) a KL of at least MARGIN**2 / 2 = 0.02 nats at that position: real drift, not noise between
# near-equal logits.
CONFIDENT_MARGIN = 0.2
MIN_CONFIDENT_POSITIONS = 32  # fewer: the top-1 check is skipped (and the report says why); KL judges alone
DEFAULT_CONTEXT_LENGTH = 512
DEFAULT_MAX_TOKENS = 8192
WORST_LAYERS = 10
KERNEL_ROWS = (1, 17, 128)  # GEMV, a ragged small batch, a tensor-core tile
KERNEL_SEED = 0

# The built-in evaluation passage: plain English prose, a few hundred tokens.
DEFAULT_TEXT = """\
The harbour town woke slowly on winter mornings. Before the sun cleared the hills, the baker had
already lit his ovens, and the smell of bread drifted down the narrow streets toward the water.
Fishermen checked their nets by lantern light, talking quietly about the weather and the price of
fuel, while gulls waited on the railings for anything that might fall from a crate.

At eight o'clock the school bell rang, and children ran past the post office with their coats
open and their scarves trailing behind them. The postmistress, who had worked there for thirty
years, knew every family by the letters they received: seed catalogues in February, postcards
from cousins in the summer, and in December a small mountain of parcels that filled the back room.

Most visitors came for the lighthouse. It stood on a rock at the end of the long stone pier, and
on clear days you could see it from the main road, white against the grey sea. A retired engineer
gave tours on Saturdays. He explained how the great lens gathered the light of a single lamp into
a beam that sailors could see twenty miles away, and how the keepers once wound the clockwork by
hand every few hours through the night. Nobody lives in the tower now; the light is automatic,
and a computer in the city reports when a bulb needs changing.

In the afternoon the wind usually picked up. Boats came back in pairs, low in the water, and the
market filled with buyers who argued cheerfully over boxes of cod and mackerel. By evening the
cafes along the front were warm and crowded. People read newspapers, played cards, and watched the
rain move across the bay in long silver curtains. When the last ferry left at nine, the town grew
quiet again, and only the steady turning of the lighthouse beam marked the passing of the hours.
"""


# ----------------------------------------------------------------------------------------------
# The JSON schema of VerifyReport.to_dict() (docs/verify.md shows it and a test keeps them equal)

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
_LAYER = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "shape", "bits", "group_size", "rel_error", "manifest_rel_error"],
    "properties": {"name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
                   "bits": {"type": ["integer", "null"]}, "group_size": {"type": ["integer", "null"]},
                   "rel_error": _NUM, "manifest_rel_error": _NUM},
}
REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "quantpack verify report",
    "type": "object",
    "additionalProperties": False,
    "required": ["schema_version", "quantpack_version", "packed", "reference", "device", "verdict", "exit_code",
                 "integrity", "layers", "kernels", "end_to_end", "thresholds", "checks", "skipped", "warnings",
                 "seconds"],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "quantpack_version": {"type": "string"},
        "packed": {"type": "string"},
        "reference": {
            "type": ["object", "null"], "additionalProperties": False,
            "required": ["source", "revision", "local", "path", "from_manifest"],
            "properties": {"source": {"type": "string"}, "revision": _STR, "local": {"type": "boolean"},
                           "path": {"type": "string"}, "from_manifest": {"type": "boolean"},
                           "matches_manifest": {"type": ["boolean", "null"]}},
        },
        "device": {"type": "string"},
        "verdict": {"type": "string", "enum": ["pass", "fail", "corrupt"]},
        "exit_code": {"type": "integer", "enum": [0, 1, 2]},
        "integrity": {
            "type": "object", "additionalProperties": False,
            "required": ["ok", "files_checked", "tensors_checked", "problems"],
            "properties": {
                "ok": {"type": "boolean"},
                "files_checked": {"type": "integer", "minimum": 0},
                "tensors_checked": {"type": "integer", "minimum": 0},
                "problems": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["kind", "file", "tensor", "message"],
                    "properties": {"kind": {"type": "string", "enum": list(PROBLEM_KINDS)}, "file": _STR, "tensor": _STR,
                                   "message": {"type": "string"}}}},
            },
        },
        "layers": {
            "type": ["object", "null"], "additionalProperties": False,
            "required": ["count", "mean_rel_error", "max_rel_error", "worst", "items", "missing"],
            "properties": {"count": {"type": "integer", "minimum": 0}, "mean_rel_error": _NUM, "max_rel_error": _NUM,
                           "worst": {"type": "array", "items": _LAYER}, "items": {"type": "array", "items": _LAYER},
                           "missing": {"type": "array", "items": {"type": "string"}}},
        },
        "kernels": {
            "type": ["object", "null"], "additionalProperties": False, "required": ["path", "rows", "seed", "items"],
            "properties": {
                "path": {"type": "string", "enum": ["triton", "reference"]},
                "rows": {"type": "array", "items": {"type": "integer"}},
                "seed": {"type": "integer"},
                "items": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["module_type", "shape", "layout", "dtype", "bias", "example", "layers", "rel_error",
                                 "tolerance", "passed"],
                    "properties": {"module_type": {"type": "string"},
                                   "shape": {"type": "array", "items": {"type": "integer"}},
                                   "layout": {"type": "object"}, "dtype": {"type": "string"},
                                   "bias": {"type": "boolean"}, "example": {"type": "string"},
                                   "layers": {"type": "integer", "minimum": 1}, "rel_error": _NUM,
                                   "tolerance": {"type": "number"}, "passed": {"type": "boolean"}}}},
            },
        },
        "end_to_end": {
            "type": ["object", "null"], "additionalProperties": False, "required": ["task", "settings", "metrics"],
            "properties": {
                "task": {"type": "string", "enum": ["causal_lm", "encoder"]},
                "settings": {
                    "type": "object", "additionalProperties": False,
                    "required": ["text", "text_sha256", "tokens", "positions", "sequences", "context_length",
                                 "max_tokens", "truncated", "packed_dtype", "reference_dtype", "device"],
                    "properties": {"text": {"type": "string"}, "text_sha256": {"type": "string"},
                                   "tokens": {"type": "integer"}, "positions": {"type": "integer"},
                                   "sequences": {"type": "integer"}, "context_length": {"type": "integer"},
                                   "max_tokens": {"type": "integer"}, "truncated": {"type": "boolean"},
                                   "packed_dtype": {"type": "string"}, "reference_dtype": {"type": "string"},
                                   "device": {"type": "string"}},
                },
                "metrics": {"oneOf": [
                    {"type": "object", "additionalProperties": False,
                     "required": ["perplexity_reference", "perplexity_packed", "kl_mean", "kl_p99", "top1_agreement",
                                  "top1_agreement_confident", "confident_positions"],
                     "properties": {"perplexity_reference": _NUM, "perplexity_packed": _NUM, "kl_mean": _NUM,
                                    "kl_p99": _NUM, "top1_agreement": _NUM, "top1_agreement_confident": _NUM,
                                    "confident_positions": {"type": "integer", "minimum": 0}}},
                    {"type": "object", "additionalProperties": False,
                     "required": ["cosine_mean", "cosine_min", "pooling"],
                     "properties": {"cosine_mean": _NUM, "cosine_min": _NUM,
                                    "pooling": {"type": "string", "enum": ["mean"]}}},
                ]},
            },
        },
        "thresholds": {
            "type": "object", "additionalProperties": False,
            "required": ["max_kl", "min_top1", "min_cosine", "max_layer_error"],
            "properties": {"max_kl": _NUM, "min_top1": _NUM, "min_cosine": _NUM, "max_layer_error": _NUM},
        },
        "checks": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "value", "threshold", "op", "passed"],
            "properties": {"name": {"type": "string"}, "value": _NUM, "threshold": _NUM,
                           "op": {"type": "string", "enum": ["<=", ">="]}, "passed": {"type": "boolean"}}}},
        "skipped": {"type": "object", "additionalProperties": {"type": "string"}},
        "warnings": {"type": "array", "items": {"type": "string"}},
        "seconds": {"type": "number", "minimum": 0},
    },
}


# ----------------------------------------------------------------------------------------------
# The report


@dataclass
class Problem:
    """Something wrong in the files: which file and (when it could be found) which tensor."""

    kind: str  # one of PROBLEM_KINDS
    message: str
    file: str | None = None
    tensor: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "file": self.file, "tensor": self.tensor, "message": self.message}


@dataclass
class Check:
    """One thresholded number (or a pass/fail fact such as a kernel agreeing with float32)."""

    name: str
    value: float | None
    threshold: float | None
    op: str  # "<=" or ">="
    passed: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "threshold": self.threshold, "op": self.op,
                "passed": self.passed}


@dataclass
class VerifyReport:
    """The result of :func:`verify`; :meth:`to_dict` follows :data:`REPORT_SCHEMA` (docs/verify.md)."""

    packed: str
    device: str
    reference: dict | None = None
    integrity: dict = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    layers: dict | None = None
    kernels: dict | None = None
    end_to_end: dict | None = None
    thresholds: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # section -> why it did not run
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.problems:
            return "corrupt"
        return "pass" if all(c.passed for c in self.checks) else "fail"

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1, "corrupt": 2}[self.verdict]

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def first_problem(self) -> str | None:
        """One line for an error message: the first problem, and how many more there are."""
        if not self.problems:
            return None
        more = len(self.problems) - 1
        return self.problems[0].message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")

    def to_dict(self) -> dict:
        return checkpoint.finite_or_none({
            "schema_version": SCHEMA_VERSION,
            "quantpack_version": __version__,
            "packed": self.packed,
            "reference": self.reference,
            "device": self.device,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "integrity": {**self.integrity, "ok": not self.problems,
                          "problems": [p.to_dict() for p in self.problems]},
            "layers": self.layers,
            "kernels": self.kernels,
            "end_to_end": self.end_to_end,
            "thresholds": self.thresholds,
            "checks": [c.to_dict() for c in self.checks],
            "skipped": self.skipped,
            "warnings": self.warnings,
            "seconds": round(self.seconds, 3),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def format_table(self) -> str:
        """The human-readable report printed by ``quantpack verify``."""
        lines = [f"packed     {self.packed}"]
        if self.reference:
            ref = self.reference["source"] + (f" @ {self.reference['revision'][:12]}" if self.reference.get("revision") else "")
            lines.append(f"reference  {ref}")
        lines.append(f"device     {self.device}")
        lines.append("")
        integ = self.integrity
        lines.append(f"integrity  {'ok' if not self.problems else 'PROBLEMS'}: {integ.get('files_checked', 0)} files, "
                     f"{integ.get('tensors_checked', 0)} tensors checked")
        for p in self.problems:
            lines.append(f"  ! {p.message}")
        if self.layers:
            lay = self.layers
            lines.append(f"layers     {lay['count']} quantized; relative error mean {lay['mean_rel_error']:.4f}, "
                         f"max {lay['max_rel_error']:.4f}")
            width = max(len(x["name"]) for x in lay["worst"])
            lines.append(f"  {'worst layers':<{width}}  {'bits':>4}  {'shape':>11}  {'rel error':>9}")
            for x in lay["worst"]:
                shape = "x".join(str(d) for d in x["shape"])
                lines.append(f"  {x['name']:<{width}}  {x['bits'] if x['bits'] is not None else '-':>4}  "
                             f"{shape:>11}  {x['rel_error']:>9.4f}")
        if self.kernels:
            k = self.kernels
            lines.append(f"kernels    {k['path']} path vs float32 oracle, rows {', '.join(map(str, k['rows']))}")
            for x in k["items"]:
                shape = "x".join(str(d) for d in x["shape"])
                layout = ", ".join(f"{key}={val}" for key, val in x["layout"].items())
                lines.append(f"  {x['module_type']} {shape} ({layout}; {x['layers']} layers): rel error "
                             f"{x['rel_error']:.2e} (tolerance {x['tolerance']:.1e}) {'ok' if x['passed'] else 'FAIL'}")
        if self.end_to_end:
            e = self.end_to_end
            s, m = e["settings"], e["metrics"]
            lines.append(f"end to end {e['task']}: {s['tokens']} tokens in {s['sequences']} sequence(s) of at most "
                         f"{s['context_length']}, text {s['text']}, packed {s['packed_dtype']} vs reference "
                         f"{s['reference_dtype']}")
            if e["task"] == "causal_lm":
                lines += [f"  perplexity  reference {m['perplexity_reference']:.3f}, packed {m['perplexity_packed']:.3f}",
                          f"  KL          mean {m['kl_mean']:.5f}, p99 {m['kl_p99']:.5f} (nats per token)",
                          f"  top-1       {m['top1_agreement']:.2%} agreement; "
                          + (f"{m['top1_agreement_confident']:.2%}" if m["top1_agreement_confident"] is not None else "n/a")
                          + f" over the {m['confident_positions']} positions where the reference is confident"]
            else:
                lines.append(f"  cosine      mean {m['cosine_mean']:.5f}, min {m['cosine_min']:.5f} "
                             f"({m['pooling']}-pooled embeddings)")
        for section, why in self.skipped.items():
            lines.append(f"skipped    {section}: {why}")
        if self.checks:
            lines.append("")
            for c in self.checks:
                if c.threshold is None:
                    lines.append(f"check      {c.name}: {'ok' if c.passed else 'FAIL'}")
                else:
                    value = "n/a" if c.value is None else f"{c.value:.5g}"
                    lines.append(f"check      {c.name} = {value} {c.op} {c.threshold:g}: {'ok' if c.passed else 'FAIL'}")
        lines.append("")
        lines.append(f"verdict    {self.verdict.upper()} ({self.seconds:.1f} s)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Quantized module types: how each scheme is verified


@dataclass(frozen=True)
class ModuleType:
    """How :func:`verify` handles one class of quantized module.

    * ``layout(module)``: the fields besides (out, in) features and dtype that select a kernel
      (bits, group size, ...); modules with equal shape, dtype and layout are kernel-checked once.
    * ``dequantize(module)``: the (N, K) float32 weight the module represents.
    * ``oracle(module, x)``: the float32 result its forward must match.
    * ``tolerance(module, dtype)``: the largest relative error of the forward (in ``dtype``).
    * ``locate(read, name, module, reference_weight, settings)``: which of the module's stored
      tensors differ from what converting ``reference_weight`` with the manifest's ``settings``
      would have stored: a list of (tensor name, reason). ``read(tensor_name)`` returns a stored
      tensor; ``module`` is the module as the loader builds it, on the meta device (its layout
      without data). ``None``: the scheme cannot tell, and the file is named instead.
    * ``stored_dtypes``: floating-point tensors the scheme always stores in one dtype, by
      state-dict key (W8A8's float32 ``weight_scale``); other floating-point tensors must have
      the conversion's output dtype.
    """

    layout: Callable[[nn.Module], dict]
    dequantize: Callable[[nn.Module], torch.Tensor]
    oracle: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    tolerance: Callable[[nn.Module, torch.dtype], float]
    locate: Callable | None = None
    stored_dtypes: dict = field(default_factory=dict)


MODULE_TYPES: dict[type, ModuleType] = {}


def register_module_type(cls: type, module_type: ModuleType) -> None:
    """Teach :func:`verify` a quantized module class (one per scheme)."""
    MODULE_TYPES[cls] = module_type


def _dequantized_oracle(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` in float32 with the module's dequantized weight."""
    w = MODULE_TYPES[type(module)].dequantize(module)
    out = x.float() @ w.t()
    bias = getattr(module, "bias", None)
    return out + bias.float() if bias is not None else out


def _half_tolerance(module: nn.Module, dtype: torch.dtype) -> float:
    # The output is rounded to `dtype` and (on a GPU) the dot runs on `dtype` operands, float32 as
    # tf32: a relative error of a few units of that precision's epsilon, never more.
    eps = torch.finfo(dtype).eps if dtype in (torch.float16, torch.bfloat16) else torch.finfo(torch.float16).eps
    return 2.0 * eps


def _locate_quant_linear(read: Callable[[str], torch.Tensor], name: str, module: QuantLinear, weight: torch.Tensor,
                         settings: dict) -> list[tuple[str, str]]:
    """Which of ``<name>.qweight/.scales/.zeros`` changed since conversion from ``weight``.

    The codes are a pure function of the weight and the stored scales and zeros
    (``round(W / scale + zero)`` clamped, see :func:`quantpack.quantize.quantize`), so codes that
    disagree mean one of the three changed. Re-quantizing the weight with the recorded settings tells
    which: on the kind of device the conversion ran on (not recorded in the manifests that need this
    fallback, those without per-tensor digests: each available one is tried) it reproduces the
    untouched tensors bit for bit. When no re-quantization does, the layer is named.
    """
    from .format import PackedWeight
    from .quantize import _grouped, _ungrouped, quantize
    from .reference import expand_meta

    pw = PackedWeight(read(f"{name}.qweight"), read(f"{name}.scales"), read(f"{name}.zeros"), module.bits,
                      module.group_size, module.axis, (module.out_features, module.in_features))
    pw.validate()
    qmax = (1 << pw.bits) - 1
    scale = expand_meta(pw.scales.float(), pw.shape, pw.group_size, pw.axis)
    zero = expand_meta(pw.zeros.float(), pw.shape, pw.group_size, pw.axis)
    w = _ungrouped(_grouped(weight.float(), pw.group_size, pw.axis), pw.shape, pw.axis)
    expected = torch.round(w / scale + zero).clamp_(0, qmax).to(torch.uint8)
    codes = unpack(pw.qweight, pw.bits)
    differing = int((codes != expected).sum())

    def differing_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())

    best = None  # (changed tensors, re-quantization) closest to what is stored
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            again = quantize(weight.to(device), bits=pw.bits, group_size=pw.group_size, axis=pw.axis,
                             method=settings.get("method", "hqq"), dtype=pw.scales.dtype).to("cpu")
        except (ValueError, RuntimeError, ImportError):
            continue
        changed = [sfx for sfx in ("qweight", "scales", "zeros") if differing_bytes(getattr(pw, sfx), getattr(again, sfx))]
        if best is None or len(changed) < len(best[0]):
            best = (changed, again)
    if best is not None and 0 < len(best[0]) < 3:
        changed, again = best
        return [(f"{name}.{sfx}", f"{differing_bytes(getattr(pw, sfx), getattr(again, sfx))} of "
                                  f"{getattr(pw, sfx).numel() * getattr(pw, sfx).element_size()} bytes differ from a "
                                  f"re-quantization of the reference weight") for sfx in changed]
    if differing:
        return [(name, f"{differing} of {codes.numel()} codes disagree with the reference weight and the stored "
                       f"scales and zeros: one of {name}.qweight, .scales, .zeros changed")]
    return []


register_module_type(QuantLinear, ModuleType(
    layout=lambda m: {"bits": m.bits, "group_size": m.group_size, "axis": m.axis},
    dequantize=lambda m: m.dequantize(torch.float32),
    oracle=_dequantized_oracle,
    tolerance=_half_tolerance,
    locate=_locate_quant_linear,
))


def _w8a8_oracle(module: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The exact result on the same quantized values, as float32: per-token int8 activations
    (:func:`quantize_activations_reference`, the definition the kernel reproduces bit for bit) times
    the int8 weight with exact integer accumulation, scaled in float64. The forward may differ from
    it only by its float32 epilogue and the final cast."""
    from .quantize_w8a8 import int8_matmul_exact, quantize_activations_reference

    x_q, x_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]))
    out = int8_matmul_exact(x_q, module.qweight).double() * x_scale.double()[:, None]
    out = out * module.weight_scale.double()[None, :]
    if module.bias is not None:
        out = out + module.bias.double()
    return out.float().reshape(*x.shape[:-1], module.out_features)


def _w8a8_tolerance(module: nn.Module, dtype: torch.dtype) -> float:
    # The output is cast to `dtype` (half an ulp) after a float32 epilogue of at most four roundings
    # (int32 -> float32, two scale products, the bias): for a float32 output 4 * 2**-24 = 2 eps.
    if dtype in (torch.float16, torch.bfloat16):
        return torch.finfo(dtype).eps / 2 + 2 * torch.finfo(torch.float32).eps
    return 2 * torch.finfo(torch.float32).eps


def _locate_w8a8(read: Callable[[str], torch.Tensor], name: str, module: W8A8Linear, weight: torch.Tensor,
                 settings: dict) -> list[tuple[str, str]]:
    """Which of ``<name>.qweight`` / ``<name>.weight_scale`` changed since conversion from ``weight``.

    Both are pure functions of the weight, computed with correctly rounded float32 operations on
    every device (``weight_scale = max |W[n]| / 127``, ``qweight = clamp(round(W / weight_scale),
    -127, 127)``), so re-quantizing the reference weight reproduces the untouched one bit for bit.
    When both differ, the layer is named.
    """
    from .quantize_w8a8 import quantize_weight_w8a8

    qweight, weight_scale = read(f"{name}.qweight"), read(f"{name}.weight_scale")
    n, k = module.out_features, module.in_features
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != (n, k) or weight_scale.dtype != torch.float32 \
            or tuple(weight_scale.shape) != (n,):
        return []  # the shape and dtype checks report it
    want_q, want_scale = quantize_weight_w8a8(weight)
    bad_codes = int((qweight != want_q).sum())
    bad_scales = int((weight_scale.view(torch.uint8) != want_scale.view(torch.uint8)).sum())
    if bad_scales and not bad_codes:
        return [(f"{name}.weight_scale", f"{bad_scales} of {weight_scale.numel() * 4} bytes differ from "
                                         f"max |W| / 127 of the reference weight")]
    if bad_codes and not bad_scales:
        return [(f"{name}.qweight", f"{bad_codes} of {qweight.numel()} codes differ from round(W / weight_scale) "
                                    f"of the reference weight")]
    if bad_codes:
        return [(name, f"{bad_codes} of {qweight.numel()} codes and {bad_scales} scale bytes disagree with the "
                       f"reference weight: {name}.qweight and .weight_scale changed")]
    return []


register_module_type(W8A8Linear, ModuleType(
    layout=lambda m: {"scheme": "w8a8", "bits": 8},
    dequantize=lambda m: m.dequantize(torch.float32),
    oracle=_w8a8_oracle,
    tolerance=_w8a8_tolerance,
    locate=_locate_w8a8,
    stored_dtypes={"weight_scale": torch.float32},
))


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m) in MODULE_TYPES]


# ----------------------------------------------------------------------------------------------
# Integrity


def _skeleton(root: Path, qc: dict, tensors: dict[str, TensorInfo], trust_remote_code: bool = False):
    """The model the config describes, on meta, with quantized layers swapped in as the loader does.
    Returns (model, {state-dict name: meta tensor} with shared tensors once, tied names, quantized names)."""
    from accelerate import init_empty_weights

    from .hf_config import auto_config
    from .loader import _expected_tensors, _tied_targets, linear_modules_to_convert, model_class_for, replace_linear_layers

    config = auto_config(root, trust_remote_code=trust_remote_code)
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    with init_empty_weights(include_buffers=False):
        model = model_class_for(config, trust_remote_code=trust_remote_code)._from_config(plain, dtype=torch.float32)

    def compute_dtype(module: str) -> torch.dtype:
        info = tensors.get(module + ".scales")
        return info.dtype if info is not None and info.dtype.is_floating_point else torch.float32

    names = linear_modules_to_convert(model, qc)
    replace_linear_layers(model, qc, names, compute_dtype)
    expected, aliases = _expected_tensors(model)
    return model, expected, aliases | _tied_targets(model), set(names)


def _file_list(root: Path) -> tuple[list[str], dict[str, str] | None, list[Problem]]:
    """Shard file names and the index's weight map (None without an index)."""
    index = root / checkpoint.SAFE_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return [], None, [Problem("index", f"file {index.name}: not a valid index (needs a \"weight_map\" object); "
                                               f"download it again", file=index.name)]
        return sorted(set(weight_map.values())), weight_map, []
    if (root / checkpoint.SAFE_SINGLE_NAME).is_file():
        return [checkpoint.SAFE_SINGLE_NAME], None, []
    return [], None, [Problem("index", f"{root}: no {checkpoint.SAFE_INDEX_NAME} or {checkpoint.SAFE_SINGLE_NAME}; "
                                       f"not a packed checkpoint directory", file=checkpoint.SAFE_INDEX_NAME)]


def check_integrity(root, *, reference: Path | None = None,
                    allow_pickle: bool = False, trust_remote_code: bool = False) -> tuple[dict, list[Problem], dict | None]:
    """Check a packed checkpoint's files without loading the model.

    Returns (summary counts, problems, validated quantization_config or None). With ``reference``
    (the source checkpoint directory), a file whose checksum differs is searched for the tensors
    that changed (in a reference holding only PyTorch .bin weights when ``allow_pickle``). ``trust_remote_code``: let transformers run the
    checkpoint's own code to build its model (off: such a checkpoint is a config problem).
    """
    from .loader import read_quantization_config

    root = Path(root)
    problems: list[Problem] = []
    summary = {"files_checked": 0, "tensors_checked": 0}

    # -- config and quantization_config: without them nothing else can be judged
    if not (root / checkpoint.CONFIG_NAME).is_file():
        return summary, [Problem("config", f"{root}: no config.json; not a packed checkpoint directory",
                                 file=checkpoint.CONFIG_NAME)], None
    try:
        config = checkpoint.read_config(root)
    except CheckpointError as e:
        return summary, [Problem("config", f"file config.json: {str(e).partition(': ')[2]}",
                                 file=checkpoint.CONFIG_NAME)], None
    qc = None
    try:
        qc = read_quantization_config(config)
    except CheckpointError as e:
        problems.append(Problem("layout" if "layout_version" in str(e) else "config", str(e), file=checkpoint.CONFIG_NAME))

    # -- manifest: checksums of every output file
    manifest = None
    try:
        manifest = checkpoint.read_manifest(root)
    except CheckpointError as e:
        problems.append(Problem("manifest", str(e), file=checkpoint.MANIFEST_NAME))
    if manifest is not None and manifest.get("layout_version") != LAYOUT_VERSION:
        problems.append(Problem("layout", f"{checkpoint.MANIFEST_NAME}: layout_version={manifest.get('layout_version')!r}; "
                                          f"this quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or "
                                          f"re-convert", file=checkpoint.MANIFEST_NAME))
    shard_files, weight_map, index_problems = _file_list(root)
    problems += index_problems
    missing_files: set[str] = set()
    bad_checksum: list[str] = []
    outputs = ((manifest or {}).get("files") or {}).get("outputs") or {}
    for rel, entry in sorted(outputs.items()):
        f = root / rel
        if not f.is_file():
            missing_files.add(rel)
            continue
        summary["files_checked"] += 1
        if f.stat().st_size != entry.get("size") or checkpoint.sha256_file(f) != entry.get("sha256"):
            bad_checksum.append(rel)
    if manifest is not None:
        for name in shard_files:
            if name not in outputs and (root / name).is_file():
                problems.append(Problem("manifest", f"file {name}: a shard that {checkpoint.MANIFEST_NAME} does not list; "
                                                    f"the checkpoint was modified after conversion", file=name))

    # -- shards: present, parseable, layout version in their metadata; index against headers
    tensors: dict[str, TensorInfo] = {}
    file_tensors: dict[str, dict[str, TensorInfo]] = {}  # shard -> its header's tensors
    in_file: dict[str, list[str]] = {}
    for name, shard in (weight_map or {}).items():
        in_file.setdefault(shard, []).append(name)
    for fname in shard_files:
        f = root / fname
        if not f.is_file():
            missing_files.add(fname)
            continue
        try:
            infos, meta = checkpoint.read_safetensors_header(f)
        except CheckpointError as e:
            problems.append(Problem("checksum", f"file {fname}: {str(e).removeprefix(str(f) + ': ')}", file=fname))
            bad_checksum = [b for b in bad_checksum if b != fname]
            continue
        file_tensors[fname] = infos
        version = meta.get("quantpack_layout_version")
        if version is not None and version != str(LAYOUT_VERSION):
            problems.append(Problem("layout", f"file {fname}: quantpack_layout_version={version!r} in its metadata; this "
                                              f"quantpack reads layout version {LAYOUT_VERSION}: upgrade quantpack or "
                                              f"re-convert", file=fname))
        for tname, info in infos.items():
            if tname in tensors:
                problems.append(Problem("index", f"tensor {tname}: stored in both {tensors[tname].file.name} and {fname}",
                                        file=fname, tensor=tname))
            tensors[tname] = info
            if weight_map is not None and tname not in weight_map:
                problems.append(Problem("index", f"tensor {tname} in {fname}: missing from {checkpoint.SAFE_INDEX_NAME}",
                                        file=fname, tensor=tname))
    for fname in sorted(missing_files):
        held = sorted(in_file.get(fname, []))
        what = f" (it holds {len(held)} tensors: {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})" if held else ""
        problems.append(Problem("missing_file", f"file {fname}: missing{what}; download it again", file=fname,
                                tensor=held[0] if held else None))
    for tname, shard in sorted((weight_map or {}).items()):
        info = tensors.get(tname)
        if shard not in missing_files and (info is None or info.file.name != shard):
            problems.append(Problem("index", f"tensor {tname}: {checkpoint.SAFE_INDEX_NAME} says it is in {shard}, "
                                             f"but it is not; the index does not match the shards", file=shard, tensor=tname))

    # -- every tensor against the model the config describes
    expected, skeleton = None, None
    if qc is not None:
        try:
            skeleton, expected, tied, quantized = _skeleton(root, qc, tensors, trust_remote_code)
        except CheckpointError as e:
            problems.append(Problem("config", str(e), file=checkpoint.CONFIG_NAME))
        except Exception as e:  # transformers raises many kinds for a config it cannot build
            problems.append(Problem("config", f"file config.json: transformers cannot build the model it describes "
                                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})",
                                    file=checkpoint.CONFIG_NAME))
    if expected is not None:
        out_dtype = ((manifest or {}).get("settings") or {}).get("dtype")
        fixed_dtypes = {f"{name}.{key}": dt for name, module in quantized_modules(skeleton)
                        for key, dt in MODULE_TYPES[type(module)].stored_dtypes.items()}
        held_by_missing = {t for f in missing_files for t in in_file.get(f, [])}
        for tname, info in sorted(tensors.items()):
            want = expected.get(tname)
            if want is None:
                if tname not in tied:
                    problems.append(Problem("unexpected_tensor", f"tensor {tname} in {info.file.name}: not a tensor of "
                                                                 f"the model config.json describes", file=info.file.name,
                                            tensor=tname))
                continue
            if tuple(info.shape) != tuple(want.shape):
                problems.append(Problem("shape", f"tensor {tname} in {info.file.name}: shape {list(info.shape)}, expected "
                                                 f"{list(want.shape)} from config.json and quantization_config",
                                        file=info.file.name, tensor=tname))
            if tname in fixed_dtypes:
                ok, wanted = info.dtype == fixed_dtypes[tname], checkpoint.dtype_name(fixed_dtypes[tname])
            elif want.is_floating_point():
                ok = info.dtype.is_floating_point and (out_dtype is None or checkpoint.dtype_name(info.dtype) == out_dtype)
                wanted = out_dtype or "a floating-point dtype"
            else:
                ok, wanted = info.dtype == want.dtype, checkpoint.dtype_name(want.dtype)
            if not ok:
                problems.append(Problem("dtype", f"tensor {tname} in {info.file.name}: dtype "
                                                 f"{checkpoint.dtype_name(info.dtype)}, expected {wanted}",
                                        file=info.file.name, tensor=tname))
        for tname in sorted(expected):
            if tname not in tensors and tname not in tied and tname not in held_by_missing:
                problems.append(Problem("missing_tensor", f"tensor {tname}: missing from the checkpoint", tensor=tname))
        for layer in (manifest or {}).get("layers") or []:
            if layer.get("name") + ".qweight" not in tensors and layer.get("name") + ".qweight" not in held_by_missing:
                problems.append(Problem("missing_tensor", f"tensor {layer['name']}.qweight: missing, but "
                                                          f"{checkpoint.MANIFEST_NAME} lists {layer['name']} as quantized",
                                        tensor=layer["name"] + ".qweight"))

    # -- values: every floating-point number finite
    nonfinite: dict[str, str] = {}
    handles: dict[Path, object] = {}
    try:
        for tname, info in tensors.items():
            summary["tensors_checked"] += 1
            if not info.dtype.is_floating_point or not info.numel:
                continue
            f = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
            t = checkpoint.read_tensor(info, f)
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                nonfinite[tname] = f"{bad} of {t.numel()} values are NaN or infinite"
    finally:
        for f in handles.values():
            f.close()

    # -- a changed file: say which tensor changed
    reported: set[str] = set()
    for fname in bad_checksum:
        recorded = outputs[fname].get("tensors")
        if isinstance(recorded, dict) and fname in file_tensors:  # per-tensor digests: exact, and no reference needed
            located = _changed_by_digest(file_tensors[fname], recorded)
            located = {t: nonfinite.get(t, why) for t, why in located.items()}
            hint = " (every tensor's data matches its sha256 there: the header changed)"
        else:  # a manifest from before per-tensor digests
            located = {t: why for t, why in nonfinite.items() if tensors[t].file.name == fname}
            if reference is not None and skeleton is not None and not located:
                located = _locate_changes(skeleton, fname, tensors, reference, (manifest or {}).get("settings") or {},
                                          allow_pickle=allow_pickle)
            hint = "" if reference is not None else " (verify with a reference to find the tensor)"
        if located:
            for tname, why in located.items():
                reported.add(tname)
                problems.append(Problem("checksum", f"tensor {tname} in {fname}: {why}; the file's sha256 differs from "
                                                    f"{checkpoint.MANIFEST_NAME}: it is corrupt or modified, download it "
                                                    f"again", file=fname, tensor=tname))
        else:
            problems.append(Problem("checksum", f"file {fname}: sha256 differs from {checkpoint.MANIFEST_NAME}; the file is "
                                                f"corrupt or modified, download it again{hint}", file=fname))
    for tname, why in nonfinite.items():
        if tname not in reported:
            problems.append(Problem("values", f"tensor {tname} in {tensors[tname].file.name}: {why}",
                                    file=tensors[tname].file.name, tensor=tname))

    problems.sort(key=lambda p: PROBLEM_KINDS.index(p.kind))  # stable: file order within a kind
    summary["tensors_checked"] = len(tensors)
    return summary, problems, qc


def _changed_by_digest(infos: dict[str, TensorInfo], recorded: dict[str, str]) -> dict[str, str]:
    """Tensors of one shard (``infos``, from its header) whose data's sha256 differs from the digest
    the manifest records for it (``recorded``), or that only one side has: {name: why}."""
    changed = {}
    handle = open(next(iter(infos.values())).file, "rb", buffering=0) if infos else None
    try:
        for tname, info in sorted(infos.items(), key=lambda kv: kv[1].offset):
            want = recorded.get(tname)
            if want is None:
                changed[tname] = f"not among the tensors {checkpoint.MANIFEST_NAME} records for this file"
            elif checkpoint.sha256_tensor_data(info, handle) != want:
                changed[tname] = f"its data's sha256 differs from the one {checkpoint.MANIFEST_NAME} records"
    finally:
        if handle is not None:
            handle.close()
    for tname in sorted(set(recorded) - set(infos)):
        changed[tname] = f"{checkpoint.MANIFEST_NAME} records it in this file, but the file no longer holds it"
    return changed


def _reference_name(ref: checkpoint.SourceCheckpoint, name: str, prefix: str = "") -> str | None:
    """The reference tensor that holds checkpoint tensor ``name`` (names agree up to the base-model prefix)."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(prefix + ".")]
    return next((c for c in candidates if c in ref.tensors), None)


def _locate_changes(skeleton: nn.Module, fname: str, tensors: dict[str, TensorInfo], reference: Path,
                    settings: dict, *, allow_pickle: bool = False) -> dict[str, str]:
    """Tensors of shard ``fname`` that differ from what converting ``reference`` stores: other
    tensors bit for bit against the reference cast to the stored dtype, quantized modules by their
    scheme's ``locate``."""
    try:
        ref = checkpoint.SourceCheckpoint(reference, allow_pickle=allow_pickle)
    except CheckpointError:
        return {}

    def read(tname: str) -> torch.Tensor:
        return checkpoint.read_tensor(tensors[tname])

    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    located: dict[str, str] = {}
    try:
        modules = {}  # quantized module name -> its stored tensor names
        for name, module in quantized_modules(skeleton):
            names = [f"{name}.{k}" for k in module.state_dict(keep_vars=True)]
            if any(n in tensors and tensors[n].file.name == fname for n in names):
                modules[name] = (module, names)
        for tname, info in tensors.items():
            ref_name = _reference_name(ref, tname, prefix) if info.file.name == fname else None
            if ref_name is None:  # packed tensors (qweight, scales...) have no reference namesake
                continue
            stored = read(tname)
            want = ref.get(ref_name)
            if want.is_floating_point() and stored.is_floating_point():
                want = want.to(stored.dtype)
            same = want.shape == stored.shape and want.dtype == stored.dtype and (
                not stored.numel() or torch.equal(want.reshape(-1).view(torch.uint8), stored.reshape(-1).view(torch.uint8)))
            if not same:
                located[tname] = "differs from the reference tensor it was converted from"
        for name, (module, names) in sorted(modules.items()):
            locate = MODULE_TYPES[type(module)].locate
            ref_name = _reference_name(ref, name + ".weight", prefix)
            if locate is None or ref_name is None or not all(n in tensors for n in names if not n.endswith(".bias")):
                continue
            try:
                found = locate(read, name, module, _reference_weight(ref, ref_name, module), settings)
            except (CheckpointError, ValueError):
                continue
            located.update(dict(found))
    finally:
        ref.close()
    return located


# ----------------------------------------------------------------------------------------------
# Per layer and kernels


def _reference_weight(reference: checkpoint.SourceCheckpoint, ref_name: str, module: nn.Module) -> torch.Tensor:
    """The source weight of a quantized module as (out, in): GPT-2's Conv1D stored it (in, out)."""
    w = reference.get(ref_name)
    return w.t() if getattr(module, "source_transposed", False) else w


@torch.no_grad()
def _sinq_rescale(model: nn.Module, reference: checkpoint.SourceCheckpoint, manifest: dict | None,
                  prefix: str) -> dict:
    """For a ``sinq`` conversion, the column/row factors it applied to each weight (recomputed from
    the reference and the choices the manifest records); else empty."""
    settings = (manifest or {}).get("settings") or {}
    if settings.get("method") != "sinq" or not settings.get("sinq_scales"):
        return {}
    names = {f"{n}.weight" for n, _ in quantized_modules(model)} | {n for n, _ in model.named_parameters()}
    located = {n: _reference_name(reference, n, prefix) for n in names}
    located = {n: r for n, r in located.items() if r is not None}
    rescale, _ = sinq.plan(located, lambda n: reference.get(located[n]), model.config, bits=None, group_size=None,
                           kept=settings["sinq_scales"])
    return rescale


def layer_errors(model: nn.Module, reference: checkpoint.SourceCheckpoint, manifest: dict | None,
                 worst: int = WORST_LAYERS, on_layer: Callable[[str], None] | None = None) -> dict:
    """Relative error ``||W - dequantize(Q)||_F / ||W||_F`` (float32) of every quantized layer
    (``on_layer(name)`` is called after each one)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    recorded = {x["name"]: x for x in (manifest or {}).get("layers") or []}
    items, missing = [], []
    rescale = _sinq_rescale(model, reference, manifest, prefix)
    for name, module in quantized_modules(model):
        # (one expert's matrix comes from a checkpoint tensor of another name, which the manifest records)
        ref_name = _reference_name(reference, recorded.get(name, {}).get("source", name) + ".weight", prefix)
        if ref_name is None:
            missing.append(name)
            continue
        deq = MODULE_TYPES[type(module)].dequantize(module).float()
        w = _reference_weight(reference, ref_name, module).to(deq.device, torch.float32)
        if f"{name}.weight" in rescale:  # method sinq: the codes are of the weight with its scales absorbed
            w = sinq.scale_tensor(w, *(None if x is None else x.to(w.device) for x in rescale[f"{name}.weight"]))
        if tuple(w.shape) != tuple(deq.shape):
            raise ValueError(f"reference: {ref_name} has shape {list(w.shape)} but the packed layer {name} is "
                             f"{list(deq.shape)}; pass the checkpoint it was converted from")
        err = float(torch.linalg.vector_norm(deq - w) / torch.linalg.vector_norm(w).clamp_min(1e-30))
        rec = recorded.get(name, {})
        bits = getattr(module, "bits", None) or MODULE_TYPES[type(module)].layout(module).get("bits")
        items.append({"name": name, "shape": list(deq.shape), "bits": bits,
                      "group_size": getattr(module, "group_size", None), "rel_error": err,
                      "manifest_rel_error": rec.get("rel_error")})
        del deq, w
        if on_layer is not None:
            on_layer(name)
    if not items:
        return {"count": 0, "mean_rel_error": None, "max_rel_error": None, "worst": [], "items": [], "missing": missing}
    errors = [x["rel_error"] for x in items]
    ranked = sorted(items, key=lambda x: -x["rel_error"])
    return {"count": len(items), "mean_rel_error": sum(errors) / len(errors), "max_rel_error": max(errors),
            "worst": ranked[:worst], "items": items, "missing": missing}


@torch.no_grad()
def kernel_errors(model: nn.Module, rows=KERNEL_ROWS, seed: int = KERNEL_SEED) -> dict:
    """For each distinct quantized layout: the module's forward against its float32 oracle on
    random inputs (``rows`` rows each); the relative error is the largest over ``rows``."""
    groups: dict[tuple, list[tuple[str, nn.Module]]] = {}
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for name, module in quantized_modules(model):
        mt = MODULE_TYPES[type(module)]
        dtype = _module_dtype(module, model_dtype)
        key = (type(module).__name__, module.out_features, module.in_features, str(dtype),
               tuple(sorted(mt.layout(module).items())), getattr(module, "bias", None) is not None)
        groups.setdefault(key, []).append((name, module))
    gen = torch.Generator().manual_seed(seed)
    items, path = [], "reference"
    for key, members in groups.items():
        name, module = members[0]
        mt = MODULE_TYPES[type(module)]
        dtype = _module_dtype(module, model_dtype)
        device = next(t.device for t in module.buffers())
        if device.type == "cuda":
            path = "triton"  # quantized modules run their fused kernels on CUDA tensors
        worst = 0.0
        for m in rows:
            x = torch.randn(m, module.in_features, generator=gen).to(device, dtype)
            got = module(x).float()
            want = mt.oracle(module, x)
            err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))
            worst = max(worst, err if math.isfinite(err) else float("inf"))
        tol = mt.tolerance(module, dtype)
        items.append({"module_type": key[0], "shape": [module.out_features, module.in_features],
                      "layout": mt.layout(module), "dtype": checkpoint.dtype_name(dtype), "bias": key[5],
                      "example": name, "layers": len(members), "rel_error": worst if math.isfinite(worst) else None,
                      "tolerance": tol, "passed": math.isfinite(worst) and worst <= tol})
    return {"path": path, "rows": list(rows), "seed": seed, "items": items}


def _module_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The compute dtype of a quantized module: that of its floating-point buffers other than
    float32 per-channel scales (W8A8 keeps those in float32), else ``default`` (the model's dtype:
    a W8A8 layer without bias holds no other floating-point tensor)."""
    floats = [b.dtype for n, b in module.named_buffers() if b.is_floating_point() and b.dtype != torch.float32]
    return floats[0] if floats else default


# ----------------------------------------------------------------------------------------------
# End to end


def _is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return (getattr(model.config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None
            and not getattr(model.config, "is_encoder_decoder", False))


def _token_windows(ids: list[int], context_length: int, bos: int | None, max_tokens: int) -> list[torch.Tensor]:
    """Non-overlapping windows of at most ``context_length`` tokens (each led by BOS when the
    tokenizer has one); at most ``max_tokens`` tokens in all."""
    body = context_length - (1 if bos is not None else 0)
    ids = ids[:max_tokens]
    out = []
    for start in range(0, len(ids), body):
        chunk = ids[start:start + body]
        if bos is not None:
            chunk = [bos] + chunk
        if len(chunk) >= 2:
            out.append(torch.tensor([chunk]))
    return out


@torch.no_grad()
def compare_causal_lm(packed_model, reference_model, tokenizer, text: str, *, context_length: int,
                      max_tokens: int) -> tuple[dict, dict]:
    """(settings, metrics) of the next-token distributions of both models on ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = _token_windows(ids, context_length, tokenizer.bos_token_id, max_tokens)
    if not windows:
        raise ValueError("text: too short to evaluate; it must give at least two tokens")
    dev_p = next(packed_model.parameters()).device
    dev_r = next(reference_model.parameters()).device
    kls, nll_p, nll_r, agree, confident = [], [], [], [], []
    for w in windows:
        lp_p = torch.log_softmax(packed_model(w.to(dev_p)).logits[0, :-1].float(), -1).cpu()
        lp_r = torch.log_softmax(reference_model(w.to(dev_r)).logits[0, :-1].float(), -1).cpu()
        target = w[0, 1:]
        # KL(reference || packed) per position; xlogy makes 0 * log 0 = 0.
        kls.append((torch.special.xlogy(lp_r.exp(), lp_r.exp()) - lp_r.exp() * lp_p).sum(-1).clamp_min(0))
        nll_p.append(-lp_p.gather(-1, target[:, None])[:, 0])
        nll_r.append(-lp_r.gather(-1, target[:, None])[:, 0])
        agree.append(lp_p.argmax(-1) == lp_r.argmax(-1))
        top2 = lp_r.exp().topk(min(2, lp_r.shape[-1]), -1).values
        confident.append(top2[:, 0] - (top2[:, 1] if top2.shape[-1] > 1 else 0) >= CONFIDENT_MARGIN)
    kl = torch.cat(kls).double()
    positions = kl.numel()
    agree, confident = torch.cat(agree), torch.cat(confident)
    settings = {"tokens": sum(w.shape[1] for w in windows), "positions": positions, "sequences": len(windows),
                "context_length": context_length, "truncated": len(ids) > max_tokens}
    metrics = {"perplexity_reference": math.exp(float(torch.cat(nll_r).double().mean())),
               "perplexity_packed": math.exp(float(torch.cat(nll_p).double().mean())),
               "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
               "top1_agreement": float(agree.double().mean()),
               "top1_agreement_confident": float(agree[confident].double().mean()) if confident.any() else None,
               "confident_positions": int(confident.sum())}
    return settings, metrics


def _sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text.strip())
    return [" ".join(p.split()) for p in parts if p.strip()]


@torch.no_grad()
def compare_encoder(packed_model, reference_model, tokenizer, text: str, *, context_length: int,
                    max_tokens: int) -> tuple[dict, dict]:
    """(settings, metrics): cosine similarity of mean-pooled last hidden states, sentence by sentence."""
    sentences, tokens, cosines = _sentences(text), 0, []
    dev_p = next(packed_model.parameters()).device
    dev_r = next(reference_model.parameters()).device
    truncated = False
    for s in sentences:
        enc = tokenizer(s, truncation=True, max_length=context_length, return_tensors="pt")
        if tokens + enc["input_ids"].shape[1] > max_tokens:
            truncated = True
            break
        tokens += enc["input_ids"].shape[1]
        pooled = []
        for model, dev in ((packed_model, dev_p), (reference_model, dev_r)):
            hidden = model(**{k: v.to(dev) for k, v in enc.items()}).last_hidden_state.float().cpu()
            mask = enc["attention_mask"][..., None].float()
            pooled.append((hidden * mask).sum(1) / mask.sum(1))
        cosines.append(float(torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=-1)[0]))
    if not cosines:
        raise ValueError("text: too short to evaluate; it must hold at least one sentence")
    settings = {"tokens": tokens, "positions": tokens, "sequences": len(cosines), "context_length": context_length,
                "truncated": truncated}
    return settings, {"cosine_mean": sum(cosines) / len(cosines), "cosine_min": min(cosines), "pooling": "mean"}


# ----------------------------------------------------------------------------------------------
# verify()


def _resolve_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use auto, cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is available; use cpu or auto")
    return dev


def _check_threshold(name: str, value, *, low=None, high=None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        rng = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r} must be {rng}")


def _resolve_reference(reference, manifest: dict | None, *, revision=None, token=None, allow_pickle: bool = False):
    """(directory, description) of the reference checkpoint: ``reference`` or the manifest's source."""
    from .hub import resolve_source

    if reference is None:
        src = (manifest or {}).get("source") or {}
        if not src.get("repo"):
            raise ValueError(f"reference: {checkpoint.MANIFEST_NAME} records no source; pass reference= "
                             f"(--reference) with the checkpoint this was converted from")
        repo, revision = src["repo"], src.get("revision") if not src.get("local") else None
        what = f"the source recorded in {checkpoint.MANIFEST_NAME} ({repo})"
    else:
        repo = what = str(reference)
    try:
        resolved = resolve_source(repo, revision=revision, token=token, allow_pickle=allow_pickle)
    except CheckpointError as e:
        message = str(e).removeprefix("source: ")
        raise ValueError(f"reference: {what} is not available: {message}"
                         + ("; pass --reference" if reference is None else "")) from None
    desc = {"source": resolved.repo, "revision": resolved.revision, "local": resolved.local,
            "path": str(resolved.path), "from_manifest": reference is None}
    return resolved.path, desc


def _same_as_source(ref_dir: Path, manifest: dict | None) -> bool | None:
    """Whether the reference holds the files the conversion read: same sizes, and same sha256 for
    the small ones (hashing the weights would double the run time). None when unknown."""
    inputs = ((manifest or {}).get("files") or {}).get("inputs") or {}
    if not inputs:
        return None
    for rel, entry in inputs.items():
        f = ref_dir / rel
        if not f.is_file() or f.stat().st_size != entry.get("size"):
            return False
        if entry.get("size", 0) <= (16 << 20) and checkpoint.sha256_file(f) != entry.get("sha256"):
            return False
    return True


def verify(packed, *, reference=None, text: str | None = None, text_file=None, device="auto",
           max_kl: float | None = DEFAULT_MAX_KL, min_top1: float | None = DEFAULT_MIN_TOP1,
           min_cosine: float | None = DEFAULT_MIN_COSINE, max_layer_error: float | None = None,
           context_length: int = DEFAULT_CONTEXT_LENGTH, max_tokens: int = DEFAULT_MAX_TOKENS,
           dtype: torch.dtype | None = None, end_to_end: bool = True, revision: str | None = None,
           token: str | None = None, allow_pickle: bool = False, trust_remote_code: bool = False,
           progress: bool = False) -> VerifyReport:
    """Check the packed checkpoint ``packed`` (directory or hub repo id) and measure what quantizing cost.

    * ``reference``: the original checkpoint (hub repo id or directory); default: the source
      recorded in the manifest (repo id and revision, or local path). ``False``: no reference, so
      only the integrity and kernel checks run.
    * ``text`` / ``text_file``: the evaluation text; default :data:`DEFAULT_TEXT`.
    * ``device``: ``"auto"`` (a GPU when present), ``"cpu"`` or ``"cuda"``; on a GPU the kernel check
      runs the fused Triton kernels.
    * Thresholds (``None`` turns a check off): ``max_kl`` (mean KL, nats per token), ``min_top1``
      (top-1 agreement over the positions where the reference is confident, see :data:`CONFIDENT_MARGIN`;
      skipped, with the reason in ``report.skipped``, when fewer than :data:`MIN_CONFIDENT_POSITIONS`; causal LMs), ``min_cosine`` (mean cosine similarity, encoders),
      ``max_layer_error`` (largest per-layer relative error).
    * ``context_length``: tokens per evaluated sequence (capped at the model's maximum);
      ``max_tokens``: most tokens of the text evaluated. ``dtype``: dtype of the packed model's
      unquantized weights (default: as stored). ``end_to_end=False`` skips loading both models.
    * ``allow_pickle``: accept a reference that holds only PyTorch .bin weights (loaded with
      ``weights_only=True``), as ``convert(..., allow_pickle=True)`` does for a source.
    * ``trust_remote_code``: run the Python code the packed checkpoint, its reference and their
      tokenizers ship (``auto_map``). Off by default: such a checkpoint is refused, nothing prompts.
    * ``progress``: a progress bar on stderr, one step per stage and per quantized layer.

    Problems in the files do not raise: they are in ``report.problems`` (verdict ``corrupt``). Bad
    arguments and an unavailable reference raise ``ValueError`` with a one-line message.
    """
    t0 = time.perf_counter()
    for name, value, low, high in (("max_kl", max_kl, 0, None), ("min_top1", min_top1, 0, 1),
                                   ("min_cosine", min_cosine, -1, 1), ("max_layer_error", max_layer_error, 0, None)):
        _check_threshold(name, value, low=low, high=high)
    for name, value in (("context_length", context_length), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{name}={value!r} must be an integer >= 2")
    if text is not None and text_file is not None:
        raise ValueError("text and text_file: pass one of them, not both")
    text_desc = "built-in passage"
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"text_file: cannot read {text_file} as UTF-8 text ({getattr(e, 'strerror', None) or e})") from None
        text_desc = str(text_file)
    elif text is not None:
        text_desc = "given text"
    text = DEFAULT_TEXT if text is None else text
    if not text.strip():
        raise ValueError("text: is empty; pass some text to evaluate on")
    dev = _resolve_device(device)

    from .loader import resolve_checkpoint

    try:
        root = resolve_checkpoint(packed, revision=revision, token=token)
    except CheckpointError as e:
        raise ValueError("packed" + str(e).removeprefix("path_or_repo_id")) from None
    from tqdm.auto import tqdm

    with tqdm(desc="verifying", unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        return _verify(root, bar, t0, reference=reference, text=text, text_desc=text_desc, dev=dev, max_kl=max_kl,
                       min_top1=min_top1, min_cosine=min_cosine, max_layer_error=max_layer_error,
                       context_length=context_length, max_tokens=max_tokens, dtype=dtype, end_to_end=end_to_end,
                       token=token, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


def _verify(root: Path, bar, t0: float, *, reference, text, text_desc, dev, max_kl, min_top1, min_cosine,
            max_layer_error, context_length, max_tokens, dtype, end_to_end, token, allow_pickle,
            trust_remote_code) -> VerifyReport:
    """:func:`verify` once its arguments are checked and the packed checkpoint found; ``bar`` shows
    the stage (and layer) being checked."""
    def stage(name: str) -> None:
        bar.set_postfix_str(name, refresh=False)
        bar.update()

    bar.reset(total=2)
    report = VerifyReport(packed=str(root), device=str(dev),
                          thresholds={"max_kl": max_kl, "min_top1": min_top1, "min_cosine": min_cosine,
                                      "max_layer_error": max_layer_error})
    try:
        manifest = checkpoint.read_manifest(root)
    except CheckpointError:
        manifest = None
    # An explicit reference that cannot be found is bad input; the manifest's source being gone is
    # reported after the integrity check, which needs no reference.
    ref_dir, ref_error = None, None
    if reference is not False:
        try:
            ref_dir, report.reference = _resolve_reference(reference, manifest, token=token, allow_pickle=allow_pickle)
        except ValueError as e:
            if reference is not None:
                raise
            ref_error = str(e)
    from .hf_config import check_remote_code

    # Refused as bad input (the files may well be intact): running their code needs the user's word.
    for where in [root] + ([ref_dir] if ref_dir is not None else []):
        try:
            config = checkpoint.read_config(where)
        except CheckpointError:
            continue  # the integrity check (or loading the reference) reports it
        check_remote_code(where, config, trust_remote_code=trust_remote_code)
    bar.set_postfix_str("integrity")
    summary, report.problems, qc = check_integrity(root, reference=ref_dir, allow_pickle=allow_pickle,
                                                  trust_remote_code=trust_remote_code)
    report.integrity = summary
    if report.problems:
        for section in ("layers", "kernels", "end_to_end"):
            report.skipped[section] = "the files have problems (see integrity)"
        report.seconds = time.perf_counter() - t0
        return report
    if ref_error is not None:
        raise ValueError(ref_error + ", or reference=False (--no-reference) for the integrity and kernel checks only")
    if report.reference is not None:
        report.reference["matches_manifest"] = _same_as_source(ref_dir, manifest)
        if report.reference["matches_manifest"] is False:
            report.warnings.append(f"the reference differs from the files {checkpoint.MANIFEST_NAME} says the conversion "
                                   f"read; the numbers compare with a different model")

    from .loader import load

    stage("loading")
    model = load(root, device=dev, dtype=dtype, verify=False,  # the files were just checked
                 trust_remote_code=trust_remote_code)
    layers = len(quantized_modules(model))
    bar.total = 3 + (layers + (1 if end_to_end else 0) if ref_dir is not None else 0)
    stage("kernels")
    report.kernels = kernel_errors(model)
    stage("layers" if ref_dir is not None else "done")
    for item in report.kernels["items"]:
        shape = "x".join(map(str, item["shape"]))
        report.checks.append(Check(f"kernel {item['module_type']} {shape} {item['dtype']}", item["rel_error"],
                                   item["tolerance"], "<=", item["passed"]))
    if ref_dir is None:
        report.skipped["layers"] = report.skipped["end_to_end"] = "no reference (--no-reference / reference=False)"
        report.seconds = time.perf_counter() - t0
        return report

    ref = checkpoint.SourceCheckpoint(ref_dir, allow_pickle=allow_pickle)
    try:
        report.layers = layer_errors(model, ref, manifest, on_layer=lambda name: stage(name))
    finally:
        ref.close()
    for item in report.layers["items"]:
        rec = item["manifest_rel_error"]
        if rec is not None and abs(item["rel_error"] - rec) > 1e-3 * max(rec, 1e-6) + 1e-6:
            report.warnings.append(f"layer {item['name']}: relative error {item['rel_error']:.6g} but "
                                   f"{checkpoint.MANIFEST_NAME} recorded {rec:.6g} at conversion")
            break
    if report.layers["missing"]:
        report.warnings.append(f"{len(report.layers['missing'])} quantized layers have no weight in the reference "
                               f"(e.g. {report.layers['missing'][0]})")
    if max_layer_error is not None and report.layers["count"]:
        value = report.layers["max_rel_error"]
        report.checks.append(Check("max_layer_error", value, max_layer_error, "<=", value <= max_layer_error))

    if end_to_end:
        bar.set_postfix_str("end to end")
        report.end_to_end = _end_to_end(model, ref_dir, root, dev, text, text_desc, context_length, max_tokens,
                                        trust_remote_code)
        if report.end_to_end is None:
            report.skipped["end_to_end"] = (f"{type(model).__name__} is neither a causal LM nor an encoder with "
                                            f"last_hidden_state")
        stage("done")
    else:
        report.skipped["end_to_end"] = "not requested"
    del model
    if report.end_to_end:
        m = report.end_to_end["metrics"]
        if report.end_to_end["task"] == "causal_lm":
            if max_kl is not None:
                report.checks.append(Check("kl_mean", m["kl_mean"], max_kl, "<=", m["kl_mean"] <= max_kl))
            if min_top1 is not None:
                n, value = m["confident_positions"], m["top1_agreement_confident"]
                if n < MIN_CONFIDENT_POSITIONS:
                    report.skipped["top1_agreement"] = (
                        f"only {n} of {report.end_to_end['settings']['positions']} positions have a reference top-1 "
                        f"probability at least {CONFIDENT_MARGIN} above the second (at least {MIN_CONFIDENT_POSITIONS} "
                        f"needed): on near-flat distributions top-1 agreement is noise; the KL check judges alone")
                else:
                    report.checks.append(Check("top1_agreement", value, min_top1, ">=", value >= min_top1))
        elif min_cosine is not None:
            report.checks.append(Check("cosine_mean", m["cosine_mean"], min_cosine, ">=", m["cosine_mean"] >= min_cosine))
    report.seconds = time.perf_counter() - t0
    return report


def _end_to_end(model, ref_dir: Path, root: Path, dev: torch.device, text: str, text_desc: str,
                context_length: int, max_tokens: int, trust_remote_code: bool = False) -> dict | None:
    from transformers import AutoTokenizer

    causal = _is_causal_lm(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer: neither the packed checkpoint nor the reference has a tokenizer "
                             f"({type(e).__name__}); copy the tokenizer files next to config.json") from None
    if not causal:
        with torch.no_grad():
            probe = model(torch.tensor([[tokenizer.cls_token_id or 0, tokenizer.sep_token_id or 0]], device=dev))
        if getattr(probe, "last_hidden_state", None) is None:
            return None
    # On the CPU the reference runs in float32 (half-precision CPU matmuls are slow and no more exact).
    ref_dtype = torch.float32 if dev.type == "cpu" else "auto"
    # The reference is built as the class the packed model is (the one the conversion built: e.g. the base
    # model of a checkpoint whose architectures names a head it does not hold).
    with quiet_transformers():
        reference_model = type(model).from_pretrained(ref_dir, dtype=ref_dtype).to(dev).eval()
    limit = getattr(model.config, "max_position_embeddings", None)
    ctx = min(context_length, limit) if isinstance(limit, int) and limit > 1 else context_length
    compare = compare_causal_lm if causal else compare_encoder
    settings, metrics = compare(model, reference_model, tokenizer, text, context_length=ctx, max_tokens=max_tokens)
    settings.update({"text": text_desc, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "packed_dtype": checkpoint.dtype_name(next(model.parameters()).dtype),
                     "reference_dtype": checkpoint.dtype_name(next(reference_model.parameters()).dtype),
                     "device": str(dev), "max_tokens": max_tokens})
    del reference_model
    return {"task": "causal_lm" if causal else "encoder", "settings": settings, "metrics": metrics}
