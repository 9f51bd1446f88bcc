"""Mixture-of-experts blocks on the tensor-core decode layout: the dense decode GEMV (``mma_gemv.py``) run per expert.

A block whose experts fit it (4-bit, groups of a multiple of 64, widths of a multiple of 16, no bias, 16-bit
activations) keeps each projection's experts as :class:`MmaExperts`: the experts'
:func:`~quantpack.kernels.mma_layout.mma_pack` layouts stacked, in place of the checkpoint's (K/2, N) layout (same
bytes; modules/experts.py converts a block once its tensors are on a GPU). Each projection is then one launch of the
``mma`` kernel over blocks of rows, each block with its own expert:

* decode, few pairs per expert (:data:`~quantpack.kernels.moe.dispatch.PAIRS_PER_EXPERT`): one block per (token,
  slot) pair, x's row read in place (no sorting);
* more pairs per expert: pairs sorted into blocks of 16 per expert on the GPU (routing.py), x's rows gathered;
* prefill, many pairs per expert: grouped.py dequantizes ranges of experts (from this layout, :meth:`MmaExperts.rows`)
  for ``torch._grouped_mm``.

Between the projections one small kernel sums gate_up's split-K partials and applies the activation; after down one
sums its partials and each token's slots with their top-k weights, in float32, rounded once (for one or two tokens,
down's own last program of each tile does this: three launches a block, chained with programmatic dependent launch
on Hopper). No host sync: a decode step is captured in a CUDA graph and replayed with new routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ... import reference
from ...env import switch
from ...format import PackedExperts
from .. import dequant
from ..dequant import cdiv, interpreting, on_device, triton_usable
from ..dispatch import launch_plans_enabled
from ..caches import counter_slice, mma_self_check
from ..launch_plan import KernelReplays, tensor_key
from ..mma_gemv import launch_mma_experts, mma_depth, mma_grid
from ..mma_layout import CHUNK, mma_pack, mma_unpack
from .activation import ACTIVATIONS, expert_activation
from .routing import align_block_size, gather_rows

BLOCK_ROWS = 16  # rows of a sorted block (one 16-row block of the mma kernel)
PROGRAMS_PER_SM = 8  # two-warp programs per SM the launch aims at (column tiles, then K split)
KWARPS_MIN_GROUPS = 32  # sorted blocks: K split over two warps of a program from this many groups in it (H200:
# Mixtral-8x7B's 32 and 112 at 16 and 64 tokens, 412 -> 380 and 555 -> 508 us; Qwen3-30B-A3B's 16 and 6 were 20%
# slower so; a block per pair: 10% slower at Mixtral's batch 1)
ACT_BLOCK = 256  # columns per program of the activation kernel
SUM_BLOCK = 256  # columns per program of the final sum (at batch 1 its programs are few: small ones, more of them)
ELEMENTWISE_WARPS = 2  # warps of those two kernels' programs (four columns a thread)
SUMMED_BY_DOWN_MAX_TOKENS = 2  # decode up to this many tokens: down's last programs sum each token's slots (H200:
# 19.1 -> 17.4 us for Qwen3-30B-A3B's batch-1 block, 70.4 -> 69.3 for Mixtral's; from 4 tokens, 1-5% slower: the
# arrivals' round trips hold each program's slot, and the launches span several waves). gate_up's activation done
# the same way ran 0.4 us faster for Qwen3 and 15 us slower for Mixtral: not done.
PACK_EXPERTS = 16  # experts repacked per step (the repack's transient tensors are about 16x their packed bytes)


@dataclass(frozen=True)
class MmaExperts:
    """One projection's experts in the ``mma`` layout: ``words`` (E, N/16, K/64, 32, 4) int32, expert ``e``'s
    :func:`~quantpack.kernels.mma_layout.mma_pack` of its 4-bit (K/2, N) weight; ``scales``/``zeros`` (E, K/g, N)
    as in :class:`~quantpack.format.PackedExperts`."""

    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    shape: tuple[int, int]  # (N, K) of each expert's matrix
    bits: int = 4
    bias: None = None

    @property
    def num_experts(self) -> int:
        return self.words.shape[0]

    @classmethod
    def from_packed(cls, pe: PackedExperts) -> "MmaExperts":
        """``pe``'s experts repacked (PACK_EXPERTS at a time: the transient tensors are theirs)."""
        if not mma_experts_fit(pe, pe.scales.dtype):
            raise ValueError(f"experts of shape {pe.shape}, {pe.bits}-bit, group size {pe.group_size}: not a shape "
                             f"the mma layout holds")
        n, k = pe.shape
        words = torch.empty((pe.num_experts, n // 16, k // CHUNK, 32, 4), dtype=torch.int32, device=pe.qweight.device)
        for e in range(0, pe.num_experts, PACK_EXPERTS):
            words[e:e + PACK_EXPERTS] = mma_pack(pe.qweight[e:e + PACK_EXPERTS], n, k)
        return cls(words, pe.scales, pe.zeros, pe.group_size, pe.shape)

    def rows(self, e0: int = 0, e1: int | None = None) -> PackedExperts:
        """Experts ``e0 .. e1 - 1`` in the checkpoint's (K/2, N) layout (a copy; one Triton launch where Triton
        runs, reading and writing the packed bytes once)."""
        e1 = self.num_experts if e1 is None else e1
        n, k = self.shape
        words = self.words[e0:e1]
        if triton_usable(words):
            qweight = dequant._alloc((e1 - e0, k // 2, n), torch.uint8, words.device)
            key = tensor_key(words) if launch_plans_enabled() else None
            with on_device(words):
                _UNPACK(key, (e1 - e0, cdiv(n, UNPACK_COLUMNS), k // CHUNK), words, words, qweight, n, k,
                        COLUMNS=UNPACK_COLUMNS, num_warps=4)
        else:
            qweight = mma_unpack(words, n, k)
        return PackedExperts(qweight, self.scales[e0:e1], self.zeros[e0:e1], 4, self.group_size, self.shape)


def mma_experts_fit(pe: PackedExperts, dtype: torch.dtype) -> bool:
    """Whether experts ``pe`` (run on activations of ``dtype``) fit the mma layout and kernel."""
    n, k = pe.shape
    return (pe.bits == 4 and pe.bias is None and pe.group_size % CHUNK == 0 and k % pe.group_size == 0
            and n % 16 == 0 and dtype in (torch.float16, torch.bfloat16) and pe.scales.dtype == dtype)


def mma_layout_usable(stacks, device, weight_on_input: bool = False) -> bool:
    """Whether a block's experts ``stacks`` (its :class:`~quantpack.format.PackedExperts`, gate_up and down) can be
    held in the mma layout on ``device``: a GPU whose mma kernel passed its self-check (or the CPU under
    TRITON_INTERPRET=1), QUANTPACK_MMA on, no input-side routing weight, and each stack fitting the layout
    (:func:`mma_experts_fit`, at its scales' dtype)."""
    device = torch.device(device)
    on = device.type == "cuda" or (device.type == "cpu" and interpreting())
    return (on and not weight_on_input and switch("QUANTPACK_MMA")
            and all(mma_experts_fit(pe, pe.scales.dtype) for pe in stacks)
            and (device.type != "cuda" or mma_self_check(device)))


def mma_experts_grid(blocks: int, n: int, k: int, group_size: int, sms: int, sorted_blocks: bool = False,
                     sums_slots: bool = False):
    """The mma grid for ``blocks`` blocks of rows over an (N, K) expert: two-warp programs, one 16-row tile of N per
    warp, K split until the GPU has about PROGRAMS_PER_SM programs per SM (a decode GEMV is latency-bound: the
    more loads in flight, the nearer the copy bandwidth); for ``sorted_blocks`` (16 rows) whose programs still
    hold KWARPS_MIN_GROUPS groups or more, two more warps split each program's K range. ``sums_slots``: the launch
    also sums each token's slots (down at up to SUMMED_BY_DOWN_MAX_TOKENS tokens), which the last program of each
    column tile does over every split's rows: the split rounds down to at most PROGRAMS_PER_SM programs per SM
    (H200, Qwen3-30B-A3B's block: 18.3 -> 17.0 us at one token, split 3 -> 2; 23.5 -> 22.4 at two, 2 -> 1; rounding
    gate_up's down too made two tokens 7% slower)."""
    along_n = max(1, n // 32)
    wanted = PROGRAMS_PER_SM * sms
    split = max(1, wanted // (blocks * along_n) if sums_slots else cdiv(wanted, blocks * along_n))
    grid = mma_grid(n, k, group_size, 2, split, 1, 4)
    if sorted_blocks and grid.groups >= KWARPS_MIN_GROUPS:
        grid = mma_grid(n, k, group_size, 2, split, 1, 4, kwarps=2)
    return grid


@triton.jit
def _activate_kernel(p_ptr, h_ptr, R, I, alpha, limit, SPLIT: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """h[r] = act(sum_s gate[s, r], sum_s up[s, r]) in h's dtype: ``p`` (SPLIT, R, 2I) float32, gate then up (the
    splits unrolled: their loads are in flight together). ``PDL``: launched with PDL, it lets the next grid start
    at once and waits for the previous one before reading."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        row = p_ptr + (s * R + r) * 2 * I
        g += tl.load(row + cols, mask=mask, other=0.0)
        u += tl.load(row + I + cols, mask=mask, other=0.0)
    h = expert_activation(g, u, ACT, alpha, limit)
    tl.store(h_ptr + r * I + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_sum_kernel(y_ptr, pos_ptr, ids_ptr, w_ptr, out_ptr, H, R, E, TOPK: tl.constexpr, SPLIT: tl.constexpr,
                         HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over slots j with an expert in [0, E) of w[t, j] * sum_s y[s, row(t, j)], float32, rounded
    once; row(t, j) is pos[t * TOPK + j] (sorted blocks) or the pair index itself. Slots and splits are unrolled, so
    all their loads are in flight together (a loop over them paid one memory round trip each: 7.7 us at
    Qwen3-30B-A3B's batch 1 on an H200, a third of the block)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        ok = (e >= 0) & (e < E)
        w = tl.load(w_ptr + p).to(tl.float32)
        if HAS_POS:
            row = tl.load(pos_ptr + p).to(tl.int64)
        else:
            row = p
        m = mask & ((tl.zeros_like(cols) + ok.to(tl.int32)) != 0)  # (a block mask: the interpreter's & with a
        # scalar flag is not one)
        for s in tl.static_range(SPLIT):
            acc += tl.where(ok, w, 0.0) * tl.load(y_ptr + (s * R + row) * H + cols, mask=m, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _project(x2, pe: MmaExperts, ids, *, per_row: bool, x_div: int, rows: int, sms: int, out=None,
             topk_weights=None, pdl: bool = False, release: bool = False) -> torch.Tensor:
    """One projection: (split, rows, N) float32 partial sums (see launch_mma_experts); with ``out`` (tokens, N),
    each token's rows times ``topk_weights``, summed, written there by the launch itself. ``pdl``, ``release``: as
    launch_mma_experts takes them."""
    n, k = pe.shape
    blocks = ids.numel()
    grid = mma_experts_grid(blocks, n, k, pe.group_size, sms, sorted_blocks=not per_row, sums_slots=out is not None)
    partials = dequant._alloc((grid.split, rows, n), torch.float32, x2.device)
    counters = counter_slice(x2.device, out.shape[0] * grid.programs) if out is not None else None
    # (rawq: the zeros applied in float32)
    launch_mma_experts(x2, pe.words, pe.scales, pe.zeros, partials, ids, per_row=per_row, x_div=x_div, n=n, k=k,
                       group_size=pe.group_size, grid=grid, depth=mma_depth(grid, pe.group_size, 0),
                       rawq=True, use_asm=not interpreting(), replay=launch_plans_enabled(), out=out,
                       counters=counters, topk_weights=topk_weights, pdl=pdl, release=release)
    return partials if out is None else out


def mma_experts(x: torch.Tensor, gate_up: MmaExperts, down: MmaExperts, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, per_row: bool, sms: int, activation: str = "silu",
                alpha: float = 1.702, limit: float = 7.0, pdl: bool = False) -> torch.Tensor:
    """:func:`quantpack.reference.experts`'s semantics (no bias, weights on the output) on the mma layout, for
    contiguous ``x`` (T, H), ``topk_ids`` and ``topk_weights`` (T, k): ``per_row``, one block per (token, slot) pair
    (up to :data:`SUMMED_BY_DOWN_MAX_TOKENS` tokens, down's launch also sums the slots); else pairs sorted into
    blocks of :data:`BLOCK_ROWS` per expert. ``sms``: the GPU's multiprocessors (grid sizing). ``pdl`` (``per_row``,
    a Hopper GPU; dispatch.experts_pdl decides): the activation's grid starts while gate_up finishes, and down's
    loads its experts' weights while the activation runs (the routing that wrote the ids came before gate_up, which
    is launched without PDL)."""
    tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    with on_device(x):
        if per_row:
            ids = topk_ids.reshape(-1)
            h = activate(_project(x, gate_up, ids, per_row=True, x_div=top_k, rows=pairs, sms=sms, release=pdl),
                         x.dtype, activation, alpha, limit, pdl=pdl)
            if tokens <= SUMMED_BY_DOWN_MAX_TOKENS:
                return _project(h, down, ids, per_row=True, x_div=1, rows=pairs, sms=sms, topk_weights=topk_weights,
                                out=dequant._alloc((tokens, x.shape[1]), x.dtype, x.device), pdl=pdl)
            y = _project(h, down, ids, per_row=True, x_div=1, rows=pairs, sms=sms, pdl=pdl)
            return weighted_sum(y, None, topk_ids, topk_weights, x.dtype, gate_up.num_experts)
        sorted_pairs, ids, pos = align_block_size(topk_ids, gate_up.num_experts, BLOCK_ROWS, positions=True)
        rows = sorted_pairs.numel()
        xg = gather_rows(x, sorted_pairs, ids, top_k, BLOCK_ROWS, gate_up.num_experts)
        gu = _project(xg, gate_up, ids, per_row=False, x_div=1, rows=rows, sms=sms)
        h = activate(gu, x.dtype, activation, alpha, limit)
        y = _project(h, down, ids, per_row=False, x_div=1, rows=rows, sms=sms)
        return weighted_sum(y, pos, topk_ids, topk_weights, x.dtype, gate_up.num_experts)


_ACTIVATE, _WEIGHTED_SUM = KernelReplays(_activate_kernel), KernelReplays(_weighted_sum_kernel)


def activate(gu: torch.Tensor, dtype: torch.dtype, activation: str, alpha: float, limit: float,
             pdl: bool = False) -> torch.Tensor:
    """h (rows, I) in ``dtype`` = the activation of gate_up's float32 (split, rows, 2I) partial sums (or (rows, 2I))
    summed over their splits (on gu's device, which the caller made current); ``pdl``: launched with PDL (a GPU)."""
    split, rows, two_i = (1, *gu.shape) if gu.dim() == 2 else gu.shape
    inter = two_i // 2
    h = dequant._alloc((rows, inter), dtype, gu.device)
    key = (tensor_key(gu), dtype, activation, alpha, limit, pdl) if launch_plans_enabled() else None
    _ACTIVATE(key, (rows, cdiv(inter, ACT_BLOCK), 1), gu, gu, h, rows, inter, float(alpha), float(limit),
              SPLIT=split, ACT=ACTIVATIONS[activation], BLOCK=ACT_BLOCK, PDL=pdl, num_warps=ELEMENTWISE_WARPS,
              **({"launch_pdl": True} if pdl else {}))
    return h


def weighted_sum(y: torch.Tensor, pos: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 dtype: torch.dtype, num_experts: int) -> torch.Tensor:
    """out (T, H) in ``dtype``: each token's rows of y (float32 (split, rows, H) partial sums, or (rows, H)) times
    their top-k weights, summed in float32; row of pair p: ``pos[p]``, or p itself where ``pos`` is None."""
    split, rows, hidden = (1, *y.shape) if y.dim() == 2 else y.shape
    tokens, top_k = topk_ids.shape
    out = dequant._alloc((tokens, hidden), dtype, y.device)
    pos_t = pos if pos is not None else topk_ids
    key = ((tensor_key(y, pos_t, topk_ids, topk_weights), dtype, num_experts, pos is not None)
           if launch_plans_enabled() else None)
    _WEIGHTED_SUM(key, (tokens, cdiv(hidden, SUM_BLOCK), 1), y, y, pos_t, topk_ids, topk_weights, out, hidden,
                  rows, num_experts, TOPK=top_k, SPLIT=split, HAS_POS=pos is not None, BLOCK=SUM_BLOCK,
                  num_warps=ELEMENTWISE_WARPS)
    return out


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, G, T0, NC, CHUNKS: tl.constexpr):
    """One expert's 16 rows of N (tile T0 + program 1) by CHUNKS x 64 in-features, dequantized from the mma layout
    into out (E, NC, K), whose rows start at row 16 T0: each element gathers its word (lane 4g + c, word j) and
    nibble (bits 4(h + 2kh) + 16e) as mma_pack placed it, so the stores run along K."""
    e = tl.program_id(0).to(tl.int64)
    t = T0 + tl.program_id(1)
    kc0 = tl.program_id(2) * CHUNKS
    nn = tl.arange(0, 16)[:, None]
    kk = tl.arange(0, 64 * CHUNKS)[None, :]
    kc = kc0 + kk // 64
    kin = kk % 64  # (16c + 8kh + 2j + e within the chunk)
    lane = 4 * (nn % 8) + kin // 16
    word = (kin % 8) // 2
    shift = 4 * (nn // 8 + 2 * ((kin % 16) // 8)) + 16 * (kin % 2)
    k = kc * 64 + kin
    ok = (k < K) & (nn < 16)
    chunks_per_row = K // 64
    w = tl.load(w_ptr + e * (N // 16) * chunks_per_row * 128 + (t * chunks_per_row + kc) * 128 + lane * 4 + word,
                mask=ok, other=0)
    q = ((w >> shift) & 15).to(tl.float32)
    n = t * 16 + nn
    meta = e * (K // G) * N + (k // G) * N + n
    s = tl.load(s_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (e * NC + n - 16 * T0) * K + k, ((q - z) * s).to(out_ptr.dtype.element_ty), mask=ok)


DEQUANT_CHUNKS = 4  # 64-in-feature chunks per program of the dequantization


UNPACK_COLUMNS = 128  # out-features per program of the unpacking: whole 128-byte lines of its (K/2, N) rows


@triton.jit
def _unpack_kernel(w_ptr, out_ptr, N, K, COLUMNS: tl.constexpr):
    """:func:`~quantpack.kernels.mma_layout.mma_unpack` for one expert's COLUMNS out-features (program 1) by one
    64-in-feature chunk (program 2): out (E, K/2, N) uint8, each of its 32 rows stored whole. In-features 2p and
    2p + 1 sit in one word, 16 bits apart (mma_pack's e)."""
    e = tl.program_id(0).to(tl.int64)
    kc = tl.program_id(2)
    pp = tl.arange(0, 32)[:, None]
    n = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    t = n // 16
    nn = n % 16
    kin = 2 * pp  # (the even in-feature within the chunk: 16c + 8kh + 2j)
    lane = 4 * (nn % 8) + kin // 16
    word = (kin % 8) // 2
    shift = 4 * (nn // 8 + 2 * ((kin % 16) // 8))
    ok = (n < N) & (pp < 32)
    chunks_per_row = K // 64
    w = tl.load(w_ptr + e * (N // 16) * chunks_per_row * 128 + (t * chunks_per_row + kc) * 128 + lane * 4 + word,
                mask=ok, other=0)
    byte = ((w >> shift) & 15) | (((w >> (shift + 16)) & 15) << 4)
    tl.store(out_ptr + e * (K // 2) * N + (kc * 32 + pp) * N + n, byte.to(tl.uint8), mask=ok)


_UNPACK = KernelReplays(_unpack_kernel)


def mma_dequantize(pe: MmaExperts, e0: int, e1: int, dtype: torch.dtype, n0: int = 0,
                   n1: int | None = None) -> torch.Tensor:
    """Experts ``e0 .. e1 - 1`` dense, out-features ``n0 .. n1 - 1`` (multiples of 16; default all), as an
    (e1 - e0, K, n1 - n0) view of an (e1 - e0, n1 - n0, K) tensor in ``dtype``: one launch straight from the mma
    layout (grouped.py's prefill)."""
    n, k = pe.shape
    n1 = n if n1 is None else n1
    if n0 % 16 or n1 % 16 or not 0 <= n0 < n1 <= n:
        raise ValueError(f"mma_dequantize: columns {n0}..{n1} must be multiples of 16 within 0..{n}")
    count = e1 - e0
    out = dequant._alloc((count, n1 - n0, k), dtype, pe.words.device)
    with on_device(out):
        _dequantize_kernel[(count, (n1 - n0) // 16, cdiv(k // CHUNK, DEQUANT_CHUNKS))](
            pe.words[e0:e1], pe.scales[e0:e1], pe.zeros[e0:e1], out, n, k, pe.group_size, n0 // 16, n1 - n0,
            CHUNKS=DEQUANT_CHUNKS, num_warps=4)
    return out.transpose(1, 2)


def reference_experts(x, gate_up, down, topk_ids, topk_weights, **kwargs) -> torch.Tensor:
    """:func:`quantpack.reference.experts` for experts in either layout."""
    if isinstance(gate_up, MmaExperts):
        gate_up, down = gate_up.rows(), down.rows()
    return reference.experts(x, gate_up, down, topk_ids, topk_weights, **kwargs)
