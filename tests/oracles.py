"""Test oracles shared by the loader and kernel tests (``from oracles import ...``; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from quantpack import checkpoint
from quantpack.modules.linear import linear_dims
from quantpack.modules.experts import PROJECTIONS
from quantpack.quantization.groupwise import quantize
from quantpack.reference import dequantize

# The kernel modules, by name: quantpack.kernels re-exports functions under some of the modules' names (mixed_mm), so
# ``import quantpack.kernels.mixed_mm as m`` would bind the function.
mm_mod = importlib.import_module("quantpack.kernels.mixed_mm")
configs_mod = importlib.import_module("quantpack.kernels.configs")
dispatch_mod = importlib.import_module("quantpack.kernels.dispatch")
caches_mod = importlib.import_module("quantpack.kernels.caches")
launcher_mod = importlib.import_module("quantpack.kernels.launcher")
autotune_mod = importlib.import_module("quantpack.kernels.autotune")


def dequantized_source(src: Path, packed: Path, auto_cls=None):
    """The source model in float32 with the packed checkpoint's weights: converted layers dequantized
    by the reference path (into a Conv1D's (in, out) weight transposed, into an experts block's 3-D
    slot), every other tensor as stored (for a bf16 source: exactly the source's)."""
    from transformers import AutoModelForCausalLM

    model = (auto_cls or AutoModelForCausalLM).from_pretrained(src, dtype=torch.float32).eval()
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with checkpoint.PackedCheckpoint(packed) as pc, torch.no_grad():
        quantized = set(pc.quantized_modules)
        for name in quantized:
            pw, bias = pc.layer(name)
            _place(model, name, dequantize(pw, torch.float32), bias)
        for name in pc.source.tensors:
            if name.rpartition(".")[0] not in quantized:
                params[name].copy_(pc.source.get(name).float())
    return model


def _place(model, name: str, w: torch.Tensor, bias) -> None:
    parent, _, expert = name.rpartition(".")
    block, _, proj = parent.rpartition(".")
    if expert.isdigit() and proj in PROJECTIONS and hasattr(model.get_submodule(block), "gate_up_proj_bias"):
        # gpt-oss: gate_up_proj (E, H, 2I), gate and up interleaved; down_proj (E, I, H); a bias for each
        experts, e = model.get_submodule(block), int(expert)
        if proj == "down_proj":
            experts.down_proj[e].copy_(w.t())
            experts.down_proj_bias[e].copy_(bias.float())
        else:
            cols = slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2)
            experts.gate_up_proj[e][:, cols].copy_(w.t())
            experts.gate_up_proj_bias[e][cols].copy_(bias.float())
        return
    if expert.isdigit() and proj in PROJECTIONS and hasattr(model.get_submodule(block), "expert_dim"):
        # Llama 4: gate_up_proj (E, H, 2I), gate's columns first; down_proj (E, I, H)
        experts, e = model.get_submodule(block), int(expert)
        inter = experts.expert_dim
        {"gate_proj": experts.gate_up_proj[e][:, :inter], "up_proj": experts.gate_up_proj[e][:, inter:],
         "down_proj": experts.down_proj[e]}[proj].copy_(w.t())
        return
    if expert.isdigit() and proj in PROJECTIONS and hasattr(model.get_submodule(block), "gate_up_proj"):
        experts, e = model.get_submodule(block), int(expert)
        inter = experts.intermediate_dim
        {"gate_proj": experts.gate_up_proj[e, :inter], "up_proj": experts.gate_up_proj[e, inter:],
         "down_proj": experts.down_proj[e]}[proj].copy_(w)
        return
    layer = model.get_submodule(name)
    layer.weight.copy_(w.t() if linear_dims(layer)[2] else w)
    if bias is not None:
        layer.bias.copy_(bias.float())


def fused_vs_dequantized(src: Path, packed: Path, model, monkeypatch) -> float:
    """Max relative error of ``model`` (the packed checkpoint loaded on a GPU) against the dequantized
    source, on a short prompt; fails the test if any quantized layer took the reference path."""
    import pytest
    from transformers import AutoTokenizer

    from quantpack import reference

    ids = AutoTokenizer.from_pretrained(packed)("Packed weights are read by a fused kernel", return_tensors="pt")
    with torch.no_grad():
        want = dequantized_source(src, packed)(**ids).logits
        monkeypatch.setattr(reference, "matmul", lambda *a, **k: pytest.fail("reference path ran on GPU"))
        got = model(**{k: v.cuda() for k, v in ids.items()}).logits.float().cpu()
    return ((got - want).abs().max() / want.abs().max()).item()


def packed_weight(n, k, gs, dtype=torch.float16, bits=4, axis=1, seed=0, method="rtn", device=None):
    """A random (N, K) weight quantized group-wise and its float32 dequantized reference, on ``device``
    (the GPU when there is one)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    pw = quantize(torch.randn(n, k, generator=g), bits=bits, group_size=gs, axis=axis, method=method, dtype=dtype)
    return pw.to(device), dequantize(pw, torch.float32).to(device)


def rel_err(out, ref) -> float:
    """Relative Frobenius error of a kernel's output; NaN (an unwritten element of a poisoned output) fails."""
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    return ((out.float() - ref).norm() / ref.norm()).item()


