"""The shared file helpers: a folder made once through a staging folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.files import staged_folder


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


def test_the_first_process_to_finish_keeps_its_folder(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    with staged_folder(entry) as staging:
        (staging / "fields.json").write_text("mine")
        entry.mkdir()  # another process renamed its copy into place meanwhile
        (entry / "fields.json").write_text("theirs")
    assert (entry / "fields.json").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_a_refused_write_is_raised(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError), staged_folder(tmp_path / "file" / "entry"):
        pass
