"""bench/run.py's comparison block: ratios within each repeat, and what differs between the variants is named."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run


def _found(attention_dropout: float | None) -> dict:
    spec = {
        "samples": 64,
        "texts_how": "the first 64 embedded Wikipedia training sentences",
        "batch_size": 32,
        "max_length": 128,
        "lr": 1e-4,
        "warmup_ratio": 0.1,
        "weight_decay": 0.01,
        "seed": 42,
        "attention_dropout": attention_dropout,
    }
    runs = []
    for peer_train, warm_train, floor_train in ((40.0, 10.0, 9.0), (20.0, 10.0, 10.0), (30.0, 20.0, 10.0)):
        common = {"teacher_seconds": 5.0, "teacher_encode_seconds": 4.0, "train_samples": 64}
        cold = {**common, "teacher_loaded": True, "ndcg@10": 0.55, "train_seconds": warm_train}
        warm = {**cold, "teacher_seconds": 0.0, "teacher_loaded": False}
        floor = {"teacher_seconds": 0.0, "train_seconds": floor_train, "train_samples": 64, "padding_fraction": 0.05}
        random = {**floor, "train_seconds": 2 * floor_train, "padding_fraction": 0.6}
        runs.append(
            {
                "peer": run.Process(60.0, 1500.0, {**common, "train_seconds": peer_train, "ndcg@10": 0.5}),
                "toolkit_cold": run.Process(30.0, 1200.0, cold),
                "toolkit_warm": run.Process(20.0, 1200.0, warm),
                "floor_grouped": run.Process(15.0, 1200.0, floor),
                "floor_random": run.Process(25.0, 1200.0, random),
            }
        )
    return {"spec": spec, "teacher": {"queries": 4, "corpus": 4, "ndcg@10": 0.6}, "runs": runs}


def test_ratios_are_taken_within_each_repeat_then_the_median() -> None:
    text = run.main_block(argparse.Namespace(), _found(0.0), ["(head)"])
    # warm / peer samples/s per repeat: 40/10 = 4, 20/10 = 2, 30/20 = 1.5 -> median 2 (not 30/10 = 3 of the medians)
    assert "| training samples/s, toolkit (warm) / peer | 2.00 (1.50–4.00) | ≥ 1.5 | yes |" in text
    # toolkit / floor per repeat: 10/9, 10/10, 20/10 -> median 1.11: above the 1.10 target
    assert "| training time, toolkit (warm) / floor (same batches) | 1.11 (1.00–2.00) | ≤ 1.10 | no |" in text
    assert "| warm run: teacher seconds, teacher loaded | 0.00 (0.00–0.00) s, no | 0 s, no | yes |" in text


def test_the_block_says_the_peer_trains_with_the_models_own_attention_dropout() -> None:
    text = run.main_block(argparse.Namespace(), _found(0.0), ["(head)"])
    assert "attention dropout 0 (toolkit and floor; the toolkit's default)" in text
    assert "the model's own in the peer" in text


def test_run_process_reports_the_peak_and_its_file_backed_part(tmp_path: Path) -> None:
    mapped = tmp_path / "mapped.bin"
    mapped.write_bytes(b"\1" * (48 << 20))
    script = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "touched = sum(m[i] for i in range(0, len(m), 4096))  # every page of the file resident\n"
        "heap = b'\\2' * (96 << 20)  # written, so resident\n"
        "time.sleep(1.0)\n"
    )
    process = run.run_process([sys.executable, "-c", script, str(mapped)], tmp_path / "log.txt", preload="")
    assert process.peak_rss_mib >= 96 + 48
    assert process.peak_file_mib is not None and 48 <= process.peak_file_mib < 96
    assert process.peak_rss_mib - process.peak_file_mib >= 96  # the heap is not counted as file-backed


def _row(samples: int, peaks: list[float], files: list[float]) -> dict:
    timing = {"teacher_seconds": 1.0, "train_seconds": 2.0}
    runs = [run.Process(3.0, peak, dict(timing), peak_file_mib=f) for peak, f in zip(peaks, files)]
    return {"samples": samples, "how": f"{samples} texts", "allocator": "tcmalloc", "runs": runs}


def test_memory_block_takes_the_median_of_each_size_and_names_the_file_backed_part() -> None:
    args = argparse.Namespace(sweep_repeats=3, launchers="tcmalloc")
    found = {
        "rows": [_row(4000, [1200, 1260, 1230], [190, 200, 180]), _row(40000, [1340, 1320, 1400], [220, 230, 210])]
    }
    text = run.memory_block(args, found, ["(head)"])
    assert "| tcmalloc | 4,000 | 4000 texts | 1230 (1200–1260) | 190 (180–200) |" in text
    # 1340 / 1230 - 1 = +8.9%: under the target
    assert "- tcmalloc (what `make` and `run_ddp.sh` use here): peak RSS grows by +8.9% for 10x the data" in text
    assert "(target: less than +10%): met." in text
    found["rows"][1]["runs"][0].peak_rss_mib = 1360  # median 1360: +10.6%
    assert "+10.6% for 10x the data (target: less than +10%): NOT met." in run.memory_block(args, found, ["(head)"])
