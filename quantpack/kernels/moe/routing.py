"""Sorting (token, slot) pairs into per-expert blocks on the GPU, with no host synchronisation.

The prefill path of the fused expert kernels runs one program per block of ``block_m`` pairs that all go to one
expert. :func:`align_block_size` builds those blocks from ``topk_ids`` with tensor operations whose sizes are known
on the host (an upper bound on the number of blocks), so a step that calls it can be captured in a CUDA graph and
replayed with new routing: programs past the blocks actually filled read an expert id of ``num_experts`` and exit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dequant
from ..dequant import cdiv, next_power_of_2, on_device, triton_usable
from ..dispatch import launch_plans_enabled
from ..launch_plan import KernelReplays, tensor_key


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks of ``block_m`` pairs that ``pairs`` pairs fill when each expert's pairs start a
    new block: sum over hit experts of ceil(c_e / block_m) < pairs / block_m + (experts hit)."""
    return cdiv(pairs, block_m) + min(num_experts, pairs)


@triton.jit
def _rank_kernel(ids_ptr, counts_ptr, rank_ptr, P, E, BLOCK: tl.constexpr):
    """Each used pair's place among its expert's pairs: counts[e] claimed atomically (the order within an expert's
    blocks is the GPU's, which no result depends on: every row is computed alone)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    ok = (p < P) & (e >= 0) & (e < E)
    rank = tl.atomic_add(counts_ptr + tl.where(ok, e, 0), tl.full((BLOCK,), 1, tl.int32), mask=ok)
    tl.store(rank_ptr + p, rank, mask=ok)


@triton.jit
def _blocks_kernel(counts_ptr, starts_ptr, block_expert_ptr, sorted_ptr, E, BLOCKS, CAPACITY, P,
                   BLOCK_M: tl.constexpr, E_POW: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's first slot (its pairs padded to whole blocks, experts in order), each block's
    expert (``E`` past the filled ones), and every slot set to the sentinel ``P`` before the pairs are placed."""
    e = tl.arange(0, E_POW)
    real = e < E
    padded = (tl.load(counts_ptr + e, mask=real, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + e, ends - padded, mask=real)
    for b0 in range(0, BLOCKS, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]  # experts ending at or before the block
        tl.store(block_expert_ptr + b, tl.sum(done.to(tl.int32), axis=1), mask=b < BLOCKS)
    for i0 in range(0, CAPACITY, CHUNK * E_POW):
        i = i0 + tl.arange(0, CHUNK * E_POW)
        tl.store(sorted_ptr + i, tl.full((CHUNK * E_POW,), 0, tl.int32) + P, mask=i < CAPACITY)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, pos_ptr, P, E, BLOCK: tl.constexpr):
    """Each used pair into its slot; ``pos[p]`` that slot (0 for an unused pair)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    ok = (p < P) & (e >= 0) & (e < E)
    dest = tl.load(starts_ptr + tl.where(ok, e, 0), mask=ok, other=0) + tl.load(rank_ptr + p, mask=ok, other=0)
    tl.store(sorted_ptr + dest, p, mask=ok)
    tl.store(pos_ptr + p, tl.where(ok, dest, 0), mask=p < P)


@triton.jit
def _gather_kernel(x_ptr, sorted_ptr, block_expert_ptr, out_ptr, H, P, E, TOP_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the blocks: x's row of the token of pair sorted[r], zeros for a padding slot (the sentinel P); rows of
    blocks past the filled ones (expert E) are left alone: no kernel reads them."""
    r = tl.program_id(0)
    if tl.load(block_expert_ptr + r // BLOCK_M) < E:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        p = tl.load(sorted_ptr + r)
        ok = p < P
        t = tl.where(ok, p // TOP_K, 0).to(tl.int64)
        mask = cols < H
        m = mask & ((tl.zeros_like(cols) + ok.to(tl.int32)) != 0)  # (a block mask: the interpreter's & with a
        # scalar flag is not one)
        v = tl.load(x_ptr + t * H + cols, mask=m, other=0.0)
        tl.store(out_ptr + r.to(tl.int64) * H + cols, v, mask=mask)


PAIR_BLOCK = 1024  # pairs per program of the rank and place kernels
GATHER_BLOCK = 1024  # columns per program of the gather
_RANK, _BLOCKS, _PLACE, _GATHER = (KernelReplays(k) for k in (_rank_kernel, _blocks_kernel, _place_kernel,
                                                               _gather_kernel))  # (prefill and eager decode call
# them once a layer: Triton's binding would be most of their host time)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, positions: bool = False):
    """``(sorted_pairs, block_expert)`` for ``topk_ids`` (T, k): ``sorted_pairs`` (blocks * block_m,) int32 lists the
    flat pair indices ``t * k + slot`` expert by expert, each expert's run padded to a multiple of ``block_m`` with
    the sentinel ``T * k``; ``block_expert`` (blocks,) int32 is the expert of each block, ``num_experts`` for the
    blocks past the last one filled. Pairs whose id lies outside ``[0, num_experts)`` are in no block. ``blocks`` is
    :func:`max_blocks`, from shapes alone. With ``positions``, also ``pos`` (T * k,) int32: each pair's index in
    ``sorted_pairs`` (0 for a pair in no block). Three Triton launches where Triton runs (the order of an expert's
    pairs is then the GPU's), torch's sort otherwise."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = max_blocks(pairs, num_experts, block_m)
    capacity = blocks * block_m
    if triton_usable(topk_ids):
        ids = topk_ids.reshape(-1)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        rank = dequant._alloc((pairs,), torch.int32, device)
        starts = dequant._alloc((num_experts,), torch.int32, device)
        sorted_pairs = dequant._alloc((capacity,), torch.int32, device)
        block_expert = dequant._alloc((blocks,), torch.int32, device)
        pos = dequant._alloc((pairs,), torch.int32, device)
        grid = (cdiv(pairs, PAIR_BLOCK), 1, 1)
        # (every integer follows from ids' shape, num_experts and block_m; the other tensors are fresh allocations)
        key = (tensor_key(ids), num_experts, block_m) if launch_plans_enabled() else None
        with on_device(topk_ids):
            _RANK(key, grid, ids, ids, counts, rank, pairs, num_experts, BLOCK=PAIR_BLOCK, num_warps=4)
            _BLOCKS(key, (1, 1, 1), ids, counts, starts, block_expert, sorted_pairs, num_experts, blocks, capacity,
                    pairs, BLOCK_M=block_m, E_POW=next_power_of_2(num_experts), CHUNK=32, num_warps=4)
            _PLACE(key, grid, ids, ids, rank, starts, sorted_pairs, pos, pairs, num_experts, BLOCK=PAIR_BLOCK,
                   num_warps=4)
        return (sorted_pairs, block_expert, pos) if positions else (sorted_pairs, block_expert)
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
    if not positions:
        return sorted_pairs[:capacity], block_expert
    pos = torch.zeros(pairs, dtype=torch.int32, device=device)
    pos[order] = torch.where(dest < capacity, dest, 0).to(torch.int32)
    return sorted_pairs[:capacity], block_expert, pos


def gather_rows(x: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor, top_k: int,
                block_m: int, num_experts: int) -> torch.Tensor:
    """(len(sorted_pairs), H): x's (T, H) rows in the order of :func:`align_block_size`'s blocks, each pair's row
    being its token's, a padding slot's zeros; rows of the blocks past the filled ones are unset (no kernel reads
    them). One Triton launch where Triton runs."""
    rows, (tokens, hidden) = sorted_pairs.numel(), x.shape
    pairs = tokens * top_k
    if triton_usable(x):
        out = dequant._alloc((rows, hidden), x.dtype, x.device)
        key = (tensor_key(x, sorted_pairs, block_expert), top_k, block_m, num_experts) if launch_plans_enabled() \
            else None
        with on_device(x):
            _GATHER(key, (rows, cdiv(hidden, GATHER_BLOCK), 1), x, x, sorted_pairs, block_expert, out, hidden, pairs,
                    num_experts, TOP_K=top_k, BLOCK_M=block_m, BLOCK=GATHER_BLOCK, num_warps=4)
        return out
    valid = sorted_pairs < pairs
    token = torch.where(valid, sorted_pairs // top_k, 0).to(torch.int64)
    return torch.where(valid[:, None], x.index_select(0, token), 0)
