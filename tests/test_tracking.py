"""Tracking: the JSON-lines tracker through a real Accelerator, and tracker names resolved with fix-it errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from distill import tracking
from distill.errors import DistillError
from distill.tracking import JsonlTracker, resolve_trackers


def test_jsonl_tracker_through_accelerator(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path / "run")
    assert not (tmp_path / "run").exists()  # built on every rank, so nothing is opened before `start`
    accelerator = Accelerator(cpu=True, log_with=[tracker], project_dir=tmp_path / "run")
    accelerator.init_trackers("x", config={"lr": 1e-3, "phase": "phase1"})
    accelerator.log({"loss": torch.tensor(0.5), "lr": 1e-3}, step=1)
    accelerator.log({"loss": 0.25}, step=2)
    assert accelerator.get_tracker("jsonl") is tracker
    accelerator.end_training()

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"config": {"lr": 1e-3, "phase": "phase1"}}
    assert [(line["step"], line["values"]) for line in lines[1:]] == [
        (1, {"loss": 0.5, "lr": 1e-3}),
        (2, {"loss": 0.25}),
    ]
    assert lines[1]["time"] <= lines[2]["time"]
    assert tracker.tracker is None  # closed by end_training


def test_resolve_trackers_maps_jsonl_and_dedupes(tmp_path: Path) -> None:
    (resolved,) = resolve_trackers(["jsonl", "jsonl"], tmp_path)
    assert isinstance(resolved, JsonlTracker) and resolved.path == tmp_path / "metrics.jsonl"
    assert resolve_trackers([], tmp_path) == []


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_resolve_trackers_passes_installed_names_through(tmp_path: Path) -> None:
    assert resolve_trackers(["tensorboard"], tmp_path) == ["tensorboard"]


def test_unknown_tracker_name(tmp_path: Path) -> None:
    with pytest.raises(
        DistillError, match=r"unknown tracker 'tensorbord'; use one or more of: jsonl, tensorboard, wandb"
    ):
        resolve_trackers(["jsonl", "tensorbord"], tmp_path)


def test_missing_tracker_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = ("distill_no_such_package",)
    monkeypatch.setattr(tracking, "PACKAGES", {"tensorboard": absent, "wandb": absent})
    with pytest.raises(DistillError, match=r"tracker 'wandb' needs the wandb package; run `pip install wandb`"):
        resolve_trackers(["wandb"], tmp_path)
    with pytest.raises(DistillError, match=r"run `pip install tensorboard`"):
        resolve_trackers(["tensorboard"], tmp_path)


def test_a_resumed_run_does_not_repeat_its_config_line(tmp_path: Path) -> None:
    """A new run writes its config line, even the file's last one again; a resumed segment only a different one."""
    from conftest import reset_accelerate
    from distill.config import build_config
    from distill.tracking import tracker_config

    def segment(config: dict, step: int, resumed: bool = False) -> None:
        accelerator = Accelerator(cpu=True, log_with=[JsonlTracker(tmp_path, resumed)], project_dir=tmp_path)
        accelerator.init_trackers("x", config=config)
        accelerator.log({"loss": 0.5}, step=step)
        accelerator.end_training()
        reset_accelerate()

    started = tracker_config(build_config({"output_dir": str(tmp_path)}))
    resumed = tracker_config(build_config({"output_dir": str(tmp_path), "resume_from_checkpoint": "latest"}))
    assert resumed == started and "resume_from_checkpoint" not in started  # how a segment starts is no setting
    segment(started, 1)
    segment(resumed, 2, resumed=True)
    segment({**started, "phase1_lr": 0.5}, 1, resumed=True)  # resumed with another setting: on record
    segment(started, 1)  # the same command run again in the same folder: a new run, not a third segment
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("config" in line, line.get("step")) for line in lines] == [
        (True, None),
        (False, 1),
        (False, 2),
        (True, None),
        (False, 1),
        (True, None),
        (False, 1),
    ]
    assert lines[3]["config"]["phase1_lr"] == 0.5 and lines[5]["config"] == started


def test_any_tracker_accelerate_supports_is_accepted_once_its_package_is_there(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mlflow" else real(name, *a))
    assert resolve_trackers(["mlflow"], tmp_path) == ["mlflow"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aim" else real(name, *a))
    with pytest.raises(DistillError, match=r"tracker 'aim' needs the aim package; run `pip install aim`"):
        resolve_trackers(["aim"], tmp_path)
