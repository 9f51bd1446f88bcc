"""Keep the prose and the results data honest: sizes the docs promise, every environment variable the code reads
documented, every results line readable by the plot script, and the benchmarks' shared results writer."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _benchmarks_module(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_every_results_line_parses_with_its_required_fields():
    plot = _benchmarks_module("plot")
    files = sorted(RESULTS.glob("*.jsonl"))
    assert {p.stem for p in files} >= {"kernels", "decode", "conversion"}
    for path in files:
        rows = plot.load(path)
        assert rows, path
        for row in rows:
            assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", row["commit"]), (path, row)
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), (path, row)
        if path.stem == "kernels":
            for row in rows:
                assert row["time_us"] is not None or row["ratio_to_cublas"] is not None, row
                if row.get("case") == "experts":  # a mixture-of-experts block: its shape names its dimensions
                    assert {"experts", "top_k", "tokens", "hidden", "inter"} <= set(row["shape"]), row
                    assert row["M"] == row["shape"]["tokens"] >= 1 and row["ratio_to_bf16"] > 0, row
                else:
                    assert len(row["shape"]) == 2 and row["M"] >= 1, row


def test_a_broken_results_line_is_one_error_naming_the_file_and_line(tmp_path):
    plot = _benchmarks_module("plot")
    (tmp_path / "decode.jsonl").write_text('{"device": "x", "commit": "abc1234", "date": "2026-01-01"}\n')
    with pytest.raises(plot.ResultsError, match=r"decode.jsonl:1 lacks batch, model, path, tok_s"):
        plot.load(tmp_path / "decode.jsonl")
    (tmp_path / "kernels.jsonl").write_text("{}\nnot json\n")
    assert plot.main(["--results", str(tmp_path)]) == 2


def test_record_appends_one_line_per_row_with_its_provenance(tmp_path):
    timing = _benchmarks_module("timing")
    row = timing.kernel_line(4096, 4096, 1, 4, 128, "bf16", "quantpack", 6.0, 14.4)
    assert row["ratio_to_cublas"] == 2.4 and row["shape"] == [4096, 4096]
    assert timing.record("kernels", [row], "") is None  # '' records nothing
    path = timing.record("kernels", [row, row], tmp_path)
    path = timing.record("kernels", [row], tmp_path)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    assert len(lines) == 3
    assert all(line["impl"] == "quantpack" and line["device"] and line["date"] for line in lines)
    assert "commit" in lines[0]


def test_every_environment_variable_the_code_reads_is_documented():
    read = set()
    for path in (ROOT / "quantpack").rglob("*.py"):
        read |= set(re.findall(r"\bQUANTPACK_[A-Z_]+[A-Z]\b", path.read_text()))
    assert len(read) >= 7, read
    documented = set(re.findall(r"^\| `(QUANTPACK_[A-Z_]+)` \|", (ROOT / "docs" / "environment.md").read_text(), re.M))
    assert read <= documented, f"not in docs/environment.md: {sorted(read - documented)}"


def test_readme_and_benchmarks_stay_short_and_their_plots_exist():
    readme = (ROOT / "README.md").read_text()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert len(benchmarks.encode()) <= 60_000
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme + benchmarks)
    assert images and all((ROOT / image).is_file() for image in images), images


def test_no_kernels_doc_table_cell_is_a_wall_of_text():
    for line in (ROOT / "docs" / "kernels.md").read_text().splitlines():
        if line.startswith("|"):
            assert max(len(cell) for cell in line.split("|")) <= 300, line[:80]


def test_readme_installs_before_its_first_command_and_shows_the_user_install_first():
    readme = (ROOT / "README.md").read_text()
    first_command = readme.index("quantpack convert")
    assert readme.index("pip install .") < first_command
    assert readme.index("HF_TOKEN") < first_command  # the first example is a gated model
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    installs = re.findall(r"pip install [^\n#]*", setup)
    assert installs[0].strip() == "pip install ." and any("-e" in line for line in installs[1:]), installs
