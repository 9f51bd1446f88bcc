"""Launch plans (quantpack/kernels/launch_plan.py): a repeated mixed_mm call replays the first one's allocations
and kernel launch. Each replay is checked against the reference and, bit for bit, against the same call without
plans, on every kernel path (interpreter on the CPU; the compiled launch on the GPU), with outputs poisoned with
NaN; then what must make a new plan (other tensors, in-place changes, environment switches, a moved module) and
what must not be planned at all."""
import copy
import io
import os
import weakref

import pytest
import torch

from oracles import packed_weight, rel_err, configs_mod, dispatch_mod, caches_mod  # tests/oracles.py
from quantpack.kernels import KernelConfig, MixedMatmul, mixed_mm
from quantpack.kernels import launch_plan
from quantpack.kernels.launch_plan import Plan, PlanCache, Recording
from quantpack.modules.linear import QuantLinear

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEV = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py; replayed buffers included)
kernels_run = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                 reason="needs TRITON_INTERPRET=1 or a GPU")


@pytest.fixture
def replays(monkeypatch):
    """The rows of x of each plan replay, in order."""
    seen = []
    real = Plan.__call__

    def spy(self, x2):
        seen.append(x2.shape[0])
        return real(self, x2)
    monkeypatch.setattr(Plan, "__call__", spy)
    return seen


def weight(n=96, k=256, gs=128, bits=4, dtype=torch.float16, seed=0):
    return packed_weight(n, k, gs, dtype=dtype, bits=bits, seed=seed, device=DEV)


def call(x, pw, plans=None, **kw):
    return mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=pw.bits, plans=plans, **kw)


CONFIGS = {  # every path a forward call can take, split-K (workspace and counters) included
    "default": None,
    "mma_split": KernelConfig("mma", 16, 16, num_warps=2, split=2, num_stages=2, rawq=True),
    "mma_zero": KernelConfig("mma", 16, 32, num_warps=1, split=1, num_stages=1, rawq=False),
    "gemv_split": KernelConfig("gemv", block_n=32, block_r=16, split=3, num_warps=1),
    "fma_split": KernelConfig("fma", block_m=4, block_n=32, block_r=16, split=2),
    "dot_split": KernelConfig("dot", block_m=16, block_n=32, block_r=16, split=2),
    "dot_t_rawq": KernelConfig("dot_t", block_m=16, block_n=32, block_r=16, split=2, rawq=True),
}


@kernels_run
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_replay_matches_the_reference_and_the_unplanned_call(name, m, bits, replays):
    pw, w = weight(bits=bits)
    bias = torch.randn(96, dtype=torch.float16, device=DEV)
    plans = PlanCache()
    for i in range(3):  # (the first call may build the mma copy: a plan is recorded from the next)
        x = torch.randn(m, 256, dtype=torch.float16, device=DEV)
        out = call(x, pw, plans, config=CONFIGS[name], bias=bias)
        assert rel_err(out, x.float() @ w.t() + bias.float()) < 2e-3, i
        assert torch.equal(out, call(x, pw, config=CONFIGS[name], bias=bias)), i
    assert replays and set(replays) == {m}
    assert len(plans) == 1


@kernels_run
def test_x_of_other_strides_or_alignment_gets_its_own_plan(replays):
    pw, w = weight()
    plans = PlanCache()
    wide = torch.randn(5, 512, dtype=torch.float16, device=DEV)
    for x in (wide[:, :256], wide[:, 256:], wide[:, 1:257], wide[:, :256].contiguous()):
        for _ in range(2):
            assert rel_err(call(x, pw, plans), x.float() @ w.t()) < 2e-3
    # rows 512 apart and 16-byte aligned (the slices at 0 and 256 share a key), 2 bytes off, contiguous
    assert len(plans) == 3 and replays


@kernels_run
def test_in_place_change_of_the_weight_is_seen(replays):
    """A plan launches on the weight's memory, and the mma path's repacked copy is rebuilt after an in-place
    change (its version is part of the key)."""
    pw, w = weight()
    other, w_other = weight(seed=1)
    plans = PlanCache()
    x = torch.randn(1, 256, dtype=torch.float16, device=DEV)
    for _ in range(3):
        call(x, pw, plans)
    pw.qweight.copy_(other.qweight)
    pw.scales.copy_(other.scales)
    pw.zeros.copy_(other.zeros)
    for _ in range(2):
        assert rel_err(call(x, pw, plans), x.float() @ w_other.t()) < 2e-3
    assert replays


