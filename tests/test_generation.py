"""Fast decode by default (quantpack.generation): which generate() calls get a static cache, and the CUDA-graph
decode runner, checked on the CPU with a stand-in graph that re-runs the captured step into the captured outputs
(what a replay does); the real CUDA graphs are covered by the GPU test at the end."""
from __future__ import annotations

import pytest
import torch

import quantpack
from quantpack import generation
from quantpack.convert import convert


class RerunGraph:
    """Stands in for torch.cuda.CUDAGraph: capture runs the step once for its output buffers; each replay runs it
    again and writes the results into those buffers."""

    replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        RerunGraph.replays += 1
        new = self.fn()
        for key, value in new.items():
            if isinstance(value, torch.Tensor):
                self.out[key].copy_(value)


class CaptureGraph(RerunGraph):
    """A stand-in that fails as a real capture does: the step runs until it waits for the device (``.tolist()``,
    ``.item()``, ``nonzero()``, ``bool(tensor)``), which raises CUDA's capture error (after the ops before it ran,
    so the cache may be half-written)."""

    SYNCS = {"tolist", "item", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"}

    def capture(self, fn):
        from torch.overrides import TorchFunctionMode

        syncs = self.SYNCS

        class Capturing(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", None) in syncs:
                    raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless "
                                       "the CPU tensor is pinned")
                return func(*args, **(kwargs or {}))

        with Capturing():
            return super().capture(fn)


def _syncing(model):
    """Make the first decoder layer's MLP read its input on the host, as a MoE block that routes with
    ``nonzero().tolist()`` does; its result is unchanged."""
    def hook(module, args):
        (x,) = args
        assert len((x.abs().sum(-1) >= 0).nonzero().tolist()) == x.shape[0] * x.shape[1]

    return model.model.layers[0].mlp.register_forward_pre_hook(hook)


@pytest.fixture(scope="module")
def packed_llama(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "packed"
    convert(str(tiny_llama_dir), str(out), bits=4, group_size=32)
    return out


def _prompt(model, batch=2, length=5):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=g)


def _graph_generate(model, ids, new_tokens, runner, **kwargs):
    """generate() as on a GPU: static cache, decode steps through ``runner`` (transformers only auto-compiles on
    accelerators, so the CPU is allowed here through its compile config)."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    model.get_compiled_call = lambda compile_config=None: runner.session()
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          compile_config=config, pad_token_id=0, **kwargs)


def test_graph_replayed_decode_gives_the_eager_tokens_and_logits(packed_llama):
    model = quantpack.load(packed_llama, device="cpu")
    ids = _prompt(model)
    eager = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, disable_compile=True,
                           output_logits=True, return_dict_in_generate=True)
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    RerunGraph.replays = 0
    graphed = _graph_generate(model, ids, 6, runner, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert runner.captures == 1  # one signature: every decode step after the first replays
    assert RerunGraph.replays == 5  # (6 tokens: 1 from the prefill, 5 decode steps)
    # A second generate() gives the same tokens; where transformers made a new cache for it, the graph is captured
    # anew and the old one (holding the old cache) dropped.
    again = _graph_generate(model, ids, 6, runner)
    assert torch.equal(again, eager.sequences)
    assert len(runner.graphs) == 1 and runner.cache is not None


def test_a_step_that_cannot_be_captured_decodes_eagerly_from_then_on(packed_llama, capsys):
    model = quantpack.load(packed_llama, device="cpu")
    _syncing(model)
    ids = _prompt(model)
    eager = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, disable_compile=True,
                           output_logits=True, return_dict_in_generate=True)
    runner = generation.DecodeGraphs(model, graph_cls=CaptureGraph)
    RerunGraph.replays = 0
    capsys.readouterr()
    # The failed capture ran the first layer (writing its keys and values) before it failed: the cache is put back,
    # so the tokens and logits are the eager ones.
    for _ in range(2):
        out = _graph_generate(model, ids, 6, runner, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, eager.sequences)
        for a, b in zip(out.logits, eager.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert runner.captures == 0 and RerunGraph.replays == 0 and not runner.graphs and runner.pool is None
    assert runner.eager_reason.startswith("RuntimeError: Cannot copy between CPU and CUDA tensors")
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line, once for the model
    assert "cannot be captured as a CUDA graph" in err and "decodes eagerly" in err and "report" in err


def test_new_cache_shape_captures_again_and_drops_the_old_graphs(packed_llama):
    model = quantpack.load(packed_llama, device="cpu")
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    ids = _prompt(model, batch=1)
    eager_short = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, disable_compile=True)
    eager_long = model.generate(ids, max_new_tokens=9, do_sample=False, pad_token_id=0, disable_compile=True)
    assert torch.equal(_graph_generate(model, ids, 3, runner), eager_short)
    assert torch.equal(_graph_generate(model, ids, 9, runner), eager_long)  # a longer cache: captured anew
    assert runner.captures == 2 and len(runner.graphs) == 1


def test_prefill_sized_calls_and_unholdable_arguments_run_eagerly(packed_llama):
    model = quantpack.load(packed_llama, device="cpu")
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    ids = _prompt(model, batch=1, length=generation.MAX_TOKENS + 1)
    out = runner(input_ids=ids)
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits)
    out = runner(input_ids=ids[:, :1], output_hidden_states=True, extra=object())
    assert runner.captures == 0


def test_load_makes_graphs_the_default_and_eager_opts_out(packed_llama):
    model = quantpack.load(packed_llama, device="cpu")
    assert generation.mode_of(model) == "graphs"
    assert "get_compiled_call" in model.__dict__ and "generate" in model.__dict__
    eager = quantpack.load(packed_llama, device="cpu", decode="eager")
    assert generation.mode_of(eager) == "eager"
    assert "get_compiled_call" not in eager.__dict__ and "generate" not in eager.__dict__
    compiled = quantpack.load(packed_llama, device="cpu", decode="compile")
    assert "generate" in compiled.__dict__ and "get_compiled_call" not in compiled.__dict__
    with pytest.raises(ValueError, match="decode='fast'.*graphs, compile, eager"):
        quantpack.load(packed_llama, device="cpu", decode="fast")


def test_transformers_route_gets_the_same_default(packed_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(packed_llama)
    assert generation.mode_of(model) == "graphs"


class _Owner:
    """A model whose generate() records the keyword arguments it was called with."""

    def __init__(self, cuda=True, cache_implementation=None):
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig(cache_implementation=cache_implementation)
        self.cuda = cuda

    def parameters(self):
        return iter([torch.empty(0, device="meta")]) if not self.cuda else iter([_CudaLike()])

    def generate(self, *args, **kwargs):
        return kwargs


class _CudaLike:
    is_cuda = True


@pytest.mark.parametrize("kwargs, static", [
    ({}, True),
    ({"past_key_values": object()}, False),
    ({"cache": object()}, False),
    ({"cache_implementation": "dynamic"}, False),
    ({"use_cache": False}, False),
])
def test_static_cache_only_where_the_caller_chose_none(kwargs, static):
    out = generation.StaticCacheGenerate(_Owner().generate, keep_cache=False)(**kwargs)
    assert (out.get("cache_implementation") == "static") is static


def test_static_cache_respects_the_models_own_generation_config_and_the_cpu():
    from transformers import GenerationConfig

    def call(owner, **kwargs):
        return generation.StaticCacheGenerate(owner.generate, keep_cache=False)(**kwargs)

    assert "cache_implementation" not in call(_Owner(cuda=False))
    assert "cache_implementation" not in call(_Owner(cache_implementation="dynamic"))
    chosen = GenerationConfig(cache_implementation="offloaded")
    assert "cache_implementation" not in call(_Owner(), generation_config=chosen)


def test_kept_cache_makes_later_calls_replay_the_first_calls_graph(packed_llama, monkeypatch):
    """generate() calls of one batch size and no longer max_length share one static cache, reset between calls, so
    the graph captured by the first call replays in the later ones; another batch size gets a new cache."""
    from transformers import CompileConfig

    model = quantpack.load(packed_llama, device="cpu", decode="eager")
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    model.get_compiled_call = runner.get_compiled_call
    monkeypatch.setattr(generation, "on_cuda", lambda model: True)
    config = CompileConfig()
    config._compile_all_devices = True
    kw = dict(do_sample=False, pad_token_id=0, compile_config=config)
    ids = _prompt(model, batch=2)
    want = {n: model.generate(ids, max_new_tokens=n, disable_compile=True, **kw) for n in (4, 7)}
    fast = generation.StaticCacheGenerate(model.generate, keep_cache=True)
    assert torch.equal(fast(ids, max_new_tokens=7, **kw), want[7])
    cache = fast.cache
    assert torch.equal(fast(ids, max_new_tokens=4, **kw), want[4])
    assert torch.equal(fast(ids, max_new_tokens=7, **kw), want[7])
    assert fast.cache is cache and fast.cache_shape == (2, generation.StaticCacheGenerate.CACHE_STEP)
    assert runner.captures == 1
    one = ids[:1]
    assert torch.equal(fast(one, max_new_tokens=4, **kw),
                       model.generate(one, max_new_tokens=4, disable_compile=True, **kw))
    assert fast.cache is not cache and runner.captures == 2
    # A call that returns its cache gets a cache of its own.
    out = fast(ids, max_new_tokens=4, return_dict_in_generate=True, **kw)
    assert out.past_key_values is not fast.cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_generate_on_cuda_matches_eager(packed_llama, dtype):
    """Plain generate() on the default path (static cache, CUDA-graph replay) gives the eager path's greedy tokens,
    and logits within the kernels' tolerance."""
    fast = quantpack.load(packed_llama, device="cuda", dtype=dtype)
    eager = quantpack.load(packed_llama, device="cuda", dtype=dtype, decode="eager")
    ids = _prompt(fast, batch=3, length=7).cuda()
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a = fast.generate(ids, **kw)
    b = eager.generate(ids, **kw)
    assert fast.get_compiled_call.__self__.captures == 1  # (the default path ran: captured once, then replayed)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)
    # A second and third call (a new cache each: the old graphs and their memory pool are dropped) agree too.
    for _ in range(2):
        assert torch.equal(fast.generate(ids, **kw).sequences, b.sequences)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_generate_on_cuda_survives_a_forward_that_syncs(packed_llama, capsys):
    """A real CUDA graph capture of a step that waits for the GPU fails; the default path then decodes eagerly, with
    the eager path's tokens, at batch 1 and 16, and the device is left usable (current stream, later captures)."""
    fast = quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16)
    eager = quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16, decode="eager")
    for model in (fast, eager):
        _syncing(model)
    stream = torch.cuda.current_stream()
    capsys.readouterr()
    for batch in (1, 16):
        ids = _prompt(fast, batch=batch, length=7).cuda()
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))
    runner = fast.get_compiled_call.__self__
    assert runner.captures == 0 and runner.eager_reason and not runner.graphs
    assert torch.cuda.current_stream() == stream
    assert capsys.readouterr().err.count("cannot be captured as a CUDA graph") == 1
    # Another model in the same process still captures and replays.
    clean = quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16)
    ids = _prompt(clean, batch=2, length=7).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(clean.generate(ids, **kw), quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16,
                                                                 decode="eager").generate(ids, **kw))
    assert clean.get_compiled_call.__self__.captures == 1


