"""``QuantExperts``: the mixture-of-experts block of transformers 5 (``MixtralExperts``,
``Qwen3MoeExperts``, ...: 3-D ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)) over packed
weights, each projection's experts stacked in memory (:class:`~quantpack.format.PackedExperts`: gate and up
merged, then down), run by one fused kernel per projection on a GPU.

Checkpoints store those experts one matrix per expert and projection (``experts.<e>.w1`` or
``experts.<e>.gate_proj`` in the source, ``<block>.gate_proj.<e>.qweight`` ... once packed, docs/format.md). The
block keeps those names as light submodules (``gate_proj[e]``...) whose tensors are views of their slot in the
stacked buffers, and a tensor assigned to one is copied into its slot: every loader (``quantpack.load``,
transformers' ``from_pretrained``, ``load_state_dict``) fills the stacked buffers in place, each allocated once on
the device of the first tensor it receives.

gpt-oss's block (``GptOssExperts``: ``gate_up_proj`` (E, H, 2I) with gate and up interleaved, ``down_proj``
(E, I, H), a bias for each, the clamped SwiGLU) is stored as those 3-D tensors; ``convert`` splits it into the same
per-expert matrices (quantpack.checkpoint.experts), and it loads as a biased ``QuantExperts``. Llama 4's
(``Llama4TextExperts``: the same shapes, gate's columns before up's, no bias) loads as a ``QuantExperts`` with
``weight_on_input``, its parent routed to the top-k experts (:func:`route_llama4_moe`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import reference
from ..format import PackedExperts, PackedWeight, check_layout_args
from ..quantization.groupwise import resolve_group_size

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FIELDS = ("qweight", "scales", "zeros", "bias")
_STACKS = ("gate_up", "down")  # the stacked projections: gate_proj and up_proj -> gate_up, down_proj -> down


def fused_experts_dims(module: nn.Module) -> tuple[int, int, int] | None:
    """``(num_experts, hidden, intermediate)`` of a transformers experts block with the standard
    forward (``down(act(gate(x)) * up(x))`` per expert): parameters exactly ``gate_up_proj``
    (E, 2I, H) and ``down_proj`` (E, H, I), and an ``act_fn`` that is one of the expert activations
    (:data:`quantpack.reference.EXPERT_ACTIVATIONS`); ``None`` for anything else (biased or
    interleaved variants are not this block)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or activation_of(getattr(module, "act_fn", None)) is None:
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return None
    return e, h, two_i // 2


@dataclass(frozen=True)
class ExpertsBlock:
    """A transformers experts block as quantpack packs it: sizes, activation (one of
    :data:`quantpack.reference.EXPERT_ACTIVATIONS`, with ``swiglu_oai``'s ``alpha`` and ``limit``), whether each
    expert matrix has a bias, and whether the checkpoint stores the block's own stacked tensors (``stacked``,
    gpt-oss) rather than one matrix per expert."""

    num_experts: int
    hidden: int
    intermediate: int
    activation: str
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False
    stacked: bool = False
    form: str = "standard"  # "gpt_oss" (stacked, gate/up interleaved) or "llama4" (stacked, gate then up)
    weight_on_input: bool = False


def experts_block(module: nn.Module) -> ExpertsBlock | None:
    """The :class:`ExpertsBlock` of a transformers experts block quantpack can pack (the standard block of
    :func:`fused_experts_dims`, or gpt-oss's), ``None`` for any other module."""
    dims = fused_experts_dims(module)
    if dims is not None:
        return ExpertsBlock(*dims, activation=activation_of(module.act_fn))
    return _gpt_oss_block(module) or _llama4_block(module)


