"""W8A8 Triton kernels: per-token int8 activation quantization and an int8 x int8 -> int32 matmul.

Math and layout: :mod:`quantpack.quantization.w8a8` and docs/w8a8.md. The weight is stored (N, K)
row-major int8, K contiguous: int8 tensor-core instructions (Hopper's wgmma, Ampere's mma) want
both operands K-major, so the (N, K) layout is read with no transpose in shared memory, and it
is also what ``torch._int_mm`` wants for its second operand (as ``qweight.t()``).

``w8a8_linear(x, qweight, weight_scale, bias)`` = ``quantize_activations`` (one pass over x) +
``w8a8_matmul`` (int32 accumulation; epilogue float(acc) * x_scale[m] * weight_scale[n] + bias[n]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

try:  # host-side tensor descriptors (TMA on Hopper); Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel only
    TensorDescriptor = None

from ..quantization.w8a8 import (ACT_AMAX_FLOOR, MAX_IN_FEATURES, OUT_DTYPES, QMAX, dequantize_w8a8,  # noqa: F401
                             quantize_weight_w8a8, w8a8_linear_reference)
from .dequant import cdiv, interpreting, next_power_of_2, on_device
from .fused_call import FusedOp

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A row up to this long is quantized from registers in one read; longer rows take two passes.
_QUANT_ONE_TILE_MAX_K = 8192
_QUANT_LOOP_BLOCK_K = 4096


# ---------------------------------------------------------------------------------------------
# Activation quantization: one program per row.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _round_half_even(y):
    # The interpreter has no libdevice.rint; this emulation is exact for |y| < 2**31 when y is
    # already rounded (on the GPU an FMA contraction of y - t could break that, hence rint there).
    t = y.to(tl.int32)  # truncates toward zero
    frac = y - t.to(tl.float32)  # exact
    afrac = tl.abs(frac)
    up = (afrac > 0.5) | ((afrac == 0.5) & ((t & 1) != 0))
    return tl.where(up, t + tl.where(frac > 0, 1, -1), t)


@triton.jit
def _quantize_row_tile(x, inv_scale, QMAX: tl.constexpr, USE_RINT: tl.constexpr):
    y = x * inv_scale
    if USE_RINT:
        q = libdevice.rint(y).to(tl.int32)  # one instruction, round half to even
    else:
        q = _round_half_even(y)
    return tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int8)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                          AMAX_FLOOR: tl.constexpr, QMAX: tl.constexpr,
                          BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, USE_RINT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR)
        # Two correctly rounded divisions per row, then one multiply per element.
        scale = tl.math.div_rn(amax, 127.0)
        inv_scale = tl.math.div_rn(127.0, amax)
        tl.store(q_row + offs, _quantize_row_tile(x, inv_scale, QMAX, USE_RINT), mask=mask)
    else:
        run_max = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            run_max = tl.maximum(run_max, tl.abs(x))
        amax = tl.maximum(tl.max(run_max, axis=0), AMAX_FLOOR)
        scale = tl.math.div_rn(amax, 127.0)
        inv_scale = tl.math.div_rn(127.0, amax)
        for k0 in range(0, K, BLOCK_K):  # second read of the row mostly hits L2
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize_row_tile(x, inv_scale, QMAX, USE_RINT), mask=mask)
    tl.store(s_ptr + row, scale)


def _check_activations(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported; pass float16, bfloat16 or float32 activations")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name}: expected shape (..., K) with K > 0, got {tuple(x.shape)}")
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"{name}: on {x.device}; the Triton kernels need a CUDA tensor "
                         f"(on CPU use quantpack.quantization.w8a8.w8a8_linear_reference)")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 quantization of ``x`` (..., K) in one Triton pass.

    Returns ``(x_q, x_scale)``: int8 of ``x.shape`` and float32 of ``x.shape[:-1]``, bit-identical to
    :func:`quantpack.quantization.w8a8.quantize_activations_reference`. NaN/inf in ``x`` are not checked.
    """
    _check_activations(x)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        one_tile = k <= _QUANT_ONE_TILE_MAX_K
        block_k = next_power_of_2(k) if one_tile else _QUANT_LOOP_BLOCK_K
        with on_device(x2):
            _quantize_rows_kernel[(m,)](
                x2, q, scale, k, x2.stride(0), q.stride(0),
                AMAX_FLOOR=ACT_AMAX_FLOOR, QMAX=QMAX, BLOCK_K=block_k, ONE_TILE=one_tile, USE_RINT=not interpreting(),
                num_warps=8 if block_k >= 2048 else 4,
            )
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


