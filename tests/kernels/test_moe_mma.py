"""Experts in the tensor-core decode layout (quantpack.kernels.moe.mma_experts): the layout round trip, the kernels
(a block per pair at decode, sorted blocks of 16 beyond) against the oracle over awkward routings, NaN-poisoned, the
dispatch's words, and a QuantExperts block switched to the layout (same outputs, same state dict, loads into it).
Interpreter-sized shapes; full sizes in test_moe_gpu.py."""
import os

import pytest
import torch

from oracles import random_experts, rel_err  # tests/oracles.py
from quantpack import reference
from quantpack.kernels.dispatch import DeviceProps
from quantpack.kernels.mma_layout import mma_pack, mma_unpack
from quantpack.kernels.moe import ExpertsConfig, choose, explain, fused_experts
from quantpack.kernels.moe.mma_experts import MmaExperts, mma_experts_fit

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernels run on a GPU or under TRITON_INTERPRET=1")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def test_layout_round_trip_with_experts_leading():
    q = torch.randint(0, 256, (3, 64, 48), dtype=torch.uint8)
    words = mma_pack(q, 48, 128)
    assert words.shape == (3, 3, 2, 32, 4) and words.dtype == torch.int32
    assert torch.equal(words[1], mma_pack(q[1], 48, 128))  # (stacked = each expert's own layout)
    assert torch.equal(mma_unpack(words, 48, 128), q)
    with pytest.raises(ValueError, match="do not hold a 4-bit"):
        mma_unpack(words, 32, 128)


def case(experts, top_k, tokens, hidden, inter, gs, dtype, *, ids=None, seed=0):
    gate_up = random_experts(experts, 2 * inter, hidden, gs, dtype=dtype, seed=seed + 1, device=DEV)
    down = random_experts(experts, hidden, inter, gs, dtype=dtype, seed=seed + 2, device=DEV)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEV)
    if ids is None:
        ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    ids = ids.to(DEV)
    w = torch.rand(tokens, top_k, generator=g).to(DEV)
    return gate_up, down, x, ids, w


def check(gate_up, down, x, ids, w):
    mg, md = MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down)
    got = fused_experts(x, mg, md, ids, w)
    want = reference.experts(x, gate_up, down, ids, w)
    assert got.dtype == x.dtype and got.shape == x.shape
    err = rel_err(got, want.float())
    assert err < TOL[x.dtype], f"relative error {err:.2e}"


# (experts, top-k, tokens, hidden, expert width, group size, dtype): a block per pair (decode), sorted blocks of 16
# (more pairs per expert, a block partly filled, experts without pairs), group counts that split unevenly, g64/g128
CASES = [
    (8, 2, 1, 128, 64, 64, torch.float16),
    (60, 4, 3, 128, 192, 64, torch.bfloat16),
    (128, 8, 2, 256, 128, 128, torch.float16),
    (8, 2, 17, 128, 192, 64, torch.float16),
    (4, 4, 5, 320, 64, 64, torch.bfloat16),
    (4, 4, 3, 2048, 256, 64, torch.bfloat16),  # (gate_up's programs hold 32 groups: two warps split K)
]


@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter,gs,dtype", CASES)
def test_matches_the_reference(poisoned_outputs, experts, top_k, tokens, hidden, inter, gs, dtype):
    check(*case(experts, top_k, tokens, hidden, inter, gs, dtype))


@pytest.mark.parametrize("tokens", [2, 9])
def test_unused_slots_and_every_token_to_one_expert(poisoned_outputs, tokens):
    ids = torch.full((tokens, 2), 3)
    ids[:, 1] = -1  # (the second slot unused: it adds nothing)
    ids[0, 1] = 8  # (an id past the experts: unused too)
    ids[-1] = -1  # (a token with no expert at all: zeros, though none of its slots' programs computes)
    check(*case(8, 2, tokens, 128, 64, 64, torch.float16, ids=ids))


