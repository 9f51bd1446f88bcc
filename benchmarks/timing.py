"""Timing helpers shared by the benchmark scripts (see DEVELOPERS' method: medians of
``triton.testing.do_bench`` over CUDA-graph replays, one call per weight replica)."""
import time

import torch


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
