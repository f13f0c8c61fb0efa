"""The package's shape: no import cycles, rank logic in one home, every module importable on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "distill"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
# Only these branch on the main process: the distributed module, and the checkpoint writer, whose staging folder
# the main process makes and renames around the `save_state` every rank takes part in.
RANK_LOGIC = {"distributed", "checkpoint"}
RANK_PATTERNS = ("is_main_process", "environ[", "environ.get(")


def _runtime_imports(module: str) -> set[str]:
    """The distill modules `module` imports when it runs: at the top or in a function, not for type checking."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "distill":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("distill."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("distill."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & set(MODULES)


def test_the_import_graph_has_no_cycle() -> None:
    graph = {module: _runtime_imports(module) for module in MODULES}
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            cycle = " -> ".join([*path[path.index(module) :], module])
            pytest.fail(f"import cycle: {cycle}")
        if module in done:
            return
        for imported in sorted(graph[module]):
            walk(imported, [*path, module])
        done.add(module)

    for module in MODULES:
        walk(module, [])
    assert graph["train"] >= {"pipeline", "distributed"} and "train" not in set().union(*graph.values())


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph walk above fails on a package whose modules import each other."""
    (tmp_path / "a.py").write_text("from distill.b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import distill.c\n")
    (tmp_path / "c.py").write_text("def f():\n    from distill import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", ["a", "b", "c"])
    assert _runtime_imports("a") == {"b"} and _runtime_imports("b") == set() and _runtime_imports("c") == {"a"}
    (tmp_path / "b.py").write_text("import distill.c\n")
    with pytest.raises(pytest.fail.Exception, match="import cycle: a -> b -> c -> a"):
        test_the_import_graph_has_no_cycle()


def test_rank_logic_lives_in_the_distributed_module_and_the_checkpoint_writer() -> None:
    offenders = [
        f"{module}.py:{number}: {line.strip()}"
        for module in MODULES
        if module not in RANK_LOGIC
        for number, line in enumerate((PACKAGE / f"{module}.py").read_text().splitlines(), 1)
        if "is_main_process" in line or "RANK" in line and any(p in line for p in RANK_PATTERNS)
    ]
    assert not offenders, "rank logic outside distill/distributed.py:\n" + "\n".join(offenders)


FRESH_IMPORTS = """
import importlib, sys
failures = []
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "distill" or n.startswith("distill.")]:
        del sys.modules[name]  # every distill module imported afresh; torch and the rest stay loaded
    try:
        importlib.import_module(f"distill.{module}")
    except Exception as e:
        failures.append(f"distill.{module}: {type(e).__name__}: {e}")
print("\\n".join(failures))
"""


def test_every_module_imports_on_its_own() -> None:
    """No module leans on another having been imported first: each is imported with no distill module loaded."""
    done = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, *MODULES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout
