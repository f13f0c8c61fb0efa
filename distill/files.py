"""How everything is kept on disk, and the small file helpers every stage shares.

One way of keeping an entry (kept data, tokens, teacher vectors, reranker scores, checkpoints, the export):
- it is filled under a staging name no other process makes, on this machine or one sharing the disk
  (`unique_suffix`: host, pid and a random part);
- `seal` fsyncs every file, lists each one's size and checksum in `contents.json`, and fsyncs the folder;
- `put_in_place` renames it in, then removes the copy it replaces; a whole copy already there stays;
- `check` reads it back against `contents.json` (a small file whole, a large one by its size and 16 sampled
  blocks), so a torn file from a crash or a full disk is found and the entry rebuilt, never read.

And what the entries are keyed by: a list of texts' fingerprint (`texts_fingerprint`), each text's digest
(`text_digests`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from distill.errors import DistillError

CONTENTS = "contents.json"  # an entry's manifest: each file's size and checksum
WHOLE_READ = 4 << 20  # files up to this size are checked whole; larger ones by their size and sampled blocks
SAMPLES, SAMPLE_BYTES = 16, 64 << 10


DIGEST_BYTES = 16  # a text's digest: BLAKE2b, 16 bytes


def texts_fingerprint(texts: Sequence[str]) -> str:
    """A digest of a list of texts, in order (a column of distill/data/kept.py brings it computed)."""
    known = getattr(texts, "fingerprint", None)
    if known:
        return known
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf8")
        digest.update(len(encoded).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        digest.update(encoded)
    return digest.hexdigest()


def text_digests(texts: Sequence[str]) -> np.ndarray:
    """Each text's 16-byte BLAKE2b digest, as numpy void: what an entry's per-text index holds (a column of
    distill/data/kept.py brings them computed)."""
    digests = getattr(texts, "digests", None)
    if digests is not None:
        return digests
    raw = b"".join(hashlib.blake2b(text.encode("utf8"), digest_size=DIGEST_BYTES).digest() for text in texts)
    return np.frombuffer(raw, dtype=f"V{DIGEST_BYTES}")


def unique_suffix() -> str:
    """`<host>-<pid>-<random>`: a staging name's tail that no other process makes, here or on a machine sharing the
    folder (pids repeat across machines and containers)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this machine runs (another user's counts): what a staging name's pid says only on
    the machine that made it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(staging)` fills a hidden temporary file that is then synced and renamed to `path`: all of it or
    nothing."""
    staging = path.parent / f".{path.name}.tmp-{unique_suffix()}"
    try:
        write(staging)
        sync(staging)
        os.replace(staging, path)
    except OSError as e:
        staging.unlink(missing_ok=True)
        raise DistillError(f"cannot write {path} ({e.strerror or e}); make the output_dir writable") from None
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """A hidden staging folder beside `folder` for the block to fill, then sealed and put in place (`seal`,
    `put_in_place`): a stopped write is never read. The staging folder goes whatever happens; its name,
    `.<name>.tmp-<host>-<pid>-<random>`, tells `python -m distill.cache` whose it is."""
    staging = folder.parent / f".{folder.name}.tmp-{unique_suffix()}"
    try:
        staging.mkdir(parents=True)
        yield staging
        seal(staging)
        put_in_place(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def sync_tree(folder: Path) -> None:
    """Sync every file under `folder`, then the folders: all of it on the disk before a rename publishes it."""
    for path in folder.rglob("*"):
        if path.is_file():
            sync(path)
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        sync_folder(sub)


def seal(folder: Path, exclude: tuple[str, ...] = ()) -> None:
    """Sync everything under `folder`, list each file's size and checksum (but `exclude`d names) in its
    `contents.json`, synced too, then the folder itself: what `check` reads back."""
    sync_tree(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name != CONTENTS and name not in exclude:
            size = path.stat().st_size
            files[name] = {"bytes": size, "blake2b": file_digest(path, size)}
    contents = folder / CONTENTS
    contents.write_text(json.dumps({"files": files}, indent=1))
    sync(contents)
    sync_folder(folder)


def check(folder: Path, unsealed_ok: bool = False) -> str | None:
    """None where `folder` holds every file its `contents.json` lists, at its size and checksum; else what is
    wrong, in a few words. `unsealed_ok`: a folder without `contents.json` (written by an earlier distill) passes."""
    if not folder.is_dir():
        return "missing"
    try:
        listed = json.loads((folder / CONTENTS).read_text())["files"]
    except FileNotFoundError:
        return None if unsealed_ok else f"unsealed (no {CONTENTS}: written by an earlier distill, or cut short)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {CONTENTS}"
    for name, expected in listed.items():
        path = folder / name
        try:
            size = path.stat().st_size
            if size != expected["bytes"]:
                return f"torn ({name}: {size} bytes, {expected['bytes']} written)"
            if file_digest(path, size) != expected["blake2b"]:
                return f"corrupt ({name}: its checksum differs)"
        except FileNotFoundError:
            return f"incomplete ({name} is missing)"
        except (OSError, KeyError, TypeError) as e:
            return f"unreadable ({name}: {getattr(e, 'strerror', None) or e})"
    return None


def file_digest(path: Path, size: int) -> str:
    """BLAKE2b of a file up to WHOLE_READ bytes; of a larger one's SAMPLES blocks, the first and last included,
    so checking a many-GB entry reads 1 MiB of it."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= WHOLE_READ:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def put_in_place(staging: Path, folder: Path, replace_whole: bool = False, unsealed_ok: bool = False) -> None:
    """Rename the sealed `staging` to `folder`, then remove what it replaced, so a crash at any point leaves one
    whole copy. A whole `folder` already there stays and `staging` goes (an entry keyed by its content holds
    the same under the same name), unless `replace_whole` (a checkpoint saved again at the same step); a
    corrupt one is moved aside first. Where another process put a whole `folder` in place first, its copy stays."""
    aside = None
    if folder.exists():
        if not replace_whole and check(folder, unsealed_ok) is None:
            shutil.rmtree(staging, ignore_errors=True)
            return
        aside = folder.parent / f".{folder.name}.stale-{unique_suffix()}"
        with contextlib.suppress(FileNotFoundError):
            os.replace(folder, aside)
    try:
        os.replace(staging, folder)
    except OSError:
        if check(folder, unsealed_ok) is not None:
            raise
    sync_folder(folder.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def sync(path: Path) -> None:
    """Flush a file's data to the disk, so a rename that follows never points at bytes still in memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it), where the filesystem allows it."""
    with contextlib.suppress(OSError):  # not every filesystem syncs a directory (some network ones refuse)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def reserve(path: Path, size: int) -> None:
    """Allocate `size` bytes of the file `path` on the disk now. A memory map of a sparse file that runs out of
    space at a page fault kills the process with SIGBUS; here a full disk is an OSError saying how much is
    needed and how much is free."""
    free = shutil.disk_usage(path.parent).free
    have = os.stat(path).st_blocks * 512 if hasattr(os.stat_result, "st_blocks") else 0
    if size - have > free:
        needed = f"{human_bytes(size - have)} needed, {human_bytes(free)} free"
        raise OSError(errno.ENOSPC, f"No space left on device: {needed}")
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno != errno.ENOSPC:  # a filesystem that cannot allocate ahead: the free space was checked
            return
        raise OSError(errno.ENOSPC, f"No space left on device: {human_bytes(size)} needed") from None
    except AttributeError:  # not a POSIX system
        pass
    finally:
        os.close(fd)


def human_bytes(n: float) -> str:
    """`n` bytes as `du -h` would say them: 512 B, 3.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
