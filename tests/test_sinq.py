"""SINQ column scales: absorbed exactly, and quantized through the reference path and the kernels."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from quantpack.quantization import sinq
from quantpack.tiny import quiet_transformers

from oracles import assert_stored_layer_matches_float_product, stored_tensors


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=96, max_position_embeddings=64, **kw)
    with quiet_transformers():
        model = LlamaForCausalLM(cfg).eval()
    return _spread(model, norm_offset=0.5)


def _spread(model, norm_offset: float):
    """Spread-out columns and norms, as trained weights have (norm weights uniform from ``norm_offset``)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(torch.exp(torch.randn(p.shape[1]) * 0.7))
            else:
                p.copy_(torch.rand_like(p) + norm_offset)
    return model


def test_column_scales_balance_a_skewed_weight():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.exp(torch.randn(128) * 1.5)
    t = sinq.column_scales([w])
    assert t.shape == (128,) and bool((t > 0).all())
    assert float(t.median()) == pytest.approx(1.0)
    before, after = w.std(0), (w / t).std(0)
    assert float(after.max() / after.min()) < 0.25 * float(before.max() / before.min())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_vector_is_kept_only_for_a_clear_estimated_gain(bits):
    # Estimated gains of a few percent were noise on real weights (and made 8-bit worse): dropped.
    def case(spread):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(256, generator=g) * spread)
        t = sinq.column_scales([w])
        act = torch.ones(256)
        gain = 1 - sinq._weighted_error([w / t], act * t, bits, 128) / sinq._weighted_error([w], act, bits, 128)
        return gain, sinq._choose([w], t, act, bits, 128)

    gain, kept = case(0.1)  # nearly balanced columns: a small estimated gain
    assert 0 < gain < sinq.KEEP_GAIN and kept is None
    gain, kept = case(1.0)  # outlier columns: a large one
    assert gain > 0.3 and kept is not None


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


def _assert_only_o_and_down_move(model):
    """``absorb`` on a 2-block model whose norms cannot take a vector: o's vector goes into v's rows, down's into
    up's, the norms stay as they are, and the function is kept."""
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 24))
    changed = sinq.absorb(model)
    assert set(changed) == {f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")}
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert all(torch.equal(p, ref.get_parameter(n)) for n, p in norms.items())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_absorb_keeps_the_gemma3_function(kv_heads):
    # Gemma's norms multiply by 1 + weight, and its post-attention norm scales attention's output (the MLP's input
    # norm is pre_feedforward_layernorm): only o's vector (into v's rows) and down's (into up's) can move
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=kv_heads, head_dim=32, vocab_size=96, max_position_embeddings=64,
                           layer_types=["sliding_attention", "full_attention"])
    with quiet_transformers():
        model = _spread(Gemma3ForCausalLM(cfg).eval(), norm_offset=-0.5)  # (Gemma's norms scale by 1 + weight)
    _assert_only_o_and_down_move(model)


