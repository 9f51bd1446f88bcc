"""GPT-2 style checkpoints, whose linear layers are transformers' Conv1D (weights stored (in, out)):
convert quantizes them as (out, in) linears, load/from_pretrained run them as QuantLinear, verify
compares them with the transposed source weight."""
import json

import pytest
import torch

from quantpack import checkpoint, load
from quantpack.convert import convert
from quantpack.modules.linear import QuantLinear, linear_dims
from quantpack.tiny import make_tiny_gpt2
from quantpack.verify import verify

from oracles import dequantized_source, fused_vs_dequantized

CONV1D = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
          "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj",
          "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    src = make_tiny_gpt2(root / "src", n_embd=64, train_steps=20)
    summary = convert(src, root / "packed", group_size=32, method="rtn")
    return src, root / "packed", summary


def test_linear_dims_reads_conv1d_transposed():
    from transformers.pytorch_utils import Conv1D

    assert linear_dims(Conv1D(nf=48, nx=16)) == (48, 16, True)
    assert linear_dims(torch.nn.Linear(16, 48)) == (48, 16, False)
    assert linear_dims(torch.nn.Embedding(4, 4)) is None


def test_convert_quantizes_every_conv1d(gpt2):
    src, packed, summary = gpt2
    assert sorted(layer.name for layer in summary.quantized) == CONV1D
    assert all(layer.transposed for layer in summary.quantized)
    stored = json.loads((src / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (src / "model.safetensors").read_bytes()[:8], "little")])
    assert stored["transformer.h.0.mlp.c_fc.weight"]["shape"] == [64, 256]  # (in, out) in the source
    layers = {x["name"]: x for x in checkpoint.read_manifest(packed)["layers"]}
    assert layers["transformer.h.0.mlp.c_fc"]["shape"] == [256, 64] and layers["transformer.h.0.mlp.c_fc"]["source_transposed"]
    with checkpoint.PackedCheckpoint(packed) as pc:
        pw, _ = pc.layer("transformer.h.0.mlp.c_fc")
        assert pw.shape == (256, 64) and tuple(pw.qweight.shape) == (32, 256)


def test_load_matches_the_dequantized_source_and_generates_the_same(gpt2):
    from transformers import AutoTokenizer

    src, packed, _ = gpt2
    model = load(packed, device="cpu", dtype=torch.float32)
    for name in CONV1D:
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear) and module.source_transposed
    oracle = dequantized_source(src, packed)
    ids = AutoTokenizer.from_pretrained(packed)("Packed weights are read by a fused kernel", return_tensors="pt")
    with torch.no_grad():
        got, want = model(**ids).logits, oracle(**ids).logits
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3
        kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert torch.equal(model.generate(**ids, **kw), oracle.generate(**ids, **kw))


def test_from_pretrained_route(gpt2):
    import quantpack  # noqa: F401  (registers the quantization method)
    from transformers import AutoModelForCausalLM

    _, packed, _ = gpt2
    ids = torch.tensor([[1, 5, 9, 30, 41]])
    a = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32)
    assert isinstance(a.transformer.h[0].mlp.c_fc, QuantLinear)
    with torch.no_grad():
        assert torch.allclose(a(ids).logits, load(packed, device="cpu", dtype=torch.float32)(ids).logits,
                              rtol=0, atol=1e-5)


def test_verify_compares_with_the_transposed_source(gpt2):
    _, packed, summary = gpt2
    report = verify(packed, device="cpu")
    assert report.verdict == "pass", report.format_table()
    recorded = {layer.name: layer.rel_error for layer in summary.quantized}
    measured = {x["name"]: x["rel_error"] for x in report.layers["items"]}
    assert measured.keys() == recorded.keys()
    for name, err in recorded.items():
        assert measured[name] == pytest.approx(err, rel=1e-3)  # the same weight, not its transpose


def test_hub_gpt2_layout_is_stored_under_the_models_names(gpt2, tmp_path):
    """openai-community/gpt2 stores ``h.0...`` (no ``transformer.`` prefix) plus the causal masks
    ``h.N.attn.bias`` that transformers ignores: the packed checkpoint uses the model's own names
    and drops the masks, so it loads and converts exactly like the canonical layout."""
    from safetensors.torch import load_file, save_file
    import shutil

    src, packed, _ = gpt2
    hub = tmp_path / "hub-layout"
    shutil.copytree(src, hub)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(hub / "model.safetensors").items()
               if k != "lm_head.weight"}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    summary = convert(hub, tmp_path / "packed", group_size=32, method="rtn")
    assert summary.warnings == ["dropped 2 stored tensors that are not parameters of GPT2LMHeadModel "
                                "(transformers skips them too): h.0.attn.bias, h.1.attn.bias"]
    assert sorted(layer.name for layer in summary.quantized) == CONV1D
    with checkpoint.PackedCheckpoint(tmp_path / "packed") as a, checkpoint.PackedCheckpoint(packed) as b:
        assert sorted(a.source.tensors) == sorted(b.source.tensors)
        for name in a.source.tensors:
            assert torch.equal(a.source.get(name), b.source.get(name)), name
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "packed", device="cpu")(ids).logits, load(packed, device="cpu")(ids).logits)


def test_w8a8_scheme_on_conv1d(gpt2, tmp_path):
    """The int8 scheme takes the same (out, in) orientation: its logits track the source model."""
    from transformers import GPT2LMHeadModel
    from quantpack.modules.w8a8 import W8A8Linear

    src, _, _ = gpt2
    convert(src, tmp_path / "w8a8", scheme="w8a8")
    model = load(tmp_path / "w8a8", device="cpu", dtype=torch.float32)
    assert isinstance(model.transformer.h[0].mlp.c_fc, W8A8Linear)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        got = model(ids).logits
        want = GPT2LMHeadModel.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    err = ((got - want).norm() / want.norm()).item()
    print(f"w8a8 gpt2 logits rel err {err:.4f}")
    assert err < 0.05  # a transposed weight would be far off


@pytest.mark.gpu
def test_conv1d_runs_the_fused_kernel_on_gpu(gpt2, monkeypatch):
    src, packed, _ = gpt2
    model = load(packed, device="cuda", dtype=torch.float16)
    assert fused_vs_dequantized(src, packed, model, monkeypatch) <= 5e-3
