"""vLLM plugin: serve quantpack checkpoints with ``vllm serve``, tensor-parallel included.

Installed with ``pip install "quantpack[vllm]"``, the ``vllm.general_plugins`` entry point
``quantpack = quantpack.integrations.vllm:register`` makes vLLM call :func:`register` in every
process it starts (API server, engine core, each tensor-parallel worker), which registers the
quantization method ``quantpack``: a checkpoint whose ``config.json`` says
``quant_method: quantpack`` then loads with no extra argument. docs/serving.md describes it.

This module is importable without vLLM: it holds the entry point. The sharding rules are in
:mod:`quantpack.integrations.vllm_sharding`; the vLLM classes live in :mod:`quantpack.integrations._vllm_layers`,
imported by :func:`register`.
"""
from __future__ import annotations

from ..checkpoint import QUANT_METHOD


def register() -> None:
    """Register the ``quantpack`` quantization method with vLLM (the ``vllm.general_plugins`` entry
    point; vLLM calls it in each of its processes; safe to call repeatedly)."""
    from . import _vllm_layers

    _vllm_layers.register()


__all__ = ["QUANT_METHOD", "register"]
