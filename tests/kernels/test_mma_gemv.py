"""The tensor-core decode GEMV (``mma`` path): the repacked layout against the PTX definition of
the mma.sync.m16n8k16 fragments (a pure-torch oracle), the kernel against the reference (its
interpreter emulation in CI, inline PTX on the GPU), and mixed_mm's dispatch and fallbacks."""

import pytest
import torch

from oracles import packed_weight as packed, rel_err, mm_mod, dispatch_mod, caches_mod, launcher_mod  # tests/oracles.py
from quantpack.kernels import mixed_mm
from quantpack.kernels.mixed_mm import KernelConfig
from quantpack.kernels.mma_gemv import launch_mma_gemv, mma_depth, mma_grid
from quantpack.kernels.mma_layout import mma_pack

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def mma_products(words, x):
    """Decode packed words as PTX defines the m16n8k16 A fragment (lane = 4g + c; register
    h + 2kh holds rows g + 8h, columns 2c + 8kh + {0, 1}, low half first) and the B registers as the
    kernel loads them (lane (g, c), register kh of k-step j: in-features 16c + 8kh + 2j + {0, 1} of
    row g); return the MMA products summed over k-steps and chunks, (8, 16 tiles)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    tiles, k = words.shape[0], words.shape[1] * 64
    out = torch.zeros(8, 16 * tiles, dtype=torch.int64)
    lane = torch.arange(32)
    g, c = lane // 4, lane % 4
    for t in range(tiles):
        for kc in range(k // 64):
            for j in range(4):
                a = torch.zeros(16, 16, dtype=torch.int64)
                b = torch.zeros(16, 8, dtype=torch.int64)
                for h in range(2):
                    for kh in range(2):
                        for e in range(2):
                            nib = (words[t, kc, :, j] >> (4 * (h + 2 * kh) + 16 * e)) & 15
                            a[g + 8 * h, 2 * c + 8 * kh + e] = nib
                            b[2 * c + 8 * kh + e, g] = x[g, 64 * kc + 16 * c + 8 * kh + 2 * j + e]
                out[:, 16 * t:16 * t + 16] += (a @ b).t()
    return out


def test_packed_words_are_the_mma_fragments():
    """The MMA products of the 4-bit layout's fragments are x @ q.T."""
    n, k = 32, 128
    g_ = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=g_)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).t().contiguous().to(torch.uint8)  # (K/2, N), even k low
    x = torch.randint(-3, 4, (8, k), generator=g_).to(torch.int64)
    assert torch.equal(mma_products(mma_pack(qweight, n, k), x), x @ q.t())


def test_8bit_planes_are_high_then_low_nibble_tiles():
    """8-bit: tile 2t's fragments are the high nibbles of rows 16t.., tile 2t + 1's the low ones."""
    n, k = 48, 192
    g_ = torch.Generator().manual_seed(2)
    q = torch.randint(0, 256, (n, k), generator=g_)
    x = torch.randint(-3, 4, (8, k), generator=g_).to(torch.int64)
    words = mma_pack(q.t().contiguous().to(torch.uint8), n, k, bits=8)
    assert words.shape == (n // 8, k // 64, 32, 4)
    planes = mma_products(words, x).reshape(8, n // 16, 2, 16)
    assert torch.equal((16 * planes[:, :, 0] + planes[:, :, 1]).reshape(8, n), x @ q.t())


def test_mma_pack_refuses_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="N % 16"):
        mma_pack(torch.zeros(64, 40, dtype=torch.uint8), 40, 128)


def run_kernel(x, pw, warps, split, bias=None, depth=2, out_dtype=None, tiles=1, rawq=False, blocks=1, kwarps=1):
    n, k = pw.shape
    grid = mma_grid(n, k, pw.group_size, warps, split, tiles, pw.bits, blocks, kwarps)
    out = torch.full((x.shape[0], n), float("nan"), dtype=out_dtype or x.dtype, device=DEV)
    ws = torch.empty(grid.split, x.shape[0], n, dtype=torch.float32, device=DEV)
    cnt = torch.zeros(grid.programs * grid.row_programs(x.shape[0]), dtype=torch.int32, device=DEV)
    launch_mma_gemv(x, mma_pack(pw.qweight, n, k, pw.bits), pw.scales, pw.zeros, bias, out, ws, cnt, n=n, k=k,
                    group_size=pw.group_size, grid=grid, depth=mma_depth(grid, pw.group_size, depth), rawq=rawq,
                    use_asm=DEV == "cuda", bits=pw.bits)
    assert int(cnt.abs().sum()) == 0  # counters reset for the next launch
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k,gs,warps,split,depth,tiles", [(16, 128, 64, 1, 1, 1, 1), (48, 192, 64, 4, 3, 2, 1),
                                                            (80, 256, 128, 2, 2, 1, 1), (32, 512, 256, 2, 2, 2, 2),
                                                            (128, 192, 64, 2, 3, 1, 2), (128, 256, 128, 2, 2, 2, 4),
                                                            (48, 192, 64, 4, 3, 0, 1), (80, 512, 128, 1, 1, 0, 2),
                                                            (64, 384, 128, 2, 3, 0, 4)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("rawq", [False, True], ids=["zeros_in_a", "rawq"])
def test_kernel_matches_reference(m, n, k, gs, warps, split, depth, tiles, dtype, rawq):
    pw, w = packed(n, k, gs, dtype)
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if m in (3, 9, 40) else None
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    out = run_kernel(x, pw, warps, split, bias, depth, tiles=tiles, rawq=rawq)
    assert rel_err(out, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k,gs,warps,split,depth,tiles", [(48, 192, 64, 4, 3, 2, 1), (80, 256, 128, 2, 2, 1, 1),
                                                            (32, 512, 256, 2, 2, 2, 2), (128, 192, 64, 2, 1, 1, 2),
                                                            (64, 192, 64, 1, 3, 2, 4), (32, 256, 64, 2, 1, 0, 1)])
