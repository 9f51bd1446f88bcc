"""Calibration text for the calibrated method (``--method gptq``): reading and checking it, and cutting it
into token sequences with the source's own tokenizer; or, with ``self``, text the model writes itself.

``builtin`` names a short passage shipped with quantpack (``calibration.txt``: about 1,100 words of
varied English prose, dialogue, code and numbers), enough for a quick try; real use wants text like
the model's own data, a few hundred thousand tokens or more.

``self`` needs no text: a causal LM samples its own calibration sequences (temperature 1, from BOS and a
random first token; LLM-QAT's data-free generation), once, at the start of the conversion, on the
conversion device. Generating holds the whole model there (an 8B model in bfloat16: 16 GB, plus the
KV cache of :data:`SELF_BATCH` sequences); the block-streamed quantizing that follows does not, and it
trusts their Hessians only halfway (:data:`quantpack.quantization.gptq.SELF_SHRINK`).

For a model that is not a causal LM (a BERT-style encoder), ``self`` samples token sequences from the
vocabulary instead (:func:`zipf_token_sequences`: WordPiece vocabularies list their words in frequency
order), runs them once through the whole model in float32, and weighs ``refit`` by each layer's
per-input-feature second moments on them (:func:`self_input_moments`).
"""
from __future__ import annotations

import hashlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).with_name("calibration.txt")
DEFAULT_SEQUENCE_LENGTH = 512  # tokens per calibration sequence (capped at the model's context)
DEFAULT_MAX_SEQUENCES = 128  # more sequences add little to a 4096-wide Hessian and cost time
SELF = "self"  # --calibration self: text the model writes itself
SELF_SEED = 0
SELF_BATCH = 32  # sequences generated together: bounds the KV cache (an 8B Llama: 2 GiB at 512 tokens)
# encoders: body lengths (between [CLS] and [SEP]) and the Zipf exponent of the sampled vocabulary; measured on
# all-MiniLM-L6-v2 (BENCHMARKS.md), longer bodies and a flatter exponent change little
ENCODER_BODY_LENGTHS = (8, 64)
ENCODER_ZIPF_EXPONENT = 1.0
_UNUSED_TOKEN = re.compile(r"^[\[<]unused\d+[\]>]$")  # BERT's [unused0]..., Gemma's <unused0>...


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

    from ..tiny import quiet_transformers

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
                            batch: int = SELF_BATCH, top_p: float = 1.0) -> torch.Tensor:
    """(count, length) tokens the causal LM ``model`` writes itself: each sequence starts from BOS (when the
    tokenizer has one) and a random ordinary token, then samples at temperature 1 from the model's whole
    next-token distribution (whatever its ``generation_config`` says; ``top_p`` < 1: from the fewest likeliest tokens
    that hold that much of it), never a token outside ``ids`` (no EOS: every sequence runs its full length).
    ``batch`` sequences at a time bound the KV cache. Deterministic for a seed on one device."""
    from transformers import GenerationConfig

    from ..tiny import quiet_transformers

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
    settings = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=top_p, max_new_tokens=new,
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
    device = torch.device(device)
    ids = ordinary_token_ids(tokenizer, vocab_size)
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        return _on_whole_model(model_class, path, dtype, device, trust_remote_code,
                               lambda model: sampled_token_sequences(model, ids, count, length, seed=seed, bos=bos))
    except torch.OutOfMemoryError:
        raise ValueError(f"calibration: self: the whole model does not fit in {device}'s memory to write its own "
                         f"calibration text; pass --calibration FILE (quantized one block at a time)") from None


def _on_whole_model(model_class, path: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool, use):
    """``use(model)`` for the model stored at ``path`` (built as ``model_class``), loaded whole on ``device`` in
    ``dtype``; the model is dropped and its device memory handed back before returning (out-of-memory errors pass
    through: each caller says what to do instead)."""
    from ..tiny import quiet_transformers

    with quiet_transformers():
        model = model_class.from_pretrained(path, dtype=dtype, device_map={"": device},
                                            trust_remote_code=trust_remote_code).eval()
    try:
        return use(model)
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -- encoders (``--calibration self`` on a model that is not a causal LM): sampled vocabulary, second moments


