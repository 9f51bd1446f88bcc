"""The kernels section of verify: each distinct quantized layout's forward against its scheme's float32 oracle."""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import checkpoint, schemes
from .integrity import quantized_modules
from .report import KERNEL_ROWS, KERNEL_SEED


@torch.no_grad()
def kernel_errors(model: nn.Module, rows=KERNEL_ROWS, seed: int = KERNEL_SEED) -> dict:
    """For each distinct quantized layout: the module's forward against its float32 oracle on
    random inputs (``rows`` rows each); the relative error is the largest over ``rows``."""
    groups: dict[tuple, list[tuple[str, nn.Module]]] = {}
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for name, module in quantized_modules(model):
        mt = schemes.module_check(module)
        dtype = _module_dtype(module, model_dtype)
        key = (type(module).__name__, module.out_features, module.in_features, str(dtype),
               tuple(sorted(mt.layout(module).items())), getattr(module, "bias", None) is not None)
        groups.setdefault(key, []).append((name, module))
    gen = torch.Generator().manual_seed(seed)
    items, path = [], "reference"
    for key, members in groups.items():
        name, module = members[0]
        mt = schemes.module_check(module)
        dtype = _module_dtype(module, model_dtype)
        device = next(t.device for t in module.buffers())
        if device.type == "cuda":
            path = "triton"  # quantized modules run their fused kernels on CUDA tensors
        worst = 0.0
        for m in rows:
            x = torch.randn(m, module.in_features, generator=gen).to(device, dtype)
            got = module(x).float()
            want = mt.oracle(module, x)
            err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))
            worst = max(worst, err if math.isfinite(err) else float("inf"))
        tol = mt.tolerance(module, dtype)
        items.append({"module_type": key[0], "shape": [module.out_features, module.in_features],
                      "layout": mt.layout(module), "dtype": checkpoint.dtype_name(dtype), "bias": key[5],
                      "example": name, "layers": len(members), "rel_error": worst if math.isfinite(worst) else None,
                      "tolerance": tol, "passed": math.isfinite(worst) and worst <= tol})
    return {"path": path, "rows": list(rows), "seed": seed, "items": items}


def _module_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The compute dtype of a quantized module: that of its floating-point buffers other than
    float32 per-channel scales (W8A8 keeps those in float32), else ``default`` (the model's dtype:
    a W8A8 layer without bias holds no other floating-point tensor)."""
    floats = [b.dtype for n, b in module.named_buffers() if b.is_floating_point() and b.dtype != torch.float32]
    return floats[0] if floats else default
