"""Checkpoints: everything needed to continue a run exactly, written whole or not at all, loaded without pickle.

A checkpoint is `<output_dir>/checkpoints/checkpoint-<phase>-<step>/` holding
- Accelerate's `save_state`: student + projection (safetensors), optimizer, scheduler, gradient scaler;
- `rng_state_<rank>.safetensors`: each process's torch (and CUDA) generator states, set again once a resumed
  epoch's first batch is fetched (distill/loop.py's `continued`), so dropout goes on as in the run never stopped;
- `phase_state.safetensors` (when the phase has any): tensors the loop carries between steps, the same on
  every rank, such as phase 2's cross-batch passage memory;
- `state.json`: phase, epoch, batches done in the epoch, optimizer steps, the losses and results so far,
  the settings of the run that decide what it trains (`run_identity`) and each data source's stamp, checked
  on resume, and the save's sequence number;
- `contents.json`: each file's size and checksum (distill/files.py's `seal`), checked before a checkpoint
  is resumed or counted as `latest`, so a save cut short by a crash is skipped, never loaded.
`latest` is the checkpoint saved last (by sequence), and the rotation keeps the last saved: a run resumed from
an older checkpoint makes its own line the newest, and the abandoned newer ones are rotated out first.
Data order needs no saved state: the batch sampler is a pure function of (seed, epoch), and resuming
mid-epoch skips the batches already done (`skip_first_batches`).

Accelerate's own RNG file (`random_states_<rank>.pkl`) is read with `weights_only=True` (accelerate 1.15);
`register_for_checkpointing` would store pickles loaded with `weights_only=False`, so distill keeps its own
state in JSON and safetensors instead and never loads a pickle.
Checkpoints are named by phase and step rather than by Accelerate's automatic counter, which
`load_state` does not restore (accelerate issue 1601), so saving after a resume never collides.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from safetensors.torch import load_file, save_file

from distill.config.flags import LEAVES
from distill.config.schema import Config
from distill.distributed import elastic_restart, main_decides
from distill.errors import DistillError
from distill.files import check, put_in_place, seal
from distill.results import RunResults

logger = get_logger(__name__)
said = logging.getLogger(__name__)  # for what only the main process does (finding `latest`, rotating)

PHASES = ("phase1", "phase2")
NAME = re.compile(r"^checkpoint-(phase[12])-(\d+)$")
STATE_FILE = "state.json"
EXTRA_FILE = "phase_state.safetensors"


@dataclass
class TrainingState:
    """Where the run is; saved as JSON in every checkpoint."""

    phase: str = "phase1"
    epoch: int = 0
    batches_done: int = 0  # micro-batches finished in `epoch`
    optimizer_steps: int = 0
    train_samples: int = 0
    train_seconds: float = 0.0
    accelerator_step: int = 0  # Accelerate's micro-batch counter, which sets gradient-accumulation windows
    losses: list[float] = field(default_factory=list)
    evaluation_pending: bool = False  # stopped at an --eval_steps step before evaluating it: the resume does first
    results: RunResults = field(default_factory=RunResults)  # evaluations and finished phases' figures so far
    identity: dict = field(default_factory=dict)
    saved: int = 0  # this save's sequence number in its output_dir: what `latest` and the rotation go by

    def start_phase(self, phase: str) -> None:
        """Reset the per-phase counters; results and identity carry over."""
        self.phase, self.epoch, self.batches_done, self.optimizer_steps = phase, 0, 0, 0
        self.train_samples, self.train_seconds, self.accelerator_step, self.losses = 0, 0.0, 0, []
        self.evaluation_pending = False

    def global_step(self) -> int:
        """Optimizer steps since the run began, over the phases (finished ones are in `results`): never goes back."""
        finished = self.results.phases
        earlier = PHASES[: PHASES.index(self.phase)]
        return self.optimizer_steps + sum(finished[p].optimizer_steps for p in earlier if p in finished)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        values = json.loads(text)
        return cls(**{**values, "results": RunResults.from_dict(values.get("results") or {})})


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def _order(path: Path) -> tuple[int, int, int]:
    """Save order: the sequence number, then (for checkpoints saved before it was kept) phase and step."""
    match = NAME.match(path.name)
    assert match is not None
    try:
        saved = int(json.loads((path / STATE_FILE).read_text()).get("saved", 0))
    except (OSError, ValueError, AttributeError):
        saved = 0
    return saved, PHASES.index(match.group(1)), int(match.group(2))


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint folder `path` (None: it is whole)."""
    if not (path / STATE_FILE).is_file():
        return f"incomplete (no {STATE_FILE})"
    return check(path, unsealed_ok=True)  # a checkpoint of an earlier distill has no contents.json


