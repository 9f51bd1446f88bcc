"""The arguments of :func:`~quantpack.convert.convert`: defaults, the scheme and its settings, patterns, dtype and
device."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..quantization.calibration import CalibrationText, SelfCalibration, read_calibration
from ..checkpoint import W8A8_CONFIG, SourceCheckpoint, weight_only_scheme
from ..sizes import parse_size
from ..format import SUPPORTED_AXES, SUPPORTED_BITS, check_group_size
from ..quantization.groupwise import METHODS
from ..schemes import SCHEMES

DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 128
DEFAULT_METHOD = "hqq"
OUTPUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# sinq: hqq's solver after Sinkhorn column scales moved into the norms and producing rows (quantpack.quantization.sinq)
# gptq: error-compensating rounding on hqq's group parameters, calibrated on text (quantpack.quantization.gptq)
CONVERT_METHODS = (*METHODS, "sinq", "gptq")


def parse_bits_for(bits_for) -> list[tuple[re.Pattern, int]]:
    items = bits_for.items() if isinstance(bits_for, dict) else bits_for
    out = []
    for item in items:
        if isinstance(item, str):
            pattern, sep, bits = item.rpartition("=")
            if not sep or not pattern:
                raise ValueError(f"bits_for={item!r}: expected REGEX=BITS, e.g. 'down_proj=8'")
        else:
            pattern, bits = item
        try:
            bits = int(bits)
        except ValueError:
            raise ValueError(f"bits_for={item!r}: bits must be 4 or 8") from None
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits_for={item!r}: bits must be 4 or 8")
        out.append((compile_pattern(pattern, "bits_for"), bits))
    return out


def compile_pattern(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what}={pattern!r} is not a valid regular expression ({e})") from None


def resolve_dtype(dtype, src: SourceCheckpoint, linear_names) -> torch.dtype:
    if dtype in (None, "auto"):
        for name in linear_names:
            d = src.info(name + ".weight").dtype
            if d in (torch.float16, torch.bfloat16):
                return d
        return torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in OUTPUT_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use bfloat16 or float16")
        return OUTPUT_DTYPES[dtype]
    if dtype not in OUTPUT_DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; use torch.bfloat16 or torch.float16")
    return dtype


def resolve_device(device: str) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"device={device!r} is not supported; use auto, cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(device)


def default_output_name(model_name: str, bits: int, group_size: int | None, scheme: str | None = None) -> str:
    if scheme == "w8a8":
        return f"{model_name}-qpw8a8"
    return f"{model_name}-qp{bits}" + (f"g{group_size}" if group_size else "pc")


def resolve_scheme(scheme: str | None, bits: int | None, group_size, axis: int, method: str | None,
                   bits_for) -> tuple[str, int, int | None, int, str]:
    """``(scheme, bits, group_size, axis, method)`` from :func:`convert`'s arguments.

    No scheme: ``w<bits>a16`` (bits default 4). ``w4a16``/``w8a16`` must agree with ``bits``. ``w8a8``
    fixes the weight quantization (8-bit, symmetric, one scale per output channel), so the
    weight-only arguments must be left at their defaults or name exactly that: ``bits`` None or 8,
    ``group_size`` the default 128 or None, ``axis`` 1, ``method`` None or ``"absmax"``, no ``bits_for``.
    """
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not supported; use one of {', '.join(SCHEMES)}")
    if scheme == "w8a8":
        if bits not in (None, 8):
            raise ValueError(f"bits={bits!r} does not apply to scheme='w8a8' (always int8); leave bits out")
        if group_size not in (DEFAULT_GROUP_SIZE, None):
            raise ValueError(f"group_size={group_size!r} does not apply to scheme='w8a8' (one scale per output "
                             f"channel); leave group_size out")
        if axis != 1:
            raise ValueError(f"axis={axis!r} does not apply to scheme='w8a8' (one scale per output channel); "
                             f"leave axis out")
        if method not in (None, W8A8_CONFIG["method"]):
            raise ValueError(f"method={method!r} does not apply to scheme='w8a8' (symmetric absmax rounding); "
                             f"leave method out")
        if bits_for:
            raise ValueError("bits_for does not apply to scheme='w8a8' (every quantized layer is int8); use skip "
                             "to leave layers unquantized")
        return scheme, W8A8_CONFIG["bits"], W8A8_CONFIG["group_size"], W8A8_CONFIG["axis"], W8A8_CONFIG["method"]
    if bits is None:
        bits = int(scheme[1]) if scheme is not None else DEFAULT_BITS
    if scheme is not None and scheme != weight_only_scheme(bits):
        raise ValueError(f"scheme={scheme!r} and bits={bits!r} disagree; pass one of them")
    return weight_only_scheme(bits), bits, group_size, axis, method or DEFAULT_METHOD


@dataclass(frozen=True)
class Arguments:
    """:func:`~quantpack.convert.convert`'s settings, checked and resolved."""

    scheme: str
    bits: int
    group_size: int | None
    axis: int
    method: str
    skip: tuple
    skip_patterns: list
    bits_rules: list
    shard_limit: int
    device: torch.device
    calibration: CalibrationText | SelfCalibration | None = None
    method_given: bool = True  # False where calibration implied it (an encoder then gets refit, not gptq)


def check_arguments(*, bits, group_size, axis, method, scheme, device, skip, bits_for, max_shard_size,
                    calibration=None) -> Arguments:
    """Check and resolve the conversion settings, cheapest checks first; a ValueError with a one-line message.

    ``calibration`` (a text file's path, ``"builtin"`` or ``"self"``) implies ``method="gptq"``, which needs it
    (``"self"`` on a model that is not a causal LM: ``refit``, decided once the model is known)."""
    method_given = method is not None
    if calibration is not None:
        if scheme == "w8a8":
            raise ValueError("calibration does not apply to scheme='w8a8' (symmetric absmax rounding); drop "
                             "--calibration, or use a weight-only scheme")
        if method not in (None, "gptq"):
            raise ValueError(f"calibration is used by method 'gptq' only, not method={method!r}; pass --method gptq "
                             f"(or leave --method out), or drop --calibration")
        method = "gptq"
    elif method == "gptq":
        raise ValueError("method='gptq' needs calibration text: pass --calibration FILE (UTF-8 text like the "
                         "model's data), --calibration self (text the model writes itself), or --calibration builtin "
                         "for a quick try")
    scheme, bits, group_size, axis, method = resolve_scheme(scheme, bits, group_size, axis, method, bits_for)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use 4 or 8")
    if axis not in SUPPORTED_AXES:
        raise ValueError(f"axis={axis!r} is not supported; use 1 (groups along in-features) or 0")
    if method not in CONVERT_METHODS and scheme != "w8a8":
        raise ValueError(f"method={method!r} is not supported; use one of {', '.join(CONVERT_METHODS)}")
    if method == "sinq" and axis != 1:
        raise ValueError("method='sinq' balances input features, for groups along them; use axis=1")
    if method == "gptq" and axis != 1:
        raise ValueError("method='gptq' rounds along input features, with groups along them; use axis=1")
    if group_size is not None:
        check_group_size(group_size)
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    return Arguments(scheme, bits, group_size, axis, method, skip, [compile_pattern(p, "skip") for p in skip],
                     parse_bits_for((bits_for,) if isinstance(bits_for, str) else bits_for), parse_size(max_shard_size),
                     resolve_device(device), None if calibration is None else read_calibration(calibration),
                     method_given)
