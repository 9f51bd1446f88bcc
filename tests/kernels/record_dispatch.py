"""Record which kernel and config the fused matmul runs for a grid of calls on three GPUs, without a GPU.

Run from the repository root: ``python tests/kernels/record_dispatch.py`` writes tests/kernels/data/dispatch.json,
which tests/kernels/test_dispatch.py compares :func:`quantpack.kernels.dispatch.choose` against. The GPUs are
given as data (name, compute capability, SM count): the two with shipped tables (H100 SXM, H200) and an A100,
which has none. Every call is taken to have aligned, contiguous tensors and a working ``mma`` self-check, and to
run in steady state (the ``mma`` copy already built)."""
from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

import contextlib
from dataclasses import dataclass
from unittest import mock

from quantpack.format import packed_shapes
import importlib

mm = importlib.import_module("quantpack.kernels.mixed_mm")  # (the module; the package exports its function)
from quantpack.kernels.wgmma_mm import wgmma_usable
from quantpack.kernels.mma_gemv import mma_usable


@dataclass(frozen=True)
class DeviceProps:
    name: str
    capability: tuple
    sms: int


@dataclass(frozen=True)
class Flags:
    mma: bool = True
    wgmma: bool = True
    pdl: bool = False


@dataclass(frozen=True)
class Decision:
    config: mm.KernelConfig
    pdl: bool


def choose(props, m, n, k, bits, dtype, *, axis, group_size, transposed, flags):
    """What mixed_mm decides for such a call, from its own steps in its order, on a GPU faked as ``props``."""
    class Props:
        multi_processor_count = props.sms
    env = {"QUANTPACK_MMA": "1" if flags.mma else "0", "QUANTPACK_WGMMA": "1" if flags.wgmma else "0",
           "QUANTPACK_PDL": "1" if flags.pdl else "0", "TRITON_INTERPRET": "0"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_name", lambda index=None: props.name))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: Props()))
        stack.enter_context(mock.patch.object(mm, "_major", lambda index: props.capability[0]))
        stack.enter_context(mock.patch.object(mm, "_device_names", {}))
        stack.enter_context(mock.patch.object(mm, "_tables", {}))
        device = torch.device("cuda", 0)
        shapes = packed_shapes((n, k), bits, group_size, axis)
        x2 = torch.empty(m, n if transposed else k, dtype=dtype)
        qw = torch.empty(shapes["qweight"], dtype=torch.uint8)
        s, z = (torch.empty(shapes["scales"], dtype=torch.bfloat16) for _ in range(2))
        config = mm.pick_config(transposed, bits, m, n, k, device)
        config = mm._fix_config(config, transposed, m, axis, group_size)
        if config.path == "wgmma" and not (mm.wgmma_device(device)
                                           and wgmma_usable(x2, qw, s, z, n, k, group_size, bits, axis)):
            config = mm._without_wgmma(transposed, m, n, k, device, axis, group_size)
        pdl = False
        if config.path == "mma":
            if mm.mma_enabled() and mma_usable(x2, n, k, group_size, bits, axis):
                pdl = m <= mm.PDL_MAX_M and mm.pdl_enabled(device)
            else:
                config = mm._fix_config(mm.gemv_config(m, n, k, device), transposed, m, axis, group_size)
        return Decision(config, pdl)

OUT = Path(__file__).with_name("data") / "dispatch.json"

GPUS = {"h100": DeviceProps("NVIDIA H100 80GB HBM3", (9, 0), 132), "h200": DeviceProps("NVIDIA H200", (9, 0), 132),
        "a100": DeviceProps("NVIDIA A100-SXM4-80GB", (8, 0), 108)}
MS = (1, 2, 4, 8, 9, 16, 17, 32, 64, 65, 128, 256, 1024, 4096, 8192)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (1024, 8192), (2048, 2048))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ((1, 128), (1, 64), (0, 128))  # (axis, group_size)
FLAGS = {"default": Flags(), "mma0": Flags(mma=False), "wgmma0": Flags(wgmma=False), "pdl1": Flags(pdl=True)}


def cases():
    """(gpu, flags, M, N, K, bits, dtype, axis, group_size, transposed): every GPU, shape, bits and direction at
    bf16 with default flags and groups of 128 along K; the other dtypes, layouts and flags at a subset."""
    for gpu, (n, k), m, bits, tr in itertools.product(GPUS, SHAPES, MS, (4, 8), (False, True)):
        yield gpu, "default", m, n, k, bits, "bf16", 1, 128, tr
    for gpu, m, bits in itertools.product(GPUS, MS, (4, 8)):
        for dt in ("fp16", "fp32"):
            yield gpu, "default", m, 4096, 4096, bits, dt, 1, 128, False
        for axis, gs in LAYOUTS[1:]:
            yield gpu, "default", m, 4096, 4096, bits, "bf16", axis, gs, False
        for flags in list(FLAGS)[1:]:
            yield gpu, flags, m, 4096, 4096, bits, "bf16", 1, 128, False
            yield gpu, flags, m, 1024, 8192, bits, "bf16", 1, 128, False


def case_key(gpu, flags, m, n, k, bits, dt, axis, gs, tr) -> str:
    return f"{gpu}|{flags}|m{m}|n{n}|k{k}|b{bits}|{dt}|a{axis}|g{gs}|{'tr' if tr else 'fwd'}"


def decide(gpu, flags, m, n, k, bits, dt, axis, gs, tr) -> dict:
    d = choose(GPUS[gpu], m, n, k, bits, DTYPES[dt], axis=axis, group_size=gs, transposed=tr, flags=FLAGS[flags])
    default = asdict(mm.KernelConfig())
    config = {f: v for f, v in asdict(d.config).items() if f == "path" or v != default[f]}  # (short: the changes)
    return {"config": config, "pdl": d.pdl} if d.pdl else {"config": config}


def main() -> None:
    os.environ["QUANTPACK_CACHE_DIR"] = tempfile.mkdtemp()  # (no configs autotuned on this machine)
    golden = {case_key(*c): decide(*c) for c in cases()}
    OUT.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(golden.items())) + "\n}\n")
    print(f"{len(golden)} decisions -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
