"""Heap allocator: which one a process runs on, and the LD_PRELOAD the launchers export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill import allocator
from distill.allocator import find_tcmalloc, heap_allocator, preload_value

REPO = Path(__file__).resolve().parents[1]
TCMALLOC = "libtcmalloc_minimal.so.4"
GLIBC_MAPS = "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


def test_heap_allocator_reads_the_mapped_libraries():
    assert heap_allocator(GLIBC_MAPS) == "glibc"
    assert (
        heap_allocator(GLIBC_MAPS + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n") == "tcmalloc"
    )
    assert heap_allocator(GLIBC_MAPS + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n") == (
        "jemalloc"
    )


@pytest.fixture
def tcmalloc_installed(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: TCMALLOC)


def test_preload_puts_tcmalloc_first_and_keeps_what_was_preloaded(tcmalloc_installed):
    assert preload_value({}) == TCMALLOC
    assert preload_value({"LD_PRELOAD": "/opt/hook.so"}) == f"{TCMALLOC} /opt/hook.so"


def test_preload_leaves_an_allocator_already_preloaded_or_turned_off(tcmalloc_installed):
    assert preload_value({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "/usr/lib/libjemalloc.so.2"
    assert preload_value({"DISTILL_ALLOCATOR": "glibc"}) == ""
    assert preload_value({"DISTILL_ALLOCATOR": "glibc", "LD_PRELOAD": "/opt/hook.so"}) == "/opt/hook.so"


def test_preload_is_empty_without_tcmalloc(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert preload_value({}) == ""


def test_an_unknown_allocator_choice_says_what_is_accepted():
    with pytest.raises(ValueError, match=r"DISTILL_ALLOCATOR must be one of tcmalloc, glibc, got 'mimalloc'"):
        preload_value({"DISTILL_ALLOCATOR": "mimalloc"})


def _run_allocator_module(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distill.allocator"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )


def test_module_prints_one_error_line_for_a_bad_choice():
    done = _run_allocator_module(dict(os.environ, DISTILL_ALLOCATOR="mimalloc"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: DISTILL_ALLOCATOR must be one of tcmalloc, glibc, got 'mimalloc'; unset it for tcmalloc"
    ]


@pytest.mark.skipif(
    find_tcmalloc() is None,
    reason="tcmalloc is not installed here: `make test` installs nothing into the system, `make demo` does as root on "
    "Debian or Ubuntu (or apt-get install libtcmalloc-minimal4)",
)
def test_a_process_started_with_the_printed_preload_runs_on_tcmalloc():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DISTILL_ALLOCATOR")}
    preload = _run_allocator_module(env).stdout.strip()
    assert "tcmalloc" in preload
    probe = [sys.executable, "-c", "from distill.allocator import heap_allocator; print(heap_allocator())"]
    on = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=dict(env, LD_PRELOAD=preload), cwd=REPO)
    off = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert (on.stdout.strip(), off.stdout.strip()) == ("tcmalloc", "glibc")