def _llama4_block(module: nn.Module) -> ExpertsBlock | None:
    """Llama 4's block: ``gate_up_proj`` (E, H, 2I) (gate columns, then up), ``down_proj`` (E, I, H), no bias, and a
    forward of one argument (its parent scales each token by its routing weight and runs every expert; quantpack
    routes the top-k instead, :func:`route_llama4_moe`)."""
    import inspect

    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or activation_of(getattr(module, "act_fn", None)) is None:
        return None
    try:
        if len(inspect.signature(module.forward).parameters) != 1:
            return None
    except (TypeError, ValueError):
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or gate_up.shape[2] % 2:
        return None
    e, h, two_i = gate_up.shape
    if tuple(down.shape) != (e, two_i // 2, h):
        return None
    return ExpertsBlock(e, h, two_i // 2, activation_of(module.act_fn), stacked=True, form="llama4",
                        weight_on_input=True)


def llama4_moe_form(moe: nn.Module) -> bool:
    """Whether ``moe`` has the parts :func:`route_llama4_moe` routes with: a bias-free linear ``router``, a
    ``shared_expert``, an integer ``top_k`` and ``experts``."""
    router = getattr(moe, "router", None)
    return (isinstance(router, nn.Linear) and router.bias is None and getattr(moe, "shared_expert", None) is not None
            and isinstance(getattr(moe, "top_k", None), int) and hasattr(moe, "experts"))


def route_llama4_moe(moe: nn.Module) -> bool:
    """Make Llama 4's MoE block ``moe`` (``router``, ``shared_expert``, ``top_k``; its ``experts`` a
    :class:`QuantExperts` with ``weight_on_input``) route each token to its top-k experts, each scaled by the
    sigmoid of its router logit before the experts, as transformers' block computes it with every expert; returns
    whether ``moe`` has that form."""
    import types

    if not (llama4_moe_form(moe) and isinstance(moe.experts, QuantExperts) and moe.experts.weight_on_input):
        return False

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, self.experts.hidden_dim)
        logits = nn.functional.linear(x, self.router.weight)
        top, ids = torch.topk(logits, self.top_k, dim=1)
        weights = torch.sigmoid(top.float()).to(x.dtype)
        return self.shared_expert(x) + self.experts(x, ids, weights), logits

    moe.forward = types.MethodType(forward, moe)
    return True


def _gpt_oss_block(module: nn.Module) -> ExpertsBlock | None:
    """gpt-oss's block: ``gate_up_proj`` (E, H, 2I), ``down_proj`` (E, I, H), their biases (E, 2I) and (E, H), and a
    gate function that is the clamped SwiGLU over interleaved gate/up columns (told by running it)."""
    params = dict(module.named_parameters(recurse=False))
    gate = getattr(module, "_apply_gate", None)
    if set(params) != {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"} or not callable(gate):
        return None
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or gate_up.shape[2] % 2:
        return None
    e, h, two_i = gate_up.shape
    if (tuple(down.shape) != (e, two_i // 2, h) or tuple(params["gate_up_proj_bias"].shape) != (e, two_i)
            or tuple(params["down_proj_bias"].shape) != (e, h)):
        return None
    try:
        alpha, limit = float(module.alpha), float(module.limit)
        t = torch.linspace(-2 * limit, 2 * limit, 4 * 97, dtype=torch.float64).reshape(97, 4)
        with torch.no_grad():
            got = gate(t)
    except Exception:  # (not the gate function this block is known by)
        return None
    want = reference.expert_activation(torch.cat([t[:, 0::2], t[:, 1::2]], dim=1), "swiglu_oai", alpha=alpha,
                                       limit=limit)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got.double(), want):
        return None
    return ExpertsBlock(e, h, two_i // 2, "swiglu_oai", alpha=alpha, limit=limit, bias=True, stacked=True,
                        form="gpt_oss")


def activation_of(act_fn) -> str | None:
    """The name in :data:`quantpack.reference.EXPERT_ACTIVATIONS` of the elementwise ``act_fn`` (told by running it,
    not by its class: transformers has several classes for each), or ``None``."""
    if not callable(act_fn):
        return None
    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act_fn(x)
    except Exception:  # (not an elementwise function of one tensor)
        return None
    f = torch.nn.functional
    for name, want in (("silu", f.silu(x)), ("gelu", f.gelu(x)), ("gelu_tanh", f.gelu(x, approximate="tanh"))):
        if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y.double(), want, atol=1e-6):
            return name
    return None


