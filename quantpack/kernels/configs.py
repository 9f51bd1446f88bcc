"""Kernel configurations: the :class:`KernelConfig` type, the tuned tables shipped per GPU (``configs/<gpu>.json``)
and the ones autotuned on this machine, their keys, and the nearest tuned entry for a shape a table lacks."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .dequant import interpreting

PATHS = ("gemv", "mma", "wgmma", "fma", "dot", "dot_t", "dq", "w4a8")


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration. ``block_r`` counts pair rows (2 in-features each) per K step
    (forward) or per output tile (transposed); ``split`` splits the reduction over programs. The
    ``mma`` path reads ``block_m`` as the rows of x per program (16 or less: one 16-row block; 32: two
    blocks sharing each unpacked weight fragment) and ``block_n`` as the rows of N per warp
    (:func:`mma_tiles_per_warp`). The ``wgmma`` path (Hopper) reads ``block_m`` as the rows of x per
    program (16-256), ``block_n`` as the weight rows per program (64 or 128: 4 warps per 64),
    ``block_r`` as the pair rows per K step (32 or 64) and ``num_stages`` as its TMA ring depth."""

    path: str = "dot"
    block_m: int = 16
    block_n: int = 64
    block_r: int = 32
    split: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 2  # pipeline stages (dot paths); chunks of loads in flight per warp (mma: 1-2, 0: all)
    rawq: bool = False  # dot/wgmma paths, groups along K: MMA on raw q, rescale per tile (wgmma: 4-bit, per K step)
    words: bool = False  # gemv path, N % 4 == 0: read int32 words of 4 columns (no byte extraction)
    producer: bool = False  # wgmma path: a producer warp issues the TMA copies (warp-specialized)
    k_warps: int = 1  # mma path: warps of a program splitting its K range (summed in shared memory), x num_warps
    swap: bool = False  # w4a8 path: out^T = W xq^T (the codes as the MMA's A operand, xq's tile as B)
    pair: bool = False  # w4a8 path: two groups' MMAs in flight before the first is folded (a K step per group)
    wgmma: bool = False  # w4a8 path: the Gluon warpgroup-MMA kernel (w4a8_wgmma.py; Hopper), ``producer`` its TMA warp

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}; use one of {PATHS}")


CONFIG_DIR = Path(__file__).with_name("configs")
_tables: dict[str, dict] = {}


def m_bucket(m: int) -> int:
    """Autotune/config key for M: the next power of two, capped at 4096."""
    return min(4096, 1 << max(0, (m - 1).bit_length()))


_device_names: dict = {}


def device_key(device: torch.device | None = None) -> str:
    """Config-file stem for a device: its name in lower case, non-alphanumerics as '_'
    (``nvidia_h200``, ``nvidia_h100_80gb_hbm3``); ``interpreter`` for CPU under TRITON_INTERPRET."""
    if interpreting() and (device is None or device.type == "cpu"):
        return "interpreter"
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    key = _device_names.get(index)
    if key is None:
        key = _device_names[index] = normalized_name(torch.cuda.get_device_name(index))
    return key


def normalized_name(name: str) -> str:
    """A GPU's name as a config-file stem: lower case, non-alphanumerics as '_'."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


def config_key(transposed: bool, bits: int, n: int, k: int, m: int) -> str:
    return f"{'tr' if transposed else 'fwd'}|b{bits}|n{n}|k{k}|m{m_bucket(m)}"


def capability(dev_key: str) -> list | None:
    """The compute capability of this machine's GPU of config-file stem ``dev_key``; ``None`` if none is."""
    if dev_key == "interpreter" or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if device_key(torch.device("cuda", index)) == dev_key:
            return list(torch.cuda.get_device_capability(index))
    return None