class _HostEvent:
    """Stands in for torch.Event on the CPU (which has none; the CPU runs in order, so there is nothing to wait for)."""

    def __init__(self, device=None, blocking=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.mark.skipif(not generation.defer_stop_checks(), reason="transformers before 5.17 has no DeferredStopCheck")
def test_stop_flag_read_a_step_late_gives_the_same_tokens(packed_llama, monkeypatch):
    """On the default path the stop flag is read one step late (no host wait per token): a call stopped by EOS runs
    one step more and undoes it, a call stopped by max_new_tokens stops on time; the tokens are the eager ones. Calls
    this module does not make keep transformers' own stop check."""
    from transformers import CompileConfig
    from transformers.generation import utils

    assert generation.defer_stop_checks()
    deferred = utils.DeferredStopCheck
    finished = []
    original_finish = deferred.finish
    monkeypatch.setattr(deferred, "finish", lambda self: finished.append(original_finish(self)) or finished[-1])
    monkeypatch.setattr(generation, "DEFER_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", _HostEvent)
    monkeypatch.setattr(generation, "on_cuda", lambda model: True)

    # (float32: in bfloat16 the tiny model's top two logits tie at a step, and the paths may break the tie apart)
    model = quantpack.load(packed_llama, device="cpu", decode="eager", dtype=torch.float32)
    # (no stop token but the one each call passes: the checkpoint's own may come up among the tokens, as it did where
    # the fixture's conversion ran on a GPU, and would stop the max_new_tokens calls early)
    model.generation_config.eos_token_id = None
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    model.get_compiled_call = runner.get_compiled_call
    config = CompileConfig()
    config._compile_all_devices = True
    ids = _prompt(model, batch=1)
    kw = dict(do_sample=False, pad_token_id=0, compile_config=config)
    full = model.generate(ids, max_new_tokens=8, disable_compile=True, **kw)
    assert finished == []  # (transformers' own choice off the default path: no deferral on this device)
    eos = int(full[0, ids.shape[1] + 3])  # the 4th new token ends the sequence
    first = int((full[0, ids.shape[1]:] == eos).nonzero()[0])
    fast = generation.StaticCacheGenerate(model.generate, keep_cache=True)

    by_eos = fast(ids, max_new_tokens=8, eos_token_id=eos, **kw)
    assert finished == [1]  # one step past the stop, undone
    assert torch.equal(by_eos, full[:, :ids.shape[1] + first + 1])
    assert torch.equal(by_eos, model.generate(ids, max_new_tokens=8, eos_token_id=eos, disable_compile=True, **kw))
    by_length = fast(ids, max_new_tokens=8, **kw)
    assert finished == [1, 0]  # stopped at max_new_tokens on time
    assert torch.equal(by_length, full)


def test_compile_caches_kept_under_quantpacks_cache_directory(packed_llama, tmp_path, monkeypatch, capsys):
    """decode="compile" keeps torch.compile's caches under $QUANTPACK_CACHE_DIR (not a temporary directory), leaves
    a directory the user chose alone, and with an unusable cache directory says so in one line and keeps torch's."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path / "qp"))
    model = quantpack.load(packed_llama, device="cpu", decode="graphs")
    assert "TORCHINDUCTOR_CACHE_DIR" not in __import__("os").environ  # (graphs compile nothing)
    generation.enable(model, "compile")
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "qp" / "torchinductor")
    assert (tmp_path / "qp" / "torchinductor").is_dir()
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "qp" / "torchinductor")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert generation.keep_compile_caches() == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path / "file"))
    capsys.readouterr()
    assert generation.keep_compile_caches() is None
    err = capsys.readouterr().err
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert err.count("\n") == 1 and "cannot keep torch.compile's caches" in err and "QUANTPACK_CACHE_DIR" in err
    assert (tmp_path / "file").read_text() == "not a directory"


def _static_cache_counts_on_the_device() -> bool:
    import inspect

    from transformers.cache_utils import StaticLayer

    return "cumulative_length" in inspect.getsource(StaticLayer)


needs_device_count = pytest.mark.skipif(not _static_cache_counts_on_the_device(),
                                        reason="this transformers' static cache keeps no length on the device: "
                                               "decode steps take sdpa")
needs_interpreter = pytest.mark.skipif(not __import__("quantpack.kernels.dequant", fromlist=["x"]).interpreting(),
                                       reason="the decode attention kernel runs on the CPU only under TRITON_INTERPRET=1")


def _counting_kernel(monkeypatch):
    from quantpack.kernels import decode_attention

    calls = []
    original = decode_attention.decode_attention_unchecked

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "decode_attention_unchecked", counted)
    return calls


@needs_interpreter
@needs_device_count
@pytest.mark.parametrize("padded", [False, True])
def test_decode_steps_take_the_split_kv_kernel_with_the_eager_tokens(packed_llama, monkeypatch, padded):
    """On the graphs path the decode steps' attention runs the split-KV kernel over the static cache (prefill keeps
    sdpa), and each layer's keys and values are written by the one-launch cache write, with the eager path's greedy
    tokens and logits, left-padded prompts included; the switch turns the attention kernel off. (float32: in bfloat16
    the tiny model's top logits tie, and any rounding difference picks another token.)"""
    from quantpack.kernels import fused_ops
    from quantpack.modules import attention

    model = quantpack.load(packed_llama, device="cpu", dtype=torch.float32)
    ids = _prompt(model, batch=3, length=6)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0
        mask[2, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    eager = model.generate(ids, disable_compile=True, **kw)
    assert attention.use(model) and model.config._attn_implementation == attention.NAME
    calls = _counting_kernel(monkeypatch)
    writes = []
    write = fused_ops.kv_write_unchecked
    monkeypatch.setattr(fused_ops, "kv_write_unchecked", lambda *a: writes.append(a[0].shape) or write(*a))
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    runner = generation.DecodeGraphs(model, graph_cls=RerunGraph)
    model.get_compiled_call = lambda compile_config=None: runner.session()
    graphed = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    assert calls and all(shape[2] == 1 for shape in calls)  # decode steps only: the prefill took sdpa
    assert len(calls) == layers * 5  # capture (run once; the warm-up is the GPU's) + 4 replays, every layer
    assert writes == [(3, model.config.num_key_value_heads, 1, model.config.head_dim)] * (layers * 5)
    cache = runner.cache
    assert all("update" not in vars(layer) for layer in cache.layers)  # (only while a step runs)
    assert all(layer.cumulative_length.item() == ids.shape[1] + 4 for layer in cache.layers)
    calls.clear()
    monkeypatch.setenv("QUANTPACK_DECODE_ATTENTION", "0")
    runner.reset()
    off = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert torch.equal(off.sequences, eager.sequences) and not calls
    attention.unuse(model)
    assert model.config._attn_implementation == "sdpa"


def test_graphs_mode_points_sdpa_models_at_the_decode_attention_and_back(packed_llama):
    from quantpack.modules import attention

    model = quantpack.load(packed_llama, device="cpu", decode="eager")
    assert model.config._attn_implementation == "sdpa"
    generation.enable(model, "graphs")
    assert model.config._attn_implementation == attention.NAME
    generation.enable(model, "eager")
    assert model.config._attn_implementation == "sdpa"
    generation.enable(model, "compile")
    assert model.config._attn_implementation == "sdpa"  # (compiled steps keep sdpa: inductor traces it)
    generation.disable(model)
    eager = quantpack.load(packed_llama, device="cpu", decode="eager", attn_implementation="eager") \
        if "attn_implementation" in __import__("inspect").signature(quantpack.load).parameters else None
    if eager is not None:
        generation.enable(eager, "graphs")
        assert eager.config._attn_implementation == "eager"  # (a choice other than sdpa is kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_generate_on_cuda_runs_the_split_kv_kernel(packed_llama, monkeypatch):
    """On a GPU the default path's captured decode step runs the split-KV kernel (every layer), with the eager path's
    logits and greedy tokens, left-padded prompts and a cache of several hundred positions included."""
    calls = _counting_kernel(monkeypatch)
    fast = quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16)
    eager = quantpack.load(packed_llama, device="cuda", dtype=torch.bfloat16, decode="eager")
    ids = _prompt(fast, batch=3, length=200).cuda()
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    a = fast.generate(ids, **kw)
    b = eager.generate(ids, **kw)
    assert len(calls) == fast.config.num_hidden_layers * 3  # captured once (two warm-ups, the capture), replayed
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_a_transformers_without_deferred_stop_check_says_so_once(packed_llama, monkeypatch, capsys):
    """Before 5.17 transformers has no DeferredStopCheck: the default path still generates, and says once, in one
    line, that each step waits for the GPU."""
    monkeypatch.setattr(generation, "defer_stop_checks", lambda: False)  # (what it answers there)
    monkeypatch.setattr(generation, "_SAID", set())
    monkeypatch.setattr(generation, "on_cuda", lambda model: True)
    model = quantpack.load(packed_llama, device="cpu", decode="eager")
    fast = generation.StaticCacheGenerate(model.generate, keep_cache=False)
    ids = _prompt(model, batch=1)
    for _ in range(2):
        assert fast(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, disable_compile=True).shape[1] == \
            ids.shape[1] + 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "stop check" in line]
    assert len(lines) == 1 and "5.17" in lines[0], lines
