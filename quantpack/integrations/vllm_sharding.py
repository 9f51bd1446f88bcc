"""The tensor-parallel sharding rules of packed layers under vLLM: what a rank of a column- or row-parallel layer
holds, and which tensor-parallel sizes a layer allows. Importable without vLLM."""
from __future__ import annotations

from dataclasses import dataclass


# Tensor-parallel sizes listed in a refusal: every size up to this that would work.
MAX_LISTED_TP = 64


class TensorParallelError(ValueError):
    """A packed layer cannot be split over the requested tensor-parallel size (one-line message)."""


@dataclass(frozen=True)
class Partition:
    """What one tensor-parallel rank holds of a packed linear layer (weight-only layout, ``axis=1``).

    ``qweight`` is (``in_features`` / (8 / bits), ``out_features``); ``scales`` and ``zeros`` are
    (``in_features`` / ``group_size``, ``out_features``) when ``meta_split_k`` (groups split with
    the in-features), else (1, ``out_features``): a per-channel layer's one group spans all of K,
    so every rank of a row-parallel layer keeps the same scales row over its slice of K.
    Column-parallel ranks take a slice of every output partition along N; row-parallel ranks a
    slice of K (rows of ``qweight`` and of grouped ``scales``/``zeros``).
    """

    in_features: int
    out_features: int
    group_size: int
    meta_split_k: bool

    def shapes(self, bits: int) -> dict[str, tuple[int, int]]:
        per_byte = 8 // bits
        meta_rows = self.in_features // self.group_size if self.meta_split_k else 1
        return {"qweight": (self.in_features // per_byte, self.out_features),
                "scales": (meta_rows, self.out_features), "zeros": (meta_rows, self.out_features)}


def _problem(input_size: int, output_sizes, bits: int, group_size: int | None, row_parallel: bool,
             tp: int) -> str | None:
    """Why a layer cannot be split over ``tp`` ranks, or ``None`` if it can."""
    if row_parallel:
        if input_size % tp:
            return f"its {input_size} in-features do not split into {tp} equal parts"
        k = input_size // tp
        if group_size is not None and k % group_size:
            return (f"each rank would hold {k} of its {input_size} in-features, not a multiple of the group "
                    f"size {group_size}")
        if bits == 4 and k % 2:
            return f"each rank would hold {k} in-features, an odd number (4-bit packs two in-features a byte)"
        return None
    for n in output_sizes:
        if n % tp:
            return f"its {n} out-features do not split into {tp} equal parts"
    return None


def allowed_tp_sizes(input_size: int, output_sizes, bits: int, group_size: int | None, row_parallel: bool,
                     limit: int = MAX_LISTED_TP) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` over which this layer's packed tensors split."""
    return [t for t in range(1, limit + 1)
            if _problem(input_size, output_sizes, bits, group_size, row_parallel, t) is None]


def partition(layer: str, *, input_size: int, output_sizes, bits: int, group_size: int | None,
              row_parallel: bool, tp: int) -> Partition:
    """The :class:`Partition` one rank holds of packed layer ``layer`` (its vLLM name) split over ``tp``
    ranks: ``output_sizes`` are the full out-features of each fused part (q/k/v, gate/up; one entry
    for a plain layer), ``group_size`` ``None`` for per-channel, ``row_parallel`` whether K is split
    (else N is). Raises :class:`TensorParallelError` naming the layer and the sizes that would work."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}; quantpack packs 4 or 8 bits")
    why = _problem(input_size, output_sizes, bits, group_size, row_parallel, tp)
    if why is not None:
        sizes = allowed_tp_sizes(input_size, output_sizes, bits, group_size, row_parallel)
        kind = "row-parallel" if row_parallel else "column-parallel"
        hint = "" if group_size is None else " (or re-convert with a smaller --group-size)"
        raise TensorParallelError(f"quantpack: layer {layer} ({kind}) cannot be split over tensor-parallel size {tp}: "
                                  f"{why}; this layer allows tensor-parallel sizes {', '.join(map(str, sizes))}"
                                  f"{hint}")
    k = input_size // tp if row_parallel else input_size
    n = sum(output_sizes) // (1 if row_parallel else tp)
    return Partition(in_features=k, out_features=n, group_size=group_size or k, meta_split_k=group_size is not None)