@kernels_run
@pytest.mark.parametrize("name", ["default", "dot_split"])
def test_a_plan_does_not_keep_the_recorded_calls_x_or_output(name):
    pw, w = weight()
    plans = PlanCache()
    call(torch.randn(2, 256, dtype=torch.float16, device=DEV), pw)  # (builds the mma copy: the next call records)
    x = torch.randn(2, 256, dtype=torch.float16, device=DEV)
    out = call(x, pw, plans, config=CONFIGS[name])
    assert isinstance(next(iter(plans._plans.values())), Plan)
    gone = weakref.ref(x), weakref.ref(out)
    del x, out
    assert gone[0]() is None and gone[1]() is None


@kernels_run
def test_other_tensors_replace_the_plans_and_release_the_old_ones():
    pw, w = weight()
    plans = PlanCache()
    x = torch.randn(2, 256, dtype=torch.float16, device=DEV)
    for _ in range(2):
        call(x, pw, plans, config=CONFIGS["dot_split"])
    gone = weakref.ref(pw.qweight)
    other, w_other = weight(seed=2)
    assert rel_err(call(x, other, plans, config=CONFIGS["dot_split"]), x.float() @ w_other.t()) < 2e-3
    del pw
    assert gone() is None  # (the cache held the only other reference)


@kernels_run
def test_environment_switches_and_tuned_configs_make_new_plans(monkeypatch, replays):
    pw, w = weight()
    plans = PlanCache()
    x = torch.randn(1, 256, dtype=torch.float16, device=DEV)
    for _ in range(3):
        call(x, pw, plans)
    monkeypatch.setenv("QUANTPACK_MMA", "0")  # (the CUDA-core gemv instead of the mma copy)
    for _ in range(2):
        assert rel_err(call(x, pw, plans), x.float() @ w.t()) < 2e-3
    assert len(plans) == 2
    monkeypatch.setattr(configs_mod, "table_changes", configs_mod.table_changes + 1)  # (as _remember does)
    call(x, pw, plans)
    assert len(plans) == 3


@pytest.mark.parametrize("fast", [True, False], ids=["environ-dict", "environ-get"])
def test_plan_env_follows_every_switch(monkeypatch, fast):
    """The switches the plan key reads (straight from os.environ's dict where CPython has one) change with the
    environment, and QUANTPACK_LAUNCH_PLANS=0 (only "0") turns plans off."""
    if not fast:
        monkeypatch.setattr(dispatch_mod, "_ENV_KEYS", None)
    names = dispatch_mod._ENV_NAMES
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert dispatch_mod.read_env() == (None,) * len(names) and dispatch_mod.launch_plans_enabled()
    seen = {dispatch_mod.read_env()}
    for name in names:
        monkeypatch.setenv(name, "0")
        seen.add(dispatch_mod.read_env())
    assert len(seen) == len(names) + 1 and not dispatch_mod.launch_plans_enabled()
    monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", "1")
    assert dispatch_mod.launch_plans_enabled()


@kernels_run
def test_launch_plans_can_be_turned_off(monkeypatch, replays):
    monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", "0")
    pw, w = weight()
    plans = PlanCache()
    x = torch.randn(2, 256, dtype=torch.float16, device=DEV)
    for _ in range(3):
        assert rel_err(call(x, pw, plans, config=CONFIGS["dot_split"]), x.float() @ w.t()) < 2e-3
    assert not replays and len(plans) == 0


@kernels_run
def test_dequantize_then_matmul_is_not_planned(replays):
    """The dq path launches the dequant kernel and then cuBLAS: nothing one replay could redo."""
    pw, w = weight()
    plans = PlanCache()
    x = torch.randn(3, 256, dtype=torch.float16, device=DEV)
    for _ in range(3):
        assert rel_err(call(x, pw, plans, config=KernelConfig("dq")), x.float() @ w.t()) < 2e-3
    assert not replays and len(plans) == 1 and next(iter(plans._plans.values())) is None


