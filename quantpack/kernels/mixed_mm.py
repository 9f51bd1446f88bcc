"""Fused dequant-matmul for quantpack's packed 4/8-bit weights (forward and transposed).

``mixed_mm(x, qweight, scales, zeros, group_size=...)`` computes ``x @ W.T`` for the packed (N, K)
weight W without materializing it; ``transposed=True`` computes ``x @ W`` (the input gradient of
the forward) from the same buffer. Kernel paths, picked per (M bucket, N, K) from a tuned config
table (``configs/<gpu>.json``) so first use never autotunes (dispatch.py decides, and says why:
:func:`~quantpack.kernels.dispatch.explain`):

* ``gemv``: decode (M = 1 and a few rows), groups along K. CUDA-core GEMV in ``gemv.py``:
  split-K, next step's loads issued before this step's math, nibbles turned into floats with one
  shift and one LOP3, ``words=True`` reads int32 words of 4 columns.
* ``mma``: decode (M <= 64), 4/8-bit, groups along K of a multiple of 64. Tensor-core GEMV in
  ``mma_gemv.py`` on a copy of the weight repacked once into MMA fragment order (kept per weight
  tensor while it lives; ``QUANTPACK_MMA=0`` turns the path off and saves that memory).
* ``fma``: small M, any layout (axis 0, groups narrower than a tile). CUDA-core tiles, split-K; the
  group's scale/zero are applied once per tile column (``s * sum(x q) - z s * sum(x)``).
* ``dot`` / ``dot_t``: tensor-core tiles; ``dot_t`` computes ``C^T = W x^T`` (dequantized weight
  as the A operand, the M tile as the narrow N of the MMA). ``rawq=True`` runs the MMA on the raw
  integers (OR-ed into the bits of 128.0 / 1024.0, unpacked by inline PTX) and rescales per group.
* ``dq``: dequantize into a scratch buffer, then cuBLAS; for large M where the fused kernels lose.

Split-K partial sums go to an fp32 workspace; the last program to finish a tile (an atomic
counter, which it resets) sums them and writes the output, so one launch does it all.

This module is the public API (the product, autotuning a weight, autograd, the custom op); the parts live by
concern in configs.py (config type, tables), dispatch.py (which kernel runs), autotune.py (search space, sweep),
caches.py (counters, weight copies), tiles.py (the fma/dot kernels), launcher.py (grid, workspace, launch).
"""
from __future__ import annotations

import contextlib

import torch

from . import launch_plan
from .autotune import (RETIME_TOP, TUNE_MAX_ERR, candidate_configs, copies_past_l2, reference_product, sweep,
                       tunes_on_first_use)
from .caches import mma_weight_copy, tensor_version
from .configs import PATHS, KernelConfig, config_key, device_key, m_bucket, save_table, table_state, tuned_cache_path
from .dequant import infer_layout, on_device, triton_usable
from .fused_call import FusedOp
from .dispatch import (MMA_MAX_M, PDL_MAX_M, WGMMA_MAX_M, Flags, choose, device_props, explain, fit_config,
                       heuristic_config, launch_plans_enabled, mma_config, mma_decision, pick_config, read_env,
                       w4a8_reference, without_mma)
from .launcher import launch
from .mma_gemv import mma_usable
from .mma_layout import CHUNK
from .wgmma_mm import wgmma_usable
from .. import reference
from ..format import PackedWeight

# (kept importable from here, where they were defined before the module was split by concern)
__all__ = ["mixed_mm", "mma_mm", "autotune", "autotune_mma", "MIXED_MM", "MixedMatmul", "mixed_mm_op", "KernelConfig", "PATHS",
           "config_key", "device_key", "m_bucket", "save_table", "tuned_cache_path", "pick_config", "heuristic_config",
           "fit_config", "mma_config", "explain", "candidate_configs", "copies_past_l2", "reference_product",
           "tunes_on_first_use", "RETIME_TOP", "TUNE_MAX_ERR", "MMA_MAX_M", "PDL_MAX_M", "WGMMA_MAX_M"]


