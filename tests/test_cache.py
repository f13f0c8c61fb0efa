"""The teacher cache's upkeep (`python -m distill.cache list|prune`) on folders laid out by hand."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from distill import cache, tokens
from distill.cache import human_bytes, list_cache, main, prune
from distill.config import DataConfig
from distill.data import prepared_data
from distill.files import seal
from distill.store import claim, read_entry

HOST = socket.gethostname()
DAY = 86400.0


def make_entry(cache_dir: Path, key: str, count: int = 4, dim: int = 3, age_days: float = 0.0) -> Path:
    """A valid entry, as CacheWriter.commit leaves it, last used `age_days` ago."""
    entry = cache_dir / key
    entry.mkdir(parents=True)
    np.save(entry / "embeddings.npy", np.ones((count, dim), dtype=np.float16))
    manifest = {
        "key": key,
        "count": count,
        "dim": dim,
        "dtype": "float16",
        "bytes": (entry / "embeddings.npy").stat().st_size,
        "role": "document",
        "teacher": "org/teacher-7b",
    }
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert read_entry(entry, key, count) is not None
    age(entry, age_days)
    return entry


def make_partial(
    cache_dir: Path, key: str, legacy_host: str = "", done: int = 16, count: int = 40, age_days: float = 0.0
) -> Path:
    """An interrupted encoding, as CacheWriter leaves it (`legacy_host`: as an earlier distill named it per host)."""
    staging = cache_dir / (f".{key}.partial-{legacy_host}" if legacy_host else f".{key}.partial")
    staging.mkdir(parents=True)
    np.save(staging / "embeddings.npy", np.zeros((count, 3), dtype=np.float16))
    progress = {"key": key, "count": count, "rows_done": done, "role": "query", "teacher": "org/teacher-7b"}
    (staging / "progress.json").write_text(json.dumps(progress))
    age(staging, age_days)
    return staging


def age(path: Path, days: float) -> None:
    """Set the modification time of `path` and everything in it to `days` ago."""
    when = time.time() - days * DAY
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        os.utime(p, (when, when))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def du(*files: Path) -> int:
    """Bytes the files take on disk."""
    return sum(f.stat().st_blocks * 512 for f in files)


def key(n: int) -> str:
    return f"{n:032x}"


def test_list_shows_entries_and_interrupted_encodings(tmp_path: Path) -> None:
    make_entry(tmp_path, key(1), count=4, dim=3, age_days=3)
    partial = make_partial(tmp_path, key(2), done=16, count=40)
    report = list_cache(tmp_path).splitlines()
    assert report[0].split() == ["KEY", "STATE", "TEACHER", "ROLE", "TEXTS", "DIM", "SIZE", "LAST", "USED"]
    assert report[1].split()[:6] == [key(1), "entry", "org/teacher-7b", "document", "4", "3"]
    assert report[1].endswith("3 days ago")
    assert report[2].split()[:5] == [key(2), "partial", "16/40", "org/teacher-7b", "query"]
    assert report[2].endswith("today")
    assert report[3].startswith(f"{tmp_path}: 1 entries (")
    other = human_bytes(du(partial / "embeddings.npy", partial / "progress.json"))
    assert report[3].endswith(f"1 other items ({other})")


def test_sizes_are_disk_usage_so_a_fresh_partial_is_not_counted_full_size(tmp_path: Path) -> None:
    partial = make_partial(tmp_path, key(1), done=0, count=40)
    rows = np.lib.format.open_memmap(partial / "embeddings.npy", mode="w+", dtype=np.float16, shape=(100_000, 64))
    rows[:16] = 1.0  # as CacheWriter: a full-size memory map, of which the encoding wrote the first rows
    rows.flush()
    del rows
    apparent = (partial / "embeddings.npy").stat().st_size
    if du(partial / "embeddings.npy") >= apparent:
        pytest.skip("this filesystem does not keep files sparse")
    on_disk = human_bytes(du(partial / "embeddings.npy", partial / "progress.json"))
    summary = list_cache(tmp_path).splitlines()[-1]
    assert summary.endswith(f"1 other items ({on_disk})")
    assert human_bytes(apparent) not in summary  # 12.2 MiB apparent, a few KiB on disk
    assert prune(tmp_path, unused_days=0, dry_run=True)[-1] == f"would free {on_disk} in {tmp_path}"


def test_prune_removes_only_what_no_run_can_use(tmp_path: Path) -> None:
    kept = [
        make_entry(tmp_path, key(1), age_days=400),  # old, but no --unused_days
        make_partial(tmp_path, key(2)),  # resumable
        make_partial(tmp_path, key(3), legacy_host="other-node"),  # an earlier distill's, of another machine: by age
        tmp_path / f".{key(4)}.tmp-{HOST}-{os.getpid()}-0123abcd",  # a live process is staging
        tmp_path / f".{key(2)}.lock",  # its partial is still there
        tmp_path / "notes.txt",  # not ours
        tmp_path / f".{key(9)}.tmp-other-node-{dead_pid()}-0123abcd",  # a pid of another machine tells nothing here
        tmp_path / f".{key(10)}.stale-other-node-{dead_pid()}-0123abcd",
    ]
    removed = [
        tmp_path / f".{key(5)}.tmp-{HOST}-{dead_pid()}-0123abcd",
        tmp_path / f".{key(6)}.stale-{HOST}-{dead_pid()}-0123abcd",
        tmp_path / f".{key(7)}.lock",  # nobody holds it, no partial
        make_entry(tmp_path, key(8)),
    ]
    for folder in (kept[3], kept[6], kept[7], removed[0], removed[1]):
        folder.mkdir()
        (folder / "embeddings.npy").write_bytes(b"\0" * 1000)
    for lock in (kept[4], removed[2]):
        lock.touch()
    kept[5].write_text("mine")
    (removed[3] / "embeddings.npy").write_bytes(b"\0")  # corrupt: its size no longer matches the manifest

    freed = human_bytes(du(*(f for p in removed for f in ([p] if p.is_file() else p.iterdir()))))
    dry = prune(tmp_path, dry_run=True)
    assert all(p.exists() for p in kept + removed)
    assert dry[-1] == f"would free {freed} in {tmp_path}"
    lines = prune(tmp_path)
    assert sorted(line.split()[1] for line in lines[:-1]) == sorted(str(p) for p in removed)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in removed)
    assert any(line.endswith("its process is gone and it cannot be resumed") for line in lines)
    assert any(line.endswith("incomplete or corrupt (a run would rebuild it)") for line in lines)
    assert lines[-1] == f"freed {freed} in {tmp_path}"


def test_prune_by_age_keeps_what_was_used_recently(tmp_path: Path) -> None:
    old_entry, new_entry = make_entry(tmp_path, key(1), age_days=40), make_entry(tmp_path, key(2), age_days=5)
    old_partial = make_partial(tmp_path, key(3), age_days=40)
    old_remote = make_partial(tmp_path, key(4), legacy_host="other-node", age_days=40)
    lines = prune(tmp_path, unused_days=30)
    assert not old_entry.exists() and not old_partial.exists() and not old_remote.exists()
    assert new_entry.exists()
    assert any(line.endswith("an interrupted encoding, unused for 40.0 days") for line in lines)
    assert not list((tmp_path).glob(f".{key(3)}.lock*"))  # the lock it was removed under is gone too


def test_a_partial_being_written_is_never_removed(tmp_path: Path) -> None:
    partial = make_partial(tmp_path, key(1), age_days=40)
    lock = claim(tmp_path / f".{key(1)}.lock").fd  # a run is encoding into it
    assert lock is not None
    try:
        assert prune(tmp_path, unused_days=0) == [f"freed 0 B in {tmp_path}"]
        assert partial.exists()
        (row,) = [line for line in list_cache(tmp_path).splitlines() if " partial " in line]
        assert "partial 16/40 (encoding now)" in row
    finally:
        os.close(lock)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_entry(tmp_path / "cache", key(1), age_days=10)
    config = tmp_path / "run.yaml"
    config.write_text(f"teacher_cache_dir: {tmp_path / 'cache'}\nbatch_size: 8\n")
    assert main(["list", "--config", str(config)]) == 0
    assert key(1) in capsys.readouterr().out
    assert main(["prune", "--teacher_cache_dir", str(tmp_path / "cache"), "--unused_days", "7", "--dry_run"]) == 0
    assert capsys.readouterr().out.startswith(f"would remove {tmp_path / 'cache' / key(1)} (")
    assert (tmp_path / "cache" / key(1)).exists()

    assert main(["list", "--teacher_cache_dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: no teacher cache at {tmp_path / 'nowhere'}; pass the folder your runs use "
        "(--teacher_cache_dir DIR or --config FILE)\n"
    )
    assert main(["prune", "--teacher_cache_dir", str(tmp_path / "cache"), "--unused_days", "-1"]) == 2
    assert capsys.readouterr().err == "error: --unused_days must be 0 or more, got -1\n"


def test_an_unreadable_cache_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    make_entry(tmp_path, key(1))

    def denied(self: Path):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)
    assert main(["list", "--teacher_cache_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot read {tmp_path} (Permission denied); run as a user who can read the cache\n"
    )


@pytest.fixture
def read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`tmp_path` as a folder whose listing cannot change (tests run as root, which permissions do not stop)."""

    def guard(real):
        def call(path, *args, **kwargs):
            creates = real is os.open and not Path(path).exists()
            if Path(path).parent == tmp_path and (real is not os.open or creates):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", guard(os.open))
    monkeypatch.setattr(os, "replace", guard(os.replace))
    monkeypatch.setattr(shutil, "rmtree", guard(shutil.rmtree))
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: guard(os.unlink)(self))
    return tmp_path