def cache_root() -> Path:
    """quantpack's cache directory: ``$QUANTPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantpack``, else
    ``~/.cache/quantpack``."""
    return Path(os.environ.get("QUANTPACK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "quantpack"))


def tuned_cache_path(dev_key: str) -> Path:
    """Where configs autotuned on this machine (``QUANTPACK_AUTOTUNE=1``) are kept between runs:
    ``configs/<gpu>.json`` under :func:`cache_root`."""
    return cache_root() / "configs" / f"{dev_key}.json"


def read_configs(path: Path) -> dict:
    try:
        return {k: KernelConfig(**v) for k, v in json.loads(path.read_text())["configs"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # a missing or unreadable cache only means tuning again


def config_table(dev_key: str, cap: tuple | list | None = None) -> dict:
    """Config table of a device: its shipped file, else a shipped file tuned on a GPU of the same
    compute capability (e.g. an H100 PCIe or an H800 takes an H100 or H200 table: same architecture), the one
    whose name shares the longest prefix with this device's, else empty; then the configs autotuned earlier on
    this machine (:func:`tuned_cache_path`) on top. Autotuned entries are added to it in memory (and to that
    cache). ``cap``: the device's compute capability where known (else looked up among this machine's GPUs)."""
    table = _tables.get(dev_key)
    if table is None:
        path = CONFIG_DIR / f"{dev_key}.json"
        if not path.is_file():
            cap = list(cap) if cap is not None else capability(dev_key)
            same_arch = [p for p in sorted(CONFIG_DIR.glob("*.json"))
                         if cap is not None and json.loads(p.read_text()).get("capability") == cap]
            if same_arch:  # (max keeps the first of equals: ties go to the sorted order)
                path = max(same_arch, key=lambda p: len(os.path.commonprefix([p.stem, dev_key])))
        table = {}
        if path.is_file():
            table = {k: KernelConfig(**v) for k, v in json.loads(path.read_text())["configs"].items()}
        if dev_key != "interpreter":
            table.update(read_configs(tuned_cache_path(dev_key)))
        _tables[dev_key] = table
    return table


table_changes = 0  # configs added by :func:`remember` since import (part of a launch plan's key)


def remember(dev_key: str, key: str, cfg: KernelConfig) -> None:
    """Add an autotuned config to the in-memory table and to this machine's cache file (merged with
    what other processes wrote, replaced atomically; a cache that cannot be written is skipped)."""
    global table_changes
    config_table(dev_key)[key] = cfg
    table_changes += 1
    if dev_key == "interpreter":
        return
    path = tuned_cache_path(dev_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        configs = {k: asdict(v) for k, v in read_configs(path).items()}
        configs[key] = asdict(cfg)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"device": dev_key, "configs": dict(sorted(configs.items()))}, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass


def nearest(table: dict, transposed: bool, bits: int, n: int, k: int, m: int) -> KernelConfig | None:
    """The tuned config closest in (M bucket, N, K) (log distance, M weighted most) with the same
    direction and bits and an M bucket at most 4x away (a decode config says nothing about a batch of 4096,
    where the heuristic knows more); ``None`` if the table has none."""
    want = config_key(transposed, bits, n, k, m).split("|")
    best, best_d = None, math.inf
    for key, cfg in table.items():
        parts = key.split("|")
        dm = abs(math.log2(int(parts[4][1:]) / m_bucket(m)))
        if parts[0] != want[0] or parts[1] != want[1] or dm > 2:
            continue
        d = 4 * dm + abs(math.log2(int(parts[2][1:]) / n)) + abs(math.log2(int(parts[3][1:]) / k))
        if d < best_d:
            best, best_d = cfg, d
    return best


def table_state() -> tuple:
    """Which config tables are loaded and how many configs were autotuned into them since: a key that holds it
    is not reused after a table changes."""
    return id(_tables), table_changes


def save_table(path: str | os.PathLike, device: torch.device | None = None) -> None:
    """Write this process's config table (shipped plus autotuned) as JSON, atomically."""
    dev_key = device_key(device)
    data = {"device": dev_key, "capability": capability(dev_key),
            "configs": {k: asdict(v) for k, v in sorted(config_table(dev_key).items())}}
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
