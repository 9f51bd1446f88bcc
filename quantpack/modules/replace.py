"""Swap a model's linear layers (and experts blocks) for the quantized modules of its checkpoint's scheme, on the
meta device: what :func:`quantpack.load`, the transformers quantizer and ``verify`` build before reading tensors."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import schemes
from ..checkpoint import CheckpointError
from .experts import PROJECTIONS, QuantExperts, experts_block, route_llama4_moe
from .linear import linear_dims


def tied_targets(model) -> set[str]:
    """Parameters that ``tie_weights`` points at another parameter (e.g. ``lm_head.weight``)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and hasattr(model, "get_expanded_tied_weights_keys"):
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return set(keys or {})


def linear_modules_to_convert(model: nn.Module, qc: dict) -> list[str]:
    """Names of the linear modules (``nn.Linear``, GPT-2's ``Conv1D``) a packed checkpoint stores
    quantized: all but those in ``modules_not_converted`` and those whose weight is tied to another (a
    tied ``lm_head`` is never quantized, nor stored)."""
    skip = set(qc["modules_not_converted"]) | {n.removesuffix(".weight") for n in tied_targets(model)}
    return [n for n, m in model.named_modules() if linear_dims(m) is not None and n not in skip]


def replace_linear_layers(model: nn.Module, qc: dict, names: list[str],
                          dtype_for: Callable[[str], torch.dtype]) -> None:
    """Swap each linear module in ``names`` for the module of ``qc``'s scheme, built on meta.
    ``dtype_for(name)`` is that module's compute dtype (its scales/zeros/bias). A replaced ``Conv1D``
    becomes the same ``x @ W.T + b`` module (the checkpoint stores W as (out, in) like any linear);
    ``source_transposed`` on it records that the source stored (in, out)."""
    build = schemes.get(qc["scheme"]).build
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = build(name, old, qc, dtype_for(name))
        new.source_transposed = linear_dims(old)[2]
        setattr(parent, child, new)
    for name in qc.get("quantized_experts") or []:
        replace_experts(model, name, qc, dtype_for(f"{name}.gate_proj.0"))


def replace_experts(model: nn.Module, name: str, qc: dict, dtype: torch.dtype) -> None:
    """Swap the experts block ``name`` for a :class:`~quantpack.modules.experts.QuantExperts` on meta."""
    try:
        old = model.get_submodule(name)
    except AttributeError:
        old = None
    block = experts_block(old) if old is not None else None
    if block is None:
        raise CheckpointError(f"config.json: quantization_config.quantized_experts lists {name}, which is not an "
                              f"experts block of {type(model).__name__}; the checkpoint does not match its config: "
                              f"re-convert")
    matrices = [f"{name}.{proj}.{e}" for proj in PROJECTIONS for e in range(block.num_experts)]
    bits = {qc["bits_overrides"].get(m, qc["bits"]) for m in matrices}
    if len(bits) > 1:
        raise CheckpointError(f"config.json: quantization_config.bits_overrides gives the experts of {name} "
                              f"{len(bits)} bit widths; an experts block is quantized whole with one: re-convert")
    if qc["axis"] != 1:
        raise CheckpointError(f"config.json: quantization_config.axis={qc['axis']} with the experts block {name}; "
                              f"experts are packed with groups along in-features (axis 1): re-convert")
    new = QuantExperts(block.num_experts, block.hidden, block.intermediate, activation=block.activation,
                       alpha=block.alpha, limit=block.limit, bias=block.bias, weight_on_input=block.weight_on_input,
                       bits=bits.pop(), group_size=qc["group_size"], dtype=dtype, device="meta",
                       source_form=block.form)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
    if block.form == "llama4" and not route_llama4_moe(parent):
        raise CheckpointError(f"{name}: Llama 4 experts inside a {type(parent).__name__}, which quantpack cannot "
                              f"route; the checkpoint does not match this transformers version's model")
