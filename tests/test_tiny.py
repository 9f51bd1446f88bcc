"""The tiny checkpoint builders make real, loadable, sharded checkpoints with working tokenizers."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from quantpack.tiny import make_tiny_llama


def _tensor_names(path):
    names = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                names[name] = shard.name
    return names


def test_tiny_llama_is_sharded_with_index_and_tokenizer(tiny_llama_dir):
    files = {p.name for p in tiny_llama_dir.iterdir()}
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "LICENSE",
            "README.md"} <= files
    index = json.loads((tiny_llama_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == _tensor_names(tiny_llama_dir)
    assert "lm_head.weight" in index["weight_map"]  # untied by default


def test_tiny_llama_loads_and_generates(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = tok("Hello, world! Quantization.", return_tensors="pt")
    assert tok.decode(ids.input_ids[0]) == "Hello, world! Quantization."
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.input_ids.shape[1] + 3)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"


def test_tiny_llama_tied_single_file_bf16(tiny_llama_tied_dir):
    assert (tiny_llama_tied_dir / "model.safetensors").exists()
    assert not (tiny_llama_tied_dir / "model.safetensors.index.json").exists()
    names = _tensor_names(tiny_llama_tied_dir)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    with safe_open(tiny_llama_tied_dir / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.bfloat16


def test_tiny_encoder_loads(tiny_encoder_dir):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_encoder_dir)
    model = AutoModel.from_pretrained(tiny_encoder_dir)
    ids = tok("the quick brown fox", return_tensors="pt")
    assert ids.input_ids[0, 0] == tok.cls_token_id and ids.input_ids[0, -1] == tok.sep_token_id
    out = model(**ids)
    assert out.last_hidden_state.shape == (1, ids.input_ids.shape[1], 128)
    assert len(list(tiny_encoder_dir.glob("model-*-of-00002.safetensors"))) == 2


def test_same_seed_same_bytes(tmp_path):
    a = make_tiny_llama(tmp_path / "a", num_shards=3, num_hidden_layers=3, seed=5)
    b = make_tiny_llama(tmp_path / "b", num_shards=3, num_hidden_layers=3, seed=5)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) == 3
    for name in shards:
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_hub_cache_fixture_resolves_offline(hub_cache):
    from huggingface_hub import snapshot_download

    path = snapshot_download(hub_cache.repo_id)
    assert path.endswith(hub_cache.commit)
    assert "model.embed_tokens.weight" in _tensor_names(Path(path))
