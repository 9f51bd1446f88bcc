"""What a conversion did: :class:`ConvertSummary` (and its text form) and :class:`LayerResult` per linear module."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..sizes import format_size


@dataclass
class LayerResult:
    """One linear module: quantized (with its reconstruction error) or skipped (with the reason)."""

    name: str
    shape: tuple[int, int]  # (out_features, in_features), as quantized and stored
    bits: int | None = None
    group_size: int | None = None
    rel_error: float | None = None
    skipped: str | None = None  # the reason, when not quantized
    transposed: bool = False  # the source stores the weight (in, out) (GPT-2's Conv1D)
    source: str | None = None  # the checkpoint's module name, where it differs (e.g. one expert's matrix)


@dataclass
class ConvertSummary:
    source: str
    revision: str | None
    output: str
    dry_run: bool
    settings: dict
    layers: list[LayerResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    num_tensors: int = 0
    num_shards: int = 0
    resumed_shards: int = 0
    source_bytes: int = 0  # tensor data of the source weights
    output_bytes: int = 0  # size of the output shards (exact, also for a dry run)
    disk_free: int | None = None
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)  # seconds per phase: plan, generate (calibration self), calibrate (gptq), read_wait, quantize, write, finish

    @property
    def quantized(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.skipped is None]

    @property
    def skipped(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.skipped is not None]

    @property
    def ratio(self) -> float:
        return self.source_bytes / self.output_bytes if self.output_bytes else float("nan")

    @property
    def mean_error(self) -> float | None:
        errs = [layer.rel_error for layer in self.quantized if layer.rel_error is not None]
        return sum(errs) / len(errs) if errs else None

    @property
    def worst(self) -> LayerResult | None:
        done = [layer for layer in self.quantized if layer.rel_error is not None]
        return max(done, key=lambda layer: layer.rel_error) if done else None

    @property
    def throughput(self) -> float | None:
        """Source bytes converted per second (None for a dry run)."""
        return self.source_bytes / self.seconds if self.seconds and not self.dry_run else None

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "source": self.source, "revision": self.revision, "output": self.output, "dry_run": self.dry_run,
            "settings": self.settings, "num_tensors": self.num_tensors, "num_shards": self.num_shards,
            "resumed_shards": self.resumed_shards,
            "layers_quantized": len(self.quantized), "layers_skipped": len(self.skipped),
            "source_bytes": self.source_bytes, "output_bytes": self.output_bytes,
            "compression_ratio": round(self.ratio, 4) if self.output_bytes else None,
            "mean_rel_error": self.mean_error, "worst_rel_error": worst.rel_error if worst else None,
            "worst_layer": worst.name if worst else None, "seconds": round(self.seconds, 3),
            "throughput_bytes_per_s": round(self.throughput) if self.throughput else None,
            "disk_free": self.disk_free, "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "warnings": self.warnings,
            "layers": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(layer).items()}
                       for layer in self.layers],
        }

    def format_plan(self) -> str:
        """One line per linear module: what a conversion does with it (``--dry-run`` prints this)."""
        width = max((len(layer.name) for layer in self.layers), default=0)
        lines = []
        for layer in self.layers:
            shape = f"{layer.shape[0]}x{layer.shape[1]}"
            if layer.skipped is None and self.settings.get("scheme") == "w8a8":
                lines.append(f"quantize  {layer.name:<{width}}  {shape:>11}  w8a8: int8 per output channel")
            elif layer.skipped is None:
                lines.append(f"quantize  {layer.name:<{width}}  {shape:>11}  {layer.bits}-bit, group {layer.group_size}")
            else:
                lines.append(f"keep      {layer.name:<{width}}  {shape:>11}  {layer.skipped}")
        lines.append(f"{self.num_tensors} output tensors in {self.num_shards} shard(s); other tensors are copied "
                     f"as {self.settings['dtype']}")
        return "\n".join(lines)

    def format_table(self) -> str:
        """The human summary printed at the end of ``quantpack convert`` (``warnings`` are apart: the
        command prints them on stderr)."""
        size = format_size

        rows = [("source", self.source + (f" @ {self.revision[:12]}" if self.revision else "")),
                ("output", self.output + ("  (dry run: nothing written)" if self.dry_run else "")),
                ("settings", ", ".join([f"{k}={v}" for k, v in self.settings.items() if k in
                                        ("scheme", "bits", "group_size", "axis", "method", "dtype", "device")]
                                       + [f"bits_for {p}={b}" for p, b in self.settings.get("bits_for", {}).items()]
                                       + ["quantize_lm_head=True"] * bool(self.settings.get("quantize_lm_head")))),
                ("layers quantized", str(len(self.quantized)))]
        reasons: dict[str, int] = {}
        for layer in self.skipped:
            reasons[layer.skipped] = reasons.get(layer.skipped, 0) + 1
        rows.append(("layers skipped", str(len(self.skipped))))
        for reason, count in sorted(reasons.items()):
            rows.append(("", f"{count} x {reason}"))
        rows += [("size before", size(self.source_bytes)),
                 ("size after", size(self.output_bytes) + (" (estimated)" if self.dry_run else "")),
                 ("compression", f"{self.ratio:.2f}x" if self.output_bytes else "-"),
                 ("shards", f"{self.num_shards}" + (f" ({self.resumed_shards} resumed)" if self.resumed_shards else ""))]
        if self.disk_free is not None:
            rows.append(("disk free", size(self.disk_free)))
        if self.mean_error is not None:
            worst = self.worst
            rows += [("mean layer error", f"{self.mean_error:.4f}"),
                     ("worst layer error", f"{worst.rel_error:.4f} ({worst.name})")]
        if not self.dry_run:
            rows.append(("time", f"{self.seconds:.1f} s"))
            if self.throughput:
                rows.append(("throughput", f"{size(self.throughput)}/s of source weights"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
