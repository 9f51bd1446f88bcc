"""Where a 2048-token prompt's first token goes: bf16 (transformers' generate) against quantpack's default path and
its eager path, on the 8B shape; each timed (median of 5) and profiled once, CUDA kernel time by kernel.

    python benchmarks/dev/ttft_profile.py [--layers 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_decode  # noqa: E402


def kernel_table(model, prompt, top: int = 14) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]] += e.device_time_total / 1e3
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {"total_ms": sum(by_name.values()), "top": rows[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--json")
    a = parser.parse_args()
    args = argparse.Namespace(model="llama-8b", layers=a.layers, hidden=4096, intermediate=14336, vocab=128256,
                              prompt_len=32, ttft_prompt=a.prompt, context=[0], new_tokens=8)
    model = bench_decode.build_model(args, torch.device("cuda"))
    prompt = torch.randint(0, args.vocab, (1, a.prompt), device="cuda")
    out = {"bf16_ms": bench_decode.time_to_first_token(model, prompt, quantized=False),
           "bf16_kernels": kernel_table(model, prompt)}
    bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
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
    generation.disable(model)
    for k, v in out.items():
        if k.endswith("_ms"):
            print(f"{k}: {v:.2f}")
        else:
            print(f"{k}: total {v['total_ms']:.2f} ms")
            for name, ms in v["top"]:
                print(f"    {ms:8.2f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
