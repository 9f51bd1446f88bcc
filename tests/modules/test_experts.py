"""Mixture-of-experts checkpoints (Mixtral-style: one matrix per expert on disk, 3-D tensors in
transformers 5): convert quantizes every expert matrix, load and from_pretrained run them through
QuantExperts, verify compares each with its source matrix."""
import json

import pytest
import torch

from quantpack import checkpoint, load
from quantpack.convert import convert
from quantpack.modules.experts import QuantExperts, fused_experts_dims
from quantpack.tiny import make_tiny_mixtral
from quantpack.verify import verify

from oracles import MIXED_MM, GraphRecorder, dequantized_source, fused_vs_dequantized


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    src = make_tiny_mixtral(root / "src", train_steps=20)
    summary = convert(src, root / "packed", group_size=32, method="rtn")
    return src, root / "packed", summary


def test_fused_experts_dims():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts = MixtralExperts(MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=3))
    assert fused_experts_dims(experts) == (3, 16, 24)
    assert fused_experts_dims(torch.nn.Linear(4, 4)) is None


def test_loaded_moe_models_skip_transformers_experts_switch(mixtral, monkeypatch):
    """generate() on a GPU switches a model's grouped_mm experts to batched_mm and back, walking every module each
    time; a loaded model whose blocks are all QuantExperts is set to the eager implementation, so the decode loop
    runs without that switch (checked with the device reported as a GPU)."""
    import quantpack  # noqa: F401  (registers the quantization method)
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from quantpack.modules.experts import skip_experts_switch

    src, packed, _ = mixtral
    for model in (load(packed, device="cpu", dtype=torch.float32),
                  AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32)):
        assert set(model.get_experts_implementation().values()) == {"eager"}
        switched = []
        monkeypatch.setattr(PreTrainedModel, "set_experts_implementation", lambda self, v: switched.append(v))
        monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
        with model._optimize_model_for_decode():
            pass
        assert switched == []
        monkeypatch.undo()
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # (transformers' experts: left alone)
    before = source.get_experts_implementation()
    assert not skip_experts_switch(source) and source.get_experts_implementation() == before


def test_convert_quantizes_every_expert_matrix(mixtral):
    src, packed, summary = mixtral
    names = {layer.name for layer in summary.quantized}
    for layer in (0, 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert {f"model.layers.{layer}.mlp.experts.{proj}.{e}" for e in range(4)} <= names
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"]["quantized_experts"] == ["model.layers.0.mlp.experts",
                                                                  "model.layers.1.mlp.experts"]
    layers = {x["name"]: x for x in checkpoint.read_manifest(packed)["layers"]}
    assert layers["model.layers.1.mlp.experts.up_proj.3"]["source"] == "model.layers.1.block_sparse_moe.experts.3.w3"
    with checkpoint.PackedCheckpoint(packed) as pc:
        stored = set(pc.source.tensors)
    assert "model.layers.0.mlp.gate.weight" in stored  # the router, renamed like its block, kept as is
    assert not any("block_sparse_moe" in name for name in stored)


def test_load_and_from_pretrained_match_thedequantized_source(mixtral):
    import quantpack  # noqa: F401  (registers the quantization method)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, packed, _ = mixtral
    model = load(packed, device="cpu", dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    oracle = dequantized_source(src, packed)
    ids = AutoTokenizer.from_pretrained(packed)("Packed weights are read by a fused kernel", return_tensors="pt")
    hf = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32)
    assert isinstance(hf.model.layers[1].mlp.experts, QuantExperts)
    with torch.no_grad():
        want = oracle(**ids).logits
        for got in (model(**ids).logits, hf(**ids).logits):
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
        kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert torch.equal(model.generate(**ids, **kw), oracle.generate(**ids, **kw))


def test_verify_compares_each_expert_with_its_source_matrix(mixtral):
    _, packed, summary = mixtral
    report = verify(packed, device="cpu")
    assert report.verdict == "pass", report.format_table()
    assert report.layers["missing"] == []
    measured = {x["name"]: x["rel_error"] for x in report.layers["items"]}
    for layer in summary.quantized:
        assert measured[layer.name] == pytest.approx(layer.rel_error, rel=1e-3)


