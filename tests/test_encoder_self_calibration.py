"""``--calibration`` on an encoder: ``refit`` weighted by the second moments of its inputs, sampled from the vocabulary
(``self``) or cut from a text (a file, ``builtin``)."""
import json
import shutil

import pytest
import torch
from oracles import assert_stored_layer_matches_float_product, stored_tensors
from test_gptq import assert_refused, cli_convert

from quantpack.quantization import calibration as cal
from quantpack.convert import convert
from quantpack.tiny import make_tiny_encoder, quiet_transformers

VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "the", "[unused1]", "cat", "##s", "sat", ",",
         "."]


def bert_tokenizer(vocab=VOCAB):
    from transformers import BertTokenizerFast

    with quiet_transformers():
        return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})


def test_sampler_is_deterministic_and_draws_only_ordinary_tokens():
    tok = bert_tokenizer()
    a = cal.zipf_token_sequences(tok, len(VOCAB), 40, (2, 6), seed=3)
    ids, mask = a["input_ids"], a["attention_mask"]
    assert ids.shape == mask.shape and ids.shape[0] == 40 and ids.shape[1] <= 8
    ordinary = {VOCAB.index(t) for t in ("the", "cat", "##s", "sat", ",", ".")}  # from "the" on, no [unused1]
    lengths = mask.sum(1)
    assert ((lengths >= 4) & (lengths <= 8)).all() and torch.equal(
        mask, (torch.arange(ids.shape[1]) < lengths[:, None]).long())  # a prefix: padding at the end only
    for row, n in zip(ids.tolist(), lengths.tolist()):
        assert row[0] == tok.cls_token_id and row[n - 1] == tok.sep_token_id
        assert set(row[1:n - 1]) <= ordinary and all(t == tok.pad_token_id for t in row[n:])
    body = ids[:, 1:][mask[:, 1:].bool() & (ids[:, 1:] != tok.sep_token_id)]
    counts = torch.bincount(body, minlength=len(VOCAB))
    assert counts[VOCAB.index("the")] > counts[VOCAB.index(".")]  # rank^-1: the first word the most often
    again = cal.zipf_token_sequences(tok, len(VOCAB), 40, (2, 6), seed=3)
    assert all(torch.equal(a[k], again[k]) for k in a)
    assert not torch.equal(ids, cal.zipf_token_sequences(tok, len(VOCAB), 40, (2, 6), seed=4)["input_ids"])
    words = cal.zipf_token_sequences(tok, len(VOCAB), 40, (2, 6), seed=3, words=True)["input_ids"]
    assert not (words == VOCAB.index("##s")).any()
    # ids at or beyond the model's vocab_size (the embedding's rows) are never drawn
    assert cal.zipf_token_sequences(tok, 10, 40, (2, 6), seed=3)["input_ids"].max() < 10
    specials_only = bert_tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"])
    with pytest.raises(ValueError, match="has no ordinary token below the model's vocab_size=6 to sample"):
        cal.zipf_token_sequences(specials_only, 6, 4, (2, 6))


def test_second_moments_leave_padding_out(tiny_encoder_dir):
    from transformers import BertModel

    with quiet_transformers():
        model = BertModel.from_pretrained(tiny_encoder_dir, dtype=torch.float32).eval()
    tok = cal.load_tokenizer(tiny_encoder_dir)
    batch = cal.zipf_token_sequences(tok, model.config.vocab_size, 8, (3, 12), seed=1)
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense", "pooler.dense"]
    got = cal.input_second_moments(model, names, batch)
    assert set(got) == set(names) and all(v.shape == (model.get_submodule(n).in_features,) for n, v in got.items())
    # the query's inputs are the embeddings' output: its unpadded tokens, by hand
    x = model.embeddings(input_ids=batch["input_ids"])[batch["attention_mask"].bool()]
    torch.testing.assert_close(got[names[0]], x.square().mean(0))
    # other ids under the padding change nothing
    noisy = dict(batch, input_ids=torch.where(batch["attention_mask"].bool(), batch["input_ids"], 7))
    for name, v in cal.input_second_moments(model, names, noisy).items():
        torch.testing.assert_close(v, got[name])


def test_second_moments_of_a_function_running_the_model(tiny_encoder_dir):
    from transformers import BertModel

    with quiet_transformers():
        model = BertModel.from_pretrained(tiny_encoder_dir, dtype=torch.float32).eval()
    tok = cal.load_tokenizer(tiny_encoder_dir)
    ids = cal.zipf_token_sequences(tok, model.config.vocab_size, 8, (3, 12), seed=1)["input_ids"][:, :5]  # unpadded
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense"]
    got = cal.input_second_moments(model, names, lambda m: m(**batch).last_hidden_state)
    want = cal.input_second_moments(model, names, batch)
    assert set(got) == set(names) and all(torch.equal(got[n], want[n]) for n in names)