def checkpoint_folders(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if NAME.match(p.name) and p.is_dir()] if root.is_dir() else []


def list_checkpoints(root: Path) -> list[Path]:
    """Whole checkpoints (every file at its size and checksum), in save order, oldest first."""
    return sorted((p for p in checkpoint_folders(root) if damage(p) is None), key=_order)


def find_checkpoint(output_dir: str | os.PathLike, spec: str) -> Path | None:
    """`latest` -> the checkpoint of this output_dir saved last that is whole, or None (a damaged one is said and
    skipped); otherwise the given folder, which must be whole."""
    if spec == "latest":
        root = checkpoint_root(output_dir)
        found = list_checkpoints(root)
        newer = [p for p in checkpoint_folders(root) if p not in found and (not found or _order(p) > _order(found[-1]))]
        for path in newer:
            said.warning(f"checkpoint {path} is {damage(path)}; skipping it")
        return found[-1] if found else None
    path = Path(spec).expanduser()
    if not (path / STATE_FILE).is_file():
        raise DistillError(
            f"resume_from_checkpoint: {spec!r} is not a checkpoint folder (no {STATE_FILE} inside); pass "
            "'latest' or a folder like <output_dir>/checkpoints/checkpoint-phase1-0000100"
        )
    problem = damage(path)
    if problem is not None:
        raise DistillError(
            f"resume_from_checkpoint: {spec!r} is {problem}; pass 'latest' (the last whole checkpoint) or an "
            "earlier checkpoint folder"
        )
    return path


