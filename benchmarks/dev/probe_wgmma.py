"""Probe the Hopper wgmma path: correctness against a float32 reference, then a tile sweep timed like
bench_kernels (CUDA-graph replays over weight replicas past L2) beside cuBLAS and the shipped path.

    python benchmarks/dev/probe_wgmma.py --shapes 4096x4096,14336x4096 --ms 64,256,1024
    python benchmarks/dev/probe_wgmma.py --shapes 14336x4096 --ms 1024 --tiles 256x128x64 --splits 1 --unbalanced
    python benchmarks/dev/probe_wgmma.py --shapes 4096x4096 --ms 64 --trace   # the shipped pick's timeline

--trace: two consecutive calls in the middle of the timed graph record, per program, when it started, when its
first copies landed, when its accumulator was done, when its tile (or partial) was
stored and when a split tile's last program had summed it (the kernel's _stamp); printed as percentiles over
the programs in microseconds from the first program's start, and the gap between the two calls.
"""
import argparse
import itertools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]  # benchmarks/ (the harness), the repo

from bench_kernels import L2, graph_time, random_packed, ref_weight, replicas  # noqa: E402
import importlib  # noqa: E402
mm = importlib.import_module("quantpack.kernels.mixed_mm")  # the module, not the function of that name
launcher = importlib.import_module("quantpack.kernels.launcher")  # (what launches the kernels: patched to trace them)
from quantpack.kernels import wgmma_host as wg  # noqa: E402


def run_wg(x, qw, s, z, gs, g):
    """The wgmma launch of tile ``g`` through mixed_mm (its workspace and counters, as the shipped path)."""
    cfg = mm.KernelConfig("wgmma", g.block_m, g.block_n, g.block_k // 2, split=g.split, num_warps=g.warps,
                          num_stages=g.stages, producer=g.producer, rawq=g.rawq)
    return mm.mixed_mm(x, qw, s, z, group_size=gs, config=cfg)


def trace_calls(x, qps, gs, calls_traced=2):
    """Timelines of two consecutive calls in the middle of a CUDA graph of one call per weight replica:
    (calls_traced, programs, 16) int64 (see wgmma_mm._stamp), after a few replays."""
    real = launcher.launch_wgmma
    mid = len(qps) // 2
    bufs = []

    def traced(*a, **kw):  # the grid is known only at launch: size the buffer then
        bufs.append(wg.trace_buffer(kw["grid"], a[0].shape[0], kw["n"], "cuda"))
        return real(*a, trace=bufs[-1], **kw)

    graph = torch.cuda.CUDAGraph()
    for capture in (False, True):  # (the first pass compiles and sizes the workspaces outside the capture)
        ctx = torch.cuda.graph(graph) if capture else torch.cuda.device(x.device)
        bufs.clear()
        with ctx:
            for i, p in enumerate(qps):
                launcher.launch_wgmma = traced if mid <= i < mid + calls_traced else real
                mm.mixed_mm(x, *p, group_size=gs)
        launcher.launch_wgmma = real
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return [b.cpu() for b in bufs]


