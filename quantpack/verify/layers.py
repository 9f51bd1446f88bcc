"""The layers section of verify: each quantized layer dequantized and compared with the reference weight."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import checkpoint, schemes
from ..quantization import sinq
from .integrity import quantized_modules, reference_name, reference_weight
from .report import WORST_LAYERS


@torch.no_grad()
def _sinq_rescale(model: nn.Module, reference: checkpoint.SourceCheckpoint, manifest: dict | None,
                  prefix: str) -> dict:
    """For a ``sinq`` conversion, the column/row factors it applied to each weight (recomputed from
    the reference and the choices the manifest records); else empty."""
    settings = (manifest or {}).get("settings") or {}
    if settings.get("method") != "sinq" or not settings.get("sinq_scales"):
        return {}
    names = {f"{n}.weight" for n, _ in quantized_modules(model)} | {n for n, _ in model.named_parameters()}
    located = {n: reference_name(reference, n, prefix) for n in names}
    located = {n: r for n, r in located.items() if r is not None}
    rescale, _ = sinq.plan(located, lambda n: reference.get(located[n]), model, bits=None, group_size=None,
                           kept=settings["sinq_scales"])
    return rescale


@torch.no_grad()
def layer_errors(model: nn.Module, reference: checkpoint.SourceCheckpoint, manifest: dict | None,
                 worst: int = WORST_LAYERS, on_layer: Callable[[str], None] | None = None) -> dict:
    """Relative error ``||W - dequantize(Q)||_F / ||W||_F`` (float32) of every quantized layer
    (``on_layer(name)`` is called after each one)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    recorded = {x["name"]: x for x in (manifest or {}).get("layers") or []}
    items, missing = [], []
    rescale = _sinq_rescale(model, reference, manifest, prefix)
    for name, module in quantized_modules(model):
        # (one expert's matrix comes from a checkpoint tensor of another name, which the manifest records)
        ref_name = reference_name(reference, recorded.get(name, {}).get("source", name) + ".weight", prefix)
        if ref_name is None:
            missing.append(name)
            continue
        deq = schemes.module_check(module).dequantize(module).float()
        w = reference_weight(reference, ref_name, module).to(deq.device, torch.float32)
        if f"{name}.weight" in rescale:  # method sinq: the codes are of the weight with its scales absorbed
            w = sinq.scale_tensor(w, *(None if x is None else x.to(w.device) for x in rescale[f"{name}.weight"]))
        if tuple(w.shape) != tuple(deq.shape):
            raise ValueError(f"reference: {ref_name} has shape {list(w.shape)} but the packed layer {name} is "
                             f"{list(deq.shape)}; pass the checkpoint it was converted from")
        err = float(torch.linalg.vector_norm(deq - w) / torch.linalg.vector_norm(w).clamp_min(1e-30))
        rec = recorded.get(name, {})
        bits = getattr(module, "bits", None) or schemes.module_check(module).layout(module).get("bits")
        items.append({"name": name, "shape": list(deq.shape), "bits": bits,
                      "group_size": getattr(module, "group_size", None), "rel_error": err,
                      "manifest_rel_error": rec.get("rel_error")})
        del deq, w
        if on_layer is not None:
            on_layer(name)
    if not items:
        return {"count": 0, "mean_rel_error": None, "max_rel_error": None, "worst": [], "items": [], "missing": missing}
    errors = [x["rel_error"] for x in items]
    ranked = sorted(items, key=lambda x: -x["rel_error"])
    return {"count": len(items), "mean_rel_error": sum(errors) / len(errors), "max_rel_error": max(errors),
            "worst": ranked[:worst], "items": items, "missing": missing}
