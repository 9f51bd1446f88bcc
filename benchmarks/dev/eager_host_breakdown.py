"""Where eager decode's host time goes, by module family: bf16 and quantpack on the 8B shape, same process.

Eager decode is host-bound (the GPU idles while Python issues the step), so a module's host time is what it costs.
Each module family's calls are timed inclusively with forward hooks (perf_counter, no synchronize); the hooks'
own cost lands on both models alike. An experiment, not a product benchmark:

    python benchmarks/dev/eager_host_breakdown.py --batch 1 --new-tokens 32
    python benchmarks/dev/eager_host_breakdown.py --ab --batch 16 --rounds 5   # bf16 and quantpack alternately
    python benchmarks/dev/eager_host_breakdown.py --ab --without replay         # ... and without merged replays
    python benchmarks/dev/eager_host_breakdown.py --ops --batch 16             # torch.profiler's host op table
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_decode  # noqa: E402


def family(module) -> str | None:
    name = type(module).__name__
    if name in ("QuantLinear", "Linear"):
        return name
    for tag in ("DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding"):
        if name.endswith(tag):
            return tag
    return None


class Timer:
    def __init__(self):
        self.total = collections.Counter()
        self.calls = collections.Counter()
        self.stack = []

    def hook(self, model):
        handles = []
        for m in model.modules():
            fam = family(m)
            if fam is None:
                continue

            def pre(mod, args, fam=fam):
                self.stack.append(time.perf_counter())

            def post(mod, args, out, fam=fam):
                self.total[fam] += time.perf_counter() - self.stack.pop()
                self.calls[fam] += 1

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return handles

    def wrap(self, owner, attr, fam):
        """Time calls of ``owner.attr`` (or ``owner[attr]`` for a dict); returns the undo."""
        is_dict = isinstance(owner, dict)
        fn = owner[attr] if is_dict else getattr(owner, attr)
        put = owner.__setitem__ if is_dict else (lambda a, v: setattr(owner, a, v))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[fam] += time.perf_counter() - t
                self.calls[fam] += 1

        put(attr, timed)
        return lambda: put(attr, fn)


def measure(model, label, prompt, new_tokens):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    with torch.no_grad():
        for _ in range(2):
            model.generate(prompt, **kw)
        torch.cuda.synchronize()
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            model.generate(prompt, **kw)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        timer = Timer()
        handles = timer.hook(model)
        undo = [timer.wrap(modeling_llama, "apply_rotary_pos_emb", "rotary fn"),
                timer.wrap(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", "sdpa")]
        t = time.perf_counter()
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
        hooked = time.perf_counter() - t
        for h in handles:
            h.remove()
        for u in undo:
            u()
    steps = new_tokens
    print(f"\n{label}: generate {min(walls) * 1e3 / steps:.2f} ms a token (best of 3), "
          f"{hooked * 1e3 / steps:.2f} with hooks")
    for fam, total in timer.total.most_common():
        calls = timer.calls[fam]
        print(f"  {fam:>16}: {total * 1e6 / steps:9.1f} us a step, {calls // steps:5d} calls a step, "
              f"{total * 1e6 / calls:7.2f} us a call")
    return min(walls) / steps


def replays(model, on: bool):
    """Whether merged projections replay an identical eager call's plan (MergedProjections' replay); drops the
    recorded ones either way."""
    from quantpack.kernels import merged_mm
    from quantpack.modules import merged

    merged.MergedReplay = merged_mm.MergedReplay if on else _NoReplay
    for m in model.modules():
        link = getattr(m, "_merged", None)
        if link is not None:
            link[0]._replay = None


class _NoReplay:
    @staticmethod
    def of(*args, **kwargs):
        return None


def host_bound_choice(model, on: bool):
    """Whether eager calls of at most 16 rows take the path with the cheaper launch (dispatch.HOST_BOUND_MAX_M; 0
    turns the rule off); drops every cached plan and merge decision so the next calls decide again."""
    from quantpack.kernels import dispatch, merged_mm
    from quantpack.modules.linear import QuantLinear

    dispatch.HOST_BOUND_MAX_M = 16 if on else 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m._plans.clear()
            if m._merged is not None:
                m._merged[0]._paths.clear()
    for state in list(merged_mm._merged.values()):
        state.plans.clear()


def both_models(args):
    """The bf16 8B-shaped model and its quantized copy as ``quantpack.load`` makes it, decoding eagerly."""
    import copy

    from quantpack import generation
    from quantpack.modules import fused
    from quantpack.modules.merged import merge_projections

    model = bench_decode.build_model(args, torch.device("cuda"))
    qmodel = copy.deepcopy(model)
    bench_decode.quantize_in_place(qmodel, bits=4, group_size=128, method="rtn")
    fused.apply(qmodel)
    merge_projections(qmodel)
    generation.enable(qmodel, "eager")
    return model, qmodel


def ab(a, args, prompt):
    """bf16 and quantpack with and without one feature (``--without``: eager calls' host-bound path choice, or merged
    replays) alternately, same process: each round one generate of each; the median step time (wall and CPU) of each
    over all rounds, and the median of the rounds' ratios."""
    import statistics

    from quantpack.modules import fused

    model, qmodel = both_models(args)
    switch = host_bound_choice if a.without == "host-bound" else replays
    labels = ("bf16", "quantpack", f"without {a.without}")
    steps = {label: ([], []) for label in labels}
    ratios = {label: ([], []) for label in labels[1:]}
    for r in range(a.rounds + 1):  # (round 0 warms up: not counted)
        fused.remove(qmodel)  # (its rotary replaces transformers' function, which bf16 calls too)
        got = {"bf16": bench_decode.eager_steps(model, prompt, a.new_tokens)}
        fused.apply(qmodel)
        for on, label in ((True, labels[1]), (False, labels[2])):
            switch(qmodel, on)
            bench_decode.eager_steps(qmodel, prompt, 4)  # (the first calls after the switch record new plans)
            got[label] = bench_decode.eager_steps(qmodel, prompt, a.new_tokens)
        switch(qmodel, True)
        if r == 0:
            continue
        med = {label: [statistics.median(v) for v in pair] for label, pair in got.items()}
        for label in labels:
            for i in (0, 1):
                steps[label][i].extend(got[label][i])
        for label in labels[1:]:
            for i in (0, 1):
                ratios[label][i].append(med["bf16"][i] / med[label][i])
        print(f"round {r}: median step (wall / CPU) bf16 {med['bf16'][0]:.2f} / {med['bf16'][1]:.2f} ms, "
              + ", ".join(f"{label} {med[label][0]:.2f} / {med[label][1]:.2f} ({ratios[label][0][-1]:.3f}x / "
                          f"{ratios[label][1][-1]:.3f}x)" for label in labels[1:]), flush=True)
    for i, what in enumerate(("wall", "CPU")):
        base = statistics.median(steps["bf16"][i])
        print(f"batch {a.batch}, {a.rounds} rounds of {a.new_tokens} tokens, {what} time: median step bf16 eager "
              f"{base:.2f} ms")
        for label in labels[1:]:
            rs = sorted(ratios[label][i])
            print(f"  {label}: median step {statistics.median(steps[label][i]):.2f} ms "
                  f"({base / statistics.median(steps[label][i]):.3f}x bf16 eager); rounds' ratios median "
                  f"{statistics.median(rs):.3f}x, range {rs[0]:.3f}-{rs[-1]:.3f}")


