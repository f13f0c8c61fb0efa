"""The data kept on disk once per machine (distill/data/kept.py): what every process reads back equals what
`load_data` returns, a rerun reads no source, a changed source is read again, and the columns read as lists do."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

import distill.data as data_stage
import distill.data.kept as kept
import distill.data.reading as reading
from distill.config import DataConfig
from distill.data import load_data, prepared_data
from distill.data.containers import passage_texts, pick
from distill.data.kept import Negatives, TextColumn, data_key, hub_commits, read_column, write_column
from distill.data.reading import NANOBEIR_HUB, iter_records, pinned, revision
from distill.files import text_digests, texts_fingerprint

pytestmark = pytest.mark.usefixtures("partial_state")


def write_sources(root: Path) -> DataConfig:
    """Phase-1 texts with a repeat and an empty line, and pairs with two negatives each, of which some are held
    out for evaluation."""
    root.mkdir(parents=True, exist_ok=True)
    texts = [f"phase one text {i}  with   spaces" for i in range(300)]
    texts[5:5] = ["phase one text 3 with spaces", ""]
    (root / "texts.txt").write_text("\n".join(texts) + "\n")
    rows = [
        {"query": f"question {i}", "passage": f"answer {i}", "negatives": [f"wrong {i} a", f"wrong {i} b"]}
        for i in range(200)
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return DataConfig(
        phase1_data=str(root / "texts.txt"),
        phase2_data=str(root / "pairs.jsonl"),
        eval_data="auto",
        max_eval_queries=20,
        max_samples_phase1=250,
    )


def test_every_process_reads_back_what_load_data_returns(tmp_path: Path) -> None:
    config = write_sources(tmp_path / "data")
    expected = load_data(config, seed=3)
    data = prepared_data(config, 3, True, True, tmp_path / "cache")
    assert isinstance(data.phase1_texts, TextColumn) and isinstance(data.phase2.queries, TextColumn)
    assert list(data.phase1_texts) == expected.phase1_texts
    assert list(data.phase2.queries) == expected.phase2.queries
    assert list(data.phase2.passages) == expected.phase2.passages
    assert [data.phase2.negatives[i] for i in range(len(data.phase2))] == expected.phase2.negatives
    assert list(passage_texts(data.phase2)[0]) == passage_texts(expected.phase2)[0]
    np.testing.assert_array_equal(passage_texts(data.phase2)[1], passage_texts(expected.phase2)[1])
    assert data.evaluation == expected.evaluation and data.capped == expected.capped == {"max_samples_phase1": 250}
    # what the token and teacher caches key by comes computed, and equal to hashing the texts
    for column, texts in (
        (data.phase1_texts, expected.phase1_texts),
        (data.phase2.passages, expected.phase2.passages),
        (passage_texts(data.phase2)[0], passage_texts(expected.phase2)[0]),
    ):
        assert texts_fingerprint(column) == texts_fingerprint(list(texts))
        np.testing.assert_array_equal(text_digests(column), text_digests(list(texts)))


def test_a_rerun_reads_no_source_and_says_the_cap_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_sources(tmp_path / "data")
    first = prepared_data(config, 3, True, True, tmp_path / "cache")

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was read again")

    monkeypatch.setattr(data_stage, "load_phases", no_reading)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = prepared_data(config, 3, True, True, tmp_path / "cache")
    assert list(again.phase1_texts) == list(first.phase1_texts) and again.capped == first.capped
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # said once each, as the first run said them
    assert "stopped reading at 250 texts (--max_samples_phase1)" in said[1]
    assert "dropped 1 empty or non-string rows and 1 duplicates" in said[0]


def test_a_changed_source_another_seed_or_cap_is_another_entry(tmp_path: Path) -> None:
    config = write_sources(tmp_path / "data")
    cache = tmp_path / "cache"
    prepared_data(config, 3, True, True, cache)
    assert len(list(cache.iterdir())) == 1
    prepared_data(config, 4, True, True, cache)  # another seed: other held-out pairs
    prepared_data(DataConfig(**{**vars(config), "max_samples_phase1": 100}), 3, True, True, cache)
    assert len(list(cache.iterdir())) == 3
    prepared_data(DataConfig(**{**vars(config), "mine_hard_negatives": 4}), 3, True, True, cache)  # mined later
    assert len(list(cache.iterdir())) == 3
    texts = Path(config.phase1_data)
    texts.write_text(texts.read_text() + "one more text\n")
    os.utime(texts, ns=(texts.stat().st_atime_ns, texts.stat().st_mtime_ns + 1_000_000))
    data = prepared_data(DataConfig(**{**vars(config), "max_samples_phase1": None}), 3, True, True, cache)
    assert data.phase1_texts[-1] == "one more text" and len(list(cache.iterdir())) == 4


def key_of(config: DataConfig, need_phase1: bool = True, need_phase2: bool = True) -> str | None:
    """The data's key, the Hub asked for its datasets' commits as a run asks."""
    return data_key(config, 3, need_phase1, need_phase2, hub_commits(config, need_phase1, need_phase2))


def test_a_hub_dataset_is_keyed_by_its_commit_read_at_it_and_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_hub
) -> None:
    """A Hub dataset (phase data or NanoBEIR) is stamped by the commit the Hub names for it and read at that commit:
    a rerun reads it no more and a new commit is another entry; one whose commit the Hub cannot name is read by each
    process."""
    config = write_sources(tmp_path / "data")
    local_hub.datasets |= {"someone/pairs": "a" * 40, NANOBEIR_HUB: "b" * 40}
    reads = []

    def from_local_files(hub: DataConfig, *args: object) -> object:  # the Hub's rows, served by the local files
        reads.append((hub.phase2_data, revision(hub.phase2_data)))
        return phases(DataConfig(**{**vars(hub), "phase2_data": config.phase2_data}), *args)

    phases = data_stage.load_phases
    monkeypatch.setattr(data_stage, "load_phases", from_local_files)
    hub = DataConfig(**{**vars(config), "phase2_data": "someone/pairs"})
    first = prepared_data(hub, 3, True, True, tmp_path / "cache")
    again = prepared_data(hub, 3, True, True, tmp_path / "cache")
    assert reads == [("someone/pairs", "a" * 40)] and list(again.phase2.queries) == list(first.phase2.queries)
    key = key_of(hub)
    subset = DataConfig(**{**vars(hub), "phase2_data": "someone/pairs:subset"})
    assert key is not None and key_of(subset) not in (None, key)
    local_hub.datasets["someone/pairs"] = "c" * 40  # a new commit on the Hub
    assert key_of(hub) not in (None, key)
    assert key_of(DataConfig(**{**vars(config), "eval_data": "nanobeir"}))
    asked = [path for method, path, _ in local_hub.requests if path.startswith("/api/datasets/")]
    assert asked == ["/api/datasets/someone/pairs"] * 5 + [f"/api/datasets/{NANOBEIR_HUB}"], asked

    unknown = DataConfig(**{**vars(config), "phase2_data": "someone/unknown"})  # the Hub answers 404
    assert key_of(unknown) is None
    assert key_of(DataConfig(**{**vars(config), "eval_data": "nanobeir:someone/copy"})) is None
    prepared_data(unknown, 3, True, True, tmp_path / "other")
    assert reads[1:] == [("someone/unknown", None)] and not (tmp_path / "other").exists()


def test_a_pinned_hub_dataset_is_streamed_at_its_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `pinned`, a Hub dataset with a commit is streamed at it; without one, or outside, at its branch."""
    import datasets

    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: asked.append(kwargs) or iter([{"text": "a"}]))
    with pinned({"someone/texts": "d" * 40, "someone/other": None}):
        assert list(iter_records("someone/texts:subset")) == [{"text": "a"}]
        list(iter_records("someone/other"))
    list(iter_records("someone/texts"))
    read_at = [(kwargs["revision"], kwargs.get("name")) for kwargs in asked]
    assert read_at == [("d" * 40, "subset"), (None, None), (None, None)]  # pinned; no commit known; outside the block


