"""Time ``quantpack convert`` on a synthetic Llama-3-8B-shaped checkpoint.

Builds a checkpoint with random bf16 weights and the real Llama-3-8B shapes (hidden 4096,
intermediate 14336, 32 layers, 32 heads / 8 KV heads, vocab 128256; 16 GB in 4 GB shards like the
hub repo), then converts it with ``convert(method=..., device=...)`` and prints the summary.

    python benchmarks/bench_convert.py --method hqq --device cuda          # the acceptance run
    python benchmarks/bench_convert.py --tiny --device cpu                 # smoke test on a CPU
    python benchmarks/bench_convert.py --calibration text.txt --device cuda   # method gptq, calibrated
    python benchmarks/bench_convert.py --calibration text.txt --build-only   # build the source only, then:
    python benchmarks/bench_convert.py --calibration text.txt --device cuda --source /tmp/qp-bench-convert/llama3-8b-random

With ``--calibration`` the source gets a small BPE tokenizer (quantpack.tiny's, 320 tokens: the token ids
exercise the same code as a real vocabulary's) and the conversion runs ``--method gptq`` on that text
(128 sequences of 512 tokens at most, as the converter's defaults). ``--source DIR`` converts an existing
source (built by an earlier ``--keep`` run) instead of building one.

The conversion time includes everything the command does: reading and hashing every input,
quantizing, computing each layer's reconstruction error, writing and hashing the shards, copying
files and the manifest. Building the source is timed separately (not part of the result). A GPU run's result is
appended to benchmarks/results/conversion.jsonl (``--results DIR`` elsewhere, ``--results ""`` not at all).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch


def llama3_8b_config(layers: int, tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=512, intermediate_size=1792, num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=16032, architectures=["LlamaForCausalLM"],
                           tie_word_embeddings=False)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/qp-bench-convert", help="where the source and output go")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="small shapes, for a CPU smoke test")
    parser.add_argument("--method", default="hqq", choices=["hqq", "rtn"])
    parser.add_argument("--calibration", help="UTF-8 text (or 'builtin'): convert with method gptq")
    parser.add_argument("--source", type=Path, help="convert this existing source instead of building one")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--source-shard-size", default="4GB")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--json", help="also write the result as JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the source and output directories")
    parser.add_argument("--build-only", action="store_true", help="build the source and stop (for later --source "
                        "runs: a long conversion then fits one run's time limit)")
    parser.add_argument("--results", default=None, help="append the result to DIR/conversion.jsonl (default "
                        "benchmarks/results, for full-size runs only; '' records nothing)")
    args = parser.parse_args(argv)

    from quantpack.convert import convert
    from quantpack.tiny import make_random_checkpoint

    work = Path(args.workdir)
    src, out = args.source or work / "llama3-8b-random", work / "llama3-8b-random-qp"
    t0 = time.perf_counter()
    if args.source is None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        make_random_checkpoint(src, llama3_8b_config(args.layers, args.tiny), dtype=torch.bfloat16,
                               max_shard_size=args.source_shard_size)
        if args.calibration:  # a tokenizer, for the calibration text
            from quantpack.tiny import make_tiny_llama

            tiny = make_tiny_llama(work / "tokenizer-donor", num_shards=1)
            for f in tiny.glob("tokenizer*"):
                shutil.copy(f, src)
        os.sync()
    else:
        shutil.rmtree(out, ignore_errors=True)
    build_s = time.perf_counter() - t0
    source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"built source: {source_bytes / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards, "
          f"{build_s:.1f} s", flush=True)
    if args.build_only:
        return 0

    method = "gptq" if args.calibration else args.method
    summary = convert(src, out, bits=args.bits, group_size=args.group_size, method=method, device=args.device,
                      max_shard_size=args.max_shard_size, progress=True, calibration=args.calibration)
    print(summary.format_table(), flush=True)
    result = {
        "device": torch.cuda.get_device_name() if summary.settings["device"] == "cuda" else "cpu",
        "layers": args.layers, "tiny": args.tiny, "method": method,
        **({"calibration": "self" if args.calibration == "self" else "builtin" if args.calibration == "builtin" else "file",
            "calibration_tokens": summary.settings["calibration"]["tokens"]} if args.calibration else {}), "bits": args.bits,
        "group_size": args.group_size, "source_gb": round(summary.source_bytes / 1e9, 3),
        "output_gb": round(summary.output_bytes / 1e9, 3), "ratio": round(summary.ratio, 3),
        "layers_quantized": len(summary.quantized), "convert_s": round(summary.seconds, 2),
        "throughput_gb_s": round(summary.throughput / 1e9, 3), "mean_rel_error": round(summary.mean_error, 5),
        "worst_rel_error": round(summary.worst.rel_error, 5), "build_s": round(build_s, 1),
        "timings": {k: round(v, 2) for k, v in summary.timings.items()}, "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.tiny:  # a smoke test's numbers are not results
        sys.path.insert(0, os.path.dirname(__file__))
        from timing import record

        record("conversion", [result], args.results)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
