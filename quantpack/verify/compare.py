"""Several packed checkpoints of one source side by side: one row per :class:`VerifyReport` (method, bits, group
size, KL, top-1 agreement, perplexity ratio, worst layer error), as ``quantpack verify A B C`` prints it."""
from __future__ import annotations

from pathlib import Path

from .report import VerifyReport


def comparison_rows(reports: list[VerifyReport]) -> list[dict]:
    """One dict per report: ``packed``, ``method``, ``bits``, ``group_size``, ``kl_mean``, ``top1_agreement``,
    ``perplexity_ratio`` (packed / reference), ``cosine_mean`` (encoders), ``max_layer_error`` (and the layer),
    ``verdict``; None where the report has no such number."""
    rows = []
    for r in reports:
        q = r.quantization or {}
        m = (r.end_to_end or {}).get("metrics") or {}
        ppl_ref, ppl = m.get("perplexity_reference"), m.get("perplexity_packed")
        worst = (r.layers or {}).get("worst") or [None]
        rows.append({"packed": r.packed, "method": q.get("method"), "bits": q.get("bits"),
                     "group_size": q.get("group_size"), "kl_mean": m.get("kl_mean"),
                     "top1_agreement": m.get("top1_agreement"),
                     "perplexity_ratio": ppl / ppl_ref if ppl is not None and ppl_ref else None,
                     "cosine_mean": m.get("cosine_mean"),
                     "max_layer_error": (r.layers or {}).get("max_rel_error"),
                     "worst_layer": worst[0]["name"] if worst[0] else None, "verdict": r.verdict})
    return rows


def format_comparison(reports: list[VerifyReport]) -> str:
    """The comparison table; the text and reference the numbers share are named below it."""
    rows = comparison_rows(reports)
    encoder = any(row["cosine_mean"] is not None for row in rows)
    names = [Path(row["packed"]).name for row in rows]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = ["packed", "method", "bits", "group", *(["cosine"] if encoder else ["KL", "top-1", "ppl ratio"]),
            "worst layer err", "verdict"]
    body = []
    for name, row in zip(names, rows):
        metrics = ([num(row["cosine_mean"], ".5f")] if encoder else
                   [num(row["kl_mean"], ".5f"), num(row["top1_agreement"], ".2%"), num(row["perplexity_ratio"], ".4f")])
        body.append([name, row["method"] or "-", str(row["bits"] or "-"),
                     "channel" if row["group_size"] is None and row["bits"] else str(row["group_size"] or "-"),
                     *metrics, num(row["max_layer_error"], ".4f"), row["verdict"].upper()])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    first = next((r for r in reports if r.end_to_end), None)
    if first is not None:
        s = first.end_to_end["settings"]
        ref = (first.reference or {}).get("source", "-")
        lines.append(f"\nreference {ref}; text {s['text']}, {s['tokens']} tokens; worst layer err: the largest "
                     f"relative weight error of any layer")
    return "\n".join(lines)
