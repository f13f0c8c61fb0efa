"""What a config field accepts (`Check`) and where an option applies (`Scope`): the leaf the config tree's
fields (schema.py), the flag parser (flags.py), the rules (rules.py) and the student kinds' options read."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """A constraint on one field's value: `accepts(value)`, else "<flag>: expected <expected>, got <value>".

    None passes every check: an optional field left unset.
    """

    accepts: Callable[[Any], bool]
    expected: str
    message: str = "{flag}: expected {expected}, got {value}"

    def problem(self, flag: str, value: Any) -> str | None:
        if value is None or self.accepts(value):
            return None
        return self.message.format(flag=flag, expected=self.expected, value=value)


POSITIVE = Check(lambda v: v > 0, "a number greater than 0")
AT_LEAST_ONE = Check(lambda v: v >= 1, "a positive integer")
OPTIONAL_POSITIVE = Check(lambda v: v >= 1, "a positive integer or nothing")
OFF_OR_POSITIVE = Check(lambda v: v >= 0, "0 (off) or a positive integer")
NON_NEGATIVE = Check(lambda v: v >= 0, "a number >= 0")
FRACTION = Check(lambda v: 0 <= v < 1, "a fraction in [0, 1)")
# an empty name is the current folder to pathlib: a teacher '' would hash everything under it, then fail
EMPTY = "{flag}: expected {expected}, got an empty value; pass --{flag} (or drop it for the default)"
MODEL_NAME = Check(lambda v: bool(str(v).strip()), "a Hub name or a model folder", EMPTY)
ENV_NAME = Check(lambda v: re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(v)) is not None, "an environment variable name")
FOLDER = Check(lambda v: bool(str(v).strip()), "a folder", EMPTY)
# the Hub's own rule for a repository id: NAME or OWNER/NAME, letters, digits, '-', '_', '.'
HUB_REPO = Check(
    lambda v: re.fullmatch(r"[\w.-]{1,96}(/[\w.-]{1,96})?", str(v)) is not None and ".." not in str(v),
    "a Hub repository id like your-name/my-student",
)


@dataclass(frozen=True)
class Scope:
    """Where an option applies, when that is not everywhere: `what` (a mode, a kind of student), `how` to choose
    it, and the flags that decide. An option set outside its scope is one problem, said in one form
    (distill/config/rules.py): "<flag>: applies only to <what>; <how> or drop --<flag>"."""

    what: str
    how: str
    deciders: tuple[str, ...]
    applies: Callable[[Any], bool] = lambda config: True  # a Config in, whether it applies


MATRYOSHKA_MODE = Scope(
    "Matryoshka mode", "pass --use_projection False", ("use_projection",), lambda c: not c.mode.use_projection
)
RERANKER = Scope(
    "a reranker teacher", "pass --reranker_model", ("reranker_model",), lambda c: c.reranker.reranker_model is not None
)
