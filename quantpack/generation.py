"""Fast ``generate()`` by default: each decode step replays from a CUDA graph.

Decode at small batch is bound by the host: a token of an 8B model is ~600 kernel launches, whose Python and driver
cost exceeds the GPU time of 4-bit weights. transformers already knows which steps can be replayed: with a static KV
cache on a GPU it asks the model for a compiled forward (``get_compiled_call``) for the decode steps and runs prefill
eagerly. :func:`enable` answers that request with :class:`DecodeGraphs` instead of ``torch.compile``: the first step
of each input signature is captured as a CUDA graph (a second or two, no compilation), later steps copy their inputs
into the captured buffers and replay it. It also makes a static cache the default of ``model.generate`` when the
caller chose no cache, so plain ``model.generate(**inputs)`` takes this path.

Modes (``quantpack.load(..., decode=...)``):

* ``"graphs"`` (default on CUDA): the above.
* ``"compile"``: a static cache by default, and transformers' own ``torch.compile`` of the step (inductor, CUDA
  graphs; the kernels enter it as custom ops). A first call compiles for about a minute; what it compiles is kept
  under quantpack's cache directory (``torchinductor/``, see :func:`keep_compile_caches`), so that a new process
  reuses it instead of a temporary directory that a reboot empties.
* ``"eager"``: nothing changed: transformers' defaults (a dynamic cache, no graphs).

A single call opts out too: ``model.generate(..., disable_compile=True)`` runs that call eagerly.

In the first two modes the host also stops waiting for the GPU after every token: transformers (from 5.17, as
``DeferredStopCheck``) can read "have all sequences finished?" one step late, running one step too many and undoing
it, but turns that on only for Apple GPUs. Without it each step ends in a sync, and the next step's host work (its
inputs, mask and launches: about 0.7 ms on an H100 host) runs while the GPU idles; with it that work overlaps the
step before. :func:`defer_stop_checks` turns it on for the CUDA calls this module makes.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import sys
import time

import torch

from .modules import attention

MODES = ("graphs", "compile", "eager")
MAX_TOKENS = 8  # a call of more tokens per sequence (a prefill) runs eagerly: each prompt length would be a graph

# The names under which transformers passes the KV cache to generate() (it was renamed).
_CACHE_KWARGS = ("past_key_values", "cache")

logger = logging.getLogger(__name__)

DEFER_DEVICES = ("cuda",)  # where a generate() call of this module reads its stop flag a step late
# The generate() call in progress in this context, when this module runs it (the cache it keeps, or True).
_RUNNING = contextvars.ContextVar("quantpack_generate", default=None)


def _progress(message: str) -> None:
    """One line on stderr about a pause the user did not ask for; ``logging.getLogger("quantpack").setLevel(
    logging.ERROR)`` silences it."""
    if logging.getLogger("quantpack").isEnabledFor(logging.WARNING):
        print(f"quantpack: {message}", file=sys.stderr, flush=True)


_SAID: set[str] = set()


def say_once(message: str) -> None:
    """:func:`_progress`, once per process: for a feature that this version of a dependency lacks."""
    if message not in _SAID:
        _SAID.add(message)
        _progress(message)


def enable(model, mode: str = "graphs") -> None:
    """Make ``model.generate`` decode through ``mode`` (see the module's docstring); idempotent. A model that
    cannot generate, or ``mode="eager"``, is left as transformers made it."""
    if mode not in MODES:
        raise ValueError(f"decode={mode!r}: use one of {', '.join(MODES)}")
    disable(model)
    if mode == "eager" or not callable(getattr(model, "can_generate", None)) or not model.can_generate():
        return
    defer_stop_checks()
    if mode == "compile":
        keep_compile_caches()
    model.generate = functools.wraps(model.generate)(StaticCacheGenerate(model.generate, keep_cache=mode == "graphs"))
    if mode == "graphs":
        model.get_compiled_call = DecodeGraphs(model).get_compiled_call
        attention.use(model)
    model._quantpack_decode = mode


def disable(model) -> None:
    """Undo :func:`enable`: transformers' own ``generate`` and ``get_compiled_call`` again."""
    if mode_of(model) == "graphs":
        attention.unuse(model)
    for name in ("generate", "get_compiled_call"):
        model.__dict__.pop(name, None)
    model.__dict__.pop("_quantpack_decode", None)


def mode_of(model) -> str:
    """The decode mode :func:`enable` set on ``model`` (``"eager"`` when none)."""
    return model.__dict__.get("_quantpack_decode", "eager")


class StaticCacheGenerate:
    """``generate`` with a static KV cache unless the caller chose a cache (an object, ``use_cache=False``, or
    ``cache_implementation`` here, in the ``generation_config`` passed or in the model's). The static cache is what
    lets transformers run the decode steps through ``get_compiled_call``.

    With ``keep_cache``, the cache is one this object keeps and resets between calls (its tensors stay where they
    are, so the decode graphs captured for it keep replaying): a new one only for another batch size or a longer
    ``max_length`` (rounded up to a multiple of ``CACHE_STEP`` tokens). Calls where that cache would outlive the
    call (``return_dict_in_generate``, which returns it) or could not be sized here (beams, several sequences per
    prompt, no ``input_ids``) get a new static cache from transformers instead."""

    CACHE_STEP = 256

    def __init__(self, generate, *, keep_cache: bool):
        self.generate = generate  # the model class's generate, bound
        self.keep_cache = keep_cache
        self.cache = None
        self.cache_shape = None  # (batch, max_cache_len)

    def __call__(self, *args, **kwargs):
        model = self.generate.__self__
        gen_config = kwargs.get("generation_config")
        own_config = getattr(model, "generation_config", None)
        chosen = (any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or "cache_implementation" in kwargs
                  or kwargs.get("use_cache") is False
                  or any(c is not None and (c.cache_implementation is not None or c.use_cache is False)
                         for c in (gen_config, own_config)))
        if chosen or not on_cuda(model):
            return self.generate(*args, **kwargs)
        if not defer_stop_checks():
            import transformers

            say_once(f"transformers {transformers.__version__} cannot defer generate()'s stop check (5.17 and "
                     f"later can): each decode step waits for the GPU; upgrade transformers for faster decode")
        cache = self._kept_cache(model, args, kwargs, gen_config or own_config) if self.keep_cache else None
        if cache is None:
            kwargs["cache_implementation"] = "static"
        else:
            kwargs[_cache_kwarg(model)] = cache
        token = _RUNNING.set(cache if cache is not None else True)
        try:
            return self.generate(*args, **kwargs)
        finally:
            _RUNNING.reset(token)

    def _kept_cache(self, model, args, kwargs, config):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        merged = {k: kwargs.get(k, getattr(config, k, None)) for k in
                  ("max_new_tokens", "max_length", "num_beams", "num_return_sequences", "return_dict_in_generate")}
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or (merged["num_beams"] or 1) > 1
                or (merged["num_return_sequences"] or 1) > 1 or merged["return_dict_in_generate"]):
            return None
        if merged["max_new_tokens"] is not None:
            length = ids.shape[1] + merged["max_new_tokens"]
        elif merged["max_length"] is not None:
            length = merged["max_length"]
        else:
            return None
        batch = ids.shape[0]
        if self.cache is not None and self.cache_shape[0] == batch and self.cache_shape[1] >= length:
            self.cache.reset()
            return self.cache
        from transformers import StaticCache

        max_len = -(-length // self.CACHE_STEP) * self.CACHE_STEP
        self.cache = None  # (the old one's memory first)
        self.cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=max_len)
        self.cache_shape = (batch, max_len)
        return self.cache


