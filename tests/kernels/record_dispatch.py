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

from quantpack.kernels.configs import KernelConfig
from quantpack.kernels.dispatch import DeviceProps, Flags, choose

OUT = Path(__file__).with_name("data") / "dispatch.json"

GPUS = {"h100": DeviceProps("NVIDIA H100 80GB HBM3", (9, 0), 132), "h200": DeviceProps("NVIDIA H200", (9, 0), 132),
        "a100": DeviceProps("NVIDIA A100-SXM4-80GB", (8, 0), 108)}
MS = (1, 2, 4, 8, 9, 16, 17, 32, 64, 65, 128, 256, 1024, 4096, 8192)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (1024, 8192), (2048, 2048))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ((1, 128), (1, 64), (0, 128))  # (axis, group_size)
FLAGS = {"default": Flags(), "mma0": Flags(mma=False), "wgmma0": Flags(wgmma=False), "pdl1": Flags(pdl=True),
         "w4a8_1": Flags(w4a8="on"), "w4a8_force": Flags(w4a8="force")}


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
    default = asdict(KernelConfig())
    config = {f: v for f, v in asdict(d.config).items() if f == "path" or v != default[f]}  # (short: the changes)
    return {"config": config, "pdl": d.pdl} if d.pdl else {"config": config}


def main() -> None:
    os.environ["QUANTPACK_CACHE_DIR"] = tempfile.mkdtemp()  # (no configs autotuned on this machine)
    golden = {case_key(*c): decide(*c) for c in cases()}
    OUT.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(golden.items())) + "\n}\n")
    print(f"{len(golden)} decisions -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
