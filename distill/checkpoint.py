"""Checkpoints: everything needed to continue a run exactly, written whole or not at all, loaded without pickle.

A checkpoint is `<output_dir>/checkpoints/checkpoint-<phase>-<step>/` holding
- Accelerate's `save_state`: student + projection (safetensors), optimizer, scheduler, gradient scaler;
- `rng_state_<rank>.safetensors`: each process's torch (and CUDA) generator states;
- `phase_state.safetensors` (when the phase has any): tensors the loop carries between steps, the same on
  every rank, such as phase 2's cross-batch passage memory;
- `state.json`: phase, epoch, batches done in the epoch, optimizer steps, the losses and results so far,
  and the settings of the run that decide what it trains (train.run_identity), checked on resume.
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
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from distill.errors import DistillError

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
    results: dict = field(default_factory=dict)  # evaluations and finished phases' figures so far
    identity: dict = field(default_factory=dict)

    def start_phase(self, phase: str) -> None:
        """Reset the per-phase counters; results and identity carry over."""
        self.phase, self.epoch, self.batches_done, self.optimizer_steps = phase, 0, 0, 0
        self.train_samples, self.train_seconds, self.accelerator_step, self.losses = 0, 0.0, 0, []
        self.evaluation_pending = False

    def global_step(self) -> int:
        """Optimizer steps since the run began, over the phases (finished ones are in `results`): never goes back."""
        finished = self.results.get("phases", {})
        earlier = PHASES[: PHASES.index(self.phase)]
        return self.optimizer_steps + sum(finished[p]["optimizer_steps"] for p in earlier if p in finished)

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        return cls(**json.loads(text))


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def _order(path: Path) -> tuple[int, int]:
    match = NAME.match(path.name)
    assert match is not None
    return PHASES.index(match.group(1)), int(match.group(2))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (with their state file), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=_order)


def find_checkpoint(output_dir: str | os.PathLike, spec: str) -> Path | None:
    """`latest` -> the newest complete checkpoint of this output_dir, or None; otherwise the given folder."""
    if spec == "latest":
        found = list_checkpoints(checkpoint_root(output_dir))
        return found[-1] if found else None
    path = Path(spec).expanduser()
    if not (path / STATE_FILE).is_file():
        raise DistillError(
            f"resume_from_checkpoint: {spec!r} is not a checkpoint folder (no {STATE_FILE} inside); pass "
            "'latest' or a folder like <output_dir>/checkpoints/checkpoint-phase1-0000100"
        )
    return path


def read_state(path: Path, identity: dict) -> TrainingState:
    """The checkpoint's state, after checking it was made with the same settings (`identity`).

    Only the settings the checkpoint recorded are compared (checkpoints written before session 24 recorded
    teacher, student and mode only). YAML/JSON round trips turn tuples into lists, so values are compared
    after the same round trip.
    """
    state = TrainingState.from_json((path / STATE_FILE).read_text())
    identity = json.loads(json.dumps(identity))
    different = {
        k: (state.identity[k], v) for k, v in identity.items() if k in state.identity and state.identity[k] != v
    }
    if different:
        described = ", ".join(f"{k}: checkpoint has {old!r}, this run {new!r}" for k, (old, new) in different.items())
        if "global_batch_size" in different:
            described += " (the global batch is --batch_size times the number of processes)"
        raise DistillError(
            f"checkpoint {path} comes from a different run ({described}); resume with the same settings "
            "or start in a fresh --output_dir"
        )
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
    staging = root / f".tmp-{final.name}"
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
        (staging / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))  # last: marks it complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        for old in list_checkpoints(root)[:-limit] if limit > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, torch.Tensor]:
    """Collective: restore the prepared model, optimizer, scheduler and scaler, and this process's RNG.

    Returns the checkpoint's `extra` tensors (on the CPU; empty if it has none).
    """
    accelerator.load_state(str(path))
    rng_file = path / f"rng_state_{accelerator.process_index}.safetensors"
    if rng_file.is_file():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([rng[k] for k in sorted(rng) if k.startswith("cuda")])
    extra_file = path / EXTRA_FILE
    return load_file(str(extra_file)) if extra_file.is_file() else {}
