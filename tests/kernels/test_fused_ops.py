"""Fused RMSNorm and rotary kernels against transformers' Llama code, and quantpack.modules.fused.apply/remove on models.
Kernel outputs are poisoned with NaN first."""
import copy
import gc
import functools
import os

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from quantpack.modules import fused as fused_ops
from quantpack.kernels import fused_ops as k

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [pytest.mark.skipif(not INTERPRETING and not torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 or a GPU"),
              pytest.mark.usefixtures("poisoned_outputs")]  # (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
# (the interpreter rounds float32 -> bfloat16 toward zero: bfloat16 on the GPU only)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
ORIGINAL_ROTARY = modeling_llama.apply_rotary_pos_emb


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def _close(out, ref):
    # the mean's float32 sum runs in another order than torch's and rsqrt may differ in its last bit: a few float32
    # roundings apart, which in float16/bfloat16 moves a value by at most one rounding of the normalized value and
    # one of the weighted product
    eps = torch.finfo(ref.dtype).eps
    tol = 4 * eps if ref.dtype == torch.float32 else 2 * eps
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (17, 4096), (2, 3, 96), (1, 1, 5000)])
def test_rms_norm_matches_llama(shape, dtype):
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(DEV, dtype)
    norm.weight.data = _randn(shape[-1], dtype=dtype, seed=1)
    x = _randn(*shape, dtype=dtype) * 3
    out = k.rms_norm(x, norm.weight, norm.variance_epsilon)
    ref = norm(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref)


def test_rms_norm_promotes_and_takes_row_strides():
    # a float32 weight over float16 activations gives float32, as torch's promotion does
    norm = LlamaRMSNorm(96).to(DEV)
    norm.weight.data = _randn(96, dtype=torch.float32, seed=1)
    x = _randn(5, 96, dtype=torch.float16)
    out = k.rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == torch.float32
    _close(out, norm(x))
    # rows with a gap between them (a slice of a wider tensor): no copy needed
    wide = _randn(2, 4, 128, dtype=torch.float32)[..., :96]
    _close(k.rms_norm(wide, norm.weight, 1e-6), norm(wide))


@pytest.mark.parametrize("bad, match", [
    (lambda x, w: (x, w[:-1]), "contiguous 1-D tensor of 96"),
    (lambda x, w: (x.transpose(0, 1), w[:4]), "last dimension must be contiguous"),
    (lambda x, w: (x.view(2, 2, 96).transpose(0, 1), w), "flatten into rows"),
    (lambda x, w: (x.to(torch.int32), w), "float32, float16 and bfloat16"),
])
def test_rms_norm_refuses_what_it_cannot_take(bad, match):
    x, w = _randn(4, 96, dtype=torch.float32), _randn(96, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        k.rms_norm(*bad(x, w), 1e-6)


def _qkv(b, s, hq, hk, d, dtype, unsqueeze_dim=1):
    """q and k as attention makes them (a projection's output viewed as heads, transposed for unsqueeze_dim=1)."""
    q = _randn(b, s, hq * d, dtype=dtype, seed=2).view(b, s, hq, d)
    k_ = _randn(b, s, hk * d, dtype=dtype, seed=3).view(b, s, hk, d)
    if unsqueeze_dim == 1:
        q, k_ = q.transpose(1, 2), k_.transpose(1, 2)
    angles = _randn(b, s, d // 2, dtype=torch.float32, seed=4) * 10
    emb = torch.cat((angles, angles), dim=-1)
    return q, k_, emb.cos().to(dtype), emb.sin().to(dtype)


def _order(t):
    return [stride for stride, size in zip(t.stride(), t.shape) if size > 1]  # (a size-1 dimension's is arbitrary)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, s, hq, hk, d", [(1, 1, 4, 2, 64), (2, 5, 6, 2, 128), (1, 5, 3, 3, 64), (3, 1, 32, 8, 128),
                                             (1, 3, 2, 1, 96)])
