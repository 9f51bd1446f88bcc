"""``quantpack demo``: the whole job end to end, offline, on a small model the project builds itself."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from .convert import ConvertSummary, convert, default_output_name
from .convert.options import resolve_device
from .tiny import make_tiny_llama
from .verify import DEFAULT_TEXT, VerifyReport, verify

DEMO_TRAIN_STEPS = 120  # on the whole verify passage (a context that holds it): a few seconds on a CPU, and the
# reference is confident at enough positions that the top-1 check judges something rather than being skipped


@dataclass
class DemoResult:
    source: Path
    packed: Path
    conversion: ConvertSummary
    report: VerifyReport


def run_demo(workdir=None, *, bits: int = 4, group_size: int | None = 32, method: str = "hqq",
             device: str = "auto", progress: bool = True) -> DemoResult:
    """Build a tiny Llama (trained briefly on the verify passage) in ``workdir``, convert it, verify it.

    ``workdir`` defaults to a new temporary directory; it must not already hold a demo.
    """
    resolve_device(device)  # a missing GPU refused before anything is built or created
    workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="quantpack-demo-"))
    source = workdir / "tiny-llama"
    if source.exists():
        raise ValueError(f"workdir: {source} already exists; pass an empty or new directory")
    make_tiny_llama(source, train_steps=DEMO_TRAIN_STEPS, train_text=DEFAULT_TEXT, max_position_embeddings=2048)
    packed = workdir / default_output_name(source.name, bits, group_size)  # as `quantpack convert` names it
    conversion = convert(source, packed, bits=bits, group_size=group_size, method=method, device=device,
                         progress=progress)
    report = verify(packed, reference=source, device=device)
    return DemoResult(source, packed, conversion, report)
