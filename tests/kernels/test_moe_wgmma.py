"""The Hopper prefill experts path (quantpack.kernels.moe.wgmma_experts): pairs sorted into blocks of 64 per expert,
one grouped launch of the wgmma kernel per projection, against quantpack.reference.experts over awkward routings and
shapes, in the checkpoint's layout and the mma one. The kernel is Gluon: the CPU suite compiles it for sm_90
(test_wgmma_mm.py) and checks the dispatch; these run on a Hopper GPU."""
import pytest
import torch

from oracles import random_experts, rel_err  # tests/oracles.py
from quantpack import reference
from quantpack.kernels.dispatch import DeviceProps
from quantpack.kernels.moe import choose, explain, fused_experts
from quantpack.kernels.moe.dispatch import WGMMA_PER_EXPERT, WGMMA_PER_EXPERT_MMA
from quantpack.kernels.moe.mma_experts import MmaExperts
from quantpack.kernels.moe.wgmma_experts import wgmma_experts, wgmma_experts_usable

HOPPER = DeviceProps("NVIDIA H200", (9, 0), 132, True)
BF16_TOL = 1e-2


def test_dispatch_takes_wgmma_from_its_pairs_per_expert_and_explains_it():
    tokens = WGMMA_PER_EXPERT_MMA * 128 // 8
    d = choose(HOPPER, tokens, 8, 128, 2048, 768, 128, grouped=True, mma=True, wgmma=True)
    assert d.path == "wgmma" and "wgmma" in d.reason and d.gate_up.block_m == 64
    assert choose(HOPPER, 2 * tokens, 8, 128, 2048, 768, 128, mma=True, wgmma=True).gate_up.block_m == 128
    assert choose(HOPPER, tokens - 8, 8, 128, 2048, 768, 128, grouped=True, mma=True, wgmma=True).path == "mma"
    # the checkpoint's layout from fewer pairs per expert (nothing to read back first), never at decode's
    rows = WGMMA_PER_EXPERT * 128 // 8
    assert choose(HOPPER, rows, 8, 128, 2048, 768, 128, wgmma=True).path == "wgmma"
    assert choose(HOPPER, rows - 8, 8, 128, 2048, 768, 128, wgmma=True).path != "wgmma"
    assert choose(HOPPER, 1, 8, 8, 4096, 14336, 128, wgmma=True).path == "pairs"
    # (no host sync: also where a CUDA graph is being captured)
    assert choose(HOPPER, tokens, 8, 128, 2048, 768, 128, grouped=False, mma=True, wgmma=True).path == "wgmma"
    assert choose(HOPPER, tokens, 8, 128, 2048, 768, 128, grouped=True, mma=False, wgmma=False).path == "grouped"
    text = explain(2048, 8, 128, 2048, 768, device=HOPPER, mma=True)
    assert "wgmma kernel" in text and "blocks of 128" in text, text
    # off Hopper the grouped path stays
    blackwell = DeviceProps("NVIDIA B200", (10, 0), 148, True)
    assert "torch._grouped_mm" in explain(2048, 8, 128, 2048, 768, device=blackwell, mma=True)


hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                            reason="needs a Hopper GPU")


def block(experts, hidden, inter, gs, *, bits=4, layout="rows"):
    gate_up = random_experts(experts, 2 * inter, hidden, gs, bits=bits, dtype=torch.bfloat16, seed=1)
    down = random_experts(experts, hidden, inter, gs, bits=bits, dtype=torch.bfloat16, seed=2)
    if layout == "mma":
        return gate_up, down, (MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down))
    return gate_up, down, (gate_up, down)


def routes(tokens, experts, top_k, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "one expert":
        ids = torch.full((tokens, top_k), experts - 1, device="cuda")
        ids[:, 1:] = -1  # (one expert per token: the other slots unused)
    elif kind == "few experts":  # most experts get no pair
        ids = torch.randint(0, 3, (tokens, top_k), generator=g, device="cuda") * (experts // 3)
    else:
        ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, dim=-1).indices
    ids[0, -1] = experts  # an unused slot (an id past the last expert)
    w = torch.rand(tokens, top_k, generator=g, device="cuda").to(torch.bfloat16)
    return ids, w


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("experts,top_k,hidden,inter,gs,tokens,kind", [
    (8, 2, 4096, 1792, 128, 300, "random"),  # (Mixtral's ratio of widths, narrower)
    (60, 4, 2048, 1408, 128, 517, "random"),  # (Qwen2-MoE's widths; 1408 is no multiple of the 64-column tile)
    (128, 8, 2048, 768, 128, 1024, "random"),
    (256, 8, 1024, 512, 64, 999, "random"),
    (64, 1, 1024, 704, 64, 2049, "random"),
    (128, 8, 2048, 768, 128, 640, "few experts"),
    (64, 2, 1024, 512, 128, 257, "one expert"),
])
@pytest.mark.parametrize("layout", ["rows", "mma"])
def test_matches_the_reference(poisoned_outputs, experts, top_k, hidden, inter, gs, tokens, kind, layout):
    gate_up, down, stacks = block(experts, hidden, inter, gs, layout=layout)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routes(tokens, experts, top_k, kind, tokens)
    assert wgmma_experts_usable(x, *stacks)
    want = reference.experts(x, gate_up, down, ids, w).float()
    for rows in (64, 128):
        assert rel_err(wgmma_experts(x, *stacks, ids, w, block_rows=rows), want) < BF16_TOL
    assert rel_err(fused_experts(x, *stacks, ids, w), want) < BF16_TOL  # (whichever path the dispatch takes)



@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("activation,weight_on_input,bits", [("silu", True, 4), ("gelu_tanh", False, 8),
                                                             ("swiglu_oai", False, 4)])
def test_activations_weights_on_input_and_8_bit(poisoned_outputs, activation, weight_on_input, bits):
    gate_up, down, stacks = block(16, 1024, 512, 128, bits=bits)
    x = torch.randn(600, 1024, device="cuda", dtype=torch.bfloat16)
    ids, w = routes(600, 16, 2, "random", 3)
    kw = dict(activation=activation, weight_on_input=weight_on_input)
    want = reference.experts(x, gate_up, down, ids, w, **kw).float()
    assert rel_err(wgmma_experts(x, *stacks, ids, w, **kw), want) < BF16_TOL



@pytest.mark.gpu
@hopper
def test_what_it_does_not_take():
    """Bias (gpt-oss), in-features off the K step, float32 x: the grouped path runs those instead."""
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    gu = random_experts(4, 1024, 1024, 128, dtype=torch.bfloat16, bias=True, seed=1)
    d = random_experts(4, 1024, 512, 128, dtype=torch.bfloat16, seed=2)
    assert not wgmma_experts_usable(x, gu, d)
    gu = random_experts(4, 192, 1024, 64, dtype=torch.bfloat16, seed=1)
    d = random_experts(4, 1024, 96, 32, dtype=torch.bfloat16, seed=2)
    assert not wgmma_experts_usable(x, gu, d)
    gu = random_experts(4, 1024, 1024, 128, dtype=torch.bfloat16, seed=1)
    assert not wgmma_experts_usable(x.float(), gu, random_experts(4, 1024, 512, 128, dtype=torch.bfloat16, seed=2))

