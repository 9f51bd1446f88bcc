"""Pure-torch reference path: the oracle every kernel is tested against, and the CPU fallback."""
from __future__ import annotations

import torch

from .format import PackedExperts, PackedWeight, unpack


def expand_meta(meta: torch.Tensor, shape, group_size: int, axis: int) -> torch.Tensor:
    """Broadcast packed-layout scales or zeros to the full (N, K) weight shape."""
    if axis == 1:  # (K/g, N) -> (N, K)
        return meta.t().repeat_interleave(group_size, dim=1)
    return meta.repeat_interleave(group_size, dim=1).t()  # (K, N/g) -> (N, K)


def dequantize(pw: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return the (N, K) weight ``(q - zero) * scale``, computed in float32, cast to ``dtype``
    (default: the dtype of the scales)."""
    q = unpack(pw.qweight, pw.bits).float()
    scale = expand_meta(pw.scales.float(), pw.shape, pw.group_size, pw.axis)
    zero = expand_meta(pw.zeros.float(), pw.shape, pw.group_size, pw.axis)
    return ((q - zero) * scale).to(dtype or pw.scales.dtype)


def matmul(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T (+ bias)``, accumulated in float32, returned in ``x.dtype``."""
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={pw.in_features}")
    out = x.float() @ dequantize(pw, torch.float32).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


FP8_MAX = 448.0  # the largest finite float8 e4m3 (float8_e4m3fn) value
FP8_AMAX_FLOOR = 1e-30  # an all-zero row quantizes to zeros with a finite scale


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 e4m3 quantization of ``x`` (..., K), as the W4A8 path does it (kernels/w4a8.py): ``(xq,
    scale)`` with ``amax = max(max_k |x|, FP8_AMAX_FLOOR)``, ``scale = amax / 448`` (float32, ``x.shape[:-1]``) and
    ``xq = clamp(x * (448 / amax), -448, 448)`` rounded to float8_e4m3fn (``x ~ xq * scale``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    # (both divisions correctly rounded, as the kernel's: torch's float32 division of a scalar by a tensor is not)
    inv = (FP8_MAX / amax.double()).float()
    xq = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, (amax.double() / FP8_MAX).float().squeeze(-1)


def matmul_fp8_activations(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`matmul` with ``x`` first quantized per token to FP8 (:func:`quantize_activations_fp8`): the float
    reference of the W4A8 path, and what the CPU runs where that path is forced (``QUANTPACK_W4A8=force``)."""
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={pw.in_features}")
    xq, scale = quantize_activations_fp8(x)
    out = (xq.float() @ dequantize(pw, torch.float32).t()) * scale.unsqueeze(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# Expert activations (``gate_up`` holds the gate rows first, then the up rows): what ``h`` is made of.
EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")


def expert_activation(gate_up: torch.Tensor, activation: str, *, alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """``h`` from one projection's output (..., 2I): ``act(gate) * up`` for ``silu``, ``gelu`` (erf) and
    ``gelu_tanh``; for ``swiglu_oai`` (gpt-oss) ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)``. Computed in ``gate_up``'s dtype (callers pass float32)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return torch.nn.functional.gelu(gate, approximate=approximate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)
    raise ValueError(f"activation={activation!r}: use one of {', '.join(EXPERT_ACTIVATIONS)}")


def experts(x: torch.Tensor, gate_up: PackedExperts, down: PackedExperts, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor, *, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
            weight_on_input: bool = False) -> torch.Tensor:
    """A mixture-of-experts block's experts on packed weights: the oracle of the fused expert kernels.

    ``x`` (T, H); ``gate_up`` stacks each expert's (2I, H) matrix (gate rows, then up rows) and ``down`` its (H, I)
    matrix; ``topk_ids`` (T, k) names the experts each token goes to (an id outside ``[0, E)`` is an unused slot) and
    ``topk_weights`` (T, k) their weights. For each (token, slot): ``h = activation(x @ W_gu.T + b_gu)``, rounded to
    ``x.dtype`` (as a kernel stores it), then ``y = h @ W_d.T + b_d``; the token's output is ``sum_slots w * y``
    (with ``weight_on_input``, Llama 4's form: ``x`` is scaled by ``w`` before ``gate_up`` and ``y`` is summed
    unweighted). Accumulated in float32, returned in ``x.dtype``.
    """
    if x.dim() != 2 or x.shape[1] != gate_up.shape[1]:
        raise ValueError(f"x: expected (tokens, {gate_up.shape[1]}), got {tuple(x.shape)}")
    if down.shape != (gate_up.shape[1], gate_up.shape[0] // 2) or down.num_experts != gate_up.num_experts:
        raise ValueError(f"down: {down.num_experts} experts of shape {down.shape} do not fit gate_up's "
                         f"{gate_up.num_experts} of shape {gate_up.shape}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}: expected "
                         f"both ({x.shape[0]}, top_k)")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if not 0 <= e < gate_up.num_experts:
            continue
        token, slot = torch.where(ids == e)
        w = topk_weights[token, slot].float().unsqueeze(1)
        xe = x[token].float()
        if weight_on_input:
            xe = (xe * w).to(x.dtype).float()
        gu = xe @ dequantize(gate_up.expert(e), torch.float32).t()
        if gate_up.bias is not None:
            gu = gu + gate_up.bias[e].float()
        h = expert_activation(gu, activation, alpha=alpha, limit=limit).to(x.dtype).float()
        y = h @ dequantize(down.expert(e), torch.float32).t()
        if down.bias is not None:
            y = y + down.bias[e].float()
        out.index_add_(0, token, y if weight_on_input else y * w)
    return out.to(x.dtype)
