"""The package's shape: no import cycles, rank logic in one home, the demo apart, short functions, every module
importable on its own."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "distill"


def _module_names(package: Path) -> list[str]:
    """Every module of the package as a dotted name under it: `train`, `embedded.corpus`, `embedded` (its __init__)."""
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts and parts[-1] != "__main__":  # a command: importing it runs it
            names.append(".".join(parts))
    return names


MODULES = _module_names(PACKAGE)
# Only these branch on the main process: the distributed module, and the checkpoint writer, whose staging folder
# the main process makes and renames around the `save_state` every rank takes part in.
RANK_LOGIC = {"distributed", "checkpoint"}
# The demo's modules; the core imports them only inside the functions that serve the name `embedded`.
DEMO = "embedded"
LONGEST_FUNCTION = 60


def _source(module: str) -> str:
    path = PACKAGE.joinpath(*module.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def _imported(node: ast.AST) -> set[str]:
    """The distill modules one import statement names (dotted, under distill)."""
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == "distill":
            return {alias.name for alias in node.names}
        if node.module.startswith("distill."):
            base = node.module.removeprefix("distill.")
            return {base} | {f"{base}.{alias.name}" for alias in node.names}
    if isinstance(node, ast.Import):
        return {a.name.removeprefix("distill.") for a in node.names if a.name.startswith("distill.")}
    return set()


def _imports(module: str, top_level_only: bool = False) -> set[str]:
    """The distill modules `module` imports: at the top, in a function, and for type checking alike (a type-only
    import is a dependency too); with `top_level_only`, those its import runs (not in functions or TYPE_CHECKING)."""
    tree = ast.parse(_source(module))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        if top_level_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        found.update(_imported(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in MODULES and name != module}


def test_the_import_graph_has_no_cycle() -> None:
    """No cycle through any import, type-only and in-function ones included; a package's modules import its
    interface module, not its __init__."""
    graph = {module: _imports(module) for module in MODULES}
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
    assert graph["train"] >= {"pipeline"} and "train" not in set().union(*graph.values())


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph walk above fails on a package whose modules import each other, a type-only import included."""
    (tmp_path / "a.py").write_text("from distill.b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import distill.c\n")
    (tmp_path / "c.py").write_text("def f():\n    from distill import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", ["a", "b", "c"])
    assert _imports("a") == {"b"} and _imports("b") == {"c"} and _imports("c") == {"a"}
    assert _imports("b", top_level_only=True) == set() and _imports("c", top_level_only=True) == set()
    with pytest.raises(pytest.fail.Exception, match="import cycle: a -> b -> c -> a"):
        test_the_import_graph_has_no_cycle()


def test_the_core_imports_no_demo_module_at_top_level() -> None:
    offenders = {
        module: sorted(name for name in _imports(module, top_level_only=True) if name.split(".")[0] == DEMO)
        for module in MODULES
        if module.split(".")[0] != DEMO
    }
    assert not {m: names for m, names in offenders.items() if names}


# Main-process branches: accelerate's flags, and comparisons of a rank or process index.
RANK_FLAGS = {"is_main_process", "is_local_main_process", "is_last_process"}
RANK_INDICES = {"process_index", "local_process_index", "rank", "local_rank", "RANK", "LOCAL_RANK"}


def rank_branches(source: str) -> list[int]:
    """Lines that branch on the process: read accelerate's main-process flags, compare a rank or process index,
    or read a rank variable from the environment."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in RANK_FLAGS:
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in ast.walk(node)}
            if names & RANK_INDICES:
                lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and node.value in ("RANK", "LOCAL_RANK"):
            lines.append(node.lineno)  # os.environ["RANK"], os.environ.get("LOCAL_RANK")
    return sorted(set(lines))


def test_rank_logic_lives_in_the_distributed_module_and_the_checkpoint_writer() -> None:
    offenders = [
        f"{module}:{number}: {_source(module).splitlines()[number - 1].strip()}"
        for module in MODULES
        if module not in RANK_LOGIC
        for number in rank_branches(_source(module))
    ]
    assert not offenders, "rank logic outside distill/distributed.py:\n" + "\n".join(offenders)


def test_the_rank_check_sees_every_form_of_a_main_process_branch() -> None:
    forms = [
        "if accelerator.is_main_process:\n    pass\n",
        "if state.is_local_main_process:\n    pass\n",
        "write = accelerator.is_last_process and ready\n",
        "if accelerator.process_index == 0:\n    pass\n",
        "first = local_rank != 0\n",
        "rank = int(os.environ['RANK'])\n",
        "rank = os.environ.get('LOCAL_RANK', '0')\n",
    ]
    assert all(rank_branches(form) for form in forms)
    assert rank_branches("chunks[accelerator.process_index] = local\n") == []  # an index, not a branch


def test_no_function_is_longer_than_a_screen() -> None:
    long = [
        f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module in MODULES
        for node in ast.walk(ast.parse(_source(module)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


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


LONGEST_MODULE = 500
# The kinds' own modules: the only ones that may know a kind by its name (distill/students, distill/teachers).
KIND_MODULES = {
    "students.transformer",
    "students.static",
    "teachers.local",
    "teachers.endpoint",
    "teachers.vectors",
    "teachers.ensemble",
}
KIND_WORDS = re.compile(r"^(static|openai/)|^static:|StaticEmbedding|Transformer$")
KIND_HELPERS = {"is_static", "ENDPOINT_PREFIX", "STATIC_NAME", "StaticEmbedding", "as_model2vec", "one_table"}
NAME_TESTS = {"startswith", "endswith", "removeprefix", "removesuffix", "split", "partition"}


def kind_tests(source: str) -> list[int]:
    """Lines that tell a kind by its name: a comparison, a membership test or a prefix test against a kind's name
    ("static", "openai/..."), a class-name comparison (`type(x).__name__ == ...`), or a kind's own helper."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = list(ast.walk(node))
            named = any(isinstance(n, ast.Attribute) and n.attr == "__name__" for n in parts)
            words = any(isinstance(n, ast.Constant) and KIND_WORDS.search(str(n.value)) for n in parts)
            if named or words:
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in NAME_TESTS:
            if any(isinstance(a, ast.Constant) and KIND_WORDS.search(str(a.value)) for a in node.args):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.alias)) and (getattr(node, "id", None) or node.name) in KIND_HELPERS:
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_code_outside_the_kinds_tells_a_kind_by_its_name() -> None:
    """The run, the config checks, the planner, export and the card ask the kind (distill/students/kinds.py,
    distill/teachers/sources.py); only the kinds' own modules know their names."""
    offenders = [
        f"{module}:{number}: {_source(module).splitlines()[number - 1].strip()}"
        for module in MODULES
        if module not in KIND_MODULES
        for number in kind_tests(_source(module))
    ]
    assert not offenders, "a kind told by its name outside its module:\n" + "\n".join(offenders)


