"""The autotuner: the search space per (direction, M bucket, N, K, bits), and the sweep that times each candidate
(checked first against the float32 reference) over copies of the weight past L2 and stores the fastest in this
machine's config cache. ``mixed_mm.autotune`` and ``mixed_mm.autotune_mma`` run it on a weight."""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import replace

import torch
import triton.testing

from .. import reference
from ..env import switch
from ..format import PackedWeight
from .configs import KernelConfig, config_key, config_table, device_key, m_bucket, remember
from .dequant import cdiv
from .dispatch import (MMA_MAX_M, WGMMA_MAX_M, Flags, device_props, fill_split, pick_config,
                       wgmma_device)
from .mma_gemv import mma_depth, mma_grid


def candidate_configs(transposed: bool, m: int, n: int, k: int, device: torch.device, bits: int = 4
                      ) -> list[KernelConfig]:
    """The search space the autotuner times for one (direction, M bucket, N, K, bits)."""
    props, flags = device_props(device), Flags.from_env()
    sms = props.sms
    kh = (k + 1) // 2
    mb = m_bucket(m)
    out = [KernelConfig("dq")]

    def add(cfg: KernelConfig, waves=(1.0, 2.0, 4.0)):
        if transposed:
            tiles = cdiv(m, cfg.block_m) * cdiv(kh, cfg.block_r)
            steps = cdiv(n, cfg.block_n)
        else:
            tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
            steps = cdiv(kh, cfg.block_r)
        for w in waves:
            c = replace(cfg, split=fill_split(tiles, steps, sms, w))
            if c not in out:
                out.append(c)

    if transposed:
        bms = (16,) if mb <= 16 else ((32, 64) if mb <= 64 else (64, 128))
        for path in ("dot", "dot_t"):
            for bm in bms:
                for bn, br, warps, stages in ((64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3),
                                              (32, 64, 4, 4)):
                    add(KernelConfig(path, bm, bn, br, num_warps=warps, num_stages=stages),
                        waves=(1.0, 2.0) if mb <= 64 else (1.0,))
        return out
    if mb <= 8:
        # gemv: programs are (column tile, K range) per row of x; a sweep
        # found 1-2 warp programs at 8-16 programs per SM best on an H200
        for bn, br, warps in ((64, 32, 1), (128, 32, 1), (128, 16, 1), (256, 32, 2), (128, 32, 2), (256, 16, 1)):
            for words in (False, True):
                gcfg = KernelConfig("gemv", 1, bn, br, num_warps=warps, num_stages=1, words=words)
                for w in (4.0, 8.0, 16.0):
                    c = replace(gcfg, split=fill_split(m * cdiv(n, bn), cdiv(kh, br), sms, w))
                    if c not in out:
                        out.append(c)
        for bn, br, warps in ((64, 64, 2), (128, 64, 4), (32, 64, 1)):
            add(KernelConfig("fma", mb, bn, br, num_warps=warps, num_stages=2), waves=(2.0, 4.0, 16.0))
        for bn, br, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3)):
            add(KernelConfig("dot_t", 16, bn, br, num_warps=warps, num_stages=stages, rawq=True),
                waves=(2.0, 4.0, 8.0))
    if mb <= MMA_MAX_M:
        # tensor-core GEMV (mma_grid rounds the split down to a divisor of the group count)
        # (depth 3 and split 32 never won on an H200; depth 3 was removed)
        # (8-bit: one tile per warp, its two nibble planes always rawq; warps splitting a tile's K range
        # and summing in shared memory measured no faster
        # (block_m: rows of x per program; two 16-row blocks of x in one program always subtract the zeros
        # in A; four measured 1.4-1.8x slower
        # (rows of N per warp: 16 or 32; four tiles per warp (64), half of x's reads per weight byte, measured
        # 9-22% slower at M = 32..64 on an H200: 255 registers, so 8 warps per SM
        for x_rows in (min(16, max(8, mb)),) + ((32,) if mb >= 32 and bits == 4 else ()):
            for rows in (16, 32) if bits == 4 else (16,):
                for warps in (1, 2, 4):
                    # (beyond 16 rows there are 2-4x the programs along M, and split-K's float32 partials,
                    # split x M x N x 4 bytes written and read again, rival the weight: fewer splits)
                    for split in (4, 8, 16) if mb <= 16 else (1, 2, 4, 8):
                        # (depth 0: every load of a program issued up front, for programs of at most
                        # PRELOAD_CHUNKS chunks
                        # (the tables are tuned at group size 128)
                        preload = mb <= 8 and mma_preloads(n, k, warps, split, rows, bits)
                        for depth in (0, 1, 2) if preload else (1, 2):
                            for rawq in (False, True) if bits == 4 and x_rows <= 16 else (bits == 8,):
                                c = KernelConfig("mma", x_rows, rows, num_warps=warps, split=split,
                                                 num_stages=depth, rawq=rawq)
                                if c not in out:
                                    out.append(c)
        if mb <= 16 and n % 16 == 0 and k % 128 == 0:
            # warps of one program splitting K, summed in shared memory instead of a second pass through L2
            # (latency-bound weights up to 4096^2): one 16-row tile per warp slot
            # (8-bit: its two nibble planes, rawq); (two or four tiles per warp, and 32-row programs for
            # M = 32..64, measured slower on an H200: v29)
            for kwarps, warps, split in itertools.product((2, 4, 8), (1, 2), (1, 2, 4)):
                if kwarps * warps > 8:
                    continue
                preload = mb <= 8 and mma_preloads(n, k, warps, split, 16, bits, kwarps)
                for depth in (0, 2) if preload else (2,):
                    for rawq in (False, True) if bits == 4 else (True,):
                        c = KernelConfig("mma", min(16, max(8, mb)), 16, num_warps=warps, split=split,
                                         num_stages=depth, rawq=rawq, k_warps=kwarps)
                        if c not in out:
                            out.append(c)
    if 8 < mb <= 64 or mb == 8:
        for bn, br, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3),
                                      (128, 32, 4, 4)):
            for rawq in (False, True):
                add(KernelConfig("dot_t", max(16, mb), bn, br, num_warps=warps, num_stages=stages, rawq=rawq),
                    waves=(1.0, 2.0, 4.0))
        for rawq in (False, True):
            add(KernelConfig("dot", max(16, mb), 64, 64, num_warps=4, num_stages=3, rawq=rawq), waves=(2.0, 4.0))
    if 16 <= mb <= WGMMA_MAX_M and wgmma_device(props, flags):
        # Hopper: (rows of x, weight rows, pair rows per K step) per program, ring depth, split
        for bm in sorted({min(bm, max(16, mb)) for bm in (64, 128, 256)}):
            for bn in (64, 128):
                for br in (32, 64):
                    for stages in (3, 4):
                        if bm * 4 * br * stages > 200 * 1024:  # x's ring alone past shared memory
                            continue
                        for split, producer in itertools.product((1, 2, 4), (False, True)):
                            c = KernelConfig("wgmma", bm, bn, br, split=split, num_warps=bn // 16, num_stages=stages,
                                             producer=producer)
                            if c not in out:
                                out.append(c)
    if mb <= 32 and bits == 4 and wgmma_device(props, flags):
        # Hopper, few rows: the raw weights' MMA, scales and zeros applied per K step (9 instead of 24 instructions
        # per 8 weights, with its producer warp; from one row of x (a 16-row tile)
        for bm, bn, br, split in itertools.product(sorted({16, min(32, max(16, mb))}), (64, 128), (32, 64),
                                                   (1, 2, 4, 8)):
            c = KernelConfig("wgmma", bm, bn, br, split=split, num_warps=bn // 16, num_stages=4, producer=True,
                             rawq=True)
            if c not in out:
                out.append(c)
    if mb > 64:
        for path, bm, bn, br, warps, stages in (("dot", 64, 128, 32, 4, 4), ("dot", 128, 128, 32, 8, 3),
                                                ("dot", 128, 256, 32, 8, 3), ("dot", 128, 128, 64, 8, 3),
                                                ("dot", 256, 128, 32, 8, 3), ("dot", 64, 256, 32, 8, 3),
                                                ("dot_t", 128, 128, 32, 8, 3), ("dot_t", 64, 256, 32, 8, 3)):
            add(KernelConfig(path, bm, bn, br, num_warps=warps, num_stages=stages),
                waves=(1.0,) if mb >= 1024 else (1.0, 2.0))
        if mb <= 256:
            for path, bm, bn in (("dot", 64, 128), ("dot", 128, 128), ("dot_t", 64, 128), ("dot_t", 128, 128)):
                add(KernelConfig(path, bm, bn, 64, num_warps=8 if bm == 128 else 4, num_stages=3, rawq=True),
                    waves=(1.0, 2.0))
    return out


