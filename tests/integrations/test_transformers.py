"""transformers' from_pretrained on quantpack checkpoints, and peft LoRA on a frozen quantized base."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import quantpack.integrations.peft as peft_integration
import quantpack.integrations.transformers as hf_integration
from quantpack import checkpoint
from quantpack.checkpoint import CheckpointError
from quantpack.loader import load
from quantpack.modules.linear import QuantLinear
from test_loader import (RTOL, _flip_data_byte, _refresh_manifest, dequantized_source, encoder_src,  # noqa: F401
                         llama_src, packed_encoder, packed_llama, packed_tied, prompt_ids, rel_err)


def test_from_pretrained_gives_the_same_logits_as_load(packed_llama, llama_src):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(packed_llama, dtype=torch.float32)
    replaced = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    with checkpoint.PackedCheckpoint(packed_llama) as pc:
        assert replaced == set(pc.quantized_modules)
    assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.bfloat16  # stored dtype kept
    assert isinstance(model.config.quantization_config, hf_integration.QuantpackConfig)
    # each block's q/k/v and gate/up linked for merged decode, as quantpack.load links them
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert [m._merged[1] for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)] == [0, 1, 2, 0, 1]
    ids = prompt_ids(packed_llama)
    loaded = load(packed_llama, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        got = model(**ids).logits
        assert torch.allclose(got, loaded(**ids).logits, rtol=1e-5, atol=1e-5)
        assert rel_err(got, dequantized_source(llama_src, packed_llama)(**ids).logits) <= RTOL
        # existing generation code runs unchanged
        kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(**ids, **kw), loaded.generate(**ids, **kw))


def test_from_pretrained_tied_and_encoder(packed_tied, packed_encoder, encoder_src):
    from transformers import AutoModel, AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(packed_tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and type(tied.lm_head) is torch.nn.Linear
    ids = prompt_ids(packed_tied)
    assert torch.equal(tied(**ids).logits, load(packed_tied, device="cpu")(**ids).logits)

    enc = AutoModel.from_pretrained(packed_encoder, dtype=torch.float32)
    ids = prompt_ids(packed_encoder)
    want = dequantized_source(encoder_src, packed_encoder, AutoModel)(**ids).last_hidden_state
    assert rel_err(enc(**ids).last_hidden_state, want) <= RTOL


def test_from_pretrained_device_map_auto_on_cpu(packed_llama):
    from transformers import AutoModelForCausalLM

    # (on a GPU host, "auto" would fill the GPU first: the memory map offers it none)
    model = AutoModelForCausalLM.from_pretrained(packed_llama, device_map="auto", dtype=torch.float32,
                                                 max_memory={"cpu": "8GiB"})
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"cpu"}
    ids = prompt_ids(packed_llama)
    want = load(packed_llama, device="cpu", dtype=torch.float32)(**ids).logits
    assert torch.allclose(model(**ids).logits, want, rtol=1e-5, atol=1e-5)


def test_registration_is_idempotent_and_round_trips_the_config(packed_llama):
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    hf_integration.register()
    hf_integration.register()
    assert AUTO_QUANTIZER_MAPPING["quantpack"] is hf_integration.QuantpackHfQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantpack"] is hf_integration.QuantpackConfig
    stored = json.loads((packed_llama / "config.json").read_text())["quantization_config"]
    assert hf_integration.QuantpackConfig.from_dict(stored).to_dict() == stored


def test_from_pretrained_refuses_a_mismatched_checkpoint(packed_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    bad = tmp_path / "bad"
    shutil.copytree(packed_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["layout_version"] = 2
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layout_version=2.*upgrade quantpack"):
        AutoModelForCausalLM.from_pretrained(bad)


Q = "model.layers.0.self_attn.q_proj"


def test_from_pretrained_refuses_an_edited_modules_not_converted(packed_llama, tmp_path):
    """A quantized layer listed as not converted would be built as nn.Linear with no stored weight (uninitialised
    memory): refused before any data is read, with the manifest refreshed as an editor would, and without checksums."""
    from transformers import AutoModelForCausalLM

    bad = tmp_path / "bad"
    shutil.copytree(packed_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["modules_not_converted"].append(Q)
    (bad / "config.json").write_text(json.dumps(config))
    _refresh_manifest(bad)
    for opt_out in (False, True):
        kwargs = {"quantization_config": hf_integration.QuantpackConfig(verify=False)} if opt_out else {}
        with pytest.raises(CheckpointError) as info:
            AutoModelForCausalLM.from_pretrained(bad, **kwargs)
        assert str(info.value).startswith(f"tensor {Q}.")
        assert f"lists {Q} in modules_not_converted" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(not hf_integration.passes_loading_options(),
                    reason="transformers before 5.4 does not pass a quantization_config's loading options on")
def test_from_pretrained_checks_checksums_unless_told_not_to(packed_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    bad = tmp_path / "bad"
    shutil.copytree(packed_llama, bad)
    shard = _flip_data_byte(bad, Q + ".qweight")
    with pytest.raises(CheckpointError, match=rf"^tensor {Q}\.qweight in {shard.name}: its data's sha256 differs"):
        AutoModelForCausalLM.from_pretrained(bad)
    # the opt-out of quantpack.load (verify=False), as a loading option: the headers are intact, so it loads
    with pytest.warns(UserWarning, match="loading attributes"):
        model = AutoModelForCausalLM.from_pretrained(bad, quantization_config=hf_integration.QuantpackConfig(verify=False))
    assert not model.config.quantization_config.verify and "verify" not in model.config.quantization_config.to_dict()
    # a checkpoint cannot switch its own checksums off
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["verify"] = False
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="field 'verify', a loading option that a checkpoint cannot set"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_from_pretrained_of_a_hub_repo_verifies_against_its_manifest(packed_llama, tmp_path, monkeypatch):
    """transformers fetches only the config and shards; the manifest comes into the same snapshot."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from conftest import fill_hub_cache

    cache = tmp_path / "hf-cache"
    fill_hub_cache(cache, "quantpack-tests/packed", packed_llama)
    for key, value in {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = AutoModelForCausalLM.from_pretrained("quantpack-tests/packed", dtype=torch.float32)
    ids = prompt_ids(packed_llama)
    assert torch.equal(model(**ids).logits, load(packed_llama, device="cpu", dtype=torch.float32)(**ids).logits)
    blob = next((cache / "models--quantpack-tests--packed" / "snapshots").glob("*/quantpack.json")).resolve()
    manifest = json.loads(blob.read_text())
    next(iter(manifest["files"]["outputs"].values()))["size"] += 1
    blob.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="quantpack.json says"):
        AutoModelForCausalLM.from_pretrained("quantpack-tests/packed")


