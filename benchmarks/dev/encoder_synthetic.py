"""Synthetic calibration inputs for a BERT-style encoder (no text): candidates measured on all-MiniLM-L6-v2.

    python benchmarks/dev/encoder_synthetic.py [--configs 4:128] [--runs hqq,gptq:zipf,wrefit:zipf,...]

Each run is ``SOLVER:SOURCE[:OPTION...]``. SOLVER: ``hqq`` (no SOURCE; must come first, the ratios' reference),
``gptq`` (quantpack.quantization.gptq.gptq_quantize, layers in forward order, each with the Hessian of its inputs through the model
quantized so far), ``wrefit`` (quantpack's ``refit`` weighted by the per-input-feature second moments of each layer's
inputs on SOURCE through the source model), ``wrefit-seq`` (the same, inputs through the model quantized so far, as a
block-streamed conversion sees them); a ``+guard`` suffix keeps hqq's rounding for a layer where hqq has the lower
output error on the SOURCE inputs. SOURCE: ``random`` (uniform ordinary tokens, as bench_quality), ``zipf`` (tokens
from the frequency-ordered part of the WordPiece vocabulary, from "the" on, probability ~ rank^-a, padded with an
attention mask), ``mix`` (half each), ``text`` (bench_quality's real calibration text, for reference). OPTIONs:
``a=X`` (Zipf exponent, 1), ``n=N`` (sequences, 128), ``len=LO-HI`` (body lengths, 8-64), ``words`` (no ``##``
pieces), ``punct`` (commas and a closing period), ``damp=X`` (gptq damping), ``blend=X`` (wrefit: X times the mean
moment added to every feature's, a hedge towards the plain weight error), ``seed=N``. Evaluated as bench_quality
does: per-layer output error on the held-out documentation text (source-model inputs) and 1 - cos of mean-pooled
embeddings, both as ratios to hqq's. Prints only.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_quality import (capture_inputs, encoder_case, fetch_minilm, hessian_error, quantizable,  # noqa: E402
                           sentences)
from train_witness import corpus  # noqa: E402

from quantpack.quantization import calibration as calibration_mod  # noqa: E402
from quantpack.quantization.gptq import gptq_quantize  # noqa: E402
from quantpack.quantization.groupwise import quantize  # noqa: E402
from quantpack.reference import dequantize  # noqa: E402


def parse_options(parts):
    opts = {"a": 1.0, "n": 128, "len": (8, 64), "words": False, "punct": False, "damp": 0.01, "seed": 0, "blend": 0.0}
    for part in parts:
        key, _, val = part.partition("=")
        if key == "len":
            lo, hi = val.split("-")
            opts["len"] = (int(lo), int(hi))
        elif key in ("words", "punct"):
            opts[key] = True
        elif key in ("n", "seed"):
            opts[key] = int(val)
        else:
            opts[key] = float(val)
    return opts


@torch.no_grad()
def masked_hessian(model, lin, batch) -> torch.Tensor:
    """``2 X^T X / tokens`` of ``lin``'s inputs on ``batch``'s unpadded tokens (the forward stops there)."""
    got = {}

    class Stop(Exception):
        pass

    def hook(mod, args):
        x = args[0][batch["attention_mask"].bool()].float()
        got["h"] = 2 * x.t() @ x / x.shape[0]
        raise Stop

    handle = lin.register_forward_pre_hook(hook)
    try:
        model(**batch)
    except Stop:
        pass
    finally:
        handle.remove()
    return got["h"]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minilm", type=Path)
    ap.add_argument("--configs", default="4:128")
    ap.add_argument("--runs", default="hqq,gptq:random,gptq:zipf,wrefit:zipf")
    args = ap.parse_args()
    torch.manual_seed(0)
    train, held_out = corpus()
    minilm = args.minilm or fetch_minilm(Path.home() / ".cache" / "quantpack-bench")
    source, run, metrics, _, _ = encoder_case(minilm, held_out, train[-60000:])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm)
    vocab_size = source.config.vocab_size
    text_batch = tok(sentences(train[-60000:], 128), padding=True, truncation=True, max_length=64,
                     return_tensors="pt")
    inputs = capture_inputs(source, run)

    def source_batch(name, opts):
        if name == "text":
            return dict(text_batch)
        if name == "random":
            ids = calibration_mod.ordinary_token_ids(tok, vocab_size)
            r = calibration_mod.random_token_sequences(ids, opts["n"], opts["len"][1] + 2, seed=opts["seed"],
                                                       lead=tok.cls_token_id, tail=tok.sep_token_id)
            return {"input_ids": r, "attention_mask": torch.ones_like(r)}
        if name == "zipf":
            return calibration_mod.zipf_token_sequences(tok, vocab_size, opts["n"], opts["len"], a=opts["a"],
                                                        seed=opts["seed"], words=opts["words"], punct=opts["punct"])
        if name == "mix":
            half = dict(opts, n=opts["n"] // 2)
            r, z = source_batch("random", half), source_batch("zipf", half)
            width = max(r["input_ids"].shape[1], z["input_ids"].shape[1])
            pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
            return {"input_ids": torch.cat([pad(r["input_ids"], tok.pad_token_id),
                                            pad(z["input_ids"], tok.pad_token_id)]),
                    "attention_mask": torch.cat([pad(r["attention_mask"], 0), pad(z["attention_mask"], 0)])}
        raise SystemExit(f"unknown source {name}")

    for cfg in args.configs.split(","):
        bits, gs = (int(v) for v in cfg.split(":"))
        base = None
        for spec in args.runs.split(","):
            solver, *rest = spec.split(":")
            guard = solver.endswith("+guard")
            solver = solver.removesuffix("+guard")
            src = rest[0] if rest else None
            opts = parse_options(rest[1:])
            model = copy.deepcopy(source)
            batch = source_batch(src, opts) if src else None
            moments = (calibration_mod.input_second_moments(source, list(quantizable(source)), batch)
                       if solver == "wrefit" else None)
            errors, guarded = {}, 0
            for name, lin in quantizable(model).items():
                w = lin.weight.float()
                wh = None
                if solver == "hqq" or guard:
                    wh = dequantize(quantize(w, bits=bits, group_size=gs, method="hqq", dtype=torch.bfloat16),
                                    torch.float32)
                if solver == "hqq":
                    wq = wh
                elif solver == "gptq":
                    h = masked_hessian(model, lin, batch)
                    wq = dequantize(gptq_quantize(w, h, bits=bits, group_size=gs, damp=opts["damp"],
                                                  dtype=torch.bfloat16), torch.float32)
                elif solver == "wrefit":
                    m2 = moments[name] + opts["blend"] * moments[name].mean()
                    wq = dequantize(quantize(w, bits=bits, group_size=gs, method="refit", dtype=torch.bfloat16,
                                             input_weights=m2), torch.float32)
                elif solver == "wrefit-seq":  # moments of the inputs through the model quantized so far
                    h = masked_hessian(model, lin, batch)
                    wq = dequantize(quantize(w, bits=bits, group_size=gs, method="refit", dtype=torch.bfloat16,
                                             input_weights=torch.diagonal(h) / 2), torch.float32)
                else:
                    raise SystemExit(f"unknown solver {solver}")
                if guard:
                    h = masked_hessian(model, lin, batch) if solver not in ("gptq", "wrefit-seq") else h
                    if hessian_error(wh - w, h) < hessian_error(wq - w, h):
                        wq, guarded = wh, guarded + 1
                x = inputs[name]
                ref = x @ w.t()
                errors[name] = float(torch.linalg.vector_norm(x @ wq.t() - ref) / torch.linalg.vector_norm(ref))
                lin.weight.copy_(wq.to(lin.weight.dtype))
            m = metrics(model)
            if base is None:
                if solver != "hqq":
                    raise SystemExit("the first run must be hqq (the ratios' reference)")
                base = (m, errors)
            ratios = {n: errors[n] / base[1][n] for n in errors}
            worst = max(ratios, key=ratios.get)
            print(f"{bits}-bit g{gs:<4} {spec:<40} 1-cos {m['one_minus_cos']:.3e} "
                  f"(x{m['one_minus_cos'] / base[0]['one_minus_cos']:.2f} hqq)  mean layer "
                  f"{sum(errors.values()) / len(errors):.4f}  worst x{ratios[worst]:.3f} ({worst})"
                  + (f"  guarded {guarded}" if guard else ""), flush=True)


if __name__ == "__main__":
    main()
