"""Calibrated quantization (``--method gptq``): GPTQ's error-compensating rounding on HQQ's group parameters,
streamed one decoder block at a time.

:func:`gptq_quantize` rounds one linear weight column by column (GPTQ, arXiv 2210.17323): each column's
rounding error is spread over the columns not yet rounded, weighted by the inverse of the Hessian
``H = 2 X^T X`` of the layer's inputs (optionally shrunk towards its diagonal, damped by 1% of its mean
diagonal; its inverse's Cholesky factor, updated lazily in blocks of 128 columns). The group scale and float
zero point come from hqq's solver, as :func:`quantpack.quantization.groupwise.quantize` computes them, once from the
original weight (static, the default: measured better here) or from the partially updated weight when the
loop reaches a group's first column (GPTQ's usual choice); the result is the ordinary packed format.

:func:`quantize_blocks` runs calibration tokens through a checkpoint without ever holding the model:
the model is built with empty parameters, the embeddings run once, then block by block the block's own
weights are read from the checkpoint, the inputs of its linear layers are captured with forward hooks
(the Hessian is accumulated on the fly; layers fed the same tensor, q/k/v or gate/up, share it), the
layers are quantized in the order the block calls them (each after the earlier ones are quantized, so
it compensates their error too), and the quantized block produces the next block's inputs. Memory
stays near one block's weights, its Hessians and the calibration activations.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

from ..format import PackedWeight, check_layout_args, pack
from .groupwise import quantize
from ..reference import dequantize

DEFAULT_BLOCK_SIZE = 128
DEFAULT_DAMP = 0.01
STATIC_GROUPS = True  # group parameters from the original weight: a lower KL than GPTQ's usual (BENCHMARKS.md)
# columns rounded in decreasing order of the Hessian's diagonal (with static groups): the lowest KL and worst-layer
# error of the variants measured (BENCHMARKS.md), at no extra cost
ACT_ORDER = True
# ``convert --calibration self`` on a causal LM: the Hessian of sampled text shrunk this far towards its diagonal.
# Sampled text gets some correlations between input features wrong, and GPTQ trusts them; shrinking kept every layer of
# a pretrained model within hqq's output error for a small loss of KL (BENCHMARKS.md)
SELF_SHRINK = 0.5


class _Stop(Exception):
    """Ends a forward pass early, once what it was run for has been seen."""


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, *, bits: int = 4, group_size: int | None = 128,
                  dtype: torch.dtype = torch.bfloat16, static_groups: bool = STATIC_GROUPS,
                  act_order: bool | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                  damp: float = DEFAULT_DAMP, shrink: float = 0.0) -> PackedWeight:
    """Quantize a (N, K) weight whose inputs have the (K, K) Hessian ``hessian``; groups along K (axis 1).

    ``static_groups``: every group's scale and zero from the original weight, else from the weight as
    updated when the loop reaches the group. ``act_order`` rounds columns in decreasing order of the
    Hessian's diagonal; it needs static groups (a group must stay contiguous along K with fixed
    parameters in this format); ``None``: :data:`ACT_ORDER` with static groups, off without. ``shrink`` (a, in
    [0, 1]) rounds with ``(1 - a) H + a diag(H)`` instead of ``H`` (Ledoit-Wolf style shrinkage): trusts the
    correlations between input features less where the calibration inputs may get them wrong; 0 is GPTQ, 1 leaves
    no correlation to compensate along, so hqq's rounding with static groups. Returns the packed weight (scales and
    zeros in ``dtype``).
    """
    if act_order is None:
        act_order = ACT_ORDER and static_groups
    n, k = weight.shape
    gs = group_size or k
    check_layout_args((n, k), bits, gs, 1)
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian: shape {tuple(hessian.shape)} does not match in_features={k}")
    check_shrink(shrink)
    if act_order and not static_groups:
        raise ValueError("act_order=True needs static_groups=True: groups must stay contiguous along in-features "
                         "with fixed parameters")
    qmax = (1 << bits) - 1
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    if shrink:
        diag = torch.diag(h)
        h *= 1 - shrink
        h.diagonal().copy_(diag)
    if static_groups:
        pw = quantize(w, bits=bits, group_size=gs, method="hqq", dtype=dtype)
        scales, zeros = pw.scales.clone(), pw.zeros.clone()
    else:
        scales = torch.empty(k // gs, n, dtype=dtype, device=w.device)
        zeros = torch.empty_like(scales)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else None
    group_of = list(range(k)) if perm is None else perm.tolist()  # on the host: no device sync per column
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_cholesky(h, damp)
    # Block boundaries on group starts: a group's parameters are then computed from up-to-date columns.
    bs = block_size if gs >= block_size or act_order else max(gs, block_size // gs * gs)
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    # each group's scale and zero in float32 once, not once per column (two launches a column on a GPU)
    params = (scales.float(), zeros.float()) if static_groups else None
    current = None  # (group, its float32 scale and zero) where groups are computed as the loop goes
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static_groups and col % gs == 0:
                # w1 holds this block's columns updated so far; a group wider than the block starts it (i == 0,
                # w1 equals w there, and w's later columns have every earlier block's update).
                cols = w1[:, i:i + gs] if i + gs <= i2 - i1 else w[:, col:col + gs]
                pw = quantize(cols.contiguous(), bits=bits, group_size=gs, method="hqq", dtype=dtype)
                scales[col // gs], zeros[col // gs] = pw.scales[0], pw.zeros[0]
            g = group_of[col] // gs
            if params is not None:
                s, z = params[0][g], params[1][g]
            else:
                if current is None or current[0] != g:
                    current = (g, scales[g].float(), zeros[g].float())
                s, z = current[1], current[2]
            x = w1[:, i]
            qc = torch.round(x / s + z).clamp_(0, qmax)
            q[:, col] = qc.to(torch.uint8)
            e = (x - (qc - z) * s) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return PackedWeight(qweight=pack(q, bits), scales=scales, zeros=zeros, bits=bits, group_size=gs, axis=1,
                        shape=(n, k))


def check_shrink(shrink: float) -> None:
    """Refuse, with one line, a Hessian shrinkage outside [0, 1]."""
    if not 0 <= shrink <= 1:  # also refuses NaN
        raise ValueError(f"gptq: shrink={shrink} must lie in [0, 1] (0: the full Hessian, GPTQ; 1: its diagonal "
                         f"only)")


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``; more damping while ``H`` is not
    positive definite in float32 (few calibration tokens against a wide layer)."""
    mean_diag = float(torch.diag(h).mean())
    for attempt in range(6):
        d = h + torch.eye(h.shape[0], device=h.device) * (damp * 10 ** attempt * mean_diag)
        factor, info = torch.linalg.cholesky_ex(d)
        if int(info) == 0:
            inv, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(factor), upper=True)
            if int(info) == 0:
                return inv
    raise ValueError("gptq: the calibration Hessian stays singular even with strong damping; pass more (or more "
                     "varied) calibration text")


