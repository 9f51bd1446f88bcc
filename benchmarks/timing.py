"""The benchmark harness shared by the scripts: timing (medians of ``triton.testing.do_bench`` over CUDA-graph
replays, one call per weight replica, BENCHMARKS.md "Method") and the results writer (JSON lines under
``benchmarks/results/``, drawn by ``benchmarks/plot.py``)."""
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` by ``do_bench`` (``warmup`` and ``rep`` are in milliseconds)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_time(calls, warmup: int = 25, rep: int = 100, eager_fallback: bool = True) -> tuple[float, str]:
    """Median ms per call over CUDA-graph replays of ``calls`` (zero-argument callables, typically
    one per weight replica so the weights stream from memory), and ``"graph"``; where capture
    fails and ``eager_fallback`` is set, the eager time and ``"eager"``."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for c in calls:
                c()
        torch.cuda.synchronize()
        return median_ms(g.replay, warmup, rep) / len(calls), "graph"
    except Exception:
        if not eager_fallback:
            raise
        torch.cuda.synchronize()
        return median_ms(lambda: [c() for c in calls], warmup, rep) / len(calls), "eager"


def host_us(fn, reps: int = 300, rounds: int = 1, warmup: int = 20) -> float:
    """Microseconds per call of ``fn`` issued back to back with one synchronize at the end (its host time, unless the
    GPU is the slower of the two), the median of ``rounds`` rounds of ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / reps * 1e6)
    return sorted(times)[len(times) // 2]


def provenance() -> dict:
    """``device``, ``commit`` (short hash, ``+dirty`` when tracked files differ from it; ``None`` outside a git
    checkout) and ``date`` (UTC) for every results line, so each number says where it came from."""
    root = Path(__file__).resolve().parent

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def record(kind: str, rows, directory=None) -> Path | None:
    """Append ``rows`` (dicts) to ``<directory>/<kind>.jsonl`` (default ``benchmarks/results/``), one JSON line each,
    with :func:`provenance` in front; ``directory=""`` records nothing. Returns the file written, if any."""
    rows = list(rows)
    if directory == "" or not rows:
        return None
    path = Path(directory or RESULTS_DIR) / f"{kind}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = provenance()
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({**head, **row}) + "\n")
    return path


def kernel_line(n: int, k: int, m: int, bits: int, group_size, dtype: str, impl: str, time_us, cublas_us=None,
                **extra) -> dict:
    """One measured cell of ``kernels.jsonl``: weight (N out, K in), M rows of x, the implementation's time and its
    ratio to cuBLAS timed in the same run (``None`` where either is missing)."""
    ok = bool(time_us) and time_us == time_us
    ratio = round(cublas_us / time_us, 3) if ok and cublas_us and cublas_us == cublas_us else None
    return {"shape": [n, k], "M": m, "bits": bits, "group_size": group_size, "dtype": dtype, "impl": impl,
            "time_us": round(time_us, 2) if ok else None, "ratio_to_cublas": ratio, **extra}
