"""The teacher cache on disk: its entries and the staging folders they are written through.

Layout of `<teacher_cache_dir>/`:

    <key>/{embeddings.npy, manifest.json,     an entry: float16 vectors and what they are, each row's text's
           texts.npy, contents.json}          digest (so a run with other texts reuses the rows it shares),
                                              and each file's size and checksum (distill/files.py)
    .<key>.partial/                           an encoding in progress or interrupted; its progress.json says
                                              how far it got, and the next run with the same key continues
                                              it, on any machine that sees the folder
    .<key>.lock                               held (flock) by the run writing that partial folder; it names
                                              that run's host, pid and job
    .<key>.tmp-<host>-<pid>-<random>/         staging where the filesystem has no locks; never resumed
    .<key>.stale-<host>-<pid>-<random>/       a corrupt entry moved aside while its replacement goes in

Entries appear by a rename, whole or not at all, and a whole entry is never replaced. A run that finds the
lock held by another run waits for it and then reads what it wrote; a machine of the same job that shares
the folder leaves the writing to the machine holding the lock. A run that reads an entry refreshes its
manifest's modification time, which is what `prune --unused_days` goes by. How the key is made and the
vectors computed is the teacher stage's business (distill/stages/targets.py); their upkeep is distill/cache.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from distill.files import (
    DIGEST_BYTES,
    check,
    drop_pages,
    put_in_place,
    read_json,
    reserve,
    seal,
    sync,
    unique_suffix,
)

Role = Literal["query", "document", "pair"]  # "pair": a reranker's (query, passage) pairs


class TeacherDescription(Protocol):
    """What an entry's manifest says of the teacher that wrote it (distill.teachers.local.TeacherSpec)."""

    @property
    def path(self) -> str: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def max_seq_length(self) -> int | None: ...

    def prompt(self, role: Role) -> str: ...


CACHE_FORMAT = 1
TEXT_INDEX = "texts.npy"  # an entry's row -> its text's digest, so a run with other texts reuses its rows


CACHE_DTYPE = np.float16


KEY = re.compile(r"[0-9a-f]{32}")


STAGED = re.compile(r"\.(?P<key>[0-9a-f]{32})\.(?P<kind>partial|lock|tmp|stale)(?:-(?P<rest>.+))?")
PROGRESS = "progress.json"
WAIT_SECONDS = 10.0  # between two tries of a lock another run holds
UNLOCKED_SAID: set[Path] = set()  # cache folders whose lack of locks this process has said


def lock_file(folder: Path, key: str) -> Path:
    """The lock a run holds while it writes `.<key>.partial/`."""
    return folder / f".{key}.lock"


def partial_folder(folder: Path, key: str) -> Path:
    """Where the run holding `key`'s lock encodes, resumably."""
    return folder / f".{key}.partial"


