"""bench_quality's block-wise ``gptq`` on a pretrained causal LM, calibrated on the token layout ``convert
--calibration FILE`` cuts from the same text, next to hqq. CPU only; prints, saves nothing.

    OMP_NUM_THREADS=1 python benchmarks/dev/gptq_convert_layout.py [--checkpoint gemma3|smollm2] [--configs 4:128]
        [--shrink 0,0.25]

bench_quality.py calibrates on up to 64 windows of 128 tokens of its calibration text, each led only by what the
tokenizer itself adds; ``convert`` cuts that text with quantpack.calibration.token_sequences: sequences of the
default length (512, at most the model's context), at most 128 of them, each led by BOS. Same text, same evaluation,
same quantize_blocks: only the token layout differs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]  # benchmarks/ (the harness), the repo
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import bench_quality as bq  # noqa: E402
from quantpack import calibration as cal  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", choices=("gemma3", "smollm2"), default="gemma3")
    ap.add_argument("--configs", default="4:128", help="BITS:GROUP_SIZE pairs")
    ap.add_argument("--shrink", default="0", help="Hessian shrinkages a to measure on convert's layout")
    args = ap.parse_args()
    torch.manual_seed(0)
    train, held_out = bq.corpus()
    text = train[-60000:]  # bench_quality's calibration text
    source = bq.GEMMA3 if args.checkpoint == "gemma3" else bq.SMOLLM2
    path = bq.fetch_gguf_checkpoint(source, Path.home() / ".cache" / "quantpack-bench")
    model, run, metrics, _, calib_runs, tokens = bq.causal_case(path, held_out, text, blockwise=True)
    layout = cal.token_sequences(cal.CalibrationText(text, "bench_quality", ""), AutoTokenizer.from_pretrained(path),
                                 cal.sequence_length(model.config, None))
    print(f"{source.name}: bench_quality's layout {tuple(tokens['text'].shape)}, convert's {tuple(layout.shape)}",
          flush=True)
    for bits, gs in (tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")):
        q, hqq_errors = bq.quantize_model(model, run, "hqq", bits, gs, calib_runs, tokens)
        hqq = metrics(q)
        del q
        for shrink in (float(a) for a in args.shrink.split(",")):
            start = time.perf_counter()
            q, errors = bq.quantize_model(model, run, f"gptq+shrink={shrink}", bits, gs, calib_runs,
                                          {**tokens, "text": layout})
            m = metrics(q)
            del q
            worst = max(errors[n] / hqq_errors[n] for n in errors)
            print(f"{bits}-bit g{gs} gptq+shrink={shrink} on convert's layout: KL {m['kl']:.3e} "
                  f"(x{m['kl'] / hqq['kl']:.2f} hqq's {hqq['kl']:.3e}), top-1 {m['top1']:.4f}, "
                  f"ppl {m['ppl']:.3f}/{m['source_ppl']:.3f}, worst "
                  f"layer x{worst:.3f} hqq ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
