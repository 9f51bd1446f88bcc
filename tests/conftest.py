"""Shared fixtures: tiny real checkpoints (built once per session) and an offline Hugging Face cache.

The session-scoped checkpoint directories are shared by every test: treat them as read-only, and
copy them (``shutil.copytree(tiny_llama_dir, tmp_path / "src")``) before changing anything.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from quantpack.tiny import make_tiny_encoder, make_tiny_llama


@pytest.fixture(autouse=True, scope="session")
def private_kernel_config_cache(tmp_path_factory):
    """Autotuned kernel configs go to a cache the tests own, never the user's ~/.cache/quantpack."""
    old = os.environ.get("QUANTPACK_CACHE_DIR")
    os.environ["QUANTPACK_CACHE_DIR"] = str(tmp_path_factory.mktemp("quantpack-cache"))
    yield
    if old is None:
        os.environ.pop("QUANTPACK_CACHE_DIR", None)
    else:
        os.environ["QUANTPACK_CACHE_DIR"] = old


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output and workspace the fused kernels allocate (launch-plan replays included) starts as NaN (0x7F bytes
    for integers), so an element a kernel never writes fails the comparison."""
    import importlib

    def alloc(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(127)
    monkeypatch.setattr(importlib.import_module("quantpack.kernels.dequant"), "_alloc", alloc)


def _mend_triton_interpreter_for_numpy_2_4() -> None:
    """Triton's interpreter before 3.9 (3.6 is what the GPU image has) turns a loop bound into an int with
    ``int(array of shape (1,))``, which numpy >= 2.4 refuses, so every kernel with a runtime loop bound fails there
    (triton-lang/triton#9171). Apply the upstream fix (squeeze first) for this test session, where it is needed."""
    import inspect

    import numpy as np

    try:
        int(np.zeros(1))
        return  # numpy < 2.4
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "int(self.handle.data)" not in inspect.getsource(patch):
        return  # a Triton with the fix

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _mend_triton_interpreter_for_numpy_2_4()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Tiny LlamaForCausalLM, float32, 2 safetensors shards + index, untied lm_head, real tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    """Tiny Llama with tied embeddings, bfloat16, a single ``model.safetensors``."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tied") / "tiny-llama-tied", num_shards=1,
                           tie_word_embeddings=True, dtype=torch.bfloat16, seed=1)


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory) -> Path:
    """Tiny BertModel (linear layers with biases, a pooler), float32, 2 shards + index, WordPiece tokenizer."""
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny-encoder") / "tiny-encoder")


@dataclass
class HubCache:
    """A Hugging Face hub cache holding ``repo_id`` at ``commit`` (ref ``main``), used offline."""

    cache_dir: Path
    repo_id: str
    commit: str
    env: dict = field(default_factory=dict)  # environment for a subprocess that should see this cache


def fill_hub_cache(cache_dir: Path, repo_id: str, source_dir: Path, *, ref: str = "main") -> str:
    """Lay out ``source_dir`` in ``cache_dir`` exactly as huggingface_hub's cache does (blobs named by
    content hash, snapshot symlinks, ``refs/<ref>``). Returns the fake commit hash."""
    files = sorted(p for p in Path(source_dir).iterdir() if p.is_file())
    commit = hashlib.sha1("".join(p.name for p in files).encode() + repo_id.encode()).hexdigest()
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob_name = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, repo / "blobs" / blob_name)
        (snapshot / p.name).symlink_to(os.path.relpath(repo / "blobs" / blob_name, snapshot))
    (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def hub_cache(tiny_llama_dir, tmp_path, monkeypatch) -> HubCache:
    """``quantpack-tests/tiny-llama`` in a fresh hub cache, with ``HF_HUB_OFFLINE=1`` in this process
    (environment and huggingface_hub's already-read constants) and in ``.env`` for subprocesses."""
    from huggingface_hub import constants

    cache_dir = tmp_path / "hf-cache"
    repo_id = "quantpack-tests/tiny-llama"
    commit = fill_hub_cache(cache_dir, repo_id, tiny_llama_dir)
    env = {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return HubCache(cache_dir=cache_dir, repo_id=repo_id, commit=commit, env={**os.environ, **env})


@pytest.fixture
def convert_interrupted(monkeypatch):
    """``convert(...)`` interrupted (KeyboardInterrupt) as it starts writing output shard ``at``,
    as Ctrl-C would; the partial output stays for a resume."""
    import quantpack.convert.writer as writer
    from quantpack.convert import convert

    def run(*args, at: int = 3, **kwargs):
        real_write = writer.write_safetensors
        calls = []

        def crash(path, *a, **kw):
            calls.append(path)
            if len(calls) == at:
                raise KeyboardInterrupt
            return real_write(path, *a, **kw)

        with monkeypatch.context() as m:
            m.setattr(writer, "write_safetensors", crash)
            with pytest.raises(KeyboardInterrupt):
                convert(*args, **kwargs)
    return run
