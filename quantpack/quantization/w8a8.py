"""W8A8 (int8 weights x int8 activations): quantizers and the pure-torch reference.

The math, shared by the Triton kernels in :mod:`quantpack.kernels.w8a8` (docs/w8a8.md is the spec):

* Weight ``W`` (N, K): symmetric per output channel. ``weight_scale[n] = max_k |W[n, k]| / 127``
  (float32; 1.0 for an all-zero row) and ``qweight[n, k] = clamp(round(W[n, k] / weight_scale[n]),
  -127, 127)`` as int8, stored (N, K) row-major.
* Activations ``x`` (M, K), per token (row), on the fly: ``amax = max(max_k |x[m, k]|, ACT_AMAX_FLOOR)``,
  ``x_scale[m] = amax / 127`` and ``inv = 127 / amax`` (float32), ``x_q[m, k] = clamp(round(x[m, k] * inv),
  -127, 127)``. Every step is one correctly rounded float32 operation and ``round`` is half-to-even,
  so the kernel reproduces these integers and scales bit for bit on any device.
* Output: ``acc = x_q @ qweight.T`` accumulated exactly in int32, then in float32
  ``out = float(acc) * x_scale[m] * weight_scale[n] (+ bias[n])``, cast to the output dtype.
"""
from __future__ import annotations

import torch

QMAX = 127
# Rows whose max |x| is below this are quantized against this floor instead: it keeps the scale a
# normal float32 (no division by zero or by a denormal) and an all-zero row maps to q = 0.
ACT_AMAX_FLOOR = 1e-30
# int32 accumulation of K products of magnitude <= 127 * 128 cannot overflow below this K.
MAX_IN_FEATURES = (2**31 - 1) // (127 * 128)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.no_grad()
def quantize_weight_w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a (N, K) linear weight.

    Returns ``(qweight, weight_scale)``: int8 (N, K) contiguous, float32 (N,).
    """
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point() or weight.dtype.itemsize < 2:
        raise ValueError(f"weight: dtype {weight.dtype} cannot be quantized; pass a float16, bfloat16 or float32 tensor")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"weight: expected a non-empty 2-D (out_features, in_features) tensor, got shape {tuple(weight.shape)}")
    if weight.shape[1] > MAX_IN_FEATURES:
        raise ValueError(f"weight: in_features={weight.shape[1]} exceeds {MAX_IN_FEATURES}, the most an int32 accumulator holds")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight: contains NaN or inf values; fix the checkpoint before quantizing")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    # amax / tensor(127): correctly rounded on every device (see quantize_activations_reference).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, QMAX), torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


@torch.no_grad()
def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization of ``x`` (..., K): returns ``(x_q int8 (..., K), x_scale float32 (...))``.

    Pure torch, the oracle for the Triton quantizer (same operations, same rounding).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(ACT_AMAX_FLOOR)
    # Tensor / tensor: torch turns division by a Python scalar (and scalar / tensor) into a multiply
    # by a reciprocal on CUDA, which is not the correctly rounded quotient the kernel computes.
    qmax = torch.full_like(amax, QMAX)
    scale, inv_scale = amax / qmax, qmax / amax
    q = torch.round(xf * inv_scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul_exact(a: torch.Tensor, b_nk: torch.Tensor) -> torch.Tensor:
    """Exact ``a (M, K) int8 @ b_nk (N, K) int8 .T`` as int32, on any device and shape."""
    if a.is_cuda and a.shape[0] > 16 and a.shape[1] % 8 == 0 and b_nk.shape[0] % 8 == 0:
        return torch._int_mm(a, b_nk.t())
    # float64 holds every partial sum exactly (|acc| < 2**31 << 2**53).
    return (a.double() @ b_nk.double().t()).to(torch.int32)


def w8a8_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                          weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel's epilogue math on an exact int32 accumulator: ``x_q`` (M, K) int8, ``x_scale`` (M,)."""
    acc = int8_matmul_exact(x_q, qweight)
    out = acc.float() * x_scale.float()[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear`` over int8 weights and per-token int8 activations, in pure torch (CPU fallback)."""
    if x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features={qweight.shape[1]}")
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x_q, x_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]))
    out = w8a8_matmul_reference(x_q, x_scale, qweight, weight_scale, bias, out_dtype)
    return out.reshape(*lead, qweight.shape[0])


def dequantize_w8a8(qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) weight the int8 values stand for: ``qweight * weight_scale[:, None]``."""
    return (qweight.float() * weight_scale.float()[:, None]).to(dtype)
