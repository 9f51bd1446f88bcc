"""The verify report: its JSON schema (:data:`REPORT_SCHEMA`), :class:`VerifyReport` and its parts, and the
default thresholds."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import __version__, checkpoint
from ..checkpoint.integrity import PROBLEM_KINDS, Problem  # noqa: F401 (part of the report)


SCHEMA_VERSION = 1
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
                 "quantization", "integrity", "layers", "kernels", "end_to_end", "thresholds", "checks", "skipped", "warnings",
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
        "quantization": {
            "type": ["object", "null"], "additionalProperties": False,
            "required": ["scheme", "method", "bits", "group_size", "axis", "calibration"],
            "properties": {"scheme": _STR, "method": _STR, "bits": {"type": ["integer", "null"]},
                           "group_size": {"type": ["integer", "null"]}, "axis": {"type": ["integer", "null"]},
                           "calibration": {"type": ["object", "null"]}},
        },
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


def quantization_summary(qc: dict | None, manifest: dict | None) -> dict | None:
    """The report's ``quantization``: from the checkpoint's quantization config, else its manifest's settings."""
    settings = (manifest or {}).get("settings") or {}
    qc = qc or {}
    if not qc and not settings:
        return None
    pick = (lambda key: qc.get(key, settings.get(key)))
    return {"scheme": pick("scheme"), "method": pick("method"), "bits": pick("bits"), "group_size": pick("group_size"),
            "axis": pick("axis"), "calibration": settings.get("calibration")}


def describe_quantization(q: dict) -> str:
    """One line: ``gptq, 4-bit, group 128 (w4a16); calibrated on 8192 tokens (sha256 0e829cb1a64c)``."""
    group = "per channel" if q.get("group_size") is None else f"group {q['group_size']}"
    line = f"{q.get('method') or '-'}, {q.get('bits') or '-'}-bit, {group}" + (f" ({q['scheme']})" if q.get("scheme") else "")
    cal = q.get("calibration")
    if cal:
        if cal.get("builtin"):
            origin = "built-in passage"
        elif cal.get("self") and cal.get("sampler"):  # an encoder: its vocabulary sampled, refit weighted on it
            origin = f"sampled from the vocabulary ({cal['sampler']}), seed {cal.get('seed')}"
        elif cal.get("self"):
            origin = f"written by the model, seed {cal.get('seed')}"
        else:
            origin = f"sha256 {str(cal.get('sha256'))[:12]}"
        line += f"; calibrated on {cal.get('tokens')} tokens ({origin})"
    return line


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
    quantization: dict | None = None  # scheme, method, bits, group_size, axis, calibration (gptq)
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

    def kl_advice(self) -> str | None:
        """One line when the KL check failed: how far the conversion is from ``--max-kl`` and which conversions
        lose less (small models lose more to 4 bits: a correct conversion can miss the default threshold)."""
        c = next((c for c in self.checks if c.name == "kl_mean" and not c.passed and c.value is not None), None)
        if c is None or not c.threshold:
            return None
        q = self.quantization or {}
        tries = []
        if not q.get("calibration"):
            tries.append("convert with --calibration self (or --calibration FILE)")
        if q.get("bits") is None or q["bits"] < 8:
            tries.append("convert with --bits 8")
        tries.append(f"pass --max-kl {c.value * 1.05:.2g} if this loss is acceptable")
        return (f"KL {c.value:.3g} is {c.value / c.threshold:.1f}x --max-kl {c.threshold:g}; to lose less: "
                + "; ".join(tries))

    def to_dict(self) -> dict:
        return checkpoint.finite_or_none({
            "schema_version": SCHEMA_VERSION,
            "quantpack_version": __version__,
            "packed": self.packed,
            "reference": self.reference,
            "device": self.device,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "quantization": self.quantization,
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
        if self.quantization:
            lines.append(f"method     {describe_quantization(self.quantization)}")
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
        advice = self.kl_advice()
        if advice:
            lines.append(f"advice     {advice}")
        lines.append("")
        lines.append(f"verdict    {self.verdict.upper()} ({self.seconds:.1f} s)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
