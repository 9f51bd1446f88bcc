"""``quantpack tune`` / ``quantpack.tune.tune``: every layer shape of a packed model timed once per batch-size bucket
ahead of use, merged stacks included, and kept in the machine's config cache. On the CPU the kernels run in Triton's
interpreter and the timer is scripted (the GPU timing itself is covered by the autotuner's GPU tests)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from quantpack.cli import cli
from quantpack.kernels import KernelConfig
from quantpack.modules.linear import QuantLinear
from quantpack.tune import parse_batch_sizes, tune
from quantpack.convert import convert
from quantpack.tiny import make_tiny_llama
from oracles import pretend_device, scripted_gpu_timing, mm_mod as MM, configs_mod  # tests/oracles.py

MERGED = importlib.import_module("quantpack.kernels.merged_mm")
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory):
    """A tiny bf16 Llama (hidden 128, 4 heads of which 2 for k/v, MLP 256, 2 layers) converted to 4 bits, group 64."""
    root = tmp_path_factory.mktemp("tune")
    source = make_tiny_llama(root / "llama", dtype=torch.bfloat16, seed=3)
    convert(source, root / "llama-qp4g64", group_size=64, progress=False)
    return root / "llama-qp4g64"


@pytest.fixture
def scripted_tuning(tmp_path, monkeypatch):
    """A CPU standing in for a GPU named "test_gpu" with an empty table: kernels run in the interpreter, one
    candidate per path, a scripted timer; returns the configs each timing ran."""
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(configs_mod, "_tables", {})
    pretend_device(monkeypatch, "test_gpu")
    monkeypatch.setattr(QuantLinear, "backend", "triton")

    def first_use(x2, transposed, bits, n, k):  # (what a GPU answers with QUANTPACK_AUTOTUNE=1)
        return (os.environ.get("QUANTPACK_AUTOTUNE") == "1"
                and MM.config_key(transposed, bits, n, k, x2.shape[0]) not in configs_mod.config_table("test_gpu"))

    monkeypatch.setattr(MM, "tunes_on_first_use", first_use)
    monkeypatch.setattr(MERGED, "tunes_on_first_use", first_use)
    monkeypatch.setattr(MM, "candidate_configs", lambda transposed, m, *args, **kwargs: (
        [KernelConfig("mma", 8, 16, num_warps=1, split=1, num_stages=2)] if m <= 16 else
        [KernelConfig("dot", 32, 64, 32, num_warps=4, num_stages=2)]))
    timed = []
    real_launch = MM.launch

    def recording_launch(*args):
        timed.append(args[12])  # (the config)
        return real_launch(*args)

    monkeypatch.setattr(MM, "launch", recording_launch)
    scripted_gpu_timing(monkeypatch, lambda fn, **kwargs: 1e-3)
    return timed


@interpreter_only
def test_tune_times_each_new_key_once_and_keeps_it_for_later_runs(packed_llama, scripted_tuning, monkeypatch):
    """Batch sizes 1 and 20 on the tiny Llama (q 128 x 128, k/v 64 x 128, o 128 x 128, gate/up 256 x 128, down
    128 x 256): at 1 row the q/k/v and gate/up siblings run merged, so their stacks (256 x 128, 512 x 128) are tuned
    with o and down; at 20 rows (bucket 32) every layer runs alone, so each distinct shape is tuned. The keys go to the
    cache; a second run, as a new process would, reads them back and times nothing."""
    report = tune(packed_llama, batch_sizes=(1, 20), device="cpu", progress=False)
    expected = {MM.config_key(False, 4, n, k, m) for n, k, m in [
        (256, 128, 1), (512, 128, 1), (128, 128, 1), (128, 256, 1),  # stacked q/k/v, stacked gate/up, o, down
        (128, 128, 32), (64, 128, 32), (256, 128, 32), (128, 256, 32)]}  # q and o, k and v, gate and up, down
    assert set(report.tuned) == expected
    assert report.tuned[MM.config_key(False, 4, 256, 128, 1)] == "mma"
    assert report.tuned[MM.config_key(False, 4, 64, 128, 32)] == "dot"
    assert report.layers == 14 and report.batch_sizes == (1, 20) and os.environ.get("QUANTPACK_AUTOTUNE") is None
    cached = json.loads((MM.tuned_cache_path("test_gpu")).read_text())["configs"]
    assert set(cached) == expected and report.cache == str(MM.tuned_cache_path("test_gpu"))

    monkeypatch.setattr(configs_mod, "_tables", {})  # (a new process: the shipped table, then this machine's cache)
    scripted_tuning.clear()
    again = tune(packed_llama, batch_sizes=(1, 20), device="cpu", progress=False)
    assert again.tuned == {} and "already tuned" in again.format_table()
    assert set(scripted_tuning) <= {KernelConfig(**v) for v in cached.values()}  # (only the picks ran)


@interpreter_only
def test_tune_backward_also_times_the_transposed_product(packed_llama, scripted_tuning):
    """``--backward``: a training pass per batch size (forward with gradients, unmerged, then backward) tunes the
    transposed product's keys, x @ W at M rows, for every distinct shape."""
    result = CliRunner().invoke(cli, ["tune", str(packed_llama), "--batch-sizes", "20", "--backward", "--device",
                                      "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    shapes = [(128, 128), (64, 128), (256, 128), (128, 256)]
    assert set(report["tuned"]) == ({MM.config_key(False, 4, n, k, 32) for n, k in shapes}
                                    | {MM.config_key(True, 4, n, k, 32) for n, k in shapes})
    assert report["layers"] == 14 and report["batch_sizes"] == [20]


def test_tune_needs_a_gpu_and_says_so_in_one_line(tmp_path, monkeypatch):
    """Without a CUDA GPU (and off the interpreter) there is nothing to time: a one-line error, exit code 2, nothing
    loaded or written; through CliRunner and as a subprocess."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA GPU"):
        tune(tmp_path, device="cuda", progress=False)
    result = CliRunner().invoke(cli, ["tune", str(tmp_path)])
    assert result.exit_code == 2 and "CUDA GPU" in result.output and len(result.output.strip().splitlines()) == 1
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "quantpack", "tune", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "CUDA GPU" in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text", ["", "0,16", "1,x", "-4"])
def test_bad_batch_sizes_are_one_line_errors(text):
    with pytest.raises(ValueError, match="positive integers"):
        parse_batch_sizes(text)
    result = CliRunner().invoke(cli, ["tune", "model", "--batch-sizes", text])
    assert result.exit_code == 2 and "positive integers" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_batch_sizes_parse():
    assert parse_batch_sizes("1, 16,256") == (1, 16, 256)


@pytest.mark.gpu
def test_tune_on_gpu_times_the_model_for_real_and_a_second_run_times_nothing(packed_llama, tmp_path, monkeypatch):
    """On a GPU, real timings (a few candidates per key, to keep it short): the tiny Llama's shapes, in no shipped
    table, are tuned at 1 and 64 rows (merged stacks at 1; every candidate checked against the reference first), land
    in the cache, and a new process's run times nothing."""
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    monkeypatch.setattr(MM, "candidate_configs", lambda transposed, m, *args, **kwargs: (
        [KernelConfig("mma", 8, 16, num_warps=1, split=1, num_stages=2),
         KernelConfig("mma", 8, 16, num_warps=2, split=2, num_stages=2, rawq=True)] if m <= 16 else
        [KernelConfig("dot", 64, 64, 64, num_warps=4, num_stages=3), KernelConfig("dq")]))
    report = tune(packed_llama, batch_sizes=(1, 64), device="cuda", progress=False)
    assert MM.config_key(False, 4, 256, 128, 1) in report.tuned  # (the q/k/v stack)
    assert MM.config_key(False, 4, 64, 128, 64) in report.tuned  # (k and v alone at 64 rows)
    cached = json.loads(MM.tuned_cache_path(MM.device_key(torch.device("cuda"))).read_text())["configs"]
    assert set(report.tuned) <= set(cached)
    monkeypatch.setattr(configs_mod, "_tables", {})
    monkeypatch.setattr(MM, "sweep", lambda *args, **kwargs: pytest.fail("tuned twice"))
    assert tune(packed_llama, batch_sizes=(1, 64), device="cuda", progress=False).tuned == {}