def mma_preloads(n: int, k: int, warps: int, split: int, rows: int, bits: int, kwarps: int = 1) -> bool:
    """Whether an ``mma`` grid at group size 128 (the tables') runs depth 0 (its warps' K ranges short enough)."""
    if n % 16 or n < 16 or k % 128:
        return False
    grid = mma_grid(n, k, 128, warps, split, max(1, rows // 16), bits, 1, kwarps)
    return mma_depth(grid, 128, 0) == 0


RETIME_TOP = 4  # the sweep's fastest, which the autotuner times again
TUNE_MAX_ERR = 1e-2  # relative error above which the autotuner drops a candidate (the kernels measure 1.6-2.5e-3)


def tunes_on_first_use(x2: torch.Tensor, transposed: bool, bits: int, n: int, k: int) -> bool:
    """Whether a call with ``x2`` autotunes its key first: ``QUANTPACK_AUTOTUNE=1``, on a GPU, outside CUDA-graph
    capture, and the table (shipped, cached or tuned in this process) lacks the key. (Every untuned call asks:
    the switch is read first, parsed once per environment, and the key built only when it is on.)"""
    if not (x2.is_cuda and Flags.from_env().autotune):
        return False
    return (not torch.cuda.is_current_stream_capturing()
            and config_key(transposed, bits, n, k, x2.shape[0]) not in config_table(device_key(x2.device)))


def reference_product(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, n: int,
                      k: int, axis: int, group_size: int, bits: int, transposed: bool = False) -> torch.Tensor:
    """``x2 @ W.T`` (``x2 @ W`` transposed) in float32 from the reference dequantization: what the tuner checks
    each candidate against."""
    w = reference.dequantize(PackedWeight(qweight, scales, zeros, bits, group_size, axis, (n, k)), torch.float32)
    return x2.float() @ (w if transposed else w.t())



def copies_past_l2(tensors: tuple, device: torch.device, limit: int = 16) -> int:
    """How many copies of a weight's tensors the tuner cycles through so that together they exceed 4x the GPU's L2
    (as the benchmarks time): in a model, each layer's weight comes from HBM, since the other layers' weights
    evict it, so a config timed on an L2-resident weight is timed for the wrong regime (a 4096^2 4-bit weight is
    8 MB of an H100's 50 MB). At most ``limit``; 1 off a GPU."""
    if device.type != "cuda":
        return 1
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(limit, -(-4 * l2 // max(1, nbytes))))


def sweep(fields: tuple, device: torch.device, candidates: list[KernelConfig], run, tensors: tuple,
          weight_copies: int | None, want: torch.Tensor, rep_ms: int) -> tuple[KernelConfig, dict]:
    """The sweep behind :func:`autotune` and :func:`autotune_mma`: ``run(config, copy)`` computes the product with
    ``tensors`` or one of their ``weight_copies - 1`` clones; each config is checked against ``want`` on its first run,
    timed, the fastest timed again, and the winner stored under the key of ``fields`` (transposed, bits, N, K, M)."""
    key = config_key(*fields)
    if weight_copies is None:
        weight_copies = copies_past_l2(tensors, device)
    copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(weight_copies - 1)]
    checked = set()
    verbose = switch("QUANTPACK_TUNE_VERBOSE")

    def time_config(cfg) -> float:
        try:
            if cfg not in checked:
                out = run(cfg, copies[0]).reshape(want.shape).float()
                err = ((out - want).norm() / want.norm().clamp_min(1e-30)).item()
                if not err <= TUNE_MAX_ERR:  # (NaN too)
                    if verbose:
                        print("config dropped", cfg, f"relative error {err:.2e}")
                    return math.inf
                checked.add(cfg)

            def calls():
                for copy in copies:
                    run(cfg, copy)
            calls()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            return triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3 / len(copies)
        except Exception as exc:  # a config that does not compile or fit (shared memory) is skipped
            torch.cuda.synchronize()
            if verbose:
                print("config failed", cfg, repr(exc)[:200])
            return math.inf

    times = {cfg: time_config(cfg) for cfg in candidates}
    # the clock drifts over a long sweep (heat, power), which favours whichever ran early: the fastest few
    # are timed again back to back, in order and then in reverse (a linear drift then weighs them alike),
    # and the best of them by their mean time wins
    top = [cfg for cfg in sorted(times, key=times.get)[:RETIME_TOP] if times[cfg] < math.inf]
    if not top:
        warnings.warn(f"quantpack autotune: none of {len(times)} configs for {key} ran and matched the reference; "
                      "nothing stored, the table's or the heuristic pick stays")
        transposed, bits, n, k, m = fields
        return pick_config(transposed, bits, m, n, k, device), times
    again = {cfg: [] for cfg in top}
    for cfg in top + top[::-1]:
        again[cfg].append(time_config(cfg))
    times.update({cfg: sum(t) / len(t) for cfg, t in again.items()})
    best = min(top, key=times.get)
    remember(device_key(device), key, best)
    return best, times


