"""Experts for many tokens per expert (prefill): dequantize, then a grouped GEMM.

At prefill each hit expert serves many (token, slot) pairs, so the GEMMs are compute-bound and the weights are read
once whatever their format: the dequantized weights cost one extra pass over memory (a fraction of the GEMM time),
after which the tensor cores run torch's own grouped GEMM (``torch._grouped_mm``) at bf16 speed. The pairs are sorted
by expert on the device, and the 16-bit copy of the weights never exceeds ``scratch_bytes``:

* every expert of a projection at once, its out-features a slice at a time where the whole does not fit (the mma
  layout dequantizes any slice of 16-column tiles; the checkpoint's layout only the whole): the GEMMs' row groups
  come from the device's per-expert counts, so nothing waits for the GPU. A prefill that waits once a layer runs its
  host work and its GPU work one after the other instead of side by side.
* otherwise (the checkpoint's layout, too large to dequantize whole), a consecutive range of experts at a time, whose
  row boundaries are read on the host (one sync per call).

Prefill is never captured in a CUDA graph (decode steps run :func:`~quantpack.kernels.moe.fused_experts.fused_experts`'s
kernels instead).
"""
from __future__ import annotations

import torch

from ... import reference
from ...format import PackedExperts
from ..dequant import dequantize
from ..dispatch import device_props

SCRATCH_BYTES = 1024 * 2 ** 20  # the largest 16-bit copy of experts' weights one call holds at a time
GROUPED_DTYPES = (torch.bfloat16,)