def test_prune_in_a_read_only_folder_names_each_failure_and_keeps_entries_whole(
    read_only: Path, capsys: pytest.CaptureFixture
) -> None:
    entry = make_entry(read_only, key(1), age_days=40)
    partial = make_partial(read_only, key(2), age_days=40)  # no lock file yet: prune would have to create one
    assert main(["prune", "--teacher_cache_dir", str(read_only), "--unused_days", "30"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"could not remove {partial}: Permission denied",
        f"could not remove {entry}: Permission denied",
        f"freed 0 B in {read_only}",
    ]
    assert read_entry(entry, key(1), 4) is not None and (partial / "progress.json").exists()


def test_prune_keeps_what_a_run_used_or_rebuilt_after_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    used, rebuilt = make_entry(tmp_path, key(1), age_days=40), make_entry(tmp_path, key(2))
    (rebuilt / "embeddings.npy").write_bytes(b"\0")  # corrupt
    age(rebuilt, 1)
    real_scan = cache.scan

    def scan_then_a_run_starts(cache_dir: Path) -> list:
        items = real_scan(cache_dir)
        os.utime(used / "manifest.json")  # a run read it (teacher.py touches it)
        shutil.rmtree(rebuilt)  # a run rebuilt it (CacheWriter.commit)
        make_entry(tmp_path, key(2))
        return items

    monkeypatch.setattr(cache, "scan", scan_then_a_run_starts)
    assert prune(tmp_path, unused_days=30) == [f"freed 0 B in {tmp_path}"]
    assert read_entry(used, key(1), 4) is not None and read_entry(rebuilt, key(2), 4) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [key(1), key(2)]  # nothing left moved aside


def test_entries_of_another_cache_format_go_only_by_age(tmp_path: Path) -> None:
    """A newer distill sharing the folder writes entries this one cannot read; they are not corrupt."""
    entry = make_entry(tmp_path, key(1), age_days=10)
    np.save(entry / "embeddings.npy", np.ones((4, 3), dtype=np.float32))  # say format 2 keeps float32
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest.update(format=2, dtype="float32", bytes=(entry / "embeddings.npy").stat().st_size)
    (entry / "manifest.json").write_text(json.dumps(manifest))
    age(entry, 10)
    assert prune(tmp_path) == [f"freed 0 B in {tmp_path}"]
    assert f"{key(1)}  format 2 (another distill version)  org/teacher-7b" in list_cache(tmp_path)
    assert prune(tmp_path, unused_days=7)[0].endswith("unused for 10.0 days")
    assert not entry.exists()


@pytest.mark.usefixtures("partial_state")
def test_kept_data_and_token_ids_are_listed_and_pruned_by_last_use(tmp_path: Path) -> None:
    """The entries distill/data/kept.py and distill/tokens.py keep under data/ and tokens/, made by their own
    writers: listed with their sizes, and removed by --unused_days unless a run read them since."""
    (tmp_path / "texts.txt").write_text("".join(f"text {i}\n" for i in range(50)))
    config = DataConfig(phase1_data=str(tmp_path / "texts.txt"), phase2_data="none", eval_data="none")
    cache_dir = tmp_path / "cache"
    prepared_data(config, 1, True, False, cache_dir / "data")
    (data_entry,) = (cache_dir / "data").iterdir()
    tokens_entry = cache_dir / "tokens" / key(1)
    tokens.save(SimpleNamespace(ids=np.arange(10), max_length=8), tokens_entry)
    stopped = cache_dir / "tokens" / f".{key(2)}.tmp-{HOST}-{dead_pid()}"  # a tokenizing process that died
    stopped.mkdir()
    (stopped / "ids.npy").write_bytes(b"\0" * 100)

    rows = [row.split() for row in list_cache(cache_dir).splitlines()]
    assert [data_entry.name, "entry", "data"] in [row[:3] for row in rows]
    assert [key(1), "entry", "tokens"] in [row[:3] for row in rows]
    summary = " ".join(rows[-1])
    assert "2 entries (" in summary and " data, " in summary and " tokens), 1 other items" in summary

    age(data_entry, 40)
    age(tokens_entry, 40)
    assert tokens.load(SimpleNamespace, tokens_entry).max_length == 8  # a run reads the token ids: used today
    lines = prune(cache_dir, unused_days=30)
    assert not data_entry.exists() and not stopped.exists() and tokens_entry.exists()
    assert any(line.startswith(f"removed {data_entry} (") and "unused for 40.0 days" in line for line in lines)
    assert prepared_data(config, 1, True, False, cache_dir / "data").phase1_texts[3] == "text 3"  # made again


def sealed(folder: Path, age_days: float = 0.0) -> Path:
    """A sealed folder (distill/files.py), as a static student's table or token block or a vectors file's copy."""
    folder.mkdir(parents=True)
    np.save(folder / "vectors.npy", np.ones((8, 4), dtype=np.float32))
    seal(folder)
    age(folder, age_days)
    return folder


def test_prune_sees_the_static_students_and_the_vectors_files_folders(tmp_path: Path) -> None:
    """A static student's tables and token blocks and a vectors file's streamed copy are sealed folders: a staging
    folder of a process that is gone goes, a torn one goes, a whole one only by age; a live process's stays."""
    tokens = tmp_path / "static-0123456789abcdef-tokens"
    table = sealed(tmp_path / "static-0123456789abcdef-256", age_days=40)
    block = sealed(tokens / "00000-0123456789ab", age_days=40)
    copy = sealed(tmp_path / "files" / "teacher-vectors-0123456789abcdef", age_days=2)
    torn = sealed(tokens / "00001-0123456789ab")
    (torn / "vectors.npy").write_bytes(b"\0" * 16)
    dead, live = dead_pid(), os.getpid()
    staging = {
        "table": tmp_path / f".static-0123456789abcdef-64.tmp-{HOST}-{dead}-0123abcd",
        "block": tokens / f".00002-0123456789ab.tmp-{HOST}-{dead}-0123abcd",
        "copy": tmp_path / "files" / f".teacher-vectors-fedcba9876543210.tmp-{HOST}-{dead}-0123abcd",
        "live": tokens / f".00003-0123456789ab.tmp-{HOST}-{live}-0123abcd",
    }
    for folder in staging.values():
        folder.mkdir()
        (folder / "vectors.npy").write_bytes(b"\0" * 1000)
    rows = {line.split()[0]: line for line in list_cache(tmp_path).splitlines()[1:-1]}
    assert rows[table.name].split()[1:3] == ["entry", "static"] and rows[copy.name].split()[1:3] == ["entry", "files"]
    assert rows[torn.name].split()[1] == "corrupt"
    assert list_cache(tmp_path).splitlines()[-1].startswith(f"{tmp_path}: 3 entries (")

    lines = prune(tmp_path)
    assert sorted(line.split()[1] for line in lines[:-1]) == sorted(
        str(p) for p in (torn, staging["table"], staging["block"], staging["copy"])
    )
    assert all(p.exists() for p in (table, block, copy, staging["live"]))
    prune(tmp_path, unused_days=30)
    assert not table.exists() and not block.exists() and copy.exists()
    assert tokens.is_dir()  # a live process is still staging a block in it
    shutil.rmtree(staging["live"])
    prune(tmp_path)
    assert not tokens.exists()  # left empty: removed with its last block
