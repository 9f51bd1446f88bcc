"""Calibration text for the calibrated method (``--method gptq``): reading and checking it, and cutting it
into token sequences with the source's own tokenizer.

``builtin`` names a short passage shipped with quantpack (``calibration.txt``: about 1,100 words of
varied English prose, dialogue, code and numbers), enough for a quick try; real use wants text like
the model's own data, a few hundred thousand tokens or more.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).with_name("calibration.txt")
DEFAULT_SEQUENCE_LENGTH = 512  # tokens per calibration sequence (capped at the model's context)
DEFAULT_MAX_SEQUENCES = 128  # more sequences add little to a 4096-wide Hessian and cost time


@dataclass(frozen=True)
class CalibrationText:
    """The text, its origin (``builtin`` or the file's path) and the sha256 of its bytes."""

    text: str
    source: str
    sha256: str


def read_calibration(spec: str | Path) -> CalibrationText:
    """The calibration text named by ``spec``: a UTF-8 text file, or ``"builtin"``.

    Raises ``ValueError`` with a one-line message for a missing, unreadable, empty or binary file.
    """
    if str(spec) == BUILTIN:
        path, source = BUILTIN_FILE, BUILTIN
    else:
        path = Path(spec).expanduser()
        source = str(spec)
    what = f"calibration: {source}"
    hint = "pass a UTF-8 text file, or --calibration builtin for the built-in passage"
    if not path.exists():
        raise ValueError(f"{what} does not exist; {hint}")
    if path.is_dir():
        raise ValueError(f"{what} is a directory; {hint}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{what} cannot be read ({e.strerror or e}); {hint}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): a binary "
                         f"file?; {hint}") from None
    if "\x00" in text:
        raise ValueError(f"{what} contains NUL bytes (offset {text.index(chr(0))}): a binary file, not text; {hint}")
    if not text.strip():
        raise ValueError(f"{what} is empty; {hint}")
    return CalibrationText(text, source, hashlib.sha256(data).hexdigest())


def sequence_length(config, requested: int | None) -> int:
    """Tokens per calibration sequence: ``requested`` (default :data:`DEFAULT_SEQUENCE_LENGTH`), at most the
    model's ``max_position_embeddings``."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 2):
        raise ValueError(f"calibration_length={requested!r} must be an integer >= 2")
    limit = getattr(config, "max_position_embeddings", None)
    length = requested or DEFAULT_SEQUENCE_LENGTH
    return min(length, limit) if isinstance(limit, int) and limit > 1 else length


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The source checkpoint's tokenizer; a one-line ``ValueError`` when it has none."""
    from transformers import AutoTokenizer

    from .tiny import quiet_transformers

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        first = " ".join(str(e).split())[:120]
        raise ValueError(f"calibration: cannot load the source's tokenizer to tokenize the text ({type(e).__name__}: "
                         f"{first}); the calibrated method needs the tokenizer files next to config.json") from None


def token_sequences(cal: CalibrationText, tokenizer, length: int,
                    max_sequences: int = DEFAULT_MAX_SEQUENCES) -> torch.Tensor:
    """``cal`` as non-overlapping sequences of ``length`` tokens, (sequences, length), each led by the
    tokenizer's BOS token when it has one (as the model sees text); at most ``max_sequences``. A
    shorter tail is dropped. A one-line ``ValueError`` when the text holds less than one sequence."""
    if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 1:
        raise ValueError(f"calibration_sequences={max_sequences!r} must be a positive integer")
    ids = tokenizer(cal.text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    body = length - (1 if bos is not None else 0)
    if len(ids) < body:
        raise ValueError(f"calibration: {cal.source} has {len(ids)} tokens but one sequence needs {body} (sequences "
                         f"of {length} tokens{', BOS included' if bos is not None else ''}); pass a longer text or "
                         f"a smaller --calibration-length")
    count = min(len(ids) // body, max_sequences)
    seqs = torch.tensor(ids[:count * body], dtype=torch.long).reshape(count, body)
    if bos is not None:
        seqs = torch.cat([torch.full((count, 1), bos, dtype=torch.long), seqs], dim=1)
    return seqs
