"""``--calibration self``: GPTQ calibrated on sequences the model writes itself."""
import json

import torch
from oracles import assert_stored_layer_matches_float_product
from test_gptq import assert_refused, cli_convert, correlated, output_error, spy_shrink

from quantpack.quantization import calibration as cal
from quantpack.convert import convert
from quantpack.quantization.gptq import gptq_quantize
from quantpack.quantization.groupwise import quantize
from quantpack.reference import dequantize
from quantpack.tiny import quiet_transformers


def tiny_model_and_tokenizer(path):
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                cal.load_tokenizer(path))


def test_random_sequences_are_deterministic_ordinary_tokens(tiny_llama_dir):
    _, tok = tiny_model_and_tokenizer(tiny_llama_dir)
    ids = cal.ordinary_token_ids(tok, 10_000)
    assert len(ids) == len(tok) - len(set(tok.all_special_ids)) and not set(ids.tolist()) & set(tok.all_special_ids)
    a = cal.random_token_sequences(ids, 6, 9, seed=3, lead=1, tail=2)
    assert a.shape == (6, 9) and (a[:, 0] == 1).all() and (a[:, -1] == 2).all()
    assert torch.isin(a[:, 1:-1], ids).all()
    assert torch.equal(a, cal.random_token_sequences(ids, 6, 9, seed=3, lead=1, tail=2))
    assert not torch.equal(a, cal.random_token_sequences(ids, 6, 9, seed=4, lead=1, tail=2))


def test_sampled_sequences_are_deterministic_and_respect_the_budget(tiny_llama_dir):
    model, tok = tiny_model_and_tokenizer(tiny_llama_dir)
    ids = cal.ordinary_token_ids(tok, model.config.vocab_size)
    rows = []
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    a = cal.sampled_token_sequences(model, ids, 5, 8, seed=7, bos=tok.bos_token_id, batch=2)
    assert a.shape == (5, 8) and (a[:, 0] == tok.bos_token_id).all()
    assert torch.isin(a[:, 1:], ids).all()  # no EOS, padding or other special token: full length
    assert rows and max(rows) == 2  # never more than `batch` sequences at once: the KV cache stays bounded
    assert len(rows) == 3 * (8 - 2)  # three batches, one forward per new token
    assert torch.equal(a, cal.sampled_token_sequences(model, ids, 5, 8, seed=7, bos=tok.bos_token_id, batch=2))
    assert not torch.equal(a, cal.sampled_token_sequences(model, ids, 5, 8, seed=8, bos=tok.bos_token_id, batch=2))
    # the checkpoint's own generation settings (greedy, penalties) do not change what is drawn
    own = model.generation_config
    own.top_k, own.repetition_penalty, own.no_repeat_ngram_size = 1, 50.0, 1
    assert torch.equal(a, cal.sampled_token_sequences(model, ids, 5, 8, seed=7, bos=tok.bos_token_id, batch=2))
    assert model.generation_config is own
    # drawn from the model's own distribution: a model sure of one token writes only that token
    favourite = int(ids[5])

    def sure(module, args, out):
        out[..., favourite] += 100
        return out

    model.lm_head.register_forward_hook(sure)
    b = cal.sampled_token_sequences(model, ids, 4, 8, seed=1, bos=tok.bos_token_id)
    assert (b[:, 2:] == favourite).all()


def test_top_p_samples_from_the_likeliest_tokens_only(tiny_llama_dir):
    """``top_p`` near 0 keeps only the likeliest allowed token: every drawn token is the model's argmax over the
    ordinary tokens given what precedes it; at the default (1) the draws differ from that."""
    model, tok = tiny_model_and_tokenizer(tiny_llama_dir)
    ids = cal.ordinary_token_ids(tok, model.config.vocab_size)

    def argmax_continuation(seqs):
        with torch.no_grad():
            logits = model(seqs).logits[:, 1:-1][..., ids]  # the prediction of each token after the random one
        return ids[logits.argmax(-1)]

    narrow = cal.sampled_token_sequences(model, ids, 4, 10, seed=3, bos=tok.bos_token_id, top_p=1e-6)
    assert torch.equal(narrow[:, 2:], argmax_continuation(narrow))
    full = cal.sampled_token_sequences(model, ids, 4, 10, seed=3, bos=tok.bos_token_id)
    assert not torch.equal(full[:, 2:], argmax_continuation(full))


