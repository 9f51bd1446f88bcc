"""quantpack: 4/8-bit packed checkpoints for Hugging Face models, run on fused Triton kernels.

The package imports torch (and transformers) only when one of its names is first used, so that
``import quantpack`` and ``quantpack --help`` stay fast; ``import quantpack`` still lets
``from_pretrained`` load packed checkpoints (the quantizer registers when transformers loads).

Where things are:

* :mod:`.format` and :mod:`.reference`: the packed layout and its pure-torch meaning (docs/format.md), the spec
  every other part follows.
* :mod:`.quantization`: the methods that choose codes, scales and zeros (rtn, hqq, refit, sinq, gptq; calibration).
* :mod:`.checkpoint`: checkpoint files: reading, writing, the hub, integrity.
* :mod:`.convert`, :mod:`.verify`, :func:`load` (:mod:`.loader`): the three things a user does.
* :mod:`.kernels`: the Triton kernels and their dispatch (:mod:`.kernels.moe` for mixtures of experts).
* :mod:`.modules`: the ``nn.Module`` s a loaded model runs (``QuantLinear``, ``QuantExperts``, fused norms).
* :mod:`.schemes`: what a checkpoint's scheme (w4a16, w8a16, w8a8) means to convert, load and verify.
* :mod:`.generation`: ``generate`` from CUDA graphs; :mod:`.integrations`: transformers, PEFT, vLLM.
"""
import importlib

from ._registry_hook import register_when_transformers_loads

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {"LAYOUT_VERSION": "format", "PackedWeight": "format", "pack": "format", "unpack": "format",
            "quantize": "quantization.groupwise", "dequantize": "reference", "load": "loader"}
__all__ = [*_EXPORTS, "__version__"]

register_when_transformers_loads()


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a submodule not imported yet, e.g. quantpack.convert
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

