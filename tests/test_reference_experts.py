"""The experts oracle (quantpack.reference.experts) and the stacked layout (quantpack.format.PackedExperts),
checked against a token-by-token loop over dense dequantized weights."""
import pytest
import torch

from quantpack import reference
from quantpack.format import PackedExperts
from quantpack.quantization.groupwise import quantize


def stacked(num_experts, n, k, *, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [quantize(torch.randn(n, k, generator=g), group_size=32, dtype=torch.float32)
               for _ in range(num_experts)]
    b = torch.randn(num_experts, n, generator=g) if bias else None
    return PackedExperts.stack(weights, bias=b)


def dense_loop(x, gate_up, down, ids, weights, activation, weight_on_input):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.num_experts:
                continue
            xt = x[t] * weights[t, j] if weight_on_input else x[t]
            a = xt @ reference.dequantize(gate_up.expert(e)).t()
            if gate_up.bias is not None:
                a = a + gate_up.bias[e]
            y = reference.expert_activation(a, activation) @ reference.dequantize(down.expert(e)).t()
            if down.bias is not None:
                y = y + down.bias[e]
            out[t] += y if weight_on_input else weights[t, j] * y
    return out


@pytest.mark.parametrize("activation", reference.EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("weight_on_input,bias", [(False, False), (True, False), (False, True)])
def test_experts_match_a_dense_loop(activation, weight_on_input, bias):
    num_experts, hidden, inter, tokens, top_k = 5, 64, 96, 7, 3
    gate_up = stacked(num_experts, 2 * inter, hidden, bias=bias, seed=1)
    down = stacked(num_experts, hidden, inter, bias=bias, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    ids[0, 2] = num_experts  # an unused slot
    ids[1, 0] = -1
    weights = torch.rand(tokens, top_k, generator=g)
    got = reference.experts(x, gate_up, down, ids, weights, activation=activation, weight_on_input=weight_on_input)
    want = dense_loop(x, gate_up, down, ids, weights, activation, weight_on_input)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_swiglu_oai_clamps():
    gate_up = torch.tensor([[10.0, -10.0, 10.0, 0.5]])  # gate (10, -10), up (10, 0.5)
    h = reference.expert_activation(gate_up, "swiglu_oai", alpha=1.0, limit=7.0)
    want = torch.tensor([[(7.0 + 1) * 7.0 * torch.sigmoid(torch.tensor(7.0)),
                          (0.5 + 1) * -10.0 * torch.sigmoid(torch.tensor(-10.0))]])
    torch.testing.assert_close(h, want)


def test_stack_refuses_mixed_experts_and_checks_shapes():
    a = quantize(torch.randn(32, 64), group_size=32)
    b = quantize(torch.randn(32, 64), group_size=64)
    with pytest.raises(ValueError, match=r"^expert 1: .* differ from expert 0's"):
        PackedExperts.stack([a, b])
    s = PackedExperts.stack([a, a])
    assert s.num_experts == 2 and s.expert(1).qweight.data_ptr() == s.qweight[1].data_ptr()
    s.validate()
    s.scales = s.scales[:, :1]
    with pytest.raises(ValueError, match=r"^scales: shape"):
        s.validate()
    with pytest.raises(ValueError, match=r"^activation='relu'"):
        reference.expert_activation(torch.zeros(1, 4), "relu")
