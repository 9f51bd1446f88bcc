"""Writing the output shards: source tensors read ahead, quantized by the scheme or cast, one shard at a time."""
from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checkpoint import SHARD_METADATA, CheckpointError, SourceCheckpoint, dtype_name
from ..checkpoint.writer import write_safetensors
from ..schemes import SCHEMES
from .output import write_progress
from .summary import LayerResult


def write_shards(src, shards, names, partial, done, fingerprint, scheme, axis, method, dev, out_dtype, progress,
                 summary, rescale=None, precomputed=None, input_weights=None):
    """``rescale``: {source tensor: (row, column factors)} applied before quantizing or copying;
    ``precomputed``: {module: safetensors file holding its packed tensors} (calibrated layers), written as
    they are instead of quantizing; ``input_weights``: {module: per-input-feature weights (K,)}, those layers
    quantized with ``refit`` weighted by them (the others with ``method``)."""
    from tqdm.auto import tqdm

    todo_bytes = sum(src.info(u.source).nbytes for i, s in enumerate(shards) if names[i] not in done for u in s)
    bar = tqdm(total=todo_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    # Finished shards carry their layers' errors, so a resumed manifest equals an uninterrupted one.
    for name in names:
        for rec in done.get(name, {}).get("layers", []):
            layer = next(l for l in summary.layers if l.name == rec["name"])
            layer.rel_error = rec["rel_error"]
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qp-read")  # read the next tensor meanwhile
    timings = summary.timings
    for key in ("read_wait", "quantize", "write"):
        timings[key] = 0.0
    try:
        for i, shard in enumerate(shards):
            if names[i] in done:
                continue
            bar.set_postfix_str(f"shard {i + 1}/{len(shards)}")
            tensors, layers = {}, []
            pending = reader.submit(src.get, shard[0].source)
            for j, unit in enumerate(shard):
                t = time.perf_counter()
                tensor = pending.result()
                timings["read_wait"] += time.perf_counter() - t
                if j + 1 < len(shard):
                    pending = reader.submit(src.get, shard[j + 1].source)
                _check_finite(src, unit.source, tensor)
                if rescale and unit.source in rescale:
                    from ..quantization.sinq import scale_tensor

                    tensor = scale_tensor(tensor.float(), *rescale[unit.source])  # one rounding, at the end
                if unit.layer is None:
                    (out_name, (_, out_t)), = unit.outputs.items()
                    out = tensors[out_name] = tensor.to(out_t) if tensor.dtype != out_t else tensor
                    if out is not tensor and out.is_floating_point() and not bool(torch.isfinite(out).all()):
                        raise CheckpointError(f"source: tensor {unit.source}: values up to "
                                              f"{float(tensor.abs().max()):.3g} do not fit in {dtype_name(out_t)}; "
                                              f"pass --dtype bfloat16, or fix the checkpoint")
                else:
                    t = time.perf_counter()
                    layer = unit.layer
                    weight = tensor.t().contiguous() if layer.transposed else tensor  # stored as (out, in)
                    weights = input_weights.get(layer.name) if input_weights else None
                    if precomputed and layer.name in precomputed:
                        packed = _stored_layer(precomputed[layer.name], weight, layer, dev)
                    elif _usable(weights):
                        packed = _quantize_layer(SCHEMES[scheme], weight, layer, axis, "refit", dev, out_dtype,
                                                 weights.to(dev))
                    else:
                        packed = _quantize_layer(SCHEMES[scheme], weight, layer, axis, method, dev, out_dtype)
                    if not math.isfinite(layer.rel_error) or not all(bool(torch.isfinite(v).all()) for v in
                                                                    packed.values() if v.is_floating_point()):
                        raise CheckpointError(f"source: tensor {unit.source}: values up to "
                                              f"{float(tensor.abs().max()):.3g} overflow the {dtype_name(out_dtype)} "
                                              f"scales when quantized; pass --dtype bfloat16, --skip the layer, or "
                                              f"fix the checkpoint")
                    tensors.update(packed)
                    layers.append({"name": layer.name, "rel_error": layer.rel_error})
                    timings["quantize"] += time.perf_counter() - t
                bar.update(src.info(unit.source).nbytes)
                del tensor
            t = time.perf_counter()
            digests: dict[str, str] = {}
            sha, size = write_safetensors(partial / names[i], tensors, SHARD_METADATA, digests=digests)
            timings["write"] += time.perf_counter() - t
            del tensors
            done[names[i]] = {"sha256": sha, "size": size, "tensors": dict(sorted(digests.items())), "layers": layers}
            write_progress(partial, fingerprint, done, summary.settings)
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        bar.close()
    for entry in done.values():
        entry.pop("layers", None)


def _check_finite(src: SourceCheckpoint, name: str, tensor: torch.Tensor) -> None:
    """A NaN or infinity in a source tensor would be copied or quantized into garbage: refuse it, by name."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"source: tensor {name} in {src.info(name).file.name}: {bad} of {tensor.numel()} "
                              f"values are NaN or infinite; the checkpoint is damaged: download it again")


def _rel_error(deq: torch.Tensor, w: torch.Tensor) -> float:
    """``||deq - w|| / ||w||`` in float32, both scaled by a power of two near ``max |w|`` first: exact the
    same for ordinary weights, and finite for huge ones (3e38) whose squares overflow float32."""
    scale = torch.exp2(torch.floor(torch.log2(w.abs().amax().clamp_min(1e-30))))
    err = torch.linalg.vector_norm((deq - w) / scale) / torch.linalg.vector_norm(w / scale).clamp_min(1e-30)
    return float(f"{float(err):.6g}")


@torch.no_grad()
def _stored_layer(file, weight, layer: LayerResult, dev) -> dict[str, torch.Tensor]:
    """A layer quantized ahead (weight-only layout, groups along in-features), read back from ``file``, with
    its error against the source weight."""
    from safetensors import safe_open

    from ..format import PackedWeight
    from ..reference import dequantize

    names = {suffix: f"{layer.name}.{suffix}" for suffix in ("qweight", "scales", "zeros")}
    with safe_open(file, framework="pt") as f:
        packed = {name: f.get_tensor(name) for name in names.values()}
    pw = PackedWeight(packed[names["qweight"]], packed[names["scales"]], packed[names["zeros"]], bits=layer.bits,
                      group_size=layer.group_size, axis=1, shape=tuple(layer.shape))
    pw.validate()
    layer.rel_error = _rel_error(dequantize(pw.to(dev), torch.float32), weight.to(dev).float())
    return packed


@torch.no_grad()
def _quantize_layer(scheme, weight, layer: LayerResult, axis, method, dev, out_dtype,
                    input_weights=None) -> dict[str, torch.Tensor]:
    w = weight.to(dev, non_blocking=False)
    stored, deq = scheme.quantize(w, bits=layer.bits, group_size=layer.group_size, axis=axis, method=method,
                                  dtype=out_dtype, input_weights=input_weights)
    layer.rel_error = _rel_error(deq, w.float())
    return {f"{layer.name}.{suffix}": t.cpu() for suffix, t in stored.items()}


def _usable(v: torch.Tensor | None) -> bool:
    """Input weights that can weigh a refit: finite, and not all zero (a layer whose inputs were never active
    keeps the plain method)."""
    return v is not None and bool(torch.isfinite(v).all()) and float(v.sum()) > 0

