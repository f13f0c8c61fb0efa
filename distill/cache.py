"""The teacher cache's upkeep: what is in it, and what no run can use again removed (distill/store.py writes it).

It reads the layout distill/store.py writes (entries, staging folders, locks), and what other stages keep beside
it, each made again by the next run that needs it: the entries under `data/` and `tokens/` (distill/data/kept.py,
distill/tokens.py: a corpus's cleaned texts and its token ids), a static student's tables and token vectors
(`static-*`, distill/students/static.py), and the streamed copies of vectors files under `files/`
(distill/teachers/vectors.py). A run that reads an entry refreshes the modification time of one of its files,
which is what `prune --unused_days` goes by. How the key is made and the vectors computed is the teacher stage's
business (distill/stages/targets.py).

    python -m distill.cache list  [--teacher_cache_dir DIR | --config FILE]
    python -m distill.cache prune [--teacher_cache_dir DIR | --config FILE] [--unused_days N] [--dry_run]

`prune` removes what no run can use again: staging folders of processes that are gone, moved-aside
entries, unheld lock files, corrupt entries (each file is checked against the entry's contents.json, as a run
checks it). With `--unused_days N` it also removes entries, and interrupted encodings, untouched for N days.
Anything a live run holds (its lock, or its process on this machine) is left alone; another machine's staging
folder is removed only by age, since its process cannot be seen from here. An entry is moved aside before it is
deleted, and kept if a run read or rebuilt it since `prune` looked. `prune` exits with 1 if something could not
be removed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distill.files import check, human_bytes, process_alive, unique_suffix
from distill.store import CACHE_FORMAT, KEY, STAGED, claim, lock_file, lock_held, read_entry, read_json_or_empty

STAGING_TAIL = re.compile(r"(?P<host>.+)-(?P<pid>\d+)(?:-[0-9a-f]{8})?")  # <host>-<pid>[-<random>]


def staging_owner(rest: str) -> tuple[str, int | None]:
    """The host and pid a staging folder's name ends with (`<host>-<pid>[-<random>]`); ("", None) if it names none."""
    tail = STAGING_TAIL.fullmatch(rest)
    return (tail["host"], int(tail["pid"])) if tail else ("", None)


@dataclass
class CacheItem:
    """One thing in a cache folder: an entry, a staging folder, or a lock file."""

    path: Path
    key: str
    kind: str  # "entry", "corrupt", "other format", "partial", "tmp", "stale", "lock"
    host: str = ""
    pid: int | None = None
    bytes: int = 0  # on disk: a partial's embeddings.npy is full-size but sparse, holding only the rows done
    used: float = 0.0  # modification time: an entry's last use, a staging folder's last progress
    info: dict = field(default_factory=dict)  # manifest.json or progress.json

    @property
    def this_host(self) -> bool:
        """Whether this machine can tell if the item is in use ("": a lock any machine sharing the folder sees)."""
        return self.host in ("", socket.gethostname())

    @property
    def lock_path(self) -> Path:
        return lock_file(self.path.parent, self.key)


AREAS = ("data", "tokens")  # sub-folders of kept data (distill/data/kept.py) and token ids (distill/tokens.py)
# Sealed folders named by what they hold, not by a key of 32 hex digits, each beside the staging (`.tmp-`) and
# moved-aside (`.stale-`) folders distill/files.py names after them: a vectors file's streamed copy under files/
# (distill/teachers/vectors.py), and a static student's tables and its blocks of token vectors, which sit in the
# cache folder itself (distill/students/static.py).
FILES = "files"
STATIC = "static"
STATIC_TABLE = re.compile(r"static-[0-9a-f]{16}-\d+")
STATIC_TOKENS = "static-*-tokens"
ASIDE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|stale)-(?P<rest>.+)")