def test_nanobeir_the_hub_cannot_date_is_read_by_each_process_and_the_phase_data_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_hub, nanobeir_stand_in: Path
) -> None:
    """Offline, or with a Hub that does not answer, NanoBEIR has no commit to key by: each process reads it (from
    datasets' cache), and the phase data are still read once and kept. Once the Hub dates it, it is kept with them,
    read at its commit."""
    config = DataConfig(
        **{**vars(write_sources(tmp_path / "data")), "eval_data": "nanobeir", "nanobeir_datasets": "scifact"}
    )
    nanobeir_reads, loads = [], []
    rows, load = reading._nanobeir_rows, data_stage.load_evaluation

    def from_the_stand_in(dataset: str, subset: str, split: str) -> object:  # NanoBEIR-en, served by a local copy
        nanobeir_reads.append(revision(dataset))
        return rows(str(nanobeir_stand_in), subset, split)

    monkeypatch.setattr(reading, "_nanobeir_rows", from_the_stand_in)
    monkeypatch.setattr(data_stage, "load_evaluation", lambda data: loads.append(reading.PINNED.get()) or load(data))
    phases, phases_read = data_stage.load_phases, []
    monkeypatch.setattr(data_stage, "load_phases", lambda *args: phases_read.append(1) or phases(*args))
    expected = reading.nanobeir_eval_set("nanobeir", "scifact")
    nanobeir_reads.clear()
    first = prepared_data(config, 3, True, True, tmp_path / "cache")  # the stand-in Hub does not know NanoBEIR-en
    again = prepared_data(config, 3, True, True, tmp_path / "cache")
    assert first.evaluation == again.evaluation == expected and list(again.phase1_texts) == list(first.phase1_texts)
    assert len(phases_read) == 1 and len(loads) == 2  # the phase data read once; NanoBEIR by each run, beside them
    assert nanobeir_reads == [None] * 6  # its 3 subsets, twice
    assert len(list((tmp_path / "cache").iterdir())) == 1

    local_hub.datasets[NANOBEIR_HUB] = "e" * 40
    dated = prepared_data(config, 3, True, True, tmp_path / "cache")
    assert prepared_data(config, 3, True, True, tmp_path / "cache").evaluation == dated.evaluation == expected
    assert len(phases_read) == len(loads) - 1 == 2  # read once more, with the phases, at its commit; then kept
    assert nanobeir_reads[6:] == ["e" * 40] * 3