@kernels_run
def test_backward_through_the_transposed_kernel_replays(replays):
    pw, w = weight()
    plans = PlanCache()
    call(torch.randn(4, 256, dtype=torch.float16, device=DEV), pw)  # (builds the mma copy: every call below plans)
    for _ in range(3):
        x = torch.randn(4, 256, dtype=torch.float16, device=DEV, requires_grad=True)
        g = torch.randn(4, 96, dtype=torch.float16, device=DEV)
        out = MixedMatmul.apply(x, pw.qweight, pw.scales, pw.zeros, None, pw.group_size, pw.bits, pw.axis, False,
                                plans)
        out.backward(g)
        assert rel_err(out, x.detach().float() @ w.t()) < 2e-3
        assert rel_err(x.grad, g.float() @ w) < 2e-3
    assert len(plans) == 2 and replays.count(4) == 4  # forward and transposed, replayed twice each


@kernels_run
def test_quant_linear_keeps_plans_and_drops_them_when_moved_copied_or_reassigned():
    lin = torch.nn.Linear(256, 96, bias=True)
    q = QuantLinear.from_linear(lin, bits=4, group_size=128, method="rtn", dtype=torch.float16).to(DEV)
    q.backend = "triton"
    x = torch.randn(2, 256, dtype=torch.float16, device=DEV)
    with torch.no_grad():
        want = x.float() @ q.dequantize(torch.float32).t() + q.bias.float()
        for _ in range(3):
            assert rel_err(q(x), want) < 2e-3
        assert len(q._plans) == 1
        for clone in (copy.deepcopy(q), torch.load(io.BytesIO(_saved(q)), weights_only=False)):
            assert len(clone._plans) == 0 and rel_err(clone(x), want) < 2e-3
        q.to(DEV)  # (any move or cast)
        assert len(q._plans) == 0
        q(x)
        q(x)
        old = weakref.ref(q.qweight)
        q.qweight = q.qweight.clone()
        assert rel_err(q(x), want) < 2e-3
        assert old() is None


def _saved(module) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()


def test_counter_slices_start_16_byte_aligned():
    """A replayed kernel was compiled for 16-byte aligned pointers; counters come as slices of one ring."""
    dev = torch.device(DEV)
    slices = [caches_mod.counter_slice(dev, tiles) for tiles in (3, 1, 5, 4, 7)]
    assert all(s.data_ptr() % 16 == 0 for s in slices)


class _FakeKernel:
    """Stands in for a JIT function under the interpreter: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _record(kernel, x2, extra, keep):
    with launch_plan.recording() as rec:
        out = launch_plan.allocate(torch.zeros, (2, 3))
        launch_plan.launch(kernel, (4,), x2, extra, out, 7, BLOCK=16)
    return Plan.from_recording(rec, x2, out, keep=keep), out


def test_plan_substitutes_x_and_fresh_buffers_and_keeps_the_rest():
    kernel, x2, w = _FakeKernel(), torch.ones(2, 8), torch.ones(3, 8)
    plan, first = _record(kernel, x2, w[1:], keep=(w,))  # (a view of a kept tensor is kept)
    x_new = torch.full((2, 8), 2.0)
    out = plan(x_new)
    grid, args, kwargs = kernel.calls[-1]
    assert grid == (4,) and args[0] is x_new and args[2] is out and out is not first
    assert args[1].data_ptr() == w[1:].data_ptr() and args[3] == 7 and kwargs == {"BLOCK": 16}


def test_plan_refuses_a_launch_on_tensors_it_cannot_account_for():
    kernel, x2 = _FakeKernel(), torch.ones(2, 8)
    temporary = x2 * 2  # (say, a per-call cast of x: replaying it would reuse stale values)
    plan, _ = _record(kernel, x2, temporary, keep=())
    assert plan is None
    with launch_plan.recording() as rec:  # two launches, or one whose result it did not allocate
        launch_plan.launch(kernel, (1,), x2)
        launch_plan.launch(kernel, (1,), x2)
    assert Plan.from_recording(rec, x2, x2, keep=()) is None
    assert Plan.from_recording(Recording(), x2, x2, keep=()) is None


class _FakeCompiled:
    """Stands in for Triton's compiled kernel: its runner (``[grid]``) and its launcher (``run``) record their calls."""

    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self):
        self.runner_calls, self.run_calls = [], []

    def __getitem__(self, grid):
        return lambda *args: self.runner_calls.append((grid, args))

    def run(self, *args):
        self.run_calls.append(args)


