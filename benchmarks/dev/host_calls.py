"""Host time of each call an eager decode step makes in one Llama decoder layer (8B shape), bf16 against quantpack,
and a cProfile of quantpack's calls: what to take out of eager decode. An experiment, not a product benchmark:

    python benchmarks/dev/host_calls.py --batch 1 16
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_decode  # noqa: E402
from timing import host_us  # noqa: E402


def layer_calls(layer, x, cos, sin, rotary):
    attn, mlp = layer.self_attn, layer.mlp
    b = x.shape[0]
    q4 = torch.randn(b, 32, 1, 128, dtype=x.dtype, device=x.device)
    k4 = torch.randn(b, 8, 1, 128, dtype=x.dtype, device=x.device)
    h = torch.randn(b, 1, 14336, dtype=x.dtype, device=x.device)
    return {
        "q/k/v": lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
        "o": lambda: attn.o_proj(x),
        "gate/up": lambda: (mlp.gate_proj(x), mlp.up_proj(x)),
        "down": lambda: mlp.down_proj(h),
        "rmsnorm": lambda: layer.input_layernorm(x),
        "rotary": lambda: rotary(q4, k4, cos, sin),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args()
    from transformers.models.llama import modeling_llama

    from quantpack.modules import fused
    from quantpack.modules.merged import merge_projections

    args = argparse.Namespace(hidden=4096, intermediate=14336, vocab=1024, layers=1)
    model = bench_decode.build_model(args, torch.device("cuda"))
    bf16_layer = model.model.layers[0]
    import copy

    qmodel = copy.deepcopy(model)
    bench_decode.quantize_in_place(qmodel, bits=4, group_size=128, method="rtn")
    original_rotary = modeling_llama.apply_rotary_pos_emb
    fused.apply(qmodel)
    merge_projections(qmodel)
    fused_rotary = modeling_llama.apply_rotary_pos_emb
    q_layer = qmodel.model.layers[0]
    with torch.no_grad():
        for batch in a.batch:
            x = torch.randn(batch, 1, 4096, dtype=torch.bfloat16, device="cuda")
            cos = torch.randn(1, 1, 128, dtype=torch.bfloat16, device="cuda")
            sin = torch.randn(1, 1, 128, dtype=torch.bfloat16, device="cuda")
            ref = layer_calls(bf16_layer, x, cos, sin, original_rotary)
            quant = layer_calls(q_layer, x, cos, sin, fused_rotary)
            print(f"\nbatch {batch}: us per call (host)")
            print(f"{'call':>10} {'bf16':>8} {'quantpack':>10} {'no plans/replays':>17}")
            for name in ref:
                t_ref = host_us(ref[name], reps=400, rounds=5)
                t_q = host_us(quant[name], reps=400, rounds=5)
                os.environ["QUANTPACK_LAUNCH_PLANS"] = "0"
                t_off = host_us(quant[name], reps=400, rounds=5)
                del os.environ["QUANTPACK_LAUNCH_PLANS"]
                print(f"{name:>10} {t_ref:8.1f} {t_q:10.1f} {t_off:17.1f}")
            step = list(quant.values())
            for fn in step:
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                for fn in step:
                    fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue()[-7000:])


if __name__ == "__main__":
    main()
