"""The flat flags: every leaf of the config tree by its flag name, how a value becomes its type, and --help.

`python -m distill.config` prints docs/options.md from the same help texts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distill.config.constraints import Check, Scope
from distill.config.schema import EMPTY_IS_A_VALUE, Config
from distill.errors import DistillError
from distill.files import write_atomic


def _sections() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.metadata.get("section", True)]


@dataclass(frozen=True)
class _Leaf:
    flag: str
    section: str
    name: str
    type: Any
    help: str
    choices: tuple[str, ...] | None
    check: Check | None = None
    scope: Scope | None = None

    def value(self, config: Config) -> Any:
        return getattr(getattr(config, self.section), self.name)


def _leaves() -> list[_Leaf]:
    """Every configurable field, in declaration order, with its flat flag name."""
    leaves = []
    for section in _sections():
        section_type = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            flag = (f.metadata.get("flag") or f.name).format(phase=section.name)
            helptext = f.metadata.get("help", "").format(phase=section.name.replace("phase", "phase "))
            choices, check, scope = f.metadata.get("choices"), f.metadata.get("check"), f.metadata.get("scope")
            leaves.append(_Leaf(flag, section.name, f.name, hints[f.name], helptext, choices, check, scope))
    return leaves


LEAVES = _leaves()
FLAGS = {leaf.flag: leaf for leaf in LEAVES}
SECTIONS = tuple(f.name for f in _sections())


def _base_type(tp: Any) -> Any:
    """`int | None` -> `int`; other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _integer(value: Any) -> int:
    """An int from a flag's text or a YAML number; a YAML bool or a fractional number is a ValueError."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
    return int(value)


def _kind(tp: Any) -> str:
    """The kind of value a field takes, for a message: 'an integer', 'a list of integers like 384,192'..."""
    if typing.get_origin(tp) is list:
        return "a list of integers like 384,192"
    return {bool: "True or False", int: "an integer", float: "a number"}.get(tp, "a text")


def convert(leaf: _Leaf, value: Any) -> Any:
    """Turn a YAML or command-line value into the field's type, or raise DistillError."""
    optional = type(None) in typing.get_args(leaf.type)
    tp = _base_type(leaf.type)
    if value == "" and leaf.flag in EMPTY_IS_A_VALUE:
        return ""
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise DistillError(f"{leaf.flag}: expected a value, got nothing; give it {_kind(tp)}")
    if tp is str and isinstance(value, bool):
        if value is False and leaf.choices and "no" in leaf.choices:
            return "no"  # YAML 1.1 reads an unquoted `mixed_precision: no` as false
        raise DistillError(f"{leaf.flag}: expected a text, got the YAML boolean {value}; quote it in the YAML file")
    if tp is not bool and typing.get_origin(tp) is not list and isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "a mapping"
        raise DistillError(f"{leaf.flag}: expected a single value, got {kind}: {value!r}")
    try:
        number = _typed(tp, value)
    except (TypeError, ValueError):
        kind = tp.__name__ if tp in (int, float, str) else _kind(tp)  # `list[int].__name__` is just "list"
        raise DistillError(f"{leaf.flag}: expected {kind}, got {value!r}") from None
    if isinstance(number, float) and not math.isfinite(number):  # nan passes every `< 0` check and poisons the loss
        raise DistillError(f"{leaf.flag}: expected a finite number, got {value!r}")
    return number


