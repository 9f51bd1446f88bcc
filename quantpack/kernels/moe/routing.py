"""Sorting (token, slot) pairs into per-expert blocks on the GPU, with no host synchronisation.

The prefill path of the fused expert kernels runs one program per block of ``block_m`` pairs that all go to one
expert. :func:`align_block_size` builds those blocks from ``topk_ids`` with tensor operations whose sizes are known
on the host (an upper bound on the number of blocks), so a step that calls it can be captured in a CUDA graph and
replayed with new routing: programs past the blocks actually filled read an expert id of ``num_experts`` and exit.
"""
from __future__ import annotations

import torch

from ..dequant import cdiv


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks of ``block_m`` pairs that ``pairs`` pairs fill when each expert's pairs start a
    new block: sum over hit experts of ceil(c_e / block_m) < pairs / block_m + (experts hit)."""
    return cdiv(pairs, block_m) + min(num_experts, pairs)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)`` for ``topk_ids`` (T, k): ``sorted_pairs`` (blocks * block_m,) int32 lists the
    flat pair indices ``t * k + slot`` expert by expert, each expert's run padded to a multiple of ``block_m`` with
    the sentinel ``T * k``; ``block_expert`` (blocks,) int32 is the expert of each block, ``num_experts`` for the
    blocks past the last one filled. Pairs whose id lies outside ``[0, num_experts)`` are in no block. ``blocks`` is
    :func:`max_blocks`, from shapes alone."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = max_blocks(pairs, num_experts, block_m)
    capacity = blocks * block_m
    ids = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # unused slots: one bucket past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_key, order = torch.sort(key, stable=True)
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[sorted_key]  # place within its expert
    starts = ends - padded
    dest = torch.where(sorted_key < num_experts, starts[sorted_key.clamp(max=num_experts - 1)] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))  # (unused slots land on the extra last element)
    block_starts = torch.arange(blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs[:capacity], block_expert
