"""The model card (``README.md``) of a packed checkpoint.

The source's card describes the source model; a published packed checkpoint that copied it would
describe itself as the original. ``convert`` writes this card instead: Hub metadata (YAML front
matter: ``base_model``, ``base_model_relation: quantized``, tags, the quantization settings, the
source's license), what the checkpoint is, how to load it, and the command that made it.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from . import __version__
from .sizes import format_size

CARD_NAME = "README.md"


def _source_license(source_dir: Path) -> str | None:
    """The ``license`` of the source's own card front matter, if it has one."""
    from huggingface_hub.repocard import metadata_load

    card = Path(source_dir) / CARD_NAME
    if not card.is_file():
        return None
    try:
        license_ = (metadata_load(card) or {}).get("license")
    except Exception:  # front matter that does not parse: leave the field out (the LICENSE files are copied)
        return None
    return license_ if isinstance(license_, (str, list)) else None


def _source_prose(source_dir: Path) -> str:
    """The body of the source's own card (its front matter dropped: the packed card's replaces it), headings one
    level down so that they sit under the packed card's own section; "" when it has none."""
    import re

    try:
        text = (Path(source_dir) / CARD_NAME).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    match = re.match(r"\A---\r?\n.*?\r?\n---[ \t]*(\r?\n|\Z)", text, flags=re.DOTALL)
    lines, fenced = [], False
    for line in text[match.end() if match else 0:].strip().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        lines.append("#" + line if not fenced and re.match(r"#{1,5} ", line) else line)
    return "\n".join(lines)


def _auto_class(source_dir: Path) -> str:
    import json

    try:
        architectures = json.loads((Path(source_dir) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        architectures = []
    return "AutoModelForCausalLM" if any(str(a).endswith("ForCausalLM") for a in architectures) else "AutoModel"


def convert_command(source: str, revision: str | None, settings: dict) -> str:
    """The ``quantpack convert`` command line that reproduces ``settings``."""
    args = ["quantpack", "convert", source]
    if revision:
        args += ["--revision", revision]
    if settings["scheme"] == "w8a8":
        args += ["--scheme", "w8a8"]
    else:
        group = "none" if settings["group_size"] is None else str(settings["group_size"])
        calibration = settings.get("calibration") or {}
        args += ["--bits", str(settings["bits"]), "--group-size", group, "--axis", str(settings["axis"])]
        if not (calibration and settings["method"] == "refit"):  # an encoder's refit comes from --calibration alone
            args += ["--method", settings["method"]]
        if calibration.get("self") or calibration.get("builtin"):
            args += ["--calibration", "self" if calibration.get("self") else "builtin"]
        elif calibration:  # a user's file: its name is not recorded (its sha256 is)
            args += ["--calibration", "FILE"]
        for pattern, bits in settings.get("bits_for", {}).items():
            args += ["--bits-for", f"{pattern}={bits}"]
    args += ["--dtype", settings["dtype"]]
    for pattern in settings.get("skip", []):
        args += ["--skip", pattern]
    if settings.get("quantize_lm_head"):
        args.append("--quantize-lm-head")
    return shlex.join(args)


def _count(n: int, noun: str) -> str:
    """``1 layer is``, ``2 layers are``."""
    return f"{n} {noun} is" if n == 1 else f"{n} {noun}s are"


def model_card(*, name: str, source: str, revision: str | None, local: bool, settings: dict, quantized: int,
               skipped: list[tuple[str, str]], size_bytes: int, source_bytes: int, source_dir: Path) -> str:
    """The text of the packed checkpoint's README.md."""
    from huggingface_hub import ModelCardData

    scheme, bits = settings["scheme"], settings["bits"]
    group = "per output channel" if settings["group_size"] is None else f"groups of {settings['group_size']}"
    if scheme == "w8a8":
        what = "int8 weights with one scale per output channel, int8 activations quantized per token at run time"
        quantization = {"scheme": scheme, "bits": 8}
    else:
        along = "in-features" if settings["axis"] == 1 else "out-features"
        what = (f"{bits}-bit weights ({scheme}), {group} along {along}, {settings['method'].upper()} zero points, "
                f"scales and zeros in {settings['dtype']}")
        what += "".join(f"; {b}-bit where `{p}` matches" for p, b in settings.get("bits_for", {}).items())
        quantization = {"scheme": scheme, "bits": bits, "group_size": settings["group_size"], "axis": settings["axis"],
                        "method": settings["method"]}
    if settings.get("quantize_lm_head"):
        what += "; the output embeddings (lm_head) quantized too"
    data = ModelCardData(
        base_model=None if local else source,  # a local path is no model id
        base_model_relation=None if local else "quantized",
        license=_source_license(source_dir),
        library_name="transformers",
        tags=["quantpack", f"{8 if scheme == 'w8a8' else bits}-bit", scheme, "quantized"],
        quantization={**quantization, "dtype": settings["dtype"], "quantpack_version": __version__},
    )
    origin = f"[{source}](https://huggingface.co/{source})" if not local else f"`{Path(source).name}` (a local checkpoint)"
    if revision:
        origin += f" at revision `{revision}`"
    auto = _auto_class(source_dir)
    skipped_text = "".join(f"\n- `{n}`: {why}" for n, why in skipped) or "\n- none"
    body = f"""
# {name}

{origin} quantized by [quantpack](https://pypi.org/project/quantpack/) {__version__}: {what}.
{_count(quantized, "linear layer")} quantized; {_count(len(skipped), "layer")} kept as in the source:
{skipped_text}

Size: {format_size(size_bytes)} (the source's weights: {format_size(source_bytes)}). `quantpack.json` records
the settings, the sha256 of every file and tensor, and each quantized layer's relative weight error.

## Use

```python
import quantpack

model = quantpack.load("{name}")  # on a GPU the quantized layers run quantpack's fused kernels
```

or through transformers (importing quantpack registers the quantization method):

```python
import quantpack
from transformers import {auto}

model = {auto}.from_pretrained("{name}")
```

## How it was made

```
{convert_command(source, revision, settings)}
```

Check it against the source (integrity, per-layer error, kernels, KL and top-1 agreement):
`quantpack verify {name}`.
"""
    prose = _source_prose(source_dir)
    if prose:
        body += f"\n## The source model's card\n\n{prose}\n"
    return f"---\n{data.to_yaml()}\n---\n{body}"


def write_model_card(directory: Path, *, resolved, settings: dict, summary, name: str) -> None:
    """Write ``directory/README.md`` for a conversion (``resolved``: the source, ``summary``: the
    :class:`~quantpack.convert.ConvertSummary` of the layers and sizes). ``name`` (the title, and the
    path in the examples) is the default output name, not ``--output``, so that the card, like every
    other output file, depends only on the source and the settings."""
    text = model_card(name=name, source=resolved.repo, revision=resolved.revision, local=resolved.local,
                      settings=settings, quantized=len(summary.quantized),
                      skipped=[(layer.name, layer.skipped) for layer in summary.skipped],
                      size_bytes=summary.output_bytes, source_bytes=summary.source_bytes, source_dir=resolved.path)
    (Path(directory) / CARD_NAME).write_text(text, encoding="utf-8")