class _FakeJit:
    """A JIT function's signature, as a plan reads it."""

    class _Param:
        def __init__(self, name, default=None):
            self.name, self.default = name, default

    params = [_Param("x"), _Param("out"), _Param("n"), _Param("BLOCK", 32)]


def test_a_compiled_replay_calls_the_launcher_directly_unless_a_launch_hook_is_set(monkeypatch):
    """With no launch hook registered, a replay hands the launcher what the runner would (grid, the current stream of
    x's device, function, metadata, no launch metadata or hooks, then every kernel argument in order, defaults
    included); with a hook (a profiler) it goes through the runner; where the launcher interface is not known
    (another Triton version, no driver) there is no direct call."""
    class Hooks:
        launch_enter_hook, launch_exit_hook = type("Chain", (), {"calls": []})(), type("Chain", (), {"calls": []})()

    compiled, kernel, x2 = _FakeCompiled(), _FakeJit(), torch.ones(2, 8)
    with launch_plan.recording() as rec:
        out = launch_plan.allocate(torch.zeros, (2, 3))
        rec.launches.append((kernel, compiled, (4,), (x2, out, 7), {}))  # (as launch() notes a compiled launch)
    plan = Plan.from_recording(rec, x2, out, keep=())
    streams = []
    plan._direct = (compiled.run, compiled.function, compiled.packed_metadata,
                    lambda index: streams.append(index) or 1234, Hooks)
    x_new = torch.full((2, 8), 2.0)
    got = plan(x_new)
    (call,) = compiled.run_calls
    assert call[:9] == (4, 1, 1, 1234, "function handle", "packed metadata", None, None, None)
    assert call[9] is x_new and call[10] is got and call[11:] == (7, 32) and streams == [x_new.get_device()]
    assert compiled.runner_calls == []
    Hooks.launch_enter_hook.calls.append(print)
    plan(x_new)
    assert len(compiled.run_calls) == 1 and len(compiled.runner_calls) == 1
    Hooks.launch_enter_hook, Hooks.launch_exit_hook = None, print  # (hooks assigned outright, not chained)
    plan(x_new)
    assert len(compiled.run_calls) == 1 and len(compiled.runner_calls) == 2
    Hooks.launch_exit_hook = None
    plan(x_new)
    assert len(compiled.run_calls) == 2
    # the real lookup: none without a GPU driver, none for a Triton outside the versions read, none without `run`
    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available():
        assert launch_plan._direct_launcher(compiled) is None
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    assert launch_plan._direct_launcher(compiled) is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert launch_plan._direct_launcher(object()) is None


class _FakeJitRunner(_FakeJit):
    """A JIT function whose ``[grid]`` launch records the call and returns the compiled kernel."""

    def __init__(self, compiled):
        self.compiled, self.launches = compiled, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled
        return launch


