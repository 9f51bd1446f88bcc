"""quantpack.load on tiny real checkpoints converted by quantpack.convert.

The oracle is the *source* model with every converted layer's weight replaced by the reference
dequantization of its packed weight (and every other tensor as the packed checkpoint stores it),
run in float32 on the CPU: the loaded model must give the same logits and the same greedy tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantpack import checkpoint
from quantpack.checkpoint import writer as checkpoint_writer
from quantpack.checkpoint import CheckpointError
from quantpack.convert import convert
from quantpack.loader import load
from quantpack.modules.linear import QuantLinear
from quantpack.tiny import make_tiny_encoder, make_tiny_llama

from oracles import dequantized_source

RTOL = 1e-3


# --------------------------------------------------------------------------------------------------
# fixtures: sources and their packed conversions (built once per session)
# --------------------------------------------------------------------------------------------------

_BUILT: dict[str, Path] = {}


def _once(tmp_path_factory, name: str, build) -> Path:
    """Build a checkpoint once per test session, even when other test modules import these fixtures."""
    if name not in _BUILT:
        _BUILT[name] = build(tmp_path_factory.mktemp(name) / name)
    return _BUILT[name]


def _convert(source: Path, output: Path, **kw) -> Path:
    convert(source, output, progress=False, **kw)
    return output


@pytest.fixture
def llama_src(tmp_path_factory) -> Path:
    """bf16 source, 2 shards, untied lm_head: converted tensors other than the packed layers equal the source's."""
    return _once(tmp_path_factory, "llama", lambda p: make_tiny_llama(p, dtype=torch.bfloat16, seed=3))


@pytest.fixture
def packed_llama(llama_src, tmp_path_factory) -> Path:
    return _once(tmp_path_factory, "llama-qp4g64",
                 lambda p: _convert(llama_src, p, group_size=64))


@pytest.fixture
def packed_tied(tiny_llama_tied_dir, tmp_path_factory) -> Path:
    return _once(tmp_path_factory, "tied-qp4g32",
                 lambda p: _convert(tiny_llama_tied_dir, p, group_size=32))


@pytest.fixture
def packed_mixed(tiny_llama_dir, tmp_path_factory) -> Path:
    """float32 source, per-channel groups along out-features, down_proj at 8 bits, one o_proj left unquantized."""
    return _once(tmp_path_factory, "mixed", lambda p: _convert(
        tiny_llama_dir, p, group_size=None, axis=0, method="rtn", bits_for=["down_proj=8"],
        skip=[r"layers\.1\.self_attn\.o_proj"]))


@pytest.fixture
def encoder_src(tmp_path_factory) -> Path:
    return _once(tmp_path_factory, "encoder", lambda p: make_tiny_encoder(p, dtype=torch.bfloat16, seed=4))


@pytest.fixture
def packed_encoder(encoder_src, tmp_path_factory) -> Path:
    return _once(tmp_path_factory, "encoder-qp8",
                 lambda p: _convert(encoder_src, p, bits=8, group_size=128))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def prompt_ids(path: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok(["Packed weights are read by a fused kernel", "Hello, world!"], return_tensors="pt", padding=True)


# --------------------------------------------------------------------------------------------------
# acceptance: logits and greedy generation match the dequantized source
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["llama", "tied", "mixed"])
def test_logits_match_dequantized_source(case, request, llama_src, tiny_llama_tied_dir, tiny_llama_dir):
    src, packed = {"llama": (llama_src, "packed_llama"), "tied": (tiny_llama_tied_dir, "packed_tied"),
                   "mixed": (tiny_llama_dir, "packed_mixed")}[case]
    packed = request.getfixturevalue(packed)
    model = load(packed, device="cpu", dtype=torch.float32)
    oracle = dequantized_source(src, packed)
    ids = prompt_ids(packed)
    with torch.no_grad():
        got, want = model(**ids).logits, oracle(**ids).logits
    assert got.dtype == torch.float32
    assert rel_err(got, want) <= RTOL


def test_greedy_generation_of_32_tokens_is_identical(packed_llama, llama_src):
    model = load(packed_llama, device="cpu", dtype=torch.float32)
    oracle = dequantized_source(llama_src, packed_llama)
    ids = prompt_ids(packed_llama)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():
        got, want = model.generate(**ids, **kw), oracle.generate(**ids, **kw)
    assert got.shape == (2, ids.input_ids.shape[1] + 32)
    assert torch.equal(got, want)


