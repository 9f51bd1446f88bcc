"""Compile the fused expert kernel (quantpack.kernels.moe) and the mma layout's activation kernel for sm_90
(Hopper) on any machine, GPU or not: Triton lowers each variant to PTX and runs its bundled ptxas. Run without TRITON_INTERPRET; prints one JSON line per
variant: ``{"variant": [...], "mma": <tensor-core MMA instructions in the PTX>, "cubin": <bytes>}`` or ``"error"``.

    python tests/kernels/sm90_compile_moe.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

# (the package exports the function under the module's name)
fe = importlib.import_module("quantpack.kernels.moe.fused_experts")
me = importlib.import_module("quantpack.kernels.moe.mma_experts")

ARGS = {"a_ptr": "*{a}", "qw_ptr": "*u8", "s_ptr": "*{x}", "z_ptr": "*{x}", "b_ptr": "*{x}", "out_ptr": "*{o}",
        "ids_ptr": "*i64", "tw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "P": "i32", "E": "i32",
        "N": "i32", "K": "i32", "G": "i32", "TOPK": "i32", "stride_a": "i32", "stride_out": "i32", "alpha": "fp32",
        "limit": "fp32", "STEPS": "i32"}
# (x dtype, path, bits, gate_up projection (else down), activation, bias, weight on input, block_m, block_n, block_r);
# pairs: gate_up writes split-K partial sums, down reads (two of) them
VARIANTS = [("bf16", "pairs", 4, True, "silu", False, False, 1, 64, 32),
            ("bf16", "pairs", 4, False, "silu", False, False, 1, 128, 32),
            ("bf16", "pairs", 8, True, "swiglu_oai", True, False, 1, 32, 32),
            ("fp16", "pairs", 4, True, "gelu", False, True, 1, 64, 16),
            ("bf16", "pairs", 4, False, "swiglu_oai", True, False, 1, 64, 32),
            ("bf16", "sorted", 4, True, "silu", False, False, 16, 64, 32),
            ("bf16", "sorted", 4, False, "silu", True, False, 64, 128, 32),
            ("bf16", "sorted", 4, True, "gelu_tanh", True, True, 32, 64, 32),
            ("fp16", "sorted", 8, False, "silu", False, False, 16, 64, 16)]


# the mma layout's activation kernel between gate_up and down: (name, x dtype, launched with PDL)
ACTIVATE_VARIANTS = [("activate", "bf16", False), ("activate", "fp16", True)]


def compile_activate(name, xname, pdl):
    """Compile mma_experts' activation kernel; return (0, cubin bytes); PDL's wait in the PTX exactly when asked."""
    const = dict(SPLIT=2, ACT=fe.ACTIVATIONS["silu"], BLOCK=me.ACT_BLOCK, PDL=pdl)
    sig = {"p_ptr": "*fp32", "h_ptr": f"*{xname}", "R": "i32", "I": "i32", "alpha": "fp32", "limit": "fp32"}
    kernel = triton.compile(ASTSource(fn=me._activate_kernel, signature=sig | {k: "constexpr" for k in const},
                                      constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "launch_pdl": pdl})
    ptx = kernel.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == ("griddepcontrol.launch_dependents" in ptx) == pdl
    return 0, len(kernel.asm["cubin"])


def compile_variant(xname, path, bits, gated, activation, bias, woi, block_m, block_n, block_r):
    sorted_mode = path == "sorted"
    const = dict(BITS=bits, GATED=gated, ACT=fe.ACTIVATIONS[activation], HAS_BIAS=bias, A_BY_TOKEN=gated,
                 SCALE_INPUT=woi and gated, SCALE_OUTPUT=not woi and not gated, SORTED=sorted_mode, DOT=sorted_mode,
                 DOT_F32=False, META_ROW=True, SPLIT_OUT=not (sorted_mode and gated),
                 A_SPLIT=2 if path == "pairs" and not gated else 0,
                 A_DT={"bf16": tl.bfloat16, "fp16": tl.float16}[xname], BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_R=block_r)
    out = xname if sorted_mode and gated else "fp32"
    a = "fp32" if path == "pairs" and not gated else xname
    sig = {name: ty.format(x=xname, o=out, a=a) for name, ty in ARGS.items()} | {name: "constexpr" for name in const}
    kernel = triton.compile(ASTSource(fn=fe._experts_kernel, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    return ptx.count("mma.sync.aligned") + ptx.count("wgmma.mma_async"), len(kernel.asm["cubin"])


if __name__ == "__main__":
    for v in VARIANTS + ACTIVATE_VARIANTS:
        try:
            mma, cubin = (compile_activate if v[0] == "activate" else compile_variant)(*v)
            print(json.dumps({"variant": v, "mma": mma, "cubin": cubin}), flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-2000:]}), flush=True)