def read_state(path: Path, identity: dict, say: Callable[[str], None] = said.warning) -> TrainingState:
    """The checkpoint's state, after checking it was made with the same settings (`identity`).

    Only the settings the checkpoint recorded are compared (older checkpoints record teacher, student and mode
    only). YAML/JSON round trips turn tuples into lists, so values are compared
    after the same round trip. A checkpoint saved in phase 1 resumes under other `PHASE2_SETTINGS`: phase 2 starts
    afresh from it, so one phase-1 run serves several phase-2 trials. The state then records the new values, so
    phase 2's own checkpoints resume only under them; `say` tells the user which changed.
    """
    state = TrainingState.from_json((path / STATE_FILE).read_text())
    identity = json.loads(json.dumps(identity))
    recorded = {
        k: (state.identity[k], v) for k, v in identity.items() if k in state.identity and state.identity[k] != v
    }
    free = PHASE2_SETTINGS if state.phase == PHASES[0] else set()
    different = {k: values for k, values in recorded.items() if k not in free}
    if different:
        described = ", ".join(f"{k}: checkpoint has {old!r}, this run {new!r}" for k, (old, new) in different.items())
        if "global_batch_size" in different:
            described += " (the global batch is --batch_size times the number of processes)"
        raise DistillError(
            f"checkpoint {path} comes from a different run ({described}); resume with the same settings "
            "or start in a fresh --output_dir"
        )
    if recorded:
        changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in recorded.items())
        say(f"checkpoint {path} is from phase 1; phase 2 trains with this run's settings ({changed})")
        state.identity.update({k: new for k, (_, new) in recorded.items()})
    return state


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | os.PathLike,
    state: TrainingState,
    limit: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Collective: every process calls it. Written to a temporary folder, then renamed; keeps the last `limit`.

    `extra`: tensors that are the same on every rank (the main process writes them), given back by `load_checkpoint`.
    """
    root = checkpoint_root(output_dir)
    final = root / f"checkpoint-{state.phase}-{state.optimizer_steps:07d}"
    staging = root / f".tmp-{final.name}"  # one name on every process; one run per output_dir (distill/report.py)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging), safe_serialization=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(staging / f"rng_state_{accelerator.process_index}.safetensors"))
    if extra and accelerator.is_main_process:
        save_file({k: v.detach().cpu().contiguous() for k, v in extra.items()}, str(staging / EXTRA_FILE))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.saved = max((_order(p)[0] for p in checkpoint_folders(root)), default=0) + 1
        (staging / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        seal(staging)  # every rank's files are on disk (the barrier): synced and listed with their checksums
        put_in_place(staging, final, replace_whole=True)  # a checkpoint abandoned at this step is replaced
        rotate(root, limit)
    accelerator.wait_for_everyone()
    return final


def rotate(root: Path, limit: int) -> None:
    """Keep the last `limit` checkpoints saved (all with 0), and remove damaged ones: no run can resume them."""
    kept = list_checkpoints(root)
    for old in kept[:-limit] if limit > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for damaged in set(checkpoint_folders(root)) - set(kept):
        said.warning(f"removing checkpoint {damaged}: {damage(damaged)}")
        shutil.rmtree(damaged, ignore_errors=True)


@dataclass
class CheckpointSettings:
    output_dir: Path
    every: int  # optimizer steps between checkpoints; 0 disables periodic checkpoints
    limit: int  # checkpoints kept
    at_end: bool = False  # save one when the phase's training ends: the run's last, so a stop after it loses nothing
    saved_at_end: Path | None = None  # where that one is (or the checkpoint a resume found already at the end)


def end_checkpoint(
    state: TrainingState,
    checkpoints: CheckpointSettings,
    resume: Path | None,
    steps_before: int,
    checkpoint: Callable[[], Path],
) -> Path | None:
    """With `checkpoints.at_end`, the checkpoint of the trained phase: saved now, unless the last step saved one, or
    the run resumed from one saved here already. Evaluation, the cost and the export come after it; a SIGTERM or a
    crash during them costs no training (distill/pipeline.py stops at the next stage with it)."""
    if not checkpoints.at_end:
        return None
    if resume is not None and state.optimizer_steps == steps_before:
        return resume
    if checkpoints.every and state.optimizer_steps % checkpoints.every == 0 and state.optimizer_steps > steps_before:
        return checkpoint_root(checkpoints.output_dir) / f"checkpoint-{state.phase}-{state.optimizer_steps:07d}"
    return checkpoint()


def load_checkpoint(accelerator: Accelerator, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Collective: restore the prepared model, optimizer, scheduler and scaler, and this process's RNG.

    Returns the checkpoint's `extra` tensors and this process's generator states (on the CPU; empty if none).
    """
    accelerator.load_state(str(path))
    rng_file = path / f"rng_state_{accelerator.process_index}.safetensors"
    rng = load_file(str(rng_file)) if rng_file.is_file() else {}
    set_rng(rng)
    extra_file = path / EXTRA_FILE
    return (load_file(str(extra_file)) if extra_file.is_file() else {}), rng


