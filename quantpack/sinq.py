"""Sinkhorn-normalized per-input-feature scales, absorbed exactly into the model (pre-SINQ).

Group-wise quantization along in-features is blind to a per-row scale (each group lies in one
row), but not to a per-column one: a column with a large spread widens every group it touches.
SINQ (arXiv 2509.22944) balances a weight by alternately dividing its columns and rows by their
standard deviations (a Sinkhorn-style iteration); the column factors ``t`` are then moved out of
the weight and into whatever produces its input, so that ``W x == (W / t) (t * x)`` holds exactly
and the checkpoint keeps its format (one scale and one zero per group):

* q/k/v share one vector, absorbed into the preceding RMSNorm/LayerNorm weight (pre-norm blocks
  only: a post-norm block's norm output also feeds the residual);
* gate/up share one vector, absorbed into the post-attention norm;
* down_proj's vector into up_proj's rows (``act(gate) * up`` is linear in up);
* o_proj's vector into v_proj's rows (attention mixes whole value rows), when every value head
  feeds one query head (no grouped-query sharing) or the vector is shared across the group.

Layers whose input cannot take a scale keep their weight as it is. The weights are then
quantized by the ``hqq`` solver; see :func:`quantpack.quantize.quantize`.
"""
from __future__ import annotations

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
    log_c = torch.zeros(m.shape[0], 1, tile)
    log_r = torch.zeros(m.shape[0], n, 1)
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


def _scale_rows(linear: nn.Linear, factor: torch.Tensor) -> None:
    linear.weight.mul_(factor.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias.mul_(factor.to(linear.bias.dtype))


def _scale_cols(linear: nn.Linear, factor: torch.Tensor) -> None:
    linear.weight.mul_(factor.to(linear.weight.dtype)[None, :])


def _scale_norm(norm: nn.Module, factor: torch.Tensor) -> None:
    norm.weight.mul_(factor.to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.mul_(factor.to(norm.bias.dtype))


def _decoder_layers(model: nn.Module):
    """Pre-norm decoder blocks with Llama's module names (Llama, Mistral, Qwen, ...)."""
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        if (attn is not None and mlp is not None and hasattr(module, "input_layernorm")
                and hasattr(module, "post_attention_layernorm")
                and all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))):
            yield module


@torch.no_grad()
def absorb(model: nn.Module, *, iters: int = DEFAULT_ITERS, tile: int = DEFAULT_TILE, passes: int = 1) -> list[str]:
    """Move Sinkhorn column scales of every absorbable linear into its input's producer, in place.

    The model computes the same function afterwards (to float rounding). Returns the names of the
    linear modules whose weights were rescaled by a column vector.
    """
    names = {m: n for n, m in model.named_modules()}
    done: set[str] = set()
    for _ in range(passes):
        for layer in _decoder_layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            heads = getattr(attn, "num_key_value_groups", 1) or 1
            # o_proj <- v_proj rows: o's input is softmax-mixed value rows, one value head per
            # group of query heads; with grouping the vector must agree across the group.
            o, v = attn.o_proj, attn.v_proj
            hd = getattr(attn, "head_dim", None)
            if hd and o.in_features == v.out_features * heads and v.out_features % hd == 0:
                kv = v.out_features // hd
                # o's input index is (kv head * groups + g) * head_dim + d; v's row is kv head * head_dim + d
                blocks = o.weight.reshape(o.out_features, kv, heads, hd).permute(2, 0, 1, 3)
                t = column_scales([blocks.reshape(-1, v.out_features)], iters=iters, tile=tile)
                _scale_cols(o, t.reshape(kv, 1, hd).expand(kv, heads, hd).reshape(-1).reciprocal())
                _scale_rows(v, t)
                done.add(names[o])
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            t = column_scales([p.weight for p in qkv], iters=iters, tile=tile)
            for p in qkv:
                _scale_cols(p, t.reciprocal())
                done.add(names[p])
            _scale_norm(layer.input_layernorm, t)
            gate, up, down = (getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj"))
            if not all(isinstance(p, nn.Linear) for p in (gate, up, down)):
                continue
            t = column_scales([down.weight], iters=iters, tile=tile)
            _scale_cols(down, t.reciprocal())
            _scale_rows(up, t)
            done.add(names[down])
            t = column_scales([gate.weight, up.weight], iters=iters, tile=tile)
            for p in (gate, up):
                _scale_cols(p, t.reciprocal())
                done.update((names[gate], names[up]))
            _scale_norm(layer.post_attention_layernorm, t)
        # Post-norm encoders (BERT-style): only attention's output projection takes a scale,
        # from the value projection's rows; everything else feeds a residual or a GELU.
        for module in model.modules():
            attn_self = getattr(module, "self", None)
            out = getattr(module, "output", None)
            value, dense = getattr(attn_self, "value", None), getattr(out, "dense", None)
            if isinstance(value, nn.Linear) and isinstance(dense, nn.Linear) and dense.in_features == value.out_features:
                t = column_scales([dense.weight], iters=iters, tile=tile)
                _scale_cols(dense, t.reciprocal())
                _scale_rows(value, t)
                done.add(names[dense])
    return sorted(done)
