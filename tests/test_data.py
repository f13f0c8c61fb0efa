"""Data loading and cleaning: local files, bad rows, column detection, hold-out, the demo's data by name."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distill.data.reading as data_module
from distill.config import DataConfig
from distill.data import load_data, load_pairs, load_phase1_texts
from distill.data.cleaning import clean_texts, hold_out
from distill.data.containers import Pairs
from distill.data.reading import embedded_eval_set, read_records
from distill.embedded import corpus
from distill.errors import DistillError

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("partial_state")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def numbered_pairs(count: int) -> list[dict]:
    return [
        {"query": f"question number {i}", "passage": f"the answer to question {i} is {i * 7}"} for i in range(count)
    ]


# ---------------------------------------------------------------- cleaning


def test_clean_texts_drops_bad_rows_and_duplicates() -> None:
    raw = ["first text", "", "   ", "\n\t", None, 3, 4.5, ["a list"], "first text", "  first   text ", "second\n text"]
    assert clean_texts(raw, "test") == ["first text", "second text"]


def test_clean_texts_keeps_order_and_distinct_texts() -> None:
    raw = ["c", "b", "a", "b", "c", "d"]
    assert clean_texts(raw, "test") == ["c", "b", "a", "d"]
    assert clean_texts([], "test") == []


def test_clean_pairs_drops_bad_rows_duplicates_and_collapses_whitespace(tmp_path: Path) -> None:
    rows = [
        {"query": "good  query", "passage": "good\npassage"},
        {"query": "", "passage": "passage without query"},
        {"query": "query without passage", "passage": "   "},
        {"query": None, "passage": "null query"},
        {"query": 12, "passage": "numeric query"},
        {"query": "good query", "passage": "good passage"},  # duplicate after whitespace cleanup
        {"query": "good query", "passage": "another passage"},  # same query, new passage: kept
    ]
    pairs = load_pairs(str(write_jsonl(tmp_path / "pairs.jsonl", rows)), 100, seed=0)
    assert pairs.queries == ["good query", "good query"]
    assert pairs.passages == ["good passage", "another passage"]
    assert pairs.negatives == []
    assert len(pairs) == 2


# ---------------------------------------------------------------- local formats


def test_local_txt_phase1(tmp_path: Path) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("alpha beta\ngamma  delta\n\n  \nalpha beta\nepsilon\n")
    assert load_phase1_texts(str(path), 100) == ["alpha beta", "gamma delta", "epsilon"]
    assert load_phase1_texts(str(path), 2) == ["alpha beta", "gamma delta"]


def test_local_jsonl_phase1_picks_text_column(tmp_path: Path) -> None:
    rows = [{"id": i, "sentence": f"sentence {i}", "other": "x"} for i in range(5)]
    path = write_jsonl(tmp_path / "texts.jsonl", rows)
    assert load_phase1_texts(str(path), 100) == [f"sentence {i}" for i in range(5)]


def test_local_phase1_single_string_column_is_used(tmp_path: Path) -> None:
    rows = [{"id": i, "body": f"body text {i}"} for i in range(4)]
    path = write_jsonl(tmp_path / "texts.jsonl", rows)
    assert load_phase1_texts(str(path), 100) == [f"body text {i}" for i in range(4)]


def test_local_jsonl_pairs(tiny_data: dict[str, Path]) -> None:
    pairs = load_pairs(str(tiny_data["pairs"]), 1000, seed=0)
    assert len(pairs) == 160
    # the fixture puts each query inside its passage
    assert all(q in p for q, p in zip(pairs.queries, pairs.passages, strict=True))
    assert len(pairs.negatives) == 160 and all(len(n) == 1 for n in pairs.negatives)


def test_local_csv_pairs_with_alternative_column_names(tmp_path: Path) -> None:
    rows = [{"question": f"what is {i}", "answer": f"{i} is a number", "score": i} for i in range(6)]
    pairs = load_pairs(str(write_csv(tmp_path / "pairs.csv", rows)), 100, seed=0)
    assert pairs.queries == [f"what is {i}" for i in range(6)]
    assert pairs.passages == [f"{i} is a number" for i in range(6)]


def test_local_parquet_pairs_and_texts(tmp_path: Path) -> None:
    rows = [{"anchor": f"anchor {i}", "positive": f"positive {i}"} for i in range(8)]
    path = write_parquet(tmp_path / "pairs.parquet", rows)
    pairs = load_pairs(str(path), 100, seed=0)
    assert pairs.queries == [f"anchor {i}" for i in range(8)]
    assert pairs.passages == [f"positive {i}" for i in range(8)]
    texts = write_parquet(tmp_path / "texts.parquet", [{"text": f"text {i}"} for i in range(3)])
    assert load_phase1_texts(str(texts), 100) == ["text 0", "text 1", "text 2"]


def test_read_records_caps_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(20))
    assert len(read_records(str(path), 5)) == 5
    assert len(read_records(str(path))) == 20
    assert len(load_pairs(str(path), 7, seed=0)) == 7


def test_missing_file_error(tmp_path: Path) -> None:
    with pytest.raises(DistillError, match=r"data file '.*missing\.jsonl' does not exist"):
        load_pairs(str(tmp_path / "missing.jsonl"), 10, seed=0)
    with pytest.raises(DistillError, match=r"does not exist"):
        load_phase1_texts("./no/such/texts.txt", 10)


def test_wrong_extension_error(tmp_path: Path) -> None:
    path = tmp_path / "texts.xlsx"
    path.write_text("not a spreadsheet")
    with pytest.raises(DistillError, match=r"unsupported extension '\.xlsx'; use one of \.jsonl, \.json, \.csv"):
        load_phase1_texts(str(path), 10)


def test_unreachable_hub_dataset_error() -> None:
    with pytest.raises(DistillError, match=r"data 'nobody/no-such-dataset-xyz' could not be loaded.*'embedded'"):
        read_records("nobody/no-such-dataset-xyz")


def test_missing_columns_error_names_found_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"foo": "a", "bar": "b"}] * 3)
    with pytest.raises(
        DistillError, match=r"no phase-2 query column: expected one of query, question, anchor, queries, found foo, bar"
    ):
        load_pairs(str(path), 10, seed=0)
    only_query = write_jsonl(tmp_path / "queries.jsonl", [{"query": "a", "label": "b"}] * 3)
    with pytest.raises(DistillError, match=r"no phase-2 passage column: .* found query, label"):
        load_pairs(str(only_query), 10, seed=0)
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"x": 1, "y": 2}] * 3)
    with pytest.raises(DistillError, match=r"no phase-1 text column: .* found x, y; rename the column"):
        load_phase1_texts(str(numbers), 10)


def test_phase1_with_nothing_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings = []
    monkeypatch.setattr(data_module.logger, "warning", lambda message, **kwargs: warnings.append(message))
    path = tmp_path / "blank.txt"
    path.write_text("\n   \n\t\n")
    with pytest.raises(DistillError, match=r"phase-1 data .* has no usable text .*--skip_phase1"):
        load_phase1_texts(str(path), 10)
    assert warnings == []  # the error is the one line (README), no "dropped 3 ...; 0 remain" before it


def test_phase2_with_nothing_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings = []
    monkeypatch.setattr(data_module.logger, "warning", lambda message, **kwargs: warnings.append(message))
    rows = [{"query": "", "passage": "p"}, {"query": "q", "passage": None}, {"query": 3, "passage": "x"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DistillError, match=r"phase-2 data .* has no usable \(query, passage\) pair.*--skip_phase2"):
        load_pairs(str(path), 10, seed=0)
    assert warnings == []


# ---------------------------------------------------------------- negatives


def test_single_negative_column(tmp_path: Path) -> None:
    rows = [{"query": f"q{i}", "passage": f"p{i}", "negative": f"n{i}"} for i in range(4)]
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 10, seed=0)
    assert pairs.negatives == [["n0"], ["n1"], ["n2"], ["n3"]]


def test_numbered_negative_columns_in_order(tmp_path: Path) -> None:
    rows = [
        {"query": f"q{i}", "passage": f"p{i}", "negative_2": f"second {i}", "negative_1": f"first {i}"}
        for i in range(3)
    ]
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 10, seed=0)
    assert pairs.negatives == [[f"first {i}", f"second {i}"] for i in range(3)]


def test_list_negatives_trimmed_to_common_count(tmp_path: Path) -> None:
    rows = [
        {"query": "q0", "passage": "p0", "negatives": ["a0", "b0", "c0"]},
        {"query": "q1", "passage": "p1", "negatives": ["a1", "b1"]},
        {"query": "q2", "passage": "p2", "negatives": ["a2", "b2", "c2", "d2"]},
    ]
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 10, seed=0)
    assert pairs.negatives == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]


def test_pair_with_bad_negative_is_dropped(tmp_path: Path) -> None:
    rows = [
        {"query": "q0", "passage": "p0", "negative": "n0"},
        {"query": "q1", "passage": "p1", "negative": ""},
        {"query": "q2", "passage": "p2", "negative": "n2"},
    ]
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 10, seed=0)
    assert pairs.queries == ["q0", "q2"]
    assert pairs.negatives == [["n0"], ["n2"]]


# ---------------------------------------------------------------- hold-out


def make_pairs(count: int, negatives: bool = False) -> Pairs:
    return Pairs(
        [f"q{i}" for i in range(count)],
        [f"p{i}" for i in range(count)],
        [[f"n{i}"] for i in range(count)] if negatives else [],
    )


def test_hold_out_moves_pairs_out_of_training() -> None:
    pairs = make_pairs(100, negatives=True)
    train, evaluation = hold_out(pairs, 8, seed=3)
    assert len(evaluation.queries) == 8 and len(train) == 92
    assert not set(evaluation.queries) & set(train.queries)
    assert not set(evaluation.corpus) & set(train.passages)
    assert set(evaluation.queries) | set(train.queries) == set(pairs.queries)
    # each held-out query's relevant passage is its own
    for query, relevant in zip(evaluation.queries, evaluation.relevant, strict=True):
        assert evaluation.corpus[relevant] == "p" + query[1:]
    # training rows stay aligned with their passages and negatives
    for query, passage, negative in zip(train.queries, train.passages, train.negatives, strict=True):
        assert passage == "p" + query[1:] and negative == ["n" + query[1:]]
    # deterministic for a seed, different for another
    again, evaluation_again = hold_out(pairs, 8, seed=3)
    assert evaluation_again.queries == evaluation.queries and again.queries == train.queries
    _, other = hold_out(pairs, 8, seed=4)
    assert other.queries != evaluation.queries


def test_hold_out_takes_at_most_a_tenth() -> None:
    train, evaluation = hold_out(make_pairs(50), 1000, seed=0)
    assert len(evaluation.queries) == 5 and len(train) == 45


def test_hold_out_too_few_pairs() -> None:
    with pytest.raises(DistillError, match=r"has 9 pairs, too few to hold out evaluation queries"):
        hold_out(make_pairs(9), 5, seed=0)


def test_load_data_auto_eval_holds_out_local_pairs(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(120))
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"text {i}" for i in range(30)))
    config = DataConfig(
        phase1_data=str(texts),
        phase2_data=str(path),
        eval_data="auto",
        max_samples_phase1=20,
        max_samples_phase2=100,
        max_eval_queries=10,
    )
    data = load_data(config, seed=1)
    assert len(data.phase1_texts) == 20
    assert data.evaluation is not None
    assert len(data.evaluation.queries) == 10
    assert len(data.phase2) == 100
    assert not set(data.evaluation.queries) & set(data.phase2.queries)
    assert data.evaluation.sts_pairs == []  # STS only with the embedded set, whatever is installed


def test_load_data_eval_none_and_skipped_phases(tiny_data: dict[str, Path]) -> None:
    config = DataConfig(phase1_data=str(tiny_data["texts"]), phase2_data=str(tiny_data["pairs"]), eval_data="none")
    data = load_data(config, seed=0, need_phase1=False)
    assert data.phase1_texts == [] and data.evaluation is None and len(data.phase2) == 160
    data = load_data(config, seed=0, need_phase2=False)
    assert len(data.phase1_texts) == 256 and len(data.phase2) == 0


def test_load_data_bad_eval_choice(tiny_data: dict[str, Path]) -> None:
    config = DataConfig(phase1_data=str(tiny_data["texts"]), phase2_data=str(tiny_data["pairs"]), eval_data="heldout")
    with pytest.raises(
        DistillError, match=r"eval_data: expected auto, embedded, nanobeir, nanobeir:DATASET or none, got 'heldout'"
    ):
        load_data(config, seed=0)


# ---------------------------------------------------------------- the demo's data, named `embedded`


def test_embedded_phase_loaders() -> None:
    texts = load_phase1_texts("embedded", 500)
    assert len(texts) == 500 and len(set(texts)) == 500
    pairs = load_pairs("embedded", 10, seed=0)
    assert len(pairs) > 100 and pairs.negatives == []


def test_embedded_eval_set_points_at_the_right_passages() -> None:
    evaluation = embedded_eval_set(seed=2, max_queries=40)
    queries, passages = corpus.inverse_cloze_pairs(corpus.eval_articles(), seed=2)
    assert len(evaluation.queries) == 40
    assert evaluation.corpus == passages
    for query, relevant in zip(evaluation.queries, evaluation.relevant, strict=True):
        assert queries[relevant] == query
    assert len(evaluation.sts_texts) == 50 and len(evaluation.sts_pairs) == 1225


def test_a_users_own_data_is_evaluated_without_sts_and_loads_no_demo_module(tmp_path: Path) -> None:
    """STS comes with the embedded set only, never because gensim happens to be installed."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"query": f"question {i} about topic {i}", "passage": f"passage {i} on topic {i}."} for i in range(60)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = (
        "import sys\nfrom distill.config import DataConfig\nfrom distill.data import load_data\n"
        f"data = load_data(DataConfig(phase2_data={str(pairs)!r}, max_eval_queries=10), 0, need_phase1=False)\n"
        "print(len(data.evaluation.queries), len(data.evaluation.sts_texts), 'distill.embedded' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    queries, sts, demo_loaded = done.stdout.split()
    assert int(queries) > 0 and (sts, demo_loaded) == ("0", "False")


