"""The results of a run as a typed object: what `results.json` holds, what checkpoints carry, what the report shows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

ROWS = ("teacher", "student_before", "after_phase1", "student_after")  # the evaluated model states, in order

Metrics = dict[str, Any]  # "ndcg@10": 0.56, ..., "matryoshka_ndcg@10": {"96": 0.54, ...}


@dataclass
class PhaseFigures:
    """What one phase cost and how its loss went."""

    teacher_seconds: float  # encoding its texts with the teacher (0 on a warm cache)
    train_seconds: float
    train_samples: int
    optimizer_steps: int
    samples_per_second: float
    final_loss: float | None
    losses: list[float]
    examples: int | None = None  # the texts or pairs the phase trains on (each epoch)
    terms: dict[str, float] | None = None  # the loss terms that trained it, by name, with their weights
    negatives: dict[str, Any] | None = None  # phase 2: hard negatives per query, from the data or mined
    added: dict[str, float] | None = None  # what it changed of the evaluation's figures (nDCG@10, STS, ...)


def negatives_phrase(stats: dict) -> str:
    """How a phase's record names its hard negatives ("1 hard negative per query (mined by the teacher)"), as the
    report and the card say it; "" for in-batch negatives alone."""
    negatives = stats.get("negatives") or {}
    count = negatives.get("per_query")
    return f"{count} hard negative{'s' if count > 1 else ''} per query ({negatives['from']})" if count else ""


@dataclass
class RunResults:
    """Every figure of a run. Rows left None (no evaluation set, one phase only) are left out of `results.json`."""

    mode: str = ""  # "projection" or "matryoshka"
    world_size: int = 1
    heap_allocator: str = ""
    mixed_precision: str = ""  # what the student trained in: "no", "bf16" or "fp16" (`auto` resolved)
    capped: dict[str, int] | None = None  # the caps the data reached (--max_samples_phase1/2 -> the cap)
    reranker: dict[str, Any] | None = None  # phase 2's reranker: its name, the pairs it scored, its seconds, the loss
    attention: dict[str, Any] | None = None  # the student's attention in training: {"unpadded", "reason"}
    evaluations: dict[str, list[Metrics]] = field(default_factory=dict)  # --eval_steps: per phase, per step
    teacher: Metrics | None = None
    teachers: dict[str, Metrics] | None = None  # a combined teacher's members, by name
    student_before: Metrics | None = None
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    after_phase1: Metrics | None = None  # both phases ran: the student between them
    student_after: Metrics | None = None
    teacher_loaded: bool | None = None
    teacher_load_seconds: float | None = None
    teacher_seconds_evaluation: float | None = None
    exported: dict[str, str] | None = None  # folder name -> path
    hub: dict[str, str] | None = None  # --push_to_hub: {"repo", "url"} or {"repo", "error"}
    efficiency: dict[str, Any] | None = None  # efficiency.Efficiency.to_dict(): the teacher's and student's costs
    config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`results.json`, checkpoints)."""
        return {k: v for k, v in asdict(self).items() if v is not None and (k != "evaluations" or v)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunResults:
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in values.items() if k in known}
        kept["phases"] = {name: PhaseFigures(**figures) for name, figures in kept.get("phases", {}).items()}
        return cls(**kept)

    def evaluated_rows(self) -> dict[str, Metrics]:
        """The evaluation rows present, in ROWS order."""
        return {row: getattr(self, row) for row in ROWS if getattr(self, row) is not None}

    def tracked_scalars(self) -> dict[str, float]:
        """The evaluation rows as flat tracker scalars: `student_after/ndcg@10`, `teacher/matryoshka_ndcg@10/8`."""
        scalars: dict[str, float] = {}
        for row, metrics in self.evaluated_rows().items():
            for name, value in metrics.items():
                if isinstance(value, dict):
                    scalars |= {f"{row}/{name}/{k}": v for k, v in value.items() if isinstance(v, (int, float))}
                elif isinstance(value, (int, float)):
                    scalars[f"{row}/{name}"] = value
        return scalars