def test_kernel_replays_launch_directly_after_a_keys_first_launch(monkeypatch):
    """A key's first launch goes through Triton; later launches of that key hand the launcher the grid, the stream of
    the tensor's device, the function, its metadata, no launch metadata or hooks, then the arguments and the
    remaining parameters (keywords given, else defaults). Another key, a launch hook, no key or a CPU tensor go
    through Triton; a Triton without a direct launcher is not asked again."""
    class Hooks:
        launch_enter_hook = launch_exit_hook = None

    compiled = _FakeCompiled()
    kernel = _FakeJitRunner(compiled)
    streams = []
    lookups = []

    def direct(c):
        lookups.append(c)
        return (c.run, c.function, c.packed_metadata, lambda index: streams.append(index) or 99, Hooks)

    monkeypatch.setattr(launch_plan, "_direct_launcher", direct)
    replays = launch_plan.KernelReplays(kernel, limit=2)
    gpu_like = torch.ones(1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t is gpu_like))
    x, out = torch.ones(2), torch.zeros(2)
    replays("a", (3, 1, 1), gpu_like, x, out, 5, BLOCK=64, num_warps=4)
    assert kernel.launches == [((3, 1, 1), (x, out, 5), {"BLOCK": 64, "num_warps": 4})] and compiled.run_calls == []
    x2, out2 = torch.ones(2), torch.zeros(2)
    replays("a", (4, 2, 1), gpu_like, x2, out2, 6, BLOCK=64, num_warps=4)
    (call,) = compiled.run_calls
    assert call[:9] == (4, 2, 1, 99, "function handle", "packed metadata", None, None, None)
    assert call[9] is x2 and call[10] is out2 and call[11:] == (6, 64) and len(kernel.launches) == 1
    assert streams == [gpu_like.get_device()]
    replays("b", (1, 1, 1), gpu_like, x, out, 7)  # (another key: through Triton, then remembered with the default)
    replays("b", (1, 1, 1), gpu_like, x, out, 7)
    assert len(kernel.launches) == 2 and compiled.run_calls[-1][11:] == (7, 32)
    Hooks.launch_enter_hook = print  # (a profiler's hook: every launch through Triton)
    replays("a", (4, 2, 1), gpu_like, x2, out2, 6, BLOCK=64, num_warps=4)
    assert len(kernel.launches) == 3 and len(compiled.run_calls) == 2
    Hooks.launch_enter_hook = None
    for _ in range(2):  # (no key: through Triton, never remembered)
        replays(None, (4, 2, 1), gpu_like, x2, out2, 6, BLOCK=64, num_warps=4)
    assert len(kernel.launches) == 5 and len(compiled.run_calls) == 2
    replays("c", (1, 1, 1), gpu_like, x, out, 7)  # (past the limit: the old keys are dropped)
    assert len(replays) == 1
    cpu = launch_plan.KernelReplays(kernel)
    for _ in range(2):
        cpu("a", (1, 1, 1), x, x, out, 7)
    assert len(cpu) == 0 and len(kernel.launches) == 8
    monkeypatch.setattr(launch_plan, "_direct_launcher", lambda c: lookups.append(c))
    lookups.clear()
    none = launch_plan.KernelReplays(kernel)
    for key in ("a", "b"):
        none(key, (1, 1, 1), gpu_like, x, out, 7)
    assert len(none) == 0 and len(lookups) == 1
    odd = launch_plan.KernelReplays(kernel)  # (a keyword that is neither a parameter nor a launch option)
    odd("a", (1, 1, 1), gpu_like, x, out, 7, surprise=1)
    assert len(odd) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,gs", [(4096, 4096, 128), (1040, 640, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_replay_at_full_size_and_under_graph_capture(n, k, gs, dtype, bits, replays):
    """The shipped dispatch at every M bucket (mma, wgmma on Hopper, split or not) replays the compiled kernel
    bit for bit; a replay captured in a CUDA graph replays right with new x."""
    pw, w = packed_weight(n, k, gs, dtype=dtype, bits=bits, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    plans = PlanCache()
    for m in (1, 5, 16, 33, 64, 200, 1024):
        for _ in range(3):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = call(x, pw, plans, bias=bias)
            assert rel_err(out, x.float() @ w.t() + bias.float()) < 8e-3, m
            assert torch.equal(out, call(x, pw, bias=bias)), m
    assert {1, 5, 16, 33, 64} <= set(replays)  # (and the larger M but where they dequantize, then call cuBLAS)
    x = torch.randn(16, k, dtype=dtype, device="cuda")
    call(x, pw, plans, bias=bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(x, pw, plans, bias=bias)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.float() @ w.t() + bias.float()) < 8e-3


def test_a_layer_pickled_before_launch_plans_gets_an_empty_cache():
    q = QuantLinear(256, 64)
    state = dict(q.__dict__)
    del state["_plans"]  # (what an older quantpack pickled)
    old = QuantLinear.__new__(QuantLinear)
    old.__setstate__(state)
    assert isinstance(old._plans, PlanCache) and len(old._plans) == 0
    old.to("cpu")  # (moving clears the cache: it must exist)