# ---------------------------------------------------------------- formats users bring


def test_bge_style_pos_and_neg_lists(tmp_path: Path) -> None:
    rows = [{"query": f"q{i}", "pos": [f"p{i}", f"other {i}"], "neg": [f"a{i}", f"b{i}"]} for i in range(3)]
    pairs = load_pairs(str(write_jsonl(tmp_path / "bge.jsonl", rows)), 10, seed=0)
    assert pairs.queries == ["q0", "q1", "q2"]
    assert pairs.passages == ["p0", "p1", "p2"]  # the first positive of each list
    assert pairs.negatives == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]


def test_columns_named_like_negatives_but_not_texts_are_ignored(tmp_path: Path) -> None:
    rows = [{"query": f"q{i}", "passage": f"p{i}", "negative_score": 0.5, "negative_ids": [i]} for i in range(3)]
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 10, seed=0)
    assert pairs.queries == ["q0", "q1", "q2"] and pairs.negatives == []


def test_a_row_without_negatives_is_dropped_not_the_negatives_of_all(tmp_path: Path) -> None:
    rows = [{"query": f"q{i}", "passage": f"p{i}", "negatives": [f"n{i}", f"m{i}"]} for i in range(20)]
    rows[5]["negatives"] = []
    pairs = load_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), 100, seed=0)
    assert len(pairs) == 19 and "q5" not in pairs.queries
    assert all(len(n) == 2 for n in pairs.negatives) and pairs.negatives[0] == ["n0", "m0"]


