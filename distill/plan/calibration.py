"""This CPU's rates, timed on the run's own work: a CPU has no spec sheet that says what a transformer reaches on it.

A matmul's rate misses what a transformer's forward and backward reach on a given processor: the demo ran at 0.55x
of the rate a matmul timing predicted on a 2-core Xeon and at 0.85x on a 2-core EPYC. So the planner times the work
itself, on random weights built from the models' configs (no weights are loaded):

- the student: TIMED_STEPS optimizer steps of each phase it trains, after one warm-up, at the run's batch size and
  the phase's mean lengths (phase 2 forwards its queries, and its passages with any mined negatives): forward,
  backward, gradient clipping and AdamW's update over every parameter, in bf16 autocast where the run trains so;
- the teacher: TIMED_STEPS batches of the run's teacher batch at its texts' mean length, in inference mode, through
  TEACHER_LAYERS of its layers. The layers are alike, so a layer's rate is the model's, and a 7B teacher is timed
  without building it whole.

A rate is the work's FLOPs (the planner's own count, distill/plan/figures.py) over its seconds. Each is kept in
`cpu-rates.json` in the teacher cache folder (`--teacher_cache_dir`, which machines may share) under the processor's
model name, torch's threads and version and the work's shape, and read back by the next plan of the same work on the
same kind of processor (`--recalibrate` times it again).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.config.schema import Config
from distill.plan.figures import Models, TextList

TIMED_STEPS = 3
TEACHER_LAYERS = 2
TEACHER_BATCH_FLOPS = 3e10  # at most this much work in one timed teacher batch: fewer texts beyond it
STUDENT_STEP_FLOPS = 3e11  # and in one timed student step: a smaller batch beyond it
LARGE_VOCABULARY = 100_000_000  # embedding parameters beyond which the teacher is timed with a small vocabulary
SMALL_VOCABULARY = 32_000


@dataclass(frozen=True)
class Rates:
    """What calibration found: the teacher's FLOP/s, the student's per phase, and one line on what was timed."""

    teacher: float | None  # None: no teacher runs here (an endpoint, a vectors file)
    student: dict[str, float]  # phase -> FLOP/s; empty for a student with no layers to time (a static table)
    line: str


KEPT = "cpu-rates.json"


def kept_path(config: Config) -> Path:
    return Path(config.output.teacher_cache_dir).expanduser() / KEPT


def processor() -> str:
    """This machine's processor model, as the run's cost stage names it."""
    from distill.stages.cost import cpu_model

    return cpu_model() or "unknown processor"


def calibrate(config: Config, models: Models, measured: list[TextList], again: bool = False) -> Rates:
    """The rates of the run `config` describes on this CPU: kept ones for the same work, else timed now."""
    import torch

    path = kept_path(config)
    kept = _read(path)
    machine = {"processor": processor(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    where = f"{machine['processor']}, {machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"
    timed: list[str] = []
    read: list[str] = []
    teacher_rate = None
    batch = config.performance.teacher_batch_size or config.training.batch_size
    teacher = _teacher_work(config, models, measured, batch)
    if teacher is not None:
        teacher_rate, fresh = _rate(kept, machine, teacher, again)
        (timed if fresh else read).append(
            f"{TIMED_STEPS} teacher batches of {teacher['texts']} x {teacher['length']} tokens through "
            f"{teacher['layers']} of its layers"
        )
    student: dict[str, float] = {}
    for phase, work in _student_work(config, models, measured).items():
        student[phase], fresh = _rate(kept, machine, work, again)
        shapes = " + ".join(f"{texts} x {length}" for texts, length in work["shapes"])
        precision = " in bf16" if work.get("precision") == "bf16" else ""
        (timed if fresh else read).append(f"{TIMED_STEPS} {phase} steps of the student at {shapes} tokens{precision}")
    busy = _busy() if timed else None
    if timed and busy is None:
        _write(path, kept)
    parts = [f"timed now on this CPU ({where}): " + "; ".join(timed)] if timed else []
    if busy:
        parts.append(f"not kept: other work ran ({busy}) and may have slowed them; plan again on an idle CPU")
    if read:
        parts.append(f"kept for this CPU ({where}) in {path}: " + "; ".join(read))
    return Rates(teacher_rate, student, ". ".join(parts))


def _busy() -> str | None:
    """Whether other work holds this CPU's cores, so that rates timed now come out slow: the 1-minute load average at
    half the cores or more (None: idle enough, or no load average on this platform). Timed beside a training run on 2
    cores, the rates come out up to 3x too slow; such rates serve the plan that timed them and are not kept."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load >= max(1.0, cores / 2) else None


