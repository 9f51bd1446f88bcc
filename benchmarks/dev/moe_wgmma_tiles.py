"""Tiles of the MoE prefill's grouped wgmma launch (quantpack.kernels.moe.wgmma_experts), timed at Qwen3-30B-A3B's
and Mixtral-8x7B's expert shapes over prefill token counts, against torch._grouped_mm on the bf16 weights in the
same process. Experiments only: what it finds is set in wgmma_experts.py by hand.

    python benchmarks/dev/moe_wgmma_tiles.py [--tokens 512,2048,8192]
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from quantpack import reference  # noqa: E402
from quantpack.kernels.moe import wgmma_experts as wx  # noqa: E402
from quantpack.kernels.moe.mma_experts import MmaExperts  # noqa: E402
from bench_moe import MODELS, Grouped, dense, random_block, rel_error, routing  # noqa: E402
from timing import graph_time  # noqa: E402

TILES = [(64, 64, 3, False), (128, 64, 3, False), (128, 128, 4, True), (256, 64, 3, False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--models", default="qwen3-moe,mixtral")
    ap.add_argument("--layouts", default="mma,rows")
    args = ap.parse_args()
    for model in args.models.split(","):
        experts, top_k, hidden, inter = MODELS[model]
        reps = 4 if model == "qwen3-moe" else 2
        blocks = [random_block(experts, hidden, inter, torch.bfloat16, 1 + i, "cuda") for i in range(reps)]
        loaded = [tuple(MmaExperts.from_packed(pe) for pe in b) for b in blocks]
        dense_w = [(dense(gu), dense(d)) for gu, d in blocks]
        for tokens in (int(t) for t in args.tokens.split(",")):
            xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
            routes = [routing(tokens, experts, top_k, 100 + i, "cuda") for i in range(reps)]
            want = reference.experts(xs[0], *blocks[0], *routes[0])
            grouped = [Grouped(*dense_w[i], *routes[i]) for i in range(reps)]
            base = graph_time([lambda i=i: grouped[i](xs[i]) for i in range(reps)], warmup=10, rep=40)[0] * 1e3
            print(f"{model} T={tokens}: grouped_mm bf16 {base:.1f} us", flush=True)
            for (rows, bn, stages, producer), layout in itertools.product(TILES, args.layouts.split(",")):
                wx.BLOCK_N, wx.STAGES, wx.PRODUCER = bn, stages, producer
                stacks = loaded if layout == "mma" else blocks
                try:
                    err = rel_error(wx.wgmma_experts(xs[0], *stacks[0], *routes[0], block_rows=rows), want)
                    us = graph_time([lambda i=i: wx.wgmma_experts(xs[i], *stacks[i], *routes[i], block_rows=rows)
                                     for i in range(reps)], warmup=10, rep=40)[0] * 1e3
                except Exception as exc:  # noqa: BLE001
                    print(f"  rows {rows} bn {bn} stages {stages} producer {producer} {layout}: {exc!r:.200}")
                    continue
                print(f"  rows {rows:3d} bn {bn:3d} stages {stages} producer {producer:d} {layout:4s}: {us:8.1f} us "
                      f"{base / us:5.2f}x bf16  err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
