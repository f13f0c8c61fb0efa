"""Experiment trackers for `Accelerator(log_with=...)`: a dependency-free JSON-lines tracker, and name resolution.

Accelerate gates trackers on the main process itself: `init_trackers` and `log` run on the main process only,
so only there does `accelerator.trackers` (which `end_training` finishes) hold anything. The instance built by
`resolve_trackers` exists on every rank but opens no file until `start`, and its methods are wrapped in
accelerate's `on_main_process` as well, so a direct call on another rank does nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import IO, Any

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, on_main_process

from distill.config.flags import to_flat_dict
from distill.config.schema import Config
from distill.errors import DistillError

METRICS_FILE = "metrics.jsonl"
# Accelerate's trackers (accelerate.tracking.LOGGER_TYPE_TO_CLASS) and the packages each needs, any one of them;
# a name not listed needs the package of the same name.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX")}
ACCELERATE_TRACKERS = ("tensorboard", "wandb", *(n for n in LOGGER_TYPE_TO_CLASS if n not in ("tensorboard", "wandb")))
TRACKER_NAMES = ("jsonl", *ACCELERATE_TRACKERS)


class JsonlTracker(GeneralTracker):
    """Appends `<logging_dir>/metrics.jsonl`: `{"config": ...}` first, then `{"step", "time", "values"}` per log.

    The file is opened in append mode, so a resumed run adds to the same file. A new run writes its
    `{"config": ...}` line always, so a second run in the same folder starts visibly, even with the same settings; a
    resumed segment (`resumed`) only when it differs from the file's last one, so resuming does not repeat it. The
    step is the run's optimizer step: lines a resumed run logs again (those after its checkpoint) repeat a step.
    Every line is flushed, so a crash loses nothing already logged.
    """

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, logging_dir: str | os.PathLike, resumed: bool = False) -> None:
        super().__init__()
        self.path = Path(logging_dir) / METRICS_FILE
        self.resumed = resumed
        self._file: IO[str] | None = None

    @property
    def tracker(self) -> IO[str] | None:
        """The open metrics file (None before `start` and off the main process)."""
        return self._file

    @on_main_process
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in `finish`

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        if not self.resumed or json.loads(json.dumps(values, default=_to_json)) != self._last_config():  # as read back
            self._write({"config": values})

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, "time": time.time(), "values": values})

    @on_main_process
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _last_config(self) -> dict | None:
        """The config of the file's last `{"config": ...}` line, if any (a torn last line is skipped)."""
        last = None
        if self.path.is_file():
            with open(self.path, encoding="utf-8") as lines:
                for line in lines:
                    if line.startswith('{"config": '):
                        try:
                            last = json.loads(line)["config"]
                        except json.JSONDecodeError:
                            pass
        return last

    def _write(self, record: dict) -> None:
        if self._file is None:  # used without `Accelerator.init_trackers`
            self.start()
        assert self._file is not None  # opened by start()
        self._file.write(json.dumps(record, default=_to_json) + "\n")
        self._file.flush()


def _to_json(value: Any) -> Any:
    """Tensors and numpy scalars as numbers (`.item()`), anything else as its string."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):  # a tensor or array of more than one element
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def resolve_trackers(
    names: list[str], output_dir: str | os.PathLike, resumed: bool = False
) -> list[GeneralTracker | str]:
    """The Accelerator's `log_with` for tracker names from the config (`resumed`: the run continues an earlier one).

    "jsonl" becomes a `JsonlTracker` writing `<output_dir>/metrics.jsonl`; any of Accelerate's own trackers
    (tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio) passes through as its name
    once its package is known to be installed.

    Accelerate itself drops a named tracker whose package is missing with only a debug message, so the
    check is made here. "tensorboard" also needs the Accelerator's `project_dir` (or `logging_dir`) set.
    """
    resolved: list[GeneralTracker | str] = []
    for name in dict.fromkeys(names):  # a repeated name would log everything twice
        if name not in TRACKER_NAMES:
            raise DistillError(f"unknown tracker {name!r}; use one or more of: {', '.join(TRACKER_NAMES)}")
        if name == "jsonl":
            resolved.append(JsonlTracker(output_dir, resumed))
            continue
        if not any(importlib.util.find_spec(package) for package in PACKAGES.get(name, (name,))):
            raise DistillError(f"tracker {name!r} needs the {name} package; run `pip install {name}` or drop it")
        resolved.append(name)
    return resolved


def tracker_config(config: Config) -> dict:
    """The flat config with values every tracker accepts (TensorBoard's hparams take no None or lists).

    Without resume_from_checkpoint: how a segment of the run was started, not a setting of the experiment, so a
    resumed run logs the config it started with (and the JSON-lines tracker does not write it again).
    """
    flat = to_flat_dict(config)
    flat.pop("resume_from_checkpoint", None)
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}