def autotune(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
             bits: int = 4, transposed: bool = False, candidates: list[KernelConfig] | None = None,
             weight_copies: int | None = None, rep_ms: int = 40) -> tuple[KernelConfig, dict]:
    """Time the candidate configs on this input (CUDA graph replay over ``weight_copies`` copies of
    the weight so repeated runs do not read it from L2; default :func:`copies_past_l2`), store the
    fastest under its M-bucketed key for this process and in this machine's cache
    (:func:`tuned_cache_path`, so later runs do not tune again), and return it with all timings
    (microseconds). Each candidate's output is first checked against the float32 reference product: one
    off by more than ``TUNE_MAX_ERR`` (a compiler that miscompiles a variant) is never timed (``inf``).
    The fastest ``RETIME_TOP`` of the sweep are timed again twice, in order and in reverse; their mean
    times decide."""
    n, k, axis = infer_layout(qweight, scales, zeros, group_size, bits, None)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    want = reference_product(x2, qweight, scales, zeros, n=n, k=k, axis=axis, group_size=group_size, bits=bits,
                             transposed=transposed)
    candidates = candidates or candidate_configs(transposed, m, n, k, x.device, bits)
    if not (Flags.from_env().mma and mma_usable(x2, n, k, group_size, bits, axis)):
        candidates = [c for c in candidates if c.path != "mma"]  # (it would time the fallback under its name)

    def run(cfg, copy):
        return mixed_mm(x2, *copy, group_size=group_size, bits=bits, transposed=transposed, config=cfg)

    return sweep((transposed, bits, n, k, m), x.device, candidates, run, (qweight, scales, zeros), weight_copies, want,
                 rep_ms)


def autotune_mma(x: torch.Tensor, mma_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 want: torch.Tensor, *, group_size: int, bits: int = 4, weight_copies: int | None = None,
                 rep_ms: int = 40) -> tuple[KernelConfig, dict]:
    """:func:`autotune` for a weight that exists only in the ``mma`` layout (merged_mm.py's stacked projections),
    over the ``mma`` candidates: ``want`` is the float32 product every candidate is checked against (the caller
    has the members' checkpoint-layout weights). The pick is stored under the stacked shape's key."""
    n, k = scales.shape[1], mma_weight.shape[1] * CHUNK
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    candidates = [fit_config(c, False, m, 1, group_size) for c in candidate_configs(False, m, n, k, x.device, bits)
                  if c.path == "mma"]

    def run(cfg, copy):
        with on_device(x2):
            return launch(x2, None, copy[1], copy[2], None, n, k, 1, group_size, bits, False, x2.dtype, cfg, copy[0])

    return sweep((False, bits, n, k, m), x.device, list(dict.fromkeys(candidates)), run, (mma_weight, scales, zeros),
                 weight_copies, want, rep_ms)



# ----------------------------------------------------------------------------------------------
# launch plans (launch_plan.py): what a call decides, made once per key and replayed

def call_key(x2, qweight, scales, zeros, bias, group_size, bits, transposed, out_dtype, axis, config,
             env: tuple) -> tuple:
    """Everything a call's decisions depend on besides the identity of the weight's tensors (which the PlanCache
    checks): x's shape, strides, dtype, device and alignment, the arguments (the bias by identity: a plan that
    launches with it holds it), the tensors' versions (an in-place change rebuilds the mma copy), the environment
    switches and the config table."""
    return (x2.shape, x2.stride(), x2.dtype, x2.device, x2.data_ptr() % 16, out_dtype, transposed, group_size, bits,
            axis, config, tensor_version(qweight), tensor_version(scales), tensor_version(zeros),
            None if bias is None else (id(bias), tensor_version(bias)), env, table_state())