def test_max_samples_counts_usable_texts_not_raw_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "spaced.txt"
    path.write_text("".join(f"sentence {i}\n\n" for i in range(100)))  # every other line blank
    assert load_phase1_texts(str(path), 40) == [f"sentence {i}" for i in range(40)]
    monkeypatch.setattr("distill.data.reading.CHUNK_ROWS", 3)  # datasets are read in chunks until enough are usable
    rows = [{"query": "same", "passage": "same"}] * 5 + numbered_pairs(20)
    pairs = load_pairs(str(write_jsonl(tmp_path / "dupes.jsonl", rows)), 7, seed=0)
    assert len(pairs) == 7 and pairs.queries[0] == "same" and len(set(pairs.queries)) == 7


def test_malformed_jsonl_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken"\n')
    with pytest.raises(DistillError, match=r"'.*bad\.jsonl' could not be read \(.*\); check that it is well-formed"):
        load_phase1_texts(str(path), 10)


def test_text_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.txt"
    path.write_bytes("café crème\n".encode("latin-1"))
    with pytest.raises(DistillError, match=r"is not UTF-8 text .*; convert it to UTF-8, e\.g\. iconv"):
        load_phase1_texts(str(path), 10)


def test_text_file_is_read_line_by_line_with_the_whole_files_lines(tmp_path: Path) -> None:
    from distill.data.reading import iter_records

    path = tmp_path / "mixed.txt"
    text = "\ufeffbom first\r\nwindows\rold mac\nform\x0cfeed\nline\u2028separator\n\nemoji \U0001f600 here\nno end"
    path.write_bytes(text.encode("utf8"))
    assert [row["text"] for row in iter_records(str(path))] == text.splitlines()


