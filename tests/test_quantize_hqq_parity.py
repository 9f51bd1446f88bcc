"""quantpack's hqq against the hqq library on a real weight matrix (layer 21's v_proj of
Qwen2.5-Coder-0.5B-Instruct, stored in bfloat16), where a fractional starting zero lost to the library."""
from pathlib import Path

import pytest
import torch

hqq_quantize = pytest.importorskip("hqq.core.quantize")
from safetensors.torch import load_file  # noqa: E402

from quantpack import quantize  # noqa: E402
from quantpack.reference import dequantize  # noqa: E402

DATA = Path(__file__).parent / "data" / "qwen2_5_coder_0_5b_l21_v_proj.safetensors"


def test_hqq_4bit_matches_library_on_real_weight():
    w = load_file(DATA)["weight"].float()
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    cfg = hqq_quantize.BaseQuantizeConfig(nbits=4, group_size=128, axis=1)
    lib = hqq_quantize.HQQLinear(lin, cfg, compute_dtype=torch.float16, device="cpu")
    lib_err = (lib.dequantize().float().reshape(w.shape) - w).pow(2).mean().item()
    ours = dequantize(quantize(w, bits=4, group_size=128, axis=1, method="hqq")).float()
    err = (ours - w).pow(2).mean().item()
    # float16 storage rounding allows a hair above the library; the fractional start was ~1% worse
    assert err <= lib_err * 1.002, (err, lib_err)
