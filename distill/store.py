"""The teacher cache on disk: its entries and the staging folders they are written through.

Layout of `<teacher_cache_dir>/`:

    <key>/{embeddings.npy, manifest.json,     an entry: float16 vectors and what they are, and each row's text's
           texts.npy}                         digest (so a run with other texts reuses the rows it shares)
    .<key>.partial-<host>/                     an encoding in progress or interrupted on <host>; its
                                               progress.json says how far it got, and a run with the same
                                               key on that host continues it
    .<key>.lock-<host>                         held (flock) by the run writing that partial folder
    .<key>.tmp-<host>-<pid>/                   staging of a run that could not take the lock; never resumed
    .<key>.stale-<pid>/                        a corrupt entry moved aside while its replacement goes in

Entries appear by a rename, whole or not at all. A run that reads an entry refreshes its manifest's
modification time, which is what `prune --unused_days` goes by. How the key is made and the vectors
computed is the teacher stage's business (distill/stages/targets.py); their upkeep is distill/cache.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from distill.files import drop_pages, read_json

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
DIGEST_BYTES = 16


CACHE_DTYPE = np.float16


def text_digests(texts: Sequence[str]) -> np.ndarray:
    """Each text's 16-byte BLAKE2b digest, as numpy void: what an entry's per-text index holds (a column of
    distill/prepared.py brings them computed)."""
    digests = getattr(texts, "digests", None)
    if digests is not None:
        return digests
    raw = b"".join(hashlib.blake2b(text.encode("utf8"), digest_size=DIGEST_BYTES).digest() for text in texts)
    return np.frombuffer(raw, dtype=f"V{DIGEST_BYTES}")


KEY = re.compile(r"[0-9a-f]{32}")


STAGED = re.compile(r"\.(?P<key>[0-9a-f]{32})\.(?P<kind>partial|lock|tmp|stale)-(?P<rest>.+)")


def lock_file(folder: Path, key: str, host: str) -> Path:
    """The lock a run on `host` holds while it writes `.<key>.partial-<host>/`."""
    return folder / f".{key}.lock-{host}"


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
    if data.stat().st_size != manifest.get("bytes"):
        return None
    try:
        vectors = np.load(data, mmap_mode="r")
    except (ValueError, OSError):
        return None
    if vectors.shape != (count, manifest.get("dim")) or vectors.dtype != CACHE_DTYPE:
        return None
    return vectors


def claim(path: Path) -> int | None:
    """A file descriptor holding an exclusive lock on `path`, or None: another process holds it, or no locks here."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its last holder removed it while we opened it
            raise OSError("lock file replaced")
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


class CacheWriter:
    """Streams gathered vectors into a staging folder's `embeddings.npy` (a memory map), then renames it into place.

    The staging folder `.<key>.partial-<host>` outlives a killed run: `mark(n)` records (after flushing the
    vectors) that the first n texts of the encoding order are in it, and `resume()` in the next run on this
    machine returns that n. A lock file keeps two runs on one machine from sharing it; a run that cannot
    take the lock (another run is encoding the same texts, or the filesystem has no locks) stages under its
    process id and cannot be resumed. Write errors (a full disk) are remembered, not raised, so the writer
    keeps taking part in the gathers; `commit` returns the error message, or None once the entry is in place.
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
    ):
        self.entry, self.key, self.count, self.role, self.spec = entry, key, count, role, spec
        self.index, self.model = index, model  # each row's text digest, and the key of everything but the texts
        host = socket.gethostname()
        self.lock_path = lock_file(entry.parent, entry.name, host)
        self.lock = claim(self.lock_path)
        suffix = f"partial-{host}" if self.lock is not None else f"tmp-{host}-{os.getpid()}"
        self.staging = entry.parent / f".{entry.name}.{suffix}"
        self.vectors: np.ndarray | None = None
        self.problem: str | None = None

    def resume(self) -> int:
        """Texts an interrupted run on this machine left done in the staging folder; 0 (and it cleared) if none."""
        # no lock, or a missing or unreadable progress file: start over
        progress = read_json_or_empty(self.staging / "progress.json") if self.lock is not None else {}
        if progress.get("key") == self.key and progress.get("count") == self.count:
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                vectors = np.load(self.staging / "embeddings.npy", mmap_mode="r+")
                done = int(progress["rows_done"])
                if vectors.shape[0] == self.count and vectors.dtype == CACHE_DTYPE and 0 <= done <= self.count:
                    self.vectors = vectors
                    return done
        shutil.rmtree(self.staging, ignore_errors=True)
        return 0

    def write(self, indices: np.ndarray, vectors: np.ndarray) -> None:
        if self.problem:
            return
        try:
            if self.vectors is None:
                self.entry.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging.mkdir()
                self.vectors = np.lib.format.open_memmap(
                    self.staging / "embeddings.npy", mode="w+", dtype=CACHE_DTYPE, shape=(self.count, vectors.shape[1])
                )
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
            progress = self.staging / "progress.json"
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps({**self._identity(), "rows_done": rows_done}))
            os.replace(tmp, progress)
        except OSError as e:
            self._fail(e)

    def commit(self) -> str | None:
        if self.problem is None and self.vectors is not None:
            try:
                dim = int(self.vectors.shape[1])
                self.vectors.flush()
                self.vectors = None  # close the memory map before the rename
                manifest = {
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
                if self.index is not None:
                    np.save(self.staging / TEXT_INDEX, self.index.view(np.uint8).reshape(-1, DIGEST_BYTES))
                (self.staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
                (self.staging / "progress.json").unlink(missing_ok=True)
                if self.entry.exists():  # a corrupt entry: move it aside, then swap in the good one
                    stale = self.entry.parent / f".{self.entry.name}.stale-{os.getpid()}"
                    os.replace(self.entry, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                os.replace(self.staging, self.entry)
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

    def _identity(self) -> dict:
        return {"key": self.key, "count": self.count, "role": self.role, "teacher": self.spec.path}

    def _fail(self, error: OSError) -> None:
        self.vectors = None
        self.problem = (
            f"cannot write the teacher cache under {self.entry.parent} ({error.strerror or error}); make it "
            f"writable, free space (python -m distill.cache prune --teacher_cache_dir {self.entry.parent} "
            "--unused_days 30 --dry_run lists what can go), or pass --teacher_cache_dir elsewhere"
        )


def read_index(entry: Path, count: int) -> np.ndarray | None:
    """An entry's text digests, one per row (numpy void of DIGEST_BYTES), or None where it keeps none."""
    try:
        index = np.load(entry / TEXT_INDEX, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if index.shape != (count, DIGEST_BYTES) or index.dtype != np.uint8:
        return None
    return np.ascontiguousarray(index).view(f"V{DIGEST_BYTES}").reshape(-1)
