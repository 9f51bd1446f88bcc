"""Host-side planning of a launch of the Hopper warpgroup-MMA kernel (wgmma_mm.py): the grid (the tuned tile
clamped to the call, the K split, the last wave balanced), the scale/zero planes one TMA copy reads, the register limit of a kernel with a producer warp, and
the buffer a profiling launch records its timeline in."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .dequant import cdiv, next_power_of_2


@dataclass(frozen=True)
class WgmmaGrid:
    """A launch: (BLOCK_M, BLOCK_N, BLOCK_K) tile, K split, ring depth, warps (4 per 64 weight rows), and the
    tiles that run whole before the split ones (0: every tile split; see :func:`balance_last_wave`)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    stages: int
    warps: int
    whole: int = 0
    producer: bool = False
    rawq: bool = False  # 4-bit with a producer warp: MMA on q + OFFSET, scales and zeros applied per K step

    def tiles(self, m: int, n: int) -> int:
        return cdiv(n, self.block_n) * cdiv(m, self.block_m)

    def programs(self, m: int, n: int) -> int:
        if self.split == 1:
            return self.tiles(m, n)
        return self.whole + (self.tiles(m, n) - self.whole) * self.split

    def split_tiles(self, m: int, n: int) -> int:
        """Tiles whose K range is split (each has a counter and ``split`` float32 partial blocks)."""
        return 0 if self.split == 1 else self.tiles(m, n) - self.whole


def _fit_split(steps: int, split: int) -> int:
    """The largest split up to ``split`` that leaves every program at least one of ``steps`` K steps."""
    split = max(1, min(split, steps))
    while split > 1 and (split - 1) * cdiv(steps, split) >= steps:
        split -= 1
    return split


@functools.lru_cache(maxsize=4096)  # (per launch on the host: pure, and cheaper looked up than recomputed)
def wgmma_grid(m: int, n: int, k: int, group_size: int, block_m: int, block_n: int, block_k: int, split: int,
               stages: int, producer: bool = False, rawq: bool = False) -> WgmmaGrid:
    """Clamp a tuned tile to this call: BLOCK_M to x's rows (a power of two, as TMA blocks are, 16 to 256),
    BLOCK_K to a divisor of the group (64 or 128 in-features), the split so that every program has at
    least one K step. ``rawq`` (4-bit only; the caller checks) runs on the producer warp's ring."""
    block_m = max(16, min(block_m, 256, next_power_of_2(m)))
    block_k = 128 if block_k >= 128 and group_size % 128 == 0 else 64
    split = _fit_split(cdiv(k, block_k), split)
    return WgmmaGrid(block_m, block_n, block_k, split, max(2, stages), block_n // 16, producer=producer or rawq,
                     rawq=rawq)


def balance_last_wave(grid: WgmmaGrid, m: int, n: int, k: int, resident: int) -> WgmmaGrid:
    """An unsplit grid whose last wave (``resident`` programs run at once) is at most half full: split
    the K range of that wave's tiles so they fill it (up to 4 ways), and run the others whole. 448 tiles
    of 256 x 128 (14336 x 4096, M = 1024) on 132 SMs are 3 full waves and 52 tiles: 3.5 tile times
    instead of 4. Any other grid is returned as it is."""
    tiles = grid.tiles(m, n)
    if grid.split != 1 or resident <= 0 or tiles <= resident:  # (0 resident: the kernel does not fit as asked)
        return grid
    last = tiles % resident
    if last == 0 or 2 * last > resident:
        return grid
    split = _fit_split(cdiv(k, grid.block_k), min(4, resident // last))
    return replace(grid, split=split, whole=tiles - last) if split > 1 else grid


def producer_maxnreg(grid: WgmmaGrid) -> int:
    """The register limit of a kernel with a producer warp. Its warps count in warpgroups (warps + 4) and the
    producer's group gives all but 24 of its registers to the MMA warps, but the limit also binds the code outside
    the specialized loop, where the accumulator (BLOCK_M / 2 registers per thread) and the epilogue live: 128 for
    four MMA warps and up to 128 rows of x (two CTAs per SM, up to 232 registers for the MMA warps), else all that
    one CTA per SM may have (256 rows of x need at least 158)."""
    if grid.warps == 4 and grid.block_m <= 128:
        return 128
    return min(256, 65536 // (32 * (grid.warps + 4)) // 8 * 8)


TRACE_EVENTS = ("start", "first copies", "accumulator", "stored", "summed")  # what the kernel records, in order


def trace_buffer(grid: WgmmaGrid, m: int, n: int, device) -> torch.Tensor:
    """A zeroed timeline buffer for one launch of ``grid`` (``launch_wgmma(trace=...)``): 16 int64 per program, the
    global timer of event e at slot e, the SM's cycle counter at slot 8 + e, the SM at slot 7 (see wgmma_mm._stamp); read it
    with :func:`read_trace`."""
    return torch.zeros(grid.programs(m, n), 16, dtype=torch.int64, device=device)


def read_trace(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A filled :func:`trace_buffer` as (global ns, SM cycles), each (programs, len(TRACE_EVENTS)) with 0 for an
    event a program did not record, and each program's SM (programs,)."""
    events = len(TRACE_EVENTS)
    return buf[:, :events], buf[:, 8:8 + events], buf[:, 7]


def scale_zero_planes(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """scales and zeros, two (K/G, N) tensors, as the planes of one (2, K/G, N) view: the lower of the two
    as the base, the distance between them (in elements) as the plane stride, so that one TMA copy brings
    a step's scale and zero rows (two copies per step cost a CTA barrier and ~25 instructions more each).
    Returns (base, plane stride, plane of the scales)."""
    gap = zeros.data_ptr() - scales.data_ptr()
    base, s_plane = (scales, 0) if gap > 0 else (zeros, 1)
    return base, abs(gap) // scales.element_size(), s_plane