@pytest.fixture(scope="module")
def structured_encoder_dir(tmp_path_factory):
    """The tiny encoder with a few outlier hidden channels (as trained encoders have): the layers reading the
    hidden states see inputs whose second moments differ by two orders of magnitude across features."""
    from transformers import BertModel

    path = make_tiny_encoder(tmp_path_factory.mktemp("structured") / "enc", num_shards=1, seed=2)
    with quiet_transformers():
        model = BertModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for ln in [model.embeddings.LayerNorm, *(layer.output.LayerNorm for layer in model.encoder.layer),
                   *(layer.attention.output.LayerNorm for layer in model.encoder.layer)]:
            ln.weight[:6] *= 12
    with quiet_transformers():
        model.save_pretrained(path)
    return path


def layer_inputs(path, text):
    """Each linear layer's inputs when the source model reads real text."""
    from transformers import BertModel

    with quiet_transformers():
        model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = cal.load_tokenizer(path)
    batch = tok(text.split("\n\n")[:16], padding=True, truncation=True, max_length=64, return_tensors="pt")
    got = {}
    keep = batch["attention_mask"].bool()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, a, name=name: got.__setitem__(
                name, a[0][keep] if a[0].dim() == 3 else a[0]))
    with torch.no_grad():
        model(**batch)
    return model, got


def dequantized(t, name, shape, group_size):
    """The 4-bit layer ``name`` of the stored tensors ``t``, as float32."""
    from quantpack.format import PackedWeight
    from quantpack.reference import dequantize

    return dequantize(PackedWeight(t[f"{name}.qweight"], t[f"{name}.scales"], t[f"{name}.zeros"], bits=4,
                                   group_size=group_size, axis=1, shape=tuple(shape)), torch.float32)