@pytest.mark.parametrize("m", [9, 17, 33, 40, 50, 64])
def test_row_blocks_match_reference(m, n, k, gs, warps, split, depth, tiles, dtype):
    """Two 16-row blocks of x per program (four 8-row fragments on each unpacked A): fewer rows than
    the blocks hold (9, 17), a ragged last program (33, 40, 50: 32 + 1, 8, 18 rows), one, two and four
    tiles per warp; rawq asked for is ignored (the zeros are subtracted in A)."""
    blocks = 2
    pw, w = packed(n, k, gs, dtype, seed=m)
    g = torch.Generator().manual_seed(m + n + blocks)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if m in (17, 40) else None
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    out = run_kernel(x, pw, warps, split, bias, depth, tiles=tiles, rawq=m == 33, blocks=blocks)
    assert rel_err(out, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k,gs,warps,split,depth", [(16, 128, 64, 1, 1, 1), (48, 192, 64, 4, 3, 2),
                                                      (64, 256, 128, 2, 2, 1), (96, 512, 256, 2, 2, 2),
                                                      (64, 512, 128, 2, 2, 0)])
@pytest.mark.parametrize("m", [1, 3, 9, 16, 33])
def test_8bit_kernel_matches_reference(m, n, k, gs, warps, split, depth, dtype):
    """8-bit weights as two nibble planes (always combined per group in float32)."""
    pw, w = packed(n, k, gs, dtype, bits=8, seed=n + m)
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if m == 3 else None
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    out = run_kernel(x, pw, warps, split, bias, depth, tiles=2)  # (8-bit gets one tile per warp)
    assert rel_err(out, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m,blocks", [(2, 1), (13, 1), (40, 2)])
@pytest.mark.parametrize("rawq", [False, True], ids=["zeros_in_a", "rawq"])
def test_fractional_zeros_lose_no_more_than_dequantizing(m, blocks, dtype, rawq):
    """HQQ zeros are not integers: the zeros-in-A mode rounds ``q - z`` to x's dtype (as
    dequantizing to it rounds ``(q - z) s``), rawq keeps them in float32; both must stay within
    the dequantized weight's error of the float64 product."""
    pw, w = packed(32, 256, 128, dtype, method="hqq")
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEV)
    ref = x.double() @ w.double().t()
    dequantized = x.double() @ w.to(dtype).double().t()
    got = run_kernel(x, pw, 1, 2, out_dtype=torch.float32, tiles=2, rawq=rawq, blocks=blocks).double()
    assert (got - ref).norm() <= 1.5 * (dequantized - ref).norm() + 1e-6 * ref.norm()


