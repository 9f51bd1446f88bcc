"""Compile the decode attention kernels (quantpack.kernels.decode_attention) and the KV-cache write
(quantpack.kernels.fused_ops) for sm_90 (Hopper) on any machine, GPU or not: Triton lowers each variant to PTX and
runs its bundled ptxas. Run without TRITON_INTERPRET; prints one JSON line per variant:
``{"variant": [...], "mma": <tensor-core MMA instructions in the PTX>, "cubin": <bytes>}`` or ``"error"``.

    python tests/kernels/sm90_compile_decode.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
import triton  # noqa: E402

from quantpack.kernels import decode_attention as da  # noqa: E402
from quantpack.kernels import fused_ops  # noqa: E402

SPLIT_ARGS = ["q_ptr", "k_ptr", "v_ptr", "mask_ptr", "len_ptr", "part_ptr", "lse_ptr", "o_ptr"]
SPLIT_INTS = ["sq_b", "sq_h", "sq_m", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n", "sm_b", "sm_m", "sm_n",
              "so_b", "so_m", "so_h", "H_KV", "Q_LEN"]
# (kernel, dtype, GQA group, splits, mask): one split writes the output itself, several write partials; the
# combine kernel (splits); the KV write (rows a block, head size)
VARIANTS = [("split", "bf16", 4, 1, False), ("split", "bf16", 4, 4, True), ("split", "fp16", 8, 33, False),
            ("combine", "bf16", 4, 33, False), ("kv_write", "bf16", 128, 128, False),
            ("kv_write", "fp16", 16, 256, False)]


def compile_variant(kernel, xname, group, splits, mask):
    """Compile one variant; return (tensor-core MMA count in the PTX, cubin bytes)."""
    if kernel == "split":
        sig = {name: f"*{xname}" for name in SPLIT_ARGS} | {name: "i32" for name in SPLIT_INTS}
        sig |= {"mask_ptr": "*i1", "len_ptr": "*i64", "part_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
        const = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=da.BLOCK_N, SPLITS=splits,
                     HAS_MASK=mask, UPCAST=False)
        fn = da._decode_attention_split_kernel
    elif kernel == "combine":
        sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "o_ptr": f"*{xname}", "so_b": "i32", "so_m": "i32",
               "so_h": "i32", "H_Q": "i32", "Q_LEN": "i32"}
        const = dict(HEAD_DIM=128, BLOCK_D=128, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits))
        fn = da._decode_attention_combine_kernel
    else:
        names = ["H", "S", "L", "ROWS", "DK", "DV", "k_sb", "k_sh", "k_ss", "v_sb", "v_sh", "v_ss", "kc_sb",
                 "kc_sh", "kc_ss", "vc_sb", "vc_sh", "vc_ss"]
        sig = {name: f"*{xname}" for name in ("k_ptr", "v_ptr", "kc_ptr", "vc_ptr")} | {"len_ptr": "*i64"}
        sig |= {name: "i32" for name in names}
        const = dict(BLOCK_R=group, BLOCK_D=splits)
        fn = fused_ops._kv_write_kernel
    sig |= {name: "constexpr" for name in const}
    warps = fused_ops.kv_write_warps(group, splits) if kernel == "kv_write" else 4  # (as the launchers choose)
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    return ptx.count("mma.sync.aligned") + ptx.count("wgmma.mma_async"), len(compiled.asm["cubin"])


if __name__ == "__main__":
    for v in VARIANTS:
        try:
            mma, cubin = compile_variant(*v)
            print(json.dumps({"variant": v, "mma": mma, "cubin": cubin}), flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per variant; the test names it)
            print(json.dumps({"variant": v, "error": repr(exc)[-2000:]}), flush=True)
