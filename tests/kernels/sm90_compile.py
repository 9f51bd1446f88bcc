"""Compile the mma kernel for sm_90 (Hopper) on any machine, GPU or not: Triton lowers it to PTX and
runs its bundled ptxas, so a malformed inline-PTX chunk fails here, not first on a GPU. Run without
TRITON_INTERPRET (which turns the kernels into Python functions); prints one JSON line per variant:
``{"variant": [...], "mma": <mma.sync instructions in the PTX>, "cubin": <bytes>}`` or ``"error"``.

    python tests/kernels/sm90_compile.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from quantpack.kernels import mma_gemv  # noqa: E402

ARGS = {"x_ptr": "*{x}", "qm_ptr": "*i32", "s_ptr": "*{x}", "z_ptr": "*{x}", "bias_ptr": "*{x}", "out_ptr": "*{x}",
        "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
        "stride_om": "i32"}
# (x dtype, 8-row fragments of x, tiles per warp, nibble planes, rawq, depth, warps): the modes and
# fragment counts launch_mma_gemv can ask for
VARIANTS = [("bf16", 1, 1, 1, True, 1, 2), ("bf16", 2, 2, 1, True, 2, 1), ("bf16", 2, 1, 1, False, 2, 4),
            ("bf16", 4, 2, 1, False, 1, 1), ("bf16", 2, 1, 2, True, 2, 2), ("fp16", 2, 2, 1, False, 2, 2)]


def mma_per_chunk(frags, nt, planes, rawq):
    """MMAs per 64-in-feature chunk: 4 k-steps x fragments x (tiles x planes, plus the sums MMA if rawq)."""
    return 4 * frags * (nt * planes + int(rawq))


def compile_variant(xname, frags, nt, planes, rawq, depth, warps):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[xname]
    asm, cons = mma_gemv.chunk_asm(dtype, frags, "raw_sum" if rawq else "zero")
    asm2, cons2 = mma_gemv.chunk_asm(dtype, frags, "raw" if rawq else "zero")
    const = dict(G=128, HAS_BIAS=True, FP16=xname == "fp16", USE_ASM=True, ASM=asm, CONS=cons, ASM2=asm2,
                 CONS2=cons2, RAWQ=rawq, FRAGS=frags, NT=nt * planes, PLANES=planes, DEPTH=depth, WARPS=warps,
                 GROUPS=8, SPLIT=4)
    sig = {name: ty.format(x=xname) for name, ty in ARGS.items()} | {name: "constexpr" for name in const}
    kernel = triton.compile(ASTSource(fn=mma_gemv._mma_gemv_kernel, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    return kernel.asm["ptx"].count("mma.sync.aligned.m16n8k16"), len(kernel.asm["cubin"])


if __name__ == "__main__":
    for v in VARIANTS:
        try:
            mma, cubin = compile_variant(*v)
            print(json.dumps({"variant": v, "mma": mma, "cubin": cubin}), flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-2000:]}), flush=True)