def grouped_usable(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_experts` can run on ``x``: torch has ``_grouped_mm``, x is bf16 (what it multiplies)
    and, on a GPU, the GPU is a Hopper or newer (sm_90+), where torch implements it."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_DTYPES:
        return False
    if x.device.type == "cuda":
        return device_props(x.device).capability[0] >= 9
    return x.device.type == "cpu"


def _dense_range(pe: PackedExperts, e0: int, e1: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``e0 .. e1 - 1`` of ``pe`` as one (e1 - e0, K, N) view of their dense weights in ``dtype``: the
    stacked packed tensors of the range read as one (E' K, N) matrix (groups never straddle two experts), dequantized
    in one launch to (N, E' K), viewed back per expert."""
    n, k = pe.shape
    count = e1 - e0
    if not isinstance(pe, PackedExperts):  # (the mma layout: its own dequantization kernel)
        from .mma_experts import mma_dequantize

        return mma_dequantize(pe, e0, e1, dtype)
    dense = dequantize(pe.qweight[e0:e1].reshape(-1, n), pe.scales[e0:e1].reshape(-1, n),
                       pe.zeros[e0:e1].reshape(-1, n), group_size=pe.group_size, bits=pe.bits, out_dtype=dtype)
    return dense.view(n, count, k).permute(1, 2, 0)


def _sliceable(pe, scratch_bytes: int) -> bool:
    """Whether every expert of ``pe`` can be dequantized at once within ``scratch_bytes``, a slice of out-features
    at a time: any projection in the mma layout (down to 16 columns a slice), the checkpoint's layout whole only."""
    n, k = pe.shape
    columns = 16 if not isinstance(pe, PackedExperts) else n
    return 2 * pe.num_experts * k * columns <= scratch_bytes


def _all_experts_mm(a: torch.Tensor, pe, offs: torch.Tensor, dtype: torch.dtype, scratch_bytes: int) -> torch.Tensor:
    """``torch._grouped_mm(a, every expert of pe dense, offs)``, the experts dequantized to ``dtype`` a slice of
    out-features at a time so that a slice's 16-bit copy stays within ``scratch_bytes`` (see :func:`_sliceable`)."""
    n, k = pe.shape
    if 2 * pe.num_experts * k * n <= scratch_bytes:
        return torch._grouped_mm(a, _dense_range(pe, 0, pe.num_experts, dtype), offs=offs)
    from .mma_experts import mma_dequantize

    step = max(16, scratch_bytes // (2 * pe.num_experts * k) // 16 * 16)
    return torch.cat([torch._grouped_mm(a, mma_dequantize(pe, 0, pe.num_experts, dtype, n0, min(n, n0 + step)),
                                        offs=offs) for n0 in range(0, n, step)], dim=1)


def grouped_experts(x: torch.Tensor, gate_up: PackedExperts, down: PackedExperts, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, *, activation: str = "silu", alpha: float = 1.702,
                    limit: float = 7.0, weight_on_input: bool = False,
                    scratch_bytes: int = SCRATCH_BYTES) -> torch.Tensor:
    """:func:`quantpack.reference.experts`'s semantics for ``x`` where :func:`grouped_usable` holds: pairs sorted by
    expert, the experts (all, a slice of out-features at a time, or a range of experts at a time: see the module)
    dequantized to x's dtype and multiplied with ``torch._grouped_mm`` (gate_up, the activation in float32, ``h``
    rounded to x's dtype, down), weighted and summed per token in float32."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    experts = gate_up.num_experts
    ids = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((ids >= 0) & (ids < experts), ids, experts)  # unused slots sort last
    order = torch.argsort(key, stable=True)
    # (not torch.bincount, which reads the largest id on the host: a sync)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:experts]
    token = order // top_k
    pair_w = topk_weights.reshape(-1)[order].float()
    rows = x[token]
    if weight_on_input:
        rows = (rows.float() * pair_w[:, None]).to(x.dtype)
    out = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
    if _sliceable(gate_up, scratch_bytes) and _sliceable(down, scratch_bytes):
        # Every expert at once: no host sync. Rows of unused slots sort last, past the last group, where the grouped
        # GEMM writes nothing defined: they are dropped before the sum.
        sorted_key = key[order]
        expert_of_row = sorted_key.clamp(max=experts - 1)
        offs = counts.cumsum(0).to(torch.int32)
        gu = _all_experts_mm(rows, gate_up, offs, x.dtype, scratch_bytes).float()
        if gate_up.bias is not None:
            gu += gate_up.bias[expert_of_row].float()
        h = reference.expert_activation(gu, activation, alpha=alpha, limit=limit).to(x.dtype)
        del gu
        y = _all_experts_mm(h, down, offs, x.dtype, scratch_bytes).float()
        if down.bias is not None:
            y += down.bias[expert_of_row].float()
        if not weight_on_input:
            y *= pair_w[:, None]
        out.index_add_(0, token, torch.where((sorted_key < experts)[:, None], y, 0.0))
        return out.to(x.dtype)
    per_expert = 2 * (gate_up.shape[0] * gate_up.shape[1] + down.shape[0] * down.shape[1])  # 16-bit bytes
    span = max(1, scratch_bytes // per_expert)
    counts_host = counts.tolist()  # (the one host sync: where each range of experts' rows starts and ends)
    row0 = 0
    for e0 in range(0, experts, span):
        e1 = min(experts, e0 + span)
        row1 = row0 + sum(counts_host[e0:e1])
        if row1 == row0:
            continue
        offs = counts[e0:e1].cumsum(0).to(torch.int32)
        expert_of_row = torch.repeat_interleave(torch.arange(e0, e1, device=x.device), counts[e0:e1],
                                                output_size=row1 - row0)
        a = rows[row0:row1]
        gu = torch._grouped_mm(a, _dense_range(gate_up, e0, e1, x.dtype), offs=offs).float()
        if gate_up.bias is not None:
            gu += gate_up.bias[expert_of_row].float()
        h = reference.expert_activation(gu, activation, alpha=alpha, limit=limit).to(x.dtype)
        del gu
        y = torch._grouped_mm(h, _dense_range(down, e0, e1, x.dtype), offs=offs).float()
        if down.bias is not None:
            y += down.bias[expert_of_row].float()
        if not weight_on_input:
            y *= pair_w[row0:row1, None]
        out.index_add_(0, token[row0:row1], y)
        row0 = row1
    return out.to(x.dtype)
