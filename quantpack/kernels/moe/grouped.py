"""Experts for many tokens per expert (prefill): dequantize, then a grouped GEMM.

At prefill each hit expert serves many (token, slot) pairs, so the GEMMs are compute-bound and the weights are read
once whatever their format: the dequantized weights cost one extra pass over memory (a fraction of the GEMM time),
after which the tensor cores run torch's own grouped GEMM (``torch._grouped_mm``) at bf16 speed. The pairs are sorted
by expert on the device; experts are dequantized a consecutive range at a time so that the 16-bit copy never exceeds
``scratch_bytes``. The range boundaries are read on the host (one sync per call): prefill is never captured in a
CUDA graph (decode steps run :func:`~quantpack.kernels.moe.fused_experts.fused_experts`'s kernels instead).
"""
from __future__ import annotations

import torch

from ... import reference
from ...format import PackedExperts
from ..dequant import dequantize

SCRATCH_BYTES = 512 * 2 ** 20  # the largest 16-bit copy of experts' weights one call holds at a time
GROUPED_DTYPES = (torch.bfloat16,)


def grouped_usable(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_experts` can run on ``x``: torch has ``_grouped_mm``, x is bf16 (what it multiplies)
    and, on a GPU, the GPU is a Hopper or newer (sm_90+), where torch implements it."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_DTYPES:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device)[0] >= 9
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


def grouped_experts(x: torch.Tensor, gate_up: PackedExperts, down: PackedExperts, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, *, activation: str = "silu", alpha: float = 1.702,
                    limit: float = 7.0, weight_on_input: bool = False,
                    scratch_bytes: int = SCRATCH_BYTES) -> torch.Tensor:
    """:func:`quantpack.reference.experts`'s semantics for ``x`` where :func:`grouped_usable` holds: pairs sorted by
    expert, each range of experts dequantized to x's dtype and multiplied with ``torch._grouped_mm`` (gate_up, the
    activation in float32, ``h`` rounded to x's dtype, down), weighted and summed per token in float32."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    experts = gate_up.num_experts
    ids = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((ids >= 0) & (ids < experts), ids, experts)  # unused slots sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=experts + 1)[:experts]
    token = order // top_k
    pair_w = topk_weights.reshape(-1)[order].float()
    rows = x[token]
    if weight_on_input:
        rows = (rows.float() * pair_w[:, None]).to(x.dtype)
    out = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
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
