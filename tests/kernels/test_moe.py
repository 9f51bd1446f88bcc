"""The fused expert kernels (quantpack.kernels.moe) against the oracle, quantpack.reference.experts: both kernel
paths (decode ``pairs``, prefill ``sorted``), awkward routings and widths, every activation, biases, weights on the
input, 8-bit; the GPU routing's blocks; the dispatch and its explanation; refusals. Interpreter-sized shapes (each
program of the interpreter costs milliseconds); full sizes are in test_moe_gpu.py."""
import pytest
import torch

from oracles import random_experts, rel_err  # tests/oracles.py
from quantpack import reference
from quantpack.kernels.dispatch import DeviceProps
from quantpack.kernels.moe import ExpertsConfig, choose, explain, fused_experts
from quantpack.kernels.moe.routing import align_block_size, gather_rows, max_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernels run on a GPU or under TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def configs(path, tokens, top_k, experts, hidden, inter, gs):
    """(gate_up, down) configs of ``path`` for this call, as the dispatch would build them."""
    from quantpack.kernels.moe import dispatch
    pairs = tokens * top_k
    if path == "pairs":
        return (dispatch._pairs_config(pairs, inter, hidden, gs, 8),
                dispatch._pairs_config(pairs, hidden, inter, gs, 8))
    return (dispatch._sorted_config(pairs, experts, inter, hidden, gs),
            dispatch._sorted_config(pairs, experts, hidden, inter, gs))


def run_case(experts, top_k, tokens, hidden, inter, gs, *, path=None, bits=4, dtype=torch.float32, ids=None,
             activation="silu", bias=False, weight_on_input=False, seed=0):
    gate_up = random_experts(experts, 2 * inter, hidden, gs, bits=bits, dtype=dtype, bias=bias, seed=seed + 1)
    down = random_experts(experts, hidden, inter, gs, bits=bits, dtype=dtype, bias=bias, seed=seed + 2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEV)
    if ids is None:  # distinct experts per token, as a router's top-k gives them
        ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    ids = ids.to(DEV)
    w = torch.rand(tokens, top_k, generator=g).to(DEV)
    cfg = None if path is None else configs(path, tokens, top_k, experts, hidden, inter, gs)
    got = fused_experts(x, gate_up, down, ids, w, activation=activation, weight_on_input=weight_on_input, config=cfg)
    want = reference.experts(x, gate_up, down, ids, w, activation=activation, weight_on_input=weight_on_input)
    assert got.dtype == x.dtype and got.shape == x.shape
    err = rel_err(got, want.float())
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return got, want


# (experts, top-k, tokens, hidden, expert width, group size, path, bits, dtype): every E and top-k of the models,
# widths off the tiles (gate_up's 2I and down's H), g32/g64/g128, decode to a small prefill
CASES = [
    (8, 2, 1, 128, 64, 64, None, 4, torch.float32),
    (8, 1, 3, 192, 96, 32, "pairs", 4, torch.float16),
    (60, 4, 3, 128, 64, 64, "pairs", 4, torch.float32),
    (64, 8, 1, 384, 128, 128, None, 4, torch.float16),
    (128, 8, 3, 128, 128, 128, "pairs", 4, torch.float32),
    (256, 8, 2, 192, 64, 64, "sorted", 4, torch.float32),
    (60, 4, 3, 192, 160, 32, "sorted", 4, torch.float16),
    (8, 2, 17, 128, 96, 32, "sorted", 4, torch.float32),
    (8, 2, 17, 192, 64, 64, None, 8, torch.float32),
    (64, 4, 3, 128, 64, 64, "pairs", 8, torch.float16),
]


@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter,gs,path,bits,dtype", CASES)
def test_matches_the_reference(poisoned_outputs, experts, top_k, tokens, hidden, inter, gs, path, bits, dtype):
    run_case(experts, top_k, tokens, hidden, inter, gs, path=path, bits=bits, dtype=dtype)


def test_prefill_takes_the_sorted_path_and_matches(poisoned_outputs):
    tokens, top_k, experts = 48, 2, 8
    assert choose(DeviceProps("x", (9, 0), 132), tokens, top_k, experts, 128, 64, 64).path == "sorted"
    run_case(experts, top_k, tokens, 128, 64, 64, seed=3)