def op_profile(a, args, prompt):
    """torch.profiler's host-side records of one eager generate per model: aten ops by self CPU time and count."""
    from torch.profiler import ProfilerActivity, profile

    from quantpack.modules import fused

    model, qmodel = both_models(args)
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens)
    for label, m in (("bf16", model), ("quantpack", qmodel)):
        if label == "bf16":
            fused.remove(qmodel)
        else:
            fused.apply(qmodel)
        with torch.no_grad():
            m.generate(prompt, **kw)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                m.generate(prompt, **kw)
                torch.cuda.synchronize()
        print(f"\n{label}, batch {a.batch}, {a.new_tokens} tokens:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", action="store_true", help="only torch.profiler's host-side op table of each model")
    ap.add_argument("--ab", action="store_true", help="only alternate bf16 and quantpack eager timings")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--without", choices=["host-bound", "replay"], default="host-bound",
                    help="with --ab: the feature the third model runs without")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    args = argparse.Namespace(hidden=4096, intermediate=14336, vocab=128256, layers=a.layers)
    from quantpack import generation
    from quantpack.modules import fused
    from quantpack.modules.merged import merge_projections

    prompt = torch.randint(0, 128256, (a.batch, 32), device="cuda")
    if a.ab:
        return ab(a, args, prompt)
    if a.ops:
        return op_profile(a, args, prompt)
    model = bench_decode.build_model(args, torch.device("cuda"))
    bf16 = measure(model, f"bf16, batch {a.batch}", prompt, a.new_tokens)
    bench_decode.quantize_in_place(model, bits=4, group_size=128, method="rtn")
    fused.apply(model)
    merge_projections(model)
    generation.enable(model, "eager")
    q = measure(model, f"quantpack eager, batch {a.batch}", prompt, a.new_tokens)
    print(f"\nquantpack eager / bf16 eager: {bf16 / q:.3f}x")


if __name__ == "__main__":
    main()