def test_a_capped_text_file_is_read_only_as_far_as_it_keeps(tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_bytes(b"".join(f"sentence {i}\n".encode() for i in range(20_010)) + "caf\xe9\n".encode("latin-1"))
    assert load_phase1_texts(str(path), 20_000)[-1] == "sentence 19999"  # the bad last line is never read
    with pytest.raises(DistillError, match=r"not UTF-8 text \(invalid continuation byte at byte 289043\)"):
        load_phase1_texts(str(path), 20_011)


def test_a_large_data_file_is_read_under_a_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Above the bar's threshold (256 MiB; 0 here) a text file shows a bar in bytes and the other formats one in
    rows; below it reading is silent."""
    import distill.files

    lines = [f"sentence number {i} of a long corpus" for i in range(60_000)]
    text = tmp_path / "big.txt"
    text.write_text("\n".join(lines) + "\n")
    rows = tmp_path / "big.jsonl"
    rows.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:50]))
    assert load_phase1_texts(str(text), 100_000) == lines and load_phase1_texts(str(rows), 100) == lines[:50]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(distill.files, "BAR_BYTES", 0)
    monkeypatch.setattr(distill.data.reading, "BAR_BYTES", 0)
    assert load_phase1_texts(str(text), 100_000) == lines
    assert re.search(r"reading big\.txt: 100%.*\| 2\.\d+M/2\.\d+M \[", capsys.readouterr().err)
    assert load_phase1_texts(str(rows), 100) == lines[:50]
    assert re.search(r"reading big\.jsonl: 50 rows \[", capsys.readouterr().err)


def test_a_capped_jsonl_file_is_streamed_only_as_far_as_it_keeps(tmp_path: Path) -> None:
    """datasets' streaming mode: 12 MB of rows (beyond its first 10 MB block) end in a broken line that a capped
    read never reaches, and that a full read reports as one error."""
    path = tmp_path / "long.jsonl"
    with open(path, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"text": f"sentence {i} of a corpus larger than what the phase keeps"}) + "\n")
        f.write('{"text": "broken"\n')
    assert path.stat().st_size > 12e6
    assert load_phase1_texts(str(path), 1000)[-1] == "sentence 999 of a corpus larger than what the phase keeps"
    with pytest.raises(DistillError, match=r"'.*long\.jsonl' could not be read \(.*\); check that it is well-formed"):
        load_phase1_texts(str(path), 300_000)


def test_local_dataset_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = tmp_path / "pq"
    shards.mkdir()
    write_parquet(shards / "part-0.parquet", [{"text": f"shard zero {i}"} for i in range(3)])
    write_parquet(shards / "part-1.parquet", [{"text": f"shard one {i}"} for i in range(3)])
    monkeypatch.chdir(tmp_path)
    for source in ("./pq", str(shards), "pq"):
        assert sorted(load_phase1_texts(source, 100)) == sorted(
            [f"shard zero {i}" for i in range(3)] + [f"shard one {i}" for i in range(3)]
        )
    import datasets

    datasets.Dataset.from_list(numbered_pairs(12)).save_to_disk(str(tmp_path / "saved"))
    assert len(load_pairs(str(tmp_path / "saved"), 100, seed=0)) == 12


def test_dataset_with_subsets_needs_one_named(tmp_path: Path) -> None:
    folder = tmp_path / "multi"
    for subset, rows in (("pair", numbered_pairs(4)), ("triplet", numbered_pairs(6))):
        (folder / subset).mkdir(parents=True)
        write_jsonl(folder / subset / "train.jsonl", rows)
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: pair\n  data_files:\n  - split: train\n    path: pair/train.jsonl\n"
        "- config_name: triplet\n  data_files:\n  - split: train\n    path: triplet/train.jsonl\n---\n"
    )
    with pytest.raises(
        DistillError, match=r"several subsets \('pair', 'triplet'\); name one as NAME:SUBSET, e\.g\. .*:pair"
    ):
        load_pairs(str(folder), 10, seed=0)
    assert len(load_pairs(f"{folder}:triplet", 10, seed=0)) == 6


def test_hold_out_keeps_evaluation_texts_out_of_training_and_the_corpus_unique() -> None:
    """Natural-Questions-like data: several queries per passage, and passages that reappear as negatives."""
    queries = [f"q{i}" for i in range(100)]
    passages = [f"p{i // 2}" for i in range(100)]  # every passage answers two queries
    negatives = [[f"p{(i // 2 + 1) % 50}"] for i in range(100)]  # each negative is another pair's passage
    train, evaluation = hold_out(Pairs(queries, passages, negatives), 10, seed=2)  # q0 and q1 share p0
    assert {"q0", "q1"} <= set(evaluation.queries) and len(evaluation.corpus) == 9
    assert len(evaluation.corpus) == len(set(evaluation.corpus))  # no copy to tie with the relevant passage
    for query, relevant in zip(evaluation.queries, evaluation.relevant, strict=True):
        assert evaluation.corpus[relevant] == passages[queries.index(query)]
    held = set(evaluation.queries) | set(evaluation.corpus)
    assert train.queries, "something is left to train on"
    for query, passage, negative in zip(train.queries, train.passages, train.negatives, strict=True):
        assert not {query, passage, *negative} & held


def test_hold_out_holds_each_query_out_once() -> None:
    """A query with two passages is held out with one: the other, in the corpus too, would count as a miss."""
    queries = [f"q{i // 2}" for i in range(200)]  # every query has two passages
    passages = [f"p{i}" for i in range(200)]
    train, evaluation = hold_out(Pairs(queries, passages), 20, seed=0)
    assert len(evaluation.queries) == 20 and len(set(evaluation.queries)) == 20
    assert len(evaluation.corpus) == 20  # only the held-out passage of each query
    for query, relevant in zip(evaluation.queries, evaluation.relevant, strict=True):
        assert queries[passages.index(evaluation.corpus[relevant])] == query
    assert not set(train.queries) & set(evaluation.queries) and len(train.queries) == 200 - 40


def test_without_a_cap_a_run_reads_all_of_its_data_and_a_reached_cap_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No default drops data: every text and pair is read. A cap the source reaches is one warning line each and
    an entry of `capped` (the cap, not the cap plus the held-out queries); a cap the source does not reach says
    nothing."""
    import logging

    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text {i}\n" for i in range(15_000)))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"query": "q {i}", "passage": "p {i}"}}\n' for i in range(6_050)))
    config = DataConfig(phase1_data=str(texts), phase2_data=str(pairs), eval_data="auto", max_eval_queries=50)
    with caplog.at_level(logging.WARNING):
        data = load_data(config, seed=0)
    assert (len(data.phase1_texts), len(data.phase2), data.capped) == (15_000, 6_000, {})
    assert not [r for r in caplog.records if "stopped reading" in r.getMessage()]
    capped = DataConfig(**{**vars(config), "max_samples_phase1": 1_000, "max_samples_phase2": 2_000})
    with caplog.at_level(logging.WARNING):
        data = load_data(capped, seed=0)
    assert (len(data.phase1_texts), len(data.phase2), len(data.evaluation.queries)) == (1_000, 2_000, 50)
    assert data.capped == {"max_samples_phase1": 1_000, "max_samples_phase2": 2_000}
    lines = [r.getMessage().removeprefix("[RANK 0] ") for r in caplog.records if "stopped reading" in r.getMessage()]
    assert lines == [
        f"phase-1 data {str(texts)!r}: stopped reading at 1,000 texts (--max_samples_phase1); the source holds more: "
        "drop the option to train on all of them",
        f"phase-2 data {str(pairs)!r}: stopped reading at 2,000 pairs (--max_samples_phase2), and 50 held out for "
        "evaluation; the source holds more: drop the option to train on all of them",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # phase 2 skipped: its pairs are read for the held-out queries only
        assert load_data(capped, seed=0, need_phase2=False).capped == {"max_samples_phase1": 1_000}
    assert not [r for r in caplog.records if "phase-2 data" in r.getMessage()]
    caplog.clear()
    roomy = DataConfig(**{**vars(config), "max_samples_phase1": 15_000})  # exactly the source: nothing left out
    with caplog.at_level(logging.WARNING):
        assert load_data(roomy, seed=0, need_phase2=False).capped == {}
    assert not [r for r in caplog.records if "stopped reading" in r.getMessage()]
