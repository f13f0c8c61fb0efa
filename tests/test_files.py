"""How entries are kept: made once through a staging folder, sealed with each file's size and checksum, checked
on read, and put in place without ever removing a whole copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.files import CONTENTS, SAMPLE_BYTES, WHOLE_READ, check, put_in_place, seal, staged_folder


def test_a_staged_folder_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError), staged_folder(entry) as staging:
        (staging / "half.npy").write_bytes(b"\0")
        raise RuntimeError("stopped while writing")
    assert not entry.exists() and list(entry.parent.iterdir()) == []  # the staging folder went too

    with staged_folder(entry) as staging:
        assert staging.parent == entry.parent and staging.name.startswith(".entry.tmp-")
        (staging / "fields.json").write_text("{}")
    assert [p.name for p in entry.parent.iterdir()] == ["entry"] and (entry / "fields.json").read_text() == "{}"
    assert sorted(p.name for p in entry.iterdir()) == [CONTENTS, "fields.json"] and check(entry) is None


def test_the_first_process_to_finish_keeps_its_folder(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    with staged_folder(entry) as staging:
        (staging / "fields.json").write_text("mine")
        entry.mkdir()  # another process renamed its whole copy into place meanwhile
        (entry / "fields.json").write_text("theirs")
        seal(entry)
    assert (entry / "fields.json").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_a_torn_copy_in_place_is_replaced_and_a_whole_one_never_removed(tmp_path: Path) -> None:
    """The copy in place fails its check (a crash tore it): it is moved aside, the new one renamed in, then the old
    one removed; with `replace_whole` (a checkpoint saved again) a whole one is replaced the same way."""
    entry = tmp_path / "entry"
    with staged_folder(entry) as staging:
        (staging / "data.npy").write_bytes(b"\1" * 100)
    (entry / "data.npy").write_bytes(b"\1" * 40)  # torn
    assert check(entry) == "torn (data.npy: 40 bytes, 100 written)"
    with staged_folder(entry) as staging:
        (staging / "data.npy").write_bytes(b"\2" * 100)
    assert (entry / "data.npy").read_bytes() == b"\2" * 100 and check(entry) is None
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # the torn copy went, after the rename

    staging = tmp_path / "again"
    staging.mkdir()
    (staging / "data.npy").write_bytes(b"\3")
    seal(staging)
    put_in_place(staging, entry)  # whole already: kept
    assert (entry / "data.npy").read_bytes() == b"\2" * 100 and not staging.exists()
    staging.mkdir()
    (staging / "data.npy").write_bytes(b"\3")
    seal(staging)
    put_in_place(staging, entry, replace_whole=True)
    assert (entry / "data.npy").read_bytes() == b"\3" and [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_check_finds_a_missing_file_a_changed_byte_and_an_unsealed_folder(tmp_path: Path) -> None:
    """A large file is checked by its size and sampled blocks: a byte changed inside one (here the last) is found."""
    entry = tmp_path / "entry"
    with staged_folder(entry) as staging:
        (staging / "big.npy").write_bytes(bytes(WHOLE_READ + 3 * SAMPLE_BYTES))
        (staging / "fields.json").write_text("{}")
    with (entry / "big.npy").open("r+b") as f:
        f.seek(WHOLE_READ + 3 * SAMPLE_BYTES - 1)
        f.write(b"\1")
    assert check(entry) == "corrupt (big.npy: its checksum differs)"
    (entry / "big.npy").unlink()
    assert check(entry) == "incomplete (big.npy is missing)"
    (entry / CONTENTS).unlink()
    assert check(entry).startswith("unsealed") and check(entry, unsealed_ok=True) is None
    assert check(tmp_path / "absent") == "missing"


def test_a_refused_write_is_raised(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError), staged_folder(tmp_path / "file" / "entry"):
        pass
