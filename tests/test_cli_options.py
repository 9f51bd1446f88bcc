"""Option parsing of the commands: errors name the option they are about."""
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
