"""Where a decode call of the fused experts spends its time: the whole call (the experts as quantpack.load keeps
them on a GPU, the mma layout) and each of its launches alone, under CUDA-graph replays over weight replicas
(past L2), plus the kernels' own durations from the profiler (what is left of the whole call is gaps between
launches). Qwen3-30B-A3B's and Mixtral-8x7B's shapes at 1 and 16 tokens.

    python benchmarks/dev/moe_decode_parts.py [--tokens 1,16] [--models qwen3-moe,mixtral] [--sweep]
        [--sweep-projections] [--fuse] [--without-activation]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from quantpack import reference  # noqa: E402
from quantpack.kernels.dispatch import device_props  # noqa: E402
from quantpack.kernels.moe import fused_experts  # noqa: E402
from quantpack.kernels.mma_gemv import mma_grid  # noqa: E402
from quantpack.kernels.moe import mma_experts  # noqa: E402
from quantpack.kernels.moe.mma_experts import MmaExperts  # noqa: E402
from bench_moe import GS, MODELS, check, copy_bandwidth, expert_bytes, random_block, routing  # noqa: E402
from timing import graph_time  # noqa: E402


def kernel_times(calls) -> list:
    """(kernel name, mean microseconds) of each launch of a call, in order, from the profiler over graph replays
    of ``calls`` (identical calls on other replicas)."""
    g = torch.cuda.CUDAGraph()
    for c in calls:
        c()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    reps = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    per_call = len(evs) // (reps * len(calls))
    out = [[evs[i].name[:60], 0.0] for i in range(per_call)]
    for i, ev in enumerate(evs[:per_call * reps * len(calls)]):
        out[i % per_call][1] += ev.device_time_total / (reps * len(calls))
    return out


def sweep(calls, floor):
    """The whole call's time with the mma grid aiming at other programs per SM, and with 2 warps splitting K (for
    every launch, pair rows and sorted blocks alike)."""
    grid_fn = mma_experts.mma_experts_grid
    try:
        for kwarps in (1, 2):
            for programs in (4, 8, 16, 32):
                def grid(blocks, n, k, group_size, sms, sorted_blocks=False, sums_slots=False, programs=programs,
                         kwarps=kwarps):
                    split = max(1, -(-programs * sms // (blocks * max(1, n // 32))))
                    return mma_grid(n, k, group_size, 2, split, 1, 4, kwarps=kwarps)
                mma_experts.mma_experts_grid = grid
                us = graph_time(calls, warmup=10, rep=60)[0] * 1e3
                print(f"    programs/SM {programs:2d}, K warps {kwarps}: {us:7.1f} us ({floor / us:.1%})", flush=True)
    finally:
        mma_experts.mma_experts_grid = grid_fn


def sweep_projection(calls, floor, name, proj_n, proj_k, pairs, sms, kwarps_options=(1, 2, 4, 8)):
    """The whole call's time with one projection's grid changed (the other's kept; the projections told apart by
    their out-features ``proj_n``): warps along N, warps splitting each program's K range (the dense decode GEMV's
    tuned configs at K = 2048-4096 take 4-8) and programs per SM."""
    grid_fn = mma_experts.mma_experts_grid
    best = None
    try:
        for warps in (1, 2, 4):
            for kwarps in kwarps_options:
                for programs in (2, 4, 8, 16):
                    def grid(blocks, n, k, group_size, sms, sorted_blocks=False, sums_slots=False, warps=warps,
                             kwarps=kwarps, programs=programs):
                        if n != proj_n:
                            return grid_fn(blocks, n, k, group_size, sms, sorted_blocks, sums_slots)
                        split = max(1, -(-programs * sms // (blocks * max(1, n // (16 * warps)))))
                        return mma_grid(n, k, group_size, warps, split, 1, 4, kwarps=kwarps)
                    mma_experts.mma_experts_grid = grid
                    g = grid(pairs, proj_n, proj_k, GS, sms)  # (what mma_grid made of the ask)
                    us = graph_time(calls, warmup=10, rep=60)[0] * 1e3
                    what = f"warps {g.warps} x {g.kwarps} over K, split {g.split}, {g.groups} groups a warp"
                    best = min(best or (us, ""), (us, what))
                    print(f"    {name} {what} (asked {warps} x {kwarps}, {programs}/SM): {us:7.1f} us "
                          f"({floor / us:.1%})", flush=True)
    finally:
        mma_experts.mma_experts_grid = grid_fn
    print(f"    best {name}: {best[0]:.1f} us ({floor / best[0]:.1%}), {best[1]}", flush=True)


def fusions(calls, floor, tokens):
    """The whole call's time with down's launch summing each token's slots, and with a kernel of its own doing it."""
    saved = mma_experts.SUMMED_BY_DOWN_MAX_TOKENS
    try:
        for most in (tokens, 0):
            mma_experts.SUMMED_BY_DOWN_MAX_TOKENS = most
            us = graph_time(calls, warmup=10, rep=60)[0] * 1e3
            print(f"    weighted sum {'by down' if most else 'apart'}: {us:7.1f} us ({floor / us:.1%})", flush=True)
    finally:
        mma_experts.SUMMED_BY_DOWN_MAX_TOKENS = saved