def test_rotary_matches_llama_bit_for_bit(b, s, hq, hk, d, dtype):
    q, k_, cos, sin = _qkv(b, s, hq, hk, d, dtype)
    qo, ko = k.rotary(q, k_, cos, sin)
    qr, kr = ORIGINAL_ROTARY(q, k_, cos, sin)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    assert _order(qo) == _order(qr) and _order(ko) == _order(kr)  # the memory order torch gives


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_other_layouts(dtype):
    # q/k as (B, S, H, D) with unsqueeze_dim=2
    q, k_, cos, sin = _qkv(2, 3, 4, 2, 64, dtype, unsqueeze_dim=2)
    for got, want in zip(k.rotary(q, k_, cos, sin, unsqueeze_dim=2), ORIGINAL_ROTARY(q, k_, cos, sin, 2)):
        assert torch.equal(got, want)
    # contiguous q/k, and one row of cos/sin broadcast over the batch
    q, k_, cos, sin = _qkv(2, 3, 4, 2, 64, dtype)
    q, k_, cos, sin = q.contiguous(), k_.contiguous(), cos[:1], sin[:1]
    for got, want in zip(k.rotary(q, k_, cos, sin), ORIGINAL_ROTARY(q, k_, cos, sin)):
        assert torch.equal(got, want) and got.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_calls_match_through_the_replayed_launch(dtype):
    """Repeated calls of one key replay the compiled launch on the GPU (launch_plan.KernelReplays): new data,
    views of other alignment, strides and shapes each still match torch, called alternately."""
    norm = LlamaRMSNorm(96, eps=1e-6).to(DEV, dtype)
    norm.weight.data = _randn(96, dtype=dtype, seed=1)
    base = _randn(4 * 96 + 8, dtype=dtype)
    norms = [base[:4 * 96].view(4, 96), base[1:4 * 96 + 1].view(4, 96), base[8:].view(2, 2, 96),
             base[:2 * 192].view(2, 192)[:, :96]]
    q, k_, cos, sin = _qkv(2, 3, 4, 2, 64, dtype)
    rotaries = [(q, k_, cos, sin), (q.contiguous(), k_.contiguous(), cos[:1], sin[:1]), _qkv(1, 1, 32, 8, 128, dtype)]
    for rnd in range(3):
        base.copy_(_randn(base.numel(), dtype=dtype, seed=10 + rnd) * (rnd + 1))
        for x in norms:
            _close(k.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        for i, (q, k_, cos, sin) in enumerate(rotaries):
            q = q * (rnd + 1)  # (new data, same layout)
            for got, want in zip(k.rotary(q, k_, cos, sin), ORIGINAL_ROTARY(q, k_, cos, sin)):
                assert torch.equal(got, want), (rnd, i)
    if DEV == "cuda":
        assert len(k._RMS_NORM) >= len(norms) and len(k._ROTARY) >= 2  # (the replays were remembered)


def test_launch_plans_off_gives_the_fused_ops_no_replay_key(monkeypatch):
    """QUANTPACK_LAUNCH_PLANS=0 turns the fused ops' direct launches off with the linears' plans: no key."""
    keys = []
    for name in ("_RMS_NORM", "_ROTARY"):
        real = getattr(k, name)
        monkeypatch.setattr(k, name, lambda key, *a, _real=real, **kw: keys.append(key) or _real(key, *a, **kw))
    x, w = _randn(2, 64, dtype=torch.float32), _randn(64, dtype=torch.float32, seed=1)
    q, k_, cos, sin = _qkv(1, 2, 2, 2, 64, torch.float32)
    for env in ("0", None):
        if env is None:
            monkeypatch.delenv("QUANTPACK_LAUNCH_PLANS", raising=False)
        else:
            monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", env)
        k.rms_norm(x, w, 1e-6)
        k.rotary(q, k_, cos, sin)
    assert keys[:2] == [None, None] and all(isinstance(key, tuple) for key in keys[2:]) and len(keys) == 4


@pytest.mark.parametrize("bad, match", [
    (lambda q, k_, c, s: (q[..., :63], k_[..., :63], c[..., :63], s[..., :63], 1), "even head size"),
    (lambda q, k_, c, s: (q, k_, c, s, 0), "unsqueeze_dim=0"),
    (lambda q, k_, c, s: (q, k_[:, :, :2], c, s, 1), "do not match"),
    (lambda q, k_, c, s: (q, k_, c.double(), s.double(), 1), "share one dtype"),
])
def test_rotary_refuses_what_it_cannot_take(bad, match):
    args = bad(*_qkv(1, 3, 2, 2, 64, torch.float32))
    assert k.rotary_unsupported(*args) is not None
    with pytest.raises(ValueError, match=match):
        k.rotary(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (3, 1500), (17, 14336)])
