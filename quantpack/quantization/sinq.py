"""Sinkhorn-normalized per-input-feature scales, absorbed exactly into the model (pre-SINQ).

Group-wise quantization along in-features is blind to a per-row scale (each group lies in one
row), but not to a per-column one: a column with a large spread widens every group it touches.
SINQ (arXiv 2509.22944) balances a weight by alternately dividing its columns and rows by their
standard deviations (a Sinkhorn-style iteration); the column factors ``t`` are then moved out of
the weight and into whatever produces its input, so that ``W x == (W / t) (t * x)`` holds exactly
and the checkpoint keeps its format (one scale and one zero per group):

* q/k/v share one vector, absorbed into the preceding RMSNorm/LayerNorm weight (pre-norm blocks
  only: a post-norm block's norm output also feeds the residual);
* gate/up share one vector, absorbed into the MLP's input norm (Llama's post-attention norm; the
  pre-feedforward norm where a block has one, as Gemma 2/3's, whose post-attention norm scales the
  attention output);
* down_proj's vector into up_proj's rows (``act(gate) * up`` is linear in up);
* o_proj's vector into v_proj's rows (attention mixes whole value rows), when every value head
  feeds one query head (no grouped-query sharing) or the vector is shared across the group.

Layers whose input cannot take a scale keep their weight as it is; so do q/k/v and gate/up where
the norms multiply by ``1 + weight`` (Gemma's): ``(1 + w) t - 1`` is no rescaling of the stored
weight; the norm modules themselves tell (:func:`norm_gain`), and norms of no known kind are left
alone too; a block holding more than attention, MLP and norms keeps all its weights (:func:`plain_block`).
The weights are then quantized by the ``hqq`` solver; see :func:`quantpack.quantization.groupwise.quantize`.

A vector does not always help: the scaled-down columns' inputs grow by the same factor, so their
quantization error counts more. Given the target bits and group size, each block's vectors are kept
only where a data-free estimate of the output error drops (:func:`block_scales`). :func:`plan`
does this on a checkpoint's tensors one block at a time (the converter's ``--method sinq``);
:func:`absorb` on a loaded model.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

DEFAULT_ITERS = 16
DEFAULT_TILE = 64  # columns are balanced in tiles (as the groups see them), not across all of K


@torch.no_grad()
def column_scales(weights: list[torch.Tensor], *, iters: int = DEFAULT_ITERS, tile: int = DEFAULT_TILE) -> torch.Tensor:
    """One positive factor per input feature for the (N_i, K) weights stacked along rows.

    Sinkhorn-style balancing in the log domain, tile by tile of ``tile`` columns: each step moves
    the column and row log-scales toward equal standard deviations (a damped step, as a plain
    divide overshoots on heavy-tailed weights); the step with the smallest max/min spread of
    row and column deviations wins. Returned with median 1, so the absorbed norm keeps its size.
    """
    w = torch.cat([x.float() for x in weights], dim=0)
    n, k = w.shape
    tile = tile if tile and k % tile == 0 else k
    m = w.reshape(n, k // tile, tile).permute(1, 0, 2)  # (tiles, N, tile)
    log_c = torch.zeros(m.shape[0], 1, tile, device=w.device)
    log_r = torch.zeros(m.shape[0], n, 1, device=w.device)
    tiny = 1e-12

    def spread(x):
        sc, sr = x.std(dim=1).clamp_min(tiny), x.std(dim=2).clamp_min(tiny)
        return (torch.maximum(sc.amax(1), sr.amax(1)) / torch.minimum(sc.amin(1), sr.amin(1)))  # (tiles,)

    best = spread(m)
    best_c = log_c.clone()
    for _ in range(iters):
        cur = m * torch.exp(-log_c - log_r)
        target = torch.minimum(cur.std(dim=1).amin(1), cur.std(dim=2).amin(1)).clamp_min(tiny)  # (tiles,)
        log_c = log_c + torch.log(cur.std(dim=1, keepdim=True).clamp_min(tiny) / target[:, None, None]).clamp(
            math.log(0.7), math.log(2.0))
        cur = m * torch.exp(-log_c - log_r)
        log_r = log_r + torch.log(cur.std(dim=2, keepdim=True).clamp_min(tiny) / target[:, None, None]).clamp(
            math.log(0.7), math.log(2.0))
        s = spread(m * torch.exp(-log_c - log_r))
        better = s < best
        best = torch.where(better, s, best)
        best_c = torch.where(better[:, None, None], log_c, best_c)
    t = torch.exp(best_c).reshape(k)
    return t / t.median()


def _weighted_error(weights, act, bits: int, group_size: int) -> float:
    """sum_k act_k^2 ||column k of (Q(W) - W)||^2 over ``weights``: the output error for inputs whose
    feature k has magnitude ``act_k`` (uncorrelated features)."""
    from .groupwise import quantize
    from ..reference import dequantize

    total = 0.0
    for w in weights:
        err = dequantize(quantize(w, bits=bits, group_size=group_size, method="hqq", dtype=torch.bfloat16),
                         torch.float32) - w
        total += float(((err * act) ** 2).sum())
    return total


# A vector is kept only where the estimate promises at least this relative gain. Measured on a
# trained Llama and a pretrained encoder, estimated gains of a few percent were noise: the proxy
# inputs are not the real ones, and such vectors made the end-to-end error up to 16% worse (at
# 8 bits most of all, where there is the least to gain).
KEEP_GAIN = 0.10


def _choose(weights, t, act, bits, group_size):
    """``t``, or None where dividing the columns by it does not clearly lower the expected output error.

    The inputs' magnitudes are not known without data; ``act`` is a proxy from the weights (the
    norm's gain, or the producing rows' norms). A scaled column's input grows by ``t``, so its
    quantization error counts ``t`` times more. The estimated error must drop by
    :data:`KEEP_GAIN` at least.
    """
    if bits is None:
        return t
    group_size = group_size or weights[0].shape[1]  # None: one group per row
    if weights[0].shape[1] % group_size:
        return None
    act = act.float().abs()
    scaled = _weighted_error([w / t for w in weights], act * t, bits, group_size)
    return t if scaled < (1 - KEEP_GAIN) * _weighted_error(weights, act, bits, group_size) else None


@torch.no_grad()
def block_scales(q, k, v, o, gate, up, down, norm_in, norm_post, *, kv_groups: int, head_dim: int | None,
                 bits: int | None = None, group_size: int | None = None, sites=None, iters: int = DEFAULT_ITERS,
                 tile: int = DEFAULT_TILE, into_norms: bool = True) -> dict[str, torch.Tensor]:
    """Column-scale vectors for one pre-norm decoder block, from its weights (any float dtype).

    Returns a subset of ``{"o": t_o, "qkv": t_qkv, "down": t_d, "gate_up": t_gu}``; applying them
    keeps the block's function (see :func:`apply_block_scales`):

    * o_proj's columns / t_o (repeated over the query heads of each value head), v_proj's rows * t_o;
    * q/k/v_proj's columns / t_qkv, the input norm's weight * t_qkv;
    * down_proj's columns / t_d, up_proj's rows * t_d;
    * gate/up_proj's columns / t_gu, the MLP's input norm's weight * t_gu.

    ``norm_in``/``norm_post``: the norms' gains (what multiplies the normalised input). Without
    ``into_norms`` (norms that cannot take a vector) neither ``qkv`` nor ``gate_up`` is returned.

    With ``bits`` (and ``group_size``) given, a vector is kept only where it lowers a data-free
    estimate of the block's output error at that precision (:func:`_choose`); without, always.
    ``sites`` (a subset of the keys above) computes exactly those, deciding nothing (to redo a
    recorded choice). ``mlp`` weights may be None (a block without a gated MLP).
    """
    def choose(key, weights, t, act):
        if sites is not None:
            return t if key in sites else None
        return _choose(weights, t, act, bits, group_size)

    f = (lambda x: None if x is None else x.float())
    q, k, v, o, gate, up, down = map(f, (q, k, v, o, gate, up, down))
    g_in, g_post = norm_in.float(), norm_post.float() if norm_post is not None else None
    out: dict[str, torch.Tensor] = {}
    if head_dim and o.shape[1] == v.shape[0] * kv_groups and v.shape[0] % head_dim == 0:
        kv = v.shape[0] // head_dim
        # o's input index is (kv head * groups + g) * head_dim + d; v's row is kv head * head_dim + d:
        # with grouped-query attention one vector serves every query head of a value head.
        blocks = o.reshape(o.shape[0], kv, kv_groups, head_dim).permute(2, 0, 1, 3).reshape(-1, v.shape[0])
        t = column_scales([blocks], iters=iters, tile=tile)
        act = (v * g_in).norm(dim=1)  # value rows' gain on a normalised input
        t = choose("o", [blocks], t, act)
        if t is not None:
            out["o"] = t
            v = v * t[:, None]
    if into_norms:
        t = column_scales([q, k, v], iters=iters, tile=tile)
        t = choose("qkv", [q, k, v], t, g_in)
        if t is not None:
            out["qkv"] = t
    if gate is None or up is None or down is None or g_post is None:
        return out
    act = (up * g_post).norm(dim=1) * (gate * g_post).norm(dim=1)  # |act(gate) * up| grows with both
    t = choose("down", [down], column_scales([down], iters=iters, tile=tile), act)
    if t is not None:
        out["down"] = t
        up = up * t[:, None]
    if into_norms:
        t = choose("gate_up", [gate, up], column_scales([gate, up], iters=iters, tile=tile), g_post)
        if t is not None:
            out["gate_up"] = t
    return out


def block_transforms(scales: dict[str, torch.Tensor], *, kv_groups: int, head_dim: int) -> dict[str, tuple]:
    """What :func:`block_scales`' vectors do to each tensor of the block, as
    ``{tensor role: (row factor or None, column factor or None)}``; roles: q, k, v, o, gate, up,
    down (weights, bias rows with the row factor), norm_in, norm_post (the row factor scales the
    norm's weight and bias)."""
    rows: dict[str, list] = {}
    cols: dict[str, list] = {}

    def add(table, role, vec):
        table.setdefault(role, []).append(vec)

    if "o" in scales:
        t = scales["o"]
        kv = t.numel() // head_dim
        add(cols, "o", t.reshape(kv, 1, head_dim).expand(kv, kv_groups, head_dim).reshape(-1).reciprocal())
        add(rows, "v", t)
    if "qkv" in scales:
        for role in ("q", "k", "v"):
            add(cols, role, scales["qkv"].reciprocal())
        add(rows, "norm_in", scales["qkv"])
    if "down" in scales:
        add(cols, "down", scales["down"].reciprocal())
        add(rows, "up", scales["down"])
    if "gate_up" in scales:
        for role in ("gate", "up"):
            add(cols, role, scales["gate_up"].reciprocal())
        add(rows, "norm_post", scales["gate_up"])

    def prod(vs):
        return None if not vs else math.prod(vs[1:], start=vs[0])

    return {role: (prod(rows.get(role)), prod(cols.get(role))) for role in set(rows) | set(cols)}


def scale_tensor(tensor: torch.Tensor, row: torch.Tensor | None, col: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` (a (N, K) weight, or a 1-D bias/norm weight) with its rows and columns scaled, in
    float32, returned in the tensor's dtype."""
    x = tensor.float()
    if row is not None:
        x = x * (row[:, None] if x.dim() == 2 else row)
    if col is not None:
        x = x * col[None, :]
    return x.to(tensor.dtype)


@torch.no_grad()
def absorb(model: nn.Module, *, iters: int = DEFAULT_ITERS, tile: int = DEFAULT_TILE, passes: int = 1,
           bits: int | None = None, group_size: int | None = None) -> list[str]:
    """Move Sinkhorn column scales of every absorbable linear into its input's producer, in place.

    The model computes the same function afterwards (to float rounding). With ``bits`` and
    ``group_size``, a scale is moved only where it is estimated to lower the quantization error
    at that precision (see :func:`block_scales`). Returns the names of the linear modules whose
    weights were rescaled by a column vector.
    """
    params = dict(model.named_parameters())
    names = {m: n for n, m in model.named_modules()}
    done: set[str] = set()
    for _ in range(passes):
        # Pre-norm decoder blocks (Llama's names: Llama, Mistral, Qwen, ...)
        changes, _ = plan(params, lambda name: params[name].detach(), model, bits=bits,
                          group_size=group_size, device=next(model.parameters()).device, iters=iters, tile=tile)
        for name, factors in changes.items():
            p = params[name]
            p.copy_(scale_tensor(p, *(None if f is None else f.to(p.device) for f in factors)))
            row, col = factors
            if col is not None:
                done.add(name.removesuffix(".weight"))
        # Post-norm encoders (BERT-style): only attention's output projection takes a scale,
        # from the value projection's rows; everything else feeds a residual or a GELU.
        for module in model.modules():
            attn_self = getattr(module, "self", None)
            out = getattr(module, "output", None)
            value, dense = getattr(attn_self, "value", None), getattr(out, "dense", None)
            if isinstance(value, nn.Linear) and isinstance(dense, nn.Linear) and dense.in_features == value.out_features:
                t = column_scales([dense.weight], iters=iters, tile=tile)
                t = _choose([dense.weight.float()], t, value.weight.float().norm(dim=1), bits, group_size)
                if t is None:
                    continue
                dense.weight.copy_(scale_tensor(dense.weight, None, t.reciprocal()))
                value.weight.copy_(scale_tensor(value.weight, t, None))
                if value.bias is not None:
                    value.bias.copy_(scale_tensor(value.bias, t, None))
                done.add(names[dense])
    return sorted(done)


@torch.no_grad()
def norm_gain(norm: nn.Module | None) -> str | None:
    """How ``norm`` applies its weight: ``"weight"`` where its output is the normalised input times its
    weight (Llama's RMSNorm, LayerNorm), so that multiplying the weight (and bias) by a vector multiplies
    the output by it; ``"one_plus"`` where it is times ``1 + weight`` (Gemma's RMSNorm), which no
    rescaling of the stored weight can follow; None for anything else (no 1-D weight, a forward that
    takes more than the hidden states, another formula).

    Told by running a float32 copy on the CPU (of a model on the meta device too): with every
    parameter zero, the first kind outputs zero and the second the normalised input.
    """
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    probe = copy.deepcopy(norm)
    probe = (probe.to_empty(device="cpu") if weight.is_meta else probe.cpu()).float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.numel(), generator=gen)
    w = torch.rand(weight.numel(), generator=gen) + 0.5

    for p in probe.parameters():
        p.zero_()

    def run(gain):
        probe.weight.copy_(gain)
        return probe(x)

    try:
        zero, one, scaled = run(torch.zeros_like(w)), run(torch.ones_like(w)), run(w)
        if bool(zero.eq(0).all()):
            return "weight" if bool(one.ne(0).any()) and torch.allclose(scaled, one * w) else None
        return "one_plus" if torch.allclose(scaled, zero * (1 + w)) else None
    except Exception:  # noqa: BLE001 - a norm this probe cannot run is one it does not know
        return None


# What a pre-norm decoder block may hold for the vectors to move exactly: Llama's attention, MLP and norms, Gemma 2/3's
# extra norms, q/k norms (q's and k's rows never change). Anything else may read a norm's output or sit between v
# and o (Cohere's MLP reads the input norm, Gemma 3n's side branches too, and it normalizes v): such a block keeps
# its weights as they are.
_BLOCK_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                             "pre_feedforward_layernorm", "post_feedforward_layernorm"})
_ATTENTION_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "query_layernorm",
                                 "key_layernorm"})
_MLP_CHILDREN = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})


def plain_block(block: nn.Module, mlp: bool) -> bool:
    """Whether ``block`` is made of nothing but the modules above, its MLP reading a norm of its own; ``mlp``:
    whether its MLP's vectors are to move too (then the MLP holds nothing but its projections and activation)."""
    children = dict(block.named_children())
    attention = children.get("self_attn")
    if (attention is None or not children.keys() <= _BLOCK_CHILDREN
            or not dict(attention.named_children()).keys() <= _ATTENTION_CHILDREN):
        return False
    if "mlp" in children and not children.keys() & {"post_attention_layernorm", "pre_feedforward_layernorm"}:
        return False  # (a parallel block: the MLP reads the attention's input norm)
    return not mlp or dict(children["mlp"].named_children()).keys() <= _MLP_CHILDREN


_ROLES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
          "norm_in": "input_layernorm", "norm_post": "post_attention_layernorm"}


@torch.no_grad()
def plan(names, read, model: nn.Module, *, bits: int | None, group_size: int | None, device="cpu",
         kept: dict | None = None, iters: int = DEFAULT_ITERS,
         tile: int = DEFAULT_TILE) -> tuple[dict[str, tuple], dict[str, list[str]]]:
    """The rescaling of a checkpoint's tensors, block by block, without loading the model's weights.

    ``names``: the model's state-dict names; ``read(name)`` returns that tensor. Pre-norm decoder
    blocks are found by Llama's names (``<block>.self_attn.q_proj.weight``, ...,
    ``<block>.input_layernorm.weight``; the MLP's input norm is ``pre_feedforward_layernorm`` where a
    block has one); ``model`` (its weights may be on the meta device) gives the attention heads (its
    config) and the norm modules, whose kind :func:`norm_gain` tells: vectors go into norms that
    scale by their weight only. Returns
    ``({name: (row factor or None, column factor or None)}, {block: kept sites})``: every tensor
    that changes (float32, on the CPU; see :func:`scale_tensor`), and the vectors each block kept
    (see :func:`block_scales`). ``kept`` (a returned record) recomputes those vectors exactly,
    without deciding again. Memory stays near one block's weights.
    """
    names = set(names)
    blocks = sorted(n[: -len(".self_attn.q_proj.weight")] for n in names if n.endswith(".self_attn.q_proj.weight"))
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    kv_groups = heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else 0
    out: dict[str, tuple] = {}
    record: dict[str, list[str]] = {}
    for block in blocks:
        if kept is not None and not kept.get(block):
            continue
        roles = dict(_ROLES)
        if f"{block}.pre_feedforward_layernorm.weight" in names:  # post_attention_layernorm scales attention's output
            roles["norm_post"] = "pre_feedforward_layernorm"
        weights = {role: f"{block}.{path}.weight" for role, path in roles.items()}
        attn_roles = ("q", "k", "v", "o", "norm_in")
        if not kv_groups or not all(weights[r] in names for r in attn_roles):
            continue
        if not all(weights[r] in names for r in ("gate", "up", "down", "norm_post")):
            for r in ("gate", "up", "down", "norm_post"):
                weights[r] = None
        if not plain_block(model.get_submodule(block), mlp=weights["gate"] is not None):
            continue
        kinds = {r: norm_gain(model.get_submodule(f"{block}.{roles[r]}")) for r in ("norm_in", "norm_post")
                 if weights[r] is not None}
        into_norms = all(kind == "weight" for kind in kinds.values())
        t = {r: None if n is None else read(n).to(device) for r, n in weights.items()}
        for r, kind in kinds.items():
            if kind == "one_plus":  # the gain the estimates need
                t[r] = t[r].float() + 1
        scales = block_scales(t["q"], t["k"], t["v"], t["o"], t["gate"], t["up"], t["down"], t["norm_in"],
                              t["norm_post"], kv_groups=kv_groups, head_dim=head_dim, bits=bits,
                              group_size=group_size, sites=None if kept is None else set(kept[block]),
                              iters=iters, tile=tile, into_norms=into_norms)
        del t
        if scales:
            record[block] = sorted(scales)
        for role, (row, col) in block_transforms(scales, kv_groups=kv_groups, head_dim=head_dim).items():
            row, col = (None if x is None else x.float().cpu() for x in (row, col))
            out[weights[role]] = (row, col)
            bias = f"{block}.{roles[role]}.bias"
            if row is not None and bias in names:
                out[bias] = (row, None)
    return out, record
