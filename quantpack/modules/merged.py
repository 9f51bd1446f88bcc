"""Merged decode projections: sibling ``QuantLinear`` layers that read one input (q/k/v, gate/up) run as one GEMV.

:func:`merge_projections` links the siblings of each attention and MLP block (``quantpack.load`` and
``from_pretrained`` do it). The model's code is untouched and still calls ``q_proj(h)``, ``k_proj(h)``,
``v_proj(h)``: at decode (at most :data:`MERGE_MAX_M` rows, no gradient wanted) the first member's call computes
the product of all of them in one launch (kernels/merged_mm.py) and returns its columns; its siblings, called next
with the very same tensor, return theirs from it. Anything else, any other input, any other order, a training
step or a prefill, runs each layer alone as before.

The siblings recognize the shared input by identity, and in eager mode also by its version counter, so an input
modified in place between the calls is multiplied again. Under torch.compile only identity can be checked: a
model that modifies the input in place between sibling projections (none in transformers does) must not be
merged (``merge=False``). A block whose siblings turn out to read different inputs (cross-attention) is unmerged
on the first such call.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..kernels.caches import tensor_version
from ..kernels.configs import table_state
from ..kernels.dispatch import MERGE_MAX_M, read_env
from ..kernels.merged_mm import MergedReplay, merged_mm, merged_path
from .linear import QuantLinear

MERGED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedProjections:
    """The link between sibling :class:`QuantLinear` layers (each holds ``_merged = (this, its index)``), and the
    product the first one computed for the others while they have not taken their columns."""

    def __init__(self, members: list[QuantLinear]):
        _mark_merged_path_constant()
        self.members = tuple(members)
        self.widths = [m.out_features for m in members]  # each member's columns of the merged product, in order
        self.unmerged = False  # (set when the siblings were seen reading different inputs)
        self._held = None  # (x, its version, each member's columns of the merged output, calls still to come)
        self._paths = {}  # (rows, device, environment) -> whether merged_mm runs such a call (eager calls)
        self._replay = None  # (the last eager merged call's launch plan: merged_mm.MergedReplay)

    def take(self, index: int, x: torch.Tensor, compiling: bool) -> torch.Tensor | None:
        """Sibling ``index``'s columns of the product the first member's call computed for this very ``x``, or
        ``None``: the sibling then runs alone. ``compiling``: whether torch.compile is tracing the call."""
        held = self._held
        if held is None:
            return None
        if held[0] is x and (compiling or held[1] == tensor_version(x)):
            self._held = (held[0], held[1], held[2], held[3] - 1) if held[3] > 1 else None
            return held[2][index]
        self._held, self.unmerged = None, True  # a sibling read another input: not siblings in this model
        return None

    def compute(self, x: torch.Tensor, compiling: bool) -> torch.Tensor | None:
        """The first member's output for ``x``, from one product of all the members' weights whose other columns
        are held for the siblings' calls; or ``None``: the first member then runs alone."""
        self._held = None
        members = self.members
        first = members[0]
        rows = math.prod(x.shape[:-1]) if x.dim() >= 1 else 0
        if (self.unmerged or not 1 <= rows <= MERGE_MAX_M
                or x.dtype not in (torch.float16, torch.bfloat16)
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None  # (what the mma path never runs, known at trace time too)
        n, k = sum(self.widths), first.in_features
        if compiling:
            # decided at trace time, as a constant of the graph: the rows as a plain int (one graph per row count
            # under dynamic shapes), then the path a call of that size takes
            rows = next(r for r in range(1, MERGE_MAX_M + 1) if rows == r)
            if not merged_path(rows, n, k, first.group_size, first.bits, x.device):
                return None
        else:
            # (what a launch plan's key holds of them; and whether the call is captured in a CUDA graph: outside
            # one, every call at decode merges, its host time being the call's time)
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            env = (read_env(), table_state())
            if not capturing and self._replay is not None:  # (an identical call: its plan in one check)
                sources = self._sources()
                out = self._replay.run(x, sources, env)
                if out is not None:
                    return self._hold(x, out, compiling)
            key = (rows, x.device, *env, capturing)
            known = self._paths.get(key)
            if known is None:
                known = self._paths[key] = merged_path(rows, n, k, first.group_size, first.bits, x.device,
                                                       host_bound=not capturing)
            if not known:
                return None  # (a call that runs each layer alone, decided in one lookup: captured batch-16 gate/up)
        tensors = [m._tensors(compiling) for m in members]
        if x.device != tensors[0][0].device:
            return None
        args = [list(column) for column in zip(*tensors)]  # qweights, scales, zeros, biases
        if compiling:  # (where it declines at run time after all, the op computes each member's product itself)
            out = torch.ops.quantpack.merged_mm(x, *args, first.group_size, first.bits)
        else:
            out = merged_mm(x, *args, group_size=first.group_size, bits=first.bits)
            if out is None:
                return None
            if not capturing:
                self._replay = MergedReplay.of(x, sum(args, []), env, group_size=first.group_size, bits=first.bits)
        return self._hold(x, out, compiling)

    def _hold(self, x: torch.Tensor, out: torch.Tensor, compiling: bool) -> torch.Tensor:
        """Keep each member's columns of ``out`` for the siblings' calls; the first member's."""
        columns = out.split_with_sizes(self.widths, -1)  # (one call for all the views: half the time of slicing)
        self._held = (x, -1 if compiling else tensor_version(x), columns, len(self.members) - 1)
        return columns[0]

    def _sources(self) -> tuple:
        """The members' tensors as merged_mm takes them, flat: qweights, scales, zeros, biases."""
        tensors = [m._tensors(False) for m in self.members]
        return tuple(t for column in zip(*tensors) for t in column)

    def __repr__(self) -> str:
        return f"MergedProjections({len(self.members)} layers, out_features={self.widths})"


@functools.cache
def _mark_merged_path_constant() -> None:
    """Let torch.compile call ``merged_path`` at trace time and put its result in the graph as a constant. Done when
    the first link is made, not on import: marking it imports torch._dynamo, a second of startup."""
    torch.compiler.assume_constant_result(merged_path)


def mergeable(members: list[nn.Module]) -> bool:
    """Whether these layers can be merged: all :class:`QuantLinear` with groups along in-features, one in_features
    (a multiple of 64), bits, group size (a multiple of 64) and scales dtype, and out_features multiples of 16."""
    if not members or not all(isinstance(m, QuantLinear) for m in members):
        return False
    first = members[0]
    return (first.in_features % 64 == 0 and first.group_size % 64 == 0 and first.bits in (4, 8)
            and all(m.axis == 1 and m.in_features == first.in_features and m.bits == first.bits
                    and m.group_size == first.group_size and m.scales.dtype == first.scales.dtype
                    and m.out_features % 16 == 0 for m in members))


def merge_projections(model: nn.Module, names=MERGED_NAMES) -> int:
    """Link the sibling projections of every block of ``model`` whose children named as one of ``names`` (default:
    q_proj/k_proj/v_proj and gate_proj/up_proj, in that call order) are mergeable :class:`QuantLinear` layers;
    returns how many groups were linked. Encoder-decoder models are left alone (their cross-attention reads two
    inputs). Undo with :func:`unmerge_projections`."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return 0
    count = 0
    for module in model.modules():
        for group in names:
            members = [getattr(module, name, None) for name in group]
            if len(members) > 1 and mergeable(members):
                link = MergedProjections(members)
                for i, m in enumerate(members):
                    m._merged = (link, i)
                    m._plans.clear()  # (a plan recorded alone holds the member's own mma copy, which becomes a view)
                count += 1
    return count


def unmerge_projections(model: nn.Module) -> None:
    """Every :class:`QuantLinear` of ``model`` runs alone again."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m._merged = None
