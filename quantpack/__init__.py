"""quantpack: 4/8-bit packed checkpoints for Hugging Face models, run on fused Triton kernels."""
from .format import LAYOUT_VERSION, PackedWeight, pack, unpack
from .quantize import quantize
from .reference import dequantize

__version__ = "0.1.0"

__all__ = ["LAYOUT_VERSION", "PackedWeight", "pack", "unpack", "quantize", "dequantize", "__version__"]
