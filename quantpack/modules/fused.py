"""Run a loaded transformers model's RMSNorms, rotary embeddings and gated MLPs' SiLU * up as one Triton launch each.

In a decode step torch runs an RMSNorm as about 8 kernels and the rotary embedding of q and k as about 10, each a
launch gap and a tail on the GPU; :func:`apply` swaps in the one-launch kernels of
:mod:`quantpack.kernels.fused_ops`, which compute the same values (rotary bit-exact, RMSNorm within a float32
rounding of its mean):

* every norm module whose class's ``forward`` is transformers' ``LlamaRMSNorm.forward`` verbatim (Llama, Mistral,
  Qwen2, Qwen3 and the other models that copy it; not Gemma's, which differs) gets an instance-level ``forward``
  (an instance-level ``forward`` already there, such as accelerate's device hook, stays its fallback);
* every MLP module whose class's ``forward`` is transformers' ``LlamaMLP.forward`` verbatim and whose ``act_fn`` is
  SiLU gets an instance-level ``forward`` computing ``silu(gate) * up`` in one launch (:func:`fused_ops.silu_mul`,
  reading the merged gate/up product where it is one), the projections called as before, in the same order (an
  MLP with an instance-level ``forward`` already there is left alone);
* the modeling module (e.g. ``transformers.models.llama.modeling_llama``) of each module class of the model whose
  ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's verbatim gets its module-level ``apply_rotary_pos_emb``
  replaced. This is global: every model of that architecture in the process, patched or not, goes through the
  replacement, which is harmless as it computes the same values and runs the original wherever the kernel would not.
  :func:`remove` puts the original back once no patched model uses it (a deep copy of a patched model keeps its
  patched norms; call :func:`apply` on the copy too, so that it counts as a user).

The kernels run where :attr:`backend` says (``"auto"``: CUDA tensors); everywhere else, while ``torch.compile``
traces (inductor fuses these ops itself), and when autograd records (the kernels have no backward), the original
code runs.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import nn

from ..kernels import fused_ops as _k
from ..kernels.dequant import triton_usable

# "auto": the kernels on CUDA tensors; "triton": also on the CPU under TRITON_INTERPRET=1 (slow, for tests);
# "reference": never (the original torch code always).
backend = "auto"

_ROTARY_NAME = "apply_rotary_pos_emb"
_ROTARY_USERS: dict[str, weakref.WeakSet] = {}  # modeling module name -> the patched models using its replacement


def _kernel_wanted(*tensors: torch.Tensor) -> bool:
    if backend == "auto":
        wanted = tensors[0].is_cuda
    elif backend == "triton":
        wanted = triton_usable(tensors[0])
    elif backend == "reference":
        return False
    else:
        raise ValueError(f"quantpack.modules.fused.backend={backend!r}; use 'auto', 'triton' or 'reference'")
    if not wanted or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _same_code(fn, ref) -> bool:
    """Whether function ``fn`` is ``ref`` verbatim: bytecode, names, constants (docstrings aside) and signature."""
    a, b = getattr(fn, "__code__", None), getattr(ref, "__code__", None)
    if a is None or b is None:
        return False

    def consts(f, code):
        c = code.co_consts
        return c[1:] if c and isinstance(c[0], str) and c[0] == f.__doc__ else c

    return (a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames
            and a.co_argcount == b.co_argcount and consts(fn, a) == consts(ref, b)
            and fn.__defaults__ == ref.__defaults__)


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


# --- RMSNorm: per instance ------------------------------------------------------------------------------------------

def _norm_forward(module: nn.Module, previous, hidden_states: torch.Tensor) -> torch.Tensor:
    """The patched ``forward`` (bound with ``functools.partial``: deep copies and pickles keep working);
    ``previous`` is the instance-level forward it replaced (say, accelerate's device hook), or None."""
    weight = module.weight
    if (isinstance(hidden_states, torch.Tensor) and _kernel_wanted(hidden_states, weight)
            and _k.rms_norm_unsupported(hidden_states, weight) is None):
        return _k.rms_norm_unchecked(hidden_states, weight, module.variance_epsilon)
    if previous is not None:
        return previous(hidden_states)
    return type(module).forward(module, hidden_states)


def _patched_norm(module: nn.Module):
    f = module.__dict__.get("forward")
    return f if isinstance(f, functools.partial) and f.func is _norm_forward else None


# --- gated MLP's SiLU * up: per instance ----------------------------------------------------------------------------

def _mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The patched ``forward`` of a Llama-style MLP: ``down(silu(gate(x)) * up(x))``, the middle in one launch."""
    gate = module.gate_proj(x)
    up = module.up_proj(x)
    if isinstance(gate, torch.Tensor) and _kernel_wanted(gate, up) and _k.silu_mul_unsupported(gate, up) is None:
        return module.down_proj(_k.silu_mul_unchecked(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def _patched_mlp(module: nn.Module):
    f = module.__dict__.get("forward")
    return f if isinstance(f, functools.partial) and f.func is _mlp_forward else None


def _silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (its class's forward verbatim) with a SiLU activation."""
    if not _same_code(getattr(type(module), "forward", None), _llama().LlamaMLP.forward):
        return False
    from transformers.activations import SiLUActivation

    act = getattr(module, "act_fn", None)
    return type(act) is nn.SiLU or (isinstance(act, SiLUActivation)
                                    and type(act).forward is SiLUActivation.forward)


# --- rotary embedding: per modeling module --------------------------------------------------------------------------

def _original(fn):
    return getattr(fn, "_quantpack_original", None)


def _llama_rotary():
    llama = _llama()
    fn = getattr(llama, _ROTARY_NAME)
    return _original(fn) or fn, llama.rotate_half


def _fused_rotary(original):
    (default_dim,) = original.__defaults__

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=default_dim):
        if (isinstance(q, torch.Tensor) and _kernel_wanted(q, k, cos, sin)
                and _k.rotary_unsupported(q, k, cos, sin, unsqueeze_dim) is None):
            return _k.rotary_unchecked(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._quantpack_original = original
    return apply_rotary_pos_emb


def _install_rotary(module, model: nn.Module) -> bool:
    """Replace ``module.apply_rotary_pos_emb`` (once) when it is Llama's; record ``model`` as a user."""
    fn = getattr(module, _ROTARY_NAME, None)
    if _original(fn) is None:
        ref, ref_rotate_half = _llama_rotary()
        if not (_same_code(fn, ref) and _same_code(getattr(module, "rotate_half", None), ref_rotate_half)):
            return False
        setattr(module, _ROTARY_NAME, _fused_rotary(fn))
    _ROTARY_USERS.setdefault(module.__name__, weakref.WeakSet()).add(model)
    return True


def _uninstall_rotary(name: str) -> None:
    module = sys.modules.get(name)
    original = _original(getattr(module, _ROTARY_NAME, None))
    if original is not None:
        setattr(module, _ROTARY_NAME, original)
    _ROTARY_USERS.pop(name, None)


# --- public API -----------------------------------------------------------------------------------------------------

def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"expected a torch.nn.Module (a loaded transformers model), got {type(model).__name__}")


