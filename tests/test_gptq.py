"""The calibrated method (``--method gptq`` / ``--calibration``): the solver, the block-streamed conversion, its
record in the checkpoint, its memory bound, and every bad calibration input (exit 2, one line, nothing written)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from quantpack.quantization.calibration import BUILTIN_FILE
from quantpack.cli import cli
from quantpack.convert import convert
from quantpack.quantization.gptq import gptq_quantize
from quantpack.quantization.groupwise import quantize
from quantpack.reference import dequantize
from quantpack.tiny import PASSAGE, make_random_checkpoint


def correlated(n=64, k=256, tokens=2048, seed=0):
    """A weight and inputs with correlated features and a few outlier channels, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    mix = torch.randn(k, k, generator=g) * 0.1 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix
    x[:, :4] *= 10
    return w, x


def output_error(x, w, deq):
    return float(((x @ (deq - w).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum())


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 128), (8, 128), (4, None)])
@pytest.mark.parametrize("static_groups,act_order", [(False, False), (True, False), (True, True)])
def test_gptq_lowers_the_layer_output_error_below_hqq(bits, group_size, static_groups, act_order):
    w, x = correlated()
    h = 2 * x.t() @ x / x.shape[0]
    pw = gptq_quantize(w, h, bits=bits, group_size=group_size, static_groups=static_groups, act_order=act_order)
    pw.validate()
    hqq = dequantize(quantize(w, bits=bits, group_size=group_size, method="hqq", dtype=torch.bfloat16), torch.float32)
    assert output_error(x, w, dequantize(pw, torch.float32)) < 0.6 * output_error(x, w, hqq)


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_with_uncorrelated_unit_inputs_is_hqq_exactly(static_groups):
    # H = I: no error to move anywhere, so the codes, scales and zeros are hqq's, bit for bit.
    w, _ = correlated()
    pw = gptq_quantize(w, torch.eye(w.shape[1]), bits=4, group_size=64, static_groups=static_groups, damp=0.0)
    ref = quantize(w, bits=4, group_size=64, method="hqq", dtype=torch.bfloat16)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(pw, name), getattr(ref, name)), name


def test_gptq_rounds_in_act_order_by_default_with_static_groups():
    w, x = correlated()
    h = 2 * x.t() @ x / x.shape[0]

    def codes(**kw):
        return gptq_quantize(w, h, bits=4, group_size=64, **kw).qweight

    assert torch.equal(codes(), codes(static_groups=True, act_order=True))
    assert not torch.equal(codes(), codes(static_groups=True, act_order=False))
    assert torch.equal(codes(static_groups=False), codes(static_groups=False, act_order=False))


def test_gptq_shrinks_the_hessian_towards_its_diagonal():
    w, x = correlated(n=16, k=128, tokens=512)
    h = 2 * x.t() @ x / x.shape[0]
    diag = torch.diag_embed(torch.diag(h))

    def packed(hessian, **kw):
        return gptq_quantize(w, hessian, bits=4, group_size=64, **kw)

    def same(a, b):
        return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("qweight", "scales", "zeros"))

    full = packed(h)
    assert same(packed(h, shrink=0.0), full)
    assert same(packed(h, shrink=1.0), packed(diag))  # no correlation left to compensate along: hqq's rounding
    assert same(packed(h, shrink=1.0), quantize(w, bits=4, group_size=64, method="hqq", dtype=torch.bfloat16))
    half = packed(h, shrink=0.5)
    assert same(half, packed(0.5 * h + 0.5 * diag))
    assert not same(half, full) and not same(half, packed(diag))


@pytest.mark.parametrize("shrink", [-0.1, 1.5, float("nan")])
def test_gptq_refuses_a_shrinkage_outside_0_1(shrink, tmp_path):
    from quantpack.quantization.gptq import quantize_blocks

    w, _ = correlated(n=16, k=128, tokens=8)
    with pytest.raises(ValueError, match=r"^gptq: shrink=.* must lie in \[0, 1\]") as info:
        gptq_quantize(w, torch.eye(128), shrink=shrink)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^gptq: shrink="):  # before building anything or creating the store
        quantize_blocks(None, None, None, {}, torch.zeros(1, 4, dtype=torch.long), store=tmp_path / "store",
                        dtype=torch.bfloat16, device="cpu", shrink=shrink)
    assert not (tmp_path / "store").exists()


