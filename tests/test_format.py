"""Packed layout: pack/unpack are exact inverses, the nibble order is as documented, bad input is refused."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantpack.format import PackedWeight, check_layout_args, pack, packed_shapes, unpack


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k_half=st.integers(1, 40), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31))
def test_pack_unpack_roundtrip(n, k_half, bits, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, 2 * k_half), generator=g, dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8
    assert tuple(packed.shape) == ((k_half, n) if bits == 4 else (2 * k_half, n))
    assert torch.equal(unpack(packed, bits), q)


def test_int4_nibble_order_even_k_low():
    # q[n, k]: n=0 row holds k=0 -> 1, k=1 -> 15 (high values must not sign-extend), k=2 -> 7, k=3 -> 8
    q = torch.tensor([[1, 15, 7, 8], [0, 9, 15, 15]], dtype=torch.uint8)
    packed = pack(q, 4)
    assert packed.tolist() == [[1 | (15 << 4), 0 | (9 << 4)], [7 | (8 << 4), 15 | (15 << 4)]]
    assert unpack(packed, 4).tolist() == q.tolist()


def test_unpack_never_sign_extends():
    packed = torch.full((3, 5), 0xFF, dtype=torch.uint8)
    assert int(unpack(packed, 4).min()) == 15
    assert int(unpack(packed, 8).min()) == 255


@pytest.mark.parametrize("bits,bad", [(4, 16), (8, 256), (4, -1)])
def test_pack_rejects_out_of_range(bits, bad):
    q = torch.zeros(2, 4, dtype=torch.int32)
    q[0, 0] = bad
    with pytest.raises(ValueError, match="q: values"):
        pack(q, bits)


@pytest.mark.parametrize("shape,bits,gs,axis,match", [
    ((8, 64), 3, 32, 1, "bits"),
    ((8, 64), 4, 48, 1, "group_size"),      # not a power of two
    ((8, 96), 4, 64, 1, "group_size"),      # does not divide K
    ((8, 64), 4, 8, 1, "group_size"),       # below the minimum
    ((8, 4096), 4, 2048, 1, "group_size"),  # above the maximum
    ((8, 63), 4, 63, 1, "K=63 is odd"),
    ((48, 64), 4, 32, 0, "group_size"),     # axis 0: must divide N
    ((8, 64), 4, 32, 2, "axis"),
])
def test_check_layout_args_names_the_argument(shape, bits, gs, axis, match):
    with pytest.raises(ValueError, match=match):
        check_layout_args(shape, bits, gs, axis)


def test_per_channel_group_need_not_be_power_of_two():
    check_layout_args((8, 96), 4, 96, 1)
    check_layout_args((24, 64), 8, 24, 0)
    assert packed_shapes((8, 96), 4, 96, 1) == {"qweight": (48, 8), "scales": (1, 8), "zeros": (1, 8)}
    assert packed_shapes((24, 64), 8, 24, 0) == {"qweight": (64, 24), "scales": (64, 1), "zeros": (64, 1)}


def test_validate_reports_wrong_tensor():
    pw = PackedWeight(torch.zeros(32, 8, dtype=torch.uint8), torch.zeros(2, 8), torch.zeros(3, 8), 4, 32, 1, (8, 64))
    with pytest.raises(ValueError, match="zeros: shape"):
        pw.validate()
    pw = PackedWeight(torch.zeros(32, 8, dtype=torch.int8), torch.zeros(2, 8), torch.zeros(2, 8), 4, 32, 1, (8, 64))
    with pytest.raises(ValueError, match="qweight: dtype"):
        pw.validate()
    pw = PackedWeight(torch.zeros(32, 8, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.bfloat16),
                      torch.zeros(2, 8, dtype=torch.float16), 4, 32, 1, (8, 64))
    with pytest.raises(ValueError, match="zeros: dtype torch.float16 differs from scales' torch.bfloat16"):
        pw.validate()
    pw = PackedWeight(torch.zeros(32, 8, dtype=torch.uint8), torch.zeros(2, 8), torch.zeros(2, 8, device="meta"),
                      4, 32, 1, (8, 64))
    with pytest.raises(ValueError, match="different devices"):
        pw.validate()
