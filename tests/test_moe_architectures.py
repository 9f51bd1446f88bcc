"""Mixture-of-experts architectures end to end, each on a tiny real checkpoint stored as the hub stores it (one
matrix per expert): convert -> verify -> load -> generate, the packed model's logits against the dequantized
source's, and (where the fused expert kernel is built) the kernel path's logits against the reference path's."""
import importlib.util

import pytest
import torch

from quantpack import load
from quantpack.convert import convert
from quantpack.modules.experts import QuantExperts
from quantpack.tiny import make_tiny_moe
from quantpack.verify import verify

from oracles import dequantized_source

_ATTENTION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)
ARCHITECTURES = {
    # (config class, model class, config): tiny, 1-2 layers, few experts
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_ATTENTION, intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         topk_method="group_limited_greedy", first_k_dense_replace=0, num_key_value_heads=4,
                         q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=0, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
}
# The MLA attention's linears DeepSeek quantizes besides its experts.
MLA = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
       "self_attn.o_proj")


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def packed(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, config = ARCHITECTURES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_moe(root / "src", getattr(transformers, config_cls), getattr(transformers, model_cls),
                        **config)
    summary = convert(src, root / "packed", group_size=16, method="rtn")
    return request.param, src, root / "packed", summary


def test_convert_verify_load_generate(packed):
    name, src, out, summary = packed
    quantized = {layer.name for layer in summary.quantized}
    assert {f"model.layers.1.mlp.experts.{p}.3" for p in ("gate_proj", "up_proj", "down_proj")} <= quantized
    if name.startswith("deepseek"):
        assert {f"model.layers.0.{m}" for m in MLA} <= quantized, sorted(quantized)
    report = verify(out, device="cpu")
    assert report.verdict == "pass", report.format_table()
    assert report.layers["count"] == len(summary.quantized) and report.layers["missing"] == []

    model = load(out, device="cpu", dtype=torch.float32)
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)
    oracle = dequantized_source(src, out)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71]])
    with torch.no_grad():
        want = oracle(ids).logits
        got = model(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), oracle.generate(ids, **kw))


@pytest.mark.skipif(importlib.util.find_spec("quantpack.kernels.moe") is None,
                    reason="the fused expert kernel (quantpack.kernels.moe) is not in this build")
def test_kernel_path_logits_equal_the_reference_path(packed, monkeypatch):
    """The fused expert kernel (under TRITON_INTERPRET=1 on the CPU) gives the reference path's logits."""
    import os

    from quantpack.kernels import moe
    from quantpack.modules import experts

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on the CPU under TRITON_INTERPRET=1 only")
    _, _, out, _ = packed
    model = load(out, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71]])
    with torch.no_grad():
        want = model(ids).logits
        monkeypatch.setattr(experts.reference, "experts", moe.fused_experts)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text"])
def test_experts_blocks_quantpack_cannot_pack_are_refused(arch, tmp_path):
    """gpt-oss's block (biased, gate/up interleaved, stored (E, H, 2I)) and Llama 4's (stored transposed) are not
    the standard block: convert names the block in one line and writes nothing, instead of keeping the experts in
    full precision."""
    import transformers

    config = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, max_position_embeddings=128)
    if arch == "gpt_oss":
        classes, config = ("GptOssConfig", "GptOssForCausalLM"), dict(config, num_experts_per_tok=2,
                                                                    layer_types=["full_attention"])
        block = "GptOssExperts"
    else:
        classes, config = ("Llama4TextConfig", "Llama4ForCausalLM"), dict(config, intermediate_size_mlp=128,
                                                                        num_experts_per_tok=1)
        block = "Llama4TextExperts"
    src = make_tiny_moe(tmp_path / "src", *(getattr(transformers, c) for c in classes), **config)
    with pytest.raises(ValueError, match=rf"^model\.layers\.0\.(mlp|feed_forward)\.experts: quantpack does not "
                                         rf"quantize this mixture-of-experts block \({block}\) yet"):
        convert(src, tmp_path / "out", group_size=16, method="rtn")
    assert not (tmp_path / "out").exists()
