"""Which expert kernel runs: decode (``pairs``) or prefill (``sorted``), its tiles, and why.

* ``pairs``: one program per (token, slot) pair and column tile, GEMV-style on CUDA cores; no sorting at all. Each
  program reads its expert's packed weights for its columns once. Wins where few pairs share an expert (decode).
* ``sorted``: pairs sorted into blocks of ``block_m`` per expert on the GPU (routing.py), one program per block and
  column tile on tensor cores: each hit expert's weights are read once per block of pairs. Between decode and
  prefill, and at prefill where the grouped path cannot run.
* ``grouped``: many pairs per expert, bf16, a GPU where torch has a grouped GEMM (sm_90+), outside CUDA-graph
  capture: the experts are dequantized a range at a time and multiplied by ``torch._grouped_mm`` (grouped.py); the
  GEMMs are compute-bound there, so tensor-core GEMMs at bf16 speed beat dequantizing in registers.
* ``wgmma``: many pairs per expert on Hopper, where the dense prefill's wgmma kernel takes the experts' shapes:
  pairs sorted into blocks of 64 or 128 per expert on the GPU, each projection one launch of that kernel with the
  weights dequantized in registers (wgmma_experts.py): no 16-bit copy of the experts and no host sync (capturable).
* ``mma``: experts kept in the mma layout (what a GPU block gets where it fits, mma_experts.py) run the dense
  tensor-core decode GEMV per expert in place of ``pairs`` (``block_m`` 1) and ``sorted`` (blocks of 16).

:func:`choose` decides from the call's shape alone (no tuned table yet); :func:`explain` words it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..dequant import cdiv, interpreting
from ..dispatch import DeviceProps, Flags, device_props, experts_pdl, wgmma_device
from ..wgmma_mm import wgmma_layout_fits
from .mma_experts import SUMMED_BY_DOWN_MAX_TOKENS, mma_experts_grid
from .routing import max_blocks

__all__ = ["ExpertsConfig", "ExpertsDecision", "choose", "explain", "PAIRS_PER_EXPERT", "PAIRS_MAX",
           "GROUPED_PER_EXPERT", "GROUPED_PER_EXPERT_MMA", "WGMMA_PER_EXPERT", "WGMMA_PER_EXPERT_MMA",
           "wgmma_block_rows"]

PAIRS_PER_EXPERT = 2  # the pairs path runs while the pairs average at most this many per expert (beyond, sorting
# into blocks reads each hit expert's weights once instead of once per pair)
PAIRS_MAX = 256  # ... and while there are at most this many pairs (its CUDA-core math grows with the pairs)
PAIRS_WAVES = 4  # programs per SM the pairs path aims at (column tiles, then K split)
MIN_SPLIT_STEPS = 4  # K steps a split program runs at least
GROUPED_PER_EXPERT = 32  # the grouped path runs from this many pairs per expert on average (measured on an H200:
# at 32 and more the sorted kernel ran at 0.12-0.36x bf16's grouped GEMM, bound by its tensor-core tiles)
GROUPED_PER_EXPERT_MMA = 128  # ... from this many with the experts in the mma layout (H200: its sorted blocks of 16
# ran 1.9-3.0x faster than dequantize + grouped GEMM at 32 pairs per expert, 2.0x slower at 512; at 128, Qwen3-30B-A3B's
# 2048-token first token took 179 ms with the grouped path and 231 ms with the blocks)
WGMMA_PER_EXPERT = 4  # the wgmma path runs from this many pairs per expert on average (H200, Qwen3-30B-A3B's
# experts: 1.2-1.35x bf16's grouped GEMM from 4 to 128 per expert, where the sorted blocks ran 0.7-1.0x)
WGMMA_PER_EXPERT_MMA = 64  # ... with the experts in the mma layout, which it first reads back to the checkpoint's
# (about 200 us for Qwen3-30B-A3B's block on an H200: the mma blocks of 16 stay faster below this)


def wgmma_block_k(group_size: int) -> int:
    """In-features per K step of the wgmma path: 128 where the groups allow, else 64 (a step within one group)."""
    return 128 if group_size % 128 == 0 else 64


@functools.lru_cache(maxsize=256)
def wgmma_shape_fits(n: int, k: int, group_size: int, bits: int, dtype: torch.dtype) -> bool:
    """Whether one projection's experts (N, K) take the wgmma path: the dense kernel's copies take the shape
    (wgmma_mm.wgmma_layout_fits) and K is whole K steps (an expert's matrix starts on a step of the stack)."""
    return wgmma_layout_fits(n, k, group_size, bits, 1, dtype) and k % wgmma_block_k(group_size) == 0


def wgmma_block_rows(per_expert: float) -> int:
    """Pairs per block of the wgmma path: 64 up to 64 pairs per expert on average, else 128 (H200, Qwen3-30B-A3B's
    experts: 64 ran 0.92x bf16's grouped GEMM at 32 per expert where 128 ran 0.76x; 128 ran 1.08x at 128 per expert
    where 64 ran 1.03x)."""
    return 64 if per_expert <= 64 else 128


@dataclass(frozen=True)
class ExpertsConfig:
    """One projection's launch: ``path`` ``pairs`` or ``sorted``; ``block_m`` pairs per program (1 for ``pairs``),
    ``block_n`` output columns per program, ``block_r`` pair rows (2 in-features each) per K step, ``split`` programs
    splitting K (``pairs`` only: their float32 partial sums are added by the next kernel); ``k_warps`` (``mma``) of
    the ``num_warps`` split each program's K range."""

    path: str
    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 2
    split: int = 1
    k_warps: int = 1

    def __str__(self) -> str:
        warps = (f"{self.num_warps // self.k_warps} along N x {self.k_warps} along K" if self.k_warps > 1
                 else self.num_warps)
        return (f"{self.path}(block_m={self.block_m}, block_n={self.block_n}, block_r={self.block_r}, "
                f"split={self.split}, warps={warps}, stages={self.num_stages})")


@dataclass(frozen=True)
class ExpertsDecision:
    gate_up: ExpertsConfig
    down: ExpertsConfig
    reason: str

    @property
    def path(self) -> str:
        return self.gate_up.path


def _block_r(group_size: int, k: int, cap: int) -> int:
    """Pair rows per K step: at most ``cap``, and a step inside one group where the group allows (its scales are
    then one row, read once per step)."""
    r = cap
    while r > 8 and group_size % (2 * r):
        r //= 2
    return r


def _pairs_config(pairs: int, n: int, k: int, group_size: int, sms: int) -> ExpertsConfig:
    # 128 columns a program where that still gives every SM PAIRS_WAVES programs, else 64; then K split until it
    # does (a GEMV at decode is latency-bound: the more loads in flight per SM, the closer to the copy bandwidth),
    # keeping at least MIN_SPLIT_STEPS steps a split
    block_n = 128 if pairs * cdiv(n, 128) >= PAIRS_WAVES * sms else 64
    block_r = _block_r(group_size, k, 32)
    steps = cdiv(cdiv(k, 2), block_r)
    split = max(1, min(steps // MIN_SPLIT_STEPS, cdiv(PAIRS_WAVES * sms, pairs * cdiv(n, block_n))))
    return ExpertsConfig("pairs", 1, block_n, block_r, num_warps=4, num_stages=2, split=split)


def _sorted_config(pairs: int, experts: int, n: int, k: int, group_size: int) -> ExpertsConfig:
    per_expert = pairs / experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return ExpertsConfig("sorted", block_m, 64 if block_m < 64 else 128, max(16, _block_r(group_size, k, 32)),
                         num_warps=4, num_stages=3)


def _mma_config(blocks: int, rows: int, n: int, k: int, group_size: int, sms: int,
                sums_slots: bool = False) -> ExpertsConfig:
    grid = mma_experts_grid(blocks, n, k, group_size, sms, sorted_blocks=rows > 1, sums_slots=sums_slots)
    return ExpertsConfig("mma", rows, 16 * grid.warps * grid.tiles_per_warp, 0, num_warps=grid.warps * grid.kwarps,
                         num_stages=1, split=grid.split, k_warps=grid.kwarps)


@functools.lru_cache(maxsize=1024)  # (pure; eager decode asks once a layer and step)
def choose(props: DeviceProps, tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
           group_size: int, *, grouped: bool = False, mma: bool = False, wgmma: bool = False) -> ExpertsDecision:
    """The kernels and tiles of a fused-experts call: ``tokens`` rows of x, ``top_k`` slots each, ``num_experts``
    experts of hidden size ``hidden`` and expert width ``inter`` (gate_up is (2 inter, hidden), down (hidden,
    inter)), groups of ``group_size`` along K. ``grouped``: whether the grouped path could run for this call
    (grouped.grouped_usable, and not inside CUDA-graph capture); ``mma``: the experts are in the mma layout
    (mma_experts.py), whose ``mma`` configs replace ``pairs`` and ``sorted`` (``block_m`` 1: a block per pair;
    16: sorted blocks of 16); ``wgmma``: the wgmma path could run (wgmma_experts.wgmma_experts_usable)."""
    pairs = tokens * top_k
    per_expert = pairs / num_experts
    least = WGMMA_PER_EXPERT_MMA if mma else WGMMA_PER_EXPERT
    if wgmma and per_expert >= least and per_expert > PAIRS_PER_EXPERT:
        rows = wgmma_block_rows(per_expert)
        why = (f"{pairs} (token, slot) pairs over {num_experts} experts ({per_expert:.3g} per expert >= {least}): "
               f"pairs are sorted into blocks of {rows} per expert and each projection runs the wgmma kernel over "
               f"them, dequantizing in registers" + (" (the experts read back from the mma layout first)" if mma
                                                     else ""))
        cfg = ExpertsConfig("wgmma", rows, 64, 0)
        return ExpertsDecision(cfg, cfg, why)
    if grouped and per_expert >= (GROUPED_PER_EXPERT_MMA if mma else GROUPED_PER_EXPERT):
        why = (f"{pairs} (token, slot) pairs over {num_experts} experts ({per_expert:.3g} per expert >= "
               f"{GROUPED_PER_EXPERT_MMA if mma else GROUPED_PER_EXPERT}): compute-bound, so each range of experts is dequantized to 16 bits and "
               f"multiplied by torch's grouped GEMM")
        grouped_cfg = ExpertsConfig("grouped", 0, 0, 0)
        return ExpertsDecision(grouped_cfg, grouped_cfg, why)
    if pairs <= PAIRS_MAX and per_expert <= PAIRS_PER_EXPERT:
        why = (f"{pairs} (token, slot) pairs over {num_experts} experts ({per_expert:.2g} per expert <= "
               f"{PAIRS_PER_EXPERT}, and <= {PAIRS_MAX} pairs): one program per pair and column tile, no sorting")
        if mma:
            return ExpertsDecision(_mma_config(pairs, 1, 2 * inter, hidden, group_size, props.sms),
                                   _mma_config(pairs, 1, hidden, inter, group_size, props.sms,
                                               sums_slots=tokens <= SUMMED_BY_DOWN_MAX_TOKENS),
                                   why + ", tensor-core GEMV on the experts' mma layout")
        return ExpertsDecision(_pairs_config(pairs, inter, hidden, group_size, props.sms),
                               _pairs_config(pairs, hidden, inter, group_size, props.sms), why)
    if mma:
        blocks = max_blocks(pairs, num_experts, 16)
        why = (f"{pairs} (token, slot) pairs over {num_experts} experts ({per_expert:.3g} per expert"
               + (f" > {PAIRS_PER_EXPERT}" if per_expert > PAIRS_PER_EXPERT else f", but > {PAIRS_MAX} pairs")
               + "): pairs sorted into blocks of 16 per expert on the GPU, tensor-core GEMV on the experts' mma "
               "layout, each hit expert read once a block")
        return ExpertsDecision(_mma_config(blocks, 16, 2 * inter, hidden, group_size, props.sms),
                               _mma_config(blocks, 16, hidden, inter, group_size, props.sms), why)
    why = (f"{pairs} (token, slot) pairs over {num_experts} experts ({per_expert:.3g} per expert"
           + (f" > {PAIRS_PER_EXPERT}" if per_expert > PAIRS_PER_EXPERT else f", but > {PAIRS_MAX} pairs")
           + "): pairs sorted into per-expert blocks on the GPU, tensor-core tiles read each hit expert once a block")
    return ExpertsDecision(_sorted_config(pairs, num_experts, inter, hidden, group_size),
                           _sorted_config(pairs, num_experts, hidden, inter, group_size), why)


def explain(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, bits: int = 4,
            group_size: int = 128, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str | DeviceProps | None = None, mma: bool = False) -> str:
    """One paragraph: which expert kernels and tiles ``fused_experts`` runs for this call shape on ``device``
    (default: the current GPU; a :class:`~quantpack.kernels.dispatch.DeviceProps` to ask about another), and why;
    ``mma``: for experts in the mma layout (what ``quantpack.load`` gives a block that fits it on a GPU)."""
    if isinstance(device, DeviceProps):
        props = device
    else:
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
            return (f"On {device}, without TRITON_INTERPRET, no Triton kernel runs: the pure-torch reference "
                    f"(quantpack.reference.experts) computes the experts (T={tokens}, top-{top_k}, E={num_experts}).")
        props = device_props(device)
    d = choose(props, tokens, top_k, num_experts, hidden, inter, group_size,
               grouped=bool(props.gpu and props.capability and props.capability[0] >= 9
                            and dtype == torch.bfloat16), mma=mma,
               # (what the GPU runs: the switches as set, the interpreter aside)
               wgmma=wgmma_device(props, replace(Flags.from_env(), interpret=False)) and all(
                   wgmma_shape_fits(n, k, group_size, bits, dtype) for n, k in ((2 * inter, hidden), (hidden, inter))))
    where = props.name if props.gpu else "Triton's CPU interpreter"
    shape = (f"T={tokens}, top-{top_k} of E={num_experts} experts, hidden {hidden}, expert width {inter}, {bits}-bit, "
             f"group size {group_size}, {str(dtype).replace('torch.', '')}")
    if d.path == "grouped":
        return f"On {where}, fused experts with {shape} run dequantize + torch._grouped_mm, because {d.reason}."
    if d.path == "wgmma":
        return (f"On {where}, fused experts with {shape} run the wgmma kernel per expert block for gate_up, the "
                f"activation, the wgmma kernel for down, and the top-k weighted sum over slots (float32), because "
                f"{d.reason}.")
    if d.path == "mma" and d.gate_up.block_m == 1:
        chained = (", the three launches chained with PDL (QUANTPACK_PDL=0 turns that off)"
                   if experts_pdl(props, replace(Flags.from_env(), interpret=False)) else "")
        return (f"On {where}, fused experts with {shape} run gate_up as {d.gate_up}, the activation, and down as "
                f"{d.down}" + (" (the top-k weighted sum over slots, float32, by each column tile's last program)"
                               if tokens <= SUMMED_BY_DOWN_MAX_TOKENS else ", the top-k weighted sum over slots "
                               "(float32)") + f"{chained}, because {d.reason}.")
    if d.path == "mma":
        return (f"On {where}, fused experts with {shape} run gate_up as {d.gate_up}, the activation, down as "
                f"{d.down}, and the top-k weighted sum over slots (float32), because {d.reason}.")
    return (f"On {where}, fused experts with {shape} run gate_up as {d.gate_up} (activation fused) and down as "
            f"{d.down} (top-k weight fused, slots summed in float32), because {d.reason}.")
