"""Host time of one mixture-of-experts block's experts call (``fused_experts``, the experts as quantpack.load keeps
them on a GPU), eager, with the launches replayed straight to the compiled kernels and with QUANTPACK_LAUNCH_PLANS=0
(every launch bound by Triton): Qwen3-30B-A3B's and Mixtral-8x7B's shapes at decode token counts, where the host is
the slower of the two.

    python benchmarks/dev/moe_host.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from quantpack.kernels.moe import fused_experts  # noqa: E402
from quantpack.kernels.moe.mma_experts import MmaExperts  # noqa: E402
from bench_moe import MODELS, random_block, routing  # noqa: E402
from timing import host_us  # noqa: E402


def main():
    for model, (experts, top_k, hidden, inter) in MODELS.items():
        stacks = tuple(MmaExperts.from_packed(pe) for pe in random_block(experts, hidden, inter, torch.bfloat16, 1,
                                                                         "cuda"))
        for tokens in (1, 16):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            ids, w = routing(tokens, experts, top_k, 0, "cuda")
            cells = []
            for plans in ("1", "0"):
                os.environ["QUANTPACK_LAUNCH_PLANS"] = plans
                cells.append(host_us(lambda: fused_experts(x, *stacks, ids, w), reps=200, rounds=3))
            os.environ.pop("QUANTPACK_LAUNCH_PLANS")
            print(f"{model} T={tokens}: {cells[0]:.1f} us a call replayed, {cells[1]:.1f} us through Triton",
                  flush=True)


if __name__ == "__main__":
    main()
