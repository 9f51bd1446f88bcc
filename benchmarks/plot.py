"""Draw the benchmark results (JSON lines under benchmarks/results/) as PNG plots next to them.

    pip install -e ".[bench]"             # matplotlib
    python benchmarks/plot.py             # reads benchmarks/results/*.jsonl, writes benchmarks/results/*.png
    python benchmarks/plot.py --results DIR --out DIR

* ``kernels_<gpu>_<dtype>_w<bits>.png``: per weight shape, each implementation's speed against cuBLAS timed in the
  same run (``ratio_to_cublas``, higher is faster) over the rows of x (M, log scale); weight-only rows only.
* ``decode.png``: end-to-end decode tokens/s, bf16 against quantpack, per GPU, decode mode and batch size.
* ``quality.png``: each numeric metric of ``quality.jsonl`` by quantization method, where that file exists.

Where a cell was measured more than once, the newest line (the last in the file) is drawn.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PROVENANCE = ("device", "commit", "date")
KERNEL_FIELDS = PROVENANCE + ("shape", "M", "bits", "group_size", "dtype", "impl", "time_us", "ratio_to_cublas")
DECODE_FIELDS = PROVENANCE + ("batch", "model", "path", "tok_s")
CONVERSION_FIELDS = PROVENANCE + ("method", "bits", "group_size", "source_gb", "output_gb", "convert_s")
REQUIRED = {"kernels": KERNEL_FIELDS, "decode": DECODE_FIELDS, "conversion": CONVERSION_FIELDS,
            "quality": PROVENANCE + ("method",)}
IMPL_ORDER = ["quantpack", "tinygemm", "gemlite", "torchao", "hqq", "int_mm", "w4a8", "w8a8"]


# convert's methods, then the hqq library (the reference they are held to), in the quality plot's order and colours
QUALITY_METHODS = ("rtn", "hqq", "sinq", "refit", "gptq", "gptq-self", "hqq-lib")


def impl_color(impl: str) -> str:
    """One colour per implementation in every panel and figure (matplotlib's cycle, by IMPL_ORDER)."""
    i = IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER) + sum(map(ord, impl))
    return f"C{i % 10}"


class ResultsError(ValueError):
    """A results file that cannot be read as the documented JSON lines."""


def load(path: Path) -> list[dict]:
    """The lines of one results file as dicts, each checked for its kind's required fields."""
    need = REQUIRED.get(path.stem, PROVENANCE)
    rows = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}:{number} is not JSON ({e.msg}); fix or remove that line") from None
        if isinstance(row, dict) and path.stem == "decode" and row.get("path") == "ttft":
            need_here = PROVENANCE + ("batch", "model", "path", "ttft_ms")  # (a time to first token, not a rate)
        else:
            need_here = need
        missing = [f for f in need_here if f not in row] if isinstance(row, dict) else list(need_here)
        if missing:
            raise ResultsError(f"{path}:{number} lacks {', '.join(missing)}; every {path.stem} line needs "
                               f"{', '.join(need_here)}")
        rows.append(row)
    return rows


def newest(rows, key):
    """One row per ``key(row)``: the last one (files are appended in time order)."""
    out = {}
    for r in rows:
        out[key(r)] = r
    return list(out.values())


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("nvidia ", "")).strip("-")