def test_grid_rounds_to_divisors():
    # (warps, tiles per warp, groups per warp, split, programs, 16-row blocks of x per program, warps splitting K)
    assert mma_grid(4096, 4096, 128, 8, 16) == (8, 1, 2, 16, 32, 1, 1)
    assert mma_grid(4096, 14336, 128, 4, 32, 2) == (4, 2, 4, 28, 32, 1, 1)  # 112 groups: the largest divisor <= 32
    assert mma_grid(48, 192, 64, 4, 3, 2) == (1, 1, 1, 3, 3, 1, 1)  # 3 tiles of 16 rows: one warp, one tile each
    assert mma_grid(128, 192, 64, 4, 3, 2) == (4, 2, 1, 3, 1, 1, 1)  # 8 tiles: 4 warps of two
    assert mma_grid(96, 192, 64, 4, 3, 2) == (1, 2, 1, 3, 3, 1, 1)  # 3 pairs of tiles: one warp per program
    assert mma_grid(128, 192, 64, 4, 3, 4) == (2, 4, 1, 3, 1, 1, 1)  # 8 tiles: 2 warps of four
    assert mma_grid(96, 192, 64, 4, 3, 4) == (1, 2, 1, 3, 3, 1, 1)  # 6 tiles: four per warp does not divide, two does
    assert mma_grid(64, 192, 64, 4, 3, 3).tiles_per_warp == 2  # 3 asked: the most of 1, 2, 4 not above it
    assert mma_grid(128, 192, 64, 4, 3, 2, bits=8) == (4, 1, 1, 3, 2, 1, 1)  # 8-bit: one tile per warp (two planes)
    assert mma_grid(128, 192, 64, 4, 3, 4, bits=8).tiles_per_warp == 1
    assert mma_grid(128, 192, 64, 4, 3, 2, blocks=2) == (4, 2, 1, 3, 1, 2, 1)  # two blocks, two tiles per warp
    assert mma_grid(128, 192, 64, 4, 3, 2, blocks=4).blocks == 2  # at most two blocks per program
    assert mma_grid(128, 192, 64, 4, 3, 1, bits=8, blocks=2).blocks == 1  # 8-bit planes: one block
    # warps splitting K: a divisor of the groups, at most 8 warps in all, split over what is left
    assert mma_grid(2048, 2048, 128, 1, 1, kwarps=4) == (1, 1, 4, 1, 128, 1, 4)
    assert mma_grid(2048, 2048, 128, 2, 4, kwarps=8) == (2, 1, 1, 4, 64, 1, 4)
    assert mma_grid(64, 384, 128, 1, 8, kwarps=2) == (1, 1, 1, 3, 4, 1, 1)  # 3 groups: no 2 warps, split 3


@pytest.mark.parametrize("blocks,m,row_blocks,row_programs", [(1, 1, 1, 1), (1, 64, 1, 4), (2, 9, 1, 1), (2, 17, 2, 1),
                                                               (2, 50, 2, 2), (2, 64, 2, 2), (4, 64, 2, 2)])
def test_grid_rows_of_x(blocks, m, row_blocks, row_programs):
    """A program takes no more blocks than x has; the programs along M cover every row."""
    grid = mma_grid(4096, 4096, 128, 2, 8, 1, 4, blocks)
    assert (grid.row_blocks(m), grid.row_programs(m)) == (row_blocks, row_programs)
    assert grid.row_programs(m) * 16 * grid.row_blocks(m) >= m


def _spy(monkeypatch):
    """Record the mma kernel's launches (after its once-per-device self-check, which launches it too)."""
    caches_mod.mma_self_check(torch.device(DEV))
    calls = []
    real = launcher_mod.launch_mma_gemv

    def spy(*a, **kw):
        calls.append((kw["grid"].split, kw["grid"].tiles_per_warp, kw["rawq"], kw["depth"], kw["bits"],
                      kw["grid"].blocks) + ((kw["grid"].kwarps,) if kw["grid"].kwarps > 1 else ()))
        return real(*a, **kw)
    monkeypatch.setattr(launcher_mod, "launch_mma_gemv", spy)
    return calls


