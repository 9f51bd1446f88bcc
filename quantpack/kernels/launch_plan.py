"""Launch plans: the host work of a fused-matmul call, done once per (weight, call shape) and replayed.

Before launching anything, ``mixed_mm`` validates the packed tensors, picks a path and config from the table,
fits a grid and a split-K workspace, builds TMA descriptors and has Triton bind and specialize some twenty
arguments: 110-160 us of Python a call on an H100 host (BENCHMARKS.md run AI), 10-20 times the GPU time of a
decode GEMV. None of it depends on x's values, only on the weight tensors, x's shape, dtype, strides and
alignment, and the process state (environment, config table).

So the first call of such a key runs as usual while a recorder notes what it allocates (:func:`allocate`: the
output, the workspace and counters) and the one kernel it launches (:func:`launch`). A :class:`Plan` made from
that replays it for later calls: the same allocations, then the compiled kernel launched directly on them, with
x and the new buffers in place of the first call's (x's TMA descriptor re-based on the new x). Triton's binding,
specialization and cache lookup are skipped, which is sound because the key fixes everything they depend on:
tensor alignment (x's is in the key; buffers are fresh allocations; counter slices are 16-byte aligned), integer
values and every compile-time argument. Under TRITON_INTERPRET the replay calls the kernel as the first call did.

A plan is only made when every tensor the launch received is x, a buffer it allocated or one of the long-lived
tensors the caller names (weight, scales, zeros, bias, their views); anything else, say a per-call temporary,
and the call is simply not planned.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Callable

import torch

_local = threading.local()


class Recording:
    """What one call allocated (``(fn, args, result)`` per :func:`allocate`) and launched (``(kernel, compiled,
    grid, args, kwargs)`` per :func:`launch`)."""

    def __init__(self):
        self.allocations: list = []
        self.launches: list = []


@contextlib.contextmanager
def recording():
    """Record the :func:`allocate` and :func:`launch` calls made inside (this thread only)."""
    outer = getattr(_local, "recording", None)
    rec = _local.recording = Recording()
    try:
        yield rec
    finally:
        _local.recording = outer


def allocate(fn: Callable, *args):
    """``fn(*args)``, noted for the replay, which calls ``fn`` again with the same ``args``: ``fn`` must be a
    function returning fresh tensors (or a tuple of them) each call, and ``args`` must not depend on x's values."""
    result = fn(*args)
    rec = getattr(_local, "recording", None)
    if rec is not None:
        rec.allocations.append((fn, args, result))
    return result


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (a Triton or Gluon JIT function), noted for the replay."""
    compiled = kernel[grid](*args, **kwargs)
    rec = getattr(_local, "recording", None)
    if rec is not None:
        rec.launches.append((kernel, compiled, grid, args, kwargs))
    return compiled


def _is_descriptor(arg) -> bool:
    return hasattr(arg, "base") and hasattr(arg, "block_shape") and isinstance(getattr(arg, "base"), torch.Tensor)


def _source(arg, x2: torch.Tensor, where: dict, kept: set):
    """How a replay gets a recorded launch argument: ("x",), ("buffer", allocation, position), ("x_desc",) (x's TMA
    descriptor), ("same",) (the recorded value: not a tensor, or one of ``kept``'s storages), or None (a tensor it
    cannot account for). (A module function: a closure recursing on itself would hold x2 in a reference cycle.)"""
    if isinstance(arg, torch.Tensor):
        if arg is x2:
            return ("x",)
        if id(arg) in where:
            return ("buffer",) + where[id(arg)]
        return ("same",) if arg.untyped_storage().data_ptr() in kept else None
    if _is_descriptor(arg):
        if arg.base is x2:
            return ("x_desc",)
        return ("same",) if _source(arg.base, x2, where, kept) == ("same",) else None
    return ("same",)


class Plan:
    """Replays a recorded call: ``plan(x2)`` allocates what the first call did and launches its kernel with x2 and
    the new buffers. Build with :meth:`from_recording`."""

    def __init__(self, kernel, compiled, grid, template: list, kwargs: dict, subs: list, makers: list,
                 result: tuple[int, int]):
        self._kernel, self._compiled, self._grid = kernel, compiled, grid
        self._template, self._kwargs, self._subs = template, kwargs, subs
        self._makers, self._result = makers, result
        self._direct = _direct_launcher(compiled) if compiled is not None else None

    @classmethod
    def from_recording(cls, rec: Recording, x2: torch.Tensor, result: torch.Tensor,
                       keep: tuple) -> "Plan | None":
        """The plan of a call that ran ``rec``'s allocations and launch on ``x2`` and returned ``result``, or
        ``None`` if the call cannot be replayed that way (not exactly one launch, a result it did not allocate,
        or a launch argument that is a tensor other than x2, its buffers and the tensors in ``keep``)."""
        if len(rec.launches) != 1:
            return None
        kernel, compiled, grid, args, kwargs = rec.launches[0]
        where = {}  # id(tensor) -> (allocation, position) for every buffer the call allocated
        makers = []
        for i, (fn, fargs, out) in enumerate(rec.allocations):
            outs = out if isinstance(out, tuple) else (out,)
            for j, t in enumerate(outs):
                where.setdefault(id(t), (i, j))
            makers.append((fn, fargs, isinstance(out, tuple)))
        if id(result) not in where:
            return None
        kept = {t.untyped_storage().data_ptr() for t in keep if isinstance(t, torch.Tensor)}
        kept.discard(x2.untyped_storage().data_ptr())
        compiled_ok = compiled is not None and hasattr(compiled, "__getitem__") and hasattr(kernel, "params")
        if compiled_ok:  # all arguments in the kernel's order, as JITFunction.run hands them to the launcher
            names = [p.name for p in kernel.params]
            if len(args) > len(names) or any(k not in names and k not in _LAUNCH_OPTIONS for k in kwargs):
                return None
            template = list(args) + [kwargs[name] if name in kwargs else p.default
                                     for name, p in zip(names[len(args):], kernel.params[len(args):])]
            call_kwargs = {}
        else:  # (the interpreter: call the JIT function again with the same keywords)
            template, call_kwargs = list(args), dict(kwargs)
        subs = []
        for pos, arg in enumerate(template):
            how = _source(arg, x2, where, kept)
            if how is None:
                return None
            if how != ("same",):
                subs.append((pos, how))
                if how == ("x_desc",):  # (the template keeps its shape, strides and layout, not this call's x)
                    template[pos] = copy.copy(arg)
                    template[pos].base = None
                else:
                    template[pos] = None  # (nor this call's x and buffers: a prefill's output can be 100+ MB)
        for name, arg in call_kwargs.items():
            if _source(arg, x2, where, kept) != ("same",):
                return None
        if compiled_ok:  # (a compiled kernel's launcher reads all three grid dimensions)
            grid = tuple(grid) + (1,) * (3 - len(grid))
        return cls(kernel, compiled if compiled_ok else None, grid, template, call_kwargs, subs, makers,
                   where[id(result)])

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        made = []
        for fn, fargs, is_tuple in self._makers:
            out = fn(*fargs)
            made.append(out if is_tuple else (out,))
        args = list(self._template)
        for pos, how in self._subs:
            if how[0] == "x":
                args[pos] = x2
            elif how[0] == "buffer":
                args[pos] = made[how[1]][how[2]]
            else:  # x's descriptor: same shape, strides and block (the key fixes them), new base
                desc = copy.copy(args[pos])
                desc.base = x2
                args[pos] = desc
        direct = self._direct
        if direct is not None and _no_launch_hooks(direct[4]):
            run, function, metadata, stream, _ = direct
            grid = self._grid
            run(grid[0], grid[1], grid[2], stream(x2.get_device()), function, metadata, None, None, None, *args)
        elif self._compiled is not None:
            self._compiled[self._grid](*args)
        else:
            self._kernel[self._grid](*args, **self._kwargs)
        return made[self._result[0]][self._result[1]]


def _direct_launcher(compiled) -> tuple | None:
    """What ``compiled[grid](*args)`` calls, to call it without that runner (3-4 us of a replay on an H200 host: a
    closure, the current device and stream looked up, launch metadata built for the launch hooks): the compiled
    kernel's launcher, its function handle and packed metadata, the current-stream lookup and the runtime knobs that
    hold the hook chains. The launcher takes (grid, stream, function, packed metadata, launch metadata, enter hook,
    exit hook, then the kernel's arguments) in Triton 3.6 through 3.9 (read in 3.6's and 3.9's sources, run on 3.6);
    other versions, and any replay while a launch hook is registered (a profiler), go through the runner. ``None``
    where the direct call does not apply."""
    try:  # (imported here: triton.knobs exists only in the Triton versions this applies to)
        import triton
        from triton import knobs
        from triton.runtime import driver

        if not (3, 6) <= tuple(int(v) for v in triton.__version__.split(".")[:2]) <= (3, 9):
            return None
        hooks = knobs.runtime
        _no_launch_hooks(hooks)  # (raises AttributeError where the knobs have no launch hooks)
        return (compiled.run, compiled.function, compiled.packed_metadata, driver.active.get_current_stream, hooks)
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None


def _no_launch_hooks(runtime) -> bool:
    """Whether Triton's launch hooks are idle: each unset or an empty hook chain (a hook assigned as a plain function
    counts as set)."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return not (getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """Each tensor's shape, strides, dtype, device and 16-byte alignment: what a launch specializes on through its
    tensor arguments and the integers derived from their shapes (part of a :class:`KernelReplays` key)."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


