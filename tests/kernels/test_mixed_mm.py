"""mixed_mm against the fp32 reference under the Triton interpreter: every kernel path (FMA GEMV,
tensor-core tiles both ways, split-K with the last-arriver reduction, dequant+matmul), forward and
transposed, awkward shapes, outputs poisoned with NaN so unwritten elements fail."""
import os

import pytest
import torch

from quantpack import reference
from quantpack.format import PackedWeight
from quantpack.kernels import KernelConfig, mixed_mm
from quantpack.quantization.groupwise import quantize
from oracles import (  # tests/oracles.py
    pretend_device, scripted_gpu_timing, mm_mod, configs_mod, dispatch_mod, caches_mod, launcher_mod, autotune_mod)

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 or a GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]  # (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    return ((out.float() - ref).norm() / ref.norm()).item()


_packed_cache = {}


def packed(n, k, bits, group_size, axis=1, dtype=torch.float16, seed=0):
    key = (n, k, bits, group_size, axis, dtype, seed)
    if key not in _packed_cache:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g)
        pw = quantize(w, bits=bits, group_size=group_size, axis=axis, method="rtn", dtype=dtype).to(DEV)
        _packed_cache[key] = (pw, reference.dequantize(pw, torch.float32))
    return _packed_cache[key]


def run(x, pw, cfg, transposed=False, **kw):
    return mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=pw.group_size, bits=pw.bits,
                    transposed=transposed, config=cfg, **kw)


# Forced configs: each kernel variant, tile sizes that do not divide the test shapes, split-K.
FWD_CONFIGS = {
    "fma_split": lambda m: KernelConfig("fma", block_m=min(8, 1 << max(0, (m - 1).bit_length())), block_n=32,
                                        block_r=16, split=3),
    "dot_split": lambda m: KernelConfig("dot", block_m=16, block_n=32, block_r=16, split=2),
    "dot_t": lambda m: KernelConfig("dot_t", block_m=16 if m <= 16 else 32, block_n=64, block_r=32, split=1),
    "dot_big": lambda m: KernelConfig("dot", block_m=32, block_n=64, block_r=64, split=1),
    # MMA on raw integers (fp16: q OR-ed into the bits of 1024.0), rescaled per tile
    "rawq_t": lambda m: KernelConfig("dot_t", block_m=16 if m <= 16 else 32, block_n=32, block_r=16, split=2,
                                     rawq=True),
    "rawq": lambda m: KernelConfig("dot", block_m=16, block_n=64, block_r=16, split=1, rawq=True),
    # decode GEMV: byte tiles, and int32 words of 4 packed columns (4-bit; 8-bit runs the byte path);
    # split 3 becomes 4 programs over 3 or fewer steps' worth of rows (some programs get none)
    "gemv": lambda m: KernelConfig("gemv", block_n=32, block_r=16, split=3, num_warps=1),
    "gemv_words": lambda m: KernelConfig("gemv", block_n=64, block_r=16, split=2, words=True),
}
TR_CONFIGS = {
    "dot_split": lambda m: KernelConfig("dot", block_m=16, block_n=32, block_r=16, split=2),
    "swap": lambda m: KernelConfig("dot_t", block_m=32, block_n=64, block_r=32, split=1),
}
# (N, K, group size): N and K not multiples of the tiles above
SHAPES = [(72, 160, 32), (100, 192, 64), (88, 384, 128)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,gs", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
def test_forward_matches_reference(m, n, k, gs, bits):
    pw, w = packed(n, k, bits, gs)
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g, dtype=torch.float16).to(DEV)
    ref = x.float() @ w.t()
    names = ["dot_split", "dot_t", "rawq_t" if m <= 17 else "rawq"] + (["fma_split"] if m <= 17 else ["dot_big"])
    names += ["gemv", "gemv_words"] if m <= 17 else []  # (M > 8 falls back to fma)
    for name in names:
        out = run(x, pw, FWD_CONFIGS[name](m))
        assert out.shape == (m, n) and out.dtype == torch.float16
        assert rel_err(out, ref) <= 1e-3, name


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,gs", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
def test_transposed_matches_reference(m, n, k, gs, bits):
    pw, w = packed(n, k, bits, gs)
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, n, generator=g, dtype=torch.float16).to(DEV)
    ref = x.float() @ w
    for name, cfg in TR_CONFIGS.items():
        out = run(x, pw, cfg(m), transposed=True)
        assert out.shape == (m, k) and out.dtype == torch.float16
        assert rel_err(out, ref) <= 1e-3, name


