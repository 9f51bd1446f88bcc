"""One scheme registry (quantpack.schemes) for convert, load (both routes) and verify."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from quantpack import schemes
from quantpack.checkpoint import CheckpointError
from quantpack.convert import convert, resolve_scheme
from quantpack.loader import load
from quantpack.modules.linear import QuantLinear


def test_the_registry_holds_every_scheme_the_cli_offers():
    from quantpack.cli import convert_command

    choices = next(p.type.choices for p in convert_command.params if p.name == "scheme")
    assert list(schemes.SCHEMES) == list(choices) == ["w4a16", "w8a16", "w8a8"]


def test_an_unknown_scheme_is_refused_by_name():
    with pytest.raises(CheckpointError, match=r"scheme='w2a2' is not supported by this quantpack \(known: w4a16, "
                                              r"w8a16, w8a8\); upgrade quantpack"):
        schemes.get("w2a2")
    with pytest.raises(ValueError, match="scheme='w2a2' is not supported; use one of w4a16, w8a16, w8a8"):
        resolve_scheme("w2a2", None, 128, 1, None, None)


@pytest.mark.parametrize("name, bits, group_size", [("w4a16", 4, 32), ("w8a16", 8, 64), ("w8a8", 8, None)])
def test_quantize_stores_what_stored_says(name, bits, group_size):
    scheme = schemes.get(name)
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    stored, deq = scheme.quantize(weight, bits=bits, group_size=group_size, axis=1, method="rtn",
                                  dtype=torch.bfloat16)
    want = scheme.stored((48, 128), bits, group_size, 1, torch.bfloat16)
    assert {k: (tuple(t.shape), t.dtype) for k, t in stored.items()} == {k: (tuple(s), d) for k, (s, d) in want.items()}
    assert deq.dtype == torch.float32 and deq.shape == weight.shape
    assert float((deq - weight).norm() / weight.norm()) < (0.2 if bits == 4 else 0.02)


def test_convert_and_load_go_through_the_registry(tiny_llama_dir, tmp_path, monkeypatch):
    """A scheme replaced in the registry is the one convert quantizes with and load builds with."""
    base = schemes.get("w4a16")
    calls = {"quantize": 0, "build": 0}

    def quantize(*args, **kwargs):
        calls["quantize"] += 1
        return base.quantize(*args, **kwargs)

    def build(*args):
        calls["build"] += 1
        return base.build(*args)

    monkeypatch.setitem(schemes.SCHEMES, "w4a16", dataclasses.replace(base, quantize=quantize, build=build))
    convert(tiny_llama_dir, tmp_path / "out", bits=4, group_size=32, method="rtn", device="cpu")
    assert calls["quantize"] > 0
    model = load(tmp_path / "out", device="cpu")
    quantized = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert calls["build"] == calls["quantize"] == quantized > 0
