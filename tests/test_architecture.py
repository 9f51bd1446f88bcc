"""The package's shape: the import graph of quantpack/ (function-local imports included) has no cycle, no module
imports another module's private names, and no module is over MAX_LINES lines. Parsed with ``ast``: nothing is
imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "quantpack"
MAX_LINES = 700


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module> import ...`` refers to, in ``module`` (file ``path``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(modules: dict[str, Path]) -> dict[str, list[tuple[str, str | None, int]]]:
    """module -> [(imported quantpack module, name imported from it or None, line)], anywhere in the file."""
    out: dict[str, list[tuple[str, str | None, int]]] = {}
    for module, path in modules.items():
        edges = out[module] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "quantpack"]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if target.split(".")[0] != "quantpack":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    # `from . import x` imports the submodule x; `from .m import name` a name of m
                    edges.append((sub, None, node.lineno) if sub in modules else (target, alias.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {target for target, _, _ in edges if target in modules and target != m}
            for m, edges in _imports(modules).items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_a_relative_import_resolves_from_its_package():
    graph = _graph()
    assert "quantpack.modules.linear" in graph["quantpack.modules.merged"]  # from .linear import
    assert "quantpack.kernels.dispatch" in graph["quantpack.modules.merged"]  # from ..kernels.dispatch import
    assert "quantpack.kernels" in graph["quantpack.modules.linear"]  # from .. import kernels


def test_no_private_name_imported_from_another_module():
    modules = _modules()
    bad = []
    for module, edges in _imports(modules).items():
        for target, name, line in edges:
            private_module = next((part for part in target.split(".") if part.startswith("_") and part != "__init__"),
                                  None)
            # A private module (`_registry_hook`, `_vllm_layers`) is the business of its own package only.
            if private_module and target.rpartition(".")[0] != module.rpartition(".")[0] \
                    and target.rpartition(".")[0] != module:
                bad.append(f"{modules[module].name}:{line} imports {target}")
            if name is not None and name.startswith("_") and name != "__version__":
                bad.append(f"{modules[module].relative_to(PACKAGE.parent)}:{line} imports {target}.{name}")
    assert not bad, "\n".join(bad)


def test_no_module_over_max_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in _modules().values()}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"


@pytest.mark.parametrize("name", ["quantpack.loader", "quantpack.integrations.transformers", "quantpack.verify",
                                  "quantpack.convert"])
def test_the_main_modules_are_in_the_graph(name):
    assert _graph()[name]  # (a parse that found no imports would pass every test above)