def save(fig, path: Path) -> None:
    """A PNG of 256 colours: a third of the bytes of a full-colour one, for plots that look the same."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(256).save(path, optimize=True)


def plot_kernels(rows, out: Path, plt) -> list[Path]:
    rows = [r for r in rows if not r.get("scheme") and r["ratio_to_cublas"]]
    cells = newest(rows, lambda r: (r["device"], r["dtype"], r["bits"], tuple(r["shape"]), r["impl"], r["M"]))
    groups = defaultdict(list)
    for r in cells:
        groups[(r["device"], r["dtype"], r["bits"])].append(r)
    written = []
    for (device, dtype, bits), group in sorted(groups.items()):
        by_shape = defaultdict(list)
        for r in group:
            by_shape[tuple(r["shape"])].append(r)
        # a shape measured at one M says nothing about batch size; it stays in the data, not the plot
        shapes = sorted(s for s, rs in by_shape.items() if len({r["M"] for r in rs}) > 1)
        if not shapes:
            continue
        cols = min(3, len(shapes))
        nrows = math.ceil(len(shapes) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
        for ax, shape in zip(axes.flat, shapes):
            impls = {r["impl"] for r in by_shape[shape]} - {"cublas"}
            for impl in sorted(impls, key=lambda i: (IMPL_ORDER.index(i) if i in IMPL_ORDER else 99, i)):
                pts = sorted((r["M"], r["ratio_to_cublas"]) for r in by_shape[shape] if r["impl"] == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        lw=2.2 if impl == "quantpack" else 1.2, label=impl, color=impl_color(impl))
            ax.axhline(1.0, color="black", lw=0.8, ls="--", label="cuBLAS")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape[0]} x {shape[1]}" + (" (merged)" if any(r.get("merged") for r in by_shape[shape])
                                                        else ""), fontsize=9)
            ax.set_xlabel("M (rows of x)", fontsize=8)
            ax.set_ylabel("x cuBLAS (same run)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(shapes):]:
            ax.set_visible(False)
        commits = sorted({r["commit"] for r in group if r["commit"]})
        fig.suptitle(f"{device}, {dtype}, {bits}-bit weights, group {group[0]['group_size']}: speed vs cuBLAS "
                     f"(commits {', '.join(commits)})", fontsize=9)
        fig.tight_layout()
        path = out / f"kernels_{_slug(device)}_{dtype}_w{bits}.png"
        save(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def plot_decode(rows, out: Path, plt) -> list[Path]:
    """decode.png: the 8B shape at a short prompt; decode_context.png: the 8B shape after long prompts;
    decode_moe.png: the mixture-of-experts shapes (short prompts). Decode rates only (time-to-first-token rows are
    in the tables)."""
    rows = [r for r in rows if r["path"] != "ttft"]
    experts = lambda r: (r.get("shape") or {}).get("model") if isinstance(r.get("shape"), dict) and \
        (r.get("shape") or {}).get("experts") else None  # noqa: E731
    dense = [r for r in rows if experts(r) is None]
    made = _decode_bars([r for r in dense if not r.get("context")], out / "decode.png", plt,
                        lambda r: f"{r['path']}\nbatch {r['batch']}",
                        "End-to-end decode, Llama-3.1-8B shape, 4-bit g128")
    made += _decode_bars([r for r in dense if r.get("context")], out / "decode_context.png", plt,
                         lambda r: f"{r['path']}\nbatch {r['batch']}\ncontext {r['context']}",
                         "Decode after a long prompt, Llama-3.1-8B shape, 4-bit g128")
    made += _decode_bars([r for r in rows if experts(r) and not r.get("context")], out / "decode_moe.png", plt,
                         lambda r: f"{experts(r)}\n{r['path']}\nbatch {r['batch']}",
                         "End-to-end decode, mixture-of-experts shapes, 4-bit g128")
    return made


def _decode_bars(rows, path: Path, plt, group_of, title: str) -> list[Path]:
    def label(r):
        name = r["model"]
        if str(r.get("projections", "")).startswith("merged"):
            name += " " + r["projections"]  # ("merged", or "merged, lm_head w8": lm_head quantized too)
        if r.get("launch_plans") is False:
            name += " no plans"
        return name

    # One run per GPU and group, its newest: bars of one group come from one process (same-run ratios).
    last_run = {(r["device"], group_of(r)): r["commit"] for r in rows}
    rows = [r for r in rows if r["commit"] == last_run[r["device"], group_of(r)]]
    cells = newest(rows, lambda r: (r["device"], group_of(r), label(r)))
    groups = sorted({(r["device"], group_of(r)) for r in cells}, key=lambda g: (g[1], g[0]))
    labels = sorted({label(r) for r in cells}, key=lambda s: (s != "bf16", s))
    if not groups:
        return []
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups)), 3.6))
    width = 0.8 / len(labels)
    for i, name in enumerate(labels):
        xs, ys = [], []
        for g, group in enumerate(groups):
            r = next((r for r in cells if (r["device"], group_of(r)) == group and label(r) == name), None)
            if r:
                xs.append(g + (i - (len(labels) - 1) / 2) * width)
                ys.append(r["tok_s"])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g}\n{d.replace('NVIDIA ', '').split()[0]} {last_run[d, g]}" for d, g in groups], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return [path]


def plot_quality(rows, out: Path, plt) -> list[Path]:
    """End-to-end error relative to hqq's (KL for causal LMs, 1 - cosine for encoders), per checkpoint and
    bits/group, one bar per method: below 1 is better than hqq."""
    metric_of = {"kl_ratio_to_hqq": "KL", "one_minus_cos_ratio_to_hqq": "1 - cos"}
    rows = [r for r in rows if any(k in r for k in metric_of)]
    if not rows:
        return []
    # The methods convert offers, each from its latest run on the checkpoint (every ratio is to hqq in its own run):
    # an older run may be of an older form of the method, or of another build of the witness
    rows = [r for r in rows if r["method"] in QUALITY_METHODS
            and not (r["method"] == "gptq-self" and "one_minus_cos_ratio_to_hqq" in r)]  # (on an encoder, convert
    # --calibration self runs a weighted refit: its rows come from another script)
    latest = {(r["checkpoint"], r["method"]): r["commit"] for r in rows}
    rows = [r for r in rows if r["commit"] == latest[r["checkpoint"], r["method"]]]
    cells = newest(rows, lambda r: (r["checkpoint"], r["method"], r["bits"], r["group_size"]))
    checkpoints = sorted({r["checkpoint"] for r in cells})
    fig, axes = plt.subplots(1, len(checkpoints), figsize=(4.8 * len(checkpoints), 3.2), squeeze=False)
    for ax, name in zip(axes.flat, checkpoints):
        mine = [r for r in cells if r["checkpoint"] == name]
        configs = sorted({(r["bits"], r["group_size"]) for r in mine})
        methods = sorted({r["method"] for r in mine}, key=QUALITY_METHODS.index)
        key = next(k for k in metric_of if k in mine[0])
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            xs, ys = [], []
            for c, cfg in enumerate(configs):
                r = next((r for r in mine if r["method"] == method and (r["bits"], r["group_size"]) == cfg), None)
                if r is not None:
                    xs.append(c + (i - (len(methods) - 1) / 2) * width)
                    ys.append(r[key])
            ax.bar(xs, ys, width, label=method, color=f"C{QUALITY_METHODS.index(method)}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{b}-bit g{g}" for b, g in configs], fontsize=8)
        ax.set_ylabel(f"end-to-end {metric_of[key]} / hqq's", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "quality.png"
    save(fig, path)
    plt.close(fig)
    return [path]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the *.jsonl files")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: --results)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('Error: plotting needs matplotlib; install it with pip install -e ".[bench]"', file=sys.stderr)
        return 2
    if not args.results.is_dir():
        print(f"Error: {args.results} is not a folder of results; pass --results DIR", file=sys.stderr)
        return 2
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        for kind, draw in (("kernels", plot_kernels), ("decode", plot_decode), ("quality", plot_quality)):
            path = args.results / f"{kind}.jsonl"
            if path.exists():
                written += draw(load(path), out, plt)
    except ResultsError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