def zipf_token_sequences(tokenizer, vocab_size: int, count: int = DEFAULT_MAX_SEQUENCES,
                         lengths: tuple[int, int] = ENCODER_BODY_LENGTHS, *, a: float = ENCODER_ZIPF_EXPONENT,
                         seed: int = SELF_SEED, words: bool = False, punct: bool = False) -> dict[str, torch.Tensor]:
    """``count`` sequences ``[CLS] body [SEP] [PAD]...`` as ``input_ids`` and ``attention_mask`` (padding masked
    out), body lengths uniform in ``lengths`` (inclusive), body tokens drawn with probability ~ rank^-``a`` from
    the ordinary tokens (no special or ``[unused]`` ones) from ``"the"`` on, where the vocabulary has it (a
    WordPiece vocabulary lists its words in frequency order from there; else from its first ordinary token).
    The tokenizer's CLS (else BOS) leads and its SEP (else EOS) closes each sequence. ``words``: no ``##``
    continuation pieces; ``punct``: some commas and a closing period. Deterministic for a seed.

    A one-line ``ValueError`` when the vocabulary has no ordinary token to draw from."""
    vocab = tokenizer.get_vocab()
    ids = ordinary_token_ids(tokenizer, vocab_size)
    inv = {v: k for k, v in vocab.items()}
    start = vocab.get("the", 0)
    keep = [i for i in ids.tolist() if i >= start and not _UNUSED_TOKEN.match(inv.get(i, ""))
            and not (words and inv.get(i, "").startswith("##"))]
    if not keep:
        raise ValueError(f"calibration: self: the tokenizer ({type(tokenizer).__name__}) has no ordinary token below "
                         f"the model's vocab_size={vocab_size} to sample inputs from; use --method hqq")
    ids = torch.tensor(keep)
    lead = next((t for t in (tokenizer.cls_token_id, tokenizer.bos_token_id) if t is not None), None)
    tail = next((t for t in (tokenizer.sep_token_id, tokenizer.eos_token_id) if t is not None), None)
    pad = next((t for t in (tokenizer.pad_token_id, tail, int(ids[0])) if t is not None))
    lo, hi = lengths
    p = torch.arange(1, len(ids) + 1, dtype=torch.float64).pow(-a)
    gen = torch.Generator().manual_seed(seed)
    body_lengths = torch.randint(lo, hi + 1, (count,), generator=gen)
    ends = (lead is not None) + (tail is not None)
    width = int(body_lengths.max()) + ends
    input_ids = torch.full((count, width), pad, dtype=torch.long)
    mask = torch.zeros((count, width), dtype=torch.long)
    comma, period = vocab.get(","), vocab.get(".")
    for i, n in enumerate(body_lengths.tolist()):
        body = ids[torch.multinomial(p, n, replacement=True, generator=gen)]
        if punct and comma is not None and period is not None:
            commas = torch.rand(n, generator=gen) < 0.06
            body = torch.where(commas, torch.tensor(comma), body)
            body[-1] = period
        row = ([lead] if lead is not None else []) + body.tolist() + ([tail] if tail is not None else [])
        input_ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def encoder_text_sequences(cal: CalibrationText, tokenizer, body: int,
                           max_sequences: int = DEFAULT_MAX_SEQUENCES) -> dict[str, torch.Tensor]:
    """``cal`` as an encoder reads text: non-overlapping windows of ``body`` tokens, each ``[CLS] window [SEP]`` (the
    tokenizer's CLS, else BOS, and SEP, else EOS), at most ``max_sequences``, the last window possibly shorter
    (padding masked out), as ``input_ids`` and ``attention_mask`` like :func:`zipf_token_sequences`. A one-line
    ``ValueError`` when the text has no token."""
    ids = tokenizer(cal.text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"calibration: {cal.source} holds no token for the source's tokenizer; pass a text in the "
                         f"model's language")
    lead = next((t for t in (tokenizer.cls_token_id, tokenizer.bos_token_id) if t is not None), None)
    tail = next((t for t in (tokenizer.sep_token_id, tokenizer.eos_token_id) if t is not None), None)
    pad = next((t for t in (tokenizer.pad_token_id, tail, ids[0]) if t is not None))
    rows = [([lead] if lead is not None else []) + ids[i:i + body] + ([tail] if tail is not None else [])
            for i in range(0, len(ids), body)][:max_sequences]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def encoder_body_lengths(config, requested: int | None) -> tuple[int, int]:
    """Body lengths for :func:`zipf_token_sequences`: :data:`ENCODER_BODY_LENGTHS`, or up to ``requested`` tokens
    per sequence (``--calibration-length``), both within the model's ``max_position_embeddings`` ([CLS] and [SEP]
    included)."""
    lo, hi = ENCODER_BODY_LENGTHS
    if requested is not None:
        hi = sequence_length(config, requested) - 2
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 2:
        hi = min(hi, limit - 2)
    if hi < 1:
        raise ValueError(f"calibration_length={requested!r} leaves no room between [CLS] and [SEP]; pass at least 3")
    return min(lo, hi), hi


