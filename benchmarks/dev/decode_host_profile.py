"""What paces generate()'s decode steps on the default path, 8B shape, after warm-up: the captured step replayed
alone (the GPU's time a step), its kernels in order with the idle time before each, the kernels generate() runs
per step outside the graph, and a cProfile of one generate call (top functions by own time). An experiment, not a
product benchmark."""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_decode  # noqa: E402


def main():
    parser = bench_decode.argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--decode", default="graphs", choices=["graphs", "eager"])
    a = parser.parse_args()
    args = bench_decode.argparse.Namespace(hidden=4096, intermediate=14336, vocab=128256, layers=a.layers,
                                           prompt_len=32, ttft_prompt=0, context=[0], new_tokens=a.new_tokens)
    model = bench_decode.build_model(args, torch.device("cuda"))
    if not a.bf16:
        bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
        from quantpack.modules import fused
        from quantpack.modules.merged import merge_projections
        fused.apply(model)
        merge_projections(model)
    from quantpack import generation
    import transformers
    generation.enable(model, a.decode)
    prompt = torch.randint(0, 128256, (a.batch, 32), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens)
    with torch.no_grad():
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        prof = cProfile.Profile()
        prof.enable()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        prof.disable()
    print(f"transformers {transformers.__version__}: {a.batch * a.new_tokens / wall:.1f} tok/s "
          f"({wall * 1e3 / a.new_tokens:.2f} ms a token incl. prefill)")
    # the captured step alone, replayed back to back: the GPU's time per step without generate()'s host work
    graphs = model.get_compiled_call.__self__.graphs
    for captured in graphs.values():
        for _ in range(5):
            captured.graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            captured.graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) * 10
        t = time.perf_counter()
        for _ in range(100):
            captured.graph.replay()
        host_ms = (time.perf_counter() - t) * 10
        torch.cuda.synchronize()
        print(f"captured step replayed alone: {replay_ms:.3f} ms a step (host time of a replay call "
              f"{host_ms:.3f} ms, {captured.graph.__class__.__name__})")
        # the step's kernels in order, with the idle time before each (where the graph's gaps are)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
            captured.graph.replay()
            torch.cuda.synchronize()
        evs = sorted((e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        by_kernel = {}
        prev_end = None
        print(f"{len(evs)} kernels in one replay")
        for i, e in enumerate(evs):
            gap = 0.0 if prev_end is None else e.time_range.start - prev_end
            prev_end = e.time_range.end
            name = e.name[:60]
            n, g, d = by_kernel.get(name, (0, 0.0, 0.0))
            by_kernel[name] = (n + 1, g + gap, d + e.time_range.elapsed_us())
            if i < 40:
                print(f"  {gap:7.2f} gap  {e.time_range.elapsed_us():7.2f} us  {name}")
        graph_kernels = {name: n for name, (n, _, _) in by_kernel.items()}
        # what a generate() step runs besides the graph: its own small ops, eagerly
        steps = 16
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace2:
            model.generate(prompt, **dict(kw, max_new_tokens=steps + 1, min_new_tokens=steps + 1))
            torch.cuda.synchronize()
        outside = {}
        for e in trace2.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                n, d = outside.get(e.name[:60], (0, 0.0))
                outside[e.name[:60]] = (n + 1, d + e.time_range.elapsed_us())
        print(f"generate(): per decode step, kernels outside the graph (prefill included, {steps} steps):")
        total_n = total_us = 0.0
        for name, (n, d) in sorted(outside.items(), key=lambda kv: -kv[1][1]):
            extra = n - graph_kernels.get(name, 0) * steps
            if extra > 0:
                total_n += extra / steps
                total_us += d * extra / n / steps
                print(f"  {extra / steps:6.2f} a step {d * extra / n / steps:7.2f} us  {name}")
        print(f"  total {total_n:.1f} kernels, {total_us:.1f} us a step")
        print("per kernel name: count, gap before (us), time (us)")
        for name, (n, g, d) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
            print(f"  {n:4d} {g:8.1f} {d:8.1f}  {name}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    print(s.getvalue()[-9000:])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    print(s.getvalue()[-9000:])


if __name__ == "__main__":
    main()
