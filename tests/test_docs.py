"""The documentation matches the code: the options page is --help's, and the commands the README promises exist."""

from __future__ import annotations

import re
from pathlib import Path

from distill.config import FLAGS, build_parser, options_markdown

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_options_page_is_generated_from_the_config():
    page = (DOCS / "options.md").read_text()
    assert page == options_markdown(), "docs/options.md is stale: run `python -m distill.config > docs/options.md`"


def test_options_page_has_every_flag_with_the_help_that_help_prints():
    page = (DOCS / "options.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `--(\w+)` \| `[^`]*` \| (.*) \|$", page, re.M)}
    assert set(rows) == set(FLAGS)
    for action in build_parser()._actions:
        flag = action.option_strings[0][2:] if action.option_strings else ""
        if flag in FLAGS:  # --help adds "(default: ...)" to a help text that does not say its default itself
            assert rows[flag].replace("\\|", "|").startswith(action.help.split(" (default: ")[0]), flag


def test_readme_commands_are_make_targets():
    makefile = (REPO / "Makefile").read_text()
    readme = (REPO / "README.md").read_text()
    for target in ("demo", "test", "test-fast", "lint"):
        assert f"make {target}" in readme and f"\n{target}:" in makefile


def test_readme_links_resolve():
    readme = (REPO / "README.md").read_text()
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", readme):
        assert (REPO / link).is_file(), link