@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_every_token_to_one_expert_and_empty_experts(poisoned_outputs, path):
    """All pairs on expert 5 (several blocks of it at block_m 16), the other experts hit by none."""
    tokens = 17 if path == "sorted" else 4
    ids = torch.full((tokens, 1), 5)
    run_case(8, 1, tokens, 128, 64, 64, path=path, ids=ids)


@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_unused_slots_contribute_nothing(poisoned_outputs, path):
    ids = torch.tensor([[0, -1], [8, 3], [3, 0]])  # ids outside [0, E): unused slots
    run_case(8, 2, 3, 128, 64, 64, path=path, ids=ids)


@pytest.mark.parametrize("activation", reference.EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_activations_with_bias(poisoned_outputs, activation, path):
    run_case(8, 2, 3, 128, 64, 64, path=path, activation=activation, bias=True, seed=4)


@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_weight_on_input(poisoned_outputs, path):
    run_case(16, 1, 5, 128, 64, 64, path=path, weight_on_input=True, dtype=torch.float16, seed=5)


@pytest.mark.parametrize("split_gate_up,split_down,down_path", [(3, 2, "pairs"), (6, 4, "pairs"), (2, 1, "sorted")])
def test_split_k_partial_sums(poisoned_outputs, split_gate_up, split_down, down_path):
    """The pairs path's split-K: gate_up's partial sums (the bias in one of them) activated as down loads them, down's
    summed with the slots; a split per step and beyond; down on the sorted path reading them too."""
    gate_up = random_experts(8, 128, 192, 32, bias=True, seed=1)
    down = random_experts(8, 192, 64, 32, bias=True, seed=2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 192, generator=g).to(DEV)
    ids = torch.tensor([[1, 6], [6, -1], [0, 1]]).to(DEV)
    w = torch.rand(3, 2, generator=g).to(DEV)
    cfg = (ExpertsConfig("pairs", 1, 64, 16, split=split_gate_up),
           ExpertsConfig("pairs", 1, 64, 16, split=split_down) if down_path == "pairs"
           else ExpertsConfig("sorted", 16, 64, 16))
    got = fused_experts(x, gate_up, down, ids, w, activation="swiglu_oai", config=cfg)
    want = reference.experts(x, gate_up, down, ids, w, activation="swiglu_oai")
    assert rel_err(got, want) < TOL[torch.float32]


def test_dispatch_splits_k_at_decode_to_fill_the_gpu():
    h200 = DeviceProps("NVIDIA H200", (9, 0), 132)
    d = choose(h200, 1, 8, 128, 2048, 768, 128)
    assert d.gate_up.split > 1 and d.down.split > 1
    assert choose(h200, 16, 8, 128, 2048, 768, 128).gate_up.split == 1  # (enough programs without)
    assert choose(h200, 2048, 8, 128, 2048, 768, 128).gate_up.split == 1


@pytest.mark.parametrize("experts,tokens,top_k,block_m", [(6, 9, 2, 4), (128, 300, 8, 64), (60, 5, 4, 16)])
@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "torch"])
def test_routing_blocks_hold_each_experts_pairs_once(monkeypatch, experts, tokens, top_k, block_m, kernels):
    from quantpack.kernels.moe import routing

    if not kernels:
        monkeypatch.setattr(routing, "triton_usable", lambda t: False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[0, 0], ids[4, 1] = -1, experts  # unused
    ids[:, 1][ids[:, 1] == 2] = 3  # expert 2 only through slot 0
    sorted_pairs, block_expert, pos = align_block_size(ids.to(DEV), experts, block_m, positions=True)
    sorted_pairs, block_expert, pos = sorted_pairs.cpu(), block_expert.cpu(), pos.cpu()
    pairs = ids.numel()
    assert block_expert.numel() == max_blocks(pairs, experts, block_m)
    assert sorted_pairs.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        members = sorted_pairs[b * block_m:(b + 1) * block_m].tolist()
        if e == experts:  # past the filled blocks: only sentinels
            assert set(members) == {pairs}
            continue
        real = [p for p in members if p != pairs]
        assert real and all(flat[p] == e for p in real)
        seen += real
    want = sorted(p for p in range(pairs) if 0 <= flat[p] < experts)
    assert sorted(seen) == want
    assert block_expert.tolist() == sorted(block_expert.tolist())
    for p in want:  # each used pair's position in sorted_pairs
        assert sorted_pairs[pos[p]] == p


@pytest.mark.parametrize("experts,tokens,top_k,block_m,hidden", [(6, 9, 2, 4, 40), (60, 5, 4, 16, 1100)])
@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "torch"])
def test_gathered_rows_follow_the_blocks(monkeypatch, experts, tokens, top_k, block_m, hidden, kernels):
    from quantpack.kernels.moe import routing

    if not kernels:
        monkeypatch.setattr(routing, "triton_usable", lambda t: False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[0, 0] = -1  # unused
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(DEV)
    sorted_pairs, block_expert = align_block_size(ids.to(DEV), experts, block_m)
    xg = gather_rows(x, sorted_pairs, block_expert, top_k, block_m, experts).cpu()
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    filled = (block_expert < experts).repeat_interleave(block_m)  # (rows of the other blocks: unset)
    pairs = ids.numel()
    for r in filled.nonzero().flatten().tolist():
        p = int(sorted_pairs[r])
        want = x[p // top_k].cpu() if p < pairs else torch.zeros(hidden, dtype=x.dtype)
        assert torch.equal(xg[r], want), (r, p)


def test_dispatch_decode_pairs_prefill_sorted_and_explain():
    h200 = DeviceProps("NVIDIA H200", (9, 0), 132)
    assert choose(h200, 1, 8, 128, 2048, 768, 128).path == "pairs"
    assert choose(h200, 16, 8, 128, 2048, 768, 128).path == "pairs"
    assert choose(h200, 16, 2, 8, 4096, 14336, 128).path == "sorted"  # 4 pairs per expert
    d = choose(h200, 2048, 8, 128, 2048, 768, 128)
    assert d.path == "sorted" and d.down.path == "sorted" and d.gate_up.block_m > 16
    text = explain(1, 8, 128, 2048, 768, device=h200)
    assert text.startswith("On NVIDIA H200, fused experts with T=1, top-8 of E=128") and "pairs(" in text
    # many pairs per expert on sm_90, either 16-bit dtype: the wgmma kernel over per-expert blocks
    assert "wgmma kernel" in explain(512, 2, 8, 4096, 14336, dtype=torch.float16, device=h200)
    # ... in bf16 where it cannot run: dequantize + torch's grouped GEMM (not inside capture: the caller's say)
    assert choose(h200, 512, 8, 128, 2048, 768, 128, grouped=True).path == "grouped"
    assert choose(h200, 16, 2, 8, 4096, 14336, 128, grouped=True).path == "sorted"  # 4 pairs per expert
    assert "torch._grouped_mm" in explain(512, 2, 8, 4096, 14336, device=DeviceProps("NVIDIA B200", (10, 0), 148))
    a100 = DeviceProps("NVIDIA A100", (8, 0), 108)
    assert "sorted into per-expert blocks" in explain(512, 2, 8, 4096, 14336, device=a100)


def test_refuses_what_does_not_fit():
    gate_up = random_experts(4, 128, 128, 64, device="cpu")
    down = random_experts(4, 128, 64, 64, device="cpu")
    x = torch.randn(2, 128)
    ids, w = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"^x: expected \(tokens, 128\)"):
        fused_experts(x[:, :64], gate_up, down, ids, w)
    with pytest.raises(ValueError, match=r"^down: 4 experts of shape \(64, 64\)"):
        fused_experts(x, gate_up, random_experts(4, 64, 64, 64, device="cpu"), ids, w)
    with pytest.raises(ValueError, match=r"^topk_ids and topk_weights"):
        fused_experts(x, gate_up, down, ids, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^topk_ids: dtype torch.float32"):
        fused_experts(x, gate_up, down, w, w)
    with pytest.raises(ValueError, match=r"^activation='relu'"):
        fused_experts(x, gate_up, down, ids, w, activation="relu")


def test_sm90_compile():
    """Every kernel variant compiles for Hopper (sm_90) on this machine (tests/kernels/sm90_compile_moe.py)."""
    import sys
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from sm90_compile import run_script  # tests/kernels/sm90_compile.py
    from sm90_compile_moe import ACTIVATE_VARIANTS, VARIANTS  # tests/kernels/sm90_compile_moe.py

    for line in run_script("sm90_compile_moe.py", VARIANTS + ACTIVATE_VARIANTS):
        assert "error" not in line, line
        assert line["cubin"] > 0
        assert (line["mma"] > 0) == (line["variant"][1] == "sorted"), line  # tensor cores on the sorted path
