"""The Hopper wgmma path: its tile clamping and dispatch (CPU), its sm_90 compile with ptxas keeping the
MMAs asynchronous (CPU, no GPU needed), and the kernel against the reference at awkward and full sizes
(GPU: Gluon has no interpreter)."""
import os

import pytest
import torch

from oracles import (  # tests/oracles.py
    packed_weight as packed, rel_err, mm_mod, dispatch_mod, launcher_mod, autotune_mod)
from quantpack.kernels.launch_plan import PlanCache
from quantpack.kernels.mixed_mm import KernelConfig
from quantpack.kernels.wgmma_host import (TRACE_EVENTS, balance_last_wave, read_trace, scale_zero_planes, trace_buffer,
                                          wgmma_grid)
from quantpack.kernels.wgmma_mm import HAVE_GLUON, wgmma_usable

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("m,bm,want", [(1, 64, 16), (17, 64, 32), (64, 64, 64), (100, 256, 128), (300, 256, 256),
                                       (40, 16, 16), (33, 128, 64)])
def test_grid_rows_of_x_are_a_power_of_two_from_16_to_256(m, bm, want):
    assert wgmma_grid(m, 4096, 4096, 128, bm, 64, 128, 1, 4).block_m == want


@pytest.mark.parametrize("gs,bk,want", [(128, 128, 128), (128, 64, 64), (64, 128, 64), (256, 128, 128), (384, 128, 128)])
def test_grid_k_step_divides_the_group(gs, bk, want):
    assert wgmma_grid(64, 4096, 4096, gs, 64, 64, bk, 1, 4).block_k == want