def keep_compile_caches() -> str | None:
    """Point torch.compile's caches (inductor's compiled graphs and their Triton kernels) at ``torchinductor/`` under
    quantpack's cache directory (``$QUANTPACK_CACHE_DIR``, see docs/environment.md) unless
    ``TORCHINDUCTOR_CACHE_DIR`` is set (by the user, or by inductor once it has picked its directory in this
    process). Returns the directory now in use, ``None`` where it is inductor's default; a directory that cannot be
    written leaves the default, with one line on stderr saying so."""
    import os

    from .kernels.configs import cache_root

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    path = cache_root() / "torchinductor"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:
        _progress(f"cannot keep torch.compile's caches in {path} ({e.strerror or e}); they stay in torch's "
                  f"temporary directory (set QUANTPACK_CACHE_DIR to a writable directory to keep them)")
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return str(path)


def defer_stop_checks() -> bool:
    """Let transformers' ``DeferredStopCheck`` run in the ``generate`` calls this module makes on a GPU (see the
    module's docstring); other calls keep transformers' choice. Idempotent; ``False`` where this transformers has no
    deferred stop check. The cache this module keeps counts as not returned to the caller (it is reset before its
    next use), so it needs no rollback records, which cost a copy per step."""
    try:
        from transformers.generation import utils
    except ImportError:  # pragma: no cover (transformers is a dependency)
        return False
    base = getattr(utils, "DeferredStopCheck", None)
    if base is None:
        return False
    if getattr(base, "quantpack_defers", False):
        return True

    class DeferredOnCuda(base):
        __doc__ = base.__doc__
        quantpack_defers = True

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant):
            running = _RUNNING.get()
            if running is None or device.type not in DEFER_DEVICES or is_assistant:
                return base.is_supported(device, cache, cache_is_returned, is_assistant)
            return cache is None or cache is running or cache.is_croppable or not cache_is_returned

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
            if cache is not None and cache is _RUNNING.get():
                cache_is_returned = False
            super().__init__(input_ids, max_length, cache, cache_is_returned, streamer)

    utils.DeferredStopCheck = DeferredOnCuda
    return True


