"""The prefill experts path (quantpack.kernels.moe.grouped): sorted pairs, experts dequantized a range at a time,
torch's grouped GEMM; checked against quantpack.reference.experts (bf16 on the CPU, where torch runs _grouped_mm)."""
import pytest
import torch

from quantpack import reference
from quantpack.format import PackedExperts
from quantpack.kernels.moe.grouped import grouped_experts, grouped_usable
from quantpack.quantization.groupwise import quantize

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def stacked(num_experts, n, k, *, group_size, bits=4, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [quantize(torch.randn(n, k, generator=g) / k ** 0.5, bits=bits, group_size=group_size, method="rtn",
                        dtype=torch.bfloat16) for _ in range(num_experts)]
    b = torch.randn(num_experts, n, generator=g).to(torch.bfloat16) if bias else None
    return PackedExperts.stack(weights, bias=b)


def close(got, want):
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert torch.isfinite(got).all() and err < 2e-2, f"relative error {err:.3g}"


@pytest.mark.parametrize("experts,top_k,tokens,routing", [
    (8, 2, 33, "random"), (60, 8, 17, "random"), (8, 1, 9, "one expert"), (60, 4, 12, "few experts"),
    (8, 2, 1, "random"),
])
@pytest.mark.parametrize("scratch", [None, 1])  # 1 byte: one expert per range, every range boundary exercised
def test_grouped_matches_reference(experts, top_k, tokens, routing, scratch):
    hidden, inter = 64, 96
    gate_up = stacked(experts, 2 * inter, hidden, group_size=32, seed=1)
    down = stacked(experts, hidden, inter, group_size=32, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    if routing == "one expert":
        ids = torch.full((tokens, top_k), 5)
    elif routing == "few experts":
        ids = torch.randint(0, 3, (tokens, top_k), generator=g) * 7
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    if tokens > 1:
        ids[1, 0] = experts  # an unused slot
    w = torch.rand(tokens, top_k, generator=g)
    kw = {} if scratch is None else {"scratch_bytes": scratch}
    close(grouped_experts(x, gate_up, down, ids, w, **kw), reference.experts(x, gate_up, down, ids, w))


@pytest.mark.parametrize("activation", ["swiglu_oai", "gelu_tanh"])
def test_grouped_bias_activation_and_weight_on_input(activation):
    experts, hidden, inter, tokens, top_k = 8, 64, 32, 21, 2
    gate_up = stacked(experts, 2 * inter, hidden, group_size=64, bias=True, seed=4)
    down = stacked(experts, hidden, inter, group_size=32, bias=True, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    w = torch.rand(tokens, top_k, generator=g)
    for on_input in (False, True):
        close(grouped_experts(x, gate_up, down, ids, w, activation=activation, weight_on_input=on_input,
                              scratch_bytes=1),
              reference.experts(x, gate_up, down, ids, w, activation=activation, weight_on_input=on_input))


def test_grouped_8_bit_and_usable():
    gate_up = stacked(8, 64, 32, group_size=32, bits=8, seed=7)
    down = stacked(8, 32, 32, group_size=32, bits=8, seed=8)
    x = torch.randn(10, 32).to(torch.bfloat16)
    ids = torch.randint(0, 8, (10, 2))
    w = torch.rand(10, 2)
    close(grouped_experts(x, gate_up, down, ids, w), reference.experts(x, gate_up, down, ids, w))
    assert grouped_usable(x) and not grouped_usable(x.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (8, 2, 4096, 14336)], ids=["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("tokens", [512, 2048])
def test_gpu_full_shapes(shape, tokens):
    experts, top_k, hidden, inter = shape
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def packed(n, k):
        qw = torch.randint(0, 256, (experts, k // 2, n), dtype=torch.uint8, device=dev, generator=g)
        scales = (torch.rand(experts, k // 128, n, device=dev, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
        zeros = (torch.rand(experts, k // 128, n, device=dev, generator=g) * 15).to(torch.bfloat16)
        return PackedExperts(qw, scales, zeros, 4, 128, (n, k))

    gate_up, down = packed(2 * inter, hidden), packed(hidden, inter)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device=dev, generator=g)
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    close(grouped_experts(x, gate_up, down, ids, w), reference.experts(x, gate_up, down, ids, w))