@pytest.mark.parametrize("k,split", [(4096, 4), (4096, 64), (1152, 8), (640, 4), (128, 2)])
def test_grid_split_leaves_every_program_a_k_step(k, split):
    g = wgmma_grid(64, 4096, k, 128, 64, 64, 128, split, 4)
    steps = -(-k // g.block_k)
    per = -(-steps // g.split)
    assert 1 <= g.split <= split and (g.split - 1) * per < steps  # the last program starts inside K
    assert g.stages >= 2 and g.warps == 4


def test_trace_buffer_holds_16_stamps_per_program():
    """A split grid's programs (17 x 2 tiles, K split 2 ways) each get 16 zeroed int64 slots."""
    buf = trace_buffer(wgmma_grid(100, 1040, 640, 64, 64, 64, 64, 2, 3), 100, 1040, "cpu")
    assert buf.shape == (68, 16) and buf.dtype == torch.int64 and not buf.any()


def test_read_trace_returns_each_events_timer_and_cycles_and_the_sm():
    """_stamp's slots: event e's timer at e, its cycle counter at 8 + e, the SM at 7."""
    buf = torch.arange(3 * 16, dtype=torch.int64).reshape(3, 16)
    ns, cycles, sm = read_trace(buf)
    events = len(TRACE_EVENTS)
    assert events == 5 and torch.equal(ns, buf[:, :5]) and torch.equal(cycles, buf[:, 8:13])
    assert torch.equal(sm, torch.tensor([7, 23, 39]))


def test_a_last_wave_at_most_half_full_is_split_and_the_rest_runs_whole():
    """14336 x 4096 at M = 1024 in 256 x 128 tiles: 448 tiles on 132 resident programs are 3 full waves
    and 52 tiles; those 52 split two ways (104 programs), the first 396 run whole."""
    g = balance_last_wave(wgmma_grid(1024, 14336, 4096, 128, 256, 128, 64, 1, 3), 1024, 14336, 4096, 132)
    assert (g.split, g.whole) == (2, 396)
    assert g.tiles(1024, 14336) == 448 and g.split_tiles(1024, 14336) == 52 and g.programs(1024, 14336) == 500


@pytest.mark.parametrize("m,n,k,resident,want", [
    (1024, 14336, 4096, 132, (2, 396)),
    (1024, 4096, 4096, 132, (1, 0)),     # 128 tiles: one partial wave, nothing to balance
    (1024, 14336, 4096, 400, (4, 400)),  # 448 = 400 + 48: the last wave 12% full, split the most (4)
    (512, 14336, 4096, 132, (1, 0)),     # 224 tiles: last wave 92 of 132, more than half full
    (2048, 14336, 4096, 132, (1, 0)),    # 896 = 6 x 132 + 104: more than half full
    (1024, 14336, 4096, 110, (4, 440)),  # 8 tiles left: 110 // 8 = 13, at most 4 ways
    (1024, 14336, 192, 132, (2, 396)),   # three K steps: two ways still leave each program one
    (1024, 14336, 64, 132, (1, 0)),      # one K step: nothing to split
    (1024, 14336, 4096, 0, (1, 0)),      # the kernel does not fit as asked (the launcher takes fewer stages)
])
def test_last_wave_balance(m, n, k, resident, want):
    g = balance_last_wave(wgmma_grid(m, n, k, 64, 256, 128, 64, 1, 3), m, n, k, resident)
    if want == (1, 0):
        assert g.split == 1 and g.programs(m, n) == g.tiles(m, n)
    else:
        assert (g.split, g.whole) == want
        assert g.whole % resident == 0 and 2 * (g.tiles(m, n) - g.whole) <= resident
        assert g.programs(m, n) - g.whole <= resident  # the split tiles' programs fit one wave


def test_a_split_grid_is_not_rebalanced():
    g = wgmma_grid(64, 4096, 4096, 128, 64, 64, 128, 4, 4)
    assert balance_last_wave(g, 64, 4096, 4096, 132) == g and g.whole == 0 and g.programs(64, 4096) == 64 * 4


def test_scales_and_zeros_become_planes_of_one_view_in_either_order():
    """One TMA copy brings a step's scale and zero rows: the lower tensor is the base, the distance the
    plane stride, and the kernel is told which plane holds the scales."""
    storage = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    s, z = storage[0], storage[2]
    base, stride, s_plane = scale_zero_planes(s, z)
    assert base.data_ptr() == s.data_ptr() and stride == 2 * 4 * 32 and s_plane == 0
    base, stride, s_plane = scale_zero_planes(z, s)  # zeros below scales
    assert base.data_ptr() == s.data_ptr() and stride == 2 * 4 * 32 and s_plane == 1


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
def test_scales_and_zeros_the_planes_cannot_join_are_refused():
    """A plane stride must be a nonzero multiple of 16 bytes (TMA): otherwise the path is not usable
    (and the dispatcher picks another)."""
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    q = torch.zeros(128, 64, dtype=torch.uint8)
    meta = torch.zeros(2 * 4 * 64 + 8, dtype=torch.bfloat16)
    s, z = meta[:256].view(4, 64), meta[256:512].view(4, 64)
    assert wgmma_usable(x, q, s, z, 64, 256, 64, 4, 1)
    assert not wgmma_usable(x, q, s, s, 64, 256, 64, 4, 1)  # one tensor for both
    z_odd = meta[260:516].view(4, 64)  # 8 bytes past a 16-byte boundary
    assert not wgmma_usable(x, q, s, z_odd, 64, 256, 64, 4, 1)


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
def test_8bit_weights_are_usable_and_other_widths_or_axes_are_not():
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    meta = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    q8 = torch.zeros(256, 64, dtype=torch.uint8)  # (K, N): a byte row per in-feature
    assert wgmma_usable(x, q8, meta[0], meta[1], 64, 256, 64, 8, 1)
    assert not wgmma_usable(x, q8, meta[0], meta[1], 64, 256, 64, 3, 1)
    assert not wgmma_usable(x, q8, meta[0], meta[1], 64, 256, 64, 8, 0)


def test_forced_wgmma_config_falls_back_off_hopper():
    """Where the kernel cannot run (CPU, interpreter, another GPU), a wgmma table entry still computes
    the right product through the path the heuristic picks instead."""
    dev = "cpu" if not torch.cuda.is_available() else "cuda"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs the interpreter or a GPU")
    pw, w = packed(64, 256, 64, torch.float16, device=dev)
    x = torch.randn(33, 256, dtype=torch.float16, device=dev)
    out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64,
                            config=KernelConfig("wgmma", 64, 64, 32, split=2, num_warps=4, num_stages=3))
    assert rel_err(out, x.float() @ w.t()) < 5e-3


@pytest.mark.parametrize("m,raw", [(1, True), (16, True), (32, True), (64, False)])
def test_tuner_offers_raw_weights_on_hopper_for_few_rows_and_4_bits(monkeypatch, m, raw):
    """RAWQ tiles (producer warp, from one row of x) are candidates at up to 32 rows of 4-bit weights on Hopper,
    never for 8-bit weights, and they clamp to a 16-row x tile at one row."""
    monkeypatch.setattr(autotune_mod, "wgmma_device", lambda props, flags: True)
    dev = torch.device("cpu")
    found = [c for c in mm_mod.candidate_configs(False, m, 4096, 4096, dev, bits=4) if c.path == "wgmma" and c.rawq]
    assert bool(found) == raw and all(c.producer for c in found)
    assert not [c for c in mm_mod.candidate_configs(False, m, 4096, 4096, dev, bits=8) if c.rawq and c.path == "wgmma"]
    if found:
        g = wgmma_grid(m, 4096, 4096, 128, max(c.block_m for c in found), 64, 128, 4, 4, rawq=True)
        assert g.rawq and g.producer and g.block_m == (16 if m <= 16 else 32)


def test_heuristic_offers_wgmma_only_on_hopper():
    cpu = torch.device("cpu")
    assert dispatch_mod.heuristic_config(False, 64, 4096, 4096, dispatch_mod.device_props(cpu), dispatch_mod.Flags.from_env()).path != "wgmma"
    assert not dispatch_mod.wgmma_device(dispatch_mod.device_props(cpu), dispatch_mod.Flags.from_env())


def test_sm90_compile_keeps_the_mmas_asynchronous():
    """Every variant (tiles, dtypes, float32 scales, split-K, bias, RAWQ) gets through Gluon and ptxas for sm_90
    with BLOCK_K / 16 wgmma per K step at four sites (the peeled first step, the loop's two, the remainder; RAWQ: one
    site, each step waited for),
    without ptxas serializing them (C7515: what a zero-filled accumulator inside the MMA pipeline caused),
    and with each site reading its register operand from other registers than the site before it, whose
    MMA is still in flight while it dequantizes (one loop site rewriting its own registers gave wrong sums)."""
    pytest.importorskip("triton.backends.nvidia")
    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from sm90_compile import run_script  # tests/kernels/sm90_compile.py
    from sm90_compile_wgmma import VARIANTS  # tests/kernels/sm90_compile_wgmma.py

    for line in run_script("sm90_compile_wgmma.py", VARIANTS):
        assert "error" not in line, line
        assert not line["serialized"] and line["spills"] == 0, line
        if len(line["variant"]) > 12 and line["variant"][12]:  # RAWQ: one loop site, the weights' MMA
            assert line["wgmma"] == line["per_step"] and len(line["operands"]) == 1, line
            continue
        assert line["wgmma"] == 4 * line["per_step"], line
        peeled, odd, even, last = (set(regs) for regs in line["operands"])
        # in order: peeled -> odd -> even -> odd ... -> last (when the step count is even)
        assert not (peeled & odd) and not (odd & even) and not (even & last) and not (peeled & last), line


needs_hopper = pytest.mark.skipif(not (HOPPER and HAVE_GLUON), reason="needs a Hopper GPU and Gluon")


def spy_grids(monkeypatch) -> list:
    """The grids of the wgmma launches that follow (the launches still run)."""
    grids = []
    real = launcher_mod.launch_wgmma
    monkeypatch.setattr(launcher_mod, "launch_wgmma", lambda *a, **kw: grids.append(kw["grid"]) or real(*a, **kw))
    return grids


def assert_graph_replays(x, w, call):
    """``call()`` (x @ w.T), captured once in a CUDA graph, replays right with new x: split programs' arrival
    counters reset themselves."""
    call()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.float() @ w.t()) < 8e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("producer,rawq", [(False, False), (True, False), (True, True)],
                         ids=["", "producer", "rawq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 8], ids=["w4", "w8"])
@pytest.mark.parametrize("n,k,gs", [(1040, 640, 64), pytest.param(4096, 4096, 128, marks=pytest.mark.slow), (208, 1152, 128),
                                    pytest.param(1024, 2048, 256, marks=pytest.mark.slow)])
def test_kernel_matches_reference(monkeypatch, n, k, gs, bits, dtype, producer, rawq):
    """Awkward rows of x (1, 3, 17, 100, 300: partial tiles along M), N not a multiple of the tile,
    K with a partial split (down to one K step per program), every tile the tuner offers, split-K, shallow
    and deep rings, bias; the MMA warps issuing the copies themselves or a producer warp; 4- and 8-bit weights;
    4-bit weights unpacked to q - z without the scales (RAWQ), the scales applied to each step's sums."""
    if rawq and bits == 8:
        pytest.skip("rawq is 4-bit only (an 8-bit code does not fit bf16's mantissa)")
    pw, w = packed(n, k, gs, dtype, bits=bits)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    calls = []
    real = launcher_mod.launch_wgmma
    monkeypatch.setattr(launcher_mod, "launch_wgmma",
                        lambda *a, **kw: calls.append((kw["bits"], kw["grid"])) or real(*a, **kw))
    for m in (1, 3, 17, 64, 100, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = x.float() @ w.t()
        for bm, bn, br, split, stages in ((64, 64, 64, 1, 4), (32, 128, 32, 4, 3), (256, 128, 32, 2, 3),
                                          (128, 64, 64, 3, 2), (16, 64, 32, 8, 4), (16, 64, 64, 8, 4)):
            cfg = KernelConfig("wgmma", bm, bn, br, split=split, num_warps=bn // 16, num_stages=stages,
                               producer=producer, rawq=rawq)
            out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, config=cfg)
            assert rel_err(out, ref) < 8e-3, (m, cfg)
            out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, config=cfg, bias=bias)
            assert rel_err(out, ref + bias.float()) < 8e-3, (m, cfg, "bias")
    assert [(b, g.rawq) for b, g in calls] == [(bits, rawq)] * (6 * 6 * 2)  # every call ran the kernel as asked


@pytest.mark.gpu
@needs_hopper
def test_zeros_allocated_below_scales_give_the_same_product():
    """The scale/zero planes in the other order (zeros at the lower address): bit-identical output."""
    pw, w = packed(1040, 640, 64, torch.bfloat16)
    x = torch.randn(100, 640, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig("wgmma", 128, 64, 32, split=2, num_warps=4, num_stages=3)
    outs = []
    for s_plane in (1, 0):  # zeros below the scales, then above
        meta = torch.empty(2, *pw.scales.shape, device="cuda", dtype=pw.scales.dtype)
        meta[s_plane].copy_(pw.scales)
        meta[1 - s_plane].copy_(pw.zeros)
        outs.append(mm_mod.mixed_mm(x, pw.qweight, meta[s_plane], meta[1 - s_plane], group_size=64, config=cfg))
    below, above = outs
    assert torch.equal(below, above) and rel_err(above, x.float() @ w.t()) < 8e-3


@pytest.mark.gpu
@needs_hopper
def test_kernel_runs_when_dispatched(monkeypatch):
    """The shipped table sends 32-4096 rows to wgmma at 4096 x 4096; the launch it makes is the kernel's
    (spied), and the product matches; with QUANTPACK_WGMMA=0 the same call takes another path."""
    pw, w = packed(4096, 4096, 128, torch.bfloat16)
    calls = spy_grids(monkeypatch)
    for m in (32, 64, 128, 256, 512, 1024, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert mm_mod.pick_config(False, 4, m, 4096, 4096, x.device).path == "wgmma"
        out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128)
        assert rel_err(out, x.float() @ w.t()) < 8e-3
    assert len(calls) == 7 and calls[-1].producer
    monkeypatch.setenv("QUANTPACK_WGMMA", "0")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128)
    assert len(calls) == 7 and rel_err(out, x.float() @ w.t()) < 8e-3


@pytest.mark.gpu
@needs_hopper
def test_16_rows_run_the_raw_weights_when_captured_and_mma_when_eager(monkeypatch):
    """The shipped tables send 16 rows of x at the two large benchmark shapes to wgmma with RAWQ: captured in a CUDA
    graph, the launches are the kernel's with raw weights; eager, the same calls are host-bound and run the mma
    kernel, whose launch builds no TMA descriptors (4096^2 runs `mma` either way): the eager calls' launch plan is
    not replayed into the graph. The products match."""
    calls = spy_grids(monkeypatch)
    for n, k in ((14336, 4096), (4096, 14336)):
        pw, w = packed(n, k, 128, torch.bfloat16)
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        plans = PlanCache()

        def call():
            return mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, plans=plans)

        for _ in range(2):  # (the second call replays the first one's plan)
            assert rel_err(call(), x.float() @ w.t()) < 8e-3, (n, k)
        assert calls == [] and len(plans) == 1, "an eager 16-row call ran wgmma"
        assert_graph_replays(x, w, call)
        assert [g.rawq for g in calls] == [True], (n, k)
        calls.clear()


