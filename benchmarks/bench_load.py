"""Time ``quantpack.load`` of a mixture-of-experts checkpoint against a dense one of the same bytes.

Builds two random checkpoints with tiny.py's builders and converts them (``rtn``, 4 bits): a Qwen3-MoE with
``--experts`` experts of width ``--expert-width`` per layer (the thousands of per-expert tensors a 128-expert
model stores), and a Llama whose MLP width is ``experts x expert-width``, so both hold the same packed bytes in
the same number of layers. Each is then loaded ``--repeats`` times onto ``--device``; the median wall time, the
number of tensors read and, on a GPU, the peak memory over the packed bytes are printed and appended to
benchmarks/results/load.jsonl (``--results ""`` not at all).

    python benchmarks/bench_load.py --device cuda        # Qwen3-30B-A3B's layer shape (128 experts of width 768, hidden 2048), 4 layers
    python benchmarks/bench_load.py --device cpu --layers 2 --hidden 256 --expert-width 128   # CPU smoke run

Targets: the MoE load at most 2x the dense load's time; its GPU peak at most 1.1x the packed bytes.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import record  # noqa: E402


def build(workdir: Path, args) -> dict[str, Path]:
    """The two sources, converted: {"moe": packed dir, "dense": packed dir}."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quantpack.convert import convert
    from quantpack.tiny import make_tiny_llama, make_tiny_moe

    heads = args.hidden // 64
    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), dtype=torch.bfloat16)
    sources = {
        "moe": make_tiny_moe(workdir / "moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, head_dim=64,
                             intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_width,
                             num_experts=args.experts, num_experts_per_tok=8, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                             **common),
        "dense": make_tiny_llama(workdir / "dense", num_shards=1,
                                 intermediate_size=args.experts * args.expert_width, **common),
    }
    packed = {}
    for kind, src in sources.items():
        packed[kind] = workdir / f"{kind}-packed"
        convert(src, packed[kind], bits=4, group_size=args.group_size, method="rtn", device=args.device)
    return packed


def time_load(path: Path, device: str, repeats: int) -> dict:
    from quantpack import checkpoint, load

    with checkpoint.PackedCheckpoint(path) as pc:
        stored = sum(info.nbytes for info in pc.source.tensors.values())
        tensors = len(pc.source.tensors)
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()  # (the last model's reference cycles freed now, not in the middle of this load's peak)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        model = load(path, device=device, dtype=torch.bfloat16)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if device == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
    row = {"seconds": statistics.median(times), "seconds_all": times, "tensors": tensors, "stored_bytes": stored}
    if peaks:
        row["peak_bytes"] = max(peaks)
        row["peak_over_stored"] = max(peaks) / stored
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", help="where the checkpoints go [default: a temporary folder]")
    parser.add_argument("--results", help='results folder [default: benchmarks/results; "" records nothing]')
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here; use --device cpu")

    import transformers

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        packed = build(Path(tmp), args)
        rows = {kind: time_load(path, args.device, args.repeats) for kind, path in packed.items()}
    shape = {"experts": args.experts, "expert_width": args.expert_width, "hidden": args.hidden,
             "layers": args.layers, "group_size": args.group_size}
    out = []
    for kind, row in rows.items():
        row = {"case": f"load-{kind}", "load_device": args.device, "shape": shape,
               "transformers": transformers.__version__, **row,
               "ratio_to_dense": row["seconds"] / rows["dense"]["seconds"]}
        out.append(row)
        peak = f", peak {row['peak_over_stored']:.3f}x the packed bytes" if "peak_over_stored" in row else ""
        print(f"{kind:5s}: {row['seconds']:.2f} s ({row['tensors']} tensors, {row['stored_bytes'] / 1e6:.0f} MB), "
              f"{row['ratio_to_dense']:.2f}x the dense load{peak}")
    record("load", out, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
