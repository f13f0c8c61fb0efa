"""The registry a kind of teacher or student is found in: kinds asked newest first, the first that claims a name
wins (distill/students/kinds.py, distill/teachers/sources.py)."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Claims(Protocol):
    def claims(self, name: str) -> bool: ...


K = TypeVar("K", bound=Claims)


class Registry(Generic[K]):
    """The kinds of one role (`what`: "student", "teacher"); the one registered first claims every name."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.kinds: list[K] = []

    def register(self, kind: K) -> K:
        """Add a kind; it is asked before the ones registered earlier."""
        self.kinds.insert(0, kind)
        return kind

    def claiming(self, name: str) -> K:
        """The kind a name is: the newest kind that claims it."""
        for kind in self.kinds:
            if kind.claims(name):
                return kind
        raise ValueError(f"no {self.what} kind claims {name!r}")  # the first one registered claims every name
