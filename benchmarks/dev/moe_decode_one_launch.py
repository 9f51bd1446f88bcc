"""A mixture-of-experts block at decode in one launch, on the experts' ``mma`` layout, against the fused_experts
path (gate_up, activation, down + sum: three launches), at 1 and 2 tokens, over launch configs; each checked against
quantpack.reference.experts first, timed as bench_moe.py times (CUDA-graph replays, one call per weight replica,
replicas past 4x L2). An experiment, not part of the product: measured on an H200, it ran 5.5-7x slower than the
three launches (NOTES.md has the numbers), so the product keeps them.

The kernel: each program takes one (token, slot) pair and one 64-wide slice of the expert width and does all of
the block's work for it: its 64 gate and 64 up rows over the whole hidden size (dequantized in registers, CUDA-core
products), the activation, ``h`` rounded to x's dtype; then down's 64 in-features of that slice for every hidden
column, times the pair's top-k weight, added into a float32 row per token with ``tl.atomic_add``; the last of a
token's programs rounds that row into the output and leaves it, and its counter, zero (caches.counter_slice's ring).
In a 16-row tile's 64-in-feature chunk of ``mma_pack``'s layout, lane ``4 (r % 8) + c``'s word ``w`` holds rows
``r`` and ``r + 8`` (bits 0-3 and 4-7 of each byte) at in-features ``16 c + 8 kh + 2 w + e`` (byte ``kh``, half
``e``): a program's products are laid out as (row, lane column and word, nibble) and summed over the last two axes.

    python benchmarks/dev/moe_decode_one_launch.py [--models qwen3-moe,mixtral]
    TRITON_INTERPRET=1 python benchmarks/dev/moe_decode_one_launch.py --check   # the kernel against the reference, CPU
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_moe  # noqa: E402
from quantpack import reference  # noqa: E402
from quantpack.kernels.moe import fused_experts  # noqa: E402
from quantpack.kernels.moe.mma_experts import MmaExperts  # noqa: E402
from quantpack.kernels.caches import counter_slice  # noqa: E402
from quantpack.kernels.dequant import on_device  # noqa: E402
from quantpack.kernels.mma_gemv import last_to_arrive  # noqa: E402
from quantpack.kernels.moe.activation import ACTIVATIONS, expert_activation  # noqa: E402
from timing import graph_time  # noqa: E402

SLICE = 64  # expert-width rows per program: one in-feature chunk of down's layout
DOWN_TILES = 8  # down's 16-row tiles a step of the program's second phase takes
OUT_BLOCK = 256  # columns per step of the last program's rounding


@triton.jit
def _chunk_products(w_ptrs, shift, a):
    """Per row, the sum over a 64-in-feature chunk of ``q * a``: ``w_ptrs`` (T, 16, 16) the words of T tiles (row,
    lane column and word), ``shift`` (16, 1, 4) each nibble's bits, ``a`` (16, 4) the inputs at those in-features."""
    w = tl.load(w_ptrs)
    q = ((w[:, :, :, None] >> shift[None, :, :, :]) & 15).to(tl.float32)
    return tl.sum(tl.sum(q * a[None, None, :, :], axis=3), axis=2)