def print_trace(traces):
    """Percentiles of each event over a call's programs (us from the call's first start), and per-program
    phase durations from the SM cycle counters (converted with the run's own cycles-per-ns)."""
    import numpy as np
    ns, cyc, sm = (t.numpy().astype(np.float64) for t in wg.read_trace(traces[0]))
    t0 = ns[:, 0].min()
    ends = np.where(ns[:, 4] > 0, ns[:, 4], ns[:, 3])
    ghz = np.median((cyc[:, 3] - cyc[:, 0]) / np.maximum(ns[:, 3] - ns[:, 0], 1))
    pct = (0, 10, 50, 90, 100)
    sms = len(set(sm.tolist()))
    print(f"  trace: {len(ns)} programs on {sms} SMs, span {(ends.max() - t0) / 1e3:.2f} us (clock {ghz:.2f} GHz)",
          flush=True)
    for e, event in enumerate(wg.TRACE_EVENTS):
        col = ns[:, e]
        col = col[col > 0]
        if len(col):
            q = np.percentile((col - t0) / 1e3, pct)
            print(f"    {event:>13} at us (p{'/p'.join(map(str, pct))}): " + " ".join(f"{v:6.2f}" for v in q))
    for name, a, b in (("launch->copies", 0, 1), ("copies->acc", 1, 2), ("start->acc", 0, 2), ("acc->stored", 2, 3),
                       ("stored->summed", 3, 4)):
        ok = (cyc[:, a] > 0) & (cyc[:, b] > 0)
        if ok.any():
            q = np.percentile((cyc[ok, b] - cyc[ok, a]) / ghz / 1e3, pct)
            print(f"    {name:>15} us (p{'/p'.join(map(str, pct))}): " + " ".join(f"{v:6.2f}" for v in q))
    if len(traces) > 1:
        nxt = wg.read_trace(traces[1])[0].numpy().astype(np.float64)
        start = nxt[:, 0].min()
        print(f"    next call's first start - this call's last end: {(start - ends.max()) / 1e3:.2f} us; "
              f"next call's span {(np.maximum(nxt[:, 3], nxt[:, 4]).max() - start) / 1e3:.2f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="64,256,1024")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--gs", type=int, default=128)
    ap.add_argument("--no-sweep", action="store_true", help="time only cuBLAS and the shipped pick")
    ap.add_argument("--tiles", default="", help="sweep only these BLOCK_MxBLOCK_NxBLOCK_K tiles (comma-separated)")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--stages", default="3,4", help="TMA ring depths to sweep")
    ap.add_argument("--producer", default="0,1", help="without (0) and/or with (1) a TMA producer warp")
    ap.add_argument("--rawq", default="0", help="RAWQ tiles (1: raw weights, scales applied per K step) and/or dequantized ones (0)")
    ap.add_argument("--rounds", type=int, default=1, help="time everything this many times, keep each one's best")
    ap.add_argument("--top", type=int, default=6, help="print the fastest this many")
    ap.add_argument("--trace", action="store_true", help="only print the shipped pick's timeline (see above)")
    ap.add_argument("--unbalanced", action="store_true",
                    help="also time each unsplit tile without splitting a partial last wave (suffix 'ub')")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gs = args.gs
    t0 = time.time()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        qw, s, z = random_packed(n, k, 4, dtype, gs=gs)
        wref = ref_weight(qw, s, z, 4, gs=gs)
        wd = wref.to(dtype)
        r4 = replicas(qw.numel() + 4 * s.numel(), L2)
        qps = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(r4 - 1)]
        wds = [wd] + [wd.clone() for _ in range(replicas(2 * n * k, L2) - 1)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            ref = x.float() @ wref.t()
            cfg = mm.pick_config(False, 4, m, n, k, x.device)
            if args.trace:
                tb = graph_time([lambda w=w: F.linear(x, w) for w in wds])[0]
                tq = graph_time([lambda p=p: mm.mixed_mm(x, *p, group_size=gs) for p in qps])[0]
                print(f"\n== N={n} K={k} M={m} {args.dtype}: cuBLAS {tb*1e3:.1f} us; shipped {tq*1e3:.1f} us "
                      f"x{tb/tq:.2f} [{cfg.path}{'/P' if cfg.producer else ''} {cfg.block_m}x{cfg.block_n} "
                      f"bk{2 * cfg.block_r} s{cfg.split} st{cfg.num_stages}]", flush=True)
                if cfg.path == "wgmma":
                    print_trace(trace_calls(x, qps, gs))
                continue
            grids = []
            if not args.no_sweep:
                bms = sorted({min(bm, max(16, triton.next_power_of_2(m))) for bm in (64, 128, 256)})  # (as wgmma_grid)
                tiles = itertools.product(bms, (64, 128), (64, 128))
                if args.tiles:
                    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
                splits = [int(v) for v in args.splits.split(",")]
                producers = [bool(int(v)) for v in args.producer.split(",")]
                rawqs = [bool(int(v)) for v in args.rawq.split(",")]
                for (bm, bn, bk), split, stages, balanced, producer, rawq in itertools.product(
                        tiles, splits, [int(v) for v in args.stages.split(",")],
                        (True, False) if args.unbalanced else (True,), producers, rawqs):
                    g = wg.wgmma_grid(m, n, k, gs, bm, bn, bk, split, stages, producer, rawq)
                    if g.split == split and (balanced or split == 1) and (g, balanced) not in grids:
                        grids.append((g, balanced))
            # every round times cuBLAS, the shipped pick and each tile once; each keeps its fastest round
            # (the GPU's clock drifts over a sweep, so single times taken minutes apart do not compare)
            best, errs = {}, {}
            for _ in range(args.rounds):
                best["cublas"] = min(best.get("cublas", math.inf),
                                     graph_time([lambda w=w: F.linear(x, w) for w in wds])[0])
                best["shipped"] = min(best.get("shipped", math.inf),
                                      graph_time([lambda p=p: mm.mixed_mm(x, *p, group_size=gs) for p in qps])[0])
                for g, balanced in grids:
                    if errs.get((g, balanced), 0.0) is None:
                        continue
                    # mixed_mm splits a partial last wave of an unsplit grid; 'ub' times it without
                    launcher.balance_last_wave = wg.balance_last_wave if balanced else (lambda grid, *a: grid)
                    try:
                        out = run_wg(x, qw, s, z, gs, g)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            print(f"  {g}: WRONG rel err {err:.2e}", flush=True)
                            errs[(g, balanced)] = None
                            continue
                        errs[(g, balanced)] = err
                        t, _ = graph_time([lambda p=p: run_wg(x, *p, gs, g) for p in qps])
                        best[(g, balanced)] = min(best.get((g, balanced), math.inf), t)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {g}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        errs[(g, balanced)] = None
                launcher.balance_last_wave = wg.balance_last_wave
            tb, tq = best.pop("cublas"), best.pop("shipped")
            print(f"\n== N={n} K={k} M={m} {args.dtype}: cuBLAS {tb*1e3:.1f} us; shipped {tq*1e3:.1f} us "
                  f"x{tb/tq:.2f} [{cfg.path}{'/P' if cfg.producer else ''} {cfg.block_m}x{cfg.block_n} s{cfg.split}]"
                  f" (best of {args.rounds} rounds)", flush=True)
            for (g, balanced), t in sorted(best.items(), key=lambda kv: kv[1])[:args.top]:
                print(f"  {t*1e3:7.1f} us x{tb/t:5.2f}  bm{g.block_m} bn{g.block_n} bk{g.block_k} s{g.split} "
                      f"st{g.stages} w{g.warps}{' P' if g.producer else ''}{' R' if g.rawq else ''}{'' if balanced else ' ub'}  "
                      f"err {errs[(g, balanced)]:.1e}", flush=True)
        del qps, wds
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