def test_partial_skip_and_w8a8_are_refused(mixtral, tmp_path):
    src, _, _ = mixtral
    with pytest.raises(ValueError, match=r"a block is quantized whole"):
        convert(src, tmp_path / "a", group_size=32, skip=[r"experts\.down_proj\.1$"])
    with pytest.raises(ValueError, match=r"--scheme w8a8 does not quantize mixture-of-experts blocks"):
        convert(src, tmp_path / "b", scheme="w8a8")
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.experts\.gate_proj\.0: group_size=128 .*"
                                         r"\(an experts block is quantized whole\)$"):
        convert(src, tmp_path / "c", group_size=128)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_other_moe_families(model_type, tmp_path):
    """Qwen-MoE checkpoints name experts ``mlp.experts.<e>.gate_proj`` (no block rename); Qwen2-MoE also
    has a shared expert (plain linears) next to the routed ones."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=96, num_experts=4, num_experts_per_tok=2,
                                  head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    summary = convert(tmp_path / "src", tmp_path / "packed", group_size=32, method="rtn")
    assert sum(".experts." in layer.name for layer in summary.quantized) == 2 * 3 * 4
    model = load(tmp_path / "packed", device="cpu", dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2]])
    with torch.no_grad():
        want = dequantized_source(tmp_path / "src", tmp_path / "packed")(ids).logits
        assert ((model(ids).logits - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_compiled_static_cache_generate_matches_eager(mixtral, monkeypatch):
    """transformers compiles a static-cache decode step without fullgraph: the experts' routing (bincount, nonzero,
    a loop over the experts hit) has data-dependent shapes and breaks the graph, so the experts run eagerly, and the
    rest (attention projections through the kernel's custom op) compiles."""
    from transformers import AutoTokenizer, CompileConfig

    from quantpack.modules.linear import QuantLinear

    _, packed, _ = mixtral
    monkeypatch.setattr(QuantLinear, "backend", "triton")
    model = load(packed, device="cpu", dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(packed)("Packed weights are read by a fused kernel", return_tensors="pt")
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model.generate(**ids, **kw, disable_compile=True)
            recorder = GraphRecorder()
            config = CompileConfig(backend=recorder)
            config._compile_all_devices = True  # (transformers compiles the decode step itself only on accelerators)
            got = model.generate(**ids, **kw, compile_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    ops = recorder.count(MIXED_MM)
    assert len(recorder.graphs) > 1 and ops >= 4 * len(model.model.layers), ops  # (q, k, v, o per layer)


@pytest.mark.gpu
def test_experts_run_the_fused_kernel_on_gpu(mixtral, monkeypatch):
    src, packed, _ = mixtral
    model = load(packed, device="cuda", dtype=torch.float16)
    assert model.model.layers[0].mlp.experts.gate_proj[0].qweight.is_cuda
    assert fused_vs_dequantized(src, packed, model, monkeypatch) <= 5e-3


def test_experts_are_stacked_per_projection_and_named_per_expert(mixtral):
    """Each block holds two stacked PackedExperts (gate and up merged); the per-expert tensors the checkpoint names
    are views of their slots, load_state_dict copies into them, and the forward equals each expert's matrix run
    as its own layer."""
    from quantpack.modules.linear import QuantLinear

    _, packed, _ = mixtral
    model = load(packed, device="cpu", dtype=torch.float32)
    block = model.model.layers[0].mlp.experts
    e, h, i = block.num_experts, block.hidden_dim, block.intermediate_dim
    assert tuple(block.gate_up_qweight.shape) == (e, h // 2, 2 * i)
    assert tuple(block.down_qweight.shape) == (e, i // 2, h)
    block.gate_up.validate()
    block.down.validate()
    assert block.up_proj[2].qweight.data_ptr() == block.gate_up_qweight[2, :, i:].data_ptr()
    state = block.state_dict()
    assert sorted(state) == sorted(f"{p}.{x}.{f}" for p in ("gate_proj", "up_proj", "down_proj") for x in range(e)
                                   for f in ("qweight", "scales", "zeros"))
    with checkpoint.PackedCheckpoint(packed) as pc:
        stored = pc.source.get("model.layers.0.mlp.experts.up_proj.3.scales")
    assert torch.equal(state["up_proj.3.scales"], stored.to(state["up_proj.3.scales"].dtype))

    fresh = QuantExperts(e, h, i, bits=4, group_size=32, dtype=block.gate_up_scales.dtype, device="meta")
    fresh.load_state_dict(state)
    for name in ("gate_up_qweight", "gate_up_scales", "gate_up_zeros", "down_qweight", "down_scales", "down_zeros"):
        assert torch.equal(getattr(fresh, name), getattr(block, name)), name

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, h, generator=g)
    ids = torch.tensor([[0, 1], [1, 3], [3, 3], [2, 0], [1, 2]])
    weights = torch.rand(5, 2, generator=g)
    want = torch.zeros(5, h)
    with torch.no_grad():
        for t in range(5):
            for s in range(2):
                x_t = x[t:t + 1]
                gate, up, down = (QuantLinear.from_packed(getattr(block, p)[int(ids[t, s])].packed())
                                  for p in ("gate_proj", "up_proj", "down_proj"))
                want[t] += weights[t, s] * down(torch.nn.functional.silu(gate(x_t)) * up(x_t))[0]
        torch.testing.assert_close(block(x, ids, weights), want, rtol=1e-4, atol=1e-5)


def test_a_block_takes_one_bit_width(mixtral, tmp_path):
    src, _, _ = mixtral
    with pytest.raises(ValueError, match=r"^--bits-for gives model\.layers\.0\.mlp\.experts\.down_proj\.1 8 bits but "
                                         r"model\.layers\.0\.mlp\.experts\.gate_proj\.0 4; an experts block is "
                                         r"quantized whole"):
        convert(src, tmp_path / "a", group_size=32, bits_for=[r"layers\.0\.mlp\.experts\.down_proj\.1$=8"])
    with pytest.raises(ValueError, match=r"--axis 0: experts are packed with groups along in-features"):
        convert(src, tmp_path / "b", group_size=32, axis=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # A whole block at its own bit width loads as one 8-bit stack.
    convert(src, tmp_path / "c", group_size=32, method="rtn", bits_for=[r"layers\.1\.mlp\.experts\.=8"])
    model = load(tmp_path / "c", device="cpu", dtype=torch.float32)
    assert [layer.mlp.experts.bits for layer in model.model.layers] == [4, 8]
    assert model.model.layers[1].mlp.experts.gate_up_qweight.shape[1] == model.config.hidden_size


def test_lora_on_packed_experts_is_refused(mixtral):
    from peft import get_peft_model

    import quantpack.integrations.peft as peft_integration

    _, packed, _ = mixtral
    model = load(packed, device="cpu", dtype=torch.float32)
    config = peft_integration.lora_config(r=4, target_modules=["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"^LoRA on a mixture-of-experts block \(gate_proj\) is not supported on "
                                         r"packed experts; leave the experts out of target_modules"):
        get_peft_model(model, config)
    get_peft_model(load(packed, device="cpu", dtype=torch.float32),
                   peft_integration.lora_config(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.gpu
def test_default_generate_on_a_moe_model_on_gpu(mixtral):
    """Plain generate() on the default path gives the eager tokens at batch 1 and 16: with the fused expert kernel
    the decode step is captured as a CUDA graph; without it (the reference syncs) the model decodes eagerly."""
    import importlib.util

    _, packed, _ = mixtral
    fast = load(packed, device="cuda", dtype=torch.bfloat16)
    eager = load(packed, device="cuda", dtype=torch.bfloat16, decode="eager")
    for batch in (1, 16):
        ids = torch.randint(3, fast.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(batch))
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(fast.generate(ids.cuda(), **kw), eager.generate(ids.cuda(), **kw))
    runner = fast.get_compiled_call.__self__
    if importlib.util.find_spec("quantpack.kernels.moe") is not None:
        assert runner.eager_reason is None and runner.captures == 2
    else:
        assert runner.eager_reason is not None and runner.captures == 0


@pytest.mark.gpu
def test_peak_gpu_memory_of_a_moe_load_is_the_packed_bytes(tmp_path):
    """Each stacked buffer is allocated once on the GPU and filled in place, the experts' qweights packed into the
    mma decode layout as they come: the peak while loading is at most 1.1x the checkpoint's bytes (no per-expert
    copies, no stacking, never both layouts)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quantpack.tiny import make_tiny_moe

    src = make_tiny_moe(tmp_path / "src", Qwen3MoeConfig, Qwen3MoeForCausalLM, dtype=torch.bfloat16,
                        hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=64,
                        num_experts_per_tok=8, max_position_embeddings=128)
    convert(src, tmp_path / "packed", group_size=64, method="rtn")
    with checkpoint.PackedCheckpoint(tmp_path / "packed") as pc:
        stored = sum(info.nbytes for info in pc.source.tensors.values())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load(tmp_path / "packed", device="cuda", dtype=torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 1.1 * stored, (peak, stored)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_qweight.is_cuda and experts.layout == "mma"


def test_from_experts_quantizes_a_block_in_memory_as_convert_does(mixtral):
    """QuantExperts.from_experts (what benchmarks build random models with) stores the tensors convert stores."""
    from transformers import AutoModelForCausalLM

    src, packed, _ = mixtral
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    loaded = load(packed, device="cpu", dtype=torch.float32).model.layers[1].mlp.experts
    made = QuantExperts.from_experts(source.model.layers[1].mlp.experts, bits=4, group_size=32, method="rtn",
                                     dtype=loaded.gate_up_scales.dtype)
    for name in ("gate_up_qweight", "gate_up_scales", "gate_up_zeros", "down_qweight", "down_scales", "down_zeros"):
        assert torch.equal(getattr(made, name), getattr(loaded, name)), name
    with pytest.raises(ValueError, match="^Linear: not an experts block"):
        QuantExperts.from_experts(torch.nn.Linear(4, 4))
