"""The command group: help lists the commands; every usage error is one line, exit 2, no traceback."""
import subprocess
import sys

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
    (["verify"], "Error: Missing argument 'PACKED'. (see 'quantpack verify --help')"),
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
