"""Compile the W4A8-FP8 wgmma kernel (Gluon, w4a8_wgmma.py) for sm_90 on any machine, GPU or not, and run the bundled
ptxas on its PTX: a Gluon API or layout error fails here, and so do ptxas serializing the asynchronous MMAs (C7515),
spills, and the e4m3 codes missing the A fragment's registers (the kernel's convert_layout to the operand layout must
be trivial, or Gluon refuses it). Run without TRITON_INTERPRET; prints one JSON line per variant: ``{"variant": [...],
"wgmma": <wgmma.mma_async in the PTX>, "per_step": <expected per K step>, "serialized": <bool>, "spills": <bytes>,
"fp8": <the MMAs are e4m3 x e4m3>, "regs": <registers per thread>}`` or ``"error"``.

    python tests/kernels/sm90_compile_w4a8.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from triton.compiler import ASTSource  # noqa: E402

from quantpack.kernels import w4a8, w4a8_wgmma  # noqa: E402

# (BLOCK_M, BLOCK_N, group size, stages, bias, producer warp): the dispatched tile, 64-wide groups (64-wide K steps),
# 8 MMA warps, 64 rows of x, and the producer warp
VARIANTS = [(128, 64, 128, 4, True, False), (128, 64, 64, 4, False, False), (128, 128, 256, 3, True, False),
            (64, 64, 128, 2, False, True), (128, 64, 128, 4, True, True)]
# the plain Triton kernel (w4a8.py, the fallback; the interpreter runs only its float32 form): (SWAP, PAIR)
TRITON_VARIANTS = [("triton", False, False), ("triton", True, True)]


def compile_variant(bm, bn, gs, stages, bias, producer):
    bk = w4a8_wgmma.block_k(gs)
    sig = w4a8_wgmma.descriptor_types(bm, bn, bk)
    sig |= {"s_ptr": "*bf16", "z_ptr": "*bf16", "xsum_ptr": "*fp32", "xs_ptr": "*fp32", "bias_ptr": "*bf16",
            "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32"}
    const = {"G": gs, "HAS_BIAS": bias, "STAGES": stages, "PRODUCER": producer, "num_warps": bn // 16}
    fn = w4a8_wgmma._w4a8_wgmma_kernel
    # as a launch specializes them (16-byte aligned pointers, N, K and out's row stride multiples of 16)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("s_ptr", "z_ptr", "xsum_ptr", "xs_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_om")}
    sig |= {name: "constexpr" for name in const}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": bn // 16, "maxnreg": w4a8_wgmma.maxnreg(bm, bn // 16, producer)})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-1000:])
    log = done.stdout + done.stderr
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    mmas = re.findall(r"wgmma\.mma_async\S*", ptx)
    regs = re.findall(r"Used (\d+) registers", log)
    return len(mmas), "C7515" in log, spills, all(".e4m3.e4m3" in m for m in mmas), regs


def compile_triton(swap, pair):
    """The Triton kernel as the GPU runs it (FP8 codes, not the interpreter's float32): whether its PTX has e4m3 x
    e4m3 wgmma."""
    sig = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "xsum_ptr": "*fp32", "qw_ptr": "*u8", "s_ptr": "*bf16",
           "z_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_om": "i32"}
    const = {"GS": 128, "HAS_BIAS": True, "F32": False, "SWAP": swap, "PAIR": pair, "BLOCK_M": 128, "BLOCK_N": 128,
             "BLOCK_R": 64, "GROUP_M": 8}
    sig |= {name: "constexpr" for name in const}
    kernel = triton.compile(ASTSource(fn=w4a8._w4a8_kernel, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
    mmas = re.findall(r"wgmma\.mma_async\S*", kernel.asm["ptx"])
    return len(mmas), all(".e4m3.e4m3" in m for m in mmas)


if __name__ == "__main__":
    for v in TRITON_VARIANTS:
        try:
            count, fp8 = compile_triton(*v[1:])
            print(json.dumps({"variant": v, "wgmma": count, "fp8": fp8}), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"variant": v, "error": repr(exc)[-3000:]}), flush=True)
    for v in VARIANTS:
        try:
            count, serialized, spills, fp8, regs = compile_variant(*v)
            per_step = w4a8_wgmma.block_k(v[2]) // 32
            print(json.dumps({"variant": v, "wgmma": count, "per_step": per_step, "serialized": serialized,
                              "spills": spills, "fp8": fp8, "regs": regs}), flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-3000:]}), flush=True)