def set_rng(rng: dict[str, torch.Tensor]) -> None:
    """Put torch's generators (the CPU's, each CUDA device's) back to the states `save_checkpoint` kept."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and any(k.startswith("cuda") for k in rng):
        torch.cuda.set_rng_state_all([rng[k] for k in sorted(rng) if k.startswith("cuda")])


# What a checkpoint shares with the run that resumes it: what it trains on and how. A resumed run may change how
# fast, where and how precisely it computes (the performance section) and which phases it runs.
RESUME_SECTIONS = ("model", "data", "phase1", "phase2", "training", "losses")
RESUME_MAY_CHANGE = {"skip_phase1", "skip_phase2"}
# What only phase 2 reads: how it trains and what it ranks. The teacher mines the negatives before phase 1, but
# nothing phase 1 trains on or draws depends on them.
PHASE2_SETTINGS = {
    "phase2_epochs",
    "phase2_lr",
    "mine_hard_negatives",
    "temperature",
    "kl_weight",
    "kl_memory_steps",
    "matryoshka_full_teacher_similarity",
    "mnrl_weight",
    "mnrl_margin",
    "reranker_loss",
    "reranker_weight",
    "reranker_temperature",
}


def run_identity(config: Config, world: int) -> dict:
    """What a checkpoint must share with the run that resumes it.

    Every setting of the model, data and training that decides what is trained on and how: the data order
    is a function of (seed, epoch, global batch), a resumed epoch skips the batches already done, and the
    schedule is laid out from the epochs and batch counts, so a change in any of them would silently train
    on other samples or bend the schedule. The per-process batch counts as the global batch, so an
    elastic restart on another number of processes resumes when the global batch is the same.
    """
    identity = {
        leaf.flag: getattr(getattr(config, leaf.section), leaf.name)
        for leaf in LEAVES
        if leaf.section in RESUME_SECTIONS and leaf.flag not in RESUME_MAY_CHANGE and leaf.flag != "batch_size"
    }
    identity["global_batch_size"] = config.training.batch_size * world
    return identity


def resume_requested(config: Config) -> bool:
    """Whether this run continues an earlier one: by the flag, or as an elastic restart of the group."""
    return config.checkpoint.resume_from_checkpoint is not None or elastic_restart()


def resume_point(accelerator: Accelerator, config: Config) -> Path | None:
    """The checkpoint to continue from: the flag's, or the latest one after an elastic restart.

    Found by the main process and sent to the others, so every rank resumes from the same one (`latest` could
    change under a rank's feet, or differ between machines' views of a shared folder).
    """
    spec = config.checkpoint.resume_from_checkpoint
    if spec is None and resume_requested(config):
        spec = "latest"  # torchrun restarted the group after a failure: pick up where it stopped
    if not spec:
        return None
    found = main_decides(accelerator, lambda: find_checkpoint(config.output.output_dir, spec))
    return None if found is None else Path(found)


@dataclass
class Resume:
    """Where this run starts: afresh, or from an earlier run's checkpoint and the state saved in it.

    Phases that ended before the checkpoint are `finished`; the phase it was saved in continues from it
    (`checkpoint_for`, once); every later phase starts afresh.
    """

    state: TrainingState
    checkpoint: Path | None = None
    taken: bool = False  # the checkpoint's phase has been handed it

    @classmethod
    def find(cls, accelerator: Accelerator, config: Config) -> Resume:
        """A fresh state, or the state of the checkpoint `resume_point` finds (the same one on every rank)."""
        checkpoint = resume_point(accelerator, config)
        identity = run_identity(config, accelerator.num_processes)
        if checkpoint is None:
            return cls(TrainingState(identity=identity))
        state = read_state(checkpoint, identity, lambda message: logger.warning(message, main_process_only=True))
        logger.warning(
            f"resuming from {checkpoint} ({state.phase}, optimizer step {state.optimizer_steps})",
            main_process_only=True,
        )
        return cls(state, checkpoint)

    def started(self, capped: dict[str, int], reranker: dict | None) -> TrainingState:
        """The state the run goes on from, with what the data and teacher stages found: the caps the data reached
        (said in the log as well), and the reranker's figures."""
        self.state.results.capped = capped or None
        self.state.results.reranker = reranker
        return self.state

    def check_data(self, stamps: dict[str, str]) -> None:
        """Refuse to continue a checkpoint on data that changed since it was saved (a source's files edited, or a
        Hub dataset at another commit): the resumed epoch would skip into other rows. Sources are compared one by
        one, so a resume that skips a phase reads fewer of them. The stamps go into the next checkpoints."""
        kept = self.state.identity.get("data") or {}
        changed = sorted(source for source, stamp in stamps.items() if kept.get(source, stamp) != stamp)
        if self.checkpoint is not None and changed:
            raise DistillError(
                f"checkpoint {self.checkpoint} was trained on other data: {', '.join(changed)} changed since "
                "(its files' size or time, or the Hub's commit); resume with the data it was trained on, or "
                "start afresh in a new --output_dir"
            )
        self.state.identity["data"] = {**kept, **stamps}

    def finished(self, phase: str) -> bool:
        """Whether `phase` ended before the checkpoint (its figures are in the checkpoint's results)."""
        return self.checkpoint is not None and PHASES.index(phase) < PHASES.index(self.state.phase)

    def checkpoint_for(self, phase: str) -> Path | None:
        """The checkpoint `phase` continues from, the first time it is asked for; None for a phase that starts."""
        if self.checkpoint is None or self.taken or phase != self.state.phase:
            return None
        self.taken = True
        return self.checkpoint