@torch.no_grad()
def input_second_moments(model, names, batch: dict[str, torch.Tensor] | Callable) -> dict[str, torch.Tensor]:
    """One forward of ``batch`` through ``model``: for each linear module in ``names``, the mean over the unpadded
    tokens of its inputs' squares per input feature (K,), in float32 on the CPU. A layer the forward never calls
    has none. ``batch``: the model's keyword inputs, padding marked by their ``attention_mask``; or a function
    that runs the model on inputs without padding (every token counts)."""
    keep = None if callable(batch) else batch["attention_mask"].bool()
    sums: dict[str, list] = {}

    def hook(name):
        def record(module, args):
            x = args[0]
            # a layer fed one row per sequence (a pooler's [CLS] token) has no padding to drop
            x = (x[keep] if keep is not None and tuple(x.shape[:-1]) == tuple(keep.shape)
                 else x.reshape(-1, x.shape[-1]))
            x = x.float()
            got = sums.setdefault(name, [0.0, 0])
            got[0] = got[0] + x.square().sum(0)
            got[1] += x.shape[0]
        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        if callable(batch):
            batch(model)
        else:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return {n: (total / max(rows, 1)).cpu() for n, (total, rows) in sums.items()}


def self_input_moments(model_class, path: Path, names, batch: dict[str, torch.Tensor], *, device,
                       trust_remote_code: bool = False) -> dict[str, torch.Tensor]:
    """:func:`input_second_moments` of the model stored at ``path`` (built as ``model_class``), loaded whole on
    ``device`` in float32 and freed before returning. A one-line ``ValueError`` when it does not fit the device
    or its forward does not take token ids and an attention mask."""
    device = torch.device(device)
    params = inspect.signature(model_class.forward).parameters
    if not {"input_ids", "attention_mask"} <= set(params):
        raise ValueError(f"calibration: self: {model_class.__name__} does not take token ids and an attention mask; "
                         f"use --method hqq")
    on_device = {k: v.to(device) for k, v in batch.items()}
    try:
        return _on_whole_model(model_class, path, torch.float32, device, trust_remote_code,
                               lambda model: input_second_moments(model, names, on_device))
    except torch.OutOfMemoryError:
        raise ValueError(f"calibration: self: the whole model does not fit in {device}'s memory (float32) to measure "
                         f"its own activations; use --method hqq") from None
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        first = " ".join(str(e).split())[:120]
        raise ValueError(f"calibration: self: cannot run sampled tokens through {model_class.__name__} "
                         f"({type(e).__name__}: {first}); use --method hqq") from None
