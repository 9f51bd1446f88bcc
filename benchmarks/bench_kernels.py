"""quantpack kernels side by side with cuBLAS and the peers, on one GPU, in one run.

    python benchmarks/bench_kernels.py [--tune] [--bench] [--dtypes bf16,fp16] [--ms 1,16,64,256,1024,4096]

--tune   times quantpack's candidate configs for the benchmark shapes (compiles in parallel first),
         writes the table to quantpack/kernels/configs/<gpu>.json (and $OUT) so later runs, and
         users, start with tuned configs and never autotune on first use.
--bench  the table: cuBLAS bf16/fp16 F.linear, hqq reference HQQLinear (PYTORCH backend), torchao
         triton_mixed_mm, tinygemm (HQQLinearTorchWeightOnlyInt4, bf16 only), gemlite
         A16W4_HQQ_INT, quantpack mixed_mm; then the transposed kernel (M >= 1024) against cuBLAS
         x @ W, the dequant kernel against copy bandwidth, W8A16 (``--w8-ms``), and (``stream``) how
         fast a kernel that only reads each shape's packed bytes, with no math, can be.

Method (BENCHMARKS.md, "Method"): random data; every implementation checked against an
fp32 reference first; each timed as the median of do_bench over CUDA-graph replays of one call per
weight replica, with enough replicas to exceed 4x L2 so weights come from HBM. cuBLAS and quantpack are
timed back to back twice (each keeps its faster median) before the peers, so that clock drift over the
peers' minutes does not bias their ratio.
Floor = max(bytes / measured copy bandwidth, FLOPs / measured cuBLAS bf16 peak), with bytes = the
packed weight + scales/zeros + activations in + out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import importlib  # noqa: E402

from quantpack.kernels import dequantize  # noqa: E402
from timing import graph_time as _graph_time, kernel_line, median_ms, record  # noqa: E402  (benchmarks/timing.py)

mm = importlib.import_module("quantpack.kernels.mixed_mm")  # the module (the package exports a function of that name)
dq_mod = importlib.import_module("quantpack.kernels.dequant")
DEQUANT_VARIANTS = [(32, 128, 4), (32, 128, 8), (64, 128, 4), (64, 128, 8), (32, 256, 8), (16, 256, 4), (64, 64, 4),
                    (32, 64, 2), (128, 128, 8), (32, 128, 2), (128, 64, 4), (128, 128, 4), (256, 128, 8),
                    (128, 128, 2), (64, 64, 2)]

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N out, K in)
IMPL = {"hqq_ref": "hqq", "ao_triton": "torchao"}  # the bench's column names -> the results files' impl names
GS = 128
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def log(*a):
    print(*a, flush=True)


def med(fn):
    return median_ms(fn, warmup=10, rep=60)


def graph_time(calls):
    """Median ms per call over CUDA-graph replays of ``calls`` (eager if capture fails), and the mode."""
    return _graph_time(calls, warmup=10, rep=60)


def random_packed(n, k, bits, dtype, gen_seed=0, axis=1, gs=GS):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    rows = k // 2 if bits == 4 else k
    qw = torch.randint(0, 256, (rows, n), device="cuda", dtype=torch.uint8, generator=g)
    meta = (k // gs, n) if axis == 1 else (k, n // gs)
    scales = (torch.rand(meta, device="cuda", generator=g) * 0.02 + 0.005).to(dtype)
    zeros = (torch.rand(meta, device="cuda", generator=g) * (2 ** bits - 1)).to(dtype)
    return qw, scales, zeros


def ref_weight(qw, scales, zeros, bits, gs=GS, axis=1):
    from quantpack import reference
    from quantpack.format import PackedWeight
    n = qw.shape[1]
    k = qw.shape[0] * (2 if bits == 4 else 1)
    return reference.dequantize(PackedWeight(qw, scales, zeros, bits, gs, axis, (n, k)), torch.float32)


def ceilings():
    x = torch.randn(2 ** 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / (med(lambda: y.copy_(x)) * 1e-3)
    x = y = None  # (their memory, before the next test's)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    peak = 2 * 8192 ** 3 / (med(lambda: a @ b) * 1e-3)
    return bw, peak


def replicas(nbytes, l2):
    return max(2, math.ceil(4 * l2 / nbytes))


# ------------------------------------------------------------------------------------------- tune

def _warm(job):
    """Compile one config (in a worker process) so the tuner later loads it from Triton's cache."""
    transposed, bits, m, n, k, dtype_name, cfg = job
    try:
        qw, s, z = random_packed(n, k, bits, DT[dtype_name])
        x = torch.randn(m, n if transposed else k, device="cuda", dtype=DT[dtype_name])
        mm.mixed_mm(x, qw, s, z, group_size=GS, bits=bits, transposed=transposed, config=mm.KernelConfig(**cfg))
        torch.cuda.synchronize()
        return None
    except torch.OutOfMemoryError:
        return "oom"
    except Exception as e:
        return f"{cfg}: {repr(e)[:160]}"


