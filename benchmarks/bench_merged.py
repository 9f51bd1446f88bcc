"""Merged decode projections (quantpack/modules/merged.py) against the same layers called one by one, on one GPU.

For the 8B model's q/k/v (4096 + 1024 + 1024 out of 4096) and gate/up (2 x 14336 out of 4096) at decode sizes,
bf16, group size 128: GPU time of one block (CUDA-graph replay, weight replicas rotated past L2, random data),
next to cuBLAS bf16 for the same block (three / two ``F.linear`` and one over the concatenated weight), and the
host time of one eager call of the block (launch plans on). Correctness first: every merged output against the
float32 product with the reference dequantization.

    python benchmarks/bench_merged.py                # M = 1, 4, 8; 4- and 8-bit
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from quantpack import reference  # noqa: E402
from quantpack.modules.linear import QuantLinear  # noqa: E402
from quantpack.modules.merged import merge_projections, unmerge_projections  # noqa: E402
from timing import graph_time, host_us  # noqa: E402

BLOCKS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def make_block(kind: str, outs, k: int, bits: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    block = nn.Module()
    for name, n in zip(BLOCKS[kind], outs):
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        setattr(block, name, QuantLinear.from_linear(lin, bits=bits, group_size=128, method="rtn",
                                                     dtype=torch.bfloat16))
    return block


def run_block(block, kind, x):
    return [getattr(block, name)(x) for name in BLOCKS[kind]]


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("Error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    l2 = 60e6 if "H200" in name else 50e6
    print(name, torch.__version__, flush=True)
    rows = []
    k = 4096
    for bits in map(int, args.bits.split(",")):
        for kind, outs in (("qkv", (4096, 1024, 1024)), ("gate_up", (14336, 14336))):
            wbytes = sum(outs) * k * bits // 8
            reps = max(2, int(2 * l2 / wbytes) + 1)
            blocks = [make_block(kind, outs, k, bits, seed) for seed in range(reps)]
            ref_w = torch.cat([reference.dequantize(getattr(blocks[0], n).packed, torch.float32)
                               for n in BLOCKS[kind]])
            dense = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in outs]
                     for _ in range(max(2, int(2 * l2 / (2 * sum(outs) * k)) + 1))]
            dense_cat = [torch.cat(ws) for ws in dense]
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = x.float() @ ref_w.t()
                row = {"bits": bits, "block": kind, "outs": outs, "m": m}
                row["cublas_us"] = graph_time([lambda ws=ws: [F.linear(x, w) for w in ws] for ws in dense])[0] * 1e3
                row["cublas_cat_us"] = graph_time([lambda w=w: F.linear(x, w) for w in dense_cat])[0] * 1e3
                for label, merge in (("alone", False), ("merged", True)):
                    for b in blocks:
                        (merge_projections if merge else unmerge_projections)(b)
                    first = blocks[0]
                    got = torch.cat(run_block(first, kind, x), dim=-1).float()
                    row[f"{label}_err"] = ((got - want).norm() / want.norm()).item()
                    row[f"{label}_us"] = graph_time([lambda b=b: run_block(b, kind, x) for b in blocks])[0] * 1e3
                    row[f"{label}_host_us"] = host_us(lambda: run_block(first, kind, x), reps=2000, rounds=5)
                row["speedup"] = row["alone_us"] / row["merged_us"]
                row["x_cublas_merged"] = row["cublas_us"] / row["merged_us"]
                rows.append(row)
                print(json.dumps({key: (round(v, 5) if isinstance(v, float) else v) for key, v in row.items()}),
                      flush=True)
            del blocks, dense, dense_cat
            torch.cuda.empty_cache()
    print(f"\n{'bits':>4} {'block':>8} {'M':>3} {'cuBLAS':>8} {'cuBLAS cat':>10} {'alone':>8} {'merged':>8} "
          f"{'speedup':>8} {'x cuBLAS':>9} {'host alone':>11} {'host merged':>12} {'err':>8}")
    for r in rows:
        print(f"{r['bits']:>4} {r['block']:>8} {r['m']:>3} {r['cublas_us']:>8.2f} {r['cublas_cat_us']:>10.2f} "
              f"{r['alone_us']:>8.2f} {r['merged_us']:>8.2f} {r['speedup']:>8.2f} {r['x_cublas_merged']:>9.2f} "
              f"{r['alone_host_us']:>11.1f} {r['merged_host_us']:>12.1f} {r['merged_err']:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
