"""torch.compile over quantpack's layers.

The fused kernels reach torch.compile as opaque custom ops (``torch.ops.quantpack.mixed_mm`` and
``torch.ops.quantpack.w8a8_linear``: the launchers themselves are not traceable), so a model compiles to one graph
(``fullgraph=True``), gives the eager outputs and input gradients, and transformers' static-cache ``generate``
(which compiles the decode step itself on a GPU) runs on it. In CI the kernels run in Triton's interpreter; the GPU
tests compile with inductor and ``mode="reduce-overhead"`` (CUDA graphs), as transformers does.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from quantpack.kernels.mixed_mm import mixed_mm_op
from quantpack.loader import load
from quantpack.modules.linear import QuantLinear
from quantpack.modules.w8a8 import W8A8Linear
from oracles import MIXED_MM, GraphRecorder
from test_loader import llama_src, packed_llama, prompt_ids, rel_err  # noqa: F401


def _quant_linear(k, n, *, bits=4, group_size=32, axis=1, bias=False, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    layer = QuantLinear.from_linear(lin, bits=bits, group_size=group_size, axis=axis, method="rtn", dtype=dtype)
    layer.backend = "triton"  # (the kernel, in the interpreter on CPU)
    return layer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# the custom ops
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,axis,bias,transposed", [(4, 1, False, False), (4, 1, True, False), (8, 1, True, False),
                                                       (4, 0, False, False), (4, 1, False, True), (8, 1, False, True)])
def test_mixed_mm_op_passes_opcheck(bits, axis, bias, transposed):
    """The op's schema, fake (shape) function, autograd registration and dynamic-shape tracing agree with its
    kernel (torch.library.opcheck runs each against the real call)."""
    layer = _quant_linear(64, 48, bits=bits, group_size=16, axis=axis, bias=bias)
    width = 48 if transposed else 64
    x = torch.randn(3, width, dtype=torch.float16, requires_grad=True)
    args = (x, layer.qweight, layer.scales, layer.zeros, layer.bias, layer.group_size, bits, axis, transposed)
    torch.library.opcheck(mixed_mm_op, args)
    out = mixed_mm_op(*args)
    assert out.shape == (3, 64 if transposed else 48)


@pytest.mark.parametrize("case", ["width", "transposed-bias", "bias-shape", "layout"])
def test_mixed_mm_op_fake_function_rejects_what_the_kernel_rejects(case):
    """Tracing (fake tensors only) already says what is wrong, with the eager call's message."""
    layer = _quant_linear(64, 48, bias=True)
    x = torch.randn(2, 63 if case == "width" else 48 if case == "transposed-bias" else 64, dtype=torch.float16)
    bias = layer.bias[:47] if case == "bias-shape" else layer.bias
    group_size = 24 if case == "layout" else layer.group_size
    args = (layer.qweight, layer.scales, layer.zeros, bias, group_size, 4, 1, case == "transposed-bias")
    with pytest.raises(ValueError) as eager:
        mixed_mm_op(x, *args)
    recorder = GraphRecorder()
    f = torch.compile(lambda x: torch.ops.quantpack.mixed_mm(x, *args), backend=recorder, fullgraph=True)
    with pytest.raises(Exception, match=re.escape(str(eager.value))):
        f(x)
    assert not recorder.graphs  # (raised while tracing, not by the kernel at run time)


def test_w8a8_linear_op_passes_opcheck():
    from quantpack.kernels.w8a8 import w8a8_linear_op

    torch.manual_seed(0)
    layer = W8A8Linear.from_linear(nn.Linear(64, 40, bias=True), dtype=torch.float16)
    x = torch.randn(5, 64, dtype=torch.float16, requires_grad=True)
    args = (x, layer.qweight, layer.weight_scale, layer.bias)
    torch.library.opcheck(w8a8_linear_op, args)
    assert w8a8_linear_op(*args).shape == (5, 40)


# --------------------------------------------------------------------------------------------------
# QuantLinear under torch.compile
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_quant_linear_compiles_to_one_graph_with_the_kernel_op(m, bias):
    layer = _quant_linear(96, 80, bias=bias)
    x = torch.randn(m, 96, dtype=torch.float16)
    recorder = GraphRecorder()
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(x), layer(x)
    assert len(recorder.graphs) == 1 and recorder.count(MIXED_MM) == 1
    assert got.dtype == want.dtype and torch.equal(got, want)  # (the same kernel and config either way)


