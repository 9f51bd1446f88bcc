""":func:`verify`: the arguments checked, then the four sections in order, each building on the one before."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from .. import checkpoint
from ..checkpoint import CheckpointError
from ..checkpoint.experts import split_stacked_experts
from .end_to_end import run_end_to_end
from .integrity import check_integrity, quantized_modules
from .kernels import kernel_errors
from .layers import layer_errors
from .report import (CONFIDENT_MARGIN, DEFAULT_CONTEXT_LENGTH, DEFAULT_MAX_KL, DEFAULT_MAX_TOKENS, DEFAULT_MIN_COSINE,
                     DEFAULT_MIN_TOP1, DEFAULT_TEXT, MIN_CONFIDENT_POSITIONS, Check, VerifyReport, quantization_summary)


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


def _resolve_reference(reference, manifest: dict | None, *, revision=None, token=None, allow_pickle: bool = False,
                       trust_remote_code: bool = False):
    """(directory, description) of the reference checkpoint: ``reference`` or the manifest's source."""
    from ..checkpoint.hub import resolve_source

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
        resolved = resolve_source(repo, revision=revision, token=token, allow_pickle=allow_pickle,
                                   trust_remote_code=trust_remote_code)
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

    from ..checkpoint.hub import resolve_checkpoint

    try:
        root = resolve_checkpoint(packed, revision=revision, token=token)
    except CheckpointError as e:
        raise ValueError("packed" + str(e).removeprefix("path_or_repo_id")) from None
    from tqdm.auto import tqdm

    with tqdm(desc="verifying", unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        return _verify(root, bar, t0, reference=reference, text=text, text_desc=text_desc, dev=dev, max_kl=max_kl,
                       min_top1=min_top1, min_cosine=min_cosine, max_layer_error=max_layer_error,
                       context_length=context_length, max_tokens=max_tokens, dtype=dtype, end_to_end=end_to_end,
                       token=token, allow_pickle=allow_pickle,
                                   trust_remote_code=trust_remote_code)


# A layer's recomputed relative error may exceed the one recorded at conversion by this factor (plus the
# slack, for layers recorded as exact) before verify fails: other devices and kernels move it by far less.
RECORDED_ERROR_MARGIN = 2.0
RECORDED_ERROR_SLACK = 1e-3

# What makes two configs the same network, as far as comparing their weights and logits goes.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
              "num_attention_heads", "num_key_value_heads", "n_embd", "n_layer", "n_head")


def _check_same_model(root: Path, packed: dict, ref_dir: Path, ref: dict) -> None:
    """Refuse a reference of another architecture or size (building the packed class from it could
    allocate a model of the class's default size): bad input, exit 2."""
    differ = [k for k in SHAPE_KEYS if packed.get(k) != ref.get(k)]
    if differ:
        k = differ[0]
        raise ValueError(f"reference: {ref_dir} has {k}={ref.get(k)!r} but {root} has {k}={packed.get(k)!r}; "
                         f"pass the checkpoint it was converted from as --reference")


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
            ref_dir, report.reference = _resolve_reference(reference, manifest, token=token, allow_pickle=allow_pickle,
                                                           trust_remote_code=trust_remote_code)
        except ValueError as e:
            if reference is not None:
                raise
            ref_error = str(e)
    from ..hf_config import check_remote_code

    # Refused as bad input (the files may well be intact): running their code needs the user's word.
    configs = {}
    for where in [root] + ([ref_dir] if ref_dir is not None else []):
        try:
            configs[where] = config = checkpoint.read_config(where)
        except CheckpointError:
            continue  # the integrity check (or loading the reference) reports it
        check_remote_code(where, config, trust_remote_code=trust_remote_code)
    if ref_dir is not None and len(configs) == 2:
        _check_same_model(root, configs[root], ref_dir, configs[ref_dir])
    bar.set_postfix_str("integrity")
    summary, report.problems, qc = check_integrity(root, reference=ref_dir, allow_pickle=allow_pickle,
                                                  trust_remote_code=trust_remote_code)
    report.integrity = summary
    report.quantization = quantization_summary(qc, manifest)
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

    from ..loader import load

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

    ref = split_stacked_experts(model, checkpoint.SourceCheckpoint(ref_dir, allow_pickle=allow_pickle))
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
    # A layer far worse than at conversion is damaged (swapped or rewritten scales, with digests to match),
    # whatever the thresholds: the worst ratio is a check of its own (docs/verify.md).
    ratios = [(item["rel_error"] / (item["manifest_rel_error"] + RECORDED_ERROR_SLACK), item["name"])
              for item in report.layers["items"] if item["manifest_rel_error"] is not None]
    if ratios:
        ratio, name = max(ratios)
        report.checks.append(Check("layer_error_vs_recorded", ratio, RECORDED_ERROR_MARGIN, "<=",
                                   ratio <= RECORDED_ERROR_MARGIN))
        if ratio > RECORDED_ERROR_MARGIN:
            report.warnings.append(f"layer {name}: relative error {ratio:.4g}x the one recorded at conversion "
                                   f"(more than {RECORDED_ERROR_MARGIN:g}x): its packed tensors are damaged")
    if report.layers["missing"]:
        report.warnings.append(f"{len(report.layers['missing'])} quantized layers have no weight in the reference "
                               f"(e.g. {report.layers['missing'][0]})")
    if max_layer_error is not None and report.layers["count"]:
        value = report.layers["max_rel_error"]
        report.checks.append(Check("max_layer_error", value, max_layer_error, "<=", value <= max_layer_error))

    if end_to_end:
        bar.set_postfix_str("end to end")
        report.end_to_end = run_end_to_end(model, ref_dir, root, dev, text, text_desc, context_length, max_tokens,
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
