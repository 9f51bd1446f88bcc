"""Compile the wgmma kernel (Gluon) for sm_90 on any machine, GPU or not, and run the bundled ptxas
on its PTX: a Gluon API or layout error fails here, and so does ptxas serializing the asynchronous
MMAs (its C7515 notice), which costs the kernel half its speed. The descriptors' types come from
:func:`quantpack.kernels.wgmma_mm.descriptor_types`, as a launch builds them. The SASS (cuobjdump)
gives the registers each static wgmma site reads its A operand from: a site must not share them with
the site that runs next, whose dequant writes its own operand while the MMA before it still reads.
Run without TRITON_INTERPRET; prints one JSON line per variant: ``{"variant": [...], "wgmma":
<wgmma.mma_async in the PTX>, "per_step": <expected per K step>, "serialized": <bool>, "spills": <bytes
spilled and reloaded>, "operands":
[[A registers of each site, in program order], ...]}`` or ``"error"``.

    python tests/kernels/sm90_compile_wgmma.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from quantpack.kernels import wgmma_host, wgmma_mm  # noqa: E402

# (weight bits, x dtype, scales dtype, BLOCK_M, BLOCK_N, BLOCK_K, split, stages, group size, bias, producer warp[,
# trace[, rawq[, grouped]]]): the tiles the tuner offers, both activation dtypes, float32 scales, 64-wide groups, split-K,
# with and without a producer warp (also split: a partial last wave's tiles, balance_last_wave), the profiling build
# (timeline stamps) of the split tile (with and without a producer warp, and of RAWQ), 8-bit weights, RAWQ (4-bit
# weights multiplied raw, the scales applied per K step), and the grouped build (experts' blocks, MoE prefill)
VARIANTS = [(4, "bf16", "bf16", 64, 64, 128, 4, 4, 128, True, False),
            (4, "bf16", "bf16", 256, 128, 64, 1, 3, 128, False, False),
            (4, "fp16", "fp16", 32, 64, 64, 2, 3, 64, True, False),
            (4, "bf16", "fp32", 16, 128, 128, 1, 4, 128, False, False),
            (4, "fp16", "fp16", 128, 64, 128, 2, 2, 256, False, False),
            (4, "bf16", "bf16", 64, 64, 128, 4, 4, 128, True, True, True),
            (4, "fp16", "bf16", 256, 128, 64, 1, 3, 128, False, True),
            (4, "bf16", "bf16", 256, 64, 64, 1, 3, 128, False, True),
            (4, "bf16", "bf16", 256, 128, 64, 2, 3, 128, False, True),
            (4, "bf16", "bf16", 64, 64, 128, 4, 4, 128, False, False, True),
            (8, "bf16", "bf16", 64, 64, 128, 4, 4, 128, True, False),
            (8, "fp16", "fp16", 128, 64, 64, 2, 3, 64, False, True),
            (8, "bf16", "bf16", 256, 128, 64, 1, 3, 128, False, True),
            (4, "bf16", "bf16", 16, 64, 128, 4, 4, 128, False, True, True, True),
            (4, "fp16", "fp16", 32, 128, 64, 2, 4, 64, True, True, False, True),
            (4, "bf16", "bf16", 64, 64, 128, 1, 4, 128, False, False, False, False, True),
            (4, "bf16", "bf16", 64, 128, 64, 1, 4, 128, False, True, False, False, True)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compile_variant(bits, xname, sname, bm, bn, bk, split, stages, gs, bias, producer, trace=False, rawq=False,
                    grouped=False):
    grid = wgmma_host.WgmmaGrid(bm, bn, bk, split, stages, bn // 16, producer=producer, rawq=rawq)
    sig = wgmma_mm.descriptor_types(DTYPES[xname], DTYPES[sname], grid, bits)
    sig |= {"bias_ptr": f"*{xname}", "out_ptr": f"*{xname}", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "trace_ptr": "*i64",
            "experts_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "whole": "i32", "E": "i32"}
    const = {"G": gs, "HAS_BIAS": bias, "SPLIT": split, "STAGES": stages, "S_PLANE": 0, "PRODUCER": producer,
             "RAWQ": rawq, "TRACE": trace, "GROUPED": grouped, "num_warps": grid.warps}
    # as a launch specializes them (pointers 16-byte aligned, N, K and out's row stride multiples of 16): without it
    # the stores are scalar and the register counts are not the ones that run
    fn = wgmma_mm._wgmma_kernel
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("bias_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "trace_ptr", "N", "K", "stride_om")}
    options = {"num_warps": grid.warps} | ({"maxnreg": wgmma_host.producer_maxnreg(grid)} if producer else {})
    sig |= {name: "constexpr" for name in const}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "k.cubin")
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", cubin], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-1000:])
        cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    log = done.stdout + done.stderr
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return ptx.count("wgmma.mma_async"), "C7515" in log, spills, operand_sites(sass)


def operand_sites(sass: str) -> list[list[int]]:
    """The A-operand registers of each static wgmma site (a run of HGMMA closed by the one that commits
    the group, ``gsb0``), in program order: each HGMMA reads four from its base register."""
    sites, regs = [], []
    for line in sass.splitlines():
        hit = re.search(r"HGMMA\.\S+ R\d+, R(\d+),", line)
        if hit:
            regs += range(int(hit.group(1)), int(hit.group(1)) + 4)
            if "gsb0" in line:
                sites.append(sorted(regs))
                regs = []
    return sites


if __name__ == "__main__":
    for v in VARIANTS:
        try:
            count, serialized, spills, operands = compile_variant(*v)
            print(json.dumps({"variant": v, "wgmma": count, "per_step": v[5] // 16, "serialized": serialized,
                              "spills": spills, "operands": operands}), flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-2000:]}), flush=True)