class KernelReplays:
    """Launches of one Triton kernel by call key (fused_ops.py's RMSNorm and rotary, which take several per-call
    tensors, so no :class:`Plan`): a key's first launch goes through Triton (binding, specialization, the compile
    cache), later ones hand the arguments straight to that compiled kernel's launcher (:func:`_direct_launcher`).

    Sound when the key fixes everything Triton specializes a launch on: each tensor argument's dtype and 16-byte
    alignment, each integer argument's value (whether it is 1 or a multiple of 16, its width), the constexpr
    arguments, launch options and the device. Callers key on the shapes, strides, dtypes, alignments and device of
    the tensors every argument derives from, and pass ``None`` for no key (``QUANTPACK_LAUNCH_PLANS=0``). Off the
    GPU (TRITON_INTERPRET), without a key and while a launch hook is set, every launch goes through Triton."""

    def __init__(self, kernel, limit: int = 256):
        self.kernel, self.limit = kernel, limit
        self._hits: dict = {}
        self._direct_known = True  # (False once this Triton has no direct launcher: no further tries)

    def __call__(self, key, grid: tuple, device_of: torch.Tensor, *args, **kwargs) -> None:
        """``kernel[grid](*args, **kwargs)``; ``grid`` has three dimensions, ``device_of`` is a tensor on the device
        the launch runs on (the caller made it current); ``key`` ``None``: through Triton, not remembered."""
        hit = self._hits.get(key) if key is not None else None
        if hit is not None:
            run, function, metadata, stream, hooks, tail = hit
            if _no_launch_hooks(hooks):
                run(grid[0], grid[1], grid[2], stream(device_of.get_device()), function, metadata, None, None, None,
                    *args, *tail)
                return
        compiled = self.kernel[grid](*args, **kwargs)
        if hit is None and key is not None and self._direct_known and device_of.is_cuda:
            self._remember(key, compiled, len(args), kwargs)

    def _remember(self, key, compiled, count: int, kwargs: dict) -> None:
        params = getattr(self.kernel, "params", None)
        direct = _direct_launcher(compiled) if params is not None and hasattr(compiled, "run") else None
        if direct is None:
            self._direct_known = False
            return
        names = [p.name for p in params]
        if count > len(names) or any(k not in names and k not in _LAUNCH_OPTIONS for k in kwargs):
            return
        tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params[count:])
        if len(self._hits) >= self.limit:
            self._hits.clear()
        self._hits[key] = direct + (tail,)

    def clear(self) -> None:
        self._hits.clear()

    def __len__(self) -> int:
        return len(self._hits)


