"""Merged decode projections (quantpack/modules/merged.py, quantpack/kernels/merged_mm.py).

Oracles: each layer run alone on the same packed weights (the unmerged model), and the float64 product with the
reference dequantization. In CI the kernels run in Triton's interpreter on small shapes; the GPU tests use the
8B model's shapes.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from quantpack import reference
from quantpack.kernels.merged_mm import _merged, merged_mm_op, merged_path
from quantpack.kernels import KernelConfig
from quantpack.kernels.caches import mma_copies
from quantpack.kernels.dispatch import mma_config
from quantpack.kernels.mma_layout import mma_pack
from quantpack.loader import load
from quantpack.modules.linear import QuantLinear
from quantpack.modules.merged import MERGE_MAX_M, merge_projections, unmerge_projections
from oracles import (  # tests/oracles.py
    MIXED_MM, GraphRecorder, pretend_device, scripted_gpu_timing, mm_mod as MIXED_MM_MODULE, configs_mod,
    dispatch_mod, caches_mod, launcher_mod)
from test_loader import llama_src, packed_llama, prompt_ids, rel_err  # noqa: F401

MERGED = {torch.ops.quantpack.merged_mm.default, torch.ops.quantpack.merged_mm}


class Attention(nn.Module):
    """q/k/v reading one input, as transformers' attention blocks call them."""

    def __init__(self, k, outs, *, bits, bias, dtype, device="cpu", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        for name, n in zip(("q_proj", "k_proj", "v_proj"), outs):
            lin = nn.Linear(k, n, bias=bias if name != "k_proj" else False, device=device)  # (k without, as in Qwen)
            setattr(self, name, QuantLinear.from_linear(lin, bits=bits, group_size=64 if k <= 256 else 128,
                                                        method="rtn", dtype=dtype))

    def layers(self):
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(self, x):
        return tuple(layer(x) for layer in self.layers())


class MLP(nn.Module):
    def __init__(self, k, n, *, bits, dtype, device="cpu", seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.gate_proj = QuantLinear.from_linear(nn.Linear(k, n, bias=False, device=device), bits=bits,
                                                 group_size=64 if k <= 256 else 128, method="rtn", dtype=dtype)
        self.up_proj = QuantLinear.from_linear(nn.Linear(k, n, bias=False, device=device), bits=bits,
                                               group_size=64 if k <= 256 else 128, method="rtn", dtype=dtype)

    def layers(self):
        return [self.gate_proj, self.up_proj]

    def forward(self, x):
        return tuple(layer(x) for layer in self.layers())


def _block(kind, *, bits=4, bias=True, dtype=torch.float16, device="cpu"):
    block = (Attention(128, (64, 32, 32), bits=bits, bias=bias, dtype=dtype, device=device) if kind == "qkv"
             else MLP(128, 96, bits=bits, dtype=dtype, device=device))
    for layer in block.layers():
        layer.backend = "triton"  # (the kernel, in the interpreter on CPU)
    return block


def _expected(block, x):
    """Each layer's float64 product with its reference-dequantized weight."""
    return [(x.double() @ reference.dequantize(layer.packed, torch.float64).t()
             + (layer.bias.double() if layer.bias is not None else 0)) for layer in block.layers()]


@pytest.fixture
def mma_launches(monkeypatch):
    """Counts the mma kernel's launches (launch plans off: every call launches through the launcher)."""
    monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", "0")
    caches_mod.mma_self_check(torch.device("cpu"))  # (its own launches, once per process)
    calls = []
    real = launcher_mod.launch_mma_gemv

    def counting(x2, *args, **kw):
        calls.append(x2.shape[0])
        return real(x2, *args, **kw)
    monkeypatch.setattr(launcher_mod, "launch_mma_gemv", counting)
    return calls


# --------------------------------------------------------------------------------------------------
# eager
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,bits,bias", [("qkv", 4, True), ("qkv", 4, False), ("qkv", 8, True), ("mlp", 4, False),
                                            ("mlp", 8, False)])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 4), (3, 5), (16,)])