def test_silu_mul_matches_torch_on_merged_columns(rows, width, dtype):
    """silu(gate) * up, gate and up the two column halves of one (merged gate/up) product, as a decode step has
    them; also contiguous and 3-D."""
    merged = _randn(rows, 2 * width, dtype=dtype) * 4
    gate, up = merged[:, :width], merged[:, width:]
    ref = torch.nn.functional.silu(gate) * up
    out = k.silu_mul(gate, up)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    # a GPU's exponential in Triton is the fast one (a few float32 ulps off torch's, times |x| for large x): float32
    # results within 1e-5; in 16 bits one rounding of silu and one of the product
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g3, u3 = gate.contiguous().view(1, rows, width), up.contiguous().view(1, rows, width)
    torch.testing.assert_close(k.silu_mul(g3, u3), torch.nn.functional.silu(g3) * u3, rtol=tol, atol=tol)


def test_silu_mul_refuses_what_it_cannot_take():
    a = _randn(2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        k.silu_mul(a, a[:, :4])
    with pytest.raises(ValueError, match="dtypes"):
        k.silu_mul(a, a.half())
    with pytest.raises(ValueError, match="contiguous"):
        k.silu_mul(a.t(), a.t())


# --- apply / remove -------------------------------------------------------------------------------------------------

def _static_layer(b, h, length, d, dtype, count):
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(max_cache_len=length)
    layer.lazy_initialization(_randn(b, h, 1, d, dtype=dtype), _randn(b, h, 1, d, dtype=dtype))
    layer.keys.copy_(_randn(b, h, length, d, dtype=dtype, seed=7))
    layer.values.copy_(_randn(b, h, length, d, dtype=dtype, seed=8))
    layer.cumulative_length.fill_(count)
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, h, s, d, length, count", [(1, 8, 1, 128, 64, 0), (3, 2, 1, 80, 37, 36),
                                                       (2, 3, 3, 64, 40, 17), (16, 8, 1, 128, 9, 5),
                                                       (1, 1, 17, 32, 20, 0)])
def test_kv_write_matches_static_layer_update(b, h, s, d, length, count, dtype):
    """One launch writes what transformers' StaticLayer.update writes (keys and values at the count, the count
    advanced), over off-tile head sizes, several tokens a step and the cache's last position; strided key/value as
    attention's transpose leaves them."""
    ref = _static_layer(b, h, length, d, dtype, count)
    got = _static_layer(b, h, length, d, dtype, count)
    key = _randn(b, s, h, d, dtype=dtype, seed=3).transpose(1, 2)
    value = _randn(b, s, h, d, dtype=dtype, seed=4).transpose(1, 2)
    ref.update(key, value)
    k.kv_write(key, value, got.keys, got.values, got.cumulative_length)
    assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)
    assert got.cumulative_length.item() == ref.cumulative_length.item() == count + s


def test_kv_write_leaves_positions_past_the_cache_unwritten():
    layer = _static_layer(1, 2, 8, 64, torch.float32, 6)
    before_keys, before_values = layer.keys.clone(), layer.values.clone()
    key, value = _randn(1, 2, 3, 64, dtype=torch.float32, seed=3), _randn(1, 2, 3, 64, dtype=torch.float32, seed=4)
    k.kv_write(key, value, layer.keys, layer.values, layer.cumulative_length)
    assert torch.equal(layer.keys[:, :, 6:], key[:, :, :2]) and torch.equal(layer.values[:, :, 6:], value[:, :, :2])
    assert torch.equal(layer.keys[:, :, :6], before_keys[:, :, :6])
    assert torch.equal(layer.values[:, :, :6], before_values[:, :, :6])
    assert layer.cumulative_length.item() == 9