def test_gptq_argument_errors():
    w, x = correlated()
    with pytest.raises(ValueError, match="act_order=True needs static_groups=True"):
        gptq_quantize(w, torch.eye(w.shape[1]), act_order=True, static_groups=False)
    with pytest.raises(ValueError, match="does not match in_features=256"):
        gptq_quantize(w, torch.eye(8))


def spy_shrink(monkeypatch) -> list:
    """The Hessian shrinkage of every quantize_blocks call a conversion makes."""
    from quantpack.quantization import gptq

    shrinks, real = [], gptq.quantize_blocks

    def spy(*args, **kwargs):
        shrinks.append(kwargs.get("shrink", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq, "quantize_blocks", spy)
    return shrinks


def test_convert_gptq_records_method_and_calibration_and_beats_hqq(tiny_llama_dir, tmp_path, monkeypatch):
    from quantpack.verify import verify

    shrinks = spy_shrink(monkeypatch)
    summary = convert(tiny_llama_dir, tmp_path / "gptq", group_size=32, calibration="builtin", calibration_length=64,
                      progress=False)
    assert shrinks == [0.0]  # real text: the full Hessian (shrinkage is for text the model writes itself)
    hqq = convert(tiny_llama_dir, tmp_path / "hqq", group_size=32, progress=False)
    manifest = json.loads((tmp_path / "gptq" / "quantpack.json").read_text())
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["method"] == "gptq" and manifest["settings"]["method"] == "gptq"
    cal = manifest["settings"]["calibration"]
    assert cal["sha256"] == hashlib.sha256(BUILTIN_FILE.read_bytes()).hexdigest() and cal["builtin"] is True
    assert cal["sequence_length"] == 64 and cal["tokens"] == cal["sequences"] * 64 > 0 and "shrink" not in cal
    assert not any("gptq" in p.name for p in (tmp_path / "gptq").iterdir())  # the block store is gone
    assert summary.to_dict()["settings"]["calibration"] == cal
    assert len(summary.quantized) == len(hqq.quantized)
    # Kernels and reference path agree on the packed layers; end to end it is closer to the source than hqq.
    text = BUILTIN_FILE.read_text()
    reports = {m: verify(tmp_path / m, reference=tiny_llama_dir, text=text, device="cpu", context_length=64,
                         max_tokens=1024) for m in ("gptq", "hqq")}
    assert reports["gptq"].exit_code == 0, reports["gptq"].format_table()
    kl = {m: r.to_dict()["end_to_end"]["metrics"]["kl_mean"] for m, r in reports.items()}
    assert kl["gptq"] < 0.7 * kl["hqq"], kl


def cli_convert(*args):
    return CliRunner().invoke(cli, ["convert", *map(str, args)])


def assert_refused(result, match, out):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_cli_refuses_bad_calibration_input(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    empty, blank, binary, nul, short = (tmp_path / n for n in ("empty.txt", "blank.txt", "b.bin", "nul.txt", "s.txt"))
    empty.write_bytes(b"")
    blank.write_text(" \n\t\n")
    binary.write_bytes(bytes(range(256)) * 4)
    nul.write_bytes(b"text\x00more text")
    short.write_text("Just a few words.")
    cases = [
        ((tmp_path / "missing.txt",), "does not exist"),
        ((tmp_path,), "is a directory"),
        ((empty,), "is empty"),
        ((blank,), "is empty"),
        ((binary,), "is not UTF-8 text (byte 0x80 at offset 128)"),
        ((nul,), "contains NUL bytes"),
        ((short,), "has 12 tokens but one sequence needs 255 (sequences of 256 tokens, BOS included)"),
        ((short, "--calibration-length", 4), None),
    ]
    for args, match in cases:
        result = cli_convert(tiny_llama_dir, "-o", out, "--calibration", *args)
        if match is None:  # the same text is long enough for sequences of 4 tokens
            assert result.exit_code == 0, result.output
            shutil.rmtree(out)
            continue
        assert_refused(result, match, out)


def test_cli_refuses_calibration_with_other_methods_and_schemes(tiny_llama_dir, tiny_encoder_dir, tmp_path):
    out = tmp_path / "out"
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "builtin", "--scheme", "w8a8"),
                   "calibration does not apply to scheme='w8a8'", out)
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "builtin", "--method", "sinq"),
                   "calibration is used by method 'gptq' only, not method='sinq'", out)
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--method", "gptq"),
                   "method='gptq' needs calibration text", out)
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "builtin", "--axis", "0"),
                   "use axis=1", out)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "builtin", "--method", "gptq"),
                   "bert (BertModel) is not one", out)


