"""Experts blocks whose checkpoint stores the block's own stacked tensors (gpt-oss: ``<block>.gate_up_proj`` (E, H, 2I)
with gate and up interleaved, ``<block>.down_proj`` (E, I, H), and their biases; Llama 4: the same without biases,
gate's columns before up's) seen as one matrix per expert and
projection, the way Mixtral's checkpoints store theirs: ``<block>.<e>.gate_proj.weight`` (I, H), ``...up_proj``,
``...down_proj`` (H, I) and a ``.bias`` for each. The rest of convert then plans, quantizes and writes them as any
per-expert block; each view reads only its expert's slab of the stacked tensor."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reading import SourceCheckpoint, TensorInfo


@dataclass(frozen=True)
class _View:
    stacked: str  # the checkpoint tensor
    expert: int
    part: str  # "even", "odd" (columns 0::2, 1::2), "first", "second" (halves) or "all"
    transpose: bool


class StackedExpertsSource:
    """``src`` with each stacked experts block of ``blocks`` ({block path: (experts, hidden, intermediate,
    interleaved)}) replaced by per-expert views; everything else is ``src``'s. ``interleaved``: gate and up
    alternate along ``gate_up_proj``'s last dimension (gpt-oss), else gate's I columns come first (Llama 4)."""

    def __init__(self, src: SourceCheckpoint, blocks: dict[str, tuple[int, int, int, bool]]):
        self._src = src
        self._views: dict[str, _View] = {}
        infos: dict[str, TensorInfo] = {}
        stacked: set[str] = set()
        for block, (e_n, h, i, interleaved) in blocks.items():
            gate, up = ("even", "odd") if interleaved else ("first", "second")
            parts = {  # stacked tensor -> ((projection, field, part, transpose, shape), ...)
                f"{block}.gate_up_proj": (("gate_proj", "weight", gate, True, (i, h)),
                                          ("up_proj", "weight", up, True, (i, h))),
                f"{block}.gate_up_proj_bias": (("gate_proj", "bias", gate, False, (i,)),
                                               ("up_proj", "bias", up, False, (i,))),
                f"{block}.down_proj": (("down_proj", "weight", "all", True, (h, i)),),
                f"{block}.down_proj_bias": (("down_proj", "bias", "all", False, (h,)),),
            }
            for name, views in parts.items():
                if name not in src.tensors:
                    continue  # (reported as an incomplete block by plan_experts)
                stacked.add(name)
                info = src.tensors[name]
                for e in range(e_n):
                    for proj, field, part, transpose, shape in views:
                        view = f"{block}.{e}.{proj}.{field}"
                        self._views[view] = _View(name, e, part, transpose)
                        numel = 1
                        for d in shape:
                            numel *= d
                        infos[view] = TensorInfo(view, info.file, info.dtype, shape, info.offset,
                                                 numel * info.dtype.itemsize)
        self.tensors = {n: i for n, i in src.tensors.items() if n not in stacked} | infos

    def __getattr__(self, name):  # (config(), weight_files, index_file, close(), ...: the source's)
        return getattr(self._src, name)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a fresh CPU tensor (a view: read from its expert's slab of the stacked tensor)."""
        view = self._views.get(name)
        if view is None:
            return self._src.get(name)
        slab = self._src.get_row(view.stacked, view.expert)
        half = slab.shape[-1] // 2
        slab = {"even": slab[..., 0::2], "odd": slab[..., 1::2], "first": slab[..., :half], "second": slab[..., half:],
                "all": slab}[view.part]
        return (slab.t() if view.transpose else slab).contiguous()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._src.close()


def split_stacked_experts(model, src: SourceCheckpoint):
    """``src`` as :class:`StackedExpertsSource` where ``model`` has experts blocks that ``src`` stores stacked (gpt-oss's
    blocks as transformers builds them, or their :class:`~quantpack.modules.experts.QuantExperts` when ``src`` is the
    reference of a packed checkpoint), else ``src`` itself."""
    from ..modules.experts import QuantExperts, experts_block

    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            if module.source_form != "standard":
                blocks[name] = (module.num_experts, module.hidden_dim, module.intermediate_dim,
                                module.source_form == "gpt_oss")
            continue
        spec = experts_block(module)
        if spec is not None and spec.stacked:
            blocks[name] = (spec.num_experts, spec.hidden, spec.intermediate, spec.form == "gpt_oss")
    return StackedExpertsSource(src, blocks) if blocks else src
