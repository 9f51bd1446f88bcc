"""The fused mixture-of-experts kernels: routing.py sorts (token, slot) pairs into per-expert blocks on the GPU,
dispatch.py picks the kernel (decode ``pairs`` or prefill ``sorted``) and says why, fused_experts.py holds the
Triton kernel and its launcher."""
from .dispatch import ExpertsConfig, choose, explain
from .fused_experts import fused_experts

__all__ = ["fused_experts", "explain", "choose", "ExpertsConfig"]