def test_compiled_mlp_forward_and_input_gradient_match_eager():
    """inductor around the op (fused activation, residual) and the op's backward (the transposed kernel)."""
    torch.manual_seed(1)
    up, down = _quant_linear(64, 96, seed=1), _quant_linear(96, 64, bias=True, seed=2)

    def mlp(x):
        return x + down(torch.nn.functional.silu(up(x)))

    x = torch.randn(2, 5, 64, dtype=torch.float16)
    outs, grads = [], []
    for fn in (mlp, torch.compile(mlp, backend="inductor", fullgraph=True)):
        xr = x.clone().requires_grad_(True)
        out = fn(xr)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append(xr.grad)
    assert grads[0].abs().sum() > 0
    assert rel_err(outs[1], outs[0]) <= 2e-3 and rel_err(grads[1], grads[0]) <= 2e-3


# --------------------------------------------------------------------------------------------------
# a whole model: transformers' static-cache generate on a compiled forward
# --------------------------------------------------------------------------------------------------

def test_compiled_tiny_llama_generates_like_eager(packed_llama, monkeypatch):
    from transformers import CompileConfig

    monkeypatch.setattr(QuantLinear, "backend", "triton")
    model = load(packed_llama, device="cpu", dtype=torch.float32)
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    ids = prompt_ids(packed_llama)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(**ids, **kw, disable_compile=True)
        recorder = GraphRecorder()
        config = CompileConfig(backend=recorder, fullgraph=True)
        config._compile_all_devices = True  # (transformers compiles the decode step itself only on accelerators)
        got = model.generate(**ids, **kw, compile_config=config)
    assert recorder.graphs, "generate did not compile the decode step"
    assert all(sum(n.target in MIXED_MM for n in gm.graph.nodes) == n_quant for gm in recorder.graphs)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------
# GPU: inductor with CUDA graphs (mode="reduce-overhead"), full sizes
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_quant_linear_under_reduce_overhead_matches_eager_on_gpu(m):
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(4096, 4096, device="cuda"), group_size=128, method="rtn",
                                    dtype=torch.bfloat16)
    x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = layer(x)
        for _ in range(3):  # warm-up, CUDA-graph recording, replay
            got = compiled(x).clone()
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_compiled_first_call_builds_its_caches_outside_the_graph_pool(monkeypatch):
    """A process's first kernel call, at decode size, compiled with CUDA graphs: the warm-up run builds the
    `mma`-ordered copy of each weight and the device's split-K counter ring, which must not come from the graph's
    private memory pool (torch refuses a live tensor there that is not an output: a static-cache `generate` whose
    prompt did not already run those paths eagerly failed so)."""
    import importlib

    from quantpack.kernels.caches import mma_copies as _mma_copies

    # (as in a new process: no counter ring yet; the module, not the function `quantpack.kernels.mixed_mm`)
    monkeypatch.setattr(importlib.import_module("quantpack.kernels.caches"), "_counters", {})
    torch.manual_seed(0)
    layers = nn.Sequential(*(QuantLinear.from_linear(nn.Linear(4096, 4096, device="cuda"), group_size=128,
                                                     method="rtn", dtype=torch.bfloat16) for _ in range(2)))
    assert not any(layer.qweight in _mma_copies for layer in layers)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(layers, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        got = [compiled(x).clone() for _ in range(3)]  # warm-up (builds the copies), recording, replay
        want = layers(x)
    assert all(layer.qweight in _mma_copies for layer in layers)
    assert all(torch.equal(g, want) for g in got)


@pytest.mark.gpu
def test_compiled_backward_and_w8a8_match_eager_on_gpu():
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(1024, 2048, device="cuda"), group_size=128, method="rtn",
                                    dtype=torch.bfloat16)
    x = torch.randn(1024, 1024, dtype=torch.bfloat16, device="cuda")
    grads = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        xr = x.clone().requires_grad_(True)
        fn(xr).float().square().sum().backward()
        grads.append(xr.grad)
    assert grads[0].abs().sum() > 0 and rel_err(grads[1], grads[0]) <= 1e-2

    w8 = W8A8Linear.from_linear(nn.Linear(4096, 4096, bias=True, device="cuda"), dtype=torch.bfloat16)
    x8 = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert torch.equal(torch.compile(w8, mode="reduce-overhead", fullgraph=True)(x8), w8(x8))


@pytest.mark.gpu
def test_static_cache_generate_compiles_on_gpu(packed_llama):
    """What ``quantpack.load(..., decode="compile")`` gives on a GPU: transformers compiles the decode step (inductor,
    CUDA graphs) and the tokens are the eager ones."""
    model = load(packed_llama, device="cuda", dtype=torch.float32, decode="compile")
    ids = {k: v.cuda() for k, v in prompt_ids(packed_llama).items()}
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(**ids, **kw, disable_compile=True)
        torch._dynamo.utils.counters.clear()
        got = model.generate(**ids, **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.equal(got, want)