@pytest.mark.parametrize("bits", [4, 8])
def test_axis0_and_per_channel(bits):
    for (n, k, gs, axis) in [(96, 80, 32, 0), (72, 200, None, 1), (64, 96, None, 0)]:
        pw, w = packed(n, k, bits, gs, axis=axis)
        x = torch.randn(5, k, dtype=torch.float16).to(DEV)
        xt = torch.randn(5, n, dtype=torch.float16).to(DEV)
        for cfg in (FWD_CONFIGS["fma_split"](5), FWD_CONFIGS["dot_split"](5), FWD_CONFIGS["dot_t"](5)):
            assert rel_err(run(x, pw, cfg), x.float() @ w.t()) <= 1e-3
        assert rel_err(run(xt, pw, TR_CONFIGS["swap"](5), transposed=True), xt.float() @ w) <= 1e-3


def test_odd_k_8bit():
    pw, w = packed(40, 33, 8, None)  # per-channel group of 33: 8-bit allows odd K
    x = torch.randn(3, 33, dtype=torch.float16).to(DEV)
    xt = torch.randn(3, 40, dtype=torch.float16).to(DEV)
    for cfg in (FWD_CONFIGS["fma_split"](3), FWD_CONFIGS["dot_split"](3)):
        assert rel_err(run(x, pw, cfg), x.float() @ w.t()) <= 1e-3
    assert rel_err(run(xt, pw, TR_CONFIGS["dot_split"](3), transposed=True), xt.float() @ w) <= 1e-3


def test_bf16_fp32_inputs_bias_and_out_dtype():
    pw, w = packed(72, 160, 4, 32, dtype=torch.bfloat16)
    bias = torch.randn(72).to(torch.bfloat16).to(DEV)
    x = torch.randn(3, 160).to(DEV)
    ref = x @ w.t() + bias.float()
    for cfg in (FWD_CONFIGS["fma_split"](3), FWD_CONFIGS["dot_split"](3), FWD_CONFIGS["rawq_t"](3),
                FWD_CONFIGS["gemv"](3), FWD_CONFIGS["gemv_words"](3), KernelConfig("dq")):
        out32 = run(x, pw, cfg, bias=bias)  # fp32 activations: fp32 ("ieee") dot or fp32 weight, fp32 out
        assert out32.dtype == torch.float32 and rel_err(out32, ref) <= 1e-5
        outb = run(x.to(torch.bfloat16), pw, cfg, bias=bias, out_dtype=torch.float32)
        assert outb.dtype == torch.float32
        assert rel_err(outb, x.to(torch.bfloat16).float() @ w.t() + bias.float()) <= 1e-2


def test_leading_dims_and_noncontiguous_x():
    pw, w = packed(72, 160, 4, 32)
    base = torch.randn(2, 3, 320, dtype=torch.float16).to(DEV)
    x = base[..., ::2]  # (2, 3, 160), stride 2 along K
    assert not x.is_contiguous()
    for cfg in (FWD_CONFIGS["fma_split"](6), FWD_CONFIGS["dot_t"](6), FWD_CONFIGS["gemv_words"](6)):
        out = run(x, pw, cfg)
        assert out.shape == (2, 3, 72)
        assert rel_err(out, x.float() @ w.t()) <= 1e-3
    xt = torch.randn(4, 72, 2, dtype=torch.float16).to(DEV).transpose(1, 2)  # (4, 2, 72) non-contiguous
    out = run(xt, pw, TR_CONFIGS["swap"](8), transposed=True)
    assert out.shape == (4, 2, 160) and rel_err(out, xt.float() @ w) <= 1e-3


def test_dequant_then_matmul_path():
    pw, w = packed(100, 192, 4, 64)
    x = torch.randn(17, 192, dtype=torch.float16).to(DEV)
    dq = KernelConfig("dq")
    assert rel_err(run(x, pw, dq), x.float() @ w.t()) <= 1e-3
    xt = torch.randn(17, 100, dtype=torch.float16).to(DEV)
    assert rel_err(run(xt, pw, dq, transposed=True), xt.float() @ w) <= 1e-3