# torch.compile (tests/test_compile.py, tests/modules/test_experts.py)
MIXED_MM = (torch.ops.quantpack.mixed_mm, torch.ops.quantpack.mixed_mm.default)  # (dynamo's graph, aot's)


class GraphRecorder:
    """A torch.compile backend that keeps every FX graph it is given and runs it as traced (no inductor)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs, **options):  # (torch.compile passes a mode to a custom backend)
        self.graphs.append(gm)
        return gm.forward

    def __deepcopy__(self, memo):  # (transformers deep-copies its CompileConfig, backend included)
        return self

    def count(self, targets) -> int:
        return sum(node.target in targets for gm in self.graphs for node in gm.graph.nodes)


def scripted_gpu_timing(monkeypatch, do_bench) -> None:
    """Stand-ins for the autotuner's GPU timing on the CPU: ``do_bench`` (the timer, scripted by the test), and
    CUDA graphs and synchronization that do nothing (the calls the tuner times still run, once, eagerly)."""
    import contextlib

    import triton.testing

    class FakeGraph:
        def replay(self):
            pass

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())


def pretend_device(monkeypatch, key: str, *, capability=None, sms: int = 8, gpu: bool = False) -> None:
    """Decisions (dispatch.py), the autotuner and ``quantpack tune`` see the device of every call as one named ``key``
    (its config table's stem) with this compute capability and SM count; ``gpu=False``: as the interpreter's CPU."""
    import importlib

    from quantpack.kernels.dispatch import DeviceProps

    props = DeviceProps(key, capability, sms, gpu)
    for name in ("dispatch", "autotune", "mixed_mm"):
        monkeypatch.setattr(importlib.import_module(f"quantpack.kernels.{name}"), "device_props", lambda device: props)
    for name in ("configs", "autotune"):
        monkeypatch.setattr(importlib.import_module(f"quantpack.kernels.{name}"), "device_key",
                            lambda device=None: key)


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a packed checkpoint's shards, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
    return tensors


def assert_stored_layer_matches_float_product(packed: Path, layer: str) -> None:
    """``layer``'s stored codes, through the reference path and the kernels (the CUDA-core GEMV at one row, the
    tensor-core tiles at five; on the CPU under TRITON_INTERPRET=1, else on the GPU), give the float32 product of
    its dequantized weight."""
    import json
    import os

    from quantpack import reference
    from quantpack.format import PackedWeight
    from quantpack.kernels import KernelConfig, mixed_mm

    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    qc = json.loads((packed / "config.json").read_text())["quantization_config"]
    t = stored_tensors(packed)
    scales = t[f"{layer}.scales"]
    k = scales.shape[0] * qc["group_size"]
    bits = (qc.get("bits_overrides") or {}).get(layer, qc["bits"])
    pw = PackedWeight(t[f"{layer}.qweight"], scales, t[f"{layer}.zeros"], bits, qc["group_size"], 1,
                      (scales.shape[1], k)).to(dev)
    w = reference.dequantize(pw, torch.float32)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).to(scales.dtype).to(dev)
    want = x.float() @ w.t()
    torch.testing.assert_close(reference.matmul(x, pw).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    for rows, cfg in ((1, KernelConfig("gemv", block_n=32, block_r=16, split=1, num_warps=1)),
                      (5, KernelConfig("dot", block_m=16, block_n=32, block_r=16, split=1))):
        got = mixed_mm(x[:rows], pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=pw.bits,
                       config=cfg, out_dtype=torch.float32)
        assert not torch.isnan(got).any()
        assert float((got - want[:rows]).norm() / want[:rows].norm()) < 1e-2, cfg.path


def random_experts(num_experts, n, k, gs, *, bits=4, dtype=torch.float32, bias=False, seed=0, device=None):
    """A :class:`~quantpack.format.PackedExperts` of ``num_experts`` random (N, K) packed matrices (random codes,
    scales and zeros: no quantizer run, so any size builds fast), on ``device`` (the GPU when there is one)."""
    from quantpack.format import PackedExperts

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    rows = k // 2 if bits == 4 else k
    qweight = torch.randint(0, 256, (num_experts, rows, n), generator=g, dtype=torch.uint8, device=device)
    scales = (torch.rand(num_experts, k // gs, n, generator=g, device=device) * 0.02 + 0.005).to(dtype)
    zeros = (torch.rand(num_experts, k // gs, n, generator=g, device=device) * (2 ** bits - 1)).to(dtype)
    b = torch.randn(num_experts, n, generator=g, device=device).to(dtype) if bias else None
    pe = PackedExperts(qweight, scales, zeros, bits, gs, (n, k), b)
    pe.validate()
    return pe
