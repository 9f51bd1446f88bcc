"""One decode GEMV for several packed weights that read the same input: ``x @ [W_1; ...; W_n].T``.

A decoder layer's q, k and v projections (and gate and up) multiply one activation. At decode (a few rows of x)
each is a latency-bound GEMV: on an H100 at M = 1, q, k and v of an 8B model take 7.6 + 4.9 + 4.9 us, where the
bytes of all three at the rate of the larger GEMVs would take about 10. One launch over
the weights stacked along N reads them in one grid, and it is one launch and one host call instead of three.

The stacked weight exists only in the ``mma`` layout (``(N/16, K/64, 32, 4)`` words, 16-row tiles of N first):
the members' copies concatenated along that first dimension, after which each member's own ``mma`` copy (the one
its separate calls use) is a view of its rows, so no weight memory is added. Scales, zeros and biases are
concatenated (about 3% of the bytes). Calls the ``mma`` path would not take (prefill, 8-bit where another path
is tuned) are declined: ``None`` from :func:`merged_mm`, and the caller runs its members one by one.
"""
from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import launch_plan
from .dequant import infer_layout, on_device
from .autotune import reference_product, tunes_on_first_use
from .caches import mma_copies, mma_self_check, outside_graph_pools, tensor_version
from .dispatch import MMA_MAX_M, mma_config
from .mixed_mm import autotune_mma, call_key, mixed_mm, mma_mm
from .mma_layout import CHUNK, mma_pack


class MergedWeights(NamedTuple):
    """The members' weights stacked along N, built from (and valid for) ``sources`` at ``versions``."""
    sources: tuple  # weak references to every member tensor (qweights, scales, zeros, biases; None for no bias):
    # the entry is keyed by the first qweight, so a strong reference here would keep the members alive forever
    versions: tuple
    mma: torch.Tensor  # the members' mma copies concatenated along their first dimension
    scales: torch.Tensor  # (K/G, sum N)
    zeros: torch.Tensor
    bias: torch.Tensor | None  # members without a bias contribute zeros; None if none has one
    plans: launch_plan.PlanCache


_merged: WeakIdKeyDictionary = WeakIdKeyDictionary()  # first member's qweight -> MergedWeights


