"""Small file helpers every stage shares: atomic writes, JSON reads, a folder's size."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from distill.errors import DistillError


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(staging)` fills a hidden temporary file that is then renamed to `path`: all of it or nothing."""
    staging = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        write(staging)
        os.replace(staging, path)
    except OSError as e:
        staging.unlink(missing_ok=True)
        raise DistillError(f"cannot write {path} ({e.strerror or e}); make the output_dir writable") from None
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """A hidden staging folder beside `folder` for the block to fill, renamed to `folder` when the block ends: a
    stopped write is never read. Where another process (of this machine, or of one sharing the disk) put `folder`
    in place first, its copy stays: entries made this way hold the same content under the same name. The staging
    folder goes whatever happens; its name, `.<name>.tmp-<host>-<pid>`, tells `python -m distill.cache` whose it
    is."""
    staging = folder.parent / f".{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        yield staging
        try:
            os.replace(staging, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def mark_used(path: Path) -> None:
    """Record that a cache entry was read now, as the modification time of its file `path`, which is what
    `python -m distill.cache prune --unused_days` goes by; a read-only cache is left as it is."""
    with contextlib.suppress(OSError):
        os.utime(path)


def write_json_atomic(path: Path, payload: dict) -> None:
    write_atomic(path, lambda staging: staging.write_text(json.dumps(payload, indent=2, default=str)))


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or {} when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else {}


def folder_bytes(folder: str | os.PathLike) -> int:
    """Every file under `folder`, in bytes (an exported model on disk, a folder of data files)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


BAR_BYTES = 256 << 20  # reading less than this takes seconds: no bar


def bytes_bar(total: int, description: str) -> tqdm:
    """A bar in bytes with rate and time left for work over BAR_BYTES; below that a silent one."""
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, disable=total < BAR_BYTES, dynamic_ncols=True)


def drop_pages(array: Any) -> None:
    """Let go of the pages of a shared memory map (numpy's `memmap`, read-only or written) that this process has
    touched: they stay in the page cache, written back if changed, and come back from there if touched again. So
    reading or writing a file larger than memory through a map adds nothing to the process's resident memory,
    which is what schedulers such as Slurm count. A private (copy-on-write) map or a plain array is left alone."""
    while array is not None and not hasattr(array, "_mmap"):  # a view of a memmap: its base is
        array = getattr(array, "base", None)
    mapping = getattr(array, "_mmap", None)
    if mapping is None or getattr(array, "mode", "c") == "c" or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mapping.madvise(mmap.MADV_DONTNEED)