def _teacher_work(config: Config, models: Models, measured: list[TextList], batch: int) -> dict[str, Any] | None:
    """The teacher's timed batch, or None where no teacher model runs here."""
    encoders = [shape for shape in models.teachers if shape.layers]
    if not encoders:
        return None
    texts = [t for t in measured if t.count]
    tokens = sum(t.count * t.teacher_tokens for t in texts) / max(sum(t.count for t in texts), 1)
    length = max(int(round(tokens)), 1)
    shape = encoders[0]
    per_text = 2 * shape.dense_parameters / shape.layers * TEACHER_LAYERS * length
    return {
        "kind": "teacher",
        "model": _model_key(models.teacher_folder),
        "layers": min(TEACHER_LAYERS, shape.layers),
        "texts": max(1, min(batch, int(TEACHER_BATCH_FLOPS / max(per_text, 1.0)))),
        "length": length,
        "folder": str(models.teacher_folder),
        "trust": config.student.trust_remote_code,
    }


def _student_work(config: Config, models: Models, measured: list[TextList]) -> dict[str, dict[str, Any]]:
    """Each trained phase's timed step: its (texts, length) forwards."""
    from distill.precision import resolve_precision

    student = models.student
    if not student.layers:
        return {}
    # the run's precision on this CPU (`auto` resolved here, as the run resolves it); the accelerate config's is not
    # read, so a run left to it is timed in float32
    bf16 = resolve_precision(config.performance.mixed_precision) == "bf16"
    lists = {t.name: t for t in measured}
    batch, mined = config.training.batch_size, config.data.mine_hard_negatives
    phases: dict[str, list[tuple[int, TextList | None]]] = {
        "phase1": [(batch, lists.get("phase1 texts"))],
        "phase2": [(batch, lists.get("phase2 queries")), (batch * (1 + mined), lists.get("phase2 passages"))],
    }
    work: dict[str, dict[str, Any]] = {}
    for phase, forwards in phases.items():
        shapes = [(n, max(int(round(t.student_tokens)), 1)) for n, t in forwards if t is not None and t.count]
        if not shapes:
            continue
        flops = sum(3 * student.forward_flops(n, length, length**2) for n, length in shapes)
        if flops > STUDENT_STEP_FLOPS:  # a step too long to time thrice: the same lengths, fewer texts
            shapes = [(max(1, int(n * STUDENT_STEP_FLOPS / flops)), length) for n, length in shapes]
        work[phase] = {
            "kind": "student",
            "model": _model_key(models.student_folder),
            "layers": student.layers,
            "shapes": shapes,
            "checkpointing": config.performance.gradient_checkpointing,
            "folder": str(models.student_folder),
            "trust": config.student.trust_remote_code,
        }
        if bf16:  # a key of its own, so that a float32 rate kept for the same shapes is not read for it
            work[phase]["precision"] = "bf16"
    return work


def _rate(kept: dict[str, Any], machine: dict[str, Any], work: dict[str, Any], again: bool) -> tuple[float, bool]:
    """(the work's FLOP/s, whether it was timed now): the rate kept for this `machine` (processor, threads, torch)
    and work, else timed."""
    shape = {k: v for k, v in work.items() if k not in ("folder", "trust")}
    key = json.dumps({**machine, **shape}, sort_keys=True)
    if not again and isinstance(kept.get(key), dict) and kept[key].get("flops_per_second", 0) > 0:
        return float(kept[key]["flops_per_second"]), False
    rate = time_teacher(work) if work["kind"] == "teacher" else time_student(work)
    kept[key] = {"flops_per_second": rate, "timed_at": time.strftime("%Y-%m-%d %H:%M")}
    return rate, True