def test_convert_self_on_an_encoder_records_refit_round_trips_and_beats_hqq(structured_encoder_dir, tmp_path):
    from quantpack import load
    from quantpack.verify import verify
    from quantpack.verify.report import describe_quantization

    src = structured_encoder_dir
    kwargs = dict(group_size=32, bits_for=["intermediate=8"], progress=False)
    summary = convert(src, tmp_path / "self", calibration="self", **kwargs)
    convert(src, tmp_path / "hqq", **kwargs)
    manifest = json.loads((tmp_path / "self" / "quantpack.json").read_text())
    got = manifest["settings"]["calibration"]
    assert manifest["settings"]["method"] == "refit" and summary.settings["method"] == "refit"
    assert json.loads((tmp_path / "self" / "config.json").read_text())["quantization_config"]["method"] == "refit"
    assert got["self"] is True and got["seed"] == 0 and got["sampler"] == "zipf" and got["sequences"] == 128
    assert 128 * 10 <= got["tokens"] <= 128 * 66 and got["sequence_length"] <= 66
    assert summary.timings["calibrate"] > 0 and summary.to_dict()["settings"]["calibration"] == got
    card = (tmp_path / "self" / "README.md").read_text()
    assert "--calibration self" in card and "--method" not in card  # the command that reproduces it is accepted
    assert "sampled from the vocabulary (zipf), seed 0" in describe_quantization({"method": "refit",
                                                                                 "calibration": got})
    report = verify(tmp_path / "self", reference=src, device="cpu")
    assert report.exit_code == 0, report.format_table()
    assert report.to_dict()["quantization"]["method"] == "refit"
    with quiet_transformers():
        load(tmp_path / "self", device="cpu")
    for layer in ("encoder.layer.0.attention.self.query", "encoder.layer.1.intermediate.dense"):
        assert_stored_layer_matches_float_product(tmp_path / "self", layer)

    mine, hqq = stored_tensors(tmp_path / "self"), stored_tensors(tmp_path / "hqq")
    model, inputs = layer_inputs(src, cal.BUILTIN_FILE.read_text())
    four = [n for n in inputs if "intermediate" not in n]
    err = {"self": 0.0, "hqq": 0.0}
    for name in four:
        assert not torch.equal(mine[f"{name}.scales"], hqq[f"{name}.scales"]), name  # refit, not hqq
        w, x = model.get_submodule(name).weight.detach().float(), inputs[name]
        for which, t in (("self", mine), ("hqq", hqq)):
            deq = dequantized(t, name, w.shape, 32)
            err[which] += float(((x @ (deq - w).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum())
    assert err["self"] < 0.75 * err["hqq"], err  # measured 0.49
    for name in ("encoder.layer.0.intermediate.dense", "encoder.layer.1.intermediate.dense"):  # 8-bit: hqq's
        for suffix in ("qweight", "scales", "zeros"):
            assert torch.equal(mine[f"{name}.{suffix}"], hqq[f"{name}.{suffix}"]), (name, suffix)


def test_text_windows_for_an_encoder():
    tok = bert_tokenizer()
    text = cal.CalibrationText("the cat sat , the cats sat . " * 3, "builtin", "0" * 64)
    got = cal.encoder_text_sequences(text, tok, 5)
    ids, mask = got["input_ids"], got["attention_mask"]
    body = tok(text.text, add_special_tokens=False)["input_ids"]  # 27 tokens (cats: cat ##s): five windows of 5, 2
    assert len(body) == 27 and ids.shape == (6, 7) and mask.sum(1).tolist() == [7, 7, 7, 7, 7, 4]
    assert ids[:, 0].eq(tok.cls_token_id).all() and ids[5, 3] == tok.sep_token_id and ids[5, 4:].eq(0).all()
    assert sum((row[1:n - 1] for row, n in zip(ids.tolist(), mask.sum(1).tolist())), []) == body
    assert cal.encoder_text_sequences(text, tok, 5, max_sequences=2)["input_ids"].shape == (2, 7)
    with pytest.raises(ValueError, match="^calibration: empty.txt holds no token for the source's tokenizer"):
        cal.encoder_text_sequences(cal.CalibrationText("   ", "empty.txt", "0" * 64), tok, 5)


@pytest.mark.parametrize("source", ["file", "builtin"])
def test_convert_on_an_encoder_with_text_refits_on_it_and_beats_hqq(structured_encoder_dir, tmp_path, source):
    """A user's text (or the built-in passage) calibrates an encoder as ``self`` does: refit weighted by the second
    moments of the layers' inputs on that text, which lowers the layers' output error on it below hqq's."""
    text = cal.BUILTIN_FILE.read_text()
    spec = "builtin"
    if source == "file":
        spec = tmp_path / "text.txt"
        spec.write_text(text)
    src = structured_encoder_dir
    kwargs = dict(group_size=32, bits_for=["intermediate=8"], progress=False)
    summary = convert(src, tmp_path / "text", calibration=str(spec), **kwargs)
    convert(src, tmp_path / "hqq", **kwargs)
    got = json.loads((tmp_path / "text" / "quantpack.json").read_text())["settings"]["calibration"]
    assert summary.settings["method"] == "refit" and got.get("builtin", False) == (source == "builtin")
    assert "self" not in got and got["sha256"] == cal.read_calibration(spec).sha256
    assert got["sequence_length"] == 66 and got["tokens"] > 1000  # windows of 64 tokens between [CLS] and [SEP]
    card = (tmp_path / "text" / "README.md").read_text()
    assert f"--calibration {'FILE' if source == 'file' else 'builtin'}" in card and "--method" not in card

    mine, hqq = stored_tensors(tmp_path / "text"), stored_tensors(tmp_path / "hqq")
    model, inputs = layer_inputs(src, text)
    err = {"text": 0.0, "hqq": 0.0}
    for name in (n for n in inputs if "intermediate" not in n):
        w, x = model.get_submodule(name).weight.detach().float(), inputs[name]
        for which, t in (("text", mine), ("hqq", hqq)):
            deq = dequantized(t, name, w.shape, 32)
            err[which] += float(((x @ (deq - w).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum())
    assert err["text"] < 0.75 * err["hqq"], err


def test_interrupted_encoder_self_conversion_resumes_to_the_same_bytes(tiny_encoder_dir, tmp_path,
                                                                       convert_interrupted):
    kwargs = dict(group_size=32, calibration="self", max_shard_size="100KB", progress=False)
    fresh = tmp_path / "fresh"
    convert(tiny_encoder_dir, fresh, **kwargs)
    out = tmp_path / "out"
    convert_interrupted(tiny_encoder_dir, out, at=3, **kwargs)
    summary = convert(tiny_encoder_dir, out, **kwargs)
    assert summary.resumed_shards == 2 and summary.num_shards >= 3
    files = sorted(p.name for p in fresh.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (fresh / name).read_bytes() == (out / name).read_bytes(), name


def test_cli_refuses_encoder_self_calibration_where_it_cannot_run(tiny_encoder_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    hint = "bert (BertModel) is not one: for an encoder, pass --calibration without --method"
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self", "--method", "gptq"), hint, out)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "builtin", "--method", "gptq"), hint,
                   out)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "builtin", "--bits", "8"),
                   "calibration: builtin refits the 4-bit layers of an encoder", out)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self", "--bits", "8"),
                   "calibration: self refits the 4-bit layers of an encoder", out)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self", "--calibration-length", "2"),
                   "leaves no room between [CLS] and [SEP]", out)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_encoder_dir, bare)
    for f in bare.glob("*token*"):
        f.unlink()
    # transformers then builds a tokenizer of special tokens only: no vocabulary to sample
    assert_refused(cli_convert(bare, "-o", out, "--calibration", "self"),
                   "the tokenizer (BertTokenizer) has no ordinary token below the model's vocab_size=256", out)
    result = cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout)["settings"]
    assert settings["method"] == "refit" and settings["calibration"]["sampler"] == "zipf"
    assert not out.exists() and not list(tmp_path.glob(".out*"))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cal, "input_second_moments", out_of_memory)
    assert_refused(cli_convert(tiny_encoder_dir, "-o", out, "--calibration", "self"),
                   "the whole model does not fit in cpu's memory (float32) to measure its own activations; use "
                   "--method hqq", out)