def test_mixed_mm_takes_the_mma_path_for_decode(monkeypatch):
    """The config's knobs reach the kernel: rows per warp (block_n 32 / 64 = two / four tiles), rawq, depth, rows of x
    per program (block_m 32 = two 16-row blocks; 64 asks for four, the grid allows two)."""
    calls = _spy(monkeypatch)
    pw, w = packed(64, 256, 128)
    for m, x_rows, rows, rawq, depth in ((1, 8, 16, True, 1), (5, 8, 32, False, 2), (16, 16, 32, True, 2),
                                         (64, 16, 16, True, 2), (64, 64, 16, False, 2), (40, 32, 32, False, 1),
                                         (17, 16, 64, True, 2), (3, 8, 16, True, 0)):
        x = torch.randn(m, 256, dtype=torch.float16).to(DEV)
        cfg = KernelConfig("mma", x_rows, rows, num_warps=2, split=2, num_stages=depth, rawq=rawq)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=cfg)
        assert rel_err(out, x.float() @ w.t()) <= 1e-3
    assert calls == [(2, 1, True, 1, 4, 1), (2, 2, False, 2, 4, 1), (2, 2, True, 2, 4, 1), (2, 1, True, 2, 4, 1),
                     (2, 1, False, 2, 4, 2), (2, 2, False, 1, 4, 2), (2, 4, True, 2, 4, 1), (2, 1, True, 0, 4, 1)]


def test_depth_0_only_for_short_programs(monkeypatch):
    """Depth 0 loads a whole program's chunks before its first MMA, so only programs of at most
    PRELOAD_CHUNKS chunks run it; a longer one asked for it runs depth 2; the tuner offers it only where it runs."""
    def depth(k, gs, split, asked, kwarps=1):
        return mma_depth(mma_grid(64, k, gs, 1, split, 1, 4, 1, kwarps), gs, asked)
    assert depth(4096, 128, 16, 0) == 0  # 2 groups of 2 chunks
    assert depth(4096, 128, 8, 0) == 0 and depth(4096, 128, 4, 0) == 2  # 8 / 16 chunks
    assert depth(4096, 128, 1, 0, kwarps=4) == 2 and depth(4096, 128, 1, 0, kwarps=8) == 0  # per warp: 8 / 4 groups
    assert depth(1024, 64, 3, 0) == 0  # split 3 rounds down to 2: 8 groups of one chunk
    assert depth(1024, 64, 1, 0) == 2 and depth(1024, 64, 1, 1) == 1 and depth(1024, 64, 1, 5) == 2
    calls = _spy(monkeypatch)
    pw, w = packed(32, 1536, 128)  # 12 groups: split 1 is 24 chunks
    x = torch.randn(2, 1536, dtype=torch.float16).to(DEV)
    for split in (1, 2, 3):
        cfg = KernelConfig("mma", 8, 16, num_warps=2, split=split, num_stages=0, rawq=True)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=cfg)
        assert rel_err(out, x.float() @ w.t()) <= 1e-3
    assert [c[3] for c in calls] == [2, 2, 0]
    for m, n, k in ((1, 4096, 4096), (8, 14336, 4096), (16, 4096, 4096)):
        mma = [c for c in mm_mod.candidate_configs(False, m, n, k, torch.device(DEV), 4) if c.path == "mma"]
        grids = [(c, mma_grid(n, k, 128, c.num_warps, c.split, c.block_n // 16, 4, 1, c.k_warps)) for c in mma]
        assert all(mma_depth(g, 128, 0) == 0 for c, g in grids if c.num_stages == 0)
        assert all(g.kwarps == c.k_warps and g.warps * g.kwarps <= 8 for c, g in grids)
        assert any(c.num_stages == 0 for c in mma) == (m <= 8), (m, n, k)
        assert {c.block_m for c in mma if c.k_warps > 1} == {min(16, max(8, m))}, (m, n, k)
    for m, n, k in ((1, 4096, 4096), (8, 2048, 2048), (16, 4096, 4096)):  # 8-bit: planes run rawq
        mma = [c for c in mm_mod.candidate_configs(False, m, n, k, torch.device(DEV), 8) if c.path == "mma"]
        assert mma and all(c.rawq for c in mma), (m, n, k)
        assert any(c.k_warps > 1 for c in mma), (m, n, k)
    for bits in (4, 8):  # (32-row programs splitting K measured slower at M = 32..64)
        mma = [c for c in mm_mod.candidate_configs(False, 64, 4096, 4096, torch.device(DEV), bits) if c.path == "mma"]
        assert mma and not any(c.k_warps > 1 for c in mma)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k,gs,warps,split,depth,tiles,bits,kwarps", [
    (32, 256, 64, 1, 1, 1, 1, 4, 4), (64, 512, 128, 2, 1, 2, 1, 4, 2), (128, 512, 64, 1, 2, 1, 2, 4, 4),
    (64, 512, 128, 1, 1, 2, 1, 8, 4), (64, 256, 64, 2, 2, 0, 1, 4, 2), (48, 1024, 128, 1, 1, 0, 1, 4, 8)])
@pytest.mark.parametrize("m", [1, 3, 9, 17])
@pytest.mark.parametrize("rawq", [False, True], ids=["zeros_in_a", "rawq"])
def test_warps_splitting_k_match_reference(m, n, k, gs, warps, split, depth, tiles, bits, kwarps, dtype, rawq):
    """``kwarps`` warps of a program split its K range and sum in shared memory, alone or with split-K over
    programs, one or two tiles per warp, 8-bit planes, each depth."""
    pw, w = packed(n, k, gs, dtype, bits=bits, seed=n + m)
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if m == 3 else None
    assert mma_grid(n, k, gs, warps, split, tiles, bits, 1, kwarps).kwarps == kwarps
    out = run_kernel(x, pw, warps, split, bias, depth, tiles=tiles, rawq=rawq, kwarps=kwarps)
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    assert rel_err(out, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)


@pytest.mark.parametrize("m", [17, 33, 64])
def test_warps_splitting_k_with_two_row_blocks(m):
    """Warps splitting K in a program of two 16-row blocks of x (four 8-row fragments summed per tile)."""
    pw, w = packed(64, 512, 128, torch.float16, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).half().to(DEV)
    for warps, split, kwarps in ((1, 1, 4), (2, 2, 2)):
        assert mma_grid(64, 512, 128, warps, split, 1, 4, 2, kwarps).kwarps == kwarps
        out = run_kernel(x, pw, warps, split, depth=2, blocks=2, kwarps=kwarps)
        assert rel_err(out, x.float() @ w.t()) <= 1e-3


def test_k_warps_reach_the_kernel(monkeypatch):
    calls = _spy(monkeypatch)
    pw, w = packed(64, 1024, 128)
    x = torch.randn(2, 1024, dtype=torch.float16).to(DEV)
    for kwarps, warps in ((4, 1), (2, 2), (8, 2)):  # (8 x 2 warps: the grid allows 4 x 2)
        cfg = KernelConfig("mma", 8, 16, num_warps=warps, split=1, num_stages=0, rawq=True, k_warps=kwarps)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=cfg)
        assert rel_err(out, x.float() @ w.t()) <= 1e-3
    assert [c[3] for c in calls] == [0, 0, 0] and [c[6] for c in calls] == [4, 2, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mixed_mm_takes_the_mma_path_for_8bit_decode(dtype, monkeypatch):
    calls = _spy(monkeypatch)
    pw, w = packed(64, 256, 128, dtype, bits=8)
    for m in (1, 11):
        x = torch.randn(m, 256).to(dtype).to(DEV)
        cfg = KernelConfig("mma", 8, 32, num_warps=2, split=2, num_stages=2, rawq=False)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, bits=8, config=cfg)
        assert rel_err(out, x.float() @ w.t()) <= (1e-3 if dtype == torch.float16 else 8e-3)
    assert calls == [(2, 1, False, 2, 8, 1)] * 2