def scan(cache_dir: Path) -> list[CacheItem]:
    """Every entry, staging folder and lock file directly under `cache_dir` and its data and token folders, and
    the sealed folders of the static student and the vectors files; other files are not ours."""
    items = scan_folder(cache_dir)
    for area in AREAS:
        if (cache_dir / area).is_dir():
            items += scan_folder(cache_dir / area, area)
    items += scan_sealed(cache_dir, STATIC, STATIC_TABLE)
    for tokens in sorted(p for p in cache_dir.glob(STATIC_TOKENS) if p.is_dir()):
        items += scan_sealed(tokens, STATIC)
    if (cache_dir / FILES).is_dir():
        items += scan_sealed(cache_dir / FILES, FILES)
    return items


def scan_sealed(folder: Path, role: str, names: re.Pattern | None = None) -> list[CacheItem]:
    """The sealed folders in `folder` (whole or corrupt, by distill/files.py `check`) and the staging and
    moved-aside folders named after them; with `names`, only those whose name it matches."""
    items = []
    for path in sorted(folder.iterdir()):
        aside = ASIDE.fullmatch(path.name)
        if aside is not None and (names is None or names.fullmatch(aside["name"])):
            host, pid = staging_owner(aside["rest"])
            info = {"role": role}
            items.append(CacheItem(path, aside["name"], aside["kind"], host, pid, info=info, **_size_and_time(path)))
        elif not path.name.startswith(".") and path.is_dir() and (names is None or names.fullmatch(path.name)):
            kind = "entry" if check(path) is None else "corrupt"
            items.append(CacheItem(path, path.name, kind, info={"role": role}, **_size_and_time(path)))
    return items


def scan_folder(folder: Path, area: str = "") -> list[CacheItem]:
    """The items of one folder: teacher entries (no `area`), or the entries of a data or tokens folder, each
    whole when every file matches its contents.json (distill/files.py `check`)."""
    items = []
    for path in sorted(folder.iterdir()):
        staged = STAGED.fullmatch(path.name)
        if KEY.fullmatch(path.name) and path.is_dir():
            manifest: dict[str, Any]
            if area:
                manifest = {"role": area}
                valid = check(path) is None
            else:
                manifest = read_json_or_empty(path / "manifest.json")
                valid = read_entry(path, path.name, manifest.get("count", -1)) is not None
            kind = "entry" if valid else "corrupt"
            if manifest.get("format", CACHE_FORMAT) != CACHE_FORMAT:  # written by another distill version
                kind = "other format"
            items.append(CacheItem(path, path.name, kind, info=manifest, **_size_and_time(path)))
        elif staged:
            kind, rest = staged["kind"], staged["rest"] or ""
            host, pid = "", None  # a partial or lock: its lock is taken through the folder, from any host
            if kind in ("tmp", "stale"):
                host, pid = staging_owner(rest)
            elif rest:  # `.partial-<host>`, `.lock-<host>`: an earlier distill's, never resumed now
                host = rest
            progress = read_json_or_empty(path / "progress.json") if kind == "partial" else {}
            items.append(CacheItem(path, staged["key"], kind, host, pid, info=progress, **_size_and_time(path)))
    return items


def _size_and_time(path: Path) -> dict:
    """Disk usage under `path` and the newest modification time among it and its files."""
    files = [path] if path.is_file() else [path, *(p for p in path.rglob("*") if p.is_file())]
    size, used = 0, 0.0
    for file in files:
        with contextlib.suppress(OSError):  # removed while we looked
            stat = file.stat()
            size += disk_usage(stat) if file.is_file() else 0
            used = max(used, stat.st_mtime)
    return {"bytes": size, "used": used}


def disk_usage(stat: os.stat_result) -> int:
    """Bytes a file takes on disk, as `du` counts them: a partial's memory map is created full-size but sparse."""
    blocks = getattr(stat, "st_blocks", None)  # POSIX; 512-byte units whatever the block size
    return stat.st_size if blocks is None else blocks * 512


