"""dispatch.choose against the decisions recorded in tests/kernels/data/dispatch.json (record_dispatch.py): which
kernel and config run per GPU (the shipped H100 and H200 tables, an A100 without one), shape, bits, dtype, layout,
direction and environment switch; and explain's answer. No GPU needed: the GPUs are given as data."""
import json

import pytest
import torch

from quantpack.kernels import configs, explain
from quantpack.kernels.dispatch import DeviceProps, Flags, choose
from record_dispatch import GPUS, OUT, case_key, cases, decide  # tests/kernels/record_dispatch.py

H200 = GPUS["h200"]


@pytest.fixture
def shipped_tables_only(monkeypatch, tmp_path):
    """The shipped tables as a new process loads them, with nothing autotuned on this machine."""
    monkeypatch.setattr(configs, "_tables", {})
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))


def test_every_recorded_decision_is_made_again(shipped_tables_only):
    golden = json.loads(OUT.read_text())
    grid = list(cases())
    assert {case_key(*c) for c in grid} == set(golden)
    changed = [(case_key(*c), golden[case_key(*c)], now) for c in grid if (now := decide(*c)) != golden[case_key(*c)]]
    assert not changed, f"{len(changed)} decisions changed, first: {changed[:3]}"


def test_the_grid_covers_every_path_and_pdl():
    golden = json.loads(OUT.read_text())
    assert {d["config"]["path"] for d in golden.values()} == {"gemv", "mma", "wgmma", "fma", "dot", "dq", "w4a8"}
    assert any(d.get("pdl") for d in golden.values())


def test_flags_follow_the_environment(monkeypatch):
    for name in ("QUANTPACK_MMA", "QUANTPACK_WGMMA", "QUANTPACK_PDL", "TRITON_INTERPRET", "QUANTPACK_W4A8"):
        monkeypatch.delenv(name, raising=False)
    assert Flags.from_env() == Flags()
    monkeypatch.setenv("QUANTPACK_WGMMA", "0")
    monkeypatch.setenv("QUANTPACK_PDL", "1")
    assert Flags.from_env() == Flags(wgmma=False, pdl=True)


def test_a_decision_says_why(shipped_tables_only):
    d = choose(H200, 256, 4096, 4096, 4, torch.bfloat16)
    assert d.path == "wgmma" and "nvidia_h200 config table has an entry for fwd|b4|n4096|k4096|m256" in d.reason
    off = choose(H200, 256, 4096, 4096, 4, torch.bfloat16, flags=Flags(wgmma=False))
    assert off.path == "dq" and "QUANTPACK_WGMMA=0" in off.reason
    a100 = choose(GPUS["a100"], 256, 4096, 4096, 4, torch.bfloat16)
    assert a100.path == "dq" and "the heuristic" in a100.reason
    no_mma = choose(H200, 1, 4096, 4096, 4, torch.bfloat16, flags=Flags(mma=False))
    assert no_mma.path == "gemv" and "QUANTPACK_MMA=0" in no_mma.reason
    forced = choose(H200, 4, 4096, 4096, 4, torch.bfloat16, transposed=True, config=configs.KernelConfig("wgmma"))
    assert forced.path == "dot" and "given by the caller" in forced.reason and "cannot run this call" in forced.reason


def test_explain_answers_in_one_paragraph(shipped_tables_only, monkeypatch):
    text = explain(256, 4096, 4096, bits=4, group_size=128, dtype=torch.bfloat16, device=H200, flags=Flags())
    assert text.startswith("On NVIDIA H200, x @ W.T with M=256, N=4096, K=4096, 4-bit")
    assert "warpgroup-MMA kernel" in text and "block_m=128" in text and "Hopper" in text and "\n" not in text
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "pure-torch reference" in explain(1, 64, 64, device="cpu")
    cpu = explain(1, 64, 128, device="cpu", flags=Flags(interpret=True))
    assert cpu.startswith("On Triton's CPU interpreter") and "DeviceProps" not in cpu
    assert DeviceProps("NVIDIA H100 PCIe", (9, 0), 114).key == "nvidia_h100_pcie"


def test_an_eager_call_of_few_rows_takes_the_cheaper_launch(shipped_tables_only):
    """Outside CUDA-graph capture (``host_bound``) a call of at most 16 rows that the table sends to wgmma runs mma
    (its launch builds no TMA descriptors) and says why; captured, beyond 16 rows, or with a forced config, the
    decision is the table's."""
    captured = choose(H200, 16, 14336, 4096, 4, torch.bfloat16)
    assert captured.path == "wgmma"
    eager = choose(H200, 16, 14336, 4096, 4, torch.bfloat16, host_bound=True)
    assert eager.path == "mma" and "not captured in a CUDA graph and M=16" in eager.reason
    assert choose(H200, 17, 14336, 4096, 4, torch.bfloat16, host_bound=True).path == "wgmma"
    for m in (1, 8, 16):  # (what already runs mma or the GEMV does not change)
        for n, k in ((4096, 4096), (6144, 4096)):
            assert (choose(H200, m, n, k, 4, torch.bfloat16, host_bound=True)
                    == choose(H200, m, n, k, 4, torch.bfloat16)), (m, n, k)
    forced = configs.KernelConfig("wgmma", 16, 64, 64, split=2, num_warps=4, num_stages=4)
    assert choose(H200, 16, 14336, 4096, 4, torch.bfloat16, config=forced, host_bound=True).path == "wgmma"
    no_mma = choose(H200, 16, 14336, 4096, 4, torch.bfloat16, flags=Flags(mma=False), host_bound=True)
    assert no_mma.path not in ("mma", "wgmma") and "QUANTPACK_MMA=0" in no_mma.reason
    assert "warpgroup-MMA" in explain(16, 14336, 4096, device=H200, flags=Flags(), captured=True)
    assert "tensor-core GEMV" in explain(16, 14336, 4096, device=H200, flags=Flags())
