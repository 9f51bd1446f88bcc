"""`quantpack demo`, the README's end-to-end command, run as a user runs it."""
import subprocess
import sys

from click.testing import CliRunner

from quantpack.cli import cli


def test_demo_subprocess_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantpack", "demo", "--workdir", str(tmp_path / "demo"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "verdict    PASS" in out and "compression" in out and "top-1" in out
    # the top-1 check judges the demo: the reference is confident at enough positions for it to run
    assert "n/a over the 0 positions" not in out and "skipped    top1_agreement" not in out, out
    assert "check      top1_agreement = " in out, out
    packed = tmp_path / "demo" / "tiny-llama-qp4g32"
    assert (packed / "quantpack.json").is_file() and (packed / "model.safetensors.index.json").is_file()


def test_demo_refuses_a_used_workdir(tmp_path):
    (tmp_path / "tiny-llama").mkdir()
    result = CliRunner().invoke(cli, ["demo", "--workdir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: workdir: {tmp_path / 'tiny-llama'} already exists; pass an empty or new directory"]


def test_demo_names_the_packed_copy_as_convert_does(tmp_path, monkeypatch):
    import quantpack.demo as demo

    calls = {}
    monkeypatch.setattr(demo, "make_tiny_llama", lambda path, **kw: calls.setdefault("source", path))
    monkeypatch.setattr(demo, "convert", lambda source, packed, **kw: calls.setdefault("packed", packed))
    monkeypatch.setattr(demo, "verify", lambda packed, **kw: None)
    result = demo.run_demo(tmp_path, bits=8, group_size=None, progress=False)
    assert result.packed == calls["packed"] == tmp_path / "tiny-llama-qp8pc"  # was tiny-llama-qp8gch


def test_demo_on_cuda_without_a_gpu_refuses_before_building(tmp_path, monkeypatch):
    import tempfile

    import torch

    import quantpack.demo as demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_build(*args, **kwargs):
        raise AssertionError("built a model before checking the device")
    monkeypatch.setattr(demo, "make_tiny_llama", no_build)
    result = CliRunner().invoke(cli, ["demo", "--device", "cuda"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: device='cuda' but no CUDA GPU is available; use --device cpu or auto"]
    assert list(tmp_path.iterdir()) == []  # no temporary folder left behind