def _cache_kwarg(model) -> str:
    """The name this transformers gives generate()'s cache argument (``past_key_values``, later ``cache``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def on_cuda(model) -> bool:
    """Whether ``model``'s (first) parameters are on a CUDA device."""
    try:
        return next(model.parameters()).is_cuda
    except StopIteration:
        return False


class _Captured:
    """One captured decode step: its input buffers, the graph, and the outputs the graph writes."""

    __slots__ = ("inputs", "graph", "output")

    def __init__(self, inputs, graph, output):
        self.inputs, self.graph, self.output = inputs, graph, output


class DecodeGraphs:
    """Captures the model's forward once per input signature (shapes, dtypes, flags, the cache object) and replays it.

    A call whose arguments it cannot hold in buffers (an argument that is not a tensor, a plain value, a dict of
    those, or a cache object) runs eagerly. The graphs hold the cache object they were captured with, and are
    dropped when a call brings another cache or when the cache's tensors moved (transformers re-allocated them).
    ``graph_cls`` is ``torch.cuda.CUDAGraph`` on a GPU; tests pass a stand-in.

    A step that cannot be captured (a forward that waits for the GPU: ``.tolist()``, ``.item()``, ``nonzero()``)
    runs eagerly, and so does every later step of this model (``eager_reason`` says why), with one line on stderr:
    the failed capture's graph and pool are dropped and the cache is put back as it was before the step.
    """

    def __init__(self, model, *, graph_cls=None, max_graphs: int = 8):
        self.model = model
        self.graph_cls = graph_cls
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Captured] = {}
        self.cache = None  # the cache object the graphs were captured with
        self.cache_tensors = None  # (data_ptr, shape) of its tensors then
        self.pool = None
        self.captures = 0
        self.eager_reason = None  # why a step could not be captured; set, every step runs eagerly

    def get_compiled_call(self, compile_config=None):
        """What transformers' ``generate`` asks the model for, once per call, to run the decode steps with (off a
        GPU, where a caller's compile config lets transformers compile there, its own compiled call)."""
        if not on_cuda(self.model):
            return type(self.model).get_compiled_call(self.model, compile_config)
        return self.session()

    def session(self):
        """The callable transformers runs the decode steps of one ``generate`` call with: it checks, on its first
        step, that the graphs' cache still holds the same tensors."""
        checked = False

        def step(**kwargs):
            nonlocal checked
            if not checked:
                self._check_cache(kwargs)
                checked = True
            return self(**kwargs)

        return step

    def _check_cache(self, kwargs) -> None:
        cache = _cache_of(kwargs)
        if cache is not self.cache or _tensors_of(cache) != self.cache_tensors:
            self.reset()

    def reset(self) -> None:
        """Drop every graph (and the cache they hold), and their memory pool: a pool whose graphs are all gone
        cannot take a new capture."""
        self.graphs.clear()
        self.cache = self.cache_tensors = self.pool = None

    def __call__(self, **kwargs):
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        key = _signature(kwargs) if tokens is not None and tokens.dim() >= 2 and tokens.shape[1] <= MAX_TOKENS else None
        if key is None or self.eager_reason is not None:
            return self.model(**kwargs)
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                self.reset()
            return self._capture(key, kwargs)
        _copy_into(captured.inputs, kwargs)
        captured.graph.replay()
        return captured.output

    def _capture(self, key, kwargs):
        cache = _cache_of(kwargs)
        if cache is not self.cache:
            self.reset()
            self.cache, self.cache_tensors = cache, _tensors_of(cache)
        start = time.perf_counter()
        inputs = _clone_inputs(kwargs)

        def run():  # (attention over ``cache`` may take the split-KV kernel: modules/attention.py)
            with attention.decoding(cache):
                return self.model(**inputs)
        # The step runs here more than once (warm-up; a stand-in graph runs it to capture): the cache (keys, values,
        # position counters) is put back as it was after each, so that only the replay below advances it.
        saved = [(t, t.clone()) for t in _tensor_objects(cache)]

        def restore():
            for t, copy in saved:
                t.copy_(copy)

        if self.graph_cls is None:
            self._warm_up(run, restore)
        try:
            graph, output = self._record(run, restore)
        except Exception as e:  # (a capture error is a RuntimeError, a stand-in's anything)
            restore()
            self._give_up(e, kwargs)
            return self.model(**kwargs)
        saved.clear()  # (the copies' memory, now)
        self.graphs[key] = _Captured(inputs, graph, output)
        graph.replay()  # (capturing ran nothing: this step's result)
        self.captures += 1
        seconds = time.perf_counter() - start
        if self.captures == 1 or seconds > 2:
            tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            _progress(f"decode step captured as a CUDA graph in {seconds:.1f} s (batch {tokens.shape[0]}); later "
                      f"steps replay it (quantpack.load(..., decode='eager') turns this off)")
        return output

    def _warm_up(self, run, restore) -> None:
        """Run the step (``run()``) twice on a side stream before capturing it on a GPU, so that first-use work
        (kernel compiles, weight copies, launch plans) is not captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
            restore()
        torch.cuda.current_stream().wait_stream(stream)

    def _record(self, run, restore):
        """Capture one step (``run()``); returns the graph and the outputs it writes."""
        if self.graph_cls is not None:
            graph = self.graph_cls()
            output = graph.capture(run)
            restore()
            return graph, output
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Not ``torch.cuda.graph``: when the step fails, its exit's capture_end fails too (the capture was
        # invalidated) and leaves the capture stream current; here the capture always ends, the stream is always
        # left, and the step's own error is the one raised.
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=self.pool)
            try:
                output = run()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass
                raise
            graph.capture_end()
        return graph, output

    def _give_up(self, error: Exception, kwargs) -> None:
        """After a failed capture: no graphs from now on for this model (the ones captured and their pool are
        dropped: a pool that saw a failed capture is not reused), and one line on stderr saying why."""
        self.reset()
        first = (str(error).strip().splitlines() or [""])[0]
        self.eager_reason = f"{type(error).__name__}: {first}" if first else type(error).__name__
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        name = getattr(getattr(self.model, "config", None), "model_type", None) or type(self.model).__name__
        _progress(f"the decode step of this {name} model cannot be captured as a CUDA graph ({self.eager_reason}); "
                  f"it decodes eagerly from now on (batch {tokens.shape[0]}). Please report it to quantpack's "
                  f"issue tracker with the model's name and this line; quantpack.load(..., decode='eager') "
                  f"silences it")


def _cache_of(kwargs):
    return next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)


def _tensors_of(obj) -> tuple:
    """(data_ptr, shape) of the tensors a cache object holds: what a captured graph reads and writes of it."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in _tensor_objects(obj))


