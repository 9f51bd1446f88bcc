"""quantpack: 4/8-bit packed checkpoints for Hugging Face models, run on fused Triton kernels."""
from .format import LAYOUT_VERSION, PackedWeight, pack, unpack
from .quantize import quantize
from .reference import dequantize

__version__ = "0.1.0"

from .loader import load  # noqa: E402
from . import hf_integration  # noqa: E402,F401  registers "quantpack" with transformers' quantizer registry

__all__ = ["LAYOUT_VERSION", "PackedWeight", "pack", "unpack", "quantize", "dequantize", "load", "__version__"]