def test_the_kind_check_sees_every_form_of_a_name_test() -> None:
    forms = [
        "if name == 'static':\n    pass\n",
        "if name.startswith('static:'):\n    pass\n",
        "remote = teacher.startswith('openai/')\n",
        "table = type(first).__name__ == 'StaticEmbedding'\n",
        "from distill.students.static import is_static\n",
        "if isinstance(module, StaticEmbedding):\n    pass\n",
        "bare = name.removeprefix('openai/')\n",
    ]
    assert all(kind_tests(form) for form in forms), [form for form in forms if not kind_tests(form)]
    assert kind_tests("kind = student_kind(name)\nif kind.projection_bias:\n    pass\n") == []


def test_no_module_is_longer_than_its_limit() -> None:
    long = [f"{module} ({len(_source(module).splitlines())} lines)" for module in MODULES]
    long = [line for module, line in zip(MODULES, long) if len(_source(module).splitlines()) > LONGEST_MODULE]
    assert not long, f"modules over {LONGEST_MODULE} lines:\n" + "\n".join(long)


def alike(a: str, b: str) -> bool:
    """Two names one reads as the same word: equal, or one another's plural or verb form (teacher and teachers,
    evaluate and evaluation, plan and planner)."""
    shorter, longer = sorted((a, b), key=len)
    stem = shorter[:-1] if len(shorter) > 4 else shorter
    return shorter == longer or longer.startswith(stem)


def test_no_two_modules_or_packages_have_names_alike() -> None:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.parent.name if path.stem == "__init__" else path.stem
        if name != "__main__" and path.parent != PACKAGE.parent:
            names.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    clashes = [f"{a}, {b}" for a in sorted(names) for b in sorted(names) if a < b and alike(a, b)]
    assert not clashes, "names alike:\n" + "\n".join(clashes)
    shared = {name: paths for name, paths in names.items() if len(paths) > 1 and name != PACKAGE.name}
    assert not shared, f"one name, several modules: {shared}"
    assert alike("teacher", "teachers") and alike("evaluate", "evaluation") and alike("plan", "planner")
    assert not alike("data", "distributed") and not alike("store", "static")


def test_no_two_test_files_have_names_alike() -> None:
    """Tests keep the code's rule: each file named by what it holds, and no two names read as one word."""
    names = sorted(path.stem.removeprefix("test_") for path in PACKAGE.parent.joinpath("tests").glob("test_*.py"))
    clashes = [f"test_{a}, test_{b}" for a in names for b in names if a < b and alike(a, b)]
    assert not clashes, "test files alike:\n" + "\n".join(clashes)


TYPES_MODULE = "data.containers"


def test_the_datas_types_import_no_distill_module() -> None:
    """The data's types are a leaf: every stage may import them, and they import nothing of the package."""
    assert _imports(TYPES_MODULE) == set()
    assert "data.containers" in _imports("metrics") and "data" not in _imports("metrics")  # the types, not the stage


SOURCE_PARSER = "data.reading"
SOURCE_WORDS = re.compile(r"source|given|_data\b|dataset")


def source_splits(source: str) -> list[int]:
    """Lines that take a data source string apart at its colon: `split`, `rsplit` or `partition` on ":" of an
    expression that names a source (`source`, `eval_data`, `phase2_data`, a dataset)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("split", "rsplit", "partition") and node.args:
                colon = isinstance(node.args[0], ast.Constant) and node.args[0].value == ":"
                if colon and SOURCE_WORDS.search(ast.unparse(node.func.value)):
                    lines.append(node.lineno)
    return lines


def test_a_source_string_is_split_in_one_module() -> None:
    offenders = [
        f"{module}:{number}: {_source(module).splitlines()[number - 1].strip()}"
        for module in MODULES
        if module != SOURCE_PARSER
        for number in source_splits(_source(module))
    ]
    assert not offenders, "a source taken apart outside distill/data/reading.py:\n" + "\n".join(offenders)
    assert source_splits(_source(SOURCE_PARSER))  # the one place, which the check sees
    forms = ['kind = config.eval_data.split(":", 1)[0]\n', 'name, subset = source.rsplit(":", 1)\n']
    assert all(source_splits(form) for form in forms) and not source_splits('host, port = address.split(":")\n')


def private_imports(source: str) -> list[str]:
    """Names starting with one underscore that an import statement takes from a distill module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distill"):
            found += [
                f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
            ]
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    offenders = {module: private_imports(_source(module)) for module in MODULES}
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"private names imported across modules: {offenders}"
    assert private_imports("from distill.records import _head_and_rest\n") == ["distill.records._head_and_rest"]
