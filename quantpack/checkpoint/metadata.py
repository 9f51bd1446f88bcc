"""A checkpoint's JSON files: ``config.json`` and its ``quantization_config``, the manifest ``quantpack.json``, and
the names of a checkpoint's files. Nothing here needs torch, so that what reads only these (``quantpack info``)
starts as fast as ``--help``; the package :mod:`quantpack.checkpoint` gives every name. docs/format.md is the spec.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..format import LAYOUT_VERSION, SUPPORTED_AXES, SUPPORTED_BITS

CONFIG_NAME = "config.json"
SAFE_INDEX_NAME = "model.safetensors.index.json"
SAFE_SINGLE_NAME = "model.safetensors"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"
MANIFEST_NAME = "quantpack.json"
QUANT_METHOD = "quantpack"
MANIFEST_VERSION = 1
WEIGHT_ONLY_SCHEMES = ("w4a16", "w8a16")
BUILT_IN_SCHEMES = (*WEIGHT_ONLY_SCHEMES, "w8a8")  # quantpack.schemes registers these (and any other scheme)
# What quantization_config says about the weights of a W8A8 checkpoint (docs/format.md, "W8A8"):
# symmetric int8 ("absmax": scale = max |W| / 127), one scale per output channel (group_size null, axis 1).
W8A8_CONFIG = {"bits": 8, "group_size": None, "axis": 1, "method": "absmax"}


class CheckpointError(ValueError):
    """A checkpoint (source or packed) that cannot be used; the message is one line saying what to do."""


class _NonFinite(str):
    """A NaN or infinity met while parsing JSON (which has neither)."""


def _non_finite_key(obj, where: str = "") -> str | None:
    """The key path of the first :class:`_NonFinite` in ``obj``, or None."""
    if isinstance(obj, _NonFinite):
        return where or "(top level)"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _non_finite_key(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if found:
            return found
    return None


def read_config(path) -> dict:
    """``config.json`` of the checkpoint directory ``path`` as a dict; a missing file, invalid JSON,
    a NaN or infinity anywhere (transformers writes them back as null, which it then cannot read) or
    anything but a JSON object is a one-line :class:`CheckpointError`."""
    f = Path(path) / CONFIG_NAME
    try:
        config = json.loads(f.read_text(encoding="utf-8"), parse_constant=_NonFinite)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; a checkpoint needs its model config") from None
    except IsADirectoryError:
        raise CheckpointError(f"{f}: is a directory, not the model config file; download it again") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{f}: not valid JSON; download it again") from None
    if not isinstance(config, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(config), "a number")
        raise CheckpointError(f"{f}: holds {kind}, not a JSON object of model settings; download it again")
    bad = _non_finite_key(config)
    if bad:
        raise CheckpointError(f"{f}: {bad.lstrip('.')} is not a finite number; set it to the model's real value "
                              f"or download the file again")
    return config


def finite_or_none(obj):
    """JSON has no NaN or infinity: such numbers become null (in dicts, lists and tuples, recursively)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# quantization_config


def weight_only_scheme(bits: int) -> str:
    """The scheme of a weight-only checkpoint with default ``bits``: ``w4a16`` or ``w8a16``."""
    return f"w{bits}a16"


def _check_w8a8_config(qc: dict) -> None:
    """W8A8 fixes the weight quantization: 8-bit, symmetric, one scale per output channel."""
    fixed = {"bits": W8A8_CONFIG["bits"], "group_size": W8A8_CONFIG["group_size"], "axis": W8A8_CONFIG["axis"],
             "method": W8A8_CONFIG["method"]}
    for key, want in fixed.items():
        if qc.get(key) != want:
            raise CheckpointError(f"config.json: quantization_config.{key}={qc.get(key)!r} but scheme 'w8a8' stores "
                                  f"{key}={json.dumps(want)}; the config is inconsistent: re-convert")
    if qc.get("bits_overrides"):
        raise CheckpointError("config.json: quantization_config.bits_overrides must be empty for scheme 'w8a8' "
                              "(every quantized layer is int8); re-convert")


def read_quantization_config(config: dict) -> dict:
    """Validate ``config["quantization_config"]`` of a packed checkpoint and return it with defaults
    filled in (``scheme``: ``w<bits>a16``). Raises :class:`CheckpointError` naming the bad field."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError("config.json: no quantization_config; this is not a quantpack checkpoint "
                              "(convert it with `quantpack convert`)")
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"config.json: quantization_config.quant_method is {qc.get('quant_method')!r}, "
                              f"not {QUANT_METHOD!r}; quantpack reads only its own checkpoints")
    version = qc.get("layout_version")
    if version != LAYOUT_VERSION:
        raise CheckpointError(f"config.json: quantization_config.layout_version={version!r}; this quantpack reads "
                              f"layout version {LAYOUT_VERSION}: upgrade quantpack or re-convert")
    if qc.get("bits") not in SUPPORTED_BITS:
        raise CheckpointError(f"config.json: quantization_config.bits={qc.get('bits')!r}; expected one of {SUPPORTED_BITS}")
    if qc.get("axis") not in SUPPORTED_AXES:
        raise CheckpointError(f"config.json: quantization_config.axis={qc.get('axis')!r}; expected 0 or 1")
    gs = qc.get("group_size")
    if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs < 1):
        raise CheckpointError(f"config.json: quantization_config.group_size={gs!r}; expected a positive integer or null")
    overrides = qc.get("bits_overrides") or {}
    if not isinstance(overrides, dict) or any(b not in SUPPORTED_BITS for b in overrides.values()):
        raise CheckpointError("config.json: quantization_config.bits_overrides must map module names to 4 or 8")
    scheme = qc.get("scheme", weight_only_scheme(qc["bits"]))
    if not isinstance(scheme, str) or not scheme:
        raise CheckpointError(f"config.json: quantization_config.scheme={scheme!r}; expected a scheme name such as "
                              f"'w4a16' or 'w8a8'")
    if scheme in WEIGHT_ONLY_SCHEMES and scheme != weight_only_scheme(qc["bits"]):
        raise CheckpointError(f"config.json: quantization_config.scheme={scheme!r} but bits={qc['bits']}; "
                              f"the config is inconsistent: re-convert")
    if scheme == "w8a8":
        _check_w8a8_config(qc)
    out = dict(qc)
    out["bits_overrides"] = dict(overrides)
    out["modules_not_converted"] = list(qc.get("modules_not_converted") or [])
    experts = qc.get("quantized_experts") or []
    if not isinstance(experts, list) or not all(isinstance(x, str) for x in experts):
        raise CheckpointError("config.json: quantization_config.quantized_experts must list module names")
    if experts and scheme not in WEIGHT_ONLY_SCHEMES:
        raise CheckpointError(f"config.json: quantization_config.quantized_experts with scheme={scheme!r}; experts "
                              f"are stored weight-only: re-convert")
    out["quantized_experts"] = list(experts)
    out["scheme"] = scheme
    return out


def read_manifest(path) -> dict:
    p = Path(path) / MANIFEST_NAME
    if not p.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_NAME}; not a complete quantpack output (re-run `quantpack convert`)")
    try:
        return json.loads(p.read_text())
    except ValueError:
        raise CheckpointError(f"{p}: not valid JSON") from None
