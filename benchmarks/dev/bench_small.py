"""Decode shapes one at a time: cuBLAS, tinygemm and quantpack's shipped pick (and, with ``--against``, the pick of
another config table, timed alternately with it), on one GPU.

    python benchmarks/dev/bench_small.py [--shapes 2048x2048,3072x2048] [--bits 4,8] [--ms 1,4] [--against DIR]

For the small-model shapes (Llama-3.2-1B / 3B q/k/v, o, gate/up, down; the 8B's k/v) where tinygemm is the peer to
beat, and for before/after comparisons of a retuned table: ``--against DIR`` reads ``DIR/<gpu>.json`` (e.g. a copy of
``quantpack/kernels/configs`` from an earlier commit) and times its pick for each key as "before". Method as
bench_kernels.py: random data, every output checked against a float32 reference first (tinygemm's too, on its own
weight), medians of CUDA-graph replays over enough weight copies to exceed 4x L2. Prints one JSON line per key.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]  # benchmarks/ (the harness), the repo
from bench_kernels import GS, config_label, mm, random_packed, ref_weight, replicas  # noqa: E402
from quantpack.kernels import configs  # noqa: E402
from timing import graph_time  # noqa: E402

SHAPES = "3072x2048,2048x2048,16384x2048,2048x8192,5120x3072,3072x3072,16384x3072,3072x8192,1024x4096"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def tinygemm_us(x: torch.Tensor, n: int, k: int, l2: int) -> float:
    """tinygemm (``aten._weight_int4pack_mm``, bf16) on a random 4-bit weight of its own layout, checked first."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=x.device)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.rand(k // GS, n, 2, device=x.device, dtype=torch.bfloat16) * 0.02
    w = ((q - 8).float().reshape(n, k // GS, GS) * sz[..., 0].t().float()[:, :, None]
         + sz[..., 1].t().float()[:, :, None]).reshape(n, k)  # tinygemm: (q - 8) * scale + zero
    err = rel_err(torch.ops.aten._weight_int4pack_mm(x, packed, GS, sz), x.float() @ w.t())
    assert err < 2e-2, f"tinygemm: rel err {err:.2e}"
    r = replicas(packed.numel() * packed.element_size() + sz.numel() * 2, l2)
    ps = [packed.clone() for _ in range(r)]
    szs = [sz.clone() for _ in range(r)]
    return graph_time([lambda i=i: torch.ops.aten._weight_int4pack_mm(x, ps[i], GS, szs[i]) for i in range(r)])[0] * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="(N, K) as NxK,...")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--ms", default="1,4", help="rows of x (8-bit: M = 1 only, as the tables are tuned)")
    ap.add_argument("--against", default="", help="a directory holding another <gpu>.json config table")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    other = configs.read_configs(Path(args.against) / f"{mm.device_key(dev)}.json") if args.against else None
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "against": args.against or None}), flush=True)
    for bits in (int(b) for b in args.bits.split(",")):
        for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
            qw, s, z = random_packed(n, k, bits, torch.bfloat16)
            w = ref_weight(qw, s, z, bits)
            r4 = replicas(qw.numel() + 4 * s.numel(), l2)
            qps = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(r4 - 1)]
            dense = [w.to(torch.bfloat16)] + [w.to(torch.bfloat16) for _ in range(replicas(2 * n * k, l2) - 1)]
            for m in [int(v) for v in args.ms.split(",")] if bits == 4 else [1]:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = x.float() @ w.t()

                def quantpack_us(cfg):
                    err = rel_err(mm.mixed_mm(x, qw, s, z, group_size=GS, bits=bits, config=cfg), ref)
                    assert err < 1e-2, f"{config_label(cfg)}: rel err {err:.2e}"
                    return graph_time([lambda i=i: mm.mixed_mm(x, *qps[i], group_size=GS, bits=bits, config=cfg)
                                       for i in range(r4)])[0] * 1e3

                row = {"bits": bits, "n": n, "k": k, "m": m,
                       "cublas": graph_time([lambda d=d: F.linear(x, d) for d in dense])[0] * 1e3,
                       "tinygemm": tinygemm_us(x, n, k, l2) if bits == 4 else None}
                now = mm.pick_config(False, bits, m, n, k, dev)
                before = configs.nearest(other, False, bits, n, k, m) if other is not None else None
                # (alternated, each keeping its faster median: clocks drift between runs of one key)
                for _ in range(2 if before is not None else 1):
                    row["now"] = min(row.get("now", float("inf")), quantpack_us(now))
                    if before is not None:
                        row["before"] = min(row.get("before", float("inf")), quantpack_us(before))
                row["now_config"] = config_label(now)
                if before is not None:
                    row["before_config"] = config_label(before)
                print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
