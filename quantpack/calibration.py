"""Calibration text for the calibrated method (``--method gptq``): reading and checking it, and cutting it
into token sequences with the source's own tokenizer; or, with ``self``, text the model writes itself.

``builtin`` names a short passage shipped with quantpack (``calibration.txt``: about 1,100 words of
varied English prose, dialogue, code and numbers), enough for a quick try; real use wants text like
the model's own data, a few hundred thousand tokens or more.

``self`` needs no text: a causal LM samples its own calibration sequences (temperature 1, from BOS and a
random first token; LLM-QAT's data-free generation), once, at the start of the conversion, on the
conversion device. Generating holds the whole model there (an 8B model in bfloat16: 16 GB, plus the
KV cache of :data:`SELF_BATCH` sequences); the block-streamed quantizing that follows does not.
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
SELF = "self"  # --calibration self: text the model writes itself
SELF_SEED = 0
SELF_BATCH = 32  # sequences generated together: bounds the KV cache (an 8B Llama: 2 GiB at 512 tokens)


@dataclass(frozen=True)
class SelfCalibration:
    """``--calibration self``: sequences the model samples itself, :data:`SELF_SEED` seeding the sampling."""

    source: str = SELF
    seed: int = SELF_SEED


@dataclass(frozen=True)
class CalibrationText:
    """The text, its origin (``builtin`` or the file's path) and the sha256 of its bytes."""

    text: str
    source: str
    sha256: str


def read_calibration(spec: str | Path) -> CalibrationText | SelfCalibration:
    """The calibration text named by ``spec``: a UTF-8 text file, ``"builtin"``, or ``"self"`` (the model
    writes it; a file named ``self`` is ``./self``).

    Raises ``ValueError`` with a one-line message for a missing, unreadable, empty or binary file.
    """
    if str(spec) == SELF:
        return SelfCalibration()
    if str(spec) == BUILTIN:
        path, source = BUILTIN_FILE, BUILTIN
    else:
        path = Path(spec).expanduser()
        source = str(spec)
    what = f"calibration: {source}"
    hint = ("pass a UTF-8 text file, --calibration builtin for the built-in passage, or --calibration self for text "
            "the model writes itself")
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


# -- inputs the model makes itself (``--calibration self``): no text from the user


def ordinary_token_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """The ids a random sequence draws from: the tokenizer's vocabulary below ``vocab_size`` (the
    embedding's rows), without its special tokens (BOS, EOS, padding, masks, ...)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    n = min(vocab_size, len(tokenizer))
    keep = torch.ones(n, dtype=torch.bool)
    keep[[i for i in special if 0 <= i < n]] = False
    return keep.nonzero().flatten()


def random_token_sequences(ids: torch.Tensor, count: int, length: int, *, seed: int, lead: int | None = None,
                           tail: int | None = None) -> torch.Tensor:
    """(count, length) token ids drawn uniformly from ``ids`` with a generator seeded by ``seed``, led by
    ``lead`` (BOS, [CLS]) and closed by ``tail`` ([SEP]) when given."""
    gen = torch.Generator().manual_seed(seed)
    body = length - (lead is not None) - (tail is not None)
    seqs = ids[torch.randint(len(ids), (count, body), generator=gen)]
    parts = ([torch.full((count, 1), lead)] if lead is not None else []) + [seqs] + (
        [torch.full((count, 1), tail)] if tail is not None else [])
    return torch.cat(parts, dim=1)


@torch.no_grad()
def sampled_token_sequences(model, ids: torch.Tensor, count: int, length: int, *, seed: int, bos: int | None,
                            batch: int = SELF_BATCH) -> torch.Tensor:
    """(count, length) tokens the causal LM ``model`` writes itself: each sequence starts from BOS (when the
    tokenizer has one) and a random ordinary token, then samples at temperature 1 from the model's whole
    next-token distribution (whatever its ``generation_config`` says), never a token outside ``ids`` (no EOS:
    every sequence runs its full length). ``batch`` sequences at a time bound the KV cache. Deterministic for
    a seed on one device."""
    from transformers import GenerationConfig

    from .tiny import quiet_transformers

    device = next(model.parameters()).device
    rows = model.get_output_embeddings().out_features
    allowed = torch.zeros(rows, dtype=torch.bool)
    allowed[ids] = True
    suppress = (~allowed).nonzero().flatten().tolist()
    gen = torch.Generator().manual_seed(seed)
    starts = ids[torch.randint(len(ids), (count, 1), generator=gen)]
    if bos is not None:
        starts = torch.cat([torch.full((count, 1), bos), starts], dim=1)
    new = length - starts.shape[1]
    if new <= 0:  # nothing left to write
        return starts[:, :length]
    # a config of its own, with the model's set aside while generating (generate fills unset values from it): a
    # checkpoint's generation_config.json (top-k/top-p, repetition penalties, ...) does not apply
    settings = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                min_new_tokens=new, suppress_tokens=suppress, use_cache=True,
                                pad_token_id=bos if bos is not None else int(ids[0]))
    out = []
    own, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_transformers():
            torch.manual_seed(seed)
            for i in range(0, count, batch):
                prompt = starts[i:i + batch].to(device)
                seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=settings)
                out.append(seqs[:, :length].cpu())
    finally:
        model.generation_config = own
    return torch.cat(out)


def self_calibration_tokens(model_class, path: Path, tokenizer, vocab_size: int, count: int, length: int, *,
                            device, dtype: torch.dtype, seed: int = SELF_SEED,
                            trust_remote_code: bool = False) -> torch.Tensor:
    """``count`` sequences of ``length`` tokens that the causal LM stored at ``path`` (built as
    ``model_class``) samples itself on ``device`` (see :func:`sampled_token_sequences`); the model is
    loaded whole there, in ``dtype``, and freed before returning. A one-line ``ValueError`` when it does not
    fit the device."""
    from .tiny import quiet_transformers

    device = torch.device(device)
    ids = ordinary_token_ids(tokenizer, vocab_size)
    try:
        with quiet_transformers():
            model = model_class.from_pretrained(path, dtype=dtype, device_map={"": device},
                                                trust_remote_code=trust_remote_code).eval()
        try:
            return sampled_token_sequences(model, ids, count, length, seed=seed,
                                           bos=getattr(tokenizer, "bos_token_id", None))
        finally:
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except torch.OutOfMemoryError:
        raise ValueError(f"calibration: self: the whole model does not fit in {device}'s memory to write its own "
                         f"calibration text; pass --calibration FILE (quantized one block at a time)") from None