def test_gptq_dry_run_checks_the_calibration_and_writes_nothing(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    result = cli_convert(tiny_llama_dir, "-o", out, "--calibration", "builtin", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"]["calibration"]["builtin"] is True
    assert not out.exists() and not list(tmp_path.glob(".out*"))


MEMORY_PROBE = """
import gc, json, sys, threading, time
from quantpack.convert import convert

def anon():
    # Anonymous memory only: the source shards are read through mmap, and the file pages a read touches count in
    # RSS (more of them with more layers) without being memory the converter holds.
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

def peak_while(fn):
    peak, done = [anon()], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.001)
    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], anon())

text, out, warmup, *models = sys.argv[1:]
growth = []
for i, model in enumerate([warmup, *models]):  # the first run warms up imports and the allocator
    gc.collect()
    base = anon()
    growth.append(peak_while(lambda: convert(model, f"{out}-{i}", group_size=64, calibration=text,
                                             calibration_length=32, max_shard_size="1MB", progress=False)) - base)
print(json.dumps(growth[1:]))
"""

@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc memory accounting")
def test_calibrated_conversion_memory_does_not_grow_with_the_layer_count(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig

    models = []
    for layers in (2, 10):
        config = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
                             architectures=["LlamaForCausalLM"])
        path = make_random_checkpoint(tmp_path / f"llama-{layers}", config, dtype=torch.float32, max_shard_size="1MB")
        for f in tiny_llama_dir.glob("tokenizer*"):
            shutil.copy(f, path)
        models.append(path)
    text = tmp_path / "calibration.txt"
    text.write_text(PASSAGE * 2)
    # One thread: small matrices on a shared machine are slower with more (and the peak does not depend on it).
    # glibc's malloc keeps freed heap and raises its mmap threshold as large blocks come and go, so the resident
    # memory of a run that frees every block still creeps up with the block count; with a fixed threshold large
    # tensors are mapped and unmapped, and what is resident is what the converter holds.
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(text), str(tmp_path / "out"), str(tiny_llama_dir),
                             *map(str, models)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert result.returncode == 0, result.stderr
    few, many = json.loads(result.stdout)
    block = (384 * 384 * 2 + 192 * 384 * 2 + 3 * 384 * 1024) * 4  # one float32 block: 6.5 MB
    # Holding the 8 more blocks (weights, or their activations or Hessians) would add 52 MB or more.
    assert many - few < 2 * block, (f"peak anonymous memory grew {few / 2**20:.1f} MiB with 2 layers, "
                                    f"{many / 2**20:.1f} MiB with 10")


def test_interrupted_calibrated_conversion_resumes_to_the_same_bytes(tiny_llama_dir, tmp_path, convert_interrupted):
    kwargs = dict(group_size=32, calibration="builtin", calibration_length=64, max_shard_size="150KB",
                  progress=False)
    fresh = tmp_path / "fresh"
    convert(tiny_llama_dir, fresh, **kwargs)
    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, at=3, **kwargs)
    partial = tmp_path / ".out.qp-partial"
    assert (partial / "gptq-blocks").is_dir() and not out.exists()  # calibrated layers wait there
    summary = convert(tiny_llama_dir, out, **kwargs)
    assert summary.resumed_shards == 2 and summary.num_shards == 3
    assert not partial.exists()
    files = sorted(p.name for p in fresh.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (fresh / name).read_bytes() == (out / name).read_bytes(), name