def _typed(tp: Any, value: Any) -> Any:
    """`value` as a `tp` (bool, int, float, str or list of int); ValueError or TypeError if it is not one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ValueError
    if typing.get_origin(tp) is list:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        return [_integer(v) for v in items]
    if tp is int:
        return _integer(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    return str(value)


def closest(name: str) -> str:
    match = difflib.get_close_matches(name, list(FLAGS), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else "; valid keys are listed by --help"


class _Parser(argparse.ArgumentParser):
    """argparse that raises DistillError (one line, with the other problems) instead of printing its usage."""

    def error(self, message: str) -> typing.NoReturn:
        hint = "give the flag its value (--name VALUE, or --name=VALUE for one starting with '-')"
        raise DistillError(f"{message}; {hint}")


# --help's topics: one per section of the config tree, in the tree's order.
HELP_GROUPS = {
    "teacher": "teacher",
    "reranker": "reranker (phase 2's second teacher)",
    "student": "student",
    "mode": "projection or Matryoshka",
    "data": "data",
    "phase1": "phase 1: alignment on general text",
    "phase2": "phase 2: query/passage similarity distillation",
    "training": "training",
    "losses": "losses",
    "performance": "performance",
    "output": "outputs",
    "checkpoint": "checkpoints and evaluation",
    "launch": "launch",
}


def command_name() -> str:
    """The command as the user called it: `distill-train`, or `python -m distill.train`."""
    return "distill-train" if Path(sys.argv[0]).name == "distill-train" else "python -m distill.train"


def build_parser() -> argparse.ArgumentParser:
    """The flag parser, grouped by topic; every default is suppressed so only flags the user typed override the YAML."""
    parser = _Parser(
        prog=command_name(),
        usage="%(prog)s [--config FILE] [--FLAG VALUE ...]",
        description="Distill a text-embedding teacher into a small SentenceTransformer student, in two phases.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of flag-named keys; flags override it.")
    groups = {key: parser.add_argument_group(title) for key, title in HELP_GROUPS.items()}
    defaults = Config()
    for leaf in LEAVES:
        default = getattr(getattr(defaults, leaf.section), leaf.name)
        # a help text that already says its default (in words: "default: all") is not given a second one
        helptext = leaf.help if "default" in leaf.help else f"{leaf.help} (default: {default})"
        group = groups[leaf.section]
        if _base_type(leaf.type) is bool:
            # `--skip_phase1` alone means True; `--skip_phase1 False` is accepted too.
            group.add_argument(f"--{leaf.flag}", nargs="?", const="True", metavar="BOOL", help=helptext)
        elif typing.get_origin(_base_type(leaf.type)) is list:  # `64,32` and `64 32` alike
            group.add_argument(f"--{leaf.flag}", nargs="+", metavar="DIM", help=helptext)
        else:
            group.add_argument(f"--{leaf.flag}", metavar=_metavar(leaf), help=helptext)
    return parser


def options_markdown() -> str:
    """docs/options.md: every flag by --help's topics, its default and the help text --help prints.

    `python -m distill.config > docs/options.md` writes it; a test keeps the page and --help the same.
    """
    defaults = Config()
    lines = [
        "# Options",
        "",
        "Every flag of `python -m distill.train` (also `distill-train`), grouped as `--help` groups them. Each is",
        "also a key of the YAML file given with `--config FILE`: flags override the file, the file overrides the",
        "defaults. This page is generated from the configuration's own help texts (`python -m distill.config`).",
    ]
    for group, title in HELP_GROUPS.items():
        leaves = [leaf for leaf in LEAVES if leaf.section == group]
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", "| flag | default | what it does |", "|---|---|---|"]
        for leaf in leaves:
            default = getattr(getattr(defaults, leaf.section), leaf.name)
            if leaf.name == "teacher_cache_dir":  # its default follows $DISTILL_CACHE and the home folder
                default = "$DISTILL_CACHE/teacher, else ~/.cache/distill/teacher"
            helptext = leaf.help.replace("|", "\\|")
            if leaf.choices:
                helptext += " One of: " + ", ".join(f"`{choice}`" for choice in leaf.choices) + "."
            lines.append(f"| `--{leaf.flag}` | `{default}` | {helptext} |")
    return "\n".join(lines) + "\n"


def _metavar(leaf: _Leaf) -> str:
    """What a flag's value is, in --help: its choices, N for a count, X for a number, else the flag's last word."""
    tp = _base_type(leaf.type)
    if leaf.choices:
        return "|".join(leaf.choices)
    if tp is int:
        return "N"
    if tp is float:
        return "X"
    word = leaf.flag.split("_")[-1]
    return "TRACKERS" if word == "with" else word.upper()  # log_with


def to_flat_dict(config: Config) -> dict[str, Any]:
    """The config as flag-named values: what `--config` reads back."""
    return {leaf.flag: getattr(getattr(config, leaf.section), leaf.name) for leaf in LEAVES}


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (flat, flag-named keys) next to the outputs, all of it or nothing.

    It goes to a hidden temporary file renamed over `path`: a full disk or a kill mid-write leaves the
    previous config.yaml (a resumed run's) whole, never a truncated file that `--config` would misread.
    """
    text = yaml.safe_dump(to_flat_dict(config), sort_keys=False)
    write_atomic(Path(path), lambda staging: staging.write_text(text))
