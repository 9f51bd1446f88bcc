"""The command group: help lists the commands; every usage error is one line, exit 2, no traceback."""
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from quantpack import __version__
from quantpack.cli import cli


def test_help_lists_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in ("convert", "verify", "demo"):
        assert f"  {command} " in result.output


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("args,message", [
    (["convert", "x", "--bits", "3"], "Error: Invalid value for '--bits': '3' is not one of '4', '8'. "
                                      "(see 'quantpack convert --help')"),
    (["convert", "x", "--no-such-option"], "Error: No such option '--no-such-option'. (see 'quantpack convert --help')"),
    (["nosuch"], "Error: No such command 'nosuch'. (see 'quantpack --help')"),
    (["verify"], "Error: Missing argument 'PACKED...'. (see 'quantpack verify --help')"),
])
def test_usage_errors_are_one_line(args, message):
    result = CliRunner().invoke(cli, args, prog_name="quantpack")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [message]


def test_usage_error_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "quantpack", "convert", "x", "--axis", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "Error: Invalid value for '--axis': '2' is not one of '1', '0'. (see 'quantpack convert --help')"]


HEAVY = ("torch", "transformers", "triton", "torch._dynamo")


def test_help_is_fast_and_imports_nothing_heavy():
    """`quantpack --help` answers in well under a second on a CI-class CPU (the bound is loose for slow
    runners); the CLI module and the package import neither torch nor transformers until a command runs."""
    probe = ("import sys, quantpack, quantpack.cli; "
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    times = []
    for _ in range(3):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "quantpack", "--help"], capture_output=True, text=True, timeout=120)
        times.append(time.perf_counter() - start)
        assert proc.returncode == 0 and "convert" in proc.stdout
    assert sorted(times)[1] < 2.5, times  # the median


def test_the_package_names_load_on_first_use():
    probe = ("import sys, quantpack, quantpack.convert, quantpack.integrations.peft; "
             "assert callable(quantpack.quantize), quantpack.quantize  # the function, not its submodule\n"
             "assert quantpack.load.__module__ == 'quantpack.loader' and quantpack.LAYOUT_VERSION >= 1\n"
             "assert quantpack.integrations.peft.lora_config and 'torch._dynamo' not in sys.modules\n"
             "print('ok')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
