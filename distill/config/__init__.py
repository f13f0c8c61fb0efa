"""One typed config tree: dataclass defaults < YAML file (``--config``) < command-line flags.

The YAML file uses the flat flag names, so the resolved config written next to the outputs can be fed back with
``--config``. Unknown keys name the closest valid one; all validation problems are reported together.

- schema.py: the sections and their fields (defaults, help, checks, scopes);
- constraints.py: what a field accepts (`Check`) and where an option applies (`Scope`);
- flags.py: the flat flag names, conversion of values, --help and docs/options.md;
- rules.py: what a valid config is: each field's checks, the options that apply only to a kind or a mode, and the
  settings that contradict each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from distill.config.flags import (
    FLAGS,
    HELP_GROUPS,
    LEAVES,
    SECTIONS,
    build_parser,
    closest,
    convert,
    dump_config,
    options_markdown,
    to_flat_dict,
)
from distill.config.rules import drop_inherited, validate
from distill.config.schema import (
    Check,
    CheckpointConfig,
    Config,
    DataConfig,
    LaunchConfig,
    LossConfig,
    ModeConfig,
    OutputConfig,
    PerformanceConfig,
    PhaseConfig,
    RerankerConfig,
    Scope,
    StudentConfig,
    TeacherConfig,
    TrainingConfig,
)
from distill.errors import DistillError

__all__ = [
    "FLAGS",
    "HELP_GROUPS",
    "LEAVES",
    "SECTIONS",
    "Check",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LaunchConfig",
    "LossConfig",
    "ModeConfig",
    "OutputConfig",
    "PerformanceConfig",
    "PhaseConfig",
    "RerankerConfig",
    "Scope",
    "StudentConfig",
    "TeacherConfig",
    "TrainingConfig",
    "build_config",
    "build_parser",
    "dump_config",
    "load_config",
    "options_markdown",
    "read_yaml",
    "to_flat_dict",
    "validate",
]


def load_config(argv: list[str] | None = None) -> Config:
    """Resolve defaults < YAML < flags into a validated Config; raises DistillError listing every problem."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    problems = unknown_arguments(unknown)
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None)
    if config_file:
        try:
            values.update(read_yaml(config_file))
        except DistillError as e:
            problems.append(str(e))
    typed = {key for key in vars(args) if key != "config"}
    for key in typed:
        value = getattr(args, key)
        values[key] = ",".join(value) if isinstance(value, list) else value  # a list flag's `64 32`
    return build_config(values, problems, inherited=set(values) - typed, typed=typed)


def unknown_arguments(unknown: list[str]) -> list[str]:
    """One problem per unknown flag (its value, if any, skipped) and per value that follows no flag."""
    problems, after_flag = [], False
    for arg in unknown:
        if arg.startswith("-"):
            problems.append(f"unknown argument '{arg}'{closest(arg.lstrip('-').split('=')[0])}")
            after_flag = "=" not in arg
        elif after_flag:
            after_flag = False  # the unknown flag's value
        else:
            problems.append(
                f"unexpected value '{arg}': it follows no flag, and each flag takes one value; "
                "quote a value that holds spaces"
            )
    return problems


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a flat YAML mapping of flag names; errors name the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DistillError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise DistillError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DistillError(f"config file {str(path)!r} must hold a mapping of flag names to values")
    lines: dict[str, list[int]] = {}
    # YAML keeps the last of a repeated key without a word: a value edited at the top would silently lose
    for key, _ in node.value if node is not None else []:
        lines.setdefault(str(key.value), []).append(key.start_mark.line + 1)
    repeated = [f"{key} (lines {', '.join(map(str, at))})" for key, at in lines.items() if len(at) > 1]
    if repeated:
        raise DistillError(f"config file {str(path)!r} sets {'; '.join(repeated)} more than once; keep one of each")
    return data


def build_config(
    values: dict[str, Any],
    problems: list[str] | None = None,
    inherited: set[str] | None = None,
    typed: set[str] | None = None,
) -> Config:
    """Apply flat flag-named values on top of the defaults and validate the result.

    `problems`: ones found before (unknown flags, an unreadable YAML), reported with the rest in one error.
    `inherited`, `typed`: the keys that came from the --config file and from the command line; a file's key that a
    typed flag makes irrelevant is dropped, with a warning line in `Config.dropped` (`drop_inherited`).
    """
    config = Config()
    problems = list(problems or [])
    for key, value in values.items():
        leaf = FLAGS.get(key)
        if leaf is None and key in SECTIONS and isinstance(value, dict):
            problems.append(_nested_section(key, value))
            continue
        if leaf is None:
            problems.append(f"unknown config key '{key}'{closest(str(key))}")
            continue
        try:
            setattr(getattr(config, leaf.section), leaf.name, convert(leaf, value))
        except DistillError as e:
            problems.append(str(e))
    config.dropped = tuple(drop_inherited(config, inherited or set(), typed or set()))
    problems += validate(config)
    if problems:
        raise DistillError("; ".join(problems))
    return config


def _nested_section(section: str, values: dict) -> str:
    """The fix for a YAML that nests keys under a section of the tree (`phase1: {lr: ...}`)."""
    by_name = {leaf.name: leaf.flag for leaf in LEAVES if leaf.section == section}
    flags = ", ".join(f"{by_name.get(name, name)}: ..." for name in values) or "its keys"
    return (
        f"config key '{section}' is a section of the config tree, but the YAML file takes flat flag names "
        f"(as --help lists them and config.yaml is written); write {flags} at the top level"
    )