def warm_workers(shapes, free_bytes=None) -> int:
    """Processes that compile the candidates side by side: at most 16 (and the CPU count), and as many as the GPU's
    free memory holds at the largest weight (a process's CUDA context, its weight, the mma-ordered copy and the
    packing's temporaries: about 1.5 GB + 12 bytes per weight element; 16 at 57344 x 8192 ran an H100 out of memory)."""
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info()[0]
    per_process = 1.5e9 + 12 * max(n * k for n, k in shapes)
    return max(1, min(16, os.cpu_count() or 4, int(0.9 * free_bytes // per_process)))


def tune_jobs(ms, tr_ms, w8_ms=(1,), shapes=SHAPES):
    jobs = []
    for n, k in shapes:
        for m in ms:
            jobs.append((False, 4, m, n, k))
        for m in tr_ms:
            jobs.append((True, 4, m, n, k))
        for m in w8_ms:
            jobs.append((False, 8, m, n, k))
    return jobs


def candidates(transposed, bits, m, n, k, paths):
    """The tuner's candidates for one key, limited to ``paths`` (all when empty)."""
    return [c for c in mm.candidate_configs(transposed, m, n, k, torch.device("cuda"), bits)
            if not paths or c.path in paths]


def tune(ms, tr_ms, dtype_name, l2, out_dir, w8_ms=(1,), paths=(), shapes=SHAPES):
    dtype = DT[dtype_name]
    jobs = tune_jobs(ms, tr_ms, w8_ms, shapes)
    warm = []
    for transposed, bits, m, n, k in jobs:
        for cfg in candidates(transposed, bits, m, n, k, paths):
            if cfg.path != "dq":
                warm.append((transposed, bits, m, n, k, dtype_name, cfg.__dict__.copy()))
    t0 = time.time()
    import multiprocessing as mp
    workers = warm_workers([(n, k) for _, _, _, n, k in jobs])
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        fails = [f for f in ex.map(_warm, warm, chunksize=4) if f]
    ooms = fails.count("oom")
    fails = [f for f in fails if f != "oom"]
    log(f"compiled {len(warm)} configs in {time.time() - t0:.0f}s ({workers} processes), {len(fails)} failed"
        + (f", {ooms} left to compile when first timed (GPU memory full)" if ooms else ""))
    for f in fails[:10]:
        log("  compile failure:", f)
    results = {}
    for transposed, bits, m, n, k in jobs:
        qw, s, z = random_packed(n, k, bits, dtype)
        x = torch.randn(m, n if transposed else k, device="cuda", dtype=dtype)
        nbytes = qw.numel() + 2 * s.numel() * s.element_size()
        best, times = mm.autotune(x, qw, s, z, group_size=GS, bits=bits, transposed=transposed,
                                  candidates=candidates(transposed, bits, m, n, k, paths),
                                  weight_copies=min(16, replicas(nbytes, l2)))
        key = mm.config_key(transposed, bits, n, k, m)
        # the pick first (autotune decides among its re-timed fastest, whose mean times can exceed another
        # candidate's single sweep time), then every other candidate, fastest first
        ranked = sorted(times.items(), key=lambda kv: (kv[0] != best, kv[1]))
        results[key] = [(c.__dict__, t) for c, t in ranked]
        log(f"tune {key}: best {times[best]:.1f}us {best}  | next: " +
            "; ".join(f"{t:.1f}us {config_label(c)}" for c, t in ranked[1:4]))
        del qw, s, z, x
    torch.cuda.empty_cache()
    dev_key = mm.device_key(torch.device("cuda"))
    cfg_path = os.path.join(os.path.dirname(mm.__file__), "configs", f"{dev_key}.json")
    os.makedirs(os.path.dirname(cfg_path), exist_ok=True)
    mm.save_table(cfg_path)
    if out_dir:
        mm.save_table(os.path.join(out_dir, f"{dev_key}.json"))
        json.dump(results, open(os.path.join(out_dir, "tune_top.json"), "w"), indent=1)
    log(f"wrote {cfg_path}")


# ------------------------------------------------------------------------------------------ bench

def peers(n, k, dtype, r4):
    """Build the peer implementations for one weight; returns (impls dict, fp32 dequantized W)."""
    from hqq.core.quantize import HQQLinear, BaseQuantizeConfig, HQQBackend
    HQQLinear.set_backend(HQQBackend.PYTORCH)
    W = torch.randn(n, k, dtype=dtype, device="cuda") * (1 / math.sqrt(k))
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device="cuda")
    lin.weight.data = W.clone()
    hq = HQQLinear(lin, quant_config=BaseQuantizeConfig(nbits=4, group_size=GS, axis=1), compute_dtype=dtype,
                   device="cuda", del_orig=False)
    Wq = hq.unpack(dtype=torch.uint8).view(n, k)
    scale = hq.meta["scale"].reshape(n, -1).to(dtype)
    zero = hq.meta["zero"].reshape(n, -1).to(dtype)
    Wd = hq.dequantize().reshape(n, k).float()
    impls = {}
    r16 = replicas(2 * n * k, L2)
    Ws = [W.clone() for _ in range(r16)]
    impls["cublas"] = (r16, lambda i, x: F.linear(x, Ws[i]), W.float())
    hqs = [hq] + [HQQLinear(lin, quant_config=BaseQuantizeConfig(nbits=4, group_size=GS, axis=1), compute_dtype=dtype,
                            device="cuda", del_orig=False) for _ in range(2)]
    impls["hqq_ref"] = (len(hqs), lambda i, x: hqs[i](x), Wd)
    try:
        from torchao.prototype.hqq import triton_mixed_mm, pack_2xint4
        pk = pack_2xint4(Wq.T.contiguous())
        pks = [(pk.clone(), scale.clone(), zero.clone()) for _ in range(r4)]
        impls["ao_triton"] = (r4, lambda i, x: triton_mixed_mm(x, pks[i][0], pks[i][1].T, pks[i][2].T, group_size=GS,
                                                              kernel_type="compute_bound"), Wd)
    except Exception as e:
        log("torchao unavailable:", repr(e)[:200])
    if dtype == torch.bfloat16:
        try:
            from torchao.prototype.hqq.hqq_tinygemm_linear import HQQLinearTorchWeightOnlyInt4
            tgs = []
            for _ in range(r4):
                mt = HQQLinearTorchWeightOnlyInt4(None, quant_config={"weight_quant_params": {"nbits": 4, "group_size": GS}},
                                                  compute_dtype=torch.bfloat16, device="cuda", initialize=False,
                                                  padding=False)
                mt.initialize_with_hqq_quants(Wq.reshape(-1, GS).clone(), {"scale": scale.reshape(-1, 1).clone(),
                                              "zero": zero.reshape(-1, 1).clone(), "shape": (n, k), "packing": None})
                tgs.append(mt)
            impls["tinygemm"] = (r4, lambda i, x: tgs[i].matmul(x), Wd)
        except Exception as e:
            log("tinygemm unavailable:", repr(e)[:200])
    try:
        from gemlite.helper import A16W4_HQQ_INT
        gls = [A16W4_HQQ_INT(device="cuda", dtype=dtype).from_weights(Wq.clone(), scale.clone(), zero.clone())
               for _ in range(r4)]
        impls["gemlite"] = (r4, lambda i, x: gls[i](x), Wd)
    except Exception as e:
        log("gemlite unavailable:", repr(e)[:200])
    # quantpack: the same hqq quantization, in quantpack's layout ((K/2, N) packed, (K/g, N) meta)
    from quantpack.format import pack
    qp = [(pack(Wq, 4), scale.t().contiguous(), zero.t().contiguous())]
    qp += [tuple(t.clone() for t in qp[0]) for _ in range(r4 - 1)]
    impls["quantpack"] = (r4, lambda i, x: mm.mixed_mm(x, *qp[i], group_size=GS, bits=4), Wd)
    return impls


def bench(ms, dtypes, bw, peak):
    rows = []
    names = ["cublas", "hqq_ref", "ao_triton", "tinygemm", "gemlite", "quantpack"]
    for dtype_name in dtypes:
        dtype = DT[dtype_name]
        for n, k in SHAPES:
            nbytes4 = k * n // 2 + 2 * 2 * (k // GS) * n
            r4 = replicas(nbytes4, L2)
            impls = peers(n, k, dtype, r4)
            log(f"\n== {dtype_name} N={n} K={k} gs={GS}  (cuBLAS {dtype_name} F.linear is the x1.00 baseline)")
            log(f"{'M':>5} {'floor us':>9} | " + " | ".join(f"{nm:>18}" for nm in names) +
                " | quantpack TB/s TFLOP/s %floor")
            for m in ms:
                x = torch.randn(m, k, dtype=dtype, device="cuda")
                floor = max((nbytes4 + 2 * m * k + 2 * m * n) / bw, 2 * m * n * k / peak) * 1e6
                line = {"dtype": dtype_name, "N": n, "K": k, "M": m, "floor_us": floor}
                # cuBLAS and quantpack back to back, twice, each keeping its faster median: the GPU's clock drifts
                # (heat, power) over the minutes the peers take, which would bias a ratio of times taken far apart
                order = ["cublas", "quantpack", "cublas", "quantpack"] + [nm for nm in impls if nm not in
                                                                          ("cublas", "quantpack")]
                for name in order:
                    if name not in impls or (name in line and line[name] is None):
                        continue
                    r, f, wref = impls[name]
                    try:
                        out = f(0, x)
                        ref = x.float() @ wref.t()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < (2e-2 if dtype == torch.bfloat16 else 5e-3):
                            if name == "quantpack":
                                raise RuntimeError(f"wrong result, rel err {err:.2e}")
                            line[name + "_fail"] = f"timed, but rel err {err:.2e} is over the bar"  # a peer's own error
                        t, mode = graph_time([lambda i=i: f(i, x) for i in range(r)])
                        line[name] = min(t * 1e3, line.get(name) or math.inf)
                        line[name + "_err"] = err
                    except Exception as e:
                        line[name] = None
                        line[name + "_fail"] = repr(e)[:160]
                rows.append(line)
                b = line.get("cublas")
                cells = []
                for nm in names:
                    t = line.get(nm)
                    cells.append(f"{t:8.1f} x{b / t:5.2f}   " if t and b else f"{'n/a':>18}")
                q = line.get("quantpack")
                extra = ""
                if q:
                    extra = (f" | {(nbytes4 + 2 * m * k + 2 * m * n) / (q * 1e-6) / 1e12:5.2f} "
                             f"{2 * m * n * k / (q * 1e-6) / 1e12:7.1f} {floor / q * 100:5.0f}%")
                line["config"] = config_label(mm.pick_config(False, 4, m, n, k, x.device))
                extra += f"  [{line['config']}]"
                log(f"{m:5d} {floor:9.1f} | " + " | ".join(cells) + extra)
                for nm in names:
                    if line.get(nm + "_fail"):
                        log(f"      {nm} failed: {line[nm + '_fail']}")
            del impls
            torch.cuda.empty_cache()
    return rows


def kernel_lines(section, rows):
    """The ``main`` and ``w8`` sections' rows as ``kernels.jsonl`` cells (a peer over its accuracy bar is left out)."""
    out = []
    for r in rows:
        if section == "main":
            for name in ("cublas", "hqq_ref", "ao_triton", "tinygemm", "gemlite", "quantpack"):
                if r.get(name) and not r.get(name + "_fail"):
                    extra = {"config": r["config"]} if name == "quantpack" and "config" in r else {}
                    out.append(kernel_line(r["N"], r["K"], r["M"], 4, GS, r["dtype"], IMPL.get(name, name),
                                           r[name], r.get("cublas"), **extra))
        else:
            dtype = {str(v): name for name, v in DT.items()}[r["dtype"]]
            for name in ("cublas", "quantpack"):
                out.append(kernel_line(r["N"], r["K"], r["M"], 8, GS, dtype, name, r[name], r["cublas"],
                                       **({"config": r["path"]} if name == "quantpack" else {})))
    return out


def replicated(n, k, bits, dtype):
    """A random packed weight, its dense reference in ``dtype``, and enough copies of each
    (packed, dense) to exceed L2, so timed calls read their weights from HBM."""
    qw, s, z = random_packed(n, k, bits, dtype)
    w = ref_weight(qw, s, z, bits).to(dtype)
    qps = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(replicas(qw.numel() + 4 * s.numel(), L2) - 1)]
    ws = [w] + [w.clone() for _ in range(replicas(2 * n * k, L2) - 1)]
    return qw, s, z, w, qps, ws


def bench_transposed(ms, dtype, peak, bw):
    log("\n== transposed kernel (backward input gradient: x (M, N) @ W -> (M, K)) vs cuBLAS x @ W")
    rows = []
    for n, k in SHAPES:
        qw, s, z, w, qps, ws = replicated(n, k, 4, dtype)
        r4, r16 = len(qps), len(ws)
        for m in ms:
            x = torch.randn(m, n, dtype=dtype, device="cuda")
            out = mm.mixed_mm(x, qw, s, z, group_size=GS, transposed=True)
            ref = x.float() @ w.float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            tq, _ = graph_time([lambda i=i: mm.mixed_mm(x, *qps[i], group_size=GS, transposed=True) for i in range(r4)])
            tc, _ = graph_time([lambda i=i: x @ ws[i] for i in range(r16)])
            cfg = mm.pick_config(True, 4, m, n, k, x.device)
            log(f"N={n:5d} K={k:5d} M={m:5d}: quantpack {tq * 1e3:8.1f}us ({2 * m * n * k / tq / 1e9:6.1f} TFLOP/s) "
                f"cuBLAS {tc * 1e3:8.1f}us  x{tc / tq:.2f}  err {err:.1e}  [{cfg.path} {cfg.block_m}x{cfg.block_n}x{cfg.block_r} s{cfg.split}]")
            rows.append({"N": n, "K": k, "M": m, "quantpack": tq * 1e3, "cublas": tc * 1e3, "err": err})
    return rows


def bench_dequant(bw):
    """The dequant kernel at each benchmark shape, against the large copy's bandwidth (the target's figure) and against
    a copy of the same bytes timed the same way (what a kernel of this size can reach); at 4096^2 every tile of
    DEQUANT_VARIANTS is timed beside the shipped one."""
    log(f"\n== dequant kernel (-> bf16) vs copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)")
    rows = []
    for n, k in SHAPES:
        for bits in (4, 8):
            for axis in (1, 0):
                for gs in (64, 128):
                    rows.append(_bench_dequant_one(n, k, bits, axis, gs, bw, sweep=(n, k) == SHAPES[0]))
    return rows


def _bench_dequant_one(n, k, bits, axis, gs, bw, sweep):
    qw, s, z = random_packed(n, k, bits, torch.bfloat16, axis=axis, gs=gs)
    out = dequantize(qw, s, z, group_size=gs, bits=bits, axis=axis)
    assert torch.equal(out, ref_weight(qw, s, z, bits, gs, axis).to(torch.bfloat16)), "dequant mismatch"
    nbytes = qw.numel() + 2 * s.numel() * 2 + n * k * 2
    r = replicas(nbytes, L2)
    cps = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(r - 1)]
    # the same bytes moved by a copy (half read, half written), in the same graph timing
    srcs = [torch.randn(nbytes // 4, dtype=torch.bfloat16, device="cuda") for _ in range(r)]
    dsts = [torch.empty_like(v) for v in srcs]
    same, _ = graph_time([lambda i=i: dsts[i].copy_(srcs[i]) for i in range(r)])
    srcs = dsts = None  # (their memory)
    choose = dq_mod._dequant_block
    shipped = choose(bits, axis, gs)
    variants = {}
    for blk in [shipped] + ([b for b in DEQUANT_VARIANTS if b != shipped] if sweep else []):
        dq_mod._dequant_block = lambda *_, blk=blk: blk
        variants[blk], _ = graph_time([lambda i=i: dequantize(*cps[i], group_size=gs, bits=bits, axis=axis)
                                       for i in range(r)])
    dq_mod._dequant_block = choose
    t = variants[shipped]
    best = min(variants, key=variants.get)
    tbs = nbytes / (t * 1e-3)
    log(f"{n}x{k} bits={bits} axis={axis} gs={gs}: {t * 1e3:7.1f}us  {tbs / 1e12:5.2f} TB/s  {tbs / bw * 100:5.1f}% of copy"
        f"  (same-size copy {same * 1e3:5.1f}us: {same / t * 100:5.1f}%)"
        + (f"  (best block {best}: {nbytes / (variants[best] * 1e-3) / bw * 100:5.1f}%)" if sweep else ""))
    return {"n": n, "k": k, "bits": bits, "axis": axis, "gs": gs, "us": t * 1e3, "pct_copy": tbs / bw * 100,
            "same_size_copy_us": same * 1e3, "variants": {str(b): v * 1e3 for b, v in variants.items()}}


@triton.jit
def _read_stream(q_ptr, out_ptr, STEPS: tl.constexpr, WARPS: tl.constexpr):
    """Read STEPS x (32 WARPS lanes x 16 bytes) contiguous int32 words per program and keep their XOR."""
    rows = tl.arange(0, 32 * WARPS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    base = tl.program_id(0) * STEPS * 128 * WARPS
    acc = tl.zeros((32 * WARPS, 4), dtype=tl.int32)
    for i in range(STEPS):
        acc ^= tl.load(q_ptr + base + i * 128 * WARPS + rows)
    tl.store(out_ptr + tl.program_id(0) * 128 * WARPS + rows, acc)


def bench_stream(dtype):
    """The read-only floor of each decode shape: the fastest of a few launch shapes of a kernel that
    reads the packed weight + scales/zeros once (one 16-byte load per lane per step, as the GEMV
    kernels do) and does nothing else, under the same CUDA-graph timing, against cuBLAS at M = 1."""
    log(f"\n== read-only floor: a kernel that only reads the packed bytes, vs cuBLAS {dtype} at M = 1")
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        ws = [w] + [w.clone() for _ in range(replicas(2 * n * k, L2) - 1)]
        tc, _ = graph_time([lambda i=i: F.linear(x, ws[i]) for i in range(len(ws))])
        w = ws = None  # (their memory)
        for bits in (4, 8):
            nbytes = n * k * bits // 8 + 4 * (k // GS) * n
            words = triton.cdiv(nbytes, 4 * 128 * 4 * 32) * 128 * 4 * 32  # whole programs of the largest shape
            qs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device="cuda")
                  for _ in range(replicas(4 * words, L2))]
            best = math.inf
            for warps, steps in ((4, 8), (4, 16), (4, 32), (2, 16), (8, 8)):
                programs = words // (128 * warps * steps)
                out = torch.empty(programs * 128 * warps, dtype=torch.int32, device="cuda")
                t, _ = graph_time([lambda q=q: _read_stream[(programs,)](q, out, STEPS=steps, WARPS=warps,
                                                                          num_warps=warps) for q in qs])
                best = min(best, t)
            log(f"N={n:5d} K={k:5d} W{bits}: {nbytes / 1e6:5.1f} MB read in {best * 1e3:5.1f} us "
                f"({nbytes / (best * 1e-3) / 1e12:.2f} TB/s); cuBLAS M=1 {tc * 1e3:5.1f} us: at most x{tc / best:.2f}")
            rows.append({"N": n, "K": k, "bits": bits, "bytes": nbytes, "us": best * 1e3, "cublas": tc * 1e3})
            del qs
    return rows


DQ = mm.KernelConfig("dq")


def config_label(cfg) -> str:
    """The dispatched config as the tables print it.
    (mma: x = rows of x per program, r = rows of N per warp, d = chunks of loads in flight (0: all), /kN = N warps
    splitting each program's K range)
    (wgmma: rows of x x weight rows x in-features per K step, d = TMA ring depth, /P = producer warp)"""
    tile = (f"x{max(16, cfg.block_m)} r{cfg.block_n} d{cfg.num_stages} " if cfg.path == "mma"
            else f"{cfg.block_m}x{cfg.block_n}xk{2 * cfg.block_r} d{cfg.num_stages} " if cfg.path == "wgmma"
            else f"{cfg.block_m}x{cfg.block_n}x{cfg.block_r} ")
    flags = (f"{'/P' if cfg.producer else ''}{'/rawq' if cfg.rawq else ''}{'/words' if cfg.words else ''}"
             f"{f'/k{cfg.k_warps}' if cfg.k_warps > 1 else ''}")
    return f"{cfg.path}{flags} {tile}s{cfg.split} w{cfg.num_warps}"


def bench_w8(ms, bw, peak, dtype):
    log(f"\n== W8A16 (8-bit weights) vs cuBLAS, {dtype}: the dispatched path, and dequantize + cuBLAS (`dq`)")
    rows = []
    for n, k in SHAPES:
        qw, s, z, w, qps, ws = replicated(n, k, 8, dtype)
        nbytes = qw.numel() + 4 * s.numel()
        r8, r16 = len(qps), len(ws)
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = mm.mixed_mm(x, qw, s, z, group_size=GS, bits=8)
            ref = x.float() @ w.float().t()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            tq, _ = graph_time([lambda i=i: mm.mixed_mm(x, *qps[i], group_size=GS, bits=8) for i in range(r8)])
            tc, _ = graph_time([lambda i=i: F.linear(x, ws[i]) for i in range(r16)])
            tdq = math.nan
            if m > 1:  # (the fused path this replaces beyond decode)
                tdq, _ = graph_time([lambda i=i: mm.mixed_mm(x, *qps[i], group_size=GS, bits=8, config=DQ)
                                     for i in range(r8)])
            cfg = mm.pick_config(False, 8, m, n, k, x.device)
            floor = max((nbytes + 2 * m * (n + k)) / bw, 2 * m * n * k / peak) * 1e6  # us
            log(f"N={n:5d} K={k:5d} M={m:5d}: quantpack W8 {tq * 1e3:7.1f}us ({nbytes / (tq * 1e-3) / 1e12:.2f} TB/s, "
                f"{2 * m * n * k / (tq * 1e-3) / 1e12:5.0f} TFLOP/s) cuBLAS {tc * 1e3:7.1f}us  x{tc / tq:.2f}  "
                f"dq {tdq * 1e3:7.1f}us x{tc / tdq:.2f}  floor {floor:6.1f}us  err {err:.1e}  [{config_label(cfg)}]")
            rows.append({"N": n, "K": k, "M": m, "dtype": str(dtype), "quantpack": tq * 1e3, "cublas": tc * 1e3,
                         "dq": tdq * 1e3, "floor": floor, "err": err, "path": cfg.path})
    return rows


def main():
    global L2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--tr-ms", default="1024,4096")
    ap.add_argument("--w8-ms", default="1,16,64,256,1024,4096", help="rows of x for the W8A16 section")
    ap.add_argument("--tune-ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--tune-tr-ms", default="256,1024,4096")
    ap.add_argument("--tune-w8", default=1, type=int, help="also tune 8-bit weights (0: skip)")
    ap.add_argument("--tune-w8-ms", default="1", help="rows of x the 8-bit weights are tuned at")
    ap.add_argument("--tune-paths", default="", help="tune only these paths (comma-separated; default all)")
    ap.add_argument("--tune-shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="(N, K) shapes to tune, as NxK,...: e.g. 6144x4096,28672x4096 for merged q/k/v and gate/up")
    ap.add_argument("--sections", default="transposed,dequant,w8,stream,main")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--results", default=None, help="append the main and W8A16 cells to DIR/kernels.jsonl "
                    "(default benchmarks/results; '' records nothing)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dtypes = args.dtypes.split(",")
    p = torch.cuda.get_device_properties(0)
    L2 = getattr(p, "L2_cache_size", 50 * 2 ** 20)
    log(f"{p.name}, {p.multi_processor_count} SMs, L2 {L2 / 2 ** 20:.0f} MB, torch {torch.__version__}, "
        f"triton {triton.__version__}, config key {mm.device_key(torch.device('cuda'))}")
    bw, peak = ceilings()
    log(f"copy {bw / 1e12:.2f} TB/s, cuBLAS bf16 8192^3 {peak / 1e12:.0f} TFLOP/s")
    results = {"device": p.name, "bw": bw, "peak": peak}
    if args.tune:
        log(f"[{time.strftime('%H:%M:%S')}] tune")
        tune([int(v) for v in args.tune_ms.split(",") if v], [int(v) for v in args.tune_tr_ms.split(",") if v], "bf16",
             L2, args.out, [int(v) for v in args.tune_w8_ms.split(",") if v] if args.tune_w8 else [],
             tuple(p for p in args.tune_paths.split(",") if p),
             [tuple(int(v) for v in shape.split("x")) for shape in args.tune_shapes.split(",")])
    if args.bench:
        for name, fn in (("transposed", lambda: bench_transposed([int(v) for v in args.tr_ms.split(",")],
                                                                 torch.bfloat16, peak, bw)),
                         ("dequant", lambda: bench_dequant(bw)),
                         ("w8", lambda: [row for d in dtypes for row in bench_w8([int(v) for v in args.w8_ms.split(",")],
                                                                                 bw, peak, DT[d])]),
                         ("stream", lambda: bench_stream(DT[dtypes[0]])),
                         ("main", lambda: bench(ms, dtypes, bw, peak))):
            if name not in args.sections.split(","):
                continue
            log(f"[{time.strftime('%H:%M:%S')}] {name}")
            try:
                results[name] = fn()
                if name in ("main", "w8"):
                    record("kernels", kernel_lines(name, results[name]), args.results)
            except Exception:
                traceback.print_exc()
            if args.out:
                json.dump(results, open(os.path.join(args.out, f"bench_{'_'.join(dtypes)}.json"), "w"), indent=1)


L2 = 50 * 2 ** 20

if __name__ == "__main__":
    main()