# keywords of a JIT launch that are compile options, not kernel arguments (their values are in the compiled kernel)
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "enable_fp_fusion",
                             "launch_cooperative_grid"})


class PlanCache:
    """The launch plans of one packed weight, kept by its owner (``QuantLinear`` keeps one per layer) and passed
    to ``mixed_mm(..., plans=...)``. The plans hold the weight's tensors; they are all dropped when a call comes
    with other tensors (a buffer reassigned), on :meth:`clear` (``QuantLinear`` clears it when moved or cast), and
    past ``limit`` keys. Copies and pickles of the owner start empty (compiled kernels do not copy)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._tensors: tuple = ()
        self._plans: dict = {}

    def get(self, tensors: tuple, key):
        """The plan stored under ``key`` for these very tensors (compared by identity): a :class:`Plan`, ``None``
        (the key's call cannot be planned) or ``MISSING``. Other tensors than the plans': all are dropped."""
        held = self._tensors
        if len(held) != len(tensors) or any(a is not b for a, b in zip(held, tensors)):
            self._tensors, self._plans = tensors, {}
            return MISSING
        return self._plans.get(key, MISSING)

    def put(self, tensors: tuple, key, plan: "Plan | None") -> None:
        held = self._tensors
        if (len(held) != len(tensors) or any(a is not b for a, b in zip(held, tensors))
                or len(self._plans) >= self.limit):
            self._tensors, self._plans = tensors, {}
        self._plans[key] = plan

    def clear(self) -> None:
        self._tensors, self._plans = (), {}

    def __len__(self) -> int:
        return len(self._plans)

    def __deepcopy__(self, memo) -> "PlanCache":
        return PlanCache(self.limit)

    def __reduce__(self):
        return PlanCache, (self.limit,)


MISSING = object()  # PlanCache.get: no entry for this key