def test_a_local_source_is_one_entry_however_its_path_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_sources(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    spellings = [config.phase1_data, "data/texts.txt", "./data/texts.txt", "data/../data/texts.txt"]
    keys = {key_of(DataConfig(**{**vars(config), "phase1_data": path})) for path in spellings}
    assert len(keys) == 1 and None not in keys
    other = DataConfig(**{**vars(config), "phase2_data": "data/texts.txt"})  # another source is another entry
    assert key_of(other) not in keys
    skipped = DataConfig(**{**vars(config), "phase1_data": "./missing.txt"})  # a phase the run skips is not read
    assert key_of(skipped, need_phase1=False)


def test_a_column_reads_as_a_list_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept, "WRITE_ROWS", 7)  # several chunks
    monkeypatch.setattr(kept, "READ_ROWS", 5)
    texts = [f"text {i} é" for i in range(40)] + ["", "last"]
    column = read_column(tmp_path / "texts", write_column(tmp_path / "texts", texts))
    assert column.array.num_chunks == 6 and len(column) == len(texts)
    assert list(column) == texts and column[3] == texts[3] and column[-1] == "last"
    assert column[5:17] == texts[5:17] and column[30:] == texts[30:] and column[::9] == texts[::9]
    assert column[40:3] == [] and bool(column)
    with pytest.raises(IndexError):
        column[len(texts)]
    rows = np.array([41, 0, 13, 13, 6, 7, 35])
    assert pick(column, rows) == [texts[i] for i in rows] == pick(texts, rows)
    assert random.Random(0).sample(column, 5) == random.Random(0).sample(texts, 5)
    view = column.view(10, 20, texts_fingerprint(texts[10:20]))
    assert list(view) == texts[10:20] and texts_fingerprint(view) == texts_fingerprint(texts[10:20])
    np.testing.assert_array_equal(text_digests(view), text_digests(texts[10:20]))
    negatives = Negatives(column.view(0, 40, ""), 4)
    assert len(negatives) == 10 and negatives[2] == texts[8:12] and negatives[-1] == texts[36:40]
    assert negatives[1:3] == [texts[4:8], texts[8:12]]


