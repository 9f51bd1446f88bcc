"""``QuantExperts``: the mixture-of-experts block of transformers 5 (``MixtralExperts``,
``Qwen3MoeExperts``, ...: 3-D ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)) over packed
weights, one :class:`~quantpack.modules.linear.QuantLinear` per expert and projection.

Checkpoints store those experts one matrix per expert and projection (``experts.<e>.w1`` or
``experts.<e>.gate_proj``), which is what quantpack quantizes; the 3-D tensors only exist in memory.
"""
from __future__ import annotations

import torch
from torch import nn

from .linear import QuantLinear

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fused_experts_dims(module: nn.Module) -> tuple[int, int, int] | None:
    """``(num_experts, hidden, intermediate)`` of a transformers experts block with the standard
    forward (``down(act(gate(x)) * up(x))`` per expert): parameters exactly ``gate_up_proj``
    (E, 2I, H) and ``down_proj`` (E, H, I), and an ``act_fn``; ``None`` for anything else (biased or
    interleaved variants are not this block)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or not hasattr(module, "act_fn"):
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return None
    return e, h, two_i // 2


class QuantExperts(nn.Module):
    """Drop-in replacement for a transformers experts block: same ``forward(hidden_states,
    top_k_index, top_k_weights)``, with ``gate_proj[e]``, ``up_proj[e]`` and ``down_proj[e]`` as
    frozen :class:`QuantLinear` layers (state-dict names ``gate_proj.<e>.qweight`` ...)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn, *, bits: int = 4,
                 group_size: int | None = 128, axis: int = 1, dtype: torch.dtype = torch.float16,
                 device=None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.act_fn = act_fn
        shapes = {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                  "down_proj": (intermediate, hidden)}
        for proj in PROJECTIONS:
            k, n = shapes[proj]
            setattr(self, proj, nn.ModuleList(
                QuantLinear(k, n, bits=bits, group_size=group_size, axis=axis, bias=False, dtype=dtype, device=device)
                for _ in range(num_experts)))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)[:self.num_experts]
            hit = counts.nonzero().flatten().tolist()  # (an index == num_experts marks an unused slot)
        for e in hit:
            token_idx, slot = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            h = self.act_fn(self.gate_proj[e](x)) * self.up_proj[e](x)
            h = self.down_proj[e](h) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        q = self.gate_proj[0]
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"bits={q.bits}, group_size={q.group_size}")
