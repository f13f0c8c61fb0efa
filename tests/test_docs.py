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


def shell_commands(page: Path) -> list[str]:
    """The commands of a page's bash blocks, continuation lines joined, comments and prompts dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


PAGES = [REPO / "README.md", DOCS / "usage.md"]


def test_the_launch_commands_name_files_that_exist_and_flags_that_parse():
    from distill.config import load_config

    commands = [c for page in PAGES for c in shell_commands(page) if "distill.train" in c or "run_ddp.sh" in c]
    assert len(commands) >= 10  # every launch form of README's launch block
    for command in commands:
        words = command.replace("[flags]", "").split()
        for word in words:
            if word.startswith(("accelerate_configs/", "configs/", "./run_ddp.sh")):
                assert (REPO / word.removeprefix("./")).is_file(), (word, command)
        if "--config_file" in words:  # the launcher's own flags end at -m
            words = words[words.index("-m") :]
        flags = (
            words[words.index("distill.train") + 1 :] if "distill.train" in words else words[3:]
        )  # run_ddp.sh N MODE
        load_config(flags)  # raises DistillError on an unknown flag or a bad value


def test_the_make_targets_the_pages_name_exist():
    makefile = (REPO / "Makefile").read_text()
    for page in [*PAGES, DOCS / "BENCHMARKS.md"]:
        for target in re.findall(r"`make ([a-z-]+)", page.read_text()):
            assert f"\n{target}:" in makefile, (page.name, target)
