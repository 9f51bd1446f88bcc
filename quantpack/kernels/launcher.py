"""The launcher: runs one decided config (dispatch.py) of the fused matmul, fitting its grid, split-K workspace and
counters, and launching the kernel of its path (gemv.py, mma_gemv.py, wgmma_mm.py, tiles.py, w4a8.py) or dequantize +
cuBLAS."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import dequant, launch_plan
from .caches import COUNTER_SLOTS, counter_slice
from .configs import KernelConfig
from .dequant import cdiv, dequantize, interpreting, meta_rowwise
from .gemv import gemv_grid, launch_gemv
from .mma_gemv import launch_mma_gemv, mma_depth, mma_grid
from .tiles import forward_kernel, transposed_kernel
from .w4a8 import w4a8_matmul
from .wgmma_host import balance_last_wave, wgmma_grid
from .wgmma_mm import launch_wgmma, resident_programs


def mma_tiles_per_warp(cfg: KernelConfig) -> int:
    """The mma path's ``block_n`` is the rows of N per warp: 32 or 64 mean two or four 16-row tiles
    sharing x's fragments, anything else one tile."""
    return {32: 2, 64: 4}.get(cfg.block_n, 1)


def mma_blocks(cfg: KernelConfig) -> int:
    """The mma path's 16-row blocks of x per program, from ``block_m`` (the rows of x it covers)."""
    return max(1, cfg.block_m // 16)


def _new_out(shape, dtype, device) -> torch.Tensor:
    """A launch's output, from dequant's allocator (looked up per call: tests swap it for a NaN-filled one, and a
    replayed plan allocates as the module does now)."""
    return dequant._alloc(shape, dtype, device)


def _new_workspace(shape, device, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's float32 partials and its ``tiles`` counters (zero at rest)."""
    return dequant._alloc(shape, torch.float32, device), counter_slice(device, tiles)



def _dot_dtype(dtype: torch.dtype):
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.float32 if interpreting() else tl.bfloat16  # the interpreter's bf16 dot is wrong
    return tl.float32



def launch(x2: torch.Tensor, qweight, scales, zeros, bias, n: int, k: int, axis: int, group_size: int, bits: int,
            transposed: bool, out_dtype: torch.dtype, cfg: KernelConfig, mma_weight=None,
            pdl: bool = False) -> torch.Tensor:
    m = x2.shape[0]
    out_cols = k if transposed else n
    if cfg.path == "dq":
        w = dequantize(qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, out_dtype=x2.dtype)
        out = x2 @ w if transposed else F.linear(x2, w, bias.to(x2.dtype) if bias is not None else None)
        return out.to(out_dtype)
    out = launch_plan.allocate(_new_out, (m, out_cols), out_dtype, x2.device)
    if m == 0:
        return out
    if cfg.path == "w4a8":  # (two launches, quantizer and GEMM: such a call records no launch plan)
        return w4a8_matmul(x2, qweight, scales, zeros, bias, out, n=n, k=k, group_size=group_size, cfg=cfg)
    kh = (k + 1) // 2
    meta_row = meta_rowwise(axis, group_size, cfg.block_r)
    n_meta = scales.shape[1]
    dd = _dot_dtype(x2.dtype)
    prec = "ieee" if dd == tl.float32 else "tf32"  # fp32 activations get full-precision dots
    rawq = cfg.rawq and meta_row and not transposed and cfg.path != "fma"
    magic, offset = 0, 0.0
    if rawq and dd == tl.float16:
        magic, offset = 0x6400, 1024.0  # fp16 1024.0: 10 mantissa bits hold any q < 1024
    elif rawq and dd == tl.bfloat16 and bits == 4:
        magic, offset = 0x4300, 128.0  # bf16 128.0: 7 mantissa bits hold q < 16
    split = cfg.split
    warps = cfg.num_warps
    if cfg.path == "gemv":
        _, split, tiles_n = gemv_grid(m, n, k, cfg.block_n, cfg.block_r, split)
        tiles = m * tiles_n
    elif cfg.path == "wgmma":
        wg = wgmma_grid(m, n, k, group_size, cfg.block_m, cfg.block_n, 2 * cfg.block_r, split, cfg.num_stages,
                        cfg.producer, rawq=cfg.rawq and bits == 4)
        if wg.split == 1:
            wg = balance_last_wave(wg, m, n, k, resident_programs(x2, qweight, scales, zeros, bias, out, n=n, k=k,
                                                                  group_size=group_size, bits=bits, grid=wg))
        split, tiles = wg.split, wg.split_tiles(m, n)
    elif cfg.path == "mma":
        grid = mma_grid(n, k, group_size, warps, split, mma_tiles_per_warp(cfg), bits, mma_blocks(cfg), cfg.k_warps)
        split, tiles = grid.split, grid.programs * grid.row_programs(m)
    elif transposed:
        tiles = cdiv(m, cfg.block_m) * cdiv(kh, cfg.block_r)
    else:
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split > 1 and tiles > COUNTER_SLOTS:
        split = 1  # (a divisor of anything: valid for gemv and mma too)
        if cfg.path == "wgmma":
            wg = replace(wg, split=1, whole=0)
    if split > 1:
        if cfg.path == "gemv":  # each row's partials together
            shape = (m, split, out_cols)
        elif cfg.path == "wgmma":  # one tile-sized block per split program
            shape = (split * tiles, wg.block_n * wg.block_m)
        else:
            shape = (split, m, out_cols)
        ws, cnt = launch_plan.allocate(_new_workspace, shape, x2.device, tiles)
    else:
        ws = cnt = out  # never touched
    if cfg.path == "mma":
        if grid.split != split:  # (too many programs for the counters: one program per column tile)
            grid = mma_grid(n, k, group_size, grid.warps, split, grid.tiles_per_warp, bits, grid.blocks, grid.kwarps)
        launch_mma_gemv(x2, mma_weight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size,
                        grid=grid, depth=mma_depth(grid, group_size, cfg.num_stages), rawq=cfg.rawq,
                        use_asm=not interpreting(),
                        bits=bits, pdl=pdl)
        return out
    if cfg.path == "gemv":
        launch_gemv(x2, qweight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size, bits=bits,
                    block_n=cfg.block_n, block_r=cfg.block_r, split=split, words=cfg.words, num_warps=cfg.num_warps)
        return out
    grid = (tiles, split)

    def launch(num_stages):
        if cfg.path == "wgmma":
            launch_wgmma(x2, qweight, scales, zeros, bias, out, ws, cnt, n=n, k=k, group_size=group_size, bits=bits,
                         grid=replace(wg, stages=num_stages))
        elif transposed:
            launch_plan.launch(transposed_kernel, grid, x2, qweight, scales, zeros, out, ws, cnt, m, n, k, group_size,
                               n_meta, x2.stride(0), x2.stride(1), out.stride(0), out.stride(1),
                               BITS=bits, AXIS=axis, META_ROW=meta_row, SWAP=cfg.path == "dot_t", DOT_DTYPE=dd,
                               DOT_PREC=prec, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
                               SPLIT=split, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=num_stages)
        else:
            path = {"fma": 0, "dot": 1, "dot_t": 2}[cfg.path]
            launch_plan.launch(forward_kernel, grid, x2, qweight, scales, zeros, bias if bias is not None else out, out,
                               ws, cnt, m, n, k, group_size, n_meta, x2.stride(0), x2.stride(1), out.stride(0),
                               out.stride(1), BITS=bits, AXIS=axis, META_ROW=meta_row, HAS_BIAS=bias is not None,
                               PATH=path, DOT_DTYPE=dd, DOT_PREC=prec, RAWQ=rawq, MAGIC=magic, OFFSET=offset,
                               USE_ASM=not interpreting(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                               BLOCK_R=cfg.block_r, SPLIT=split, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                               num_stages=num_stages)

    # A config whose pipeline does not fit this GPU's shared memory (a forced or borrowed table entry)
    # runs with fewer stages instead of failing (wgmma's ring needs two).
    lowest = 2 if cfg.path == "wgmma" else 1
    for stages in range(max(cfg.num_stages, lowest), lowest - 1, -1):
        try:
            launch(stages)
            return out
        except OutOfResources:
            if stages == lowest:
                raise
    return out