def test_save_pretrained_is_refused(packed_tied, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(packed_tied)
    with pytest.raises(ValueError):
        model.save_pretrained(tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# peft LoRA on a frozen quantized base
# --------------------------------------------------------------------------------------------------

def test_gradients_reach_the_inputs_like_the_dequantized_model(packed_llama, llama_src):
    model = load(packed_llama, device="cpu", dtype=torch.float32)
    oracle = dequantized_source(llama_src, packed_llama)
    ids = prompt_ids(packed_llama)["input_ids"]
    grads = []
    for m in (model, oracle):
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        m(inputs_embeds=embeds, labels=ids).loss.backward()
        grads.append(embeds.grad)
    assert grads[0].abs().sum() > 0
    assert rel_err(grads[0], grads[1]) <= RTOL
    for module in model.modules():  # packed weights are buffers: nothing to train there
        if isinstance(module, QuantLinear):
            assert not any(True for _ in module.parameters(recurse=False))


def test_lora_adapters_train_on_the_frozen_quantized_base(packed_llama):
    from peft import get_peft_model

    model = load(packed_llama, device="cpu", dtype=torch.float32)
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith((".qweight", ".scales", ".zeros"))}
    config = peft_integration.lora_config(r=4, lora_alpha=8, lora_dropout=0.0,
                                        target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "QuantLinearLora" and isinstance(q.base_layer, QuantLinear)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    ids = prompt_ids(packed_llama)["input_ids"]
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(12):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        # layer 0's adapter gets a gradient only through the QuantLinear backward of every later layer
        # (lora_B starts at zero, so lora_A's first gradient is zero by construction)
        assert q.lora_B["default"].weight.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert q.lora_A["default"].weight.abs().sum() > 0 and q.lora_B["default"].weight.abs().sum() > 0
    after = {n.replace(".base_layer", ""): b for n, b in peft_model.get_base_model().named_buffers()}
    assert all(torch.equal(after[n], b) for n, b in before.items())
    with pytest.raises(NotImplementedError, match="merging LoRA"):
        peft_model.merge_and_unload()


def test_trainer_accepts_adapters_on_a_loaded_model(packed_llama):
    from peft import get_peft_model
    from transformers.trainer_utils import validate_quantization_for_training

    model = load(packed_llama, device="cpu", dtype=torch.float32)
    assert model.hf_quantizer.is_trainable
    with pytest.raises(ValueError, match="purely quantized"):
        validate_quantization_for_training(model)
    validate_quantization_for_training(get_peft_model(model, peft_integration.lora_config(target_modules=["q_proj"])))


@pytest.mark.gpu
def test_gradients_through_the_transposed_kernel_on_gpu(packed_llama, llama_src):
    model = load(packed_llama, device="cuda", dtype=torch.float32)
    oracle = dequantized_source(llama_src, packed_llama)
    ids = prompt_ids(packed_llama)["input_ids"]
    grads = []
    for m, dev in ((model, "cuda"), (oracle, "cpu")):
        embeds = m.get_input_embeddings()(ids.to(dev)).detach().requires_grad_(True)
        m(inputs_embeds=embeds, labels=ids.to(dev)).loss.backward()
        grads.append(embeds.grad.cpu())
    err = rel_err(grads[0], grads[1])
    print(f"input gradient through the fused kernels vs dequantized source (float32): max rel err {err:.2e}")
    assert grads[0].abs().sum() > 0 and err <= 1e-2
