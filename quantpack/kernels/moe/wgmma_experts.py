"""Experts at prefill on Hopper: the dense wgmma kernel (wgmma_mm.py) over per-expert blocks of rows, each expert's
weights dequantized in registers as the dense prefill's are, so no 16-bit copy of the experts is ever written.

At prefill each hit expert serves many (token, slot) pairs and its GEMMs are compute-bound; dequantizing every
expert to 16 bits first (grouped.py) writes and reads back four times the packed bytes before torch's grouped GEMM
starts. Here the pairs are sorted into blocks of 64 or 128 per expert on the GPU (routing.py), x's rows gathered
in that order, and each projection is one launch of the wgmma kernel whose programs take their expert from their
block. gate_up's float32 rows are activated by one small kernel, down's float32 rows summed per token with the top-k
weights by another (mma_experts.py's). Nothing waits for the GPU. Experts kept in the mma layout (decode's) are read
back to the checkpoint's layout first: one pass over their packed bytes.
"""
from __future__ import annotations

import torch

from ...format import PackedExperts
from .. import dequant
from ..dequant import cdiv, on_device
from ..wgmma_host import WgmmaGrid
from ..wgmma_mm import launch_wgmma_grouped, wgmma_layout_fits
from .activation import ACTIVATIONS
from .mma_experts import ACT_BLOCK, SUM_BLOCK, MmaExperts, _activate_kernel, _weighted_sum_kernel
from .dispatch import wgmma_block_rows
from .routing import align_block_size

BLOCK_N = 64  # weight rows (out-features) per program: four warps
STAGES = 3  # TMA ring depth
PRODUCER = False  # a producer warp issuing the copies (wgmma_mm.py)


def wgmma_experts_usable(x: torch.Tensor, gate_up, down) -> bool:
    """Whether :func:`wgmma_experts` runs for x and these experts: a Hopper GPU with Gluon, 16-bit x, experts
    without bias whose shapes and groups the wgmma kernel's copies take (see wgmma_mm.wgmma_layout_fits)."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9):
        return False
    for pe in (gate_up, down):
        n, k = pe.shape
        if (pe.bias is not None or pe.scales.dtype != pe.zeros.dtype
                or not wgmma_layout_fits(n, k, pe.group_size, pe.bits, 1, x.dtype)
                or k % _grid(pe).block_k):
            return False
    return True


def _grid(pe, rows: int = 64) -> WgmmaGrid:
    block_k = 128 if pe.group_size % 128 == 0 else 64
    return WgmmaGrid(rows, BLOCK_N, block_k, 1, STAGES, BLOCK_N // 16, producer=PRODUCER)


def _project(a: torch.Tensor, pe, block_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, N) float32 = each block of a's rows times its expert's matrix (blocks past the filled ones left
    unwritten)."""
    if isinstance(pe, MmaExperts):
        pe = pe.rows()
    n, k = pe.shape
    out = dequant._alloc((a.shape[0], n), torch.float32, a.device)
    return launch_wgmma_grouped(a, pe.qweight, pe.scales, pe.zeros, out, block_expert, n=n, k=k,
                                group_size=pe.group_size, bits=pe.bits, grid=_grid(pe, rows))


def wgmma_experts(x: torch.Tensor, gate_up: PackedExperts | MmaExperts, down: PackedExperts | MmaExperts,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, activation: str = "silu",
                  alpha: float = 1.702, limit: float = 7.0, weight_on_input: bool = False,
                  block_rows: int | None = None) -> torch.Tensor:
    """:func:`quantpack.reference.experts`'s semantics where :func:`wgmma_experts_usable` holds, for contiguous x
    (T, H), topk_ids and topk_weights (T, k); ``block_rows`` pairs per block (64 or 128; by default
    dispatch.wgmma_block_rows)."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    inter = gate_up.shape[0] // 2
    block_rows = block_rows or wgmma_block_rows(pairs / gate_up.num_experts)
    with on_device(x):
        sorted_pairs, block_expert, pos = align_block_size(topk_ids, gate_up.num_experts, block_rows,
                                                           positions=True)
        rows = sorted_pairs.numel()
        valid = sorted_pairs < pairs
        token = torch.where(valid, sorted_pairs // top_k, 0).to(torch.int64)
        xg = x.index_select(0, token)  # (a padding row is token 0's: its results are never read)
        if weight_on_input:  # (x * w rounded to x's dtype, as the reference; the sum then weighs by 1)
            w = topk_weights.reshape(-1).float()[torch.where(valid, sorted_pairs, 0).to(torch.int64)]
            xg = (xg.float() * w[:, None]).to(x.dtype)
            topk_weights = torch.ones_like(topk_weights)
        gu = _project(xg, gate_up, block_expert, block_rows)
        h = dequant._alloc((rows, inter), x.dtype, x.device)
        _activate_kernel[(rows, cdiv(inter, ACT_BLOCK))](gu, h, rows, inter, 1, float(alpha), float(limit),
                                                         ACT=ACTIVATIONS[activation], BLOCK=ACT_BLOCK, num_warps=4)
        del gu
        y = _project(h, down, block_expert, block_rows)
        out = dequant._alloc((tokens, hidden), x.dtype, x.device)
        _weighted_sum_kernel[(tokens, cdiv(hidden, SUM_BLOCK))](
            y, pos, topk_ids, topk_weights, out, top_k, hidden, rows, 1, gate_up.num_experts, HAS_POS=True,
            BLOCK=SUM_BLOCK, num_warps=4)
    return out