def test_encoder_with_biases_matches(packed_encoder, encoder_src):
    from transformers import AutoModel, BertModel

    model = load(packed_encoder, device="cpu", dtype=torch.float32)
    assert type(model) is BertModel
    oracle = dequantized_source(encoder_src, packed_encoder, AutoModel)
    ids = prompt_ids(packed_encoder)
    with torch.no_grad():
        got, want = model(**ids), oracle(**ids)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= RTOL
    assert rel_err(got.pooler_output, want.pooler_output) <= RTOL
    dense = model.encoder.layer[0].intermediate.dense
    assert isinstance(dense, QuantLinear) and dense.bits == 8 and dense.bias is not None


def test_structure_follows_the_checkpoint(packed_mixed, packed_tied):
    from transformers import LlamaForCausalLM

    model = load(packed_mixed)
    assert type(model) is LlamaForCausalLM and not model.training
    with checkpoint.PackedCheckpoint(packed_mixed) as pc:
        quantized = set(pc.quantized_modules)
    replaced = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert replaced == quantized and "model.layers.1.self_attn.o_proj" not in replaced
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert (down.bits, q.bits, q.axis, q.group_size) == (8, 4, 0, q.out_features)
    assert type(model.lm_head) is torch.nn.Linear
    # Stored dtypes are kept by default: the converter wrote bfloat16 everywhere.
    assert model.lm_head.weight.dtype == torch.bfloat16 and q.scales.dtype == torch.bfloat16
    assert model.config.quantization_config.quant_method == "quantpack" and model.is_quantized
    assert model.generation_config.max_new_tokens == 16  # generation_config.json was read

    tied = load(packed_tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_dtype_casts_unquantized_weights_only(packed_llama):
    model = load(packed_llama, device="cpu", dtype=torch.float16)
    assert model.lm_head.weight.dtype == torch.float16
    assert model.model.norm.weight.dtype == torch.float16
    q = model.model.layers[0].self_attn.q_proj
    assert q.scales.dtype == torch.bfloat16 and q.qweight.dtype == torch.uint8
    out = model(**prompt_ids(packed_llama)).logits
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_device_maps_on_cpu(packed_llama):
    ids = prompt_ids(packed_llama)
    ref = load(packed_llama, dtype=torch.float32, device="cpu")(**ids).logits
    for device_map in ("auto", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}):
        # (on a GPU host, "auto" would fill the GPU first: the memory map offers it none)
        model = load(packed_llama, dtype=torch.float32, device_map=device_map,
                     max_memory={"cpu": "8GiB"} if device_map == "auto" else None)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert torch.equal(model(**ids).logits, ref)
    with pytest.raises(ValueError, match="device and device_map"):
        load(packed_llama, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="disk offload"):
        load(packed_llama, device_map={"model": "cpu", "lm_head": "disk"})
    with pytest.raises(ValueError, match="dtype="):
        load(packed_llama, dtype="float16")


def test_loads_from_a_hub_repo_id_offline(packed_llama, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from conftest import fill_hub_cache

    cache = tmp_path / "hub"
    fill_hub_cache(cache, "quantpack-tests/tiny-llama-qp4", packed_llama)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ids = prompt_ids(packed_llama)
    model = load("quantpack-tests/tiny-llama-qp4", device="cpu", dtype=torch.float32)
    assert torch.equal(model(**ids).logits, load(packed_llama, device="cpu", dtype=torch.float32)(**ids).logits)
    with pytest.raises(ValueError, match=r"^path_or_repo_id: .*not in the Hugging Face cache"):
        load("quantpack-tests/not-there")


# --------------------------------------------------------------------------------------------------
# loading never materializes the full-precision weights (measured: peak RSS of a fresh process)
# --------------------------------------------------------------------------------------------------

def _write_random_packed(path: Path, *, hidden: int, intermediate: int, layers: int) -> tuple[int, int]:
    """A valid packed Llama checkpoint with random codes, written directly (no source weights needed).
    Returns (bytes of the packed checkpoint's tensors, bytes its linear weights take in float32)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, vocab_size=256,
                         max_position_embeddings=64, tie_word_embeddings=True)
    kv = config.num_key_value_heads * 64
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(256, hidden, generator=g).bfloat16(),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    fp32_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, (n, k) in shapes.items():
            tensors[p + name + ".qweight"] = torch.randint(0, 256, (k // 2, n), dtype=torch.uint8, generator=g)
            tensors[p + name + ".scales"] = torch.full((k // 128, n), 0.01, dtype=torch.bfloat16)
            tensors[p + name + ".zeros"] = torch.full((k // 128, n), 7.5, dtype=torch.bfloat16)
            fp32_bytes += n * k * 4
    path.mkdir(parents=True)
    cfg = config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["quantization_config"] = checkpoint_writer.make_quantization_config(
        bits=4, group_size=128, axis=1, method="rtn", modules_not_converted=[], bits_overrides={}, version="test")
    checkpoint_writer.write_json(path / "config.json", cfg)
    shard = checkpoint_writer.shard_name(1, 1)
    checkpoint_writer.write_safetensors(path / shard, tensors, checkpoint.SHARD_METADATA, fsync=False)
    packed_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = checkpoint_writer.make_index({k: shard for k in tensors}, packed_bytes)
    checkpoint_writer.write_json(path / checkpoint.SAFE_INDEX_NAME, index)
    return packed_bytes, fp32_bytes


PEAK_RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch, transformers, accelerate, quantpack.loader  # imports before the measurement

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    transformers.LlamaForCausalLM, transformers.GenerationConfig  # import the model code (~170 MB) first
    torch.ones(1) @ torch.ones(1)
    try:  # reset the peak (VmHWM) to the current RSS, where the kernel allows it
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    before, hwm_before = rss("VmRSS:"), rss("VmHWM:")
    model = quantpack.loader.load(sys.argv[1], device="cpu", verify=False)
    peak = rss("VmHWM:")
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    print(json.dumps({"before": before, "hwm_before": hwm_before, "peak": peak, "held": held}))
""")