def _tensor_objects(obj, depth: int = 4) -> list[torch.Tensor]:
    """The tensors ``obj`` holds in attributes, lists and dicts, ``depth`` levels down."""
    found = []

    def walk(o, d):
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif d > 0:
            if isinstance(o, (list, tuple)):
                for v in o:
                    walk(v, d - 1)
            elif isinstance(o, dict):
                for v in o.values():
                    walk(v, d - 1)
            elif hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module)):
                for v in vars(o).values():
                    walk(v, d - 1)

    if obj is not None:
        walk(obj, depth)
    return found


_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _signature(kwargs) -> tuple | None:
    """What a captured graph is specific to: each tensor's shape, dtype, device and strides, each plain value (in
    dicts too), the identity of the cache object; ``None`` when an argument cannot be held."""
    key = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, dict):
            items = tuple(_held(k, value[k]) for k in sorted(value))
            if None in items:
                return None
            key.append((name, items))
        elif name in _CACHE_KWARGS and not isinstance(value, _PLAIN + (torch.Tensor,)):
            key.append((name, id(value)))
        else:
            held = _held(name, value)
            if held is None:
                return None
            key.append(held)
    return tuple(key)


def _held(name, value) -> tuple | None:
    """A tensor or plain argument's part of a signature; ``None`` for anything else."""
    if isinstance(value, torch.Tensor):
        return (name, tuple(value.shape), value.dtype, value.device, value.stride())
    if isinstance(value, _PLAIN):
        return (name, value)
    return None


def _clone_inputs(kwargs) -> dict:
    def own(v):
        return v.clone() if isinstance(v, torch.Tensor) else v

    return {k: ({kk: own(vv) for kk, vv in v.items()} if isinstance(v, dict) else own(v)) for k, v in kwargs.items()}


def _copy_into(buffers: dict, kwargs: dict) -> None:
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            buffers[name].copy_(value)
        elif isinstance(value, dict):
            held = buffers[name]
            for k, v in value.items():
                if isinstance(v, torch.Tensor):
                    held[k].copy_(v)
