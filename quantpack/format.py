"""The packed weight format: one place that defines how quantized weights are laid out.

A linear weight ``W`` of shape (N out-features, K in-features) is stored as

* ``qweight``: uint8. 4-bit: shape (K/2, N); row r holds k=2r in the low nibble and k=2r+1 in
  the high nibble. 8-bit: shape (K, N). Either way a kernel walking K reads contiguous rows of N.
* ``scales``, ``zeros``: compute dtype, contiguous. ``axis=1`` (groups along K): (K/group_size, N).
  ``axis=0`` (groups along N): (K, N/group_size).

and dequantizes as ``W[n, k] = (q[n, k] - zero) * scale``. A mixture-of-experts projection stacks its experts' tensors
along a leading axis in memory (:class:`PackedExperts`). docs/format.md is the written spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are handled: the layout constants load without it
    import torch

LAYOUT_VERSION = 1
SUPPORTED_BITS = (4, 8)
SUPPORTED_AXES = (0, 1)
MIN_GROUP_SIZE = 16
MAX_GROUP_SIZE = 1024


@dataclass
class PackedWeight:
    """A quantized linear weight in quantpack's packed layout (see module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    axis: int
    shape: tuple[int, int]  # (N, K) of the original weight

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def to(self, device=None) -> "PackedWeight":
        return PackedWeight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device),
                            self.bits, self.group_size, self.axis, self.shape)

    def validate(self) -> None:
        """Raise ValueError if tensors do not match the declared bits/group size/axis/shape."""
        import torch

        check_layout_args(self.shape, self.bits, self.group_size, self.axis)
        want = packed_shapes(self.shape, self.bits, self.group_size, self.axis)
        for name, t in (("qweight", self.qweight), ("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {want[name]} expected for "
                                 f"shape={self.shape} bits={self.bits} group_size={self.group_size} axis={self.axis}")
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight: dtype {self.qweight.dtype}, expected torch.uint8")
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if not t.is_floating_point():
                raise ValueError(f"{name}: dtype {t.dtype}, expected a floating-point dtype")
        if self.zeros.dtype != self.scales.dtype:
            raise ValueError(f"zeros: dtype {self.zeros.dtype} differs from scales' {self.scales.dtype}; "
                             f"both are stored in the compute dtype")
        devices = {t.device for t in (self.qweight, self.scales, self.zeros)}
        if len(devices) > 1:
            raise ValueError(f"qweight, scales and zeros are on different devices ({sorted(map(str, devices))}); "
                             f"move them to one device")


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def check_group_size(group_size) -> None:
    """A group size of a grouped layout: an integer power of two in [MIN_GROUP_SIZE, MAX_GROUP_SIZE]; else a
    ValueError naming it (per-channel, ``None``, is the caller's to allow)."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer, or None for per-channel")
    if not (_is_pow2(group_size) and MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE):
        raise ValueError(f"group_size={group_size} must be a power of two in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}] "
                         f"(or None for per-channel)")


def check_layout_args(shape, bits: int, group_size: int, axis: int) -> None:
    """Validate (N, K), bits, group size and axis; raise ValueError naming the bad argument.

    ``group_size`` equal to the full length of the grouped axis means per-channel (one group per
    row for axis=1) and need not be a power of two.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    if axis not in SUPPORTED_AXES:
        raise ValueError(f"axis={axis!r} is not supported; use 1 (groups along in-features) or 0 (along out-features)")
    if len(shape) != 2:
        raise ValueError(f"weight: expected a 2-D (out_features, in_features) tensor, got shape {tuple(shape)}")
    n, k = shape
    if n < 1 or k < 1:
        raise ValueError(f"weight: empty shape {tuple(shape)}")
    if bits == 4 and k % 2:
        raise ValueError(f"weight: in_features K={k} is odd; 4-bit packing stores two values of K per byte, so K must be even")
    length = k if axis == 1 else n
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise ValueError(f"group_size={group_size!r} must be an integer")
    if group_size != length:
        check_group_size(group_size)
        if length % group_size:
            dim = "in_features K" if axis == 1 else "out_features N"
            raise ValueError(f"group_size={group_size} does not divide {dim}={length}; pick a group size that divides it")


def packed_shapes(shape, bits: int, group_size: int, axis: int) -> dict[str, tuple[int, int]]:
    """Shapes of qweight, scales and zeros for a (N, K) weight."""
    n, k = shape
    q = (k // 2, n) if bits == 4 else (k, n)
    meta = (k // group_size, n) if axis == 1 else (k, n // group_size)
    return {"qweight": q, "scales": meta, "zeros": meta}


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer values ``q`` of shape (N, K) into ``qweight``.

    4-bit: (K/2, N), even k in the low nibble. 8-bit: (K, N).
    """
    import torch

    if q.dim() != 2:
        raise ValueError(f"q: expected a 2-D (N, K) tensor, got shape {tuple(q.shape)}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    if q.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"q: dtype {q.dtype}; expected an unsigned-range integer tensor")
    qmax = (1 << bits) - 1
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > qmax):
        raise ValueError(f"q: values must lie in [0, {qmax}] for bits={bits}")
    qt = q.t().to(torch.uint8)
    if bits == 8:
        return qt.contiguous()
    if qt.shape[0] % 2:
        raise ValueError(f"q: K={qt.shape[0]} is odd; 4-bit packing needs an even K")
    return (qt[0::2] | (qt[1::2] << 4)).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: return uint8 values of shape (N, K). Never sign-extends."""
    import torch

    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight: dtype {qweight.dtype}, expected torch.uint8")
    if bits == 8:
        return qweight.t().contiguous()
    if bits != 4:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    low = qweight & 0x0F
    high = qweight >> 4  # uint8 shift is logical: no sign extension
    kq, n = qweight.shape
    return torch.stack((low, high), dim=1).reshape(2 * kq, n).t().contiguous()


@dataclass
class PackedExperts:
    """One projection of a mixture-of-experts block, all experts stacked along a leading axis: expert ``e``'s
    matrix is the :class:`PackedWeight` ``(qweight[e], scales[e], zeros[e])`` of shape ``shape`` (N, K), groups along
    K (``axis=1``). This is the in-memory layout the fused expert kernels read (checkpoints keep one matrix per expert,
    docs/format.md); ``bias``, where the block has one, is (E, N) in the scales' dtype."""

    qweight: torch.Tensor  # uint8, (E, K/2, N) at 4 bits, (E, K, N) at 8
    scales: torch.Tensor  # (E, K/group_size, N)
    zeros: torch.Tensor  # (E, K/group_size, N)
    bits: int
    group_size: int
    shape: tuple[int, int]  # (N, K) of each expert's matrix
    bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    def expert(self, e: int) -> PackedWeight:
        """Expert ``e``'s matrix as a :class:`PackedWeight` (views, no copy)."""
        return PackedWeight(self.qweight[e], self.scales[e], self.zeros[e], self.bits, self.group_size, 1, self.shape)

    @classmethod
    def stack(cls, weights: "list[PackedWeight]", bias: torch.Tensor | None = None) -> "PackedExperts":
        """Stack per-expert matrices of one projection; they must share shape, bits and group size (axis 1)."""
        import torch

        if not weights:
            raise ValueError("PackedExperts.stack: no expert matrices given")
        first = weights[0]
        for e, w in enumerate(weights):
            w.validate()
            if (w.shape, w.bits, w.group_size, w.axis) != (first.shape, first.bits, first.group_size, 1):
                raise ValueError(f"expert {e}: shape {w.shape}, bits {w.bits}, group size {w.group_size}, axis "
                                 f"{w.axis} differ from expert 0's ({first.shape}, {first.bits}, {first.group_size}, "
                                 f"axis 1); experts of one projection are stacked only when they share all four")
        return cls(torch.stack([w.qweight for w in weights]), torch.stack([w.scales for w in weights]),
                   torch.stack([w.zeros for w in weights]), first.bits, first.group_size, first.shape, bias)

    def validate(self) -> None:
        """Raise ValueError if the stacked tensors do not match the declared bits, group size and shape."""
        import torch

        e = self.num_experts
        check_layout_args(self.shape, self.bits, self.group_size, 1)
        want = packed_shapes(self.shape, self.bits, self.group_size, 1)
        for name, t in (("qweight", self.qweight), ("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != (e, *want[name]):
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {(e, *want[name])} expected for "
                                 f"{e} experts of shape={self.shape} bits={self.bits} group_size={self.group_size}")
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight: dtype {self.qweight.dtype}, expected torch.uint8")
        if self.bias is not None and tuple(self.bias.shape) != (e, self.shape[0]):
            raise ValueError(f"bias: shape {tuple(self.bias.shape)}, expected {(e, self.shape[0])}")
