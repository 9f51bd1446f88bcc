"""The import hook that registers quantpack with transformers' quantizer registry when transformers
loads it (see :mod:`quantpack.integrations.transformers`). Kept apart, with nothing heavy imported, so that
``import quantpack`` installs it without importing torch or transformers."""
from __future__ import annotations

import importlib
import importlib.abc
import sys

_REGISTRY_MODULE = "transformers.quantizers.auto"
_QUANTIZER_MODULE = __name__.rpartition(".")[0] + ".integrations.transformers"


def _register_from_hook() -> None:
    try:
        module = sys.modules.get(_QUANTIZER_MODULE)
        if module is None:
            importlib.import_module(_QUANTIZER_MODULE)  # registers itself on import
        elif hasattr(module, "register"):
            module.register()
        # else: the quantizer module's own import loaded the registry; it registers itself when it finishes
    except Exception as e:  # noqa: BLE001 (whatever a transformers version lacks must not break transformers)
        sys.modules.pop(_QUANTIZER_MODULE, None)  # (a half-imported module; a later direct import shows the error)
        print(f"quantpack: cannot register with this transformers ({type(e).__name__}: {e}); from_pretrained "
              f"cannot load quantpack checkpoints, quantpack.load can (see README, Supported versions)",
              file=sys.stderr, flush=True)


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps the loader of transformers' quantizer registry: runs it, then registers quantpack."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _register_from_hook()

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._inner, name)


class _RegistryImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: hands transformers' quantizer registry to its real finder, with
    :class:`_RegisterAfterExec` around the loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def register_when_transformers_loads() -> None:
    """Register now if transformers' registry is loaded, else the moment it is (idempotent)."""
    if _REGISTRY_MODULE in sys.modules:
        _register_from_hook()
    elif not any(isinstance(f, _RegistryImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryImportHook())
