"""Decode steps' attention through the split-KV kernel (:mod:`quantpack.kernels.decode_attention`).

transformers picks a model's attention function by ``config._attn_implementation`` from its ``AttentionInterface``.
:func:`use` registers :data:`NAME` there (with sdpa's mask function, so the masks are sdpa's) and points a model
whose attention is sdpa at it; :func:`attention_forward` then runs the kernel for the calls it can take, and
transformers' sdpa for every other (prefills, eager decoding, other caches, unsupported shapes and options).

The kernel needs the number of valid cache positions on the device, which the attention call is not given: a step
that :mod:`quantpack.generation` runs (and captures) is run inside :func:`decoding` with its static cache, whose
layer ``i`` holds that count (``cumulative_length``) for the keys and values it hands to attention. A call whose key
and value are not those tensors of that cache takes sdpa, and so does any call outside :func:`decoding` (prefills,
which that module runs eagerly, included).

Inside :func:`decoding`, each static layer of that cache also writes a step's keys and values in one launch
(:func:`quantpack.kernels.fused_ops.kv_write`) instead of transformers' five kernels (an arange, two adds on its
count, two ``index_copy_``): the layer gets an instance-level ``update`` for the context's duration, which runs
``StaticLayer.update`` itself wherever the kernel cannot take the call.

``QUANTPACK_DECODE_ATTENTION=0`` (or off) sends every call to sdpa (read per call: a step captured afterwards
follows it).
"""
from __future__ import annotations

import contextlib
import contextvars
import types

import torch

from ..env import switch
from ..kernels import decode_attention as _k
from ..kernels import fused_ops

NAME = "quantpack_decode"

_CACHE = contextvars.ContextVar("quantpack_decode_attention_cache", default=None)


def enabled() -> bool:
    """Whether ``QUANTPACK_DECODE_ATTENTION`` leaves the kernel on (on while unset; quantpack.env parses it)."""
    return bool(switch("QUANTPACK_DECODE_ATTENTION"))


@contextlib.contextmanager
def decoding(cache):
    """Attention calls in this context may take the kernel over ``cache``'s static layers."""
    token = _CACHE.set(cache)
    layers = _fuse_cache_writes(cache)
    try:
        yield
    finally:
        for layer in layers:
            vars(layer).pop("update", None)
        _CACHE.reset(token)


def _static_layer_class():
    """transformers' ``StaticLayer`` when its ``update`` writes at the layer's ``cumulative_length`` count with
    ``index_copy_`` (what :func:`fused_update` does in one launch), else ``None``."""
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return None
    names = getattr(getattr(StaticLayer.update, "__code__", None), "co_names", ())
    return StaticLayer if {"cumulative_length", "index_copy_"} <= set(names) else None


def _fuse_cache_writes(cache) -> list:
    """Give each initialized static layer of ``cache`` the one-launch update; returns the layers given it."""
    static = _static_layer_class()
    layers = getattr(cache, "layers", None)
    if static is None or not isinstance(layers, (list, tuple)):
        return []
    fused = []
    for layer in layers:
        if (type(layer) is static and "update" not in vars(layer) and getattr(layer, "is_initialized", False)
                and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)):
            layer.update = types.MethodType(fused_update, layer)
            fused.append(layer)
    return fused


def fused_update(layer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """``StaticLayer.update`` for a decode step: keys and values written at the layer's count, the count advanced,
    in one launch (``StaticLayer.update`` itself where the kernel cannot take the call or autograd records)."""
    if (not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and fused_ops.kv_write_unsupported(key_states, value_states, layer.keys, layer.values,
                                               layer.cumulative_length) is None):
        fused_ops.kv_write_unchecked(key_states, value_states, layer.keys, layer.values, layer.cumulative_length)
        return layer.keys, layer.values
    return type(layer).update(layer, key_states, value_states, *args, **kwargs)


def _valid_length(module, key, value) -> torch.Tensor | None:
    """The device tensor counting the valid positions of ``key``/``value``, when they are a full-attention static
    layer of the cache in :func:`decoding`."""
    cache = _CACHE.get()
    layers = getattr(cache, "layers", None)
    index = getattr(module, "layer_idx", None)
    if layers is None or not isinstance(index, int) or not 0 <= index < len(layers):
        return None
    from transformers.cache_utils import StaticLayer

    layer = layers[index]
    if type(layer) is not StaticLayer or getattr(layer, "keys", None) is not key or layer.values is not value:
        return None
    return getattr(layer, "cumulative_length", None)  # (older transformers keep no such count there: sdpa)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """An ``AttentionInterface`` function: the kernel for a decode step over the cache in :func:`decoding`,
    transformers' sdpa otherwise."""
    # (torch.compile traces sdpa: the steps it compiles are not this module's, and dynamo cannot read a ContextVar)
    if (not torch.compiler.is_compiling() and dropout == 0.0 and enabled() and getattr(module, "is_causal", False)
            and not kwargs.get("output_attentions") and kwargs.get("sliding_window") is None
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and kwargs.get("position_bias") is None and not torch.is_grad_enabled()):
        kv_len = _valid_length(module, key, value)
        if kv_len is not None and _k.unsupported(query, key, value, kv_len, attention_mask) is None:
            return _k.decode_attention_unchecked(query, key, value, kv_len, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use(model) -> bool:
    """Point ``model``'s attention at :func:`attention_forward` where it is sdpa today; returns whether it does."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME:
        return True
    if getattr(config, "_attn_implementation", None) != "sdpa" or not callable(
            getattr(model, "set_attn_implementation", None)):
        return False
    _register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, KeyError, ImportError):  # (a model transformers will not switch: it keeps sdpa)
        model.set_attn_implementation("sdpa")
        return False
    return config._attn_implementation == NAME


def unuse(model) -> None:
    """Undo :func:`use`: sdpa again."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")