def check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed) -> tuple[int, int, int]:
    """Check a call's arguments (shapes, dtypes and devices only: fake tensors pass through here too); return
    (N, K, axis)."""
    n, k, axis = infer_layout(qweight, scales, zeros, group_size, bits, axis)
    width, what = (n, "out_features N") if transposed else (k, "in_features K")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x: expected a floating-point tensor (float16, bfloat16 or float32)")
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"x: last dimension {tuple(x.shape)[-1:] or '()'} does not match {what}={width}")
    if x.device != qweight.device:
        raise ValueError(f"x: on {x.device} but qweight on {qweight.device}; move them to one device")
    if bias is not None and (transposed or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias: expected shape ({n},) and transposed=False")
    return n, k, axis


def mixed_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
             bits: int = 4, transposed: bool = False, out_dtype: torch.dtype | None = None, axis: int | None = None,
             bias: torch.Tensor | None = None, config: KernelConfig | None = None,
             plans: launch_plan.PlanCache | None = None) -> torch.Tensor:
    """``x @ W.T`` (``transposed=False``: x (..., K) -> (..., N)) or ``x @ W`` (``transposed=True``:
    x (..., N) -> (..., K)) for the packed (N, K) weight W, dequantized in registers, accumulated
    in float32. ``axis`` is read off the scales' shape when not given; ``bias`` (N,) is added in
    the forward epilogue; ``config`` forces a launch configuration (tests, tuning); ``plans``, a
    :class:`~quantpack.kernels.launch_plan.PlanCache` kept for this weight, makes repeated calls of one
    x shape replay the first one's launch without its host-side work (launch_plan.py).
    Runs Triton on CUDA (and on CPU under TRITON_INTERPRET=1), the reference otherwise."""
    capturing = isinstance(x, torch.Tensor) and x.is_cuda and torch.cuda.is_current_stream_capturing()
    if plans is not None:
        env = read_env()
        if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] > 0) or not launch_plans_enabled(env):
            plans = None  # (the checks below say what is wrong)
        elif capturing:
            plans = None  # (a captured call runs once, and may take another path than the eager calls' plans)
        else:
            x2 = x.reshape(-1, x.shape[-1])
            plan_key = call_key(x2, qweight, scales, zeros, bias, group_size, bits, transposed, out_dtype, axis,
                                 config, env)
            plan = plans.get((qweight, scales, zeros), plan_key)
            if plan is not None and plan is not launch_plan.MISSING:
                with on_device(x2):
                    out = plan(x2)
                return out.reshape(*x.shape[:-1], out.shape[-1])
            if plan is None:
                plans = None  # (known not to plan: run as usual)
    n, k, axis = check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed)
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not triton_usable(x2):
        pw = PackedWeight(qweight, scales, zeros, bits, group_size, axis, (n, k))
        if w4a8_reference(n, k, group_size, bits, axis, transposed):
            return reference.matmul_fp8_activations(x2, pw, bias).to(out_dtype).reshape(*lead, -1)
        w = reference.dequantize(pw, torch.float32)
        out = x2.float() @ (w if transposed else w.t())
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype).reshape(*lead, -1)
    tensors = (qweight, scales, zeros)  # (as the caller holds them: what its PlanCache compares)
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    zeros = zeros.contiguous()
    if config is None:  # (a call that autotunes first then takes the fresh table entry)
        if tunes_on_first_use(x2, transposed, bits, n, k):
            autotune(x2, qweight, scales, zeros, group_size=group_size, bits=bits, transposed=transposed)
    props = device_props(x2.device)
    decision = choose(props, x2.shape[0], n, k, bits, x2.dtype, axis=axis, group_size=group_size,
                      transposed=transposed, flags=Flags.from_env(), config=config,
                      mma_fits=lambda: mma_usable(x2, n, k, group_size, bits, axis),
                      wgmma_fits=lambda: wgmma_usable(x2, qweight, scales, zeros, n, k, group_size, bits, axis),
                      host_bound=not capturing)
    config, pdl = decision.config, decision.pdl
    mma_weight, built_now = None, False
    if config.path == "mma":
        with on_device(x2):
            mma_weight, built_now = mma_weight_copy(qweight, n, k, bits)
        pdl = pdl and not built_now  # (the kernels that wrote the copy may still run)
        if mma_weight is None:  # (under CUDA-graph capture before the copy exists, or a failed self-check)
            config, pdl = without_mma(props, transposed, x2.shape[0], n, k, axis, group_size), False
    # a plan is recorded from a call that runs as every later one will: not one that built the mma copy (it may
    # not use PDL) nor one under CUDA-graph capture (it cannot build the copy)
    record = plans is not None and not built_now and not capturing
    with on_device(x2):  # Triton launches on the current device: make it x's (device maps over GPUs)
        with launch_plan.recording() if record else contextlib.nullcontext() as rec:
            out = launch(x2, qweight, scales, zeros, bias, n, k, axis, group_size, bits, transposed, out_dtype,
                          config, mma_weight, pdl)
    if record:  # (under the key of the call's arguments as given, which is how the next call looks it up)
        plans.put(tensors, plan_key, launch_plan.Plan.from_recording(rec, x2, out, keep=(qweight, scales, zeros, bias,
                                                                                    mma_weight)))
    return out.reshape(*lead, out.shape[-1])


_NOT_MMA = object()  # mma_mm's decision for a plan key whose call runs another path