@pytest.mark.parametrize("case", ["8-bit axis 0", "axis 0", "N % 16", "gs 32", "M = 65", "fp32 x", "disabled",
                                  "transposed"])
def test_mixed_mm_falls_back_where_mma_cannot_run(case, monkeypatch):
    calls = _spy(monkeypatch)
    n, k, gs, bits, axis, m, dtype = 64, 256, 128, 4, 1, 2, torch.float16
    if case == "8-bit axis 0":
        bits, axis, gs = 8, 0, 32
    elif case == "axis 0":
        axis, gs = 0, 32
    elif case == "N % 16":
        n = 72
    elif case == "gs 32":
        gs = 32
    elif case == "M = 65":
        m = 65
    elif case == "fp32 x":
        dtype = torch.float32
    elif case == "disabled":
        monkeypatch.setenv("QUANTPACK_MMA", "0")
    pw, w = packed(n, k, gs, bits=bits, axis=axis)
    cfg = KernelConfig("mma", 8, num_warps=2, split=2)
    if case == "transposed":
        x = torch.randn(m, n, dtype=dtype).to(DEV)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, transposed=True, config=cfg)
        ref = x.float() @ w
    else:
        x = torch.randn(m, k, dtype=dtype).to(DEV)
        out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=gs, bits=bits, config=cfg)
        ref = x.float() @ w.t()
    assert rel_err(out, ref) <= 1e-3
    assert calls == []