def verdict(item: CacheItem, items: list[CacheItem], unused_days: float | None, now: float) -> str | None:
    """Why `prune` removes `item`, or None to keep it. Looks at locks and processes on this machine only."""
    old = unused_days is not None and now - item.used >= unused_days * 86400
    age = f"unused for {(now - item.used) / 86400:.1f} days"
    if item.kind in ("entry", "other format"):  # this version cannot read the latter, but the one that wrote it can
        return age if old else None
    if item.kind == "corrupt":
        return "incomplete or corrupt (a run would rebuild it)"
    if item.kind == "stale":
        if item.this_host and item.pid is not None and process_alive(item.pid):
            return None
        return "a corrupt entry moved aside" if item.this_host or old else None
    if item.kind == "tmp":
        if item.this_host and item.pid is not None:
            return None if process_alive(item.pid) else "its process is gone and it cannot be resumed"
        return age if old else None
    if item.kind == "partial":
        if item.this_host and in_use(item):
            return None
        return f"an interrupted encoding, {age}" if old else None
    # a lock file: not needed once nobody holds it and its partial folder is gone
    partial_left = any(i.kind == "partial" and i.key == item.key and i.host == item.host for i in items)
    if partial_left:
        return None
    if item.this_host:
        return None if in_use(item) else "a lock nobody holds"
    return age if old else None


def in_use(item: CacheItem) -> bool:
    """Whether a live process holds the lock of `item`'s key (a partial folder or a lock file); where the folder
    takes no locks, whether one might (so nothing is removed)."""
    return lock_held(item.lock_path) is not False


def remove(item: CacheItem) -> bool:
    """Remove `item`; False if a run took its lock or used it meanwhile. Under the lock, so none starts."""
    if item.kind in ("entry", "corrupt", "other format"):
        return remove_entry(item)
    lock = None
    if item.kind in ("partial", "lock") and item.this_host:
        lock = claim(item.lock_path).fd
        if lock is None:
            if item.lock_path.exists():
                return False  # a run on this machine holds it
            os.close(os.open(item.lock_path, os.O_CREAT | os.O_RDWR, 0o644))  # raises why it cannot be made
            return False
    try:
        if item.path.is_dir():
            shutil.rmtree(item.path)
        else:
            item.path.unlink(missing_ok=True)
        if lock is not None:  # while still held, as CacheWriter.close does
            item.lock_path.unlink(missing_ok=True)
    finally:
        if lock is not None:
            os.close(lock)
    return True


def remove_entry(item: CacheItem) -> bool:
    """Remove an entry, unless a run read or rebuilt it since `scan`; moved aside first, so no run sees it half gone."""
    aside = item.path.parent / f".{item.key}.stale-{unique_suffix()}"
    os.replace(item.path, aside)  # in a read-only folder this fails, and the entry stays whole
    if max((f.stat().st_mtime for f in aside.iterdir() if f.is_file()), default=0.0) > item.used:
        with contextlib.suppress(OSError):  # if a run has written the entry again meanwhile, this copy can go
            os.rename(aside, item.path)
            return False
    shutil.rmtree(aside)
    return True


def describe(item: CacheItem, now: float) -> list[str]:
    """One `list` row: key, state, teacher, role, texts, dim, size, last used."""
    info = item.info
    state = item.kind
    if item.kind == "partial":
        done, count = info.get("rows_done"), info.get("count")
        progress = f" {done}/{count}" if done is not None and count else ""
        where = f" on {item.host}" if item.host else ""
        state = f"partial{progress}{where}" + (" (encoding now)" if item.this_host and in_use(item) else "")
    elif item.kind == "other format":
        state = f"format {info.get('format')} (another distill version)"
    elif item.kind in ("tmp", "lock"):
        state = f"{item.kind} on {item.host}" + (f" pid {item.pid}" if item.pid is not None else "")
    days = (now - item.used) / 86400
    return [
        item.key,
        state,
        str(info.get("teacher", "")),
        str(info.get("role", "")),
        str(info.get("count", "")),
        str(info.get("dim", "")),
        human_bytes(item.bytes),
        "today" if days < 1 else f"{days:.0f} days ago",
    ]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    )