@pytest.mark.gpu
@needs_hopper
def test_8bit_batches_run_the_kernel_when_dispatched(monkeypatch):
    """The shipped table sends 8-bit weights at 16-1024 rows of x to wgmma (4096 x 4096; 16 rows where captured in a
    CUDA graph, since an eager call of 16 rows takes the cheaper launch): the launches are the kernel's with 8-bit
    tiles, and the products match."""
    pw, w = packed(4096, 4096, 128, torch.bfloat16, bits=8)
    bits = []
    real = launcher_mod.launch_wgmma
    monkeypatch.setattr(launcher_mod, "launch_wgmma", lambda *a, **kw: bits.append(kw["bits"]) or real(*a, **kw))
    for m in (64, 256, 1024):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, bits=8)
        assert rel_err(out, x.float() @ w.t()) < 8e-3, m
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    assert_graph_replays(x, w, lambda: mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, bits=8))
    assert bits == [8] * 4


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("producer", [False, True], ids=["", "producer"])
def test_cuda_graph_replay_with_split_counters(producer):
    """Split-K's arrival counters reset themselves: the same captured launch replays correctly."""
    pw, w = packed(4096, 4096, 128, torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig("wgmma", 64, 64, 64, split=4, num_warps=4, num_stages=4, producer=producer)
    assert_graph_replays(x, w, lambda: mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, bits=4,
                                                       config=cfg))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("producer", [False, True], ids=["", "producer"])