@pytest.mark.parametrize("cfg", [KernelConfig("fma", block_m=4, block_n=32, block_r=16, split=4),
                                 KernelConfig("gemv", block_n=32, block_r=16, split=4, words=True)], ids=str)
def test_split_counters_reset_and_repeatable(cfg):
    pw, w = packed(72, 384, 4, 128)
    x = torch.randn(3, 384, dtype=torch.float16).to(DEV)
    first = run(x, pw, cfg)
    second = run(x, pw, cfg)
    assert torch.equal(first, second)
    assert int(caches_mod.counter_buffer(x.device).abs().sum()) == 0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("words", [False, True])
def test_gemv_exact_tiles(bits, words):
    """Tiles that cover N and K exactly compile without masks (EVEN): same results."""
    pw, w = packed(128, 256, bits, 64)
    x = torch.randn(2, 256, dtype=torch.float16).to(DEV)
    for split in (1, 4):
        cfg = KernelConfig("gemv", block_n=32, block_r=16, split=split, words=words)
        assert rel_err(run(x, pw, cfg), x.float() @ w.t()) <= 1e-3


def test_gemv_falls_back_where_the_layout_does_not_allow_it():
    """axis 0, groups narrower than a step, and the transposed product run the general tiles."""
    cfg = KernelConfig("gemv", block_n=32, block_r=32, split=2)
    for (n, k, gs, axis) in [(96, 80, 32, 0), (72, 160, 32, 1)]:
        pw, w = packed(n, k, 4, gs, axis=axis)
        x = torch.randn(1, k, dtype=torch.float16).to(DEV)
        assert dispatch_mod.fit_config(cfg, False, 1, axis, gs).path == "fma"
        assert rel_err(run(x, pw, cfg), x.float() @ w.t()) <= 1e-3
    assert dispatch_mod.fit_config(cfg, True, 1, 1, 128).path == "dot"


def test_default_config_dispatch():
    """No forced config: the heuristic/tuned table picks a path for each M and it is right."""
    for n, k, gs in [(72, 160, 32), (100, 192, 64)]:
        pw, w = packed(n, k, 4, gs)
        for m in (1, 17):
            x = torch.randn(m, k, dtype=torch.float16).to(DEV)
            assert rel_err(mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs), x.float() @ w.t()) <= 1e-3
    # untuned decode takes the tensor-core GEMV (mixed_mm falls back to the CUDA-core one where its
    # layout needs are not met: tests/kernels/test_mma_gemv.py)
    cfg = dispatch_mod.heuristic_config(False, 1, 4096, 4096, dispatch_mod.device_props(torch.device(DEV)))
    assert cfg.path == "mma" and dispatch_mod.fit_config(cfg, False, 1, 1, 128).path == "mma"
    assert dispatch_mod.fit_config(cfg, True, 1, 1, 128).path == "dot"
    cfg16 = dispatch_mod.heuristic_config(False, 16, 4096, 4096, dispatch_mod.device_props(torch.device(DEV)))  # two 8-row halves of x
    assert cfg16.path == "mma" and dispatch_mod.fit_config(cfg16, False, 16, 1, 128).path == "mma"
    assert dispatch_mod.fit_config(cfg16, False, 64, 1, 128).path == "mma"  # blocks of 16 rows of x, up to 64
    assert dispatch_mod.fit_config(cfg16, False, 65, 1, 128).path == "dot"
    assert dispatch_mod.gemv_config(1, 4096, 4096, dispatch_mod.device_props(torch.device(DEV)).sms).path == "gemv"


