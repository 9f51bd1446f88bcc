"""Tuning a packed model's kernel configs on this GPU ahead of use (``quantpack tune``).

The shipped config tables cover the GPUs and layer shapes they were tuned on (docs/kernels.md). Any other key (a
layer shape at an M bucket) takes the nearest tuned config untimed, or, with ``QUANTPACK_AUTOTUNE=1``, is timed on
its first call: seconds per key in the middle of a model's first requests. :func:`tune` does that first use ahead
of time. It loads the model on the GPU and runs every quantized layer once at each batch size with autotuning on,
in the model's own order, so that q/k/v and gate/up run as merged calls where they will at decode. Each key the
table lacks is then timed once, single weights and merged stacks alike, and kept in this machine's config cache,
which every later process reads on top of the shipped table.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

DEFAULT_BATCH_SIZES = (1, 16, 64, 256, 1024)


@dataclass
class TuneReport:
    """What :func:`tune` did: the device and the cache it wrote, the layers it ran, and the config keys
    (``direction|bits|N|K|M bucket``) it timed, with the path each picked; keys already tuned are not timed again."""

    source: str
    device: str
    cache: str
    batch_sizes: tuple
    layers: int
    tuned: dict  # config key -> the picked config's path ("mma", "wgmma", ...)

    def to_json(self) -> str:
        from .checkpoint import finite_or_none

        return json.dumps(finite_or_none(asdict(self)), indent=1, allow_nan=False)

    def format_table(self) -> str:
        lines = [f"{len(self.tuned)} config keys tuned on {self.device} ({self.layers} quantized layers, batch sizes "
                 f"{', '.join(map(str, self.batch_sizes))})"]
        lines += [f"  {key:<32} {path}" for key, path in sorted(self.tuned.items())]
        if not self.tuned:
            lines.append("  every key was already tuned (shipped table or this machine's cache)")
        lines.append(f"cache: {self.cache}")
        return "\n".join(lines)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"1,16,256"`` -> ``(1, 16, 256)``; a ValueError naming the problem otherwise."""
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    return _checked_batch_sizes(sizes, text)


def _checked_batch_sizes(sizes: tuple, given) -> tuple[int, ...]:
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes {given!r}: give positive integers separated by commas, e.g. 1,16,256")
    return sizes


def tune(source, *, batch_sizes=DEFAULT_BATCH_SIZES, device="cuda", backward: bool = False,
         revision: str | None = None, token: str | None = None, progress: bool = True) -> TuneReport:
    """Time the fused kernels' configs for every quantized layer of the packed checkpoint ``source`` (a directory
    or a hub repository id) at each of ``batch_sizes`` (rows of x per call: tokens in a prefill, sequences in a
    decode step; each stands for its power-of-two bucket) on the GPU ``device``, and keep them in this machine's
    config cache. With ``backward``, also the transposed product the backward pass runs at those sizes (training
    adapters on the frozen quantized base: each layer runs forward and backward once more, with gradients on, as a
    training step does, unmerged). Keys the shipped table or the cache already has are not timed again.
    ``QuantLinear`` layers only (4- and 8-bit weights; not W8A8 layers or fused mixture-of-experts tensors). Raises
    ValueError (one line) when there is no GPU to time on or the checkpoint cannot be loaded."""
    from .loader import load
    from .modules.linear import QuantLinear

    from .kernels import configs
    from .kernels.dequant import interpreting
    sizes = _checked_batch_sizes(tuple(int(m) for m in batch_sizes), batch_sizes)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r}: give a CUDA device, e.g. cuda or cuda:1") from None
    # (the CPU only under Triton's interpreter, where the tests run the kernels; nothing there is worth timing)
    if not ((dev.type == "cuda" and torch.cuda.is_available()) or (dev.type == "cpu" and interpreting())):
        raise ValueError("quantpack tune times the kernels on a CUDA GPU, and there is none here: run it on the "
                         "machine (and GPU model) that will serve the model")
    model = load(source, device=dev, revision=revision, token=token)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise ValueError(f"{source}: no quantized layers to tune (is it a quantpack checkpoint?)")
    dev_key = configs.device_key(dev)
    table = configs.config_table(dev_key)
    before = set(table)

    previous = os.environ.get("QUANTPACK_AUTOTUNE")
    os.environ["QUANTPACK_AUTOTUNE"] = "1"
    try:
        passes = (False, True) if backward else (False,)
        with tqdm(total=len(passes) * len(sizes) * len(layers), desc="tuning", unit="layer",
                  disable=not progress) as bar:
            for training in passes:
                for m in sizes:
                    inputs = {}  # (one x per width and dtype: siblings must see the very same tensor to merge)
                    for layer in layers:
                        key = (layer.in_features, layer.scales.dtype)
                        if key not in inputs:
                            inputs[key] = torch.randn(m, layer.in_features, dtype=layer.scales.dtype, device=dev)
                        x = inputs[key]
                        if training:
                            x = x.detach().requires_grad_()
                            with torch.enable_grad():
                                out = layer(x)
                            out.backward(torch.randn_like(out))
                        else:
                            with torch.no_grad():
                                layer(x)
                        bar.update()
                    del inputs
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        if previous is None:
            os.environ.pop("QUANTPACK_AUTOTUNE", None)
        else:
            os.environ["QUANTPACK_AUTOTUNE"] = previous
    tuned = {key: table[key].path for key in sorted(set(table) - before)}
    return TuneReport(str(source), torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
                      str(configs.tuned_cache_path(dev_key)), sizes, len(layers), tuned)
