"""SINQ column scales: absorbed exactly, and quantized through the reference path and the kernels."""
from __future__ import annotations

import copy

import pytest
import torch

from quantpack import sinq
from quantpack.tiny import quiet_transformers


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=96, max_position_embeddings=64, **kw)
    with quiet_transformers():
        model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread-out columns and norms, as trained weights have
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(torch.exp(torch.randn(p.shape[1]) * 0.7))
            else:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def test_column_scales_balance_a_skewed_weight():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.exp(torch.randn(128) * 1.5)
    t = sinq.column_scales([w])
    assert t.shape == (128,) and bool((t > 0).all())
    assert float(t.median()) == pytest.approx(1.0)
    before, after = w.std(0), (w / t).std(0)
    assert float(after.max() / after.min()) < 0.25 * float(before.max() / before.min())


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_absorb_keeps_the_llama_function(kv_heads):
    model = _llama(num_key_value_heads=kv_heads, attention_bias=True)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 24))
    changed = sinq.absorb(model)
    names = {f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(changed) == names
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, ref.model.layers[0].input_layernorm.weight)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_absorb_keeps_a_post_norm_encoder_and_touches_only_attention_output():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    with quiet_transformers():
        model = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=100)).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 16))
    changed = sinq.absorb(model)
    assert changed == [f"encoder.layer.{i}.attention.output.dense" for i in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, ref(ids).last_hidden_state, rtol=1e-4, atol=1e-4)