def test_bad_input_is_refused():
    pw, _ = packed(72, 160, 4, 32)
    x = torch.randn(2, 160, dtype=torch.float16).to(DEV)
    with pytest.raises(ValueError, match="x: last dimension"):
        mixed_mm(x[:, :100], pw.qweight, pw.scales, pw.zeros, group_size=32)
    with pytest.raises(ValueError, match="x: last dimension"):
        mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=32, transposed=True)
    with pytest.raises(ValueError, match="scales: shape"):
        mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=16)
    with pytest.raises(ValueError, match="qweight"):
        mixed_mm(x, pw.qweight.to(torch.int32), pw.scales, pw.zeros, group_size=32)
    with pytest.raises(ValueError, match="bits"):
        mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=32, bits=3)
    with pytest.raises(ValueError, match="x: expected a floating-point"):
        mixed_mm(x.to(torch.int32), pw.qweight, pw.scales, pw.zeros, group_size=32)


def test_reference_fallback_without_triton(monkeypatch):
    """Where Triton cannot run, mixed_mm computes the same function through the reference."""
    pw, w = packed(72, 160, 4, 32)
    x = torch.randn(3, 160, dtype=torch.float16).to(DEV)
    monkeypatch.setattr(mm_mod, "triton_usable", lambda t: False)
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=32)
    assert rel_err(out, x.float() @ w.t()) <= 1e-3
    outt = mixed_mm(torch.randn(3, 72, dtype=torch.float16).to(DEV), pw.qweight, pw.scales, pw.zeros, group_size=32,
                    transposed=True)
    assert outt.shape == (3, 160)


