"""The fused expert kernels at full model shapes on a GPU, bf16: Qwen3-30B-A3B's experts (E=128, top-8, hidden 2048,
width 768) and Mixtral-8x7B's (E=8, top-2, hidden 4096, width 14336) from decode to prefill token counts, against
the reference; and a CUDA-graph capture replayed with new routing."""
import pytest
import torch

from oracles import random_experts, rel_err  # tests/oracles.py
from quantpack import reference
from quantpack.kernels.moe import fused_experts
from quantpack.kernels.moe.mma_experts import MmaExperts

pytestmark = pytest.mark.gpu
SHAPES = {"qwen3-moe": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}
BF16_TOL = 1e-2


def block(name, bias=False, bits=4):
    experts, top_k, hidden, inter = SHAPES[name]
    gate_up = random_experts(experts, 2 * inter, hidden, 128, bits=bits, dtype=torch.bfloat16, bias=bias, seed=1)
    down = random_experts(experts, hidden, inter, 128, bits=bits, dtype=torch.bfloat16, bias=bias, seed=2)
    return gate_up, down, experts, top_k, hidden


def routing(tokens, experts, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    w, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 16, 512, 2048])
def test_full_shapes_match_the_reference(poisoned_outputs, name, tokens):
    gate_up, down, experts, top_k, hidden = block(name)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, tokens)
    got = fused_experts(x, gate_up, down, ids, w)
    want = reference.experts(x, gate_up, down, ids, w)
    assert rel_err(got, want.float()) < BF16_TOL


@pytest.mark.parametrize("activation,bias,weight_on_input,bits", [("swiglu_oai", True, False, 4),
                                                                  ("silu", False, True, 4), ("gelu", False, False, 8)])
@pytest.mark.parametrize("tokens", [1, 512])
def test_variants_at_qwen3_shape(poisoned_outputs, activation, bias, weight_on_input, bits, tokens):
    gate_up, down, experts, top_k, hidden = block("qwen3-moe", bias=bias, bits=bits)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, 7)
    ids[0, -1] = -1  # an unused slot
    kw = dict(activation=activation, weight_on_input=weight_on_input)
    want = reference.experts(x, gate_up, down, ids, w, **kw)
    assert rel_err(fused_experts(x, gate_up, down, ids, w, **kw), want.float()) < BF16_TOL


@pytest.mark.parametrize("layout,name,tokens", [(layout, name, tokens) for layout, last in (("rows", 512), ("mma", 16))
                                                 for name, tokens in (("qwen3-moe", 1), ("qwen3-moe", 16),
                                                                      ("mixtral", 1), ("mixtral", last))])
def test_cuda_graph_replays_with_new_routing(layout, name, tokens):
    """A captured block replays with new routing and new inputs, in the checkpoint's layout and in the mma one."""
    gate_up, down, experts, top_k, hidden = block(name)
    stacks = (gate_up, down) if layout == "rows" else (MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, 1)
    fused_experts(x, *stacks, ids, w)  # (compiles the kernels outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, *stacks, ids, w)
    for seed in (2, 3):
        new_ids, new_w = routing(tokens, experts, top_k, seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert rel_err(out, reference.experts(x, gate_up, down, ids, w).float()) < BF16_TOL


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 2048])
def test_mma_layout_matches_the_reference(poisoned_outputs, name, tokens):
    """The experts as quantpack.load keeps them on a GPU (the mma layout): a block per pair, sorted blocks of 16,
    and the grouped prefill from that layout."""
    gate_up, down, experts, top_k, hidden = block(name)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, tokens + 5)
    ids[0, -1] = -1  # an unused slot
    got = fused_experts(x, MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down), ids, w)
    assert rel_err(got, reference.experts(x, gate_up, down, ids, w).float()) < BF16_TOL


@pytest.mark.parametrize("name,tokens", [("qwen3-moe", 16), ("qwen3-moe", 2048), ("mixtral", 64)])
def test_replayed_launches_give_each_call_its_own_result(name, tokens):
    """The expert kernels' launches after a shape's first go straight to the compiled kernels (no Triton binding):
    later calls with new inputs and routing still match the reference."""
    from quantpack.kernels.mma_gemv import _MMA_EXPERTS
    from quantpack.kernels.moe import mma_experts
    from quantpack.kernels.moe import routing as sorting

    gate_up, down, experts, top_k, hidden = block(name)
    stacks = (MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down))
    for seed in (1, 2, 3):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids, w = routing(tokens, experts, top_k, seed)
        got = fused_experts(x, *stacks, ids, w)
        assert rel_err(got, reference.experts(x, gate_up, down, ids, w).float()) < BF16_TOL
    assert len(mma_experts._WEIGHTED_SUM) and (len(_MMA_EXPERTS) or len(sorting._RANK))
