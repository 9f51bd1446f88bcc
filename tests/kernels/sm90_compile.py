"""Compile the mma kernel for sm_90 (Hopper) on any machine, GPU or not: Triton lowers it to PTX and
runs its bundled ptxas, so a malformed inline-PTX chunk fails here, not first on a GPU. The kernel's
compile-time arguments come from :func:`quantpack.kernels.mma_gemv.kernel_constexprs`, as a launch
gets them. Run without TRITON_INTERPRET (which turns the kernels into Python functions); prints one
JSON line per variant: ``{"variant": [...], "mma": <mma.sync instructions in the PTX>, "cubin": <bytes>}``
or ``"error"``.

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
        "ws_ptr": "*fp32", "cnt_ptr": "*i32", "ids_ptr": "*i32", "tw_ptr": "*fp32", "M": "i32", "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_om": "i32", "E": "i32", "XDIV": "i32"}
# (x dtype, rows of x, bits, rawq asked, tiles per warp, 16-row blocks per program, depth, warps, PDL): each
# zero mode, 1 / 2 / 4 fragments of x, two and four tiles per warp, 8-bit planes, fp16, launched with PDL,
# depth 0 (every load up front, through _hold's PTX), warps splitting K (a tenth field: kwarps)
VARIANTS = [("bf16", 1, 4, True, 1, 1, 1, 2, False), ("bf16", 16, 4, True, 2, 1, 2, 1, False),
            ("bf16", 16, 4, False, 1, 1, 2, 4, False), ("bf16", 32, 4, False, 2, 2, 1, 1, False),
            ("bf16", 16, 8, True, 1, 1, 2, 2, False), ("fp16", 16, 4, False, 2, 1, 2, 2, False),
            ("bf16", 16, 4, True, 4, 1, 2, 2, False), ("bf16", 16, 4, False, 4, 1, 2, 1, False),
            ("bf16", 1, 4, True, 1, 1, 2, 2, True), ("bf16", 64, 4, False, 2, 2, 1, 1, True),
            ("bf16", 1, 4, True, 1, 1, 0, 4, False), ("fp16", 8, 4, False, 2, 1, 0, 2, True),
            ("bf16", 1, 8, True, 1, 1, 0, 4, False), ("bf16", 1, 4, True, 1, 1, 0, 1, False, 4),
            ("fp16", 9, 4, False, 1, 1, 2, 2, False, 2), ("bf16", 1, 8, True, 1, 1, 2, 1, False, 8),
            ("bf16", 33, 4, False, 1, 2, 2, 1, False, 4),
            ("bf16", 1, 4, True, 1, 1, 0, 2, False, 1, 1), ("bf16", 16, 4, False, 1, 1, 2, 2, False, 1, 2),
            ("bf16", 1, 4, True, 1, 1, 0, 2, False, 1, 1, 8), ("bf16", 1, 4, True, 1, 1, 2, 2, False, 1, 1, 6),
            ("bf16", 16, 4, True, 1, 1, 2, 2, False, 2, 2),
            ("bf16", 1, 4, True, 1, 1, 2, 2, True, 1, 1), ("bf16", 1, 4, True, 1, 1, 0, 2, True, 1, 1, 8)]
# (an eleventh field: mixture-of-experts rows, 1 a (token, slot) pair per row, 2 blocks of 16 rows per expert; a
# twelfth: pair rows whose token's top-k slots the launch sums; the last two: a MoE decode block's gate_up and down
# with PDL)
N, K, GROUP = 4096, 4096, 128


def run_script(name: str, variants: list) -> list[dict]:
    """Run a compile script of this folder in a subprocess without TRITON_INTERPRET (which would turn the
    kernels into Python functions) and return its JSON lines, checked to name exactly ``variants``."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), name)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"variant"')]
    assert [tuple(line["variant"]) for line in lines] == variants, done.stderr[-2000:]
    return lines


def compile_variant(xname, m, bits, rawq, tiles, blocks, depth, warps, pdl, kwarps=1, experts=0, top_k=0):
    """Compile one variant; return (its constexprs, mma.sync count in the PTX, cubin bytes)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[xname]
    grid = mma_gemv.mma_grid(N, K, GROUP, warps, 16 // kwarps if depth == 0 else 4, tiles, bits, blocks,
                             kwarps)  # (depth 0: short programs)
    const = mma_gemv.kernel_constexprs(dtype, m, grid, group_size=GROUP, depth=depth, rawq=rawq, bits=bits,
                                       has_bias=not experts, use_asm=True, pdl=pdl) | {"EXPERTS": experts,
                                                                                        "TOPK": top_k}
    sig = {name: ty.format(x=xname) for name, ty in ARGS.items()} | {name: "constexpr" for name in const}
    kernel = triton.compile(ASTSource(fn=mma_gemv._mma_gemv_kernel, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": grid.warps * grid.kwarps, "num_stages": 1, "launch_pdl": pdl})
    ptx = kernel.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl, "PDL: the kernel waits for the previous grid exactly when asked"
    return const, ptx.count("mma.sync.aligned.m16n8k16"), len(kernel.asm["cubin"]), ptx.count(".b8 ksum[")


def mma_per_chunk(const):
    """MMAs per 64-in-feature chunk: 4 k-steps x fragments x (tiles or planes, plus the sums MMA if rawq)."""
    return 4 * const["FRAGS"] * (const["NT"] + int(const["RAWQ"]))


if __name__ == "__main__":
    for v in VARIANTS:
        try:
            const, mma, cubin, ksum = compile_variant(*v)
            print(json.dumps({"variant": v, "mma": mma, "per_chunk": mma_per_chunk(const), "cubin": cubin,
                              "ksum": ksum}),
                  flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-2000:]}), flush=True)