def test_loading_never_allocates_the_full_precision_weights(tmp_path):
    # ~100M linear parameters: 400 MB in float32, 200 MB in bf16, ~52 MB packed.
    packed_bytes, fp32_bytes = _write_random_packed(tmp_path / "big", hidden=1024, intermediate=4096, layers=6)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(tmp_path / "big")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    baseline = max(m["before"], m["hwm_before"]) if m["hwm_before"] > m["before"] + (64 << 20) else m["before"]
    grew = m["peak"] - baseline
    assert m["held"] == packed_bytes  # the model holds exactly the packed tensors
    # The loaded tensors, plus at most one tensor in flight and allocator slack; a bf16 copy of the
    # linear weights alone would be 4x the packed size.
    assert grew < 1.5 * packed_bytes + (40 << 20), m
    assert grew < fp32_bytes / 2 / 2, m
    print(f"peak RSS growth while loading: {grew / 2**20:.0f} MiB; packed tensors {packed_bytes / 2**20:.0f} MiB; "
          f"linear weights in bf16 {fp32_bytes / 2 / 2**20:.0f} MiB")


# --------------------------------------------------------------------------------------------------
# files that do not match their config / index / manifest fail, naming the tensor or file
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def broken(packed_llama, tmp_path):
    """A private copy of the packed checkpoint to damage."""
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(packed_llama, dst)
    return dst


def _shard_of(path: Path, tensor: str) -> Path:
    index = json.loads((path / checkpoint.SAFE_INDEX_NAME).read_text())
    return path / index["weight_map"][tensor]


