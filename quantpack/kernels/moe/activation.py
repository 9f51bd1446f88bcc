"""The experts' activation of gate and up, as a Triton function the expert kernels inline (their epilogues, or the
loads of the next projection's input): :func:`quantpack.reference.expert_activation`'s formulas in float32."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import reference

ACTIVATIONS = {name: i for i, name in enumerate(reference.EXPERT_ACTIVATIONS)}  # the kernels' ACT codes


@triton.jit
def expert_activation(g, u, ACT: tl.constexpr, alpha, limit):
    """``h`` from the gate and up accumulators (float32), as reference.expert_activation."""
    if ACT == 0:  # silu
        h = g * tl.sigmoid(g) * u
    elif ACT == 1:  # gelu (erf)
        h = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:  # gelu (tanh), tanh(v) = 2 sigmoid(2v) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        h = 0.5 * g * (2.0 * tl.sigmoid(2.0 * inner)) * u
    else:  # swiglu_oai: clamped gate and up
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * g * tl.sigmoid(alpha * g)
    return h