def apply(model: nn.Module) -> int:
    """Patch ``model``'s Llama-style RMSNorms and its architecture's rotary embedding to run the fused kernels (see
    the module's docstring, global effect included). Idempotent. Returns how many norm modules of ``model`` run the
    fused RMSNorm."""
    _check_model(model)
    ref = _llama().LlamaRMSNorm.forward
    count = 0
    modeling_modules = set()
    for m in model.modules():
        modeling_modules.add(type(m).__module__)
        if _patched_norm(m) is not None:
            count += 1
        elif _same_code(getattr(type(m), "forward", None), ref):
            m.forward = functools.partial(_norm_forward, m, m.__dict__.get("forward"))
            count += 1
        elif "forward" not in m.__dict__ and _silu_mlp(m):
            m.forward = functools.partial(_mlp_forward, m)
    for name in sorted(modeling_modules):
        module = sys.modules.get(name)
        if module is not None:
            _install_rotary(module, model)
    return count


def remove(model: nn.Module) -> int:
    """Undo :func:`apply` on ``model``: its norms run their own forward again, and each modeling module's original
    ``apply_rotary_pos_emb`` is put back once no patched model uses it. Returns how many norms were restored."""
    _check_model(model)
    count = 0
    for m in model.modules():
        if _patched_mlp(m) is not None:
            del m.forward
            continue
        f = _patched_norm(m)
        if f is None:
            continue
        previous = f.args[1]
        if previous is None:
            del m.forward
        else:
            m.forward = previous
        count += 1
    for name, users in list(_ROTARY_USERS.items()):
        users.discard(model)
        if not users:
            _uninstall_rotary(name)
    return count