def merged_weights(qweights, scales, zeros, biases, *, group_size: int, bits: int) -> tuple[MergedWeights | None, bool]:
    """The :class:`MergedWeights` of these members, built on first use and again when any of their tensors is
    replaced or modified in place, and whether this call built it. ``None`` where it cannot be built now: under
    CUDA-graph capture, on a device whose ``mma`` kernel failed its self-check, or for members spread over
    devices. Raises ``ValueError`` for members that cannot be stacked (other K, N not a multiple of 16...)."""
    sources = (*qweights, *scales, *zeros, *biases)
    versions = _versions(sources)
    hit = _merged.get(qweights[0])
    if (hit is not None and hit.versions == versions and len(hit.sources) == len(sources)
            and all(map(_refers_to, hit.sources, sources))):
        return hit, False
    device = qweights[0].device
    if any(t is not None and t.device != device for t in sources):
        return None, False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None, False
    dims = [infer_layout(q, s, z, group_size, bits, 1) for q, s, z in zip(qweights, scales, zeros)]
    k = dims[0][1]
    if any(d[1] != k or d[2] != 1 or d[0] % 16 for d in dims) or k % CHUNK or group_size % CHUNK:
        raise ValueError("merged projections need one in_features K (a multiple of 64), groups along K of a "
                         f"multiple of 64 and out_features multiples of 16; got (N, K) = {[d[:2] for d in dims]}, "
                         f"group_size={group_size}")
    if not mma_self_check(device):
        return None, False

    def build():
        copies = []
        for q, (n, _, _) in zip(qweights, dims):
            have = mma_copies.get(q)
            copies.append(have[1] if have is not None and have[0] == tensor_version(q) else mma_pack(q, n, k, bits))
        return torch.cat(copies)

    with on_device(qweights[0]):
        mma = outside_graph_pools(build, device)
        scales_cat = outside_graph_pools(lambda: torch.cat(scales, dim=1), device)
        zeros_cat = outside_graph_pools(lambda: torch.cat(zeros, dim=1), device)
        bias = None
        if any(b is not None for b in biases):
            dtype = next(b for b in biases if b is not None).dtype
            bias = outside_graph_pools(lambda: torch.cat([
                b.to(dtype) if b is not None else torch.zeros(d[0], dtype=dtype, device=device)
                for b, d in zip(biases, dims)]), device)
    start, planes = 0, 2 if bits == 8 else 1  # (mma_pack: one row per 16 output features and nibble plane)
    for q, (n, _, _) in zip(qweights, dims):  # each member's own copy becomes a view: no memory added
        mma_copies[q] = (tensor_version(q), mma[start:start + n // 16 * planes])
        start += n // 16 * planes
    refs = tuple(weakref.ref(t) if t is not None else None for t in sources)
    state = MergedWeights(refs, versions, mma, scales_cat, zeros_cat, bias, launch_plan.PlanCache())
    _merged[qweights[0]] = state
    return state, True


def _versions(sources: tuple) -> tuple:
    """The version counters of ``sources`` (0 for a missing bias, -1 for an inference tensor, which keeps none)."""
    try:
        return tuple([0 if t is None else t._version for t in sources])
    except RuntimeError:  # (an inference tensor: one by one)
        return tuple(tensor_version(t) if t is not None else 0 for t in sources)


def _refers_to(ref, t) -> bool:
    """Whether ``ref`` (a weak reference, or None for a missing bias) refers to ``t``."""
    return t is None if ref is None else ref() is t


def merged_path(rows: int, n: int, k: int, group_size: int, bits: int, device: torch.device, host_bound: bool = False
                ) -> bool:
    """Whether :func:`merged_mm` runs (rather than declines) ``rows`` rows of 16-bit x, suitably laid out, through
    stacked weights of ``n`` out-features on ``device``: what the caller can decide once per call shape.
    ``host_bound``: for a call outside CUDA-graph capture (dispatch.choose)."""
    return mma_config(rows, n, k, group_size, bits, device, host_bound) is not None and mma_self_check(device)


def merged_mm(x: torch.Tensor, qweights, scales, zeros, biases, *, group_size: int, bits: int = 4
              ) -> torch.Tensor | None:
    """``x @ [W_1; ...; W_n].T + [b_1, ..., b_n]``: the members' outputs side by side in one tensor of
    ``sum(N_i)`` columns, from one ``mma`` launch; ``None`` where the call is not the ``mma`` path's (see the
    module's docstring) or the stacked weight cannot be built now. ``biases`` holds ``None`` for members without."""
    state, built_now = merged_weights(qweights, scales, zeros, biases, group_size=group_size, bits=bits)
    if state is None:
        return None
    _autotune_if_asked(x, state, qweights, scales, zeros, group_size=group_size, bits=bits)
    return mma_mm(x, state.mma, state.scales, state.zeros, group_size=group_size, bits=bits, bias=state.bias,
                  plans=state.plans, built_now=built_now)


class MergedReplay(NamedTuple):
    """The launch plan an eager :func:`merged_mm` call recorded, with everything that call's decisions read, so that
    a caller holding the members (``MergedProjections``) can replay it for an identical call in one check instead of
    going through the stacked weights' lookup, their plan key and the dispatch again (:meth:`run`)."""
    x_key: tuple  # x's shape, strides, dtype, device and 16-byte alignment
    env: tuple  # dispatch.read_env() and configs.table_state() at the call
    sources: tuple  # the members' tensors as passed (qweights, scales, zeros, biases)
    versions: tuple
    plan: launch_plan.Plan
    width: int  # sum(N_i)

    @classmethod
    def of(cls, x: torch.Tensor, sources: tuple, env: tuple, *, group_size: int, bits: int) -> "MergedReplay | None":
        """The replay of the :func:`merged_mm` call just made with ``x`` and ``sources`` (qweights, scales, zeros,
        biases, flat) under ``env``, or ``None`` where that call recorded no plan (capture, plans off, a build)."""
        state = _merged.get(sources[0])
        if (state is None or state.versions != _versions(sources) or len(state.sources) != len(sources)
                or not all(map(_refers_to, state.sources, sources))):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        key = call_key(x2, state.mma, state.scales, state.zeros, state.bias, group_size, bits, False, None, 1, None,
                       env[0])
        plan = state.plans.get((state.mma, state.scales, state.zeros), key)
        if not isinstance(plan, launch_plan.Plan):
            return None
        return cls(_x_key(x), env, sources, state.versions, plan, state.scales.shape[1])

    def run(self, x: torch.Tensor, sources: tuple, env: tuple) -> torch.Tensor | None:
        """The merged product of an eager call identical to the recorded one (same x layout, environment, config
        tables, member tensors and their versions), else ``None``."""
        if (self.env != env or self.x_key != _x_key(x) or not all(map(operator.is_, self.sources, sources))
                or self.versions != _versions(sources)):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        with on_device(x2):
            return self.plan(x2).reshape(*x.shape[:-1], self.width)


def _x_key(x: torch.Tensor) -> tuple:
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16


def _autotune_if_asked(x, state: MergedWeights, qweights, scales, zeros, *, group_size: int, bits: int) -> None:
    """With ``QUANTPACK_AUTOTUNE=1``, the first call of a stacked shape the config table lacks times the ``mma``
    candidates on the stacked weight (:func:`~quantpack.kernels.mixed_mm.autotune_mma`), each checked first against
    the members' reference products; as :func:`mixed_mm` does for a single weight."""
    n, k = state.scales.shape[1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if not (1 <= x2.shape[0] <= MMA_MAX_M and tunes_on_first_use(x2, False, bits, n, k)):
        return
    want = torch.cat([reference_product(x2, q, s, z, n=s.shape[1], k=k, axis=1, group_size=group_size, bits=bits)
                      for q, s, z in zip(qweights, scales, zeros)], dim=1)
    autotune_mma(x2, state.mma, state.scales, state.zeros, want, group_size=group_size, bits=bits)


# ----------------------------------------------------------------------------------------------
# torch.compile: the merged product as one opaque custom op

@torch.library.custom_op("quantpack::merged_mm", mutates_args=(),
                         schema="(Tensor x, Tensor[] qweights, Tensor[] scales, Tensor[] zeros, Tensor?[] biases, "
                                "int group_size, int bits) -> Tensor")
def merged_mm_op(x, qweights, scales, zeros, biases, group_size, bits):
    """:func:`merged_mm` as the torch custom op ``torch.ops.quantpack.merged_mm`` (inference only: no autograd), for
    ``MergedProjections`` under torch.compile, which decides at trace time to merge. Where :func:`merged_mm` declines
    at run time (a call the ``mma`` path does not take, CUDA-graph capture before the stacked weight exists), each
    member runs through :func:`mixed_mm` and the outputs are concatenated: the same values, at the unmerged cost."""
    out = merged_mm(x, qweights, scales, zeros, biases, group_size=group_size, bits=bits)
    if out is None:
        out = torch.cat([mixed_mm(x, q, s, z, group_size=group_size, bits=bits, axis=1, bias=b)
                         for q, s, z, b in zip(qweights, scales, zeros, biases)], dim=-1)
    return out


@merged_mm_op.register_fake
def _merged_mm_op_fake(x, qweights, scales, zeros, biases, group_size, bits):
    return x.new_empty(*x.shape[:-1], sum(s.shape[1] for s in scales))