def test_gptq_on_sampled_inputs_beats_hqq_on_the_real_inputs():
    # A layer fed by a "model" whose inputs share a structure (correlated features, outlier channels): sequences
    # it writes itself stand in for real text; rounding calibrated on them must beat hqq on fresh real inputs.
    w, x_real = correlated(tokens=1024, seed=0)
    _, x_self = correlated(tokens=1024, seed=0)
    x_self = x_self[torch.randperm(1024, generator=torch.Generator().manual_seed(1))][:512]
    pw = gptq_quantize(w, 2 * x_self.t() @ x_self / len(x_self), bits=4, group_size=64)
    hqq = quantize(w, bits=4, group_size=64, method="hqq")
    e_self = output_error(x_real, w, dequantize(pw, torch.float32))
    e_hqq = output_error(x_real, w, dequantize(hqq, torch.float32))
    assert e_self < 0.6 * e_hqq, (e_self, e_hqq)


def test_convert_self_calibration_records_it_round_trips_and_beats_hqq(tiny_llama_dir, tmp_path, monkeypatch):
    from quantpack.verify import verify
    from quantpack.verify.report import describe_quantization

    shrinks = spy_shrink(monkeypatch)
    summary = convert(tiny_llama_dir, tmp_path / "self", group_size=32, calibration="self", calibration_length=32,
                      progress=False)
    assert shrinks == [0.5]  # the Hessian of sampled text shrunk halfway to its diagonal, as recorded
    convert(tiny_llama_dir, tmp_path / "hqq", group_size=32, progress=False)
    manifest = json.loads((tmp_path / "self" / "quantpack.json").read_text())
    got = manifest["settings"]["calibration"]
    assert manifest["settings"]["method"] == "gptq"
    assert got == {"self": True, "seed": 0, "tokens": 128 * 32, "sequences": 128, "sequence_length": 32,
                   "shrink": 0.5}
    assert summary.timings["generate"] > 0 and summary.to_dict()["settings"]["calibration"] == got
    assert "--calibration self" in (tmp_path / "self" / "README.md").read_text()
    assert "written by the model, seed 0" in describe_quantization({"method": "gptq", "calibration": got})
    assert_stored_layer_matches_float_product(tmp_path / "self", "model.layers.1.mlp.down_proj")
    text = cal.BUILTIN_FILE.read_text()
    reports = {m: verify(tmp_path / m, reference=tiny_llama_dir, text=text, device="cpu", context_length=64,
                         max_tokens=1024) for m in ("self", "hqq")}
    assert reports["self"].exit_code == 0, reports["self"].format_table()
    kl = {m: r.to_dict()["end_to_end"]["metrics"]["kl_mean"] for m, r in reports.items()}
    assert kl["self"] < 0.75 * kl["hqq"], kl  # measured 0.60


def test_cli_refuses_self_calibration_where_it_cannot_run(tiny_llama_dir, tiny_encoder_dir, tmp_path):
    out = tmp_path / "out"
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self", "--method", "gptq"),
                   "bert (BertModel) is not one", out)  # without --method, an encoder gets refit instead
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "self", "--method", "refit"),
                   "calibration is used by method 'gptq' only, not method='refit'", out)
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "self", "--scheme", "w8a8"),
                   "calibration does not apply to scheme='w8a8'", out)
    result = cli_convert(tiny_llama_dir, "-o", out, "--calibration", "self", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"]["calibration"]["self"] is True
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_self_calibration_that_does_not_fit_the_device_is_one_line_and_leaves_nothing(tiny_llama_dir, tmp_path,
                                                                                      monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cal, "sampled_token_sequences", out_of_memory)
    out = tmp_path / "out"
    assert_refused(cli_convert(tiny_llama_dir, "-o", out, "--calibration", "self"),
                   "the whole model does not fit in cpu's memory to write its own calibration text; pass "
                   "--calibration FILE", out)


def test_interrupted_self_calibrated_conversion_resumes_to_the_same_bytes(tiny_llama_dir, tmp_path,
                                                                          convert_interrupted):
    kwargs = dict(group_size=32, calibration="self", calibration_length=16, max_shard_size="150KB", progress=False)
    fresh = tmp_path / "fresh"
    convert(tiny_llama_dir, fresh, **kwargs)
    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, at=3, **kwargs)
    summary = convert(tiny_llama_dir, out, **kwargs)
    assert summary.resumed_shards == 2 and summary.num_shards == 3
    files = sorted(p.name for p in fresh.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (fresh / name).read_bytes() == (out / name).read_bytes(), name