# ---------------------------------------------------------------------------------------------
# int8 x int8 -> int32 matmul with the scaling epilogue.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-blocks share each column-block of B while it is in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _scale_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """float(acc) * a_scale[m] * b_scale[n] (+ bias[n]) in float32."""
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _w8a8_matmul_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr,
                        M, N, K, stride_am, stride_bn, stride_cm, m_bucket,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """C[m, n] = float(sum_k A[m, k] * B[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]), pointer loads.

    A (M, K) int8 and B (N, K) int8, both K-contiguous. ``m_bucket`` only keys the autotuner.
    """
    off_m, off_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    # Wrapped row/column indices keep every load in bounds without masks; those rows/columns
    # are computed twice and never stored.
    rows_a = offs_m % M
    rows_b = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) view

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out = _scale_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _w8a8_matmul_tma_kernel(a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K, m_bucket,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Same product with tiles moved by tensor descriptors (the TMA engine on Hopper), which zero-fill
    reads past the edges and clip writes, so no masks or wrapped indices are needed."""
    off_m, off_n = _tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = b_desc.load([off_n, k0])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    out = _scale_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, HAS_BIAS)
    c_desc.store([off_m, off_n], out.to(c_desc.dtype))


def _config(bm, bn, bk, warps, stages, group_m=8, pre_hook=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages, pre_hook=pre_hook)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). int8 tensor-core instructions want BLOCK_K >= 32;
# Hopper's wgmma wants BLOCK_M a multiple of 64. Shared memory per stage: (BLOCK_M + BLOCK_N) * BLOCK_K bytes.
_TILES = [
    # M >= 128: large tiles, 8 warps (two warpgroups).
    (128, 256, 128, 8, 3),
    (128, 256, 128, 8, 4),
    (256, 128, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 8, 3),  # 96 KB of shared memory: two CTAs per SM, a finer last wave
    (128, 128, 256, 8, 3),
    (128, 256, 64, 8, 4),
    # Medium M (and M = 256, where 128-row tiles leave SMs idle).
    (64, 256, 128, 8, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 256, 4, 4),
    # Decode-sized M: the weight read dominates, so wide K tiles and many programs.
    (32, 64, 256, 4, 4),
    (16, 64, 256, 4, 4),
    (16, 128, 128, 4, 5),
]


def _set_tma_block_shapes(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


def _prune_configs(configs, named_args, **kwargs):
    # Keep tiles from about half the (rounded-up) M to M: taller ones waste work on wrapped rows,
    # much shorter ones re-read the weight more often than needed. From M = 512 on, 128 rows fill the GPU.
    m_bucket = named_args["m_bucket"]
    lo = 128 if m_bucket >= 512 else min(m_bucket, 128) // 2
    hi = max(16, m_bucket)
    kept = [c for c in configs if lo <= c.kwargs["BLOCK_M"] <= hi]
    return kept or configs[-1:]


_w8a8_matmul = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_w8a8_matmul_kernel)
_w8a8_matmul_autotuned = triton.autotune(
    configs=[_config(*t) for t in _TILES], key=["m_bucket", "N", "K", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_w8a8_matmul)
_w8a8_matmul_tma_autotuned = triton.autotune(
    configs=[_config(*t, pre_hook=_set_tma_block_shapes) for t in _TILES], key=["m_bucket", "N", "K", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_w8a8_matmul_tma_kernel)

# Under the interpreter (CI, CPU): one small tile so awkward shapes still span several tiles.
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
# Which kernel "auto" picks where both apply. benchmarks/bench_w8a8.py on an H200: TMA ahead at
# M = 256, the two within ~8% (either way) at M >= 1024.
_PREFER_TMA = True
KERNELS = ("auto", "tma", "pointer")


def _tma_supported(*tensors: torch.Tensor) -> bool:
    """TMA needs Hopper or newer, 16-byte aligned bases and 16-byte aligned row strides."""
    if TensorDescriptor is None:
        return False
    if not interpreting() and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def _check_weight(qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, k: int,
                  device: torch.device) -> None:
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError("qweight: expected a 2-D (out_features, in_features) int8 tensor"
                         + (f", got {qweight.dtype} {tuple(qweight.shape)}" if isinstance(qweight, torch.Tensor) else ""))
    n, kw = qweight.shape
    if kw != k:
        raise ValueError(f"x: last dimension {k} does not match qweight in_features={kw}")
    if k > MAX_IN_FEATURES:
        raise ValueError(f"qweight: in_features={k} exceeds {MAX_IN_FEATURES}, the most an int32 accumulator holds")
    if not isinstance(weight_scale, torch.Tensor) or tuple(weight_scale.shape) != (n,) or not weight_scale.is_floating_point():
        raise ValueError(f"weight_scale: expected a floating-point tensor of shape ({n},)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)
                             or not bias.is_floating_point()):
        raise ValueError(f"bias: expected a floating-point tensor of shape ({n},) or None")
    for name, t in (("qweight", qweight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device} but x is on {device}; move them to one device")


def w8a8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                kernel: str = "auto") -> torch.Tensor:
    """``float(x_q @ qweight.T) * x_scale[:, None] * weight_scale[None, :] (+ bias)`` in ``out_dtype``.

    ``x_q`` (M, K) int8, ``x_scale`` (M,) float32, ``qweight`` (N, K) int8, ``weight_scale`` (N,).
    Accumulation is exact int32; the epilogue is float32. ``kernel``: "auto" (default), or force
    "tma" (tensor-descriptor tiles; Hopper+, 16-byte aligned rows) or "pointer" (any shape/GPU).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if not isinstance(x_q, torch.Tensor) or x_q.dtype != torch.int8 or x_q.dim() != 2:
        raise ValueError("x_q: expected a 2-D (M, K) int8 tensor")
    if not (x_q.is_cuda or interpreting()):
        raise ValueError(f"x_q: on {x_q.device}; the Triton kernels need a CUDA tensor")
    m, k = x_q.shape
    _check_weight(qweight, weight_scale, bias, k, x_q.device)
    if not isinstance(x_scale, torch.Tensor) or tuple(x_scale.shape) != (m,) or x_scale.device != x_q.device:
        raise ValueError(f"x_scale: expected a tensor of shape ({m},) on {x_q.device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    n = qweight.shape[0]
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    x_scale = x_scale.float().contiguous()
    weight_scale = weight_scale.float().contiguous()
    bias_arg = bias.contiguous() if bias is not None else weight_scale  # never read when HAS_BIAS=False
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    m_bucket = min(next_power_of_2(m), 4096)
    has_bias = bias is not None
    use_tma = kernel == "tma" or (kernel == "auto" and _PREFER_TMA and _tma_supported(x_q, qweight, out))
    if kernel == "tma" and not _tma_supported(x_q, qweight, out):
        raise ValueError("kernel='tma' needs a Hopper (or newer) GPU and 16-byte aligned rows "
                         "(K a multiple of 16, N*itemsize a multiple of 16); use kernel='auto'")
    if use_tma:
        cfg = _INTERPRETER_CONFIG if interpreting() else {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 1}
        descs = (TensorDescriptor.from_tensor(x_q, [cfg["BLOCK_M"], cfg["BLOCK_K"]]),
                 TensorDescriptor.from_tensor(qweight, [cfg["BLOCK_N"], cfg["BLOCK_K"]]),
                 TensorDescriptor.from_tensor(out, [cfg["BLOCK_M"], cfg["BLOCK_N"]]))  # GPU: set per config
        args = (*descs, x_scale, weight_scale, bias_arg, m, n, k, m_bucket)
        kernel_fn, tuned_fn = _w8a8_matmul_tma_kernel, _w8a8_matmul_tma_autotuned
    else:
        args = (x_q, qweight, x_scale, weight_scale, bias_arg, out, m, n, k,
                x_q.stride(0), qweight.stride(0), out.stride(0), m_bucket)
        kernel_fn, tuned_fn = _w8a8_matmul, _w8a8_matmul_autotuned
    if interpreting():
        cfg = _INTERPRETER_CONFIG
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
        kernel_fn[grid](*args, HAS_BIAS=has_bias, **cfg)
    else:
        grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)
        with on_device(x_q):  # Triton launches on the current device, not necessarily x's
            tuned_fn[grid](*args, HAS_BIAS=has_bias)
    return out


def w8a8_linear(x: torch.Tensor, qweight_int8: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W given as int8 ``qweight_int8`` (N, K) and float32 ``weight_scale`` (N,),
    and x quantized per token to int8 on the fly. Returns (..., N) in ``out_dtype`` (default ``x.dtype``)."""
    _check_activations(x)
    k = x.shape[-1]
    _check_weight(qweight_int8, weight_scale, bias, k, x.device)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    x_q, x_scale = quantize_activations(x.reshape(-1, k))
    out = w8a8_matmul(x_q, x_scale, qweight_int8, weight_scale, bias, out_dtype)
    return out.reshape(*x.shape[:-1], qweight_int8.shape[0])


# ---------------------------------------------------------------------------------------------
# torch.compile: w8a8_linear as one opaque custom op (as mixed_mm_op in mixed_mm.py)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("quantpack::w8a8_linear", mutates_args=(),
                         schema="(Tensor x, Tensor qweight, Tensor weight_scale, Tensor? bias) -> Tensor")
def w8a8_linear_op(x, qweight, weight_scale, bias):
    """:func:`w8a8_linear` as the torch custom op ``torch.ops.quantpack.w8a8_linear`` (fake function and input
    gradient included), which ``W8A8Linear`` calls while torch.compile traces it; eager calls skip the dispatcher."""
    return w8a8_linear(x, qweight, weight_scale, bias)


@w8a8_linear_op.register_fake
def _w8a8_linear_op_fake(x, qweight, weight_scale, bias):
    _check_activations(x)
    _check_weight(qweight, weight_scale, bias, x.shape[-1], x.device)
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


def w8a8_forward(x, qweight, weight_scale, bias):
    """``W8A8Linear``'s product: the kernels on CUDA, the pure-torch reference with the same math elsewhere."""
    if x.is_cuda:
        return w8a8_linear(x, qweight, weight_scale, bias)
    return w8a8_linear_reference(x, qweight, weight_scale, bias)


def _input_grad(call, grad_out, qweight, weight_scale, bias):
    # the input gradient passes straight through the activation rounding: grad_out @ dequantize(W)
    return grad_out @ dequantize_w8a8(qweight, weight_scale, grad_out.dtype)


# W8A8Linear's product: the custom op while compiling (CUDA inputs; the reference traces as it is), the autograd
# Function ``W8A8Linear`` (frozen int8 weight, the input's gradient) when a gradient is wanted
W8A8_LINEAR = FusedOp("W8A8LinearFunction", w8a8_linear_op, w8a8_forward, _input_grad, num_args=3,
                      op_runs=lambda x: x.is_cuda)
