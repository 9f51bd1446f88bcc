"""The end-to-end section of verify: the packed and the reference model on the same text (perplexity, KL
divergence and top-1 agreement for causal LMs; cosine similarity of embeddings for encoders)."""
from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint
from ..tiny import quiet_transformers
from .report import CONFIDENT_MARGIN


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


def run_end_to_end(model, ref_dir: Path, root: Path, dev: torch.device, text: str, text_desc: str,
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
