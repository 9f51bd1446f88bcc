"""Sources that are broken or hostile: never run a checkpoint's code unasked, never write what the
loader or verify would refuse, and refuse bad files before anything is written (one line, exit 2)."""
import json
import shutil
import time

import pytest
import torch
from click.testing import CliRunner

import quantpack
from quantpack.checkpoint import CheckpointError
from quantpack.cli import cli
from quantpack.convert import convert
from quantpack.verify import verify

from hostile import broken_source, claim_layers

CONFIG_CODE = '''
import os
from transformers import LlamaConfig

with open(os.environ["QP_TEST_MARKER"], "a") as f:  # what a hostile repository could do instead
    f.write("configuration ran\\n")


class FooConfig(LlamaConfig):
    model_type = "qp_test_foo"
'''
MODEL_CODE = '''
from transformers import LlamaForCausalLM

from .configuration_foo import FooConfig


class FooForCausalLM(LlamaForCausalLM):
    config_class = FooConfig
'''


def one_line_failure(result, match):
    """Exit code 2, one ``Error:`` line on stderr naming the problem, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)


@pytest.fixture
def custom_code_src(tiny_llama_dir, tmp_path, monkeypatch):
    """The tiny Llama as a repository with its own code (unknown model_type, auto_map); importing its
    configuration module appends to the marker file. transformers' module cache is the test's own."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    marker = tmp_path / "marker"
    monkeypatch.setenv("QP_TEST_MARKER", str(marker))
    src = shutil.copytree(tiny_llama_dir, tmp_path / "foo-src")
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="qp_test_foo", architectures=["FooForCausalLM"],
                  auto_map={"AutoConfig": "configuration_foo.FooConfig",
                            "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"})
    (src / "config.json").write_text(json.dumps(config))
    (src / "configuration_foo.py").write_text(CONFIG_CODE)
    (src / "modeling_foo.py").write_text(MODEL_CODE)
    return src, marker


def test_custom_code_is_refused_unless_trusted(custom_code_src, tmp_path):
    src, marker = custom_code_src
    out = tmp_path / "out"
    # "y" on stdin: had anything prompted ("Do you wish to run the custom code? [y/N]"), it would answer yes.
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(out), "--method", "rtn"], input="y\n")
    one_line_failure(result, "model_type 'qp_test_foo' needs the repository's own Python code (auto_map); "
                             "pass --trust-remote-code")
    assert not marker.exists() and not out.exists()
    with pytest.raises(CheckpointError, match="trust_remote_code=True"):
        convert(src, out, method="rtn", progress=False)
    assert not marker.exists()

    # Asked for: transformers runs it, and the packed checkpoint builds the repository's class.
    convert(src, out, method="rtn", progress=False, trust_remote_code=True)
    assert "configuration ran" in marker.read_text()
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoConfig"] == "configuration_foo.FooConfig"
    marker.unlink()

    with pytest.raises(CheckpointError, match="needs the repository's own Python code"):
        quantpack.load(out, device="cpu")
    result = CliRunner().invoke(cli, ["verify", str(out), "--no-reference"], input="y\n")
    one_line_failure(result, "pass --trust-remote-code")
    result = CliRunner().invoke(cli, ["verify", str(out), "--reference", str(src), "--device", "cpu"], input="y\n")
    one_line_failure(result, "pass --trust-remote-code")
    assert not marker.exists()

    model = quantpack.load(out, device="cpu", trust_remote_code=True)
    assert type(model).__name__ == "FooForCausalLM"
    result = CliRunner().invoke(cli, ["verify", str(out), "--no-reference", "--trust-remote-code", "--device", "cpu"])
    assert result.exit_code == 0, result.output


def test_auto_map_for_a_model_type_transformers_knows_runs_no_code(custom_code_src, tmp_path):
    """As transformers does without trust_remote_code: its own class for the model type, no prompt."""
    src, marker = custom_code_src
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(out), "--method", "rtn", "--no-progress"],
                                input="y\n")
    assert result.exit_code == 0, result.output
    assert type(quantpack.load(out, device="cpu")).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