def read_json_or_empty(path: Path) -> dict:
    """The JSON object in `path`; {} if it is missing, unreadable or not an object."""
    try:
        value = read_json(path)
    except (ValueError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def read_entry(entry: Path, key: str, count: int) -> np.ndarray | None:
    """The entry's embeddings if its manifest and sizes match what was asked for, else None."""
    manifest = read_json_or_empty(entry / "manifest.json")
    data = entry / "embeddings.npy"
    if manifest.get("key") != key or manifest.get("count") != count or not data.is_file():
        return None
    if data.stat().st_size != manifest.get("bytes") or check(entry, unsealed_ok=True) is not None:
        return None
    try:
        vectors = np.load(data, mmap_mode="r")
    except (ValueError, OSError):
        return None
    if vectors.shape != (count, manifest.get("dim")) or vectors.dtype != CACHE_DTYPE:
        return None
    return vectors


@dataclass
class Claim:
    """The outcome of taking a lock: the descriptor holding it, or why not (held by another process, or no
    locks on this filesystem)."""

    fd: int | None = None
    held: bool = False  # another process holds it
    unsupported: str | None = None  # the filesystem refuses locks: why


def claim(path: Path, job: str | None = None) -> Claim:
    """Take the exclusive lock on `path` without waiting; with a `job`, write who holds it (host, pid, job) into it
    (`prune`, which only looks, writes nothing)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return Claim(unsupported="no fcntl here")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:  # a read-only or missing folder: nothing to wait for, and the write says what is wrong
        return Claim(unsupported=f"cannot open {path.name}: {e.strerror or e}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return Claim(held=True)
        with contextlib.suppress(OSError):  # a lock file that cannot lock holds nothing
            path.unlink()
        return Claim(unsupported=e.strerror or str(e))  # ENOLCK (NFS without lockd), EOPNOTSUPP/EINVAL (FUSE)
    try:
        replaced = os.fstat(fd).st_ino != os.stat(path).st_ino  # its last holder removed it while we opened it
        if not replaced and job is not None:
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": job}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError:
        replaced = True
    if replaced:
        os.close(fd)
        return Claim(held=True)
    return Claim(fd)


def lock_held(path: Path) -> bool | None:
    """Whether a live process holds the lock `path` (tried and let go at once); None where the folder takes no
    locks, so nobody can tell."""
    if not path.exists():  # a holder keeps its lock file until it lets go
        return False
    taken = claim(path)
    if taken.fd is None:
        return None if taken.unsupported else True
    os.close(taken.fd)
    return False


def holder(path: Path) -> dict:
    """Who holds the lock `path` ({} while its holder is still writing its name, or if it is gone)."""
    for _ in range(20):  # a holder writes its name just after taking the lock
        found = read_json_or_empty(path)
        if found or not path.exists():
            return found
        time.sleep(0.05)
    return {}


class CacheWriter:
    """Streams gathered vectors into a staging folder's `embeddings.npy` (a memory map), then puts it in place.

    The writer takes the key's lock and writes `.<key>.partial/`, which outlives a killed run: `mark(n)` records
    (after flushing the vectors) that the first n texts of the encoding order are in it, and `resume()` in the
    next run, on any machine that sees the folder, returns that n. Where the lock is held:
    - by a machine of this job that shares the folder (`sibling`): this one writes nothing and reads the entry
      that machine puts in place;
    - by another run (`waiting`): the caller waits (`claim_again`), then reads what that run wrote.
    Where the filesystem has no locks (`unlocked`), it stages under a name of its own, which no run resumes.
    The file is allocated in full before the first write, so a full disk is an error here, not a SIGBUS later.
    Write errors are remembered, not raised, so the writer keeps taking part in the gathers; `commit` returns
    the error message, or None once the entry is in place.
    """

    def __init__(
        self,
        entry: Path,
        key: str,
        count: int,
        role: Role,
        spec: TeacherDescription,
        index: np.ndarray | None = None,
        model: str | None = None,
        job: str | None = None,
    ):
        self.entry, self.key, self.count, self.role, self.spec = entry, key, count, role, spec
        self.index, self.model, self.job = index, model, job  # each row's text digest; the key of all but the texts
        self.lock_path = lock_file(entry.parent, entry.name)
        self.vectors: np.ndarray | None = None
        self.problem: str | None = None
        self.lock: int | None = None
        self.sibling = self.waiting = False
        self.holder: dict = {}
        self.unlocked: str | None = None  # why the filesystem takes no locks
        self.claim_again()

    def claim_again(self) -> None:
        """Try the lock (again): it decides where this writer stages, or whether it waits or writes nothing."""
        taken = claim(self.lock_path, self.job)
        self.lock, self.unlocked = taken.fd, taken.unsupported
        self.holder = holder(self.lock_path) if taken.held else {}
        self.sibling = taken.held and bool(self.job) and self.holder.get("job") == self.job
        self.waiting = taken.held and not self.sibling
        locked = self.lock is not None
        self.staging = (
            partial_folder(self.entry.parent, self.entry.name)
            if locked
            else (self.entry.parent / f".{self.entry.name}.tmp-{unique_suffix()}")
        )

    def unlocked_news(self) -> str | None:
        """The line that says the folder takes no locks, the first time this process asks for it; else None."""
        folder = self.entry.parent
        if not self.unlocked or folder in UNLOCKED_SAID:
            return None
        UNLOCKED_SAID.add(folder)
        return (
            f"teacher cache: {folder} takes no file locks ({self.unlocked}); an interrupted encoding there starts "
            "over, and two runs on it encode the same texts each"
        )

    def waiting_line(self) -> str:
        who = self.holder
        return (
            f"teacher cache: another run (host {who.get('host', '?')}, pid {who.get('pid', '?')}) is encoding these "
            f"{self.count:,} {self.role} texts into {self.entry}; waiting for it to finish (its lock: {self.lock_path})"
        )

    @property
    def writes(self) -> bool:
        return not (self.sibling or self.waiting)

    def resume(self) -> int:
        """Texts an interrupted run left done in the staging folder; 0 (and it cleared) if none. A sibling
        reports every text done: the holder's count decides."""
        if not self.writes:
            return self.count
        # no lock, or a missing or unreadable progress file: start over
        progress = read_json_or_empty(self.staging / PROGRESS) if self.lock is not None else {}
        if progress.get("key") == self.key and progress.get("count") == self.count:
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                path = self.staging / "embeddings.npy"
                reserve(path, path.stat().st_size)  # a folder from a run that did not allocate ahead
                vectors = np.load(path, mmap_mode="r+")
                done = int(progress["rows_done"])
                if vectors.shape[0] == self.count and vectors.dtype == CACHE_DTYPE and 0 <= done <= self.count:
                    self.vectors = vectors
                    return done
        shutil.rmtree(self.staging, ignore_errors=True)
        return 0

    def write(self, indices: np.ndarray, vectors: np.ndarray) -> None:
        if self.problem or not self.writes:
            return
        try:
            if self.vectors is None:
                self.entry.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging.mkdir()
                path = self.staging / "embeddings.npy"
                shape = (self.count, vectors.shape[1])
                self.vectors = np.lib.format.open_memmap(path, mode="w+", dtype=CACHE_DTYPE, shape=shape)
                reserve(path, path.stat().st_size)
            self.vectors[indices] = vectors.astype(CACHE_DTYPE)
        except OSError as e:
            self._fail(e)

    def mark(self, rows_done: int) -> None:
        """The first `rows_done` texts of the encoding order are written: flush them, then say so."""
        if self.problem or self.vectors is None or self.lock is None:
            return
        try:
            self.vectors.flush()
            drop_pages(self.vectors)  # written back: the entry's pages need not stay in this process
            progress = self.staging / PROGRESS
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps({**self._identity(), "rows_done": rows_done}))
            sync(tmp)
            os.replace(tmp, progress)
        except OSError as e:
            self._fail(e)

    def commit(self) -> str | None:
        """Seal the staging folder and put it in place (a whole entry already there stays); the error, if any."""
        if self.problem is None and self.vectors is not None:
            try:
                self.vectors.flush()
                dim = int(self.vectors.shape[1])
                self.vectors = None  # close the memory map before the rename
                (self.staging / "manifest.json").write_text(json.dumps(self._manifest(dim), indent=2))
                if self.index is not None:
                    np.save(self.staging / TEXT_INDEX, self.index.view(np.uint8).reshape(-1, DIGEST_BYTES))
                # progress.json stays until the entry is in place: a run killed before then finds every row done
                seal(self.staging, exclude=(PROGRESS,))
                put_in_place(self.staging, self.entry, unsealed_ok=True)
                (self.entry / PROGRESS).unlink(missing_ok=True)
            except OSError as e:
                if read_entry(self.entry, self.key, self.count) is None:
                    self._fail(e)
                # else: another machine sharing this folder wrote the same entry first
        if self.problem is None or self.lock is None:  # a failed write keeps what a rerun can continue from
            shutil.rmtree(self.staging, ignore_errors=True)
        self.close()
        return self.problem

    def close(self) -> None:
        """Let go of the staging folder (kept as it is) and its lock."""
        self.vectors = None
        if self.lock is not None:
            with contextlib.suppress(OSError):
                self.lock_path.unlink()  # while still held: a process that opened it before sees another inode
            os.close(self.lock)
            self.lock = None

    def _manifest(self, dim: int) -> dict:
        return {
            "format": CACHE_FORMAT,  # `prune` leaves another version's entries alone (but for age)
            "key": self.key,
            "count": self.count,
            "dim": dim,
            "dtype": np.dtype(CACHE_DTYPE).name,
            "bytes": (self.staging / "embeddings.npy").stat().st_size,
            "role": self.role,
            "teacher": self.spec.path,
            "revision": self.spec.revision,
            "prompt": self.spec.prompt(self.role),
            "max_seq_length": self.spec.max_seq_length,
            "model": self.model,  # entries of one model and role share it: their rows are found per text
        }

    def _identity(self) -> dict:
        return {"key": self.key, "count": self.count, "role": self.role, "teacher": self.spec.path}

    def _fail(self, error: OSError) -> None:
        self.vectors = None
        self.problem = (
            f"cannot write the teacher cache under {self.entry.parent} ({error.strerror or error}); make it "
            f"writable, free space (python -m distill.cache prune --teacher_cache_dir {self.entry.parent} "
            "--unused_days 30 --dry_run lists what can go), or pass --teacher_cache_dir elsewhere"
        )


def wait_while_held(writer: CacheWriter | None, anyone: Callable[[bool], bool], say: Callable[[str], None]) -> bool:
    """While another run holds the lock of `writer` (None on the processes that do not write) on any process
    (`anyone`, a collective every process calls), wait: every WAIT_SECONDS the writer tries again, and says once
    what it waits for. Every process waits alike, outside any collective's timeout. Whether any process waited
    (the same answer on every process)."""
    said = waited = False
    while anyone(writer is not None and writer.waiting):
        waited = True
        if writer is not None and writer.waiting and not said:
            say(writer.waiting_line())
            said = True
        time.sleep(WAIT_SECONDS)
        if writer is not None and writer.waiting:
            writer.claim_again()
    return waited


def read_index(entry: Path, count: int) -> np.ndarray | None:
    """An entry's text digests, one per row (numpy void of DIGEST_BYTES), or None where it keeps none."""
    try:
        index = np.load(entry / TEXT_INDEX, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if index.shape != (count, DIGEST_BYTES) or index.dtype != np.uint8:
        return None
    return np.ascontiguousarray(index).view(f"V{DIGEST_BYTES}").reshape(-1)