class _Hessian:
    """``2 X^T X / tokens`` of the inputs seen so far, accumulated in float32 (GPTQ's running mean)."""

    def __init__(self, k: int, device):
        self.h = torch.zeros(k, k, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.h *= self.tokens / (self.tokens + m)
        self.tokens += m
        x = x * math.sqrt(2 / self.tokens)
        self.h += x.t() @ x


# -- the model, one block at a time


def decoder_blocks(model: nn.Module, config, advice: str = "use --method hqq or sinq") -> tuple[str, nn.ModuleList]:
    """The path and list of ``model``'s decoder blocks (the first ``nn.ModuleList`` with one entry per
    hidden layer); a one-line ``ValueError`` (ending with ``advice``) for a model that is not a decoder-only
    stack of blocks."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    layers = getattr(text, "num_hidden_layers", None)
    refuse = ValueError(f"method='gptq' calibrates decoder-only causal LMs whose blocks are a list of layers "
                        f"(Llama, Qwen2, Mistral, Gemma, Phi3, ...); {model_type or type(model).__name__} "
                        f"({type(model).__name__}) is not one: {advice}")
    if (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) != type(model).__name__
            or getattr(config, "is_encoder_decoder", False) or not layers):
        raise refuse
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            return path, module
    raise refuse


def check_model(model: nn.Module, config, quant_plan: dict, expert_blocks) -> str:
    """Refuse, with one line, a model :func:`quantize_blocks` cannot calibrate; return its blocks' path."""
    path, blocks = decoder_blocks(model, config)
    if expert_blocks:
        raise ValueError(f"method='gptq' does not calibrate mixture-of-experts blocks yet ({expert_blocks[0]}); use "
                         f"--method hqq")
    inside = [name for name in quant_plan if name.startswith(path + ".")]
    if not inside:
        raise ValueError(f"method='gptq': no quantized linear layer lies in the decoder blocks ({path}); use "
                         f"--method hqq")
    bad = next((name for name in inside if type(model.get_submodule(name)) is not nn.Linear), None)
    if bad is not None:
        raise ValueError(f"method='gptq' calibrates nn.Linear layers; {bad} is a "
                         f"{type(model.get_submodule(bad)).__name__} ({getattr(config, 'model_type', '?')}): use "
                         f"--method hqq")
    return path


class _Recorder(nn.Module):
    """Stands in for a decoder block during the embedding pass: records the block's arguments besides the
    hidden states (masks, rotary position embeddings: the model's own, as it passes them) and, for the first
    block, the hidden states; stops the pass after ``stop_after``."""

    def __init__(self, index: int, store: dict, stop_after: int):
        super().__init__()
        self.index, self.store, self.stop_after = index, store, stop_after

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.store.setdefault(("args", self.index), (args[1:], kwargs))
        if self.index == 0:
            self.store["hidden"] = hidden
        if self.index >= self.stop_after:
            raise _Stop
        return hidden


def _materialize(module: nn.Module, prefix: str, read, device) -> None:
    """Give ``module``'s (empty) parameters and persistent buffers the checkpoint's values, float32 on
    ``device``; ``read(name)`` returns the tensor stored under the model's state-dict ``name``."""
    state = {}
    for k in module.state_dict():
        t = read(prefix + k)
        state[k] = t.to(device, torch.float32) if t.is_floating_point() else t.to(device)
    module.load_state_dict(state, strict=True, assign=True)
    for sub in module.modules():  # non-persistent buffers (made real at build) follow to the device
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != torch.device(device):
                sub._buffers[name] = buf.to(device)


def _run_block(block: nn.Module, hidden: torch.Tensor, call) -> torch.Tensor:
    args, kwargs = call
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def quantize_blocks(model_class, config, read, quant_plan: dict, tokens: torch.Tensor, *, store: Path,
                    dtype: torch.dtype, device, static_groups: bool = STATIC_GROUPS, act_order: bool | None = None,
                    shrink: float = 0.0, progress: bool = False) -> dict[str, Path]:
    """GPTQ every quantized linear of the decoder blocks, one block at a time; write each block's packed
    tensors (``<module>.qweight/.scales/.zeros``) to ``store/block-<i>.safetensors``.

    ``model_class(config)`` is built with empty parameters; ``read(name)`` gives the checkpoint tensor
    of the model's state-dict ``name``; ``quant_plan``: {module name: object with ``bits`` and
    ``group_size``} (layers not in it stay unquantized, also while calibrating); ``tokens``:
    (sequences, length) token ids; ``shrink``: as :func:`gptq_quantize`'s. Returns {module name: the file holding
    its packed tensors}.
    """
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from ..tiny import quiet_transformers

    check_shrink(shrink)  # before any work
    device = torch.device(device)
    with quiet_transformers(), init_empty_weights(include_buffers=False):
        model = model_class(config)  # parameters on the meta device; buffers (rotary frequencies...) real
    model.eval()
    path, blocks = decoder_blocks(model, config)
    # -- the embedding pass: every sequence's input to the first block, and each block's other arguments
    embed = model.get_input_embeddings()
    embed_name = next(n for n, m in model.named_modules() if m is embed)
    _materialize(embed, f"{embed_name}.", read, device)
    for sub in model.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                sub._buffers[name] = buf.to(device)
    originals = list(blocks)
    records: dict = {}
    hidden = []
    try:
        for s in range(tokens.shape[0]):
            for i in range(len(blocks)):
                blocks[i] = _Recorder(i, records, stop_after=len(blocks) - 1 if s == 0 else 0)
            try:
                model(input_ids=tokens[s:s + 1].to(device), use_cache=False)
            except _Stop:
                pass
            hidden.append(records.pop("hidden").float())
    except Exception as e:  # anything but a clean stop: the model's preamble needs more than its embeddings
        first = " ".join(str(e).split())[:160]
        raise ValueError(f"method='gptq': cannot run the calibration text through {type(model).__name__}'s "
                         f"embeddings ({type(e).__name__}: {first}); use --method hqq") from None
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
        embed.to("meta")
    calls = [records[("args", i)] for i in range(len(blocks))]

    def harmonize(call):  # recorded float tensors (rotary cos/sin) in the blocks' float32
        args, kwargs = call
        f = (lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        return tuple(f(a) for a in args), {k: f(v) if not isinstance(v, tuple) else tuple(f(x) for x in v)
                                           for k, v in kwargs.items()}

    calls = [harmonize(c) for c in calls]
    store.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    bar = tqdm(total=len(blocks), desc="calibrating", unit="block", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        for i, block in enumerate(blocks):
            prefix = f"{path}.{i}."
            _materialize(block, prefix, read, device)
            packed = _quantize_block(block, prefix, hidden, calls[i], quant_plan, dtype=dtype,
                                     static_groups=static_groups, act_order=act_order, shrink=shrink)
            if packed:
                file = store / f"block-{i:05d}.safetensors"
                save_file({k: v.cpu().contiguous() for k, v in packed.items()}, file)
                out.update({name.rpartition(".")[0]: file for name in packed if name.endswith(".qweight")})
            hidden = [_run_block(block, x, calls[i]) for x in hidden]  # the quantized block's outputs
            block.to("meta")
            bar.update()
    finally:
        bar.close()
    return out


def _quantize_block(block: nn.Module, prefix: str, hidden: list[torch.Tensor], call, quant_plan: dict, *,
                    dtype, static_groups: bool, act_order: bool | None, shrink: float) -> dict[str, torch.Tensor]:
    """GPTQ the planned linears of one block, in the order the block calls them; returns their packed
    tensors by output name and leaves the block computing with the dequantized weights."""
    linears = {prefix + n: m for n, m in block.named_modules() if prefix + n in quant_plan}
    # Which linears run on which input tensor, in call order (one probe pass).
    order: list[tuple[torch.Tensor, list[str]]] = []

    def probe(name):
        def hook(module, args):
            x = args[0]
            for seen, names in order:
                if seen is x:
                    names.append(name)
                    return
            order.append((x, [name]))
        return hook

    handles = [m.register_forward_pre_hook(probe(n)) for n, m in linears.items()]
    try:
        _run_block(block, hidden[0], call)
    finally:
        for handle in handles:
            handle.remove()
    groups = [names for _, names in order]
    order.clear()
    packed: dict[str, torch.Tensor] = {}
    for names in groups:
        first = linears[names[0]]
        hess = _Hessian(first.in_features, first.weight.device)

        def capture(module, args, hess=hess):
            hess.add(args[0])
            raise _Stop  # what comes after this layer does not matter for its Hessian

        handle = first.register_forward_pre_hook(capture)
        try:
            for x in hidden:
                try:
                    _run_block(block, x, call)
                except _Stop:
                    pass
        finally:
            handle.remove()
        for name in names:
            module, layer = linears[name], quant_plan[name]
            pw = gptq_quantize(module.weight, hess.h, bits=layer.bits, group_size=layer.group_size, dtype=dtype,
                               static_groups=static_groups, act_order=act_order, shrink=shrink)
            module.weight.data = dequantize(pw, torch.float32)
            packed.update({f"{name}.qweight": pw.qweight, f"{name}.scales": pw.scales, f"{name}.zeros": pw.zeros})
        hess = None  # (its memory, before the next group's)
    return packed
