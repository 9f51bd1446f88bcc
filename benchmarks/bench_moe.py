"""The fused mixture-of-experts kernels (quantpack.kernels.moe) against bf16 grouped GEMMs, on one GPU, in one run.

    python benchmarks/bench_moe.py [--tokens 1,16,512,2048] [--models qwen3-moe,mixtral] [--out DIR]
    python benchmarks/bench_moe.py --sweep        # times every candidate launch config instead (JSON lines)
    TRITON_INTERPRET=1 python benchmarks/bench_moe.py --dry-run   # CPU smoke test: a tiny block, no timing

Shapes: Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, width 768) and Mixtral-8x7B's (8, top-2, 4096,
14336), 4-bit, group size 128, bf16 activations, random non-zero data and router-like routing (softmax top-k).
For each token count: the whole block (``fused_experts``, routing included) with the experts as ``quantpack.load``
keeps them on a GPU (the mma layout, ``layout`` in the row), the same in the checkpoint's layout
(``fused_experts_rows``) and its two projections (gate_up, activation fused; down, top-k weight fused, slots summed),
against the same steps in bf16 with ``torch._grouped_mm`` on the
dequantized weights (tokens sorted by expert as transformers does it), and against transformers' own experts module
with its ``grouped_mm`` implementation (whole block). Where the pairs average ``GROUPED_PER_EXPERT`` or more per expert, also
``grouped_dequant``: the prefill path fused_experts takes outside CUDA-graph capture (experts dequantized, torch's
grouped GEMM), timed eagerly since it reads the pairs per expert on the host; and on Hopper, from 4 pairs per expert,
``wgmma_experts`` (the wgmma kernel over per-expert blocks, the prefill path there) in both layouts. Every implementation is checked against
``quantpack.reference.experts`` first. Times: median of ``do_bench`` over CUDA-graph replays of one call per weight
replica, enough replicas that the experts hit exceed 4x L2 (benchmarks/timing.py).
Bandwidth floor: the packed bytes of the experts actually hit (codes, scales, zeros) / copy bandwidth measured in
the same run; ``floor_fraction`` = floor / time. Rows go to benchmarks/results/kernels.jsonl (``case`` "experts",
``M`` the token count, ``ratio_to_bf16`` against the same run's grouped GEMM; ``ratio_to_cublas`` is null: there is
no single cuBLAS product to compare a block with).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from quantpack import reference  # noqa: E402
from quantpack.format import PackedExperts  # noqa: E402
from quantpack.kernels.moe import choose, fused_experts  # noqa: E402
from quantpack.kernels.moe.dispatch import GROUPED_PER_EXPERT  # noqa: E402
from quantpack.kernels.moe.grouped import grouped_experts  # noqa: E402
from quantpack.kernels.moe.mma_experts import MmaExperts, mma_experts_fit  # noqa: E402
from quantpack.kernels.moe.wgmma_experts import wgmma_experts, wgmma_experts_usable  # noqa: E402
from quantpack.kernels.dispatch import device_props  # noqa: E402
from timing import graph_time, median_ms, record  # noqa: E402  (benchmarks/timing.py)

MODELS = {"qwen3-moe": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}
GS, BITS = 128, 4
TOL = 1e-2  # relative error of the fused kernels' bf16 outputs against the float32 reference
BASELINE_TOL = 2e-2  # ... of the bf16 baselines (weights rounded to bf16, and every intermediate)
fe = sys.modules["quantpack.kernels.moe.fused_experts"]  # (the package exports the function under this name)


def log(*a):
    print(*a, flush=True)


def random_block(experts, hidden, inter, dtype, seed, device):
    """gate_up (2I, H) and down (H, I) packed experts: random codes, scales in [0.005, 0.025], zeros in [0, 15]."""
    g = torch.Generator(device=device).manual_seed(seed)

    def one(n, k):
        q = torch.randint(0, 256, (experts, k // 2, n), generator=g, device=device, dtype=torch.uint8)
        s = (torch.rand(experts, k // GS, n, generator=g, device=device) * 0.02 + 0.005).to(dtype)
        z = (torch.rand(experts, k // GS, n, generator=g, device=device) * 15).to(dtype)
        return PackedExperts(q, s, z, BITS, GS, (n, k))

    return one(2 * inter, hidden), one(hidden, inter)


def dense(pe: PackedExperts) -> torch.Tensor:
    """(E, N, K) bf16: every expert dequantized (the bf16 baselines' weights: the same function as the packed)."""
    return torch.stack([reference.dequantize(pe.expert(e), torch.bfloat16) for e in range(pe.num_experts)])


def routing(tokens, experts, top_k, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w, ids = torch.softmax(torch.randn(tokens, experts, generator=g, device=device), -1).topk(top_k, -1)
    return ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def expert_bytes(pe: PackedExperts) -> int:
    """Bytes one expert of ``pe`` reads: codes, scales and zeros."""
    return (pe.qweight[0].numel() * pe.qweight.element_size() + 2 * pe.scales[0].numel() * pe.scales.element_size())


class Grouped:
    """The bf16 block with torch._grouped_mm: tokens sorted by expert (offsets by histc, as transformers: no host
    synchronisation), gate_up, SiLU * up, down, weighted, summed back per token."""

    def __init__(self, wgu, wd, ids, w):
        self.wgu, self.wd = wgu.transpose(-2, -1), wd.transpose(-2, -1)  # (E, K, N) views: column-major B
        self.ids, self.w = ids, w
        self.experts, self.top_k = wgu.shape[0], ids.shape[1]
        self.inter = wd.shape[2]

    def sort(self, x):
        flat, perm = torch.sort(self.ids.reshape(-1))
        counts = torch.histc(flat.int() if x.is_cuda else flat.float(), bins=self.experts, min=0, max=self.experts - 1)
        return x[perm // self.top_k], perm, torch.cumsum(counts, 0, dtype=torch.int32)

    def gate_up(self, xs, offs):
        gu = torch._grouped_mm(xs, self.wgu, offs=offs)
        return F.silu(gu[:, :self.inter]) * gu[:, self.inter:]

    def down(self, h, perm, offs, tokens):
        y = torch._grouped_mm(h, self.wd, offs=offs) * self.w.reshape(-1)[perm, None]
        return torch.zeros(tokens, y.shape[1], dtype=y.dtype, device=y.device).index_add_(0, perm // self.top_k, y)

    def __call__(self, x):
        xs, perm, offs = self.sort(x)
        return self.down(self.gate_up(xs, offs), perm, offs, x.shape[0])


def transformers_experts(model, wgu, wd):
    """transformers' own experts module of ``model`` with the ``grouped_mm`` implementation, holding ``wgu``/``wd``,
    or None where this transformers has none."""
    try:
        if model == "qwen3-moe":
            from transformers import Qwen3MoeConfig as Config
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
            cfg = Config(hidden_size=wgu.shape[2], moe_intermediate_size=wd.shape[2], num_experts=wgu.shape[0])
        else:
            from transformers import MixtralConfig as Config
            from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
            cfg = Config(hidden_size=wgu.shape[2], intermediate_size=wd.shape[2], num_local_experts=wgu.shape[0])
        cfg._experts_implementation = "grouped_mm"
        with torch.device("meta"):
            m = Experts(cfg)
        m.gate_up_proj = torch.nn.Parameter(wgu, requires_grad=False)
        m.down_proj = torch.nn.Parameter(wd, requires_grad=False)
        return m
    except Exception as exc:  # noqa: BLE001  (reported; the other rows still run)
        log(f"transformers' {model} experts module: not benchmarked ({exc!r:.200})")
        return None


def copy_bandwidth() -> float:
    x = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / (median_ms(lambda: y.copy_(x), warmup=10, rep=60) * 1e-3)
    x = y = None  # (their memory)
    return bw


def rel_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(name, got, want, tol=TOL):
    err = rel_error(got, want)
    if not err < tol:
        raise SystemExit(f"{name}: relative error {err:.3g} against the reference (>= {tol}); not timed")
    return err


def bench_model(model, token_counts, bw, l2, out_dir):
    experts, top_k, hidden, inter = MODELS[model]
    dev = "cuda"
    probe = random_block(experts, hidden, inter, torch.bfloat16, 0, dev)
    per_expert = expert_bytes(probe[0]) + expert_bytes(probe[1])
    del probe
    hits = {t: min(experts, t * top_k) for t in token_counts}  # (upper bound, for the replica count)
    n_rep = max(2, min(16, math.ceil(4 * l2 / (min(hits.values()) * per_expert))))
    blocks = [random_block(experts, hidden, inter, torch.bfloat16, 1 + i, dev) for i in range(n_rep)]
    dense_w = [(dense(gu), dense(d)) for gu, d in blocks]
    # what quantpack.load keeps on a GPU: the experts in the mma layout where they fit it (the checkpoint's layout,
    # ``rows``, otherwise)
    mma = all(mma_experts_fit(pe, torch.bfloat16) for pe in blocks[0])
    loaded = [tuple(MmaExperts.from_packed(pe) for pe in b) for b in blocks] if mma else blocks
    log(f"{model}: E={experts} top-{top_k} H={hidden} I={inter}, {n_rep} weight replicas, "
        f"{per_expert / 1e6:.2f} MB per expert (packed)")
    rows = []
    for tokens in token_counts:
        xs = [torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16) for _ in range(n_rep)]
        routes = [routing(tokens, experts, top_k, 100 + i, dev) for i in range(n_rep)]
        n_rep_t = max(2, min(n_rep, math.ceil(4 * l2 / (hits[tokens] * per_expert))))
        hit = len(torch.unique(routes[0][0]))
        floor_us = hit * per_expert / bw * 1e6
        d = choose(device_props(torch.device(dev)), tokens, top_k, experts, hidden, inter, GS)
        d_loaded = choose(device_props(torch.device(dev)), tokens, top_k, experts, hidden, inter, GS, mma=mma)
        gu0, d0 = blocks[0]
        want = reference.experts(xs[0], gu0, d0, *routes[0])
        check("fused_experts", fused_experts(xs[0], *loaded[0], *routes[0]), want)
        check("fused_experts (rows)", fused_experts(xs[0], gu0, d0, *routes[0]), want)
        grouped = [Grouped(*dense_w[i], *routes[i]) for i in range(n_rep_t)]
        check("grouped_mm bf16", grouped[0](xs[0]), want, BASELINE_TOL)
        tf = transformers_experts(model, *dense_w[0])
        if tf is not None:
            try:
                err = rel_error(tf(xs[0], *routes[0]), want)
            except Exception as exc:  # noqa: BLE001  (its row is left out; the others still run)
                err = exc
            if not (isinstance(err, float) and err < BASELINE_TOL):
                log(f"  transformers' experts: not timed ({err!r:.200} against the reference)")
                tf = None
        # per projection: the fused kernels' launches alone (routing included where the path sorts), and the bf16
        # grouped GEMMs alone (their sort done outside)
        ours_parts = [fe_parts(xs[i], *blocks[i], *routes[i], d) for i in range(n_rep_t)]
        base_parts = [(g, *g.sort(xs[i])) for i, g in enumerate(grouped)]
        base_h = [g.gate_up(xsort, offs) for g, xsort, _, offs in base_parts]
        timings = {
            ("block", "fused_experts"): [lambda i=i: fused_experts(xs[i], *loaded[i], *routes[i])
                                         for i in range(n_rep_t)],
            ("block", "fused_experts_rows"): [lambda i=i: fused_experts(xs[i], *blocks[i], *routes[i])
                                              for i in range(n_rep_t)],
            ("block", "grouped_mm_bf16"): [lambda i=i: grouped[i](xs[i]) for i in range(n_rep_t)],
            ("gate_up", "fused_experts_rows"): [p[0] for p in ours_parts],
            ("down", "fused_experts_rows"): [p[1] for p in ours_parts],
            ("gate_up", "grouped_mm_bf16"): [lambda p=p: p[0].gate_up(p[1], p[3]) for p in base_parts],
            ("down", "grouped_mm_bf16"): [lambda p=p, h=h: p[0].down(h, p[2], p[3], tokens)
                                          for p, h in zip(base_parts, base_h)],
        }
        if tokens * top_k >= 4 * experts and wgmma_experts_usable(xs[0], *loaded[0]):  # Hopper's prefill path,
            # forced at every count from 4 pairs per expert (where the dispatch takes it is WGMMA_PER_EXPERT)
            check("wgmma_experts", wgmma_experts(xs[0], *loaded[0], *routes[0]), want)
            timings[("block", "wgmma_experts")] = [lambda i=i: wgmma_experts(xs[i], *loaded[i], *routes[i])
                                                   for i in range(n_rep_t)]
            if mma:
                timings[("block", "wgmma_experts_rows")] = [lambda i=i: wgmma_experts(xs[i], *blocks[i], *routes[i])
                                                            for i in range(n_rep_t)]
        if tf is not None:
            tfs = [tf] + [transformers_experts(model, *dense_w[i]) for i in range(1, n_rep_t)]
            timings[("block", "transformers_grouped_mm_bf16")] = [lambda i=i: tfs[i](xs[i], *routes[i])
                                                                  for i in range(n_rep_t)]
        times = {key: graph_time(calls, warmup=10, rep=60) for key, calls in timings.items()}
        if tokens * top_k / experts >= GROUPED_PER_EXPERT:  # the prefill path fused_experts takes outside capture:
            # it reads the pairs per expert on the host, so it is timed eagerly (prefill is never captured)
            check("grouped_dequant", grouped_experts(xs[0], *loaded[0], *routes[0]), want)
            calls = [lambda i=i: grouped_experts(xs[i], *loaded[i], *routes[i]) for i in range(n_rep_t)]
            times[("block", "grouped_dequant")] = (median_ms(lambda: [c() for c in calls], 5, 30) / n_rep_t,
                                                   "eager")
        for (op, impl), (ms, mode) in times.items():
            us = ms * 1e3
            base = times[(op, "grouped_mm_bf16")][0] * 1e3
            row = {"case": "experts", "model": model, "op": op, "impl": impl,
                   "shape": {"experts": experts, "top_k": top_k, "tokens": tokens, "hidden": hidden, "inter": inter},
                   "M": tokens, "bits": BITS, "group_size": GS, "dtype": "bf16", "time_us": round(us, 2),
                   "mode": mode, "ratio_to_cublas": None, "ratio_to_bf16": round(base / us, 3), "experts_hit": hit,
                   "replicas": n_rep_t}
            if impl.startswith("wgmma_experts"):
                row["layout"] = "mma" if impl == "wgmma_experts" and mma else "rows"
            if impl.startswith("fused_experts"):
                dd = d_loaded if impl == "fused_experts" else d
                row["layout"] = "mma" if impl == "fused_experts" and mma else "rows"
                row["config"] = str(dd.gate_up if op == "gate_up" else dd.down if op == "down" else dd.path)
                if op == "block" and impl == "fused_experts":
                    row["floor_us"] = round(floor_us, 2)
                    row["floor_fraction"] = round(floor_us / us, 3)
                    row["copy_GBps"] = round(bw / 1e9, 1)
            rows.append(row)
            log(f"  T={tokens:5d} {op:8s} {impl:30s} {us:9.1f} us  {base / us:5.2f}x bf16"
                + (f"  {floor_us / us:5.1%} of the {floor_us:.1f} us floor ({hit} experts hit)"
                   if impl == "fused_experts" and op == "block" else ""))
    record("kernels", rows, out_dir)
    return rows


def fe_parts(x, gate_up, down, ids, w, decision):
    """Zero-argument calls of the fused block's two projections alone (each with its routing where its path sorts,
    as fused_experts runs them)."""
    h = fe.gate_up_stage(x, gate_up, ids, w, decision.gate_up, fe.route(ids, gate_up.num_experts, decision.gate_up))

    def gate_up_call():
        return fe.gate_up_stage(x, gate_up, ids, w, decision.gate_up,
                                fe.route(ids, gate_up.num_experts, decision.gate_up))

    def down_call():
        return fe.down_stage(h, down, ids, w, decision.down, fe.route(ids, down.num_experts, decision.down),
                             dtype=x.dtype)

    return gate_up_call, down_call


def candidates(path: str, group_size: int) -> list:
    """Launch configs --sweep times for one projection on ``path``."""
    from quantpack.kernels.moe import ExpertsConfig

    if path == "pairs":
        return [ExpertsConfig("pairs", 1, bn, br, num_warps=w, split=sp) for bn in (32, 64, 128)
                for br in (16, 32, 64) if group_size % (2 * br) == 0 for w in (4, 8) for sp in (1, 2, 4, 8)]
    return [ExpertsConfig("sorted", bm, bn, 32, num_warps=w, num_stages=st)
            for bm, bn in ((16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128), (128, 128))
            for w in (4, 8) for st in (2, 3, 4)]


def sweep(model, token_counts, l2):
    """Time every candidate config of each projection (both paths) per token count; print the fastest five and the
    dispatch's pick, one JSON line per (model, tokens, projection, path)."""
    experts, top_k, hidden, inter = MODELS[model]
    dev = "cuda"
    per_expert = None
    for tokens in token_counts:
        probe = random_block(experts, hidden, inter, torch.bfloat16, 0, dev)
        per_expert = per_expert or expert_bytes(probe[0]) + expert_bytes(probe[1])
        del probe
        n_rep = max(2, min(16, math.ceil(4 * l2 / (min(experts, tokens * top_k) * per_expert))))
        blocks = [random_block(experts, hidden, inter, torch.bfloat16, 1 + i, dev) for i in range(n_rep)]
        xs = [torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16) for _ in range(n_rep)]
        routes = [routing(tokens, experts, top_k, 100 + i, dev) for i in range(n_rep)]
        d = choose(device_props(torch.device(dev)), tokens, top_k, experts, hidden, inter, GS)
        want_h = [fe.gate_up_stage(xs[i], blocks[i][0], *routes[i], d.gate_up, fe.route(routes[i][0], experts,
                                                                                          d.gate_up))
                  for i in range(n_rep)]
        want_y = fe.down_stage(want_h[0], blocks[0][1], *routes[0], d.down, fe.route(routes[0][0], experts, d.down),
                               dtype=torch.bfloat16)
        for proj, pick in (("gate_up", d.gate_up), ("down", d.down)):
            for path in ("pairs", "sorted"):
                if path == "pairs" and tokens * top_k > 512:
                    continue
                results = []
                for cfg in candidates(path, GS):
                    def call(i, cfg=cfg):
                        r = fe.route(routes[i][0], experts, cfg)
                        if proj == "gate_up":
                            return fe.gate_up_stage(xs[i], blocks[i][0], *routes[i], cfg, r)
                        return fe.down_stage(want_h[i], blocks[i][1], *routes[i], cfg, r, dtype=torch.bfloat16)
                    try:
                        got = call(0)
                        ref = want_h[0] if proj == "gate_up" else want_y
                        if not rel_error(got, ref) < TOL:
                            continue
                        ms, _ = graph_time([lambda i=i: call(i) for i in range(n_rep)], warmup=5, rep=20)
                    except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit is skipped)
                        log(f"  {cfg}: {exc!r:.120}")
                        continue
                    results.append((ms * 1e3, str(cfg)))
                results.sort()
                print(json.dumps({"model": model, "tokens": tokens, "proj": proj, "path": path, "pick": str(pick),
                                  "best": results[:5]}), flush=True)


def dry_run():
    """A tiny block on the CPU under TRITON_INTERPRET=1: the fused kernels against the reference, both paths."""
    for tokens in (1, 20):
        gate_up, down = random_block(8, 128, 128, torch.float32, 0, "cpu")
        x = torch.randn(tokens, 128)
        ids, w = routing(tokens, 8, 2, 0, "cpu")
        err = check("fused_experts", fused_experts(x, gate_up, down, ids, w.float()),
                    reference.experts(x, gate_up, down, ids, w.float()))
        d = choose(device_props(torch.device("cpu")), tokens, 2, 8, 128, 128, GS)
        log(f"dry run: T={tokens} top-2 of 8 experts, {d.path}: relative error {err:.2e}")
        gate_up, down = random_block(8, 128, 128, torch.float16, 0, "cpu")
        x = x.half()
        err = check("fused_experts (mma layout)", fused_experts(x, *(MmaExperts.from_packed(pe) for pe in
                                                                     (gate_up, down)), ids, w.float()),
                    reference.experts(x, gate_up, down, ids, w.float()), 2e-3)
        log(f"dry run: T={tokens}, the mma layout: relative error {err:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,16,512,2048", help="token counts, comma-separated")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results; '' records nothing)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every candidate launch config per projection and path instead (prints JSON lines)")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test at a tiny shape (interpreter), no timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("bench_moe: --dry-run runs the kernels in Triton's interpreter; set TRITON_INTERPRET=1",
                  file=sys.stderr)
            return 2
        dry_run()
        return 0
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU (use --dry-run for the CPU smoke test)", file=sys.stderr)
        return 2
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"bench_moe: unknown model {unknown[0]!r}; use {', '.join(MODELS)}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 * 2 ** 20)
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s, L2 {l2 / 2 ** 20:.0f} MiB")
    for model in models:
        if args.sweep:
            sweep(model, tokens, l2)
            continue
        bench_model(model, tokens, bw, l2, args.out)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