@pytest.mark.parametrize("bad, match", [
    (lambda kv: kv | {"key": kv["key"].double()}, "dtypes"),
    (lambda kv: kv | {"key": kv["key"][:, :1]}, "do not match"),
    (lambda kv: kv | {"length": kv["length"].float()}, "length"),
    (lambda kv: kv | {"key": _randn(1, 2, 1, 128, dtype=torch.float32)[..., ::2]}, "contiguous"),
    (lambda kv: kv | {"key": _randn(1, 2, 2000, 64, dtype=torch.float32),
                      "value": _randn(1, 2, 2000, 64, dtype=torch.float32)}, "rows"),
])
def test_kv_write_refuses_what_it_cannot_take(bad, match):
    layer = _static_layer(1, 2, 8, 64, torch.float32, 0)
    kv = dict(key=_randn(1, 2, 1, 64, dtype=torch.float32), value=_randn(1, 2, 1, 64, dtype=torch.float32),
              keys=layer.keys, values=layer.values, length=layer.cumulative_length)
    kv = bad(kv)
    with pytest.raises(ValueError, match=match):
        k.kv_write(**kv)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """fused_ops' kernels run wherever Triton does (the interpreter here); counts their launches."""
    monkeypatch.setattr(fused_ops, "backend", "triton")
    calls = {"rms_norm_unchecked": 0, "rotary_unchecked": 0, "silu_mul_unchecked": 0}
    for name in calls:
        real = getattr(k, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(k, name, spy)
    return calls


@pytest.fixture
def undo():
    """Models given to ``undo.append`` are unpatched afterwards, so no replacement outlives the test. (A model an
    earlier test loaded on a GPU may still hold the process-wide rotary patch: then it may stay.)"""
    gc.collect()
    before = modeling_llama.apply_rotary_pos_emb
    models = []
    yield models.append
    for m in models:
        fused_ops.remove(m)
    assert modeling_llama.apply_rotary_pos_emb in (before, ORIGINAL_ROTARY)


def _tiny_llama(dtype=torch.float32, device=DEV):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def test_apply_keeps_logits_and_remove_undoes(kernels_on_cpu, undo):
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        ref = model(ids).logits
        undo(model)
        assert fused_ops.apply(model) == 5  # 2 layers x (input, post-attention) + the final norm
        assert modeling_llama.apply_rotary_pos_emb is not ORIGINAL_ROTARY
        out = model(ids).logits
        assert kernels_on_cpu == {"rms_norm_unchecked": 5, "rotary_unchecked": 2, "silu_mul_unchecked": 2}
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

        assert fused_ops.apply(model) == 5  # idempotent: nothing wrapped twice
        assert all(m.forward.args[1:] in ((), (None,)) for m in model.modules() if "forward" in m.__dict__)
        # a copy's norms are bound to the copy; apply() on it registers it as a user of the rotary replacement
        clone = copy.deepcopy(model)
        undo(clone)
        assert clone.model.norm.forward.args[0] is clone.model.norm
        assert fused_ops.apply(clone) == 5
        torch.testing.assert_close(clone(ids).logits, ref, rtol=1e-5, atol=1e-5)

        assert fused_ops.remove(model) == 5
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert modeling_llama.apply_rotary_pos_emb is not ORIGINAL_ROTARY  # (the clone still uses it)
        assert fused_ops.remove(clone) == 5
        assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROTARY
        calls = dict(kernels_on_cpu)
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
        assert kernels_on_cpu == calls


def test_original_code_runs_where_the_kernels_do_not(kernels_on_cpu, undo, monkeypatch):
    model = _tiny_llama()
    undo(model)
    fused_ops.apply(model)
    ids = torch.tensor([[1, 2, 3]], device=DEV)
    # training: autograd records, the kernels have no backward
    model.train()
    model(ids).logits.sum().backward()
    assert model.model.norm.weight.grad is not None
    assert kernels_on_cpu == {"rms_norm_unchecked": 0, "rotary_unchecked": 0, "silu_mul_unchecked": 0}
    model.zero_grad()
    monkeypatch.setattr(fused_ops, "backend", "reference")
    with torch.no_grad():
        model(ids)
    monkeypatch.setattr(fused_ops, "backend", "auto")
    if DEV == "cpu":
        with torch.no_grad():
            model(ids)
    assert kernels_on_cpu == {"rms_norm_unchecked": 0, "rotary_unchecked": 0, "silu_mul_unchecked": 0}
    monkeypatch.setattr(fused_ops, "backend", "gpu-please")
    with pytest.raises(ValueError, match="backend='gpu-please'"), torch.no_grad():
        model(ids)


def test_only_llama_norms_are_patched_and_earlier_forwards_kept(kernels_on_cpu, undo):
    gemma, llama = GemmaRMSNorm(16).to(DEV), LlamaRMSNorm(16).to(DEV)
    seen = []

    def hook(module, x):  # an instance-level forward set before (as accelerate's device hooks are)
        seen.append(x.shape)
        return type(module).forward(module, x)
    llama.forward = functools.partial(hook, llama)
    model = nn.Sequential(gemma, llama)
    undo(model)
    assert fused_ops.apply(model) == 1
    assert "forward" not in gemma.__dict__
    x = _randn(3, 16, dtype=torch.float32)
    with torch.no_grad():
        model(x)
        assert kernels_on_cpu["rms_norm_unchecked"] == 1 and not seen
        fused_ops.remove(model)
        assert llama.forward.func is hook
        model(x)
    assert seen == [(3, 16)]


def test_apply_refuses_what_is_not_a_model():
    with pytest.raises(ValueError, match="expected a torch.nn.Module"):
        fused_ops.apply("meta-llama/Llama-3.1-8B")


@pytest.mark.gpu
def test_bf16_llama_on_gpu(undo):
    if INTERPRETING:
        pytest.skip("the GPU test runs the compiled kernels")
    model = _tiny_llama(torch.bfloat16, "cuda")
    ids = torch.randint(0, 64, (2, 7), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        undo(model)
        assert fused_ops.apply(model) == 5
        out = model(ids).logits.float()
    torch.testing.assert_close(out, ref, rtol=2 ** -6, atol=2 ** -6)


def test_silu_mlps_are_patched_in_projection_order_and_others_left(kernels_on_cpu, undo):
    """Llama's MLP with SiLU takes the fused silu * up, calling gate_proj before up_proj as Llama's forward does (the
    merged projections rely on it); another activation, or an MLP with an instance-level forward, keeps its own."""
    model = _tiny_llama()
    other = _tiny_llama()
    other.model.layers[0].mlp.act_fn = nn.GELU()
    hooked = other.model.layers[1].mlp
    hooked.forward = functools.partial(type(hooked).forward, hooked)
    ids = torch.tensor([[1, 2, 3, 4]], device=DEV)
    order = []
    for name in ("gate_proj", "up_proj"):
        model.model.layers[0].mlp.get_submodule(name).register_forward_hook(lambda *a, _n=name: order.append(_n))
    with torch.no_grad():
        ref, ref_other = model(ids).logits, other(ids).logits
        order.clear()
        undo(model)
        undo(other)
        fused_ops.apply(model)
        fused_ops.apply(other)
        assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
        assert "forward" not in other.model.layers[0].mlp.__dict__ and hooked.forward.func is type(hooked).forward
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        assert order == ["gate_proj", "up_proj"]
        assert kernels_on_cpu["silu_mul_unchecked"] == 2
        torch.testing.assert_close(other(ids).logits, ref_other, rtol=1e-5, atol=1e-5)
        assert kernels_on_cpu["silu_mul_unchecked"] == 2  # (neither of the other model's MLPs)
        fused_ops.remove(model)
        assert not any("forward" in layer.mlp.__dict__ for layer in model.model.layers)
