"""Option parsing of the commands: errors name the option they are about; help fits the terminal; --json
failures are JSON too."""
import json

import pytest
from click.testing import CliRunner

from quantpack.cli import cli


@pytest.mark.parametrize("command", ["convert", "demo"])
@pytest.mark.parametrize("value", ["abc", "0", "-32"])
def test_bad_group_size_names_the_option(command, value):
    args = [command, "x"] if command == "convert" else [command]
    result = CliRunner().invoke(cli, args + ["--group-size", value], prog_name="quantpack")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: Invalid value for '--group-size': {value!r} is not a positive integer or 'none' "
        f"(see 'quantpack {command} --help')"]


def test_command_list_is_not_truncated():
    result = CliRunner().invoke(cli, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1].strip().splitlines()
    assert len(commands) == len(cli.commands) and not any(line.rstrip().endswith("...") for line in commands), commands


def test_the_valid_group_sizes_are_in_help_and_match_the_format():
    from quantpack.cli import GROUP_SIZES_HELP
    from quantpack.format import MAX_GROUP_SIZE, MIN_GROUP_SIZE

    assert f"from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}" in GROUP_SIZES_HELP
    for command in ("convert", "demo"):
        result = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
        assert "Weights per scale/zero group: a power of two from 16 to 1024, or 'none' for per-channel." in \
            result.output or "Weights per group: a power of two from 16 to 1024, or 'none'" in result.output


@pytest.mark.parametrize("command", ["", "convert", "verify", "demo", "tune", "info"])
def test_help_wraps_to_an_80_column_terminal(command):
    result = CliRunner().invoke(cli, [*command.split(), "--help"], terminal_width=80)
    assert result.exit_code == 0
    long = [line for line in result.output.splitlines() if len(line) > 80]
    assert not long, long


@pytest.mark.parametrize("args,exit_code", [
    (["convert", "no-such-dir/", "--json"], 2),
    (["convert", "x", "--group-size", "48", "--json"], 2),
    (["verify", "no-such-dir/", "--json"], 2),
    (["info", "no-such-dir/", "--json"], 2),
    (["tune", "no-such-dir/", "--batch-sizes", "0", "--json"], 2),
])
def test_a_failing_json_command_prints_a_json_error(args, exit_code):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == exit_code
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == exit_code and doc["error"] and not doc["error"].startswith("Error")
    assert doc["error"] in result.stderr
