"""quantpack's environment switches: one parser, the documented words, and a one-line refusal of anything else."""
import pytest
from click.testing import CliRunner

from quantpack.cli import cli
from quantpack.env import EnvError, SWITCHES, parse_switch
from quantpack.kernels.dispatch import Flags, launch_plans_enabled


@pytest.mark.parametrize("word,value", [("1", True), ("on", True), ("TRUE", True), ("Yes", True), ("0", False),
                                        ("off", False), ("false", False), ("NO", False)])
def test_every_switch_takes_the_documented_words(word, value):
    for name in SWITCHES:
        assert parse_switch(name, word) is value
        assert parse_switch(name, word.encode()) is value  # as read from the dict behind os.environ


def test_off_words_turn_the_kernel_switches_off(monkeypatch):
    for word in ("off", "false", "no"):
        monkeypatch.setenv("QUANTPACK_MMA", word)
        monkeypatch.setenv("QUANTPACK_W4A8", word)
        monkeypatch.setenv("QUANTPACK_LAUNCH_PLANS", word)
        flags = Flags.from_env()
        assert not flags.mma and flags.w4a8 == "off" and not launch_plans_enabled()
    monkeypatch.setenv("QUANTPACK_W4A8", "Force")
    monkeypatch.setenv("QUANTPACK_AUTOTUNE", "on")
    assert Flags.from_env().w4a8 == "force" and Flags.from_env().autotune


@pytest.mark.parametrize("name", ["QUANTPACK_W4A8", "QUANTPACK_MMA", "QUANTPACK_PDL"])
def test_an_unknown_word_is_refused(monkeypatch, name):
    monkeypatch.setenv(name, "banana")
    with pytest.raises(EnvError, match=f"^{name}='banana' is not a value it takes: use 1/0, true/false"):
        Flags.from_env()


def test_the_command_line_refuses_a_bad_switch_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTPACK_W4A8", "banana")
    result = CliRunner().invoke(cli, ["info", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: QUANTPACK_W4A8='banana' is not a value it takes: use 1/0, true/false, on/off, yes/no or force (or "
        "unset it for the default, off)"]


def test_a_cache_dir_that_is_a_file_is_refused(monkeypatch, tmp_path):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path / "f"))
    result = CliRunner().invoke(cli, ["info", str(tmp_path)])
    assert result.exit_code == 2 and "QUANTPACK_CACHE_DIR=" in result.output and "Traceback" not in result.output
