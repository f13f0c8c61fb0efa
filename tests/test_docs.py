"""The README documents every flag, and the commands it promises exist."""

from __future__ import annotations

from pathlib import Path

from distill.config import FLAGS

REPO = Path(__file__).resolve().parents[1]


def test_readme_documents_every_flag():
    readme = (REPO / "README.md").read_text()
    missing = [flag for flag in FLAGS if f"`--{flag}`" not in readme]
    assert not missing, f"README's flag table lacks {missing}"


def test_readme_commands_are_make_targets():
    makefile = (REPO / "Makefile").read_text()
    readme = (REPO / "README.md").read_text()
    for target in ("demo", "test", "test-fast", "lint"):
        assert f"make {target}" in readme and f"\n{target}:" in makefile