def test_the_tuner_times_enough_weight_copies_to_stream_from_memory(monkeypatch):
    """The autotuner cycles through copies of the weight's tensors until they exceed 4x L2 (16 at most), as the
    benchmarks time, so a small weight is not timed from L2, where a model never finds it; one copy off a GPU."""
    class Props:
        L2_cache_size = 50 * 2 ** 20  # (an H100's)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    gpu = torch.device("cuda")

    def weight(n, k):  # (4-bit, group size 128: qweight, scales, zeros as the tuner holds them)
        return (torch.empty(k // 2, n, dtype=torch.uint8), torch.empty(k // 128, n, dtype=torch.bfloat16),
                torch.empty(k // 128, n, dtype=torch.bfloat16))

    assert mm_mod.copies_past_l2(weight(4096, 4096), gpu) == 16  # 8.5 MB: 24 would pass 200 MB
    assert mm_mod.copies_past_l2(weight(14336, 4096), gpu) == 7  # 29.8 MB
    assert mm_mod.copies_past_l2(weight(57344, 8192), gpu) == 1  # 238 MB
    assert mm_mod.copies_past_l2(weight(4096, 4096), torch.device("cpu")) == 1


def test_a_borrowed_wgmma_tile_shrinks_where_it_would_leave_most_sms_idle(monkeypatch):
    """A shape without its own entry borrows the nearest one; a borrowed 256 x 128 `wgmma` tile whose programs would
    fill under half the SMs gets 64 weight rows, then 128 rows of x (measured on an H100: 2048^2 at M = 1024 23.1 ->
    15.9 us, 1024 x 8192 75.6 -> 33.2); one that fills half or more is kept (3072 x 2048: shrinking measured slower),
    and so are exact entries, the split and every other path."""
    big = KernelConfig("wgmma", 256, 128, 32, split=1, num_warps=8, num_stages=4, producer=True)
    table = {mm_mod.config_key(False, 4, 4096, 4096, 1024): big,
             mm_mod.config_key(False, 4, 1024, 4096, 1024): big,
             mm_mod.config_key(False, 4, 4096, 4096, 1): KernelConfig("mma", 8, 16, num_warps=1, split=4)}
    monkeypatch.setattr(configs_mod, "_tables", {"test_gpu": table})
    pretend_device(monkeypatch, "test_gpu", capability=(9, 0), sms=132, gpu=True)
    cpu = torch.device("cpu")

    def pick(n, k, m):
        return mm_mod.pick_config(False, 4, m, n, k, cpu)

    # 2048^2: 4 x 16 tiles of 256 x 128 = 64 programs -> 4 x 32 of 256 x 64 = 128
    assert pick(2048, 2048, 1024) == KernelConfig("wgmma", 256, 64, 32, split=1, num_warps=4, num_stages=4,
                                                  producer=True)
    # 1024 x 8192: 32 programs -> 64 (256 x 64) -> 128 (128 x 64, 64 pair rows a step)
    assert pick(1024, 8192, 1024) == KernelConfig("wgmma", 128, 64, 64, split=1, num_warps=4, num_stages=4,
                                                  producer=True)
    assert pick(3072, 2048, 1024) == big  # (96 programs: kept)
    assert pick(4096, 4096, 1024) == big and pick(1024, 4096, 1024) == big  # (exact entries)
    assert pick(2048, 2048, 1) == table[mm_mod.config_key(False, 4, 4096, 4096, 1)]  # (not wgmma)


@pytest.mark.parametrize("table", ["nvidia_h200", "nvidia_h100_80gb_hbm3"])
def test_every_shipped_config_is_a_candidate_of_its_key(monkeypatch, table):
    """Every entry of a shipped table is one the tuner offers for that very key on that GPU (132 SMs, Hopper): tables
    merged from several tuning runs, or keeping an older pick where it timed faster, hold nothing outside the search
    space the kernels' tests and the tuner's reference check cover."""
    monkeypatch.setattr(autotune_mod, "wgmma_device", lambda props, flags: True)
    pretend_device(monkeypatch, table, capability=(9, 0), sms=132, gpu=True)
    entries = configs_mod.read_configs(configs_mod.CONFIG_DIR / f"{table}.json")
    assert len(entries) > 100
    outside = []
    for key, cfg in entries.items():
        direction, bits, n, k, m = key.split("|")
        if cfg not in mm_mod.candidate_configs(direction == "tr", int(m[1:]), int(n[1:]), int(k[1:]),
                                               torch.device("cpu"), int(bits[1:])):
            outside.append((key, cfg))
    assert not outside


def test_shipped_tables_load_and_same_arch_fallback(monkeypatch):
    """The shipped H200 and H100 tables parse into configs (the H100's own M <= 16 picks differ), and a GPU
    without its own file but of the same compute capability uses the one whose name is closest (an H100 PCIe:
    the H100's) rather than untuned heuristics."""
    monkeypatch.setattr(configs_mod, "_tables", {})
    monkeypatch.setattr(configs_mod, "capability", lambda key: [9, 0])
    h200 = configs_mod.config_table("nvidia_h200")
    h100 = configs_mod.config_table("nvidia_h100_80gb_hbm3")
    for table in (h200, h100):
        assert table and all(isinstance(c, KernelConfig) for c in table.values())
        assert mm_mod.config_key(False, 4, 4096, 4096, 1) in table
    assert h100 != h200
    assert configs_mod.config_table("nvidia_h100_pcie") == h100
    monkeypatch.setattr(configs_mod, "capability", lambda key: [8, 0])
    assert configs_mod.config_table("nvidia_a100_sxm4_80gb") == {}
    # nearest tuned entry for an untuned shape/M: same direction and bits, closest M bucket first
    # (N = 4608: nearer to the table's 4096 than to its 6144, the merged q/k/v shape)
    near = configs_mod.nearest(h200, False, 4, 4608, 4096, 2)
    assert near is not None and near == h200[mm_mod.config_key(False, 4, 4096, 4096, 1)]
    assert configs_mod.nearest(h200, False, 4, 5632, 4096, 2) == h200[mm_mod.config_key(False, 4, 6144, 4096, 1)]
    # but not across regimes: a decode entry (M = 1) says nothing about a batch of 64, which gets the heuristic, and
    # neither does any entry more than 4x away in M
    decode = {mm_mod.config_key(False, 8, 4096, 4096, 1): KernelConfig("mma")}
    assert configs_mod.nearest(decode, False, 8, 4096, 4096, 4) == KernelConfig("mma")
    assert configs_mod.nearest(decode, False, 8, 4096, 4096, 64) is None
    assert configs_mod.nearest(decode, False, 8, 4096, 4096, 8) is None
    # the shipped 8-bit batches run the fused kernels (or dequantize + cuBLAS), never a decode config
    for m in (64, 256, 1024, 4096):
        assert h200[mm_mod.config_key(False, 8, 14336, 4096, m)].path in ("wgmma", "dq")


def test_autotuned_configs_are_cached_for_later_processes(tmp_path, monkeypatch):
    """What QUANTPACK_AUTOTUNE=1 picks is kept in the machine's cache and read back by a new process
    (on top of the shipped table); a damaged cache is ignored, not fatal."""
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    monkeypatch.setattr(configs_mod, "capability", lambda key: None)
    first = (mm_mod.config_key(False, 4, 5120, 4096, 1), KernelConfig("gemv", block_n=64, block_r=16, split=8))
    second = (mm_mod.config_key(True, 4, 5120, 4096, 1024), KernelConfig("dq"))
    configs_mod.remember("some_gpu", *first)
    configs_mod.remember("some_gpu", *second)
    path = mm_mod.tuned_cache_path("some_gpu")
    assert path == tmp_path / "configs" / "some_gpu.json" and path.is_file()
    monkeypatch.setattr(configs_mod, "_tables", {})  # as a new process sees it
    assert configs_mod.config_table("some_gpu") == dict([first, second])
    path.write_text("{not json")
    monkeypatch.setattr(configs_mod, "_tables", {})
    assert configs_mod.config_table("some_gpu") == {}
    h200 = configs_mod.config_table("nvidia_h200")  # shipped entries stay underneath the cache
    assert mm_mod.config_key(False, 4, 4096, 4096, 1) in h200


def _scripted_autotune(monkeypatch, cands, script, timed, wrong=()):
    """``mm_mod.autotune`` over ``cands`` with a scripted timer (``script[config]``: its successive times, ms) and
    stand-ins for the GPU calls; each call of a config returns the reference product, or a wrong one for ``wrong``.
    The configs timed are appended to ``timed``."""
    x, qweight, meta = torch.randn(64, 256), torch.randint(0, 256, (128, 128), dtype=torch.uint8), torch.ones(2, 128)
    want = reference.matmul(x, PackedWeight(qweight, meta, meta, 4, 128, 1, (128, 256)))
    last = []

    def fake_mixed_mm(*args, config, **kwargs):
        last.append(config)
        return want * 1.05 if config in wrong else want.clone()

    def fake_do_bench(fn, **kwargs):
        timed.append(last[-1])
        return script[last[-1]][timed.count(last[-1]) - 1] / 1e3

    monkeypatch.setattr(mm_mod, "mixed_mm", fake_mixed_mm)
    scripted_gpu_timing(monkeypatch, fake_do_bench)
    return mm_mod.autotune(x, qweight, meta, meta, group_size=128, candidates=cands)


def test_autotune_never_picks_a_config_whose_output_is_wrong(tmp_path, monkeypatch):
    """Each candidate's output is checked against the float32 reference before it is timed: a config that
    would be the fastest but computes the wrong product is never timed or picked; with no correct config,
    nothing is stored and the table's (or heuristic) pick stays, with a warning."""
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    cands = [KernelConfig("dot", 16, 64, 32, split=s) for s in (1, 2, 4)]
    script = {cands[0]: [1.0] * 3, cands[1]: [2.0] * 3, cands[2]: [3.0] * 3}
    timed = []
    best, times = _scripted_autotune(monkeypatch, cands, script, timed, wrong={cands[0]})
    assert best == cands[1] and times[cands[0]] == float("inf") and cands[0] not in timed
    key = mm_mod.config_key(False, 4, 128, 256, 64)
    assert configs_mod.config_table(mm_mod.device_key(torch.device("cpu")))[key] == cands[1]
    monkeypatch.setattr(configs_mod, "_tables", {})
    with pytest.warns(UserWarning, match="none of 3 configs"):
        best, times = _scripted_autotune(monkeypatch, cands, script, [], wrong=set(cands))
    assert all(t == float("inf") for t in times.values())
    assert key not in configs_mod.config_table(mm_mod.device_key(torch.device("cpu")))
    assert best == mm_mod.pick_config(False, 4, 64, 128, 256, torch.device("cpu"))


def test_autotune_decides_among_the_fastest_by_timing_them_again(tmp_path, monkeypatch):
    """The sweep's fastest RETIME_TOP candidates are timed again back to back, in order and in reverse, and
    their mean times decide: a candidate that only looked fast because it ran first (the clock drifts over
    a sweep) loses; the others keep their sweep times. The timer is scripted; the GPU calls are stand-ins."""
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    cands = [KernelConfig("dq")] + [KernelConfig("wgmma", 64, 64, 64, split=s) for s in (1, 2, 4)] + \
        [KernelConfig("dot", 16, 64, 32, split=s) for s in (1, 2)]
    script = dict(zip(cands, ([1.00, 1.30, 1.34], [1.10, 1.06, 1.04], [1.20, 1.25, 1.25], [1.30, 1.35, 1.35],
                              [1.40], [2.00])))  # dq looks fastest in the sweep only
    timed = []

    best, times = _scripted_autotune(monkeypatch, cands, script, timed)
    top = cands[:mm_mod.RETIME_TOP]
    assert timed == cands + top + top[::-1]
    assert best == cands[1] and times[cands[1]] == pytest.approx(1.05) and times[cands[0]] == pytest.approx(1.32)
    assert times[cands[4]] == pytest.approx(1.40) and times[cands[5]] == pytest.approx(2.00)
    key = mm_mod.config_key(False, 4, 128, 256, 64)  # (N = 128, K = 256 from the packed (K/2, N) weight)
    assert configs_mod.config_table(mm_mod.device_key(torch.device("cpu")))[key] == best


def test_config_too_large_for_shared_memory_retries_with_fewer_stages(monkeypatch):
    """A config whose pipeline does not fit (seen on an H200: a 3-stage 8-bit tile needing 240 KB)
    is launched again with fewer stages instead of failing."""
    from triton.runtime.errors import OutOfResources

    real = launcher_mod.forward_kernel
    tried = []

    class TooBigAboveOneStage:
        def __getitem__(self, grid):
            def run(*args, num_stages, **kwargs):
                tried.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(245760, 232448, "shared memory")
                return real[grid](*args, num_stages=num_stages, **kwargs)
            return run

    monkeypatch.setattr(launcher_mod, "forward_kernel", TooBigAboveOneStage())
    pw = quantize(torch.randn(40, 64), bits=8, group_size=32, dtype=torch.float16).to(DEV)
    x = torch.randn(3, 64, dtype=torch.float16).to(DEV)
    out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=32, bits=8,
                   config=KernelConfig("dot", 16, 32, 16, num_stages=3))
    assert tried == [3, 2, 1]
    ref = reference.matmul(x.float(), pw)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
def test_first_use_autotune_on_gpu_stores_a_correct_pick_and_runs_it(tmp_path, monkeypatch):
    """QUANTPACK_AUTOTUNE=1 on a real GPU, real timings: the first call of a shape the table lacks checks and times the
    candidates (a few, to keep it short: mma and wgmma, and one that cannot run), stores the fastest in the machine's
    cache and returns the right product; later calls run the stored pick without timing again."""
    monkeypatch.setenv("QUANTPACK_AUTOTUNE", "1")
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs_mod, "_tables", {})
    n, k, m = 1536, 2560, 4  # (in no shipped table)
    cands = [KernelConfig("mma", 8, 16, num_warps=1, split=1, num_stages=2, rawq=True, k_warps=4),
             KernelConfig("mma", 8, 16, num_warps=2, split=4, num_stages=2, rawq=True),
             KernelConfig("wgmma", 16, 64, 64, split=2, num_warps=4, num_stages=4, rawq=True, producer=True),
             KernelConfig("dot", 64, 256, 256, num_stages=8)]  # (more shared memory than any GPU has: skipped)
    monkeypatch.setattr(mm_mod, "candidate_configs", lambda *args, **kwargs: list(cands))
    pw, w = packed(n, k, 4, 128, dtype=torch.bfloat16)
    key = mm_mod.config_key(False, 4, n, k, m)
    assert key not in configs_mod.config_table(mm_mod.device_key(torch.device(DEV)))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    assert rel_err(mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128), x.float() @ w.t()) <= 1e-2
    pick = configs_mod.config_table(mm_mod.device_key(torch.device(DEV)))[key]
    assert pick in cands[:3]
    assert key in mm_mod.tuned_cache_path(mm_mod.device_key(torch.device(DEV))).read_text()
    monkeypatch.setattr(mm_mod, "sweep", lambda *args, **kwargs: pytest.fail("tuned twice"))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    assert rel_err(mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128), x.float() @ w.t()) <= 1e-2