@triton.jit
def _decode_experts_kernel(x_ptr, gw_ptr, gs_ptr, gz_ptr, dw_ptr, ds_ptr, dz_ptr, ids_ptr, tw_ptr, h_ptr, y_ptr,
                           cnt_ptr, out_ptr, H, I, E, alpha, limit, G: tl.constexpr, GD: tl.constexpr,
                           TOPK: tl.constexpr, ACT: tl.constexpr, DOWN_TILES: tl.constexpr, OUT_BLOCK: tl.constexpr):
    p = tl.program_id(0)  # (token, slot) pair
    c = tl.program_id(1)  # 64-wide slice of the expert width
    t = p // TOPK
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & (e < E):
        nn = tl.arange(0, 16)
        cw = tl.arange(0, 16)  # (lane column c' = cw // 4, word w = cw % 4)
        m = tl.arange(0, 4)  # (byte kh = m // 2, half e = m % 2)
        words = (4 * (nn[:, None] % 8) + cw[None, :] // 4) * 4 + cw[None, :] % 4  # (16, 16) within a chunk
        shift = (4 * (nn[:, None, None] // 8) + 8 * (m[None, None, :] // 2) + 16 * (m[None, None, :] % 2))
        kin = 16 * (cw[:, None] // 4) + 8 * (m[None, :] // 2) + 2 * (cw[:, None] % 4) + m[None, :] % 2  # (16, 4)
        ti = tl.arange(0, 4)
        hc = H // 64
        rows = 64 * c + 16 * ti[:, None] + nn[None, :]  # (4, 16): this slice's rows of the expert width
        gw = gw_ptr + e * (2 * I // 16) * hc * 128
        g_ptrs = gw + ((4 * c + ti)[:, None, None] * hc) * 128 + words[None, :, :]
        u_ptrs = g_ptrs + (I // 16) * hc * 128
        meta = e * (H // G) * 2 * I + rows
        acc_g = tl.zeros((4, 16), dtype=tl.float32)
        acc_u = tl.zeros((4, 16), dtype=tl.float32)
        x_row = x_ptr + t * H
        for grp in range(H // G):
            qg = tl.zeros((4, 16), dtype=tl.float32)
            qu = tl.zeros((4, 16), dtype=tl.float32)
            xs = 0.0
            for ch in tl.static_range(G // 64):
                kc = grp * (G // 64) + ch
                xk = tl.load(x_row + kc * 64 + kin).to(tl.float32)
                xs += tl.sum(tl.sum(xk, axis=1), axis=0)
                qg += _chunk_products(g_ptrs + kc * 128, shift, xk)
                qu += _chunk_products(u_ptrs + kc * 128, shift, xk)
            # (q - z) s summed against x: s (sum q x - z sum x)
            sg = tl.load(gs_ptr + meta + grp * 2 * I).to(tl.float32)
            zg = tl.load(gz_ptr + meta + grp * 2 * I).to(tl.float32)
            su = tl.load(gs_ptr + meta + grp * 2 * I + I).to(tl.float32)
            zu = tl.load(gz_ptr + meta + grp * 2 * I + I).to(tl.float32)
            acc_g += sg * (qg - zg * xs)
            acc_u += su * (qu - zu * xs)
        h = expert_activation(acc_g, acc_u, ACT, alpha, limit).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(h_ptr + p * I + rows, h)
        tl.debug_barrier()  # (h back in this slice's input layout: stored by some threads, read by others)
        hk = tl.load(h_ptr + p * I + 64 * c + kin, cache_modifier=".cg")
        hs = tl.sum(tl.sum(hk, axis=1), axis=0)
        tw = tl.load(tw_ptr + p).to(tl.float32)
        ic = I // 64
        dw = dw_ptr + e * (H // 16) * ic * 128
        d_meta = ds_ptr + e * (I // GD) * H + (64 * c // GD) * H
        z_meta = dz_ptr + e * (I // GD) * H + (64 * c // GD) * H
        td = tl.arange(0, DOWN_TILES)
        for t0 in range(0, H // 16, DOWN_TILES):
            tiles = t0 + td
            ok = tiles < H // 16
            tiles = tl.where(ok, tiles, 0)
            qh = _chunk_products(dw + ((tiles[:, None, None] * ic + c) * 128) + words[None, :, :], shift, hk)
            cols = 16 * tiles[:, None] + nn[None, :]
            s = tl.load(d_meta + cols).to(tl.float32)
            z = tl.load(z_meta + cols).to(tl.float32)
            tl.atomic_add(y_ptr + t * H + cols, tw * s * (qh - z * hs), mask=ok[:, None] & (nn < 16)[None, :],
                          sem="relaxed")
    # (a skipped slot's programs arrive too)
    if last_to_arrive(cnt_ptr + t, TOPK * tl.num_programs(1)):
        cols = tl.arange(0, OUT_BLOCK)
        for c0 in range(0, H, OUT_BLOCK):
            mask = c0 + cols < H
            v = tl.load(y_ptr + t * H + c0 + cols, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * H + c0 + cols, v.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(y_ptr + t * H + c0 + cols, tl.zeros_like(v), mask=mask)


def decode_experts(x: torch.Tensor, gate_up, down, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                   activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                   down_tiles: int = DOWN_TILES, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """:func:`quantpack.reference.experts` (weights on the output) for ``mma``-layout experts in one launch: ``x``
    (T, H) contiguous 16-bit, ``topk_ids``/``topk_weights`` (T, k) contiguous, on x's device (a GPU, or the CPU under
    TRITON_INTERPRET=1). Meant for a token or two (decode); ``down_tiles``, ``num_warps``, ``num_stages``: the
    launch's tiles (benchmarks)."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = gate_up.shape[0] // 2
    with on_device(x):
        h = torch.empty((tokens * top_k, inter), dtype=torch.float32, device=x.device)
        y = counter_slice(x.device, tokens * hidden).view(torch.float32)  # (zero at rest, as the counters)
        counters = counter_slice(x.device, tokens)
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        _decode_experts_kernel[(tokens * top_k, inter // SLICE)](
            x, gate_up.words, gate_up.scales, gate_up.zeros, down.words, down.scales, down.zeros, topk_ids,
            topk_weights, h, y, counters, out, hidden, inter, gate_up.num_experts, float(alpha), float(limit),
            G=gate_up.group_size, GD=down.group_size, TOPK=top_k, ACT=ACTIVATIONS[activation], DOWN_TILES=down_tiles,
            OUT_BLOCK=OUT_BLOCK, num_warps=num_warps, num_stages=num_stages)
    return out


def check():
    """The kernel against the reference on small awkward blocks (two tokens, an unused slot, g64 and g128)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from oracles import random_experts  # tests/oracles.py

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for experts, top_k, tokens, hidden, inter, gs, dtype in [(8, 2, 1, 128, 64, 64, torch.float16),
                                                             (60, 4, 2, 256, 128, 128, torch.bfloat16),
                                                             (8, 8, 1, 128, 192, 64, torch.float16)]:
        gate_up = random_experts(experts, 2 * inter, hidden, gs, dtype=dtype, seed=1, device=dev)
        down = random_experts(experts, hidden, inter, gs, dtype=dtype, seed=2, device=dev)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
        ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].contiguous()
        ids[0, -1] = -1  # (an unused slot)
        w = torch.rand(tokens, top_k, generator=g)
        ids, w = ids.to(dev), w.to(dev)
        got = decode_experts(x, MmaExperts.from_packed(gate_up), MmaExperts.from_packed(down), ids, w)
        err = bench_moe.rel_error(got, reference.experts(x, gate_up, down, ids, w))
        print(f"E={experts} top-{top_k} T={tokens} H={hidden} I={inter} g{gs} {dtype}: relative error {err:.1e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-moe,mixtral")
    p.add_argument("--tokens", default="1,2")
    p.add_argument("--check", action="store_true", help="only check the kernel against the reference (small shapes)")
    a = p.parse_args()
    if a.check:
        return check()
    bw = bench_moe.copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy {bw / 1e9:.0f} GB/s, L2 {l2 / 1e6:.0f} MB", flush=True)
    configs = list(itertools.product([4, 8], [2, 3], [8, 16]))  # (num_warps, num_stages, down_tiles)
    for model in a.models.split(","):
        experts, top_k, hidden, inter = bench_moe.MODELS[model]
        probe = bench_moe.random_block(experts, hidden, inter, torch.bfloat16, 0, "cuda")
        per_expert = bench_moe.expert_bytes(probe[0]) + bench_moe.expert_bytes(probe[1])
        del probe
        for tokens in map(int, a.tokens.split(",")):
            hits = min(experts, tokens * top_k)
            n_rep = max(2, min(16, math.ceil(4 * l2 / (hits * per_expert))))
            blocks = [bench_moe.random_block(experts, hidden, inter, torch.bfloat16, 1 + i, "cuda")
                      for i in range(n_rep)]
            loaded = [tuple(MmaExperts.from_packed(pe) for pe in b) for b in blocks]
            xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(n_rep)]
            routes = [bench_moe.routing(tokens, experts, top_k, 100 + i, "cuda") for i in range(n_rep)]
            routes = [(ids.contiguous(), w.contiguous()) for ids, w in routes]
            hit = len(torch.unique(routes[0][0]))
            floor_us = hit * per_expert / bw * 1e6
            want = reference.experts(xs[0], *blocks[0], *routes[0])
            bench_moe.check("fused_experts", fused_experts(xs[0], *loaded[0], *routes[0]), want)
            base_ms, _ = graph_time([lambda i=i: fused_experts(xs[i], *loaded[i], *routes[i])
                                     for i in range(n_rep)], warmup=10, rep=60)
            base = base_ms * 1e3
            print(f"{model} T={tokens}: fused_experts {base:.1f} us ({floor_us / base:.1%} of the {floor_us:.1f} us "
                  f"floor, {hit} experts hit, {n_rep} replicas)", flush=True)
            for nw, ns, dt in configs:
                kw = dict(num_warps=nw, num_stages=ns, down_tiles=dt)
                try:
                    err = bench_moe.rel_error(decode_experts(xs[0], *loaded[0], *routes[0], **kw), want)
                    if not err < bench_moe.TOL:
                        print(f"  warps {nw} stages {ns} down tiles {dt}: WRONG (relative error {err:.2e})")
                        continue
                    ms, mode = graph_time([lambda i=i: decode_experts(xs[i], *loaded[i], *routes[i], **kw)
                                           for i in range(n_rep)], warmup=10, rep=60)
                except Exception as exc:  # noqa: BLE001  (a config that does not compile is reported, not fatal)
                    print(f"  warps {nw} stages {ns} down tiles {dt}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                us = ms * 1e3
                print(f"  warps {nw} stages {ns} down tiles {dt}: {us:6.1f} us  {base / us:4.2f}x fused_experts, "
                      f"{floor_us / us:5.1%} of the floor (error {err:.1e}, {mode})", flush=True)
            blocks = loaded = None  # (their memory, before the next count's)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
