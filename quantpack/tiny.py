"""Tiny but *real* Hugging Face checkpoints, built offline in a second: for tests, demos and docs.

Each builder writes what ``save_pretrained`` writes for a real model (sharded safetensors with an
index, ``config.json``, ``generation_config.json``) plus a real tokenizer trained on a built-in
passage with the ``tokenizers`` library, a chat template (Llama), a LICENSE and a README, so code
that converts or loads a checkpoint sees every kind of file a hub repository has.

    from quantpack.tiny import make_tiny_llama
    make_tiny_llama("tiny-llama")            # 2 layers, hidden 128, 2 shards, float32
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

# A passage to train the tokenizers on: plain English with digits and punctuation.
PASSAGE = """\
Quantization stores each weight of a neural network in a few bits instead of sixteen.
A group of one hundred and twenty-eight weights shares a scale and a zero point, so the
model keeps most of its accuracy while its memory shrinks by a factor of about four.
The quick brown fox jumps over the lazy dog; the lazy dog sleeps in the sun until noon.
Packed weights are read by a fused kernel that unpacks, rescales and multiplies in one pass.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 128 4096 appear in configs, logs and benchmarks.
Hello, world! How are you today? I am fine, thank you. Let us convert a checkpoint.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

LICENSE_TEXT = "Tiny test checkpoint made by quantpack.tiny; random weights, no rights reserved.\n"


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and info logs (while saving, loading a reference...)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (Llama-style special tokens) trained on :data:`PASSAGE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PASSAGE.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _wordpiece_tokenizer(vocab_size: int):
    """A BERT-style WordPiece tokenizer trained on :data:`PASSAGE`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(PASSAGE.splitlines(), trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def _save_sharded(model, path: Path, num_shards: int) -> None:
    """``save_pretrained`` into ``path`` with a ``max_shard_size`` that yields exactly ``num_shards``
    files (a single ``model.safetensors`` when ``num_shards == 1``)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if num_shards == 1:
        with quiet_transformers():
            model.save_pretrained(path, max_shard_size=2 * total + (1 << 20))
        return
    # save_pretrained splits greedily; search a shard size that gives the requested count.
    lo, hi = 1, total
    for _ in range(40):
        size = (lo + hi) // 2
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp, quiet_transformers():
            model.save_pretrained(tmp, max_shard_size=size)
            count = sum(1 for f in os.listdir(tmp) if f.endswith(".safetensors"))
            if count == num_shards:
                for f in os.listdir(tmp):
                    shutil.move(os.path.join(tmp, f), path / f)
                return
        if count > num_shards:
            lo = size + 1
        else:
            hi = size - 1
        if lo > hi:
            break
    raise ValueError(f"num_shards={num_shards}: cannot split this model into that many shards; use fewer shards")


def _fit(model, tokenizer, text: str, steps: int, max_tokens: int) -> None:
    """A few full-batch Adam steps of next-token prediction on ``text`` (in float32)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_tokens - 1]
    batch = torch.tensor([[tokenizer.bos_token_id] + ids])
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.float().train()
    for _ in range(steps):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()


def _write_extras(path: Path, title: str) -> None:
    (path / "LICENSE").write_text(LICENSE_TEXT)
    (path / "README.md").write_text(f"# {title}\n\nA tiny checkpoint with random weights, made by `quantpack.tiny`.\n")


def make_tiny_llama(path, *, num_shards: int = 2, dtype: torch.dtype = torch.float32,
                    tie_word_embeddings: bool = False, seed: int = 0, hidden_size: int = 128,
                    intermediate_size: int = 256, num_hidden_layers: int = 2, num_attention_heads: int = 4,
                    num_key_value_heads: int = 2, vocab_size: int = 320, train_steps: int = 0,
                    train_text: str | None = None, **config_overrides) -> Path:
    """Write a tiny ``LlamaForCausalLM`` checkpoint (random weights, real tokenizer) to ``path``.

    ``train_steps`` > 0 first fits the model for that many Adam steps to ``train_text`` (default
    :data:`PASSAGE`; at most ``max_position_embeddings`` tokens), so that its next-token
    distributions are peaked and accuracy measurements (KL, top-1 agreement) mean something.

    ``num_shards`` > 1 writes ``model-0000i-of-0000n.safetensors`` plus the index; 1 writes a single
    ``model.safetensors``. Extra keyword arguments go to ``LlamaConfig`` (e.g. ``attention_bias=True``).
    Returns ``path``.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _bpe_tokenizer(vocab_size)
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **{"max_position_embeddings": 256, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if train_steps:
        _fit(model, tokenizer, train_text or PASSAGE, train_steps, config.max_position_embeddings)
    model = model.to(dtype).eval()
    _save_sharded(model, path, num_shards)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False,
                     max_new_tokens=16).save_pretrained(path)
    _write_extras(path, "tiny-llama")
    return path


def _build_and_save(model_cls, config, tokenizer, path: Path, *, seed: int, train_steps: int, max_tokens: int,
                    dtype: torch.dtype, num_shards: int, title: str) -> Path:
    """Build ``model_cls(config)`` from ``seed``, optionally fit it to :data:`PASSAGE`, and write it with
    its tokenizer, LICENSE and README to ``path``."""
    torch.manual_seed(seed)
    model = model_cls(config)
    if train_steps:
        _fit(model, tokenizer, PASSAGE, train_steps, max_tokens)
    model = model.to(dtype).eval()
    _save_sharded(model, path, num_shards)
    tokenizer.save_pretrained(path)
    _write_extras(path, title)
    return path


def make_tiny_gpt2(path, *, num_shards: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0,
                   n_embd: int = 128, n_layer: int = 2, n_head: int = 4, vocab_size: int = 320,
                   train_steps: int = 0, **config_overrides) -> Path:
    """Write a tiny ``GPT2LMHeadModel`` checkpoint (byte-level BPE tokenizer) to ``path``: its linear
    layers are transformers' ``Conv1D``, which stores weights (in, out), and ``lm_head`` is tied.
    ``train_steps`` as in :func:`make_tiny_llama`. Returns ``path``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _bpe_tokenizer(vocab_size)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size, n_positions=256,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, **config_overrides)
    return _build_and_save(GPT2LMHeadModel, config, tokenizer, path, seed=seed, train_steps=train_steps,
                           max_tokens=config.n_positions, dtype=dtype, num_shards=num_shards, title="tiny-gpt2")


def make_tiny_mixtral(path, *, num_shards: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0,
                      hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
                      num_local_experts: int = 4, num_experts_per_tok: int = 2, vocab_size: int = 320,
                      train_steps: int = 0, **config_overrides) -> Path:
    """Write a tiny ``MixtralForCausalLM`` checkpoint (byte-level BPE tokenizer) to ``path``: its
    experts are stored one matrix per expert (``block_sparse_moe.experts.<e>.w1``), as on the hub,
    while transformers 5 holds them as 3-D tensors. ``train_steps`` as in :func:`make_tiny_llama`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return make_tiny_moe(path, MixtralConfig, MixtralForCausalLM, num_shards=num_shards, dtype=dtype, seed=seed,
                         vocab_size=vocab_size, train_steps=train_steps, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=num_local_experts,
                         num_experts_per_tok=num_experts_per_tok, max_position_embeddings=256, **config_overrides)


def make_tiny_moe(path, config_cls, model_cls, *, num_shards: int = 1, dtype: torch.dtype = torch.float32,
                  seed: int = 0, vocab_size: int = 320, train_steps: int = 0, **config) -> Path:
    """Write a tiny mixture-of-experts checkpoint of the transformers classes ``config_cls`` / ``model_cls`` (e.g.
    ``OlmoeConfig``, ``OlmoeForCausalLM``; byte-level BPE tokenizer) to ``path``, ``config`` giving its sizes.
    ``save_pretrained`` stores the experts as the hub does (one matrix per expert, undoing transformers' 3-D
    fusion). ``train_steps`` as in :func:`make_tiny_llama`. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _bpe_tokenizer(vocab_size)
    config = config_cls(vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **config)
    return _build_and_save(model_cls, config, tokenizer, path, seed=seed, train_steps=train_steps,
                           max_tokens=getattr(config, "max_position_embeddings", 256), dtype=dtype,
                           num_shards=num_shards, title=f"tiny-{config.model_type}")


def make_tiny_qwen3_moe(path, *, hidden_size: int = 64, moe_intermediate_size: int = 64, num_hidden_layers: int = 2,
                        num_experts: int = 8, num_experts_per_tok: int = 2, **kwargs) -> Path:
    """Write a tiny ``Qwen3MoeForCausalLM`` checkpoint (every layer sparse, normalized top-k, head size 32: vLLM's
    CPU attention takes no smaller) with :func:`make_tiny_moe`; ``kwargs`` as there."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return make_tiny_moe(path, Qwen3MoeConfig, Qwen3MoeForCausalLM, hidden_size=hidden_size,
                         intermediate_size=2 * moe_intermediate_size, moe_intermediate_size=moe_intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
                         **kwargs)


def make_tiny_encoder(path, *, num_shards: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0,
                      hidden_size: int = 128, intermediate_size: int = 256, num_hidden_layers: int = 2,
                      num_attention_heads: int = 4, vocab_size: int = 256, **config_overrides) -> Path:
    """Write a tiny ``BertModel`` checkpoint (random weights, WordPiece tokenizer) to ``path``.

    Its linear layers have biases and it has a pooler, unlike the Llama builder. Returns ``path``.
    """
    from transformers import BertConfig, BertModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _wordpiece_tokenizer(vocab_size)
    config = BertConfig(hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                        vocab_size=vocab_size, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                        **config_overrides)
    torch.manual_seed(seed)
    model = BertModel(config).to(dtype).eval()
    _save_sharded(model, path, num_shards)
    tokenizer.save_pretrained(path)
    _write_extras(path, "tiny-encoder")
    return path



def make_random_checkpoint(path, config, *, dtype: torch.dtype = torch.bfloat16, max_shard_size="5GB",
                           seed: int = 0, std: float = 0.02) -> Path:
    """Write a checkpoint with random weights for ``config`` (a transformers config with
    ``architectures``) shard by shard, without ever building the model in memory.

    Fast at any size (an 8B model in well under a minute): matrices are filled by tiling a fixed
    pool of Gaussian samples from a random offset, 1-D tensors (norms) are ones. Writes
    ``config.json``, ``model-0000i-of-0000n.safetensors`` and the index; no tokenizer.
    """
    import transformers

    from .checkpoint import SHARD_METADATA
    from .sizes import parse_size
    from .checkpoint.writer import make_index, shard_name, write_json, write_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = cls(config)
    params = dict(model.named_parameters(remove_duplicate=True))  # tied weights appear once
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 22, generator=gen) * std).to(dtype)

    def fill(shape) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype)
        numel = 1
        for d in shape:
            numel *= d
        start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        reps = (start + numel + pool.numel() - 1) // pool.numel()
        return pool.repeat(reps)[start:start + numel].reshape(shape) if reps > 1 else \
            pool[start:start + numel].reshape(shape).clone()

    shards, running = [[]], 0
    for name, p in params.items():
        nbytes = p.numel() * dtype.itemsize
        if shards[-1] and running + nbytes > limit:
            shards.append([])
            running = 0
        shards[-1].append((name, tuple(p.shape)))
        running += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = shard_name(i + 1, len(shards))
        tensors = {name: fill(shape) for name, shape in shard}
        write_safetensors(path / fname, tensors, SHARD_METADATA, fsync=False)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    write_json(path / "model.safetensors.index.json", make_index(weight_map, total))
    config.dtype = dtype
    config.save_pretrained(path)
    return path