def test_repacked_copy_is_cached_and_follows_in_place_changes():
    pw, _ = packed(32, 128, 64)
    first, built = caches_mod.mma_weight_copy(pw.qweight, 32, 128)
    again, built = caches_mod.mma_weight_copy(pw.qweight, 32, 128)
    assert again is first and not built
    pw.qweight[0, 0] ^= 0x11  # in place: the copy is rebuilt
    second, built = caches_mod.mma_weight_copy(pw.qweight, 32, 128)
    assert built and second is not first and torch.equal(second, mma_pack(pw.qweight, 32, 128))


def test_weights_made_in_inference_mode_run_the_mma_path(monkeypatch):
    """Inference-mode tensors have no version counter: the copy is still made, cached and used."""
    calls = _spy(monkeypatch)
    with torch.inference_mode():
        pw, w = packed(64, 256, 128)
        x = torch.randn(2, 256, dtype=torch.float16).to(DEV)
        cfg = KernelConfig("mma", 8, num_warps=2, split=2)
        for _ in range(2):
            out = mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=128, config=cfg)
    assert rel_err(out, x.float() @ w.t()) <= 1e-3
    assert len(calls) == 2 and caches_mod.mma_weight_copy(pw.qweight, 64, 256)[0] is caches_mod.mma_weight_copy(pw.qweight, 64, 256)[0]


def test_kernel_compiles_for_hopper():
    """The inline PTX of each mode, fragment count, 8-bit planes and fp16, with the compile-time
    arguments a launch passes, gets through Triton and ptxas for sm_90 with one MMA count per chunk
    as designed (no GPU needed; the interpreter never sees the PTX)."""
    pytest.importorskip("triton.backends.nvidia")
    from sm90_compile import VARIANTS, run_script  # tests/kernels/sm90_compile.py

    lines = run_script("sm90_compile.py", VARIANTS)
    for line in lines:
        assert "error" not in line, line
        assert line["cubin"] > 0 and line["mma"] > 0 and line["mma"] % line["per_chunk"] == 0, line
    # the 8-bit variant runs its two planes with x's sums: 4 k-steps x 2 fragments x (2 planes + 1)
    assert lines[4]["per_chunk"] == 24
    # warps splitting K sum through one shared-memory exchange of their own (_ksum's PTX), only then
    assert [line["ksum"] for line in lines] == [int(len(v) > 9 and v[9] > 1) for v in VARIANTS]