def test_unknown_model_type_says_what_is_missing(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "qp_test_bar"}))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(out)])
    one_line_failure(result, "does not know model_type 'qp_test_bar' and the checkpoint ships no code for it")
    assert "upgrade transformers" not in result.output and not out.exists()


# ---------------------------------------------------------------------------------------------- broken sources

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def src(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "src")


def edit_tensors(src, edit):
    """Rewrite every shard of ``src`` with ``edit(name, tensor)`` (None drops the tensor); the index
    keeps listing what it listed, so a dropped tensor stays indexed."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(shard).items():
            t = edit(name, t.clone())
            if t is not None:
                tensors[name] = t
        save_file(tensors, shard, metadata={"format": "pt"})


def drop_from_index(src, name):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def convert_cli(src, out, *args):
    return CliRunner().invoke(cli, ["convert", str(src), "-o", str(out), "--method", "rtn", "--no-progress", *args])


def refused(src, tmp_path, match, *args):
    """Converting ``src`` fails with one line naming the problem, and leaves nothing behind."""
    out = tmp_path / "out"
    one_line_failure(convert_cli(src, out, *args), match)
    assert not out.exists() and not (tmp_path / ".out.qp-partial").exists()


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
                                  "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_refused(src, tmp_path, name):
    edit_tensors(src, lambda n, t: None if n == name else t)
    drop_from_index(src, name)
    refused(src, tmp_path, f"tensor {name} of LlamaForCausalLM is missing from the checkpoint")


def test_indexed_tensor_absent_from_its_shard_is_refused(src, tmp_path):
    edit_tensors(src, lambda n, t: None if n == "model.layers.1.input_layernorm.weight" else t)
    refused(src, tmp_path, "says 'model.layers.1.input_layernorm.weight' is in model-00002-of-00002.safetensors, "
                           "but it is not")


def test_unknown_architecture_is_refused(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSomethingElse"]}))
    refused(src, tmp_path, "architectures names 'LlamaForSomethingElse', which transformers")


@pytest.mark.parametrize("text, match", [("[1, 2]", "holds an array, not a JSON object"),
                                         ('"llama"', "holds a string, not a JSON object"),
                                         ("{not json", "not valid JSON")])
def test_config_not_an_object_is_refused(src, tmp_path, text, match):
    (src / "config.json").write_text(text)
    refused(src, tmp_path, match)
    result = CliRunner().invoke(cli, ["verify", str(src), "--no-reference"])
    one_line_failure(result, match)


def rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header with ``edit(header)``; the data bytes stay as they are."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def overlap_two_tensors(header):
    """Point a tensor at the data of another of the same size (not the last one: the file's end stays)."""
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    last = max(entries, key=lambda k: entries[k]["data_offsets"][1])
    sizes = {}
    for k in sorted(entries):
        size = entries[k]["data_offsets"][1] - entries[k]["data_offsets"][0]
        if size in sizes and last not in (k, sizes[size]):
            entries[k]["data_offsets"] = list(entries[sizes[size]]["data_offsets"])
            return
        sizes[size] = k
    raise AssertionError("no two tensors of one size")


@pytest.mark.parametrize("edit, match", [
    (overlap_two_tensors, "overlaps"),
    (lambda h: h["model.layers.0.input_layernorm.weight"].update(data_offsets=[0, 8]), "do not match its dtype"),
    (lambda h: h["model.layers.0.input_layernorm.weight"].update(data_offsets=[-512, 0]), "do not match its dtype"),
    (lambda h: h["model.layers.0.input_layernorm.weight"].update(data_offsets=[10 ** 12, 10 ** 12 + 512]), "gap"),
])
def test_bad_safetensors_offsets_are_refused(src, tmp_path, edit, match):
    from safetensors import SafetensorError, safe_open

    rewrite_header(src / SHARD1, edit)
    with pytest.raises(SafetensorError):  # what safetensors itself says of the file
        safe_open(src / SHARD1, "pt")
    refused(src, tmp_path, match)


def test_verify_against_a_source_with_bad_offsets_is_one_line(src, tmp_path):
    out = tmp_path / "packed"
    convert(src, out, method="rtn", progress=False)
    rewrite_header(src / SHARD1, overlap_two_tensors)
    result = CliRunner().invoke(cli, ["verify", str(out), "--reference", str(src), "--device", "cpu"])
    one_line_failure(result, "overlaps")


def test_index_paths_outside_the_folder_are_refused(src, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(src / SHARD2, elsewhere / SHARD2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for target in ("../elsewhere/" + SHARD2, str(elsewhere / SHARD2)):
        moved = {k: (target if v == SHARD2 else v) for k, v in index["weight_map"].items()}
        (src / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": moved}))
        refused(src, tmp_path, f"names shard {target!r}, which is not a file name inside")


def test_links_outside_the_folder_are_refused(src, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(src / SHARD2, elsewhere / SHARD2)
    (src / SHARD2).symlink_to(elsewhere / SHARD2)
    refused(src, tmp_path, f"{SHARD2}: leads to {elsewhere / SHARD2}, outside the checkpoint folder")
    (src / SHARD2).unlink()
    shutil.move(elsewhere / SHARD2, src / SHARD2)
    (elsewhere / "secret.txt").write_text("not the model's")
    (src / "notes.txt").symlink_to(elsewhere / "secret.txt")  # would be copied into the output
    refused(src, tmp_path, "notes.txt: leads to")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight",
                                  "model.embed_tokens.weight", "lm_head.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_source_values_are_refused(src, tmp_path, name, value):
    def poison(n, t):
        if n == name:
            t.view(-1)[7] = value
        return t
    edit_tensors(src, poison)
    refused(src, tmp_path, f"tensor {name} in model-0000")
    refused(src, tmp_path, "1 of ")


def strict_json(text):
    """json.loads refusing NaN and Infinity, which JSON does not have."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))


def test_huge_finite_weight_gives_valid_json_or_a_refusal(src, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def huge(n, t):
        if n == name:
            t.view(-1)[3] = 3e38
        return t
    edit_tensors(src, huge)
    out = tmp_path / "out"
    result = convert_cli(src, out, "--json", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    summary = strict_json(result.output)
    layer = next(x for x in summary["layers"] if x["name"] == "model.layers.0.mlp.up_proj")
    assert 0 < layer["rel_error"] < 1
    manifest = strict_json((out / "quantpack.json").read_text())
    assert next(x for x in manifest["layers"] if x["name"] == "model.layers.0.mlp.up_proj")["rel_error"] == \
        layer["rel_error"]
    shutil.rmtree(out)
    refused(src, tmp_path, f"tensor {name}: values up to 3e+38 overflow the float16 scales", "--dtype", "float16")


def test_huge_norm_weight_that_float16_cannot_hold_is_refused(src, tmp_path):
    edit_tensors(src, lambda n, t: t.fill_(1e6) if n == "model.norm.weight" else t)
    refused(src, tmp_path, "tensor model.norm.weight: values up to 1e+06 do not fit in float16", "--dtype", "float16")


def test_write_json_writes_null_for_non_finite_numbers(tmp_path):
    from quantpack.checkpoint.writer import write_json

    write_json(tmp_path / "x.json", {"a": float("nan"), "b": [1.5, float("inf")], "c": (float("-inf"),)})
    assert strict_json((tmp_path / "x.json").read_text()) == {"a": None, "b": [1.5, None], "c": [None]}


# ---------------------------------------------------------------------------------------------- base-model checkpoints


def test_checkpoint_of_the_base_model_under_a_head_name(tiny_encoder_dir, tmp_path):
    """architectures says BertForMaskedLM; the files hold BertModel's weights (no bert. prefix, a pooler),
    as many sentence-embedding checkpoints do. transformers' AutoModel loads them as BertModel."""
    from transformers import AutoModel

    src = shutil.copytree(tiny_encoder_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    out = tmp_path / "out"
    summary = convert(src, out, method="rtn", group_size=32, progress=False)
    assert not any("dropped" in w for w in summary.warnings)
    assert any("converted as BertModel" in w for w in summary.warnings)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    assert "pooler.dense" in {x.name for x in summary.quantized}

    model = quantpack.load(out, device="cpu")
    assert type(model).__name__ == "BertModel"
    reference = AutoModel.from_pretrained(src).eval()
    ids = torch.tensor([[2, 17, 40, 99, 3]])
    with torch.no_grad():
        got, want = model(ids), reference(ids)
    for key in ("last_hidden_state", "pooler_output"):
        cos = torch.nn.functional.cosine_similarity(got[key].flatten().float(), want[key].flatten(), dim=0)
        assert cos > 0.99, key
    report = verify(out, reference=src, device="cpu", max_tokens=64)
    assert report.exit_code == 0, report.format_table()
    assert report.end_to_end["task"] == "encoder"


@pytest.mark.parametrize("kind, match", [
    ("quantization_config_list", "quantization_config is a JSON array, not an object"),
    ("layers_as_string", "field 'num_hidden_layers'"),
    ("eps_nan", "config.json: rms_norm_eps is not a finite number"),
    ("nested_infinity", "config.json: rope_scaling.factor is not a finite number"),
    ("config_is_a_folder", "config.json is a directory, not a file"),
    ("single_file_beside_shards", "holds both model.safetensors and model.safetensors.index.json (transformers "
                                  "reads model.safetensors)"),
    ("metadata_not_strings", "__metadata__ must map names to strings"),
    ("generation_config_not_json", "generation_config.json cannot be read as transformers reads it"),
    ("generation_config_invalid", "generation_config.json cannot be read as transformers reads it"),
    ("tokenizer_garbage", "tokenizer.json cannot be read as transformers reads it"),
])
def test_broken_source_is_one_line_before_anything_is_written(tiny_llama_dir, tmp_path, kind, match):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    broken_source(src, kind)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(out), "--method", "rtn", "--no-progress"])
    one_line_failure(result, match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_single_file_source_whose_weights_file_is_a_folder(tiny_llama_tied_dir, tmp_path):
    src = shutil.copytree(tiny_llama_tied_dir, tmp_path / "src")
    (src / "model.safetensors").unlink()
    broken_source(src, "weights_file_is_a_folder")
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "out")])
    one_line_failure(result, "model.safetensors is a directory, not a file")


def test_a_default_output_name_too_long_for_the_file_system(tiny_llama_dir, tmp_path, monkeypatch):
    src = shutil.copytree(tiny_llama_dir, tmp_path / ("m" * 240))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["convert", str(src), "--method", "rtn"])
    one_line_failure(result, "the default output name (from the source's name)")
    assert "pass a shorter --output" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_verify_refuses_a_reference_of_another_architecture(tiny_llama_dir, tiny_encoder_dir, tmp_path):
    out = tmp_path / "out"
    convert(tiny_llama_dir, out, method="rtn", progress=False)
    result = CliRunner().invoke(cli, ["verify", str(out), "--reference", str(tiny_encoder_dir), "--device", "cpu"])
    one_line_failure(result, "has model_type='bert' but")


def test_verify_refuses_a_reference_the_safetensors_library_rejects(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    convert(tiny_llama_dir, out, method="rtn", progress=False)
    ref = shutil.copytree(tiny_llama_dir, tmp_path / "ref")
    broken_source(ref, "metadata_not_strings")
    result = CliRunner().invoke(cli, ["verify", str(out), "--reference", str(ref), "--device", "cpu"])
    one_line_failure(result, "__metadata__ must map names to strings")


def test_a_config_claiming_far_more_layers_than_stored_is_refused_fast(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    claim_layers(src, 100_000)
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "out"), "--method", "rtn"])
    seconds = time.perf_counter() - t0
    one_line_failure(result, "num_hidden_layers=100000 but the weights hold only 2 layers")
    assert seconds < 10, seconds  # building 100,000 layers first took minutes