def test_an_empty_list_is_a_column_too(tmp_path: Path) -> None:
    column = read_column(tmp_path / "none", write_column(tmp_path / "none", []))
    assert len(column) == 0 and list(column) == [] and not column and text_digests(column).shape == (0,)


def test_a_folder_that_refuses_the_data_leaves_each_process_reading_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_sources(tmp_path / "data")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        data = prepared_data(config, 3, True, True, blocked / "data")
    assert data.phase1_texts == load_data(config, seed=3).phase1_texts  # the lists as read
    assert any("cannot keep the data under" in r.getMessage() for r in caplog.records)
    assert blocked.read_text() == "not a folder"


def test_a_torn_data_entry_is_read_again_with_one_line_and_pruned_as_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An `.arrow` cut short by a node crash used to be trusted because fields.json existed: every later run failed
    on a raw pyarrow error, and `prune` counted the entry valid. Now the entry fails its check, `prune` lists it as
    corrupt, and the next run reads the data again, saying so once."""
    from distill.cache import prune

    config = write_sources(tmp_path / "data")
    cache = tmp_path / "cache"
    first = prepared_data(config, 3, True, True, cache / "data")
    (entry,) = (cache / "data").iterdir()
    arrow = entry / "phase1.arrow"
    written = arrow.stat().st_size
    arrow.write_bytes(arrow.read_bytes()[:100])
    del first
    (line, _) = prune(cache, dry_run=True)
    assert line.startswith(f"would remove {entry} (") and line.endswith(
        "incomplete or corrupt (a run would rebuild it)"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = prepared_data(config, 3, True, True, cache / "data")
    said = [r.getMessage() for r in caplog.records if "kept data" in r.getMessage()]
    line = f"kept data {entry} is torn (phase1.arrow: 100 bytes, {written} written); reading the data again"
    assert len(said) == 1 and said[0].endswith(line)
    assert list(again.phase1_texts) == list(load_data(config, seed=3).phase1_texts)


MACHINE_FIRST = """
import os, sys, time
from datetime import timedelta
from accelerate import PartialState
from distill.distributed import machine_first

state = PartialState(cpu=True, timeout=timedelta(seconds=3))  # --ddp_timeout 3
with machine_first():
    if state.is_local_main_process:
        time.sleep(8)  # reading a corpus once for the machine, for longer than --ddp_timeout
state.wait_for_everyone()
open(sys.argv[1] + "." + os.environ["RANK"], "w").close()
"""


@pytest.mark.multiprocess
def test_the_work_done_once_per_machine_may_outlast_the_ddp_timeout(tmp_path: Path) -> None:
    """The machine's other processes wait for its first outside --ddp_timeout (accelerate's
    `local_main_process_first` waited within it, and a large corpus ended the job the same way on every restart)."""
    import subprocess
    import sys
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "driver.py").write_text(MACHINE_FIRST)
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    done = subprocess.run(
        [*launch, str(tmp_path / "driver.py"), str(tmp_path / "done")], env=env, capture_output=True, text=True
    )
    assert all((tmp_path / f"done.{rank}").exists() for rank in (0, 1)), done.stderr[-3000:]