def test_dispatch_and_explain(monkeypatch):
    h200 = DeviceProps("NVIDIA H200", (9, 0), 132)
    d = choose(h200, 1, 8, 128, 2048, 768, 128, mma=True)
    assert d.gate_up.path == d.down.path == "mma" and d.gate_up.block_m == 1 and d.gate_up.split > 1
    d = choose(h200, 16, 2, 8, 4096, 14336, 128, mma=True)  # (4 pairs per expert: sorted blocks of 16)
    assert d.gate_up.path == "mma" and d.gate_up.block_m == 16
    assert d.gate_up.num_warps == d.down.num_warps == 4  # (K's 32 and 112 groups: two warps over K)
    assert d.gate_up.k_warps == 2 and "warps=2 along N x 2 along K" in str(d.gate_up)
    assert choose(h200, 64, 8, 128, 2048, 768, 128, mma=True).gate_up.num_warps == 2
    # prefill: sorted blocks up to 127 pairs per expert, dequantize + grouped GEMM from 128
    assert choose(h200, 512, 8, 128, 2048, 768, 128, grouped=True, mma=True).path == "mma"
    assert choose(h200, 2048, 8, 128, 2048, 768, 128, grouped=True, mma=True).path == "grouped"
    # down summing the slots itself (up to two tokens) rounds its split down: its last programs add every split's
    # rows; gate_up's rounds up (Qwen3-30B-A3B's block: down split 2 at one token, 1 at two; gate_up 2 at both)
    for tokens, down_split in ((1, 2), (2, 1)):
        d = choose(h200, tokens, 8, 128, 2048, 768, 128, mma=True)
        assert (d.gate_up.split, d.down.split) == (2, down_split)
    assert choose(h200, 4, 8, 128, 2048, 768, 128, mma=True).down.split == 1
    monkeypatch.delenv("QUANTPACK_PDL", raising=False)
    text = explain(1, 8, 128, 2048, 768, device=h200, mma=True)
    assert "mma layout" in text and "top-k weighted sum" in text and "last program" in text
    assert "chained with PDL" in text  # (Hopper, QUANTPACK_PDL unset)
    monkeypatch.setenv("QUANTPACK_PDL", "0")
    assert "PDL" not in explain(1, 8, 128, 2048, 768, device=h200, mma=True)
    assert "PDL" not in explain(1, 8, 128, 2048, 768, device=DeviceProps("NVIDIA A100", (8, 0), 108), mma=True)
    with pytest.raises(ValueError, match="not in the mma layout"):
        gate_up, down, x, ids, w = case(8, 2, 1, 128, 64, 64, torch.float16)
        fused_experts(x, gate_up, down, ids, w, config=(ExpertsConfig("mma", 1, 32, 0),) * 2)


def test_what_the_layout_does_not_hold():
    assert not mma_experts_fit(random_experts(2, 64, 128, 32, dtype=torch.float16, device=DEV), torch.float16)
    assert not mma_experts_fit(random_experts(2, 64, 128, 64, bits=8, dtype=torch.float16, device=DEV),
                               torch.float16)
    assert not mma_experts_fit(random_experts(2, 64, 128, 64, dtype=torch.float32, device=DEV), torch.float32)
    with pytest.raises(ValueError, match="not a shape the mma layout holds"):
        MmaExperts.from_packed(random_experts(2, 40, 128, 64, dtype=torch.float16, device=DEV))


def test_a_block_switched_to_the_layout_computes_and_loads_the_same():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from quantpack.modules.experts import QuantExperts

    torch.manual_seed(0)
    hf = MixtralExperts(MixtralConfig(hidden_size=128, intermediate_size=64, num_local_experts=4)).half()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    block = QuantExperts.from_experts(hf, group_size=64).to(DEV)
    state = {k: v.clone() for k, v in block.state_dict().items()}
    x = torch.randn(3, 128, dtype=torch.float16, device=DEV)
    ids = torch.tensor([[0, 1], [3, 3], [2, -1]], device=DEV)
    w = torch.rand(3, 2, device=DEV)
    want = block(x, ids, w)
    assert block.use_mma_layout() and block.layout == "mma" and "layout=mma" in repr(block)
    assert block.gate_up_qweight.dtype == torch.int32 and block.gate_up_qweight.shape == (4, 8, 2, 32, 4)
    assert rel_err(block(x, ids, w), want.float()) < TOL[torch.float16]
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())  # (the checkpoint's layout)
    fresh = QuantExperts(4, 128, 64, group_size=64, dtype=torch.float16, device=DEV)
    fresh.load_state_dict(state)
    assert fresh.use_mma_layout()
    fresh.load_state_dict(state)  # (filled while in the layout: each expert repacked)
    assert torch.equal(fresh.gate_up_qweight, block.gate_up_qweight)
    assert torch.equal(fresh.down_qweight, block.down_qweight)
    assert rel_err(fresh(x, ids, w), want.float()) < TOL[torch.float16]


