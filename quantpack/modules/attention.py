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

``QUANTPACK_DECODE_ATTENTION=0`` (or off) sends every call to sdpa (read per call: a step captured afterwards
follows it).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from ..env import switch
from ..kernels import decode_attention as _k

NAME = "quantpack_decode"

_CACHE = contextvars.ContextVar("quantpack_decode_attention_cache", default=None)


def enabled() -> bool:
    """Whether ``QUANTPACK_DECODE_ATTENTION`` leaves the kernel on (on while unset; quantpack.env parses it)."""
    return bool(switch("QUANTPACK_DECODE_ATTENTION"))


@contextlib.contextmanager
def decoding(cache):
    """Attention calls in this context may take the kernel over ``cache``'s static layers."""
    token = _CACHE.set(cache)
    try:
        yield
    finally:
        _CACHE.reset(token)


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