def _rewrite_shard(path: Path, tensor: str, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to the shard holding ``tensor``; keep the index and the manifest
    consistent with the new file, so only the deliberate mismatch remains."""
    shard = _shard_of(path, tensor)
    infos, meta = checkpoint.read_safetensors_header(shard)
    tensors = edit({n: checkpoint.read_tensor(i) for n, i in infos.items()})
    sha, size = checkpoint_writer.write_safetensors(shard, tensors, meta, fsync=False)
    index = json.loads((path / checkpoint.SAFE_INDEX_NAME).read_text())
    others = {n: f for n, f in index["weight_map"].items() if f != shard.name}
    index["weight_map"] = others | {n: shard.name for n in tensors}
    checkpoint_writer.write_json(path / checkpoint.SAFE_INDEX_NAME, index)
    _refresh_manifest(path)


def _refresh_manifest(path: Path) -> None:
    manifest = checkpoint.read_manifest(path)
    for rel in manifest["files"]["outputs"]:
        f = path / rel
        manifest["files"]["outputs"][rel] = {"sha256": checkpoint.sha256_file(f), "size": f.stat().st_size}
    checkpoint_writer.write_json(path / checkpoint.MANIFEST_NAME, manifest)


def _load_error(path: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as info:
        load(path, **kw)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    return message


Q = "model.layers.0.self_attn.q_proj"


def test_wrong_shape_names_the_tensor(broken):
    _rewrite_shard(broken, Q + ".scales", lambda t: t | {Q + ".scales": torch.cat([t[Q + ".scales"]] * 2)})
    msg = _load_error(broken)
    assert f"tensor {Q}.scales" in msg and "shape [4, 128], expected [2, 128]" in msg


def test_wrong_dtype_names_the_tensor(broken):
    _rewrite_shard(broken, Q + ".qweight", lambda t: t | {Q + ".qweight": t[Q + ".qweight"].view(torch.int8)})
    assert f"tensor {Q}.qweight" in (msg := _load_error(broken)) and "dtype int8, expected uint8" in msg
    _rewrite_shard(broken, Q + ".qweight", lambda t: t | {Q + ".qweight": t[Q + ".qweight"].view(torch.uint8),
                                                          Q + ".zeros": t[Q + ".zeros"].to(torch.int16)})
    assert f"tensor {Q}.zeros" in (msg := _load_error(broken)) and "expected a floating-point dtype" in msg


def _flip_data_byte(path: Path, tensor: str) -> Path:
    """Flip one bit in ``tensor``'s data (same size, headers intact); the shard it is in."""
    shard = _shard_of(path, tensor)
    info = checkpoint.read_safetensors_header(shard)[0][tensor]
    data = bytearray(shard.read_bytes())
    data[info.offset + info.nbytes // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard


def test_checksum_mismatch_names_the_tensor(broken):
    shard = _flip_data_byte(broken, Q + ".qweight")
    msg = _load_error(broken)
    assert msg.startswith(f"tensor {Q}.qweight in {shard.name}: its data's sha256 differs from the one quantpack.json")
    assert load(broken, verify=False) is not None  # the headers are intact: only the checksum catches it


def test_checksum_mismatch_with_a_manifest_without_tensor_digests_names_the_file(broken):
    """Manifests written before per-tensor digests: the whole file is hashed and named."""
    _refresh_manifest(broken)  # rewrites the output entries without per-tensor digests
    shard = _flip_data_byte(broken, Q + ".qweight")
    assert f"file {shard.name}: sha256 differs from quantpack.json" in _load_error(broken)


def test_tensor_missing_from_the_manifest_record(broken):
    shard = _shard_of(broken, Q + ".qweight")
    manifest = checkpoint.read_manifest(broken)
    del manifest["files"]["outputs"][shard.name]["tensors"][Q + ".zeros"]
    checkpoint_writer.write_json(broken / checkpoint.MANIFEST_NAME, manifest)
    assert _load_error(broken) == (f"tensor {Q}.zeros in {shard.name}: is in the file but not in quantpack.json; "
                                   f"the file is corrupt or modified: download it again")


def test_verified_load_reads_each_shard_once(packed_llama, monkeypatch):
    """With per-tensor digests no shard is hashed as a whole file: every weight byte is read once
    (config and tokenizer files are still hashed whole)."""
    real = checkpoint.sha256_file
    hashed = []

    def sha256_file(path, *a, **k):
        hashed.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(checkpoint.reading, "sha256_file", sha256_file)
    assert load(packed_llama) is not None
    assert hashed and not [name for name in hashed if name.endswith(".safetensors")]


def test_truncated_shard(broken):
    shard = _shard_of(broken, Q + ".qweight")
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"file {shard.name}" in _load_error(broken)
    assert "truncated" in _load_error(broken, verify=False)


def test_missing_and_unexpected_tensors(broken):
    _rewrite_shard(broken, Q + ".zeros", lambda t: {n: v for n, v in t.items() if n != Q + ".zeros"})
    assert f"tensor {Q}.zeros: missing from the checkpoint" in _load_error(broken)
    _rewrite_shard(broken, Q + ".scales", lambda t: t | {Q + ".zeros": t[Q + ".scales"].clone(),
                                                          "model.extra.weight": torch.zeros(3)})
    assert "tensor model.extra.weight" in (msg := _load_error(broken)) and "not a tensor of LlamaForCausalLM" in msg


def test_index_disagreeing_with_shards(broken):
    index = json.loads((broken / checkpoint.SAFE_INDEX_NAME).read_text())
    index["weight_map"][Q + ".qweight"] = "model-00009-of-00009.safetensors"
    checkpoint_writer.write_json(broken / checkpoint.SAFE_INDEX_NAME, index)
    _refresh_manifest(broken)
    assert "model-00009-of-00009.safetensors" in _load_error(broken)


def test_layout_version_mismatch(broken):
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["layout_version"] = 2
    checkpoint_writer.write_json(broken / "config.json", config)
    _refresh_manifest(broken)
    assert "layout_version=2" in _load_error(broken)
    config["quantization_config"]["layout_version"] = 1
    checkpoint_writer.write_json(broken / "config.json", config)
    shard = _shard_of(broken, Q + ".qweight")
    _rewrite_shard(broken, Q + ".qweight", lambda t: t)  # same tensors ...
    infos, meta = checkpoint.read_safetensors_header(shard)
    checkpoint_writer.write_safetensors(shard, {n: checkpoint.read_tensor(i) for n, i in infos.items()},
                                 meta | {"quantpack_layout_version": "2"}, fsync=False)  # ... other layout version
    _refresh_manifest(broken)
    msg = _load_error(broken)
    assert f"file {shard.name}" in msg and "quantpack_layout_version='2'" in msg


def test_config_disagreeing_with_the_files(broken):
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["modules_not_converted"].append(Q)
    checkpoint_writer.write_json(broken / "config.json", config)
    _refresh_manifest(broken)
    msg = _load_error(broken)
    assert f"tensor {Q}." in msg and "modules_not_converted" in msg
    config["quantization_config"]["modules_not_converted"].remove(Q)
    config["quantization_config"]["bits_overrides"] = {Q: 8}
    checkpoint_writer.write_json(broken / "config.json", config)
    _refresh_manifest(broken)
    msg = _load_error(broken)
    assert f"module {Q}: quantpack.json says bits=4 but quantization_config gives bits=8" in msg
    assert f"tensor {Q}.qweight" in _load_error(broken, verify=False)  # without the manifest: the shape check


def test_not_a_checkpoint(tmp_path, llama_src):
    assert "no config.json" in _load_error(tmp_path)
    assert "no quantization_config" in _load_error(llama_src)


# --------------------------------------------------------------------------------------------------
# GPU: the same checks with the fused kernel
# --------------------------------------------------------------------------------------------------

GPU_RTOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fused_kernel_matches_dequantized_source_on_gpu(packed_llama, llama_src, dtype, monkeypatch):
    import quantpack.reference

    model = load(packed_llama, device="cuda", dtype=dtype)
    assert {b.device.type for b in model.buffers()} == {"cuda"}
    oracle = dequantized_source(llama_src, packed_llama)
    ids = prompt_ids(packed_llama)
    gpu_ids = {k: v.to("cuda") for k, v in ids.items()}  # (BatchEncoding.to moves in place)
    with torch.no_grad():
        want = oracle(**ids).logits
        # the reference path must not run: every quantized layer goes through the Triton kernel
        monkeypatch.setattr(quantpack.reference, "matmul", lambda *a, **k: pytest.fail("reference path ran on GPU"))
        got = model(**gpu_ids).logits.float().cpu()
    err = rel_err(got, want)
    print(f"fused kernel vs dequantized source, {dtype}: max rel err {err:.2e}")
    assert err <= GPU_RTOL[dtype]
    if dtype == torch.float32:
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
        with torch.no_grad():
            assert torch.equal(model.generate(**gpu_ids, **kw).cpu(), oracle.generate(**ids, **kw))


@pytest.mark.gpu
def test_device_map_auto_and_from_pretrained_on_gpu(packed_llama):
    import quantpack.integrations.transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    ids = prompt_ids(packed_llama).to("cuda")
    model = load(packed_llama, device_map="auto", dtype=torch.float16)
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # (over every GPU there is)
    hf = AutoModelForCausalLM.from_pretrained(packed_llama, device_map="cuda", dtype=torch.float16)
    assert hf.model.layers[0].self_attn.q_proj.qweight.is_cuda
    with torch.no_grad():
        want = hf(**ids).logits
        assert torch.allclose(want, model(**ids).logits.to(want.device), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_device_map_across_two_gpus(packed_llama):
    """A device map over two GPUs (accelerate moves activations between them): same logits and greedy
    tokens as on one GPU, for load and for from_pretrained."""
    import quantpack.integrations.transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
             "model.rotary_emb": 1, "lm_head": 1}
    ids = {k: v.to("cuda:0") for k, v in prompt_ids(packed_llama).items()}
    one = load(packed_llama, device="cuda:0", dtype=torch.float16)
    two = load(packed_llama, device_map=split, dtype=torch.float16)
    assert {p.device.index for p in two.parameters()} == {0, 1}
    assert two.model.layers[1].self_attn.q_proj.qweight.device.index == 1
    hf = AutoModelForCausalLM.from_pretrained(packed_llama, device_map=split, dtype=torch.float16)
    assert hf.model.layers[1].mlp.down_proj.qweight.device.index == 1
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with torch.no_grad():
        want = one(**ids).logits
        for model in (two, hf):
            assert torch.allclose(model(**ids).logits.to("cuda:0"), want, rtol=1e-3, atol=1e-3)
            assert torch.equal(model.generate(**ids, **kw).to("cuda:0"), one.generate(**ids, **kw))