def test_merged_block_is_one_launch_and_matches_each_layer_alone(kind, bits, bias, lead, mma_launches):
    block = _block(kind, bits=bits, bias=bias)
    x = torch.randn(*lead, 128, dtype=torch.float16)
    with torch.no_grad():
        alone = block(x)
        assert len(mma_launches) == len(block.layers())
        assert merge_projections(block) == 1
        mma_launches.clear()
        got = block(x)
    assert mma_launches == [x.numel() // 128]  # one launch for all the siblings
    assert block.layers()[0]._merged[0]._held is None  # (released by the last sibling)
    for g, a, want, layer in zip(got, alone, _expected(block, x), block.layers()):
        assert g.shape == (*lead, layer.out_features) and g.dtype == torch.float16
        assert rel_err(g, want) <= 2e-3
        assert rel_err(g, a) <= 2e-3


def test_members_mma_copies_become_views_of_the_merged_copy():
    """No weight memory is added: each member's own mma copy (what its separate calls use) is a view of the merged
    copy's rows, equal to the member's own repacking; the launch plans the layers recorded alone, which hold their
    former copies, are dropped."""
    block = _block("qkv")
    layers = block.layers()
    x = torch.randn(1, 128, dtype=torch.float16)
    with torch.no_grad():
        block(x)
        block(x)  # (the call that built a copy records no plan: the next one does)
        assert all(len(layer._plans) for layer in layers)
        merge_projections(block)
        assert not any(len(layer._plans) for layer in layers)
        block(x)
    merged = _merged[layers[0].qweight].mma
    start = 0
    for layer in layers:
        copy = mma_copies[layer.qweight][1]
        assert copy.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
        assert torch.equal(copy, mma_pack(layer.qweight, layer.out_features, layer.in_features))
        assert torch.equal(copy, merged[start:start + layer.out_features // 16])
        start += layer.out_features // 16


def test_merged_weights_are_freed_with_the_layers():
    """The stacked copy is keyed by the first member's weight and must not keep it (or the block) alive."""
    import gc
    import weakref

    block = _block("qkv")
    merge_projections(block)
    with torch.no_grad():
        block(torch.randn(1, 128, dtype=torch.float16))
    qweight = weakref.ref(block.q_proj.qweight)
    merged = weakref.ref(_merged[block.q_proj.qweight].mma)
    del block
    gc.collect()
    assert qweight() is None and merged() is None


@pytest.mark.parametrize("case", ["rows", "float32", "grad", "mma-off"])
def test_calls_the_mma_path_does_not_take_run_each_layer_alone(case, mma_launches, monkeypatch):
    """More than MERGE_MAX_M rows, float32 activations, a backward to come, or the mma path switched off: each layer
    computes alone (on the mma path where it would unmerged), with the unmerged layers' results and input gradient."""
    block = _block("qkv")
    merge_projections(block)
    if case == "mma-off":
        monkeypatch.setenv("QUANTPACK_MMA", "0")
    x = torch.randn(MERGE_MAX_M + 1 if case == "rows" else 2, 128,
                    dtype=torch.float32 if case == "float32" else torch.float16, requires_grad=case == "grad")
    got = block(x)
    if case == "grad":
        sum(g.float().sum() for g in got).backward()
        want_grad = sum(reference.dequantize(layer.packed, torch.float64).sum(0) for layer in block.layers())
        assert rel_err(x.grad, want_grad.expand_as(x)) <= 2e-3
    assert block.q_proj.qweight not in _merged  # never built
    alone_on_mma = [mma_config(x.shape[0], layer.out_features, layer.in_features, layer.group_size, layer.bits,
                               x.device) is not None for layer in block.layers()]
    assert len(mma_launches) == (0 if case in ("float32", "mma-off") else sum(alone_on_mma))
    assert all(rel_err(g.detach(), w) <= 2e-3 for g, w in zip(got, _expected(block, x.detach())))


@pytest.mark.parametrize("qkv, gate_up, k", [(6144, 28672, 4096), (10240, 57344, 8192)], ids=["8B", "70B"])
def test_shipped_hopper_tables_merge_qkv_up_to_16_rows(monkeypatch, qkv, gate_up, k):
    """The shipped Hopper tables give the 8B's and the 70B's stacked q/k/v (6144 x 4096, 10240 x 8192) the mma path
    up to 16 rows, so they merge, and give gate/up (28672 x 4096, 57344 x 8192) wgmma beyond 8 rows, so those run
    alone where captured in a CUDA graph (eager, they merge); 8-bit siblings merge at decode."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(dispatch_mod, "wgmma_device", lambda props, flags: True)
    for key in ("nvidia_h200", "nvidia_h100_80gb_hbm3"):
        pretend_device(monkeypatch, key)
        assert all(merged_path(rows, qkv, k, 128, 4, cpu) for rows in (1, 4, 8, 9, 12, 16)), key
        assert merged_path(8, gate_up, k, 128, 4, cpu) and not merged_path(9, gate_up, k, 128, 4, cpu), key
        assert merged_path(1, qkv, k, 128, 8, cpu) and not merged_path(16, qkv, k, 128, 8, cpu), key
        # outside CUDA-graph capture the launch is the call's time: gate/up merge up to 16 rows too
        assert all(merged_path(rows, gate_up, k, 128, 4, cpu, host_bound=True) for rows in (9, 12, 16)), key


def test_autotune_tunes_the_stacked_shape_over_mma_configs_on_first_use(tmp_path, monkeypatch):
    """With autotuning on, the first merged call of a stacked shape the table lacks times the mma candidates on the
    stacked weight (each checked against the members' reference products first), stores the fastest under the
    stacked shape's key, and runs it. The timer is scripted; the kernels run."""
    merged_module = importlib.import_module("quantpack.kernels.merged_mm")
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", "0")
    monkeypatch.setattr(configs_mod, "_tables", {})
    table = configs_mod.config_table(MIXED_MM_MODULE.device_key(torch.device("cpu")))
    monkeypatch.setattr(merged_module, "tunes_on_first_use",  # (what a GPU would answer)
                        lambda x2, transposed, bits, n, k: MIXED_MM_MODULE.config_key(transposed, bits, n, k,
                                                                                      x2.shape[0]) not in table)
    cands = [KernelConfig("mma", 8, 16, num_warps=1, split=split, num_stages=2) for split in (1, 2)]
    monkeypatch.setattr(MIXED_MM_MODULE, "candidate_configs",
                        lambda *args, **kwargs: cands + [KernelConfig("dot", 16, 64, 32)])
    launched, timed = [], []
    real_launch = MIXED_MM_MODULE.launch

    def recording_launch(x2, qweight, scales, zeros, bias, n, k, axis, group_size, bits, transposed, out_dtype, cfg,
                         *rest):
        launched.append(cfg)
        return real_launch(x2, qweight, scales, zeros, bias, n, k, axis, group_size, bits, transposed, out_dtype, cfg,
                           *rest)

    def fake_do_bench(fn, **kwargs):
        timed.append(launched[-1])
        return {1: 2.0, 2: 1.0}[launched[-1].split] / 1e3

    monkeypatch.setattr(MIXED_MM_MODULE, "launch", recording_launch)
    scripted_gpu_timing(monkeypatch, fake_do_bench)
    block = _block("qkv")
    merge_projections(block)
    x = torch.randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        got = block(x)
    key = MIXED_MM_MODULE.config_key(False, 4, 128, 128, 2)  # (q/k/v stacked: 64 + 32 + 32 out-features)
    assert {c.split for c in timed} == {1, 2} and all(c.path == "mma" for c in timed)
    assert table[key].path == "mma" and table[key].split == 2
    assert launched[-1] == table[key]  # the call itself ran the pick
    assert all(rel_err(g, w) <= 2e-3 for g, w in zip(got, _expected(block, x)))


def test_members_whose_tensors_are_not_buffers_still_merge(mma_launches):
    """The merged call reads members' tensors from their buffers dict (the cheap way); a tensor re-registered as a
    parameter is read as an attribute instead, and the product stays right."""
    block = _block("qkv")
    block.k_proj.scales = nn.Parameter(block.k_proj.scales.clone(), requires_grad=False)
    merge_projections(block)
    x = torch.randn(1, 128, dtype=torch.float16)
    with torch.no_grad():
        got = block(x)
    assert mma_launches == [1]
    assert all(rel_err(g, w) <= 2e-3 for g, w in zip(got, _expected(block, x)))


def test_siblings_called_in_another_order_stop_merging(mma_launches):
    """v, k, then q: the first member's product comes last, so nobody takes the others' columns; the next call
    notices and the block stops merging. Every result is right meanwhile."""
    block = _block("qkv")
    merge_projections(block)
    xs = [torch.randn(1, 128, dtype=torch.float16) for _ in range(3)]
    with torch.no_grad():
        rounds = [[layer(x) for layer in block.layers()[::-1]] for x in xs]
    assert block.q_proj._merged[0].unmerged and block.q_proj._merged[0]._held is None
    assert len(mma_launches) == 9
    assert all(rel_err(g, w) <= 2e-3 for got, x in zip(rounds, xs) for g, w in zip(got, _expected(block, x)[::-1]))


def test_input_modified_in_place_between_siblings_is_multiplied_again():
    block = _block("qkv")
    merge_projections(block)
    x = torch.randn(1, 128, dtype=torch.float16)
    with torch.no_grad():
        q = block.q_proj(x)
        x.mul_(2)
        k, v = block.k_proj(x), block.v_proj(x)
    want_q = _expected(block, x / 2)[0]
    _, want_k, want_v = _expected(block, x)
    assert rel_err(q, want_q) <= 2e-3 and rel_err(k, want_k) <= 2e-3 and rel_err(v, want_v) <= 2e-3


def test_siblings_reading_different_inputs_are_unmerged(mma_launches):
    """Cross-attention shape: q reads one tensor, k and v another. Results stay right; the block then stops
    merging (q would otherwise compute k's and v's columns for nothing on every call)."""
    block = _block("qkv")
    merge_projections(block)
    x1, x2 = (torch.randn(1, 128, dtype=torch.float16) for _ in range(2))
    with torch.no_grad():
        q, k, v = block.q_proj(x1), block.k_proj(x2), block.v_proj(x2)
        assert block.q_proj._merged[0].unmerged
        mma_launches.clear()
        again = block(x1)
    assert len(mma_launches) == 3
    assert rel_err(q, _expected(block, x1)[0]) <= 2e-3
    assert rel_err(k, _expected(block, x2)[1]) <= 2e-3 and rel_err(v, _expected(block, x2)[2]) <= 2e-3
    assert all(rel_err(a, w) <= 2e-3 for a, w in zip(again, _expected(block, x1)))


@pytest.mark.parametrize("change", ["in-place", "reassigned"])
def test_changed_weights_rebuild_the_merged_copy(change):
    block = _block("qkv")
    merge_projections(block)
    x = torch.randn(1, 128, dtype=torch.float16)
    with torch.no_grad():
        block(x)
        layer = block.k_proj
        if change == "in-place":
            layer.qweight.bitwise_xor_(0x5A)
            layer.zeros.add_(1)
        else:
            layer.qweight = layer.qweight.flip(0).contiguous()
            layer.scales = layer.scales * 2
        got = block(x)
    assert all(rel_err(g, w) <= 2e-3 for g, w in zip(got, _expected(block, x)))


@pytest.mark.parametrize("change", [None, "in-place", "reassigned", "moved", "environment", "x's shape"])
def test_identical_eager_calls_replay_the_merged_plan_until_something_changes(change, monkeypatch):
    block = _block("qkv")
    merge_projections(block)
    x = torch.randn(1, 128, dtype=torch.float16)
    link = block.q_proj._merged[0]
    merged_module = importlib.import_module("quantpack.modules.merged")
    with torch.no_grad():
        block(x)  # (builds the stacked copy: no plan)
        block(x)  # (records the plan)
        assert link._replay is not None
        through = []
        real = merged_module.merged_mm
        monkeypatch.setattr(merged_module, "merged_mm", lambda *a, **k: through.append(1) or real(*a, **k))
        if change == "in-place":
            block.k_proj.zeros.add_(1)
        elif change == "reassigned":
            block.v_proj.scales = block.v_proj.scales * 2
        elif change == "moved":  # (new tensors, same values)
            block.to(torch.float16)
            block.q_proj.qweight = block.q_proj.qweight.clone()
        elif change == "environment":
            monkeypatch.setenv("QUANTPACK_MMA", "1")  # (another raw value: decisions are taken again)
        elif change == "x's shape":
            x = torch.randn(3, 128, dtype=torch.float16)
        got = block(x)
    assert through == ([] if change is None else [1])  # the replay, or the full call
    assert all(rel_err(g, w) <= 2e-3 for g, w in zip(got, _expected(block, x)))


def test_unmerge_projections_runs_each_layer_alone(mma_launches):
    block = _block("mlp")
    merge_projections(block)
    unmerge_projections(block)
    with torch.no_grad():
        block(torch.randn(1, 128, dtype=torch.float16))
    assert len(mma_launches) == 2


def test_merge_projections_skips_layers_that_cannot_merge():
    """Other in_features, groups along out-features, out_features not a multiple of 16: left alone."""
    torch.manual_seed(0)

    def make(k, n, **kw):
        return QuantLinear.from_linear(nn.Linear(k, n), method="rtn", **kw)
    for q, k, v in [(make(128, 64, group_size=64), make(192, 64, group_size=64), make(128, 64, group_size=64)),
                    (make(128, 64, group_size=64, axis=0), make(128, 64, group_size=64, axis=0),
                     make(128, 64, group_size=64, axis=0)),
                    (make(128, 64, group_size=64), make(128, 40, group_size=64), make(128, 40, group_size=64))]:
        block = nn.Module()
        block.q_proj, block.k_proj, block.v_proj = q, k, v
        assert merge_projections(block) == 0 and q._merged is None


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_merged_mm_op_passes_opcheck():
    block = _block("qkv")
    layers = block.layers()
    x = torch.randn(3, 128, dtype=torch.float16)
    args = (x, [m.qweight for m in layers], [m.scales for m in layers], [m.zeros for m in layers],
            [m.bias for m in layers], 64, 4)
    # (the op has no autograd: it is only traced where no gradient is wanted, so opcheck's autograd checks do not apply)
    torch.library.opcheck(merged_mm_op, args, test_utils=("test_schema", "test_faketensor"))
    out = merged_mm_op(*args)
    want = torch.cat(_expected(block, x), dim=-1)
    assert out.shape == (3, 128) and rel_err(out, want) <= 2e-3


@pytest.mark.parametrize("mma", ["1", "0"])
def test_compiled_block_traces_one_merged_op(mma, fresh_dynamo, monkeypatch):
    """One merged op where the mma path runs; with it switched off (decided at trace time) each layer's own op."""
    monkeypatch.setenv("QUANTPACK_MMA", mma)
    block = _block("qkv")
    merge_projections(block)
    x = torch.randn(1, 128, dtype=torch.float16)
    recorder = GraphRecorder()
    compiled = torch.compile(block, backend=recorder, fullgraph=True)
    with torch.no_grad():
        got = compiled(x)
    assert (recorder.count(MERGED), recorder.count(MIXED_MM)) == ((1, 0) if mma == "1" else (0, 3))
    assert block.q_proj._merged[0]._held is None
    assert all(rel_err(g, w) <= 2e-3 for g, w in zip(got, _expected(block, x)))


# --------------------------------------------------------------------------------------------------
# a whole model
# --------------------------------------------------------------------------------------------------

def test_loaded_tiny_llama_merges_and_generates_like_unmerged(packed_llama, monkeypatch, fresh_dynamo):
    """quantpack.load merges each layer's q/k/v and gate/up; greedy decoding in float16 (the mma path's dtypes) gives
    the unmerged model's tokens, eager and under transformers' compiled static-cache generate."""
    from transformers import CompileConfig

    monkeypatch.setattr(QuantLinear, "backend", "triton")
    merged = load(packed_llama, device="cpu", dtype=torch.float16)
    alone = load(packed_llama, device="cpu", dtype=torch.float16, merge=False)
    layers = merged.model.layers
    assert all(layer.self_attn.q_proj._merged is not None and layer.mlp.gate_proj._merged is not None
               for layer in layers)
    assert all(m._merged is None for m in alone.modules() if isinstance(m, QuantLinear))
    ids = prompt_ids(packed_llama)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = alone.generate(**ids, **kw, disable_compile=True)
        assert torch.equal(merged.generate(**ids, **kw, disable_compile=True), want)
        assert len(_merged) >= 2 * len(layers)
        recorder = GraphRecorder()
        config = CompileConfig(backend=recorder, fullgraph=True)
        config._compile_all_devices = True  # (transformers compiles the decode step itself only on accelerators)
        got = merged.generate(**ids, **kw, compile_config=config)
    assert recorder.count(MERGED) == 2 * len(layers) * len(recorder.graphs)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------
# GPU: the 8B model's shapes
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merged_8b_shapes_match_each_layer_alone_on_gpu(bits, dtype):
    blocks = [Attention(4096, (4096, 1024, 1024), bits=bits, bias=False, dtype=dtype, device="cuda"),
              MLP(4096, 14336, bits=bits, dtype=dtype, device="cuda")]
    for block in blocks:
        for m in (1, 3, 8, 16):
            x = torch.randn(m, 4096, dtype=dtype, device="cuda")
            unmerge_projections(block)
            with torch.no_grad():
                alone = block(x)
                merge_projections(block)
                got = [block(x) for _ in range(3)]  # first call (builds), recording, replay
            for g in got:
                for a, want, b in zip(g, _expected(block, x), alone):
                    assert rel_err(a, want) <= 1e-2 and rel_err(a, b) <= 1e-2


@pytest.mark.gpu
def test_merged_block_under_reduce_overhead_matches_eager_on_gpu(fresh_dynamo):
    block = Attention(4096, (4096, 1024, 1024), bits=4, bias=True, dtype=torch.bfloat16, device="cuda")
    merge_projections(block)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = block(x)
        for _ in range(3):  # warm-up, CUDA-graph recording, replay
            got = [t.clone() for t in compiled(x)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
def test_merged_autotune_on_gpu_tunes_the_stacked_shape(tmp_path, monkeypatch):
    """QUANTPACK_AUTOTUNE=1 on a real GPU: the first merged call of a q/k/v whose stacked shape (2048 x 1536) no table
    has times mma candidates on the stacked weight (real timings, each checked first), stores an mma pick under the
    stacked key, and every sibling's output is right."""
    monkeypatch.setenv("QUANTPACK_AUTOTUNE", "1")
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    cands = [KernelConfig("mma", 8, 16, num_warps=1, split=1, num_stages=2, rawq=True, k_warps=4),
             KernelConfig("mma", 8, 16, num_warps=2, split=4, num_stages=2, rawq=True),
             KernelConfig("wgmma", 16, 64, 64, split=2, num_warps=4, num_stages=4, rawq=True, producer=True)]
    monkeypatch.setattr(MIXED_MM_MODULE, "candidate_configs", lambda *args, **kwargs: list(cands))
    block = Attention(1536, (1536, 256, 256), bits=4, bias=True, dtype=torch.bfloat16, device="cuda")
    merge_projections(block)
    key = MIXED_MM_MODULE.config_key(False, 4, 2048, 1536, 2)
    x = torch.randn(2, 1536, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = [block(x) for _ in range(3)]
    assert configs_mod.config_table(MIXED_MM_MODULE.device_key(x.device))[key] in cands[:2]
    for g in got:
        assert all(rel_err(a, want) <= 1e-2 for a, want in zip(g, _expected(block, x)))
