"""Every name a bench script imports, at the top or inside a function, exists where it is imported from.

The bench scripts import most of what they use inside their functions (a GPU run needs no CPU-only package, and
each variant runs in its own process), so a moved function fails them only when that variant runs: hours into
`make bench`, or on a lent GPU. This test reads their imports instead."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def imported_names(script: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every `from module import name` in `script`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found += [(node.module, alias.name, node.lineno) for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
    return found


def test_the_bench_scripts_are_all_read():
    assert {"gpu.py", "gpu_step.py", "variants.py", "run.py", "gpu_check.py"} <= {s.name for s in SCRIPTS}
    assert sum(len(imported_names(s)) for s in SCRIPTS) > 100


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_every_name_a_bench_script_imports_exists(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import each other by name
    missing = []
    for module, name, line in imported_names(script):
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{script.name}:{line}: import {module}: {e}")
            continue
        if name and not hasattr(imported, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