@pytest.mark.parametrize("resident,balanced", [(3, 2), (7, 6), (40, 2)])
def test_balanced_last_wave_matches_reference(monkeypatch, resident, balanced, producer):
    """Whole tiles first, then the last wave's tiles split (made to happen at small sizes by claiming fewer
    resident programs): awkward M and N, 64-wide groups, bias, and a CUDA graph replaying the counters."""
    monkeypatch.setattr(launcher_mod, "resident_programs", lambda *a, **kw: resident)
    grids = spy_grids(monkeypatch)
    pw, w = packed(1040, 640, 64, torch.bfloat16)
    bias = torch.randn(1040, device="cuda", dtype=torch.bfloat16)
    for m in (17, 100, 300):
        x = torch.randn(m, 640, device="cuda", dtype=torch.bfloat16)
        for bm, bn, br in ((64, 64, 32), (128, 128, 64), (32, 64, 64)):
            cfg = KernelConfig("wgmma", bm, bn, br, split=1, num_warps=bn // 16, num_stages=3, producer=producer)
            out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64, config=cfg, bias=bias)
            assert rel_err(out, x.float() @ w.t() + bias.float()) < 8e-3, (m, cfg, grids[-1])
    assert sum(g.split > 1 and g.whole > 0 for g in grids) == balanced, grids  # (of the 9 launches)
    x = torch.randn(300, 640, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig("wgmma", 64, 64, 32, split=1, num_warps=4, num_stages=3, producer=producer)
    assert_graph_replays(x, w, lambda: mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64,
                                                       config=cfg))


@pytest.mark.gpu
@needs_hopper
def test_a_ring_too_deep_for_shared_memory_runs_with_fewer_stages():
    """256 rows of x x 128 in-features x 4 stages is 256 KB of x alone: nothing is resident as asked, so no
    wave is balanced, and the launch retries with fewer stages (the product is right)."""
    from quantpack.kernels.wgmma_host import WgmmaGrid
    from quantpack.kernels.wgmma_mm import resident_programs

    pw, w = packed(208, 1152, 128, torch.bfloat16)
    x = torch.randn(300, 1152, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(300, 208, device="cuda", dtype=torch.bfloat16)
    assert resident_programs(x, pw.qweight, pw.scales, pw.zeros, None, out, n=208, k=1152, group_size=128, bits=4,
                             grid=WgmmaGrid(256, 128, 128, 1, 4, 8)) == 0
    cfg = KernelConfig("wgmma", 256, 128, 64, split=1, num_warps=8, num_stages=4)
    out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=cfg)
    assert rel_err(out, x.float() @ w.t()) < 8e-3


@pytest.mark.gpu
@needs_hopper
def test_resident_programs_reads_the_compiled_kernel():
    """A 256 x 128 tile (8 warps, over 200 registers, 3-stage ring) fits once per SM; a 64 x 64 tile at least
    once, and its count is a whole number of SMs. With a producer warp (a warpgroup more, registers capped by
    producer_maxnreg): 256 x 128 once per SM, 64 x 64 twice."""
    from quantpack.kernels.wgmma_host import WgmmaGrid
    from quantpack.kernels.wgmma_mm import resident_programs

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pw, _ = packed(4096, 4096, 128, torch.bfloat16)
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1024, 4096, device="cuda", dtype=torch.bfloat16)
    big = resident_programs(x, pw.qweight, pw.scales, pw.zeros, None, out, n=4096, k=4096, group_size=128, bits=4,
                            grid=WgmmaGrid(256, 128, 64, 1, 3, 8))
    small = resident_programs(x, pw.qweight, pw.scales, pw.zeros, None, out, n=4096, k=4096, group_size=128, bits=4,
                              grid=WgmmaGrid(64, 64, 128, 1, 4, 4))
    assert big == sms and small >= sms and small % sms == 0, (big, small)
    big, small = (resident_programs(x, pw.qweight, pw.scales, pw.zeros, None, out, n=4096, k=4096, group_size=128,
                                    bits=4, grid=WgmmaGrid(bm, bn, bk, 1, stages, bn // 16, producer=True))
                  for bm, bn, bk, stages in ((256, 128, 64, 3), (64, 64, 128, 4)))
    assert big == sms and small == 2 * sms, (big, small)


@pytest.mark.gpu
@needs_hopper
def test_dispatch_balances_the_last_wave_at_14336x4096(monkeypatch):
    """The shipped table runs 14336 x 4096 at M = 1024 on wgmma in 256 x 128 tiles: 448 tiles, one per SM at
    a time, so the tiles past the last full wave run split (and the product is right)."""
    pw, w = packed(14336, 4096, 128, torch.bfloat16)
    grids = spy_grids(monkeypatch)
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (g, ) = grids
    assert g.split > 1 and g.whole > 0 and g.whole % sms == 0 and g.tiles(1024, 14336) - g.whole < sms, g
    assert rel_err(out, x.float() @ w.t()) < 8e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("producer,rawq", [(False, False), (True, False), (True, True)], ids=["", "producer", "rawq"])
def test_trace_build_computes_the_same_product_and_stamps_every_program(monkeypatch, producer, rawq):
    """The profiling build (a ``trace`` buffer: benchmarks/dev/probe_wgmma.py --trace) gives the same output bit
    for bit, and every program's stamps are in order: start <= first copies <= accumulator <= stored, and a split
    tile's last program's sum after that, on an SM the GPU has."""
    pw, w = packed(1040, 640, 64, torch.bfloat16)
    x = torch.randn(100, 640, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig("wgmma", 64, 64, 32, split=2, num_warps=4, num_stages=3, producer=producer, rawq=rawq)
    plain = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64, config=cfg)
    real = launcher_mod.launch_wgmma
    traces = []

    def traced(*a, **kw):
        traces.append(trace_buffer(kw["grid"], a[0].shape[0], kw["n"], "cuda"))
        return real(*a, trace=traces[-1], **kw)

    monkeypatch.setattr(launcher_mod, "launch_wgmma", traced)
    out = mm_mod.mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64, config=cfg)
    assert torch.equal(out, plain)
    ns, cycles, sm = read_trace(traces[0].cpu())
    assert len(ns) == 2 * 17 * 2  # 17 tiles of 64 weight rows x 2 of 64 rows of x, K split two ways
    for stamps in (ns, cycles):
        first = stamps[:, 1]
        assert (stamps[:, 0] > 0).all() and (first >= stamps[:, 0]).all() and (stamps[:, 2] >= first).all()
        assert (stamps[:, 3] >= stamps[:, 2]).all()
        summed = stamps[:, 4] > 0
        assert summed.sum() == 17 * 2 and (stamps[summed, 4] >= stamps[summed, 3]).all()  # one per split tile
    assert ((sm >= 0) & (sm < torch.cuda.get_device_properties(0).multi_processor_count)).all()
