"""quantpack.load: a device that does not exist here is a one-line ValueError naming the argument,
raised before any file is read (torch's own errors are an AssertionError or a RuntimeError)."""
import pytest
import torch

from quantpack.loader import load
from test_loader import llama_src, packed_llama  # noqa: F401

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")


@pytest.mark.parametrize("kwargs,message", [
    (dict(device="tpu"), "device='tpu' is not a device; use 'cpu', 'cuda' or 'cuda:N'"),
    (dict(device="meta"), "device='meta': the model needs real memory"),
    pytest.param(dict(device="cuda"), "device='cuda': no CUDA GPU is available here; use 'cpu'", marks=no_gpu),
    pytest.param(dict(device=0), "device=0: no CUDA GPU is available here", marks=no_gpu),
    pytest.param(dict(device_map="cuda:1"), "device_map='cuda:1': no CUDA GPU is available here", marks=no_gpu),
    pytest.param(dict(device_map={"model": "cpu", "lm_head": "cuda"}),
                 "device_map['lm_head']='cuda': no CUDA GPU is available here", marks=no_gpu),
])
def test_unavailable_device_is_a_value_error(packed_llama, kwargs, message):
    with pytest.raises(ValueError) as info:
        load(packed_llama, **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_device_is_checked_before_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="device='tpu'"):
        load(tmp_path / "missing", device="tpu")


def test_explicit_cpu_device_still_loads(packed_llama):
    model = load(packed_llama, device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