class OffsetRMSNorm(torch.nn.Module):
    """An RMSNorm that scales by 1 + weight, as Gemma's does, in a model of another type."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class SquaredRMSNorm(OffsetRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight ** 2


def _norms():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return [(LlamaRMSNorm(16), "weight"), (torch.nn.LayerNorm(16), "weight"), (Gemma3RMSNorm(16), "one_plus"),
            (OffsetRMSNorm(16), "one_plus"), (SquaredRMSNorm(16), None), (torch.nn.LayerNorm(16, bias=False), "weight"),
            (torch.nn.LayerNorm(16, elementwise_affine=False), None), (torch.nn.Identity(), None)]


@pytest.mark.parametrize("meta", [False, True])
def test_norm_gain_tells_how_a_norm_applies_its_weight(meta):
    for norm, kind in _norms():
        if meta:
            norm = norm.to("meta")
        weight = getattr(norm, "weight", None)
        before = None if weight is None or meta else weight.clone()
        assert sinq.norm_gain(norm) == kind, type(norm).__name__
        if before is not None:
            assert torch.equal(norm.weight, before)  # probed on a copy


def test_absorb_leaves_offset_norms_alone_whatever_the_model_type():
    # A (1 + weight) norm in a Llama: only o's and down's vectors may move, as in Gemma.
    model = _llama(num_key_value_heads=4)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = OffsetRMSNorm(128)
                norm.weight.copy_(torch.rand(128) - 0.5)
                setattr(layer, name, norm)
    _assert_only_o_and_down_move(model)


def test_absorb_leaves_a_parallel_block_alone():
    # Cohere's MLP reads the attention's input norm: a vector in that norm would change the MLP's input too
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    cfg = CohereConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=96, max_position_embeddings=64, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    with quiet_transformers():
        model = _spread(CohereForCausalLM(cfg).eval(), norm_offset=0.5)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 24))
    assert sinq.absorb(model) == []
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_plain_block_refuses_what_it_does_not_know():
    def block(attention=("q_proj", "k_proj", "v_proj", "o_proj"), mlp=("gate_proj", "up_proj", "down_proj"),
              norms=("input_layernorm", "post_attention_layernorm"), extra=()):
        def holder(names):
            return torch.nn.ModuleDict({n: torch.nn.Identity() for n in names})
        return torch.nn.ModuleDict({"self_attn": holder(attention), "mlp": holder(mlp),
                                    **{n: torch.nn.Identity() for n in (*norms, *extra)}})

    assert sinq.plain_block(block(), mlp=True)
    assert sinq.plain_block(block(attention=("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")), mlp=True)
    assert not sinq.plain_block(block(attention=("q_proj", "k_proj", "v_proj", "o_proj", "v_norm")), mlp=True)
    assert not sinq.plain_block(block(extra=("laurel",)), mlp=True)
    assert not sinq.plain_block(block(norms=("input_layernorm",)), mlp=False)  # the MLP reads the input norm
    assert not sinq.plain_block(block(mlp=("experts", "gate")), mlp=True)
    assert sinq.plain_block(block(mlp=("experts", "gate")), mlp=False)  # attention's vectors may still move


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


@pytest.fixture(scope="module")
def skewed_llama_dir(tmp_path_factory):
    """A tiny trained Llama whose linear weights have outlier input features (as trained LLMs do)."""
    from safetensors.torch import load_file, save_file

    from quantpack.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("skewed") / "src", num_shards=1, train_steps=30)
    sd = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in sd.items():
        if name.endswith("proj.weight"):
            sd[name] = w * torch.exp(torch.randn(w.shape[1], generator=gen) * 0.8)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def sinq_converted(skewed_llama_dir, tmp_path_factory):
    """``quantpack convert --method sinq`` of the skewed Llama."""
    from click.testing import CliRunner

    from quantpack.cli import cli

    out = tmp_path_factory.mktemp("sinq") / "out"
    result = CliRunner().invoke(cli, ["convert", str(skewed_llama_dir), "--output", str(out), "--method", "sinq",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


def test_convert_method_sinq_stores_absorbed_norms_and_keeps_the_function(skewed_llama_dir, sinq_converted):
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    import quantpack
    from quantpack.verify import verify

    out = sinq_converted
    manifest = json.loads((out / "quantpack.json").read_text())
    kept = manifest["settings"]["sinq_scales"]
    assert manifest["settings"]["method"] == "sinq" and kept  # some vectors are worth absorbing here

    # The stored norms are the source's times the absorbed vectors (bfloat16 storage rounding aside).
    source = load_file(skewed_llama_dir / "model.safetensors")
    stored = stored_tensors(out)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(skewed_llama_dir))
    rescale, again = sinq.plan(source, source.__getitem__, skeleton, bits=None, group_size=None, kept=kept)
    assert again == kept
    for block, sites in kept.items():
        for site, norm in (("qkv", "input_layernorm"), ("gate_up", "post_attention_layernorm")):
            name = f"{block}.{norm}.weight"
            if site not in sites:
                torch.testing.assert_close(stored[name].float(), source[name].bfloat16().float())
                continue
            row, _ = rescale[name]
            assert not torch.allclose(stored[name].float(), source[name], rtol=1e-2)
            torch.testing.assert_close(stored[name].float(), (source[name] * row).bfloat16().float())

    # It loads and computes (nearly) the source's function on the text the source was trained on.
    from quantpack.tiny import PASSAGE

    with quiet_transformers():
        ref = LlamaForCausalLM.from_pretrained(skewed_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(skewed_llama_dir)(PASSAGE)["input_ids"][:96]])
    model = quantpack.load(out, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        a, b = ref(ids).logits.log_softmax(-1), model(ids).logits.float().log_softmax(-1)
    assert float((a.exp() * (a - b)).sum(-1).mean()) < 0.05
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9

    # verify compares each layer with the absorbed reference weight: same errors as at conversion.
    report = verify(out, device="cpu")
    assert not [c for c in report.checks if not c.passed] and not report.warnings
    recorded = {x["name"]: x["rel_error"] for x in manifest["layers"]}
    for item in report.layers["items"]:
        assert item["rel_error"] == pytest.approx(recorded[item["name"]], rel=1e-3)


def test_convert_method_sinq_refuses_groups_along_out_features(skewed_llama_dir, tmp_path):
    from click.testing import CliRunner

    from quantpack.cli import cli

    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(skewed_llama_dir), "--output", str(out), "--method", "sinq",
                                      "--axis", "0", "--no-progress"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["Error: method='sinq' balances input features, for groups along "
                                                  "them; use axis=1"]
    assert not out.exists()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py) unwritten outputs are NaN
@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"])
def test_sinq_codes_through_reference_and_kernels_match_the_float_product(sinq_converted, layer):
    import json

    kept = json.loads((sinq_converted / "quantpack.json").read_text())["settings"]["sinq_scales"]
    block, site = ("model.layers.0", "qkv") if "v_proj" in layer else ("model.layers.1", "down")
    assert site in kept[block]  # the layer's columns were rescaled before quantization
    assert_stored_layer_matches_float_product(sinq_converted, layer)