def list_cache(cache_dir: Path, now: float | None = None) -> str:
    """The `list` report: one row per item, then the totals."""
    now = time.time() if now is None else now
    items = sorted(scan(cache_dir), key=lambda i: (i.kind != "entry", i.key, i.path.name))  # entries first
    header = ["KEY", "STATE", "TEACHER", "ROLE", "TEXTS", "DIM", "SIZE", "LAST USED"]
    rows = [describe(item, now) for item in items]
    entries = [i for i in items if i.kind == "entry"]
    sizes = dict.fromkeys(("teacher", *AREAS, STATIC, FILES), 0)
    for entry in entries:
        sizes[entry.info["role"] if entry.info.get("role") in sizes else "teacher"] += entry.bytes
    parts = ", ".join(f"{human_bytes(size)} {name}" for name, size in sizes.items() if size)
    summary = (
        f"{cache_dir}: {len(entries)} entries ({parts or '0 B'}), "
        f"{len(items) - len(entries)} other items ({human_bytes(sum(i.bytes for i in items if i.kind != 'entry'))})"
    )
    return (table(rows, header) + "\n" if rows else "") + summary


def prune(
    cache_dir: Path, unused_days: float | None = None, dry_run: bool = False, now: float | None = None
) -> list[str]:
    """Remove (or with `dry_run` only name) what `verdict` says may go; one line per item, then the total."""
    now = time.time() if now is None else now
    items = scan(cache_dir)
    lines, freed = [], 0
    for item in items:
        reason = verdict(item, items, unused_days, now)
        if reason is None:
            continue
        if not dry_run:
            try:
                if not remove(item):
                    continue  # a run started on it since we looked
            except OSError as e:
                lines.append(f"could not remove {item.path}: {e.strerror or e}")
                continue
        freed += item.bytes
        lines.append(f"{'would remove' if dry_run else 'removed'} {item.path} ({human_bytes(item.bytes)}): {reason}")
    if not dry_run:  # a static student's token folder left empty; a run that stages a block in it makes it again
        for tokens in cache_dir.glob(STATIC_TOKENS):
            with contextlib.suppress(OSError):  # not empty (a run is writing into it), or not ours to remove
                tokens.rmdir()
    lines.append(f"{'would free' if dry_run else 'freed'} {human_bytes(freed)} in {cache_dir}")
    return lines


def default_cache_dir(config: str | None) -> str:
    """--teacher_cache_dir's value in a config file, else the training default."""
    from distill.config import OutputConfig  # only for the default: the cache command stays light to import

    if config:
        try:
            values = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read config {config}: {e}; pass --teacher_cache_dir instead") from e
        if isinstance(values, dict) and values.get("teacher_cache_dir"):
            return str(values["teacher_cache_dir"])
    return OutputConfig().teacher_cache_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distill.cache", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("list", "show entries and staging folders"), ("prune", "remove what is not needed")):
        command = commands.add_parser(name, help=help_text)
        where = command.add_mutually_exclusive_group()
        where.add_argument("--teacher_cache_dir", help="the cache folder (default: the training default)")
        where.add_argument("--config", help="take the cache folder from this config file's teacher_cache_dir")
        if name == "prune":
            command.add_argument(
                "--unused_days", type=float, help="also remove entries and interrupted encodings unused this long"
            )
            command.add_argument("--dry_run", action="store_true", help="say what would be removed, remove nothing")
    args = parser.parse_args(argv)
    try:
        cache_dir = Path(args.teacher_cache_dir or default_cache_dir(args.config)).expanduser()
        if not cache_dir.is_dir():
            raise ValueError(
                f"no teacher cache at {cache_dir}; pass the folder your runs use (--teacher_cache_dir DIR or "
                "--config FILE)"
            )
        if args.command == "prune" and args.unused_days is not None and args.unused_days < 0:
            raise ValueError(f"--unused_days must be 0 or more, got {args.unused_days:g}")
        lines = [list_cache(cache_dir)] if args.command == "list" else prune(cache_dir, args.unused_days, args.dry_run)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unreadable folder
        unreadable = e.filename or cache_dir
        print(
            f"error: cannot read {unreadable} ({e.strerror or e}); run as a user who can read the cache",
            file=sys.stderr,
        )
        return 2
    print("\n".join(lines))
    return 1 if any(line.startswith("could not remove") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
