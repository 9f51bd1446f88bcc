"""Fused mixture-of-experts kernels on the packed layout: each projection of a block runs for all experts in one
Triton launch, with no host synchronisation (a call can be captured in a CUDA graph and replayed with new routing).

``fused_experts(x, gate_up, down, topk_ids, topk_weights)`` has :func:`quantpack.reference.experts`'s semantics:

1. gate_up: for each (token, slot) pair, ``h = act(x @ W_gu[e].T + b)``; the program reads the gate rows and the up
   rows of the merged matrix for its columns and applies the activation in its epilogue, so only ``h`` (pairs, I),
   rounded to x's dtype, is written. With ``weight_on_input`` x is scaled by the pair's weight first.
2. down: ``y = (h @ W_d[e].T + b) * w`` per pair, in float32 (the top-k weight in the epilogue), then summed over
   the slots of each token in float32 and rounded once (:func:`_sum_slots_kernel`).

Both use one kernel, :func:`_experts_kernel`, in one of two modes that dispatch.py picks: ``pairs`` (decode: one
program per pair and column tile, CUDA-core GEMV, no sorting; K split over programs where the GPU would otherwise
have too few, gate_up then storing float32 partial gate/up sums that down activates as it loads them) or ``sorted``
(prefill: pairs sorted into per-expert blocks by routing.py, tensor-core tiles). Weights dequantize in registers as
in the dense kernels (dequant.py's pair rows: even in-features multiply the low nibbles, odd ones the high).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import reference
from ...format import PackedExperts
from .. import dequant
from ..dequant import cdiv, dequant_pair_tile, interpreting, on_device, triton_usable
from ..dispatch import Flags, device_props, experts_pdl
from .activation import ACTIVATIONS, expert_activation
from .dispatch import ExpertsConfig, choose
from .grouped import grouped_experts, grouped_usable
from .mma_experts import MmaExperts, mma_experts, reference_experts
from .routing import align_block_size
from .wgmma_experts import wgmma_experts, wgmma_experts_usable

@triton.jit
def _mac(acc, ae, ao, lo, hi, DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc += ae @ lo + ao @ hi: even in-features times the low values, odd times the high. Without ``DOT`` (one
    row of a, the GEMV) ``acc`` is (BLOCK_R, BLOCK_N), summed over its rows once after the K loop: each step is then
    elementwise FMAs, with no reduction across threads."""
    if DOT:
        if DOT_F32:
            acc = tl.dot(ae.to(tl.float32), lo, acc, input_precision="ieee")
            acc = tl.dot(ao.to(tl.float32), hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(ae, lo.to(ae.dtype), acc)
            acc = tl.dot(ao, hi.to(ao.dtype), acc)
    else:
        acc += (tl.reshape(ae.to(tl.float32), (BLOCK_R, 1)) * lo + tl.reshape(ao.to(tl.float32), (BLOCK_R, 1)) * hi)
    return acc


@triton.jit
def _activated_rows(a_rows, k, mask, split_stride, K, A_SPLIT: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    """``act(gate, up)`` at in-features ``k`` of the rows ``a_rows`` of ``A_SPLIT`` partial gate/up sums (float32:
    gate at column k, up at K + k; split s at ``s * split_stride``)."""
    g = tl.zeros(mask.shape, dtype=tl.float32)
    u = tl.zeros(mask.shape, dtype=tl.float32)
    for s in tl.static_range(A_SPLIT):
        g += tl.load(a_rows + s * split_stride + k[None, :], mask=mask, other=0.0)
        u += tl.load(a_rows + s * split_stride + K + k[None, :], mask=mask, other=0.0)
    return expert_activation(g, u, ACT, alpha, limit)


@triton.jit
def _and(mask, flag):
    """``mask & flag`` for a block mask and a scalar flag (Triton's interpreter leaves that product's dtype
    unusable as a mask)."""
    return mask & ((tl.zeros_like(mask.to(tl.int32)) + flag.to(tl.int32)) != 0)


@triton.jit
def _experts_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ids_ptr, tw_ptr, sorted_ptr, block_expert_ptr,
                    P, E, N, K, G, TOPK, stride_a, stride_out, alpha, limit, STEPS,
                    BITS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    A_BY_TOKEN: tl.constexpr, SCALE_INPUT: tl.constexpr, SCALE_OUTPUT: tl.constexpr,
                    SORTED: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr, META_ROW: tl.constexpr,
                    SPLIT_OUT: tl.constexpr, A_SPLIT: tl.constexpr, A_DT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """One projection for all experts. Rows of the input ``a``: x at the pair's token (``A_BY_TOKEN``, gate_up) or
    the pair's own row (down). ``N`` output columns; the packed matrices have ``2N`` (``GATED``: gate rows, then up
    rows, activation fused) or ``N``. Program (b, n tile): ``SORTED``, block b of routing's sorted pairs (its expert
    from ``block_expert``; past the filled blocks it exits); otherwise pair b alone (its expert from topk_ids; an
    unused slot writes zeros). Split-K: program (.., .., s) sums ``STEPS`` steps of the K range from step s * STEPS;
    with ``SPLIT_OUT`` it stores its float32 partial sums as they are, at ``out + s * P * stride_out`` (``GATED``: gate
    then up, the activation left to the reader; the bias in split 0's). ``A_SPLIT`` > 0: ``a`` holds ``A_SPLIT`` such
    partial gate/up sums per pair (float32, rows of 2K), and the input is ``act(sum gate, sum up)`` rounded to
    ``A_DT``, made while loading."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if SORTED:
        e = tl.load(block_expert_ptr + pid_b)
        if e >= E:
            return
        pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        used = e >= 0  # (true: every pair of a block goes to its expert)
        row_ok = pairs < P
    else:
        pairs = pid_b + tl.arange(0, BLOCK_M)
        e = tl.load(ids_ptr + pid_b).to(tl.int32)
        used = (e >= 0) & (e < E)
        row_ok = _and(pairs < P, used)
        e = tl.where(used, e, 0)
    if A_BY_TOKEN:
        rows = pairs // TOPK
    else:
        rows = pairs
    rows = tl.where(row_ok, rows, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    if GATED:
        NW = 2 * N
    else:
        NW = N
    if BITS == 4:
        KR = K // 2
    else:
        KR = K
    e64 = e.to(tl.int64)
    qw_e = qw_ptr + e64 * KR * NW
    s_e = s_ptr + e64 * (K // G) * NW
    z_e = z_ptr + e64 * (K // G) * NW
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_a
    if SCALE_INPUT:
        w_in = tl.load(tw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    if DOT:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # (BLOCK_M is 1: per-row partial sums, see _mac)
        acc_g = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    r_begin = pid_s * STEPS * BLOCK_R
    r_end = tl.minimum(r_begin + STEPS * BLOCK_R, (K + 1) // 2)
    for r0 in range(r_begin, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ke = 2 * r
        ko = ke + 1
        if A_SPLIT > 0:
            ae = _activated_rows(a_rows, ke, row_ok[:, None] & (ke < K)[None, :], P * stride_a, K, A_SPLIT, ACT,
                                 alpha, limit).to(A_DT)
            ao = _activated_rows(a_rows, ko, row_ok[:, None] & (ko < K)[None, :], P * stride_a, K, A_SPLIT, ACT,
                                 alpha, limit).to(A_DT)
        else:
            ae = tl.load(a_rows + ke[None, :], mask=row_ok[:, None] & (ke < K)[None, :], other=0.0)
            ao = tl.load(a_rows + ko[None, :], mask=row_ok[:, None] & (ko < K)[None, :], other=0.0)
        if SCALE_INPUT:  # (x * w rounded to x's dtype, as the reference)
            ae = (ae.to(tl.float32) * w_in[:, None]).to(a_ptr.dtype.element_ty)
            ao = (ao.to(tl.float32) * w_in[:, None]).to(a_ptr.dtype.element_ty)
        r_mask = _and(ke < K, used)  # (an unused slot reads no weights)
        lo, hi = dequant_pair_tile(qw_e, s_e, z_e, r, n, r_mask, n_mask, r0, NW, K, G, 0, BITS, 1, META_ROW)
        acc_g = _mac(acc_g, ae, ao, lo, hi, DOT, DOT_F32, BLOCK_R)
        if GATED:
            lo, hi = dequant_pair_tile(qw_e, s_e, z_e, r, n + N, r_mask, n_mask, r0, NW, K, G, 0, BITS, 1, META_ROW)
            acc_u = _mac(acc_u, ae, ao, lo, hi, DOT, DOT_F32, BLOCK_R)
    if not DOT:
        acc_g = tl.reshape(tl.sum(acc_g, axis=0), (1, BLOCK_N))
        acc_u = tl.reshape(tl.sum(acc_u, axis=0), (1, BLOCK_N))
    if HAS_BIAS:
        b_used = used & (pid_s == 0)  # (one split adds it)
        acc_g += tl.load(b_ptr + e64 * NW + n, mask=_and(n_mask, b_used), other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + e64 * NW + N + n, mask=_and(n_mask, b_used), other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_s.to(tl.int64) * P * stride_out + pairs.to(tl.int64)[:, None] * stride_out + n[None, :]
    out_mask = (pairs < P)[:, None] & n_mask[None, :]
    if GATED and SPLIT_OUT:
        tl.store(out, acc_g, mask=out_mask)
        tl.store(out + N, acc_u, mask=out_mask)
    else:
        if GATED:
            res = expert_activation(acc_g, acc_u, ACT, alpha, limit)
        else:
            res = acc_g
        if SCALE_OUTPUT:
            res = res * tl.load(tw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out, res.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, H, P, TOPK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over splits s and slots j of y[s, t * TOPK + j], float32, rounded once to out's dtype (unrolled:
    every load in flight together)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (s * P + t * TOPK + j) * H + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


SUM_BLOCK = 256  # columns per program of the sum over slots (at batch 1 its programs are few: small ones, more)


def check_experts(x, gate_up: PackedExperts, down: PackedExperts, topk_ids, topk_weights, activation: str) -> None:
    """ValueError naming what does not fit, for a fused-experts call."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError("x: expected a 2-D floating-point (tokens, hidden) tensor")
    if gate_up.shape[0] % 2 or x.shape[1] != gate_up.shape[1]:
        raise ValueError(f"x: expected (tokens, {gate_up.shape[1]}) for gate_up of shape {gate_up.shape} (2I, H), "
                         f"got {tuple(x.shape)}")
    if down.shape != (gate_up.shape[1], gate_up.shape[0] // 2) or down.num_experts != gate_up.num_experts:
        raise ValueError(f"down: {down.num_experts} experts of shape {down.shape} do not fit gate_up's "
                         f"{gate_up.num_experts} of shape {gate_up.shape}")
    if (not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor)
            or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"topk_ids and topk_weights: expected both ({x.shape[0]}, top_k)")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids: dtype {topk_ids.dtype}, expected an integer tensor of expert ids")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: use one of {', '.join(reference.EXPERT_ACTIVATIONS)}")
    if gate_up.group_size > gate_up.shape[1] or down.group_size > down.shape[1]:
        raise ValueError("gate_up/down: group size larger than the in-features")
    for t in (gate_up.scales, down.scales, topk_ids, topk_weights):
        if t.device != x.device:
            raise ValueError(f"x on {x.device}, but the experts' tensors or the routing on {t.device}; move them "
                             f"to one device")


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _launch(a, pe: PackedExperts, out, cfg: ExpertsConfig, *, n: int, gated: bool, topk_ids, topk_weights,
            routing, act: int, alpha: float, limit: float, a_by_token: bool, scale_input: bool, scale_output: bool,
            split_out: bool = False, a_split: int = 0, a_dtype: torch.dtype | None = None):
    pairs = topk_ids.numel()
    k = pe.shape[1]
    sorted_mode = cfg.path == "sorted"
    sorted_pairs, block_expert = routing if sorted_mode else (topk_ids, topk_ids)  # (unused pointers)
    programs = block_expert.numel() if sorted_mode else pairs
    bias = pe.bias if pe.bias is not None else pe.scales  # (an unused pointer)
    steps = cdiv(cdiv(cdiv(k, 2), cfg.block_r), cfg.split)
    grid = (programs, cdiv(n, cfg.block_n), cfg.split)
    dot_f32 = a_dtype == torch.float32 or a.dtype == torch.float32 or interpreting()  # (the interpreter's tl.dot
    # is wrong on 16-bit floats)
    _experts_kernel[grid](
        a, pe.qweight, pe.scales, pe.zeros, bias, out, topk_ids, topk_weights, sorted_pairs, block_expert,
        pairs, pe.num_experts, n, k, pe.group_size, topk_ids.shape[1], a.stride(-2), out.stride(-2), alpha, limit,
        steps, BITS=pe.bits, GATED=gated, ACT=act, HAS_BIAS=pe.bias is not None, A_BY_TOKEN=a_by_token,
        SCALE_INPUT=scale_input, SCALE_OUTPUT=scale_output, SORTED=sorted_mode, DOT=sorted_mode, DOT_F32=dot_f32,
        META_ROW=pe.group_size % (2 * cfg.block_r) == 0, SPLIT_OUT=split_out, A_SPLIT=a_split,
        A_DT=TL_DTYPES[a_dtype or a.dtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, gate_up: PackedExperts, down: PackedExperts, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  weight_on_input: bool = False, config: tuple[ExpertsConfig, ExpertsConfig] | None = None
                  ) -> torch.Tensor:
    """A mixture-of-experts block's experts, fused: :func:`quantpack.reference.experts`'s semantics (see there) in
    two Triton launches, one per projection, for all experts (plus the sort into per-expert blocks at prefill, and
    the sum over slots). Runs on CUDA (and on the CPU under TRITON_INTERPRET=1), the reference otherwise; never
    synchronises with the host, so it can be captured in a CUDA graph (at many pairs per expert outside capture,
    a prefill, the grouped path of grouped.py runs instead). ``config`` forces (gate_up, down)
    launch configs (tests, benchmarks); by default :func:`quantpack.kernels.moe.dispatch.choose` picks them."""
    check_experts(x, gate_up, down, topk_ids, topk_weights, activation)
    mma = isinstance(gate_up, MmaExperts)
    if mma and (weight_on_input or not isinstance(down, MmaExperts)):
        raise ValueError("experts in the mma layout: both projections in it, and weights on the output")
    if not triton_usable(x):
        return reference_experts(x, gate_up, down, topk_ids, topk_weights, activation=activation, alpha=alpha,
                                 limit=limit, weight_on_input=weight_on_input)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = gate_up.shape[0] // 2
    if tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    props = device_props(x.device)
    if config is None:
        grouped = (x.device.type == "cuda" and grouped_usable(x) and not torch.cuda.is_current_stream_capturing())
        d = choose(props, tokens, top_k, gate_up.num_experts, hidden, inter, gate_up.group_size, grouped=grouped,
                   mma=mma, wgmma=wgmma_experts_usable(x, gate_up, down))
        config = (d.gate_up, d.down)
    cfg_gu, cfg_d = config
    if cfg_gu.path == "wgmma":
        return wgmma_experts(x, gate_up, down, topk_ids, topk_weights, activation=activation, alpha=alpha,
                             limit=limit, weight_on_input=weight_on_input, block_rows=cfg_gu.block_m)
    if cfg_gu.path == "grouped":
        return grouped_experts(x, gate_up, down, topk_ids, topk_weights, activation=activation, alpha=alpha,
                               limit=limit, weight_on_input=weight_on_input)
    if mma != (cfg_gu.path == "mma"):
        raise ValueError(f"config {cfg_gu}: the experts are {'' if mma else 'not '}in the mma layout")
    if mma:
        per_row = cfg_gu.block_m == 1
        return mma_experts(x, gate_up, down, topk_ids, topk_weights, per_row=per_row, sms=props.sms,
                           activation=activation, alpha=alpha, limit=limit,
                           pdl=per_row and experts_pdl(props, Flags.from_env()))
    with on_device(x):
        routes = {cfg: route(topk_ids, gate_up.num_experts, cfg) for cfg in config}
        h = gate_up_stage(x, gate_up, topk_ids, topk_weights, cfg_gu, routes[cfg_gu], activation=activation,
                          alpha=alpha, limit=limit, weight_on_input=weight_on_input)
        return down_stage(h, down, topk_ids, topk_weights, cfg_d, routes[cfg_d], dtype=x.dtype,
                          activation=activation, alpha=alpha, limit=limit, weight_on_input=weight_on_input)


def route(topk_ids: torch.Tensor, num_experts: int, cfg: ExpertsConfig):
    """The sorted blocks a ``sorted`` launch of ``cfg`` reads (routing.align_block_size), ``None`` for ``pairs``."""
    return align_block_size(topk_ids, num_experts, cfg.block_m) if cfg.path == "sorted" else None


def gate_up_stage(x, gate_up: PackedExperts, topk_ids, topk_weights, cfg: ExpertsConfig, routing, *,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  weight_on_input: bool = False) -> torch.Tensor:
    """The first projection, one launch (x, topk_ids and topk_weights contiguous; ``routing`` from :func:`route`):
    ``sorted``, ``h`` (T * k, I) in x's dtype, the activation applied; ``pairs``, the float32 partial sums of gate
    and up (split, T * k, 2I) of its split-K programs, which :func:`down_stage` activates as it loads them."""
    pairs, inter = topk_ids.numel(), gate_up.shape[0] // 2
    if cfg.path == "pairs":
        h = dequant._alloc((cfg.split, pairs, 2 * inter), torch.float32, x.device)
    else:
        if cfg.split != 1:
            raise ValueError(f"{cfg}: the sorted path does not split K")
        h = dequant._alloc((pairs, inter), x.dtype, x.device)
    _launch(x, gate_up, h, cfg, n=inter, gated=True, routing=routing, a_by_token=True, scale_input=weight_on_input,
            scale_output=False, topk_ids=topk_ids, topk_weights=topk_weights, act=ACTIVATIONS[activation],
            alpha=float(alpha), limit=float(limit), split_out=cfg.path == "pairs")
    return h


def down_stage(h, down: PackedExperts, topk_ids, topk_weights, cfg: ExpertsConfig, routing, *, dtype: torch.dtype,
               activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
               weight_on_input: bool = False) -> torch.Tensor:
    """The block's output (T, H) in ``dtype`` (x's) from :func:`gate_up_stage`'s result: the second projection with
    the top-k weight (unless ``weight_on_input``), its split-K partial sums and each token's slots then summed."""
    tokens, top_k = topk_ids.shape
    pairs, hidden = topk_ids.numel(), down.shape[0]
    if cfg.path == "sorted" and cfg.split != 1:
        raise ValueError(f"{cfg}: the sorted path does not split K")
    # (sorted: the rows of unused slots belong to no block, so y starts at zero; pairs writes every row)
    y = (torch.zeros((1, pairs, hidden), dtype=torch.float32, device=h.device) if cfg.path == "sorted"
         else dequant._alloc((cfg.split, pairs, hidden), torch.float32, h.device))
    _launch(h, down, y, cfg, n=hidden, gated=False, routing=routing, a_by_token=False, scale_input=False,
            scale_output=not weight_on_input, topk_ids=topk_ids, topk_weights=topk_weights,
            act=ACTIVATIONS[activation], alpha=float(alpha), limit=float(limit), split_out=True,
            a_split=h.shape[0] if h.dim() == 3 else 0, a_dtype=dtype)
    out = dequant._alloc((tokens, hidden), dtype, h.device)
    _sum_slots_kernel[(tokens, cdiv(hidden, SUM_BLOCK))](y, out, hidden, pairs, TOPK=top_k, SPLIT=y.shape[0],
                                                         BLOCK_H=SUM_BLOCK, num_warps=2)
    return out