def _build(work: dict[str, Any], small_vocabulary: bool) -> tuple[Any, Any, int]:
    """(the model on random weights, its shape, the vocabulary its ids are drawn from)."""
    import torch
    from transformers import AutoConfig, AutoModel

    from distill.hub import model_shape

    settings = AutoConfig.from_pretrained(work["folder"], trust_remote_code=work["trust"])
    settings.num_hidden_layers = work["layers"]
    vocabulary = int(getattr(settings, "vocab_size", 0) or SMALL_VOCABULARY)
    if small_vocabulary and vocabulary * int(settings.hidden_size) > LARGE_VOCABULARY:
        # the lookup costs the same in any table; only building a 7B teacher's table would cost
        vocabulary = settings.vocab_size = SMALL_VOCABULARY
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if (getattr(settings, name, None) or 0) >= vocabulary:
                setattr(settings, name, None)
    with torch.random.fork_rng():  # the run's seeded generators are not the planner's to move
        torch.manual_seed(0)
        model = AutoModel.from_config(settings, trust_remote_code=work["trust"]).float()
    return model, model_shape(Path(work["folder"]), work["layers"], work["trust"]), vocabulary


def _ids(texts: int, length: int, vocabulary: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(1000, vocabulary - 1), vocabulary, (texts, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def time_teacher(work: dict[str, Any]) -> float:
    import torch

    model, shape, vocabulary = _build(work, small_vocabulary=True)
    model.eval()
    batch = _ids(work["texts"], work["length"], vocabulary)
    with torch.inference_mode():
        model(**batch)  # the warm-up: the allocator's first blocks, the kernels' first choice
        started = time.perf_counter()
        for _ in range(TIMED_STEPS):
            model(**batch)
    seconds = (time.perf_counter() - started) / TIMED_STEPS
    return shape.forward_flops(work["texts"], work["length"], work["length"] ** 2) / seconds


def time_student(work: dict[str, Any]) -> float:
    import torch

    model, shape, vocabulary = _build(work, small_vocabulary=False)
    model.train()
    if work["checkpointing"]:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batches = [_ids(texts, length, vocabulary) for texts, length in work["shapes"]]

    def step() -> None:
        loss = 0.0
        for batch in batches:  # mean pooling, normalised, an in-batch similarity: a loss the shape of the run's
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=work.get("precision") == "bf16"):
                hidden = model(**batch).last_hidden_state.mean(dim=1).float()
            pooled = torch.nn.functional.normalize(hidden, dim=-1)
            loss = loss + (pooled @ pooled.T).square().mean()
        loss.backward()  # type: ignore[attr-defined]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with torch.random.fork_rng():  # dropout draws from the global generator
        step()
        started = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step()
        seconds = (time.perf_counter() - started) / TIMED_STEPS
    passes = 4 if work["checkpointing"] else 3
    return sum(passes * shape.forward_flops(n, length, length**2) for n, length in work["shapes"]) / seconds


def _model_key(folder: Path) -> str:
    """The model's architecture, by its config file's bytes: a rate holds for any weights of one shape."""
    config = Path(folder) / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else str(folder)


def _read(path: Path) -> dict[str, Any]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: timed again and written whole
    return kept if isinstance(kept, dict) else {}


def _write(path: Path, kept: dict[str, Any]) -> None:
    from distill.errors import DistillError
    from distill.files import write_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda staging: staging.write_text(json.dumps(kept, indent=1, sort_keys=True)))
    except (OSError, DistillError):
        pass  # a read-only cache folder: the rates serve this plan and are timed again next time