def without_activation(calls, floor):
    """The whole call with the activation kernel between the projections left out (down reads a stale h): what
    making h in gate_up's own launch could save at most, alternating twice with the call as it is."""
    original = mma_experts.activate
    held = {}

    def stale(gu, dtype, activation, alpha, limit, pdl=False):
        key = (gu.shape, dtype)
        if key not in held:
            held[key] = original(gu, dtype, activation, alpha, limit, pdl=pdl)
        return held[key]

    for _ in range(2):
        for label in ("as it is", "without the activation launch"):
            mma_experts.activate = original if label == "as it is" else stale
            try:
                us = graph_time(calls, warmup=10, rep=60)[0] * 1e3
            finally:
                mma_experts.activate = original
            print(f"    {label}: {us:7.1f} us ({floor / us:.1%})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--models", default="qwen3-moe,mixtral")
    ap.add_argument("--sweep", action="store_true", help="also time the mma grid's programs per SM 4-32 and K warps")
    ap.add_argument("--sweep-projections", action="store_true",
                    help="also time each projection's grid alone over warps along N and K and programs per SM (down's "
                         "with the slots summed by its launch, then apart)")
    ap.add_argument("--fuse", action="store_true", help="also time the weighted sum by down's launch and apart")
    ap.add_argument("--without-activation", action="store_true",
                    help="also time the call with the activation launch left out (an upper bound on fusing it)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, L2 {l2 / 1e6:.0f} MB", flush=True)
    for model in args.models.split(","):
        experts, top_k, hidden, inter = MODELS[model]
        for tokens in (int(t) for t in args.tokens.split(",")):
            probe = random_block(experts, hidden, inter, torch.bfloat16, 0, "cuda")
            per_expert = expert_bytes(probe[0]) + expert_bytes(probe[1])
            hit_bound = min(experts, tokens * top_k)
            n_rep = max(2, min(16, math.ceil(4 * l2 / (hit_bound * per_expert))))
            blocks = [random_block(experts, hidden, inter, torch.bfloat16, 1 + i, "cuda") for i in range(n_rep)]
            loaded = [tuple(MmaExperts.from_packed(pe) for pe in b) for b in blocks]
            xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(n_rep)]
            routes = [routing(tokens, experts, top_k, 100 + i, "cuda") for i in range(n_rep)]
            check("fused_experts", fused_experts(xs[0], *loaded[0], *routes[0]),
                  reference.experts(xs[0], *blocks[0], *routes[0]))
            hit = len(torch.unique(routes[0][0]))
            floor = hit * per_expert / bw * 1e6
            calls = [lambda i=i: fused_experts(xs[i], *loaded[i], *routes[i]) for i in range(n_rep)]
            whole = graph_time(calls, warmup=10, rep=60)[0] * 1e3
            parts = kernel_times(calls)
            busy = sum(us for _, us in parts)
            print(f"{model} T={tokens}: {whole:.1f} us a call ({floor / whole:.1%} of the {floor:.1f} us floor, "
                  f"{hit} experts), kernels busy {busy:.1f} us, gaps {whole - busy:.1f} us "
                  f"[{device_props(torch.device('cuda')).sms} SMs, {n_rep} replicas]", flush=True)
            for name, us in parts:
                print(f"    {us:7.2f} us  {name}", flush=True)
            if args.sweep:
                sweep(calls, floor)
            if args.sweep_projections:
                sms, pairs = device_props(torch.device("cuda")).sms, tokens * top_k
                sweep_projection(calls, floor, "gate_up", 2 * inter, hidden, pairs, sms)
                summed = tokens <= mma_experts.SUMMED_BY_DOWN_MAX_TOKENS
                sweep_projection(calls, floor, "down" + (" (slots summed by it)" if summed else ""), hidden, inter,
                                 pairs, sms, (1,) if summed else (1, 2, 4, 8))
                if summed:
                    saved, mma_experts.SUMMED_BY_DOWN_MAX_TOKENS = mma_experts.SUMMED_BY_DOWN_MAX_TOKENS, 0
                    try:
                        sweep_projection(calls, floor, "down (slots summed apart)", hidden, inter, pairs, sms)
                    finally:
                        mma_experts.SUMMED_BY_DOWN_MAX_TOKENS = saved
            if args.fuse:
                fusions(calls, floor, tokens)
            if args.without_activation:
                without_activation(calls, floor)
            blocks = loaded = None  # (their memory, before the next count's)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