def test_a_block_loaded_into_the_layout_packs_each_expert_as_it_comes():
    """A block still on meta takes the layout first (as quantpack.load does for experts bound for a GPU): its
    qweights are allocated as mma words and each expert's matrix is packed into its tiles as it is filled, giving
    the same words as repacking a filled block, and the state dict back unchanged."""
    from quantpack.modules.experts import QuantExperts

    torch.manual_seed(0)
    filled = QuantExperts(3, 128, 64, group_size=64, dtype=torch.float16, device=DEV)
    state = {}
    for proj, (n, k) in (("gate_proj", (64, 128)), ("up_proj", (64, 128)), ("down_proj", (128, 64))):
        for e in range(3):
            state[f"{proj}.{e}.qweight"] = torch.randint(0, 256, (k // 2, n), dtype=torch.uint8, device=DEV)
            state[f"{proj}.{e}.scales"] = (torch.rand(k // 64, n, device=DEV) * 0.1 + 0.01).half()
            state[f"{proj}.{e}.zeros"] = (torch.rand(k // 64, n, device=DEV) * 15).half()
    filled.load_state_dict(state)
    assert filled.use_mma_layout()
    loading = QuantExperts(3, 128, 64, group_size=64, dtype=torch.float16, device="meta")
    assert not loading.use_mma_layout()  # (on meta, the layout needs the device it will be filled on)
    assert loading.use_mma_layout(DEV) and loading.layout == "mma" and loading.gate_up_qweight.is_meta
    for key in reversed(list(state)):  # (any order: up before gate, down first)
        proj, e, field = key.split(".")
        loading.fill(proj, int(e), field, state[key])
    assert loading.gate_up_qweight.dtype == torch.int32 and not loading.gate_up_qweight.is_meta
    assert torch.equal(loading.gate_up_qweight, filled.gate_up_qweight)
    assert torch.equal(loading.down_qweight, filled.down_qweight)
    assert all(torch.equal(v, state[k]) for k, v in loading.state_dict().items())
    with pytest.raises(ValueError, match=r"^up_proj.1.qweight: shape \[32, 128\], expected \[64, 64\]$"):
        loading.fill("up_proj", 1, "qweight", state["down_proj.1.qweight"])
    scaled_input = QuantExperts(2, 128, 64, group_size=64, weight_on_input=True, dtype=torch.float16, device="meta")
    assert not scaled_input.use_mma_layout(DEV) and scaled_input.layout == "rows"


def test_prefill_dequantizes_straight_from_the_layout(poisoned_outputs):
    from quantpack.kernels.moe.grouped import grouped_experts, grouped_usable
    from quantpack.kernels.moe.mma_experts import mma_dequantize

    gate_up, down, x, ids, w = case(6, 2, 40, 320, 64, 64, torch.bfloat16)
    mg = MmaExperts.from_packed(gate_up)
    got = mma_dequantize(mg, 2, 5, torch.float32)
    assert got.shape == (3, 320, 128)
    assert torch.equal(got, torch.stack([reference.dequantize(gate_up.expert(e), torch.float32).t()
                                         for e in (2, 3, 4)]))
    cols = mma_dequantize(mg, 0, 6, torch.float32, 48, 96)  # (a slice of out-features: 16-column tiles)
    assert cols.shape == (6, 320, 48)
    assert torch.equal(cols, torch.stack([reference.dequantize(gate_up.expert(e), torch.float32).t()[:, 48:96]
                                          for e in range(6)]))
    with pytest.raises(ValueError, match="multiples of 16"):
        mma_dequantize(mg, 0, 6, torch.float32, 8, 96)
    if grouped_usable(x):
        md = MmaExperts.from_packed(down)
        want = grouped_experts(x, gate_up, down, ids, w, scratch_bytes=200_000)  # (the checkpoint's layout: ranges)
        # every expert at once, out-features in slices of 16 to 64 columns, and whole
        for scratch in (200_000, 2 * 6 * 320 * 16, 10 ** 9):
            out = grouped_experts(x, mg, md, ids, w, scratch_bytes=scratch)
            assert rel_err(out, want.float()) < 1e-3
