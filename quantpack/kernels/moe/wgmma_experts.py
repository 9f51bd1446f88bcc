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
from ..dequant import on_device
from ..dispatch import Flags, device_props, launch_plans_enabled, wgmma_device
from ..launch_plan import KernelReplays, tensor_key
from ..wgmma_host import WgmmaGrid
from ..wgmma_mm import launch_wgmma
from .mma_experts import MmaExperts, activate, weighted_sum
from .dispatch import wgmma_block_k, wgmma_block_rows, wgmma_shape_fits
from .routing import align_block_size, gather_rows

BLOCK_N = 64  # weight rows (out-features) per program: four warps
STAGES = 3  # TMA ring depth
PRODUCER = False  # a producer warp issuing the copies (wgmma_mm.py)


def wgmma_experts_usable(x: torch.Tensor, gate_up, down) -> bool:
    """Whether :func:`wgmma_experts` runs for x and these experts: a GPU the dense wgmma kernel runs on (Hopper,
    Gluon, QUANTPACK_WGMMA not 0), 16-bit x, experts without bias whose shapes and groups its copies take (see
    wgmma_mm.wgmma_layout_fits)."""
    if not (x.is_cuda and wgmma_device(device_props(x.device), Flags.from_env())):
        return False
    return all(pe.bias is None and pe.scales.dtype == pe.zeros.dtype
               and wgmma_shape_fits(*pe.shape, pe.group_size, pe.bits, x.dtype) for pe in (gate_up, down))


# A prefill's launches replayed to the compiled kernel by call key (per kernel launch_wgmma hands over): Triton's
# binding and specialization cost about as much host time a call as the rest of the block's launches, and the first
# token is the host's
_LAUNCHES: dict = {}


def _grid(pe, rows: int) -> WgmmaGrid:
    return WgmmaGrid(rows, BLOCK_N, wgmma_block_k(pe.group_size), 1, STAGES, BLOCK_N // 16, producer=PRODUCER)


def _project(a: torch.Tensor, pe, block_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, N) float32 = each block of a's rows times its expert's matrix (blocks past the filled ones left
    unwritten)."""
    if isinstance(pe, MmaExperts):
        pe = pe.rows()
    n, k = pe.shape
    out = dequant._alloc((a.shape[0], n), torch.float32, a.device)
    grid = _grid(pe, rows)
    # (the key fixes what Triton specializes on: each tensor's dtype and alignment, the integers derived from the
    # shapes, the compile-time arguments derived from the grid and the group size)
    key = ((tensor_key(a, pe.qweight, pe.scales, pe.zeros, out, block_expert), n, k, pe.group_size, pe.bits, grid)
           if launch_plans_enabled() else None)

    def launch(kernel, programs, *args, **kwargs):
        replays = _LAUNCHES.get(kernel) or _LAUNCHES.setdefault(kernel, KernelReplays(kernel))
        replays(key, (programs[0], 1, 1), a, *args, **kwargs)

    return launch_wgmma(a, pe.qweight, pe.scales, pe.zeros, None, out, out, block_expert, n=n, k=k,
                        group_size=pe.group_size, bits=pe.bits, grid=grid, block_expert=block_expert, launch=launch)


def wgmma_experts(x: torch.Tensor, gate_up: PackedExperts | MmaExperts, down: PackedExperts | MmaExperts,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, activation: str = "silu",
                  alpha: float = 1.702, limit: float = 7.0, weight_on_input: bool = False,
                  block_rows: int | None = None) -> torch.Tensor:
    """:func:`quantpack.reference.experts`'s semantics where :func:`wgmma_experts_usable` holds, for contiguous x
    (T, H), topk_ids and topk_weights (T, k); ``block_rows`` pairs per block (64 or 128; by default
    dispatch.wgmma_block_rows)."""
    tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    block_rows = block_rows or wgmma_block_rows(pairs / gate_up.num_experts)
    with on_device(x):
        sorted_pairs, block_expert, pos = align_block_size(topk_ids, gate_up.num_experts, block_rows,
                                                           positions=True)
        xg = gather_rows(x, sorted_pairs, block_expert, top_k, block_rows, gate_up.num_experts)
        if weight_on_input:  # (x * w rounded to x's dtype, as the reference; the sum then weighs by 1)
            w = topk_weights.reshape(-1).float()[sorted_pairs.clamp(max=pairs - 1)]
            xg = (xg.float() * w[:, None]).to(x.dtype)
            topk_weights = torch.ones_like(topk_weights)
        gu = _project(xg, gate_up, block_expert, block_rows)
        h = activate(gu, x.dtype, activation, alpha, limit)
        del gu
        y = _project(h, down, block_expert, block_rows)
        return weighted_sum(y, pos, topk_ids, topk_weights, x.dtype, gate_up.num_experts)
