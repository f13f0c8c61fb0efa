"""Heap allocator: which one this process runs on, and the LD_PRELOAD that puts a launched run on tcmalloc.

On a CPU the student's activations live in the process heap. glibc's malloc keeps the freed blocks of
differently shaped batches scattered through it, so a run's peak memory creeps up with the number of
steps (docs/BENCHMARKS.md, "Memory"). tcmalloc (gperftools; Debian/Ubuntu package
`libtcmalloc-minimal4`) reuses them by size class and holds the peak flat at no measured cost in speed,
which is why PyTorch's CPU performance guide recommends preloading it. The choice has to be made before
the process starts, so it lives with the launchers: `make demo|quality|bench` and `./run_ddp.sh` (CPU)
ask this module for the value to export, and every process `accelerate launch` starts inherits it.

    LD_PRELOAD="$(python -m distill.allocator)" python -m distill.train ...

`DISTILL_ALLOCATOR=glibc` keeps the system allocator; an allocator already in LD_PRELOAD is kept as it is.
"""

from __future__ import annotations

import ctypes.util
import gc
import os
import sys
from pathlib import Path

PRELOADABLE = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
CHOICES = ("tcmalloc", "glibc")  # DISTILL_ALLOCATOR values


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), between stages and every few steps.

    Batches of varying shapes leave freed activation blocks scattered through the heap, and the resident
    size ratchets up with the number of distinct shapes seen; trimming returns those pages for a few page
    faults when they are reused (serving large blocks by mmap instead cost about 30% of the speed). Under
    tcmalloc it trims nothing.
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing to trim


def allocator_named_in(libraries: str) -> str | None:
    """The preloadable allocator ("tcmalloc", "jemalloc") among `libraries` (paths or sonames), or None."""
    return next((name for name in PRELOADABLE if f"lib{name}" in libraries), None)


def heap_allocator(maps: str | None = None) -> str:
    """The allocator serving this process's malloc: "tcmalloc", "jemalloc", "glibc", or "system" off Linux.

    Read from the libraries mapped into the process (`maps`: the text of /proc/self/maps, for tests).
    """
    if maps is None:
        if not sys.platform.startswith("linux"):
            return "system"
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "system"
    return allocator_named_in(maps) or "glibc"


def find_tcmalloc() -> str | None:
    """The shared library to preload for tcmalloc (e.g. "libtcmalloc_minimal.so.4"), or None if not installed."""
    for library in PRELOADABLE["tcmalloc"]:
        found = ctypes.util.find_library(library)
        if found:
            return found
    return None


def preload_value(environ: dict[str, str] | None = None) -> str:
    """LD_PRELOAD for a run launched from `environ`: tcmalloc first, unless turned off, absent or already set."""
    environ = dict(os.environ) if environ is None else environ
    current = environ.get("LD_PRELOAD", "").strip()
    choice = environ.get("DISTILL_ALLOCATOR", "tcmalloc").strip().lower()
    if choice not in CHOICES:
        raise ValueError(
            f"DISTILL_ALLOCATOR must be one of {', '.join(CHOICES)}, got {choice!r}; unset it for tcmalloc"
        )
    library = find_tcmalloc() if choice == "tcmalloc" and allocator_named_in(current) is None else None
    return " ".join(part for part in (library, current) if part)


def main() -> int:
    try:
        print(preload_value())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
