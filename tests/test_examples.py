"""The examples run as users run them (subprocesses, CPU) on a tiny converted checkpoint."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpack.loader import load
from test_loader import llama_src, packed_llama  # noqa: F401

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}


def run(*args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("flags", [[], ["--static-cache"]], ids=["dynamic-cache", "static-cache"])
def test_generate_prints_the_greedy_continuation(packed_llama, flags):
    from transformers import AutoTokenizer

    prompt = "The quick brown fox"
    out = run(EXAMPLES / "generate.py", packed_llama, "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu",
              *flags)
    assert out.returncode == 0, out.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(packed_llama)
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        greedy = load(packed_llama, device="cpu").generate(**ids, max_new_tokens=12, do_sample=False,
                                                           pad_token_id=tok.pad_token_id)
    expected = prompt + tok.decode(greedy[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    assert out.stdout.rstrip("\n") == expected
    assert re.search(r"\[\d+ tokens in [\d.]+ s, [\d.]+ tokens/s on cpu\]", out.stderr)


def test_generate_bad_checkpoint_is_one_line_exit_2(tmp_path):
    out = run(EXAMPLES / "generate.py", tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("Error: ") and "config.json" in out.stderr


def test_finetune_lora_loss_falls(packed_llama, tmp_path):
    out = run(EXAMPLES / "finetune_lora.py", packed_llama, "--steps", "6", "--device", "cpu",
              "--output", tmp_path / "adapters")
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.95 * first, out.stdout
    steps = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", out.stdout)]
    assert steps == sorted(steps, reverse=True), out.stdout  # falls at every printed step
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