def mma_mm(x: torch.Tensor, mma_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
           bits: int = 4, bias: torch.Tensor | None = None, plans: launch_plan.PlanCache | None = None,
           built_now: bool = False) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` from W's :func:`~quantpack.kernels.mma_gemv.mma_pack` copy alone, with no checkpoint-layout
    weight (merged_mm.py: projections merged along N exist only in that layout), or ``None`` where :func:`mixed_mm`
    would run another path than ``mma`` for this call (the caller then computes it another way). N is read off the
    scales, K off the copy. ``plans`` as in :func:`mixed_mm`, kept for these tensors (a declined key is remembered
    too); ``built_now``: the caller built ``mma_weight`` in this call (its kernels may still run: no PDL, no plan)."""
    n, k = scales.shape[1], mma_weight.shape[1] * CHUNK
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} does not match in_features K={k}")
    x2 = x.reshape(-1, k)
    tensors = (mma_weight, scales, zeros)
    env = read_env()
    plan_key = None
    capturing = x2.is_cuda and torch.cuda.is_current_stream_capturing()
    if plans is not None and launch_plans_enabled(env) and not capturing:
        plan_key = call_key(x2, mma_weight, scales, zeros, bias, group_size, bits, False, None, 1, None, env)
        plan = plans.get(tensors, plan_key)
        if plan is _NOT_MMA:
            return None
        if isinstance(plan, launch_plan.Plan):
            with on_device(x2):
                return plan(x2).reshape(*x.shape[:-1], n)
    m = x2.shape[0]
    decision = (mma_decision(m, n, k, group_size, bits, x2.device, host_bound=not capturing)
                if triton_usable(x2) and mma_usable(x2, n, k, group_size, bits, 1) else None)
    if decision is None:
        if plan_key is not None:
            plans.put(tensors, plan_key, _NOT_MMA)
        return None
    config, pdl = decision.config, decision.pdl and not built_now
    record = plan_key is not None and not built_now
    with on_device(x2):
        with launch_plan.recording() if record else contextlib.nullcontext() as rec:
            out = launch(x2, None, scales, zeros, bias, n, k, 1, group_size, bits, False, x2.dtype, config,
                          mma_weight, pdl)
    if record:
        plans.put(tensors, plan_key, launch_plan.Plan.from_recording(rec, x2, out,
                                                                     keep=(mma_weight, scales, zeros, bias)))
    return out.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------
# torch.compile: the fused matmul as one opaque custom op

@torch.library.custom_op("quantpack::mixed_mm", mutates_args=(),
                         schema="(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, Tensor? bias, int group_size, "
                                "int bits, int axis, bool transposed) -> Tensor")
def mixed_mm_op(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed):
    """:func:`mixed_mm` as the torch custom op ``torch.ops.quantpack.mixed_mm``, with a fake (shape) function and
    autograd (the input gradient, through the transposed kernel). torch.compile cannot trace the launcher (Triton
    launches, TMA descriptors, caches), so ``QuantLinear`` calls this op while being compiled: the model stays one
    graph (``fullgraph=True``) and ``mode="reduce-overhead"`` captures the whole step, kernels included, in a CUDA
    graph. Eager calls go to :func:`mixed_mm` directly: the dispatcher would add about 10 us to each."""
    return mixed_mm(x, qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, bias=bias,
                    transposed=transposed)


@mixed_mm_op.register_fake
def _mixed_mm_op_fake(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed):
    n, k, _ = check_call(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed)
    return x.new_empty(*x.shape[:-1], k if transposed else n)


def _eager(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed, plans=None):
    return mixed_mm(x, qweight, scales, zeros, group_size=group_size, bits=bits, axis=axis, bias=bias,
                    transposed=transposed, plans=plans)


def _input_grad(call, grad_out, qweight, scales, zeros, bias, group_size, bits, axis, transposed, *plans):
    # (the weight is frozen: only x's gradient, the product with W the other way round)
    return call(grad_out, qweight, scales, zeros, None, group_size, bits, axis, not transposed, *plans)


# QuantLinear's fused product: the custom op while compiling, the autograd Function ``MixedMatmul``
# (``apply(x, qweight, scales, zeros, bias, group_size, bits, axis, transposed, plans)``) when a gradient is wanted
MIXED_MM = FusedOp("MixedMatmul", mixed_mm_op, _eager, _input_grad, num_args=8)
MixedMatmul = MIXED_MM.function
