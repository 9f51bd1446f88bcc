"""`quantpack verify` names the method, and compares several packed checkpoints of one source in one table."""
import json

import pytest
from click.testing import CliRunner

from quantpack.cli import cli
from quantpack.convert import convert

FAST = ["--context-length", "64", "--max-tokens", "256", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def packed(tiny_llama_dir, tmp_path_factory):
    """One tiny Llama converted three ways: hqq 4-bit g32, rtn 8-bit g64, gptq 4-bit g32 (built-in passage)."""
    root = tmp_path_factory.mktemp("compare")
    out = {"hqq": root / "tiny-hqq", "rtn8": root / "tiny-rtn8", "gptq": root / "tiny-gptq"}
    convert(tiny_llama_dir, out["hqq"], group_size=32, progress=False)
    convert(tiny_llama_dir, out["rtn8"], bits=8, group_size=64, method="rtn", progress=False)
    convert(tiny_llama_dir, out["gptq"], group_size=32, calibration="builtin", calibration_length=64, progress=False)
    return out


def verify_cli(*args):
    return CliRunner().invoke(cli, ["verify", *map(str, args)])


def test_verify_reports_the_method_and_calibration(packed):
    result = verify_cli(packed["gptq"], *FAST, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    q = doc["quantization"]
    manifest = json.loads((packed["gptq"] / "quantpack.json").read_text())
    assert q == {"scheme": "w4a16", "method": "gptq", "bits": 4, "group_size": 32, "axis": 1,
                 "calibration": manifest["settings"]["calibration"]}
    table = verify_cli(packed["rtn8"], "--no-reference", "--no-progress").stdout
    assert "method     rtn, 8-bit, group 64 (w8a16)\n" in table
    table = verify_cli(packed["gptq"], "--no-reference", "--no-progress").stdout
    tokens = manifest["settings"]["calibration"]["tokens"]
    assert f"method     gptq, 4-bit, group 32 (w4a16); calibrated on {tokens} tokens (built-in passage)\n" in table


def test_verify_compares_several_checkpoints_in_one_table(packed, tiny_llama_dir):
    result = verify_cli(packed["hqq"], packed["rtn8"], packed["gptq"], *FAST)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["packed", "method", "bits", "group", "KL", "top-1", "ppl", "ratio", "worst", "layer",
                                "err", "verdict"]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert [rows[p.name][1:4] for p in packed.values()] == [["hqq", "4", "32"], ["rtn", "8", "64"], ["gptq", "4", "32"]]
    assert all(row[-1] == "PASS" for row in rows.values())
    assert f"reference {tiny_llama_dir}" in result.stdout and "verdict    " not in result.stdout  # no single reports

    doc = json.loads(verify_cli(packed["hqq"], packed["gptq"], *FAST, "--json").stdout)
    assert [r["quantization"]["method"] for r in doc["reports"]] == ["hqq", "gptq"]
    comparison = {row["method"]: row for row in doc["comparison"]}
    for report in doc["reports"]:
        row = comparison[report["quantization"]["method"]]
        m = report["end_to_end"]["metrics"]
        assert row["kl_mean"] == m["kl_mean"] and row["top1_agreement"] == m["top1_agreement"]
        assert row["perplexity_ratio"] == pytest.approx(m["perplexity_packed"] / m["perplexity_reference"])
        assert row["max_layer_error"] == report["layers"]["max_rel_error"]
    assert comparison["gptq"]["kl_mean"] < comparison["hqq"]["kl_mean"]


def test_verify_several_exits_with_the_worst_and_names_each_failure(packed):
    result = verify_cli(packed["hqq"], packed["rtn8"], *FAST, "--max-kl", "0.0001")
    assert result.exit_code == 1
    failed = [line for line in result.stderr.splitlines() if line.startswith("Failed: ")]
    assert failed == [f"Failed: {packed['hqq']}: " + failed[0].split(": ", 2)[2]]  # 8-bit passes, 4-bit does not
    assert "FAIL" in result.stdout and "PASS" in result.stdout


def test_verify_several_refuses_checkpoints_of_different_sources(packed, tiny_llama_dir, tiny_llama_tied_dir, tmp_path):
    other = tmp_path / "other"
    convert(tiny_llama_tied_dir, other, group_size=32, progress=False)
    result = verify_cli(packed["hqq"], other, *FAST)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {packed['hqq']} and {other} were converted from different sources ({tiny_llama_dir} and "
        f"{tiny_llama_tied_dir}); compare checkpoints of one source, or pass --reference SRC to compare all with it"]