class ExpertMatrix(nn.Module):
    """One expert's matrix of one projection, under the name the checkpoint gives it (``<block>.gate_proj.<e>``):
    ``qweight``, ``scales``, ``zeros`` (and ``bias``) are views of its slot in the block's stacked buffers, and a
    tensor assigned to one of them is copied into that slot. It holds no tensors of its own."""

    def __init__(self, block: "QuantExperts", proj: str, expert: int):
        super().__init__()
        object.__setattr__(self, "_owner", block)  # (not a submodule: no cycle in the module tree)
        self.proj, self.expert = proj, expert

    def _field(self, name: str) -> torch.Tensor | None:
        return self._owner.slot(self.proj, self.expert, name)

    qweight = property(lambda self: self._field("qweight"))
    scales = property(lambda self: self._field("scales"))
    zeros = property(lambda self: self._field("zeros"))
    bias = property(lambda self: self._field("bias"))

    def __setattr__(self, name, value):
        if name in FIELDS and isinstance(value, torch.Tensor):
            self._owner.fill(self.proj, self.expert, name, value)
        else:
            super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in FIELDS:
            t = self._field(name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in FIELDS:
            if self._field(name) is None:
                continue
            if prefix + name in state_dict:
                self._owner.fill(self.proj, self.expert, name, state_dict[prefix + name])
            else:
                missing_keys.append(prefix + name)

    def packed(self) -> PackedWeight:
        block = self._owner
        stack = block.gate_up if self.proj != "down_proj" else block.down
        return PackedWeight(self.qweight, self.scales, self.zeros, stack.bits, stack.group_size, 1,
                            (block.intermediate_dim, block.hidden_dim) if self.proj != "down_proj"
                            else (block.hidden_dim, block.intermediate_dim))

    def extra_repr(self) -> str:
        return f"{self.proj}[{self.expert}]"


class ExpertMatrices(nn.ModuleList):
    """One projection's :class:`ExpertMatrix` modules (``<block>.gate_proj``): a class of its own, so that tools
    that wrap modules by name (peft) can tell it from other lists."""


class QuantExperts(nn.Module):
    """Drop-in replacement for a transformers experts block: same ``forward(hidden_states,
    top_k_index, top_k_weights)``. The weights are two :class:`~quantpack.format.PackedExperts`, ``gate_up`` (each
    expert's gate rows, then its up rows) and ``down``, held as buffers ``gate_up_qweight`` ...; the
    state dict names them per expert (``gate_proj.<e>.qweight`` ..., see :class:`ExpertMatrix`).

    ``activation`` is one of :data:`quantpack.reference.EXPERT_ACTIVATIONS` (``alpha``/``limit`` for
    ``swiglu_oai``); ``weight_on_input`` scales each token's input by its routing weight (Llama 4); ``source_form``
    is the replaced block's :attr:`ExpertsBlock.form` (how its checkpoint stores the experts). On CUDA the
    forward is ``quantpack.kernels.moe.fused_experts`` (no host sync: a decode step with it is captured as a CUDA
    graph), elsewhere the reference."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, weight_on_input: bool = False, bias: bool = False,
                 bits: int = 4, group_size: int | None = 128, dtype: torch.dtype = torch.float16, device=None,
                 source_form: str = "standard"):
        super().__init__()
        if activation not in reference.EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: use one of {', '.join(reference.EXPERT_ACTIVATIONS)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.activation, self.alpha, self.limit, self.weight_on_input = activation, alpha, limit, weight_on_input
        self.bits = bits
        self.group_sizes = {}
        for stack, shape in (("gate_up", (2 * intermediate, hidden)), ("down", (hidden, intermediate))):
            # (the group size each expert's matrix was quantized with: gate and up are (I, H) each)
            gs = resolve_group_size(group_size, (shape[0] // 2 if stack == "gate_up" else shape[0], shape[1]), 1)
            check_layout_args(shape, bits, gs, 1)
            self.group_sizes[stack] = gs
            n, k = shape
            q = (num_experts, k // 2, n) if bits == 4 else (num_experts, k, n)
            meta = (num_experts, k // gs, n)
            self.register_buffer(f"{stack}_qweight", torch.empty(q, dtype=torch.uint8, device=device))
            self.register_buffer(f"{stack}_scales", torch.empty(meta, dtype=dtype, device=device))
            self.register_buffer(f"{stack}_zeros", torch.empty(meta, dtype=dtype, device=device))
            self.register_buffer(f"{stack}_bias", torch.empty((num_experts, n), dtype=dtype, device=device)
                                 if bias else None)
        for proj in PROJECTIONS:
            setattr(self, proj, ExpertMatrices(ExpertMatrix(self, proj, e) for e in range(num_experts)))
        self.layout = "rows"  # "mma" once use_mma_layout() has repacked the qweights (see there)
        self.source_form = source_form  # the replaced block's ExpertsBlock.form: how its checkpoint stores it

    @classmethod
    @torch.no_grad()
    def from_experts(cls, block: nn.Module, *, bits: int = 4, group_size: int | None = 128,
                     method: str = "rtn", dtype: torch.dtype | None = None) -> "QuantExperts":
        """Quantize a transformers experts block (see :func:`fused_experts_dims`) in memory, expert by expert as
        ``convert`` does, on the device its weights are on (benchmarks build random models this way)."""
        from ..quantization.groupwise import quantize

        dims = fused_experts_dims(block)
        if dims is None:
            raise ValueError(f"{type(block).__name__}: not an experts block with gate_up_proj (E, 2I, H) and "
                             f"down_proj (E, H, I)")
        e, h, i = dims
        dtype = dtype or block.gate_up_proj.dtype
        new = cls(e, h, i, activation=activation_of(block.act_fn), bits=bits, group_size=group_size, dtype=dtype,
                  device="meta")
        for x in range(e):
            for proj, w in (("gate_proj", block.gate_up_proj[x, :i]), ("up_proj", block.gate_up_proj[x, i:]),
                            ("down_proj", block.down_proj[x])):
                stack = "down" if proj == "down_proj" else "gate_up"
                pw = quantize(w, bits=bits, group_size=new.group_sizes[stack], axis=1, method=method, dtype=dtype)
                for field in ("qweight", "scales", "zeros"):
                    new.fill(proj, x, field, getattr(pw, field))
        return new

    # The stacked buffers are persistent (transformers re-creates a non-persistent buffer, empty, after loading)
    # but the state dict names the tensors per expert, as checkpoints do (ExpertMatrix).
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        pass

    # -- the stacked layout ------------------------------------------------------------------------------------

    @property
    def gate_up(self) -> PackedExperts:
        return self._stack("gate_up")

    @property
    def down(self) -> PackedExperts:
        return self._stack("down")

    def _dims(self, stack: str) -> tuple[int, int]:
        return ((2 * self.intermediate_dim, self.hidden_dim) if stack == "gate_up"
                else (self.hidden_dim, self.intermediate_dim))

    def _stack(self, stack: str):
        n, k = self._dims(stack)
        if self.layout == "mma":
            from ..kernels.moe.mma_experts import MmaExperts

            return MmaExperts(getattr(self, f"{stack}_qweight"), getattr(self, f"{stack}_scales"),
                              getattr(self, f"{stack}_zeros"), self.group_sizes[stack], (n, k))
        return PackedExperts(getattr(self, f"{stack}_qweight"), getattr(self, f"{stack}_scales"),
                             getattr(self, f"{stack}_zeros"), self.bits, self.group_sizes[stack], (n, k),
                             getattr(self, f"{stack}_bias"))

    def slot(self, proj: str, e: int, field: str) -> torch.Tensor | None:
        """Expert ``e``'s ``field`` of projection ``proj`` as the checkpoint stores it: a view of the stacked buffer
        (gate_proj: the first I columns of gate_up's; up_proj: the last I), or, for a qweight in the mma layout,
        a copy unpacked from its tiles."""
        stack = "down" if proj == "down_proj" else "gate_up"
        t = self._buffers[f"{stack}_{field}"]
        if t is None:
            return None
        t = t[e]
        if field == "qweight" and self.layout == "mma":
            from ..kernels.mma_layout import mma_unpack

            n, k = self._proj_dims(proj)
            return mma_unpack(t[self._tiles(proj)], n, k)
        i = self.intermediate_dim
        if proj == "gate_proj":
            return t[..., :i]
        if proj == "up_proj":
            return t[..., i:]
        return t

    def _proj_dims(self, proj: str) -> tuple[int, int]:
        """(N, K) of one expert's ``proj`` matrix."""
        return ((self.hidden_dim, self.intermediate_dim) if proj == "down_proj"
                else (self.intermediate_dim, self.hidden_dim))

    def _tiles(self, proj: str) -> slice:
        """The 16-row tiles of its stack that hold ``proj`` in the mma layout (gate rows, then up rows)."""
        i = self.intermediate_dim // 16
        return slice(0, i) if proj == "gate_proj" else slice(i, 2 * i) if proj == "up_proj" else slice(None)

    def fill(self, proj: str, e: int, field: str, value: torch.Tensor) -> None:
        """Copy ``value`` into expert ``e``'s slot of ``proj``'s ``field`` (cast to the buffer's dtype). A buffer
        still on meta is first allocated, once, on ``value``'s device; a qweight in the mma layout is packed
        into its tiles as it comes (no copy of the block in the checkpoint's layout is ever made)."""
        stack = "down" if proj == "down_proj" else "gate_up"
        name = f"{stack}_{field}"
        buf = self._buffers[name]
        if buf is None:
            raise ValueError(f"{proj}.{e}.{field}: this experts block has no {field}")
        if buf.is_meta:
            buf = torch.empty(buf.shape, dtype=buf.dtype, device=value.device)
            self._buffers[name] = buf
        mma = field == "qweight" and self.layout == "mma"
        if mma:
            n, k = self._proj_dims(proj)
            want, want_dtype = (k // 2, n), torch.uint8
        else:
            target = self.slot(proj, e, field)
            want, want_dtype = tuple(target.shape), target.dtype
        if tuple(value.shape) != want:
            raise ValueError(f"{proj}.{e}.{field}: shape {list(value.shape)}, expected {list(want)}")
        if (value.dtype == torch.uint8) != (want_dtype == torch.uint8):
            raise ValueError(f"{proj}.{e}.{field}: dtype {value.dtype}, expected {want_dtype}")
        if mma:
            from ..kernels.mma_layout import mma_pack

            buf[e, self._tiles(proj)] = mma_pack(value.detach().to(buf.device), n, k)
        else:
            target.copy_(value.detach())  # (buffers and a detached value: nothing for autograd to record)

    def mma_layout_fits(self, device: torch.device) -> bool:
        """Whether this block's experts can be held in the mma layout on ``device``: a GPU (or the CPU under
        TRITON_INTERPRET=1) where the kernel passed its self-check, QUANTPACK_MMA on, 4 bits, 16-bit scales, no
        bias, no input-side routing weight, and a group size the layout's 64-wide chunks divide (so gate, up and
        down are each whole 16-row tiles)."""
        from ..kernels.moe.mma_experts import mma_layout_usable

        return mma_layout_usable((self.gate_up, self.down), device, weight_on_input=self.weight_on_input)

    @torch.no_grad()
    def use_mma_layout(self, device: torch.device | str | None = None) -> bool:
        """Keep the experts' 4-bit weights in the tensor-core decode layout (kernels/moe/mma_experts.py) in place of
        the checkpoint's, same bytes, where :meth:`mma_layout_fits`; returns whether they are. Decode then runs the
        dense ``mma`` GEMV per expert; the state dict still gives (and takes) the checkpoint's layout, converted
        per expert.

        On a block still on meta (being loaded), ``device`` is where it will be filled: the qweights are then
        allocated in the mma layout and each expert packed as :meth:`fill` receives it, so loading never holds
        both layouts. A filled block is repacked a few experts at a time."""
        if self.layout == "mma":
            return True
        meta = self.gate_up_qweight.is_meta
        if not meta:
            device = self.gate_up_qweight.device
        elif device is None:
            return False
        if not self.mma_layout_fits(device):
            return False
        from ..kernels.moe.mma_experts import MmaExperts
        from ..kernels.mma_layout import CHUNK

        for stack in ("gate_up", "down"):
            n, k = self._dims(stack)
            if meta:
                self._buffers[f"{stack}_qweight"] = torch.empty(
                    (self.num_experts, n // 16, k // CHUNK, 32, 4), dtype=torch.int32, device="meta")
            else:  # (the old buffer is freed as its stack is replaced: one stack's two layouts at a time)
                self._buffers[f"{stack}_qweight"] = MmaExperts.from_packed(self._stack(stack)).words
        self.layout = "mma"
        return True

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden_dim)
        run = reference.experts
        if x.is_cuda or self.layout == "mma":
            try:
                from ..kernels.moe import fused_experts as run  # (the reference where Triton cannot run)
            except ImportError:  # (a build without the fused expert kernels: the reference, which syncs)
                pass
        out = run(x, self.gate_up, self.down, top_k_index.reshape(x.shape[0], -1),
                  top_k_weights.reshape(x.shape[0], -1), activation=self.activation, alpha=self.alpha,
                  limit=self.limit, weight_on_input=self.weight_on_input)
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"bits={self.bits}, group_size={self.group_sizes['gate_up']}, activation={self.activation}"
                + (", layout=mma" if self.layout == "mma" else ""))


def use_mma_layouts(model: nn.Module) -> int:
    """:meth:`QuantExperts.use_mma_layout` on every experts block of ``model``; returns how many now use it."""
    return sum(m.use_mma_layout() for m in model.modules() if isinstance(m, QuantExperts))


def skip_experts_switch(model: nn.Module) -> bool:
    """Set ``model``'s transformers experts implementation to ``"eager"`` (its config and sub-configs) when it has
    QuantExperts and no transformers experts block is left; returns whether it did.

    Around every ``generate`` call's decode loop on a GPU, transformers switches an experts implementation of
    ``grouped_mm`` to ``batched_mm`` and back, each time walking every module of the model. The per-expert modules of
    QuantExperts make that walk long (18,432 of them on Qwen3-30B-A3B's 48 layers): on an H200, 12 layers of that
    shape took 52.5 ms to a 2048-token first token with the switch and 41 ms without (bf16: 26). QuantExperts use no
    transformers experts implementation, so a model whose blocks are all QuantExperts needs no switch."""
    mods = list(model.modules())
    if not any(isinstance(m, QuantExperts) for m in mods) or any(
            "gate_up_proj" in m._parameters and experts_block(m) is not None for m in mods):
        return False
    get, set_ = getattr(model, "get_experts_implementation", None), getattr(model, "set_experts_implementation", None)
    if not callable(get) or not callable(set_):  # (a transformers without the switch)
        return False
    current = get()
    if "grouped_mm" not in current.values():
        return False
    set_({k: "eager" if v == "grouped_mm" else v for k, v in current.items()})
    return True
