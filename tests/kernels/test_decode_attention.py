"""The split-KV decode attention kernel against torch's math attention, in Triton's interpreter at tiny shapes
(awkward ones: odd batches, GQA ratios, lengths of one position and off the tile, padding masks); full sizes in bf16
on a GPU at the end."""
from __future__ import annotations

import math

import pytest
import torch

from quantpack.kernels import decode_attention as da
from quantpack.kernels.dequant import triton_usable


def _reference(q, k, v, kv_len, mask=None, scale=None):
    """Math attention over the first kv_len positions, causal within the last q_len of them, float64."""
    b, hq, q_len, dim = q.shape
    group = hq // k.shape[1]
    k = k[:, :, :kv_len].double().repeat_interleave(group, 1)
    v = v[:, :, :kv_len].double().repeat_interleave(group, 1)
    pos = torch.arange(kv_len)
    allowed = pos[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
    allowed = allowed[None, None].expand(b, 1, q_len, kv_len)
    if mask is not None:
        allowed = allowed & mask[..., :kv_len].to(allowed.device)
    s = q.double() @ k.transpose(-1, -2) * (scale if scale is not None else dim ** -0.5)
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def _inputs(b, hq, hkv, q_len, max_len, dim=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, q_len, hq, dim, generator=g).transpose(1, 2)  # (as transformers' views: strided)
    k = torch.randn(b, hkv, max_len, dim, generator=g)
    v = torch.randn(b, hkv, max_len, dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


needs_interpreter = pytest.mark.skipif(not triton_usable(torch.empty(0)), reason="needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("b,hq,hkv,q_len,kv_len,max_len,splits", [
    (1, 4, 4, 1, 1, 8, 4),       # one position; more splits than positions
    (3, 8, 2, 1, 17, 96, 3),     # GQA 4:1, off the tile, splits of uneven share
    (1, 8, 1, 1, 130, 200, 2),   # 8:1, several blocks per split
    (3, 4, 4, 3, 70, 70, 5),     # three new tokens (causal among them), the cache full
    (2, 2, 1, 1, 64, 128, 1),    # exactly one tile, no split
])
def test_matches_math_attention(poisoned_outputs, b, hq, hkv, q_len, kv_len, max_len, splits):
    q, k, v = _inputs(b, hq, hkv, q_len, max_len)
    k[:, :, kv_len:] = float("nan")  # (positions past kv_len are never read)
    v[:, :, kv_len:] = float("nan")
    out = da.decode_attention(q, k, v, torch.tensor(kv_len), splits=splits)
    assert out.shape == (b, q_len, hq, q.shape[-1])
    torch.testing.assert_close(out.double(), _reference(q, k, v, kv_len), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_padding_mask_and_scale():
    b, hq, hkv, q_len, kv_len, max_len = 3, 4, 2, 2, 23, 40
    q, k, v = _inputs(b, hq, hkv, q_len, max_len, seed=1)
    mask = torch.ones(b, 1, q_len, max_len, dtype=torch.bool)
    mask[1, ..., :5] = False  # left padding of row 1
    mask[2, ..., :19] = False  # row 2 sees only its last tokens
    mask[..., kv_len:] = False
    out = da.decode_attention(q, k, v, torch.tensor([kv_len]), mask=mask, scale=0.3, splits=3)
    torch.testing.assert_close(out.double(), _reference(q, k, v, kv_len, mask, scale=0.3), rtol=1e-5, atol=1e-5)
    # a mask shared by the batch (stride 0)
    shared = mask[:1].expand(b, 1, q_len, max_len)
    out = da.decode_attention(q, k, v, torch.tensor(kv_len), mask=shared, splits=2)
    torch.testing.assert_close(out.double(), _reference(q, k, v, kv_len, shared), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_length_is_read_on_the_device_each_call():
    """One call's launches serve any length: the kernel reads kv_len from the tensor (as a replayed graph would)."""
    q, k, v = _inputs(1, 4, 2, 1, 64)
    kv_len = torch.tensor(5)
    first = da.decode_attention(q, k, v, kv_len, splits=4)
    kv_len.fill_(41)
    second = da.decode_attention(q, k, v, kv_len, splits=4)
    torch.testing.assert_close(first.double(), _reference(q, k, v, 5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second.double(), _reference(q, k, v, 41), rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_one_split_walks_every_block_and_writes_the_output(poisoned_outputs, monkeypatch):
    """splits=1: one launch, whose program per KV head walks every valid block and writes the output itself (no
    partials, no combine kernel), at any length the cache holds."""
    launched = []
    real = da._decode_attention_combine_kernel
    monkeypatch.setattr(da, "_decode_attention_combine_kernel",
                        type("Counted", (), {"__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    q, k, v = _inputs(3, 4, 2, 2, 300, seed=2)
    kv_len = torch.tensor(0)
    for n in (290, 65, 2):
        kv_len.fill_(n)
        out = da.decode_attention(q, k, v, kv_len, splits=1)
        torch.testing.assert_close(out.double(), _reference(q, k, v, n), rtol=1e-5, atol=1e-5)
    assert not launched
    da.decode_attention(q, k, v, kv_len, splits=2)
    assert len(launched) == 1


def test_default_splits():
    """Enough programs to fill the GPU (8 off it), at most the cache's blocks; one split for a cache of at most four
    blocks once the batch's heads alone give programs to half the GPU."""
    cpu = torch.device("cpu")
    assert da.default_splits(1, 1, 1000, cpu) == 8
    assert da.default_splits(1, 1, 100, cpu) == 2  # (the cache's blocks)
    assert da.default_splits(1, 1, 256, cpu) == 4
    assert da.default_splits(2, 1, 256, cpu) == 1
    assert da.default_splits(2, 1, 257, cpu) == 4


def test_unsupported_inputs_say_why():
    q, k, v = _inputs(1, 6, 4, 1, 8)
    assert "multiple" in da.unsupported(q, k, v, torch.tensor(3))
    q, k, v = _inputs(1, 4, 2, 1, 8)
    assert "mask" in da.unsupported(q, k, v, torch.tensor(3), mask=torch.zeros(1, 1, 1, 8))
    assert "128" in da.unsupported(*_inputs(1, 64, 1, 3, 8), torch.tensor(3))
    with pytest.raises(ValueError, match="kv_len"):
        da.decode_attention(q, k, v, torch.tensor([1.0]))
    if triton_usable(q):  # (16-bit on the CPU: the interpreter's rounding is not torch's)
        assert "float32" in da.unsupported(*(t.bfloat16() for t in (q, k, v)), torch.tensor(3))


def test_sm90_compile():
    """The split kernel (one split and several, with and without a mask), the combine kernel and the KV write
    compile for Hopper (sm_90) on this machine (tests/kernels/sm90_compile_decode.py); the split kernel's two
    products run on tensor cores."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from sm90_compile import run_script  # tests/kernels/sm90_compile.py
    from sm90_compile_decode import VARIANTS  # tests/kernels/sm90_compile_decode.py

    for line in run_script("sm90_compile_decode.py", VARIANTS):
        assert "error" not in line, line
        assert line["cubin"] > 0
        assert (line["mma"] > 0) == (line["variant"][0] == "split"), line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,q_len,kv_len,max_len", [(1, 1, 32768, 33024), (16, 1, 4100, 4352), (3, 4, 1000, 2048),
                                                    (2, 1, 1, 256), (16, 1, 200, 256)])
def test_gpu_bf16_full_sizes(b, q_len, kv_len, max_len):
    """8B Llama's attention shape (32 query heads, 8 KV heads, head_dim 128) in bf16 against float64 math."""
    q, k, v = _inputs(b, 32, 8, q_len, max_len, dim=128, dtype=torch.bfloat16, device="cuda")
    mask = torch.ones(b, 1, q_len, max_len, dtype=torch.bool, device="cuda")
    mask[0, ..., : kv_len // 3] = False
    for m in (None, mask):
        out = da.decode_attention(q, k, v, torch.tensor(kv_len, device="cuda"), mask=m)
        ref = _reference(q.cpu(), k.cpu(), v.cpu(), kv_len, None if m is None else m.cpu())
        torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2)
    # under CUDA-graph replay, the length read from the device
    kv = torch.tensor(kv_len, device="cuda")
    da.decode_attention(q, k, v, kv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, k, v, kv)
    for n in (max(1, kv_len // 2), kv_len):
        kv.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double().cpu(), _reference(q.cpu(), k.cpu(), v.cpu(), n),
                                   rtol=2e-2, atol=2e-2)
    assert math.isfinite(out.float().abs().max().item())