@pytest.mark.gpu
def test_self_check_passes_on_this_gpu():
    assert caches_mod.mma_self_check(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,gs", [(4096, 4096, 128), (14336, 4096, 128), (4096, 14336, 128), (1024, 2048, 64)])
@pytest.mark.parametrize("bits", [4, 8])
def test_full_size_on_gpu(n, k, gs, dtype, bits):
    pw, w = packed(n, k, gs, dtype, bits=bits)
    for m in (1, 2, 8, 11, 16, 33, 64):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        cases = ((1, 4, 2, 2, True), (2, 16, 2, 1, False), (8, 32, 1, 2, False), (4, 8, 2, 2, True),
                 (1, 16, 1, 1, True), (2, 4, 2, 4, True), (1, 8, 1, 4, False), (4, 16, 0, 1, True),
                 (2, 32, 0, 2, False))
        for warps, split, depth, tiles, rawq in cases if bits == 4 else cases[:3] + cases[7:8]:
            out = run_kernel(x, pw, warps, split, depth=depth, tiles=tiles, rawq=rawq)
            assert rel_err(out, x.float() @ w.t()) <= 1e-2
        for warps, split, depth, kwarps, rawq in ((1, 1, 0, 4, True), (2, 4, 0, 2, False), (1, 1, 2, 8, False),
                                                  (1, 2, 2, 4, True))[:4 if m <= 16 else 1]:
            out = run_kernel(x, pw, warps, split, depth=depth, rawq=rawq, kwarps=kwarps)
            assert rel_err(out, x.float() @ w.t()) <= 1e-2
        for warps, split, depth, tiles, blocks in ((2, 8, 2, 1, 2), (1, 4, 1, 1, 2), (4, 16, 2, 2, 2),
                                                   (2, 4, 1, 2, 2))[:4 if bits == 4 and m > 8 else 0]:
            out = run_kernel(x, pw, warps, split, depth=depth, tiles=tiles, blocks=blocks)
            assert rel_err(out, x.float() @ w.t()) <= 1e-2
        for warps, split, kwarps in ((1, 2, 4), (2, 1, 4))[:2 if bits == 4 and m > 16 else 0]:
            out = run_kernel(x, pw, warps, split, depth=2, blocks=2, kwarps=kwarps)
            assert rel_err(out, x.float() @ w.t()) <= 1e-2


def _spy_pdl(monkeypatch):
    """Record whether each mma launch asks for PDL (after the once-per-device self-check, which launches
    the kernel too)."""
    caches_mod.mma_self_check(torch.device(DEV))
    flags = []
    real = launcher_mod.launch_mma_gemv
    monkeypatch.setattr(launcher_mod, "launch_mma_gemv", lambda *a, **kw: flags.append(kw["pdl"]) or real(*a, **kw))
    return flags


def test_pdl_is_opt_in(monkeypatch):
    """Dense decode kernels take PDL only with QUANTPACK_PDL=1; a mixture-of-experts decode block unless
    QUANTPACK_PDL=0; neither off a Hopper GPU (nor in the interpreter)."""
    flags = _spy_pdl(monkeypatch)
    monkeypatch.delenv("QUANTPACK_PDL", raising=False)
    pw, w = packed(32, 128, 64)
    x = torch.randn(1, 128, dtype=torch.float16).to(DEV)
    for _ in range(2):
        mixed_mm(x, pw.qweight, pw.scales, pw.zeros, group_size=64, config=KernelConfig("mma", 8, split=2))
    assert flags == [False, False]
    # the gate itself, on a pretend GPU: on only with QUANTPACK_PDL=1 and compute capability 9 or later
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for env, major, dense, experts in ((None, 9, False, True), ("0", 9, False, False), ("1", 9, True, True),
                                       ("experts", 9, False, True), ("1", 8, False, False), (None, 8, False, False)):
        if env is None:
            monkeypatch.delenv("QUANTPACK_PDL", raising=False)
        else:
            monkeypatch.setenv("QUANTPACK_PDL", env)
        gpu = dispatch_mod.DeviceProps("gpu", (major, 0), 132)
        assert dispatch_mod.pdl_device(gpu, dispatch_mod.Flags.from_env()) is dense, (env, major)
        assert dispatch_mod.experts_pdl(gpu, dispatch_mod.Flags.from_env()) is experts, (env, major)
    monkeypatch.delenv("QUANTPACK_PDL", raising=False)
    assert not dispatch_mod.pdl_device(dispatch_mod.INTERPRETER, dispatch_mod.Flags.from_env())
    assert not dispatch_mod.experts_pdl(dispatch_mod.INTERPRETER, dispatch_mod.Flags.from_env())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_pdl_chains_read_what_the_previous_kernel_wrote(m, monkeypatch):
    """With QUANTPACK_PDL=1 decode kernels launch with PDL (Hopper): each starts while the previous one
    finishes and waits before reading x. Two layers back to back, the second reading the first's output (split-K, so the
    shared counters too), eagerly and replayed in a CUDA graph, must match the reference every time;
    the launch that builds the mma copy does not use PDL, later ones do up to PDL_MAX_M rows."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    monkeypatch.setenv("QUANTPACK_PDL", "1")
    flags = _spy_pdl(monkeypatch)
    n = k = 4096
    p1, w1 = packed(n, k, 128, torch.bfloat16, seed=1)
    p2, w2 = packed(n, k, 128, torch.bfloat16, seed=2)
    cfg = KernelConfig("mma", 16, 16, num_warps=2, split=8, num_stages=2, rawq=True)

    def two_layers(x):
        h = mixed_mm(x, p1.qweight, p1.scales, p1.zeros, group_size=128, config=cfg)
        return mixed_mm(h, p2.qweight, p2.scales, p2.zeros, group_size=128, config=cfg)

    def check(x, out):
        h = (x.float() @ w1.t()).to(torch.bfloat16).float()
        assert rel_err(out, h @ w2.t()) <= 1e-2
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    check(x, two_layers(x))
    assert flags[-2:] == [False, False]  # (each weight's first launch built its mma copy)
    for _ in range(20):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        check(x, two_layers(x))
    assert flags[-1] is (m <= mm_mod.PDL_MAX_M)
    static_x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = two_layers(static_x)
    for _ in range(10):
        static_x.copy_(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
        graph.replay()
        check(static_x, static_out)
