"""The floors CI job installs what pyproject.toml promises: .ci/floors.txt pins each dependency at its lower bound."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _floors_file() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f".ci/floors.txt: {line!r} must pin one version (==)"
            pins[req.name.lower().replace("_", "-")] = Version(spec.version)
    return pins


def _declared_floors() -> dict[str, Version]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        req = Requirement(dep)
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"pyproject.toml: {dep!r} needs one lower bound (>=) for the floors job to test"
        floors[req.name.lower().replace("_", "-")] = lower[0]
    return floors


# Declared floors the CPU job cannot install, with the version it installs instead and why (tested elsewhere).
ABOVE_FLOOR = {"torch": Version("2.13.0")}  # the registry's oldest CPU build; 2.11 runs the GPU tests (CUDA build)


def test_floors_file_pins_every_dependency_at_its_declared_floor():
    pinned, declared = _floors_file(), _declared_floors()
    assert set(pinned) == set(declared)
    for name, version in declared.items():
        assert pinned[name] == ABOVE_FLOOR.get(name, version), name
