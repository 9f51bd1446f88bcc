"""Where a 2048-token prompt's first token goes: bf16 (transformers' generate) against quantpack's default path and
its eager path, on the 8B shape or a mixture of experts' (bench_decode's presets); each timed (median of 5) and
profiled once: CUDA kernel time by kernel, and the wall time of the profiled call (their difference is the GPU idle,
waiting on the host).

    python benchmarks/dev/ttft_profile.py [--model qwen3-moe] [--layers 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_decode  # noqa: E402


def kernel_table(model, prompt, top: int = 14) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    by_name = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]] += e.device_time_total / 1e3
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {"total_ms": sum(by_name.values()), "wall_ms": wall, "top": rows[:top]}


def host_table(model, prompt, top: int = 25) -> list[str]:
    """Python's own profile of one first token: the functions that hold the host longest (their own time), where a
    host-bound prefill leaves the GPU idle."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(2 * top)
    return out.getvalue().splitlines()


def sync_sites(model, prompt) -> list[str]:
    """Where one first token makes the host wait for the GPU (torch's sync debug mode), most frequent first."""
    import traceback
    import warnings
    from collections import Counter

    sites = Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        sites["; ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-3:])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old, warnings.showwarning = warnings.showwarning, note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return [f"{n:4d}  {site}" for site, n in sites.most_common(12)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama-8b", *bench_decode.MODELS], default="llama-8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers [default: the model's]")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--host", action="store_true", help="also print Python's profile of quantpack's first token")
    parser.add_argument("--syncs", action="store_true", help="also print where quantpack's first token waits for the GPU")
    parser.add_argument("--json")
    a = parser.parse_args()
    layers = a.layers or bench_decode.MODELS.get(a.model, {}).get("layers", 32)
    args = argparse.Namespace(model=a.model, layers=layers, hidden=4096, intermediate=14336, vocab=128256,
                              prompt_len=32, ttft_prompt=a.prompt, context=[0], new_tokens=8)
    model = bench_decode.build_model(args, torch.device("cuda"))
    prompt = torch.randint(0, model.config.vocab_size, (1, a.prompt), device="cuda")
    out = {"bf16_ms": bench_decode.time_to_first_token(model, prompt, quantized=False),
           "bf16_kernels": kernel_table(model, prompt)}
    if a.host:
        out["bf16_host"] = host_table(model, prompt)
    bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
    from quantpack.modules.experts import use_mma_layouts

    use_mma_layouts(model)  # (as quantpack.load does on a GPU; none on a dense model)
    from quantpack import generation
    from quantpack.modules import fused
    from quantpack.modules.merged import merge_projections

    fused.apply(model)
    merge_projections(model)
    out["quantpack_ms"] = bench_decode.time_to_first_token(model, prompt, quantized=True)
    out["quantpack_eager_ms"] = bench_decode.time_to_first_token(model, prompt, quantized=False)
    out["quantpack_eager_kernels"] = kernel_table(model, prompt)
    generation.enable(model, "graphs")
    model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    out["quantpack_kernels"] = kernel_table(model, prompt)
    if a.host:
        out["quantpack_host"] = host_table(model, prompt)
    if a.syncs:
        out["quantpack_syncs_host"] = sync_sites(model, prompt)
    generation.disable(model)
    for k, v in out.items():
        if k.endswith("_ms"):
            print(f"{k}: {v:.2f}")
        elif k.endswith("_host"):
            print("\n".join(v))
        else:
            print(f"{k}: kernels {v['total_ms']:.2f} ms, wall {v['wall_ms']:.2f} ms (profiled)")
            for name, ms in v["top"]:
                print(f"    {ms:8.2f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
