"""Quantization schemes: what a ``quantization_config.scheme`` means to convert, load and verify.

One registry, :data:`SCHEMES` (name -> :class:`~quantpack.schemes.base.Scheme`), holds ``w4a16``, ``w8a16`` and
``w8a8``; :func:`register` adds another. :func:`read_quantization_config` refuses a scheme this quantpack does not
know.
"""
from __future__ import annotations

from .. import checkpoint
from .base import ModuleCheck, ModuleBuilder, Scheme
from .w8a8 import W8A8
from .weight_only import W4A16, W8A16

SCHEMES: dict[str, Scheme] = {s.name: s for s in (W4A16, W8A16, W8A8)}


def register(scheme: Scheme) -> None:
    """Teach convert, load (and the transformers integration) and verify the scheme ``scheme.name``."""
    SCHEMES[scheme.name] = scheme


def get(name: str) -> Scheme:
    """The registered scheme ``name``; a one-line :class:`~quantpack.checkpoint.CheckpointError` if none."""
    scheme = SCHEMES.get(name)
    if scheme is None:
        raise checkpoint.CheckpointError(f"config.json: quantization_config.scheme={name!r} is not supported by this "
                                         f"quantpack (known: {', '.join(sorted(SCHEMES))}); upgrade quantpack")
    return scheme


def read_quantization_config(config: dict) -> dict:
    """:func:`quantpack.checkpoint.read_quantization_config` plus: the scheme must be a registered one."""
    qc = checkpoint.read_quantization_config(config)
    get(qc["scheme"])
    return qc


def module_check(module) -> ModuleCheck | None:
    """How verify checks ``module``: the check of the scheme whose module class it is (exactly), or ``None`` for a
    module no scheme loads as."""
    for scheme in SCHEMES.values():
        if type(module) is scheme.module_class:
            return scheme.check
    return None


__all__ = ["SCHEMES", "ModuleBuilder", "ModuleCheck", "Scheme", "get", "module_check", "read_quantization_config",
           "register"]
