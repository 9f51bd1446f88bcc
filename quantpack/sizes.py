"""Sizes for people: ``parse_size`` reads what ``--max-shard-size`` takes, ``format_size`` prints every size
quantpack reports (the convert summary, the model card, ``info``), in the same decimal units."""
from __future__ import annotations

import re


def parse_size(size) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912; ints pass through (bytes)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
        if not m:
            raise ValueError(f"max_shard_size={size!r} is not a size; use e.g. 5GB, 500MB or 2GiB")
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def format_size(n: float) -> str:
    """Bytes for people, in decimal units as parse_size reads them: 512 B, 354.51 KB, 5.81 GB (the one way
    quantpack prints a size: the convert summary, the model card and ``info``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
