"""A reranker as phase 2's teacher: a cross-encoder that reads a query and a passage together and scores the pair.

It is a source of scores rather than of vectors, behind the same interface (`Source`) and the same content-keyed
cache: each (query, passage) pair is one "text" of role "pair" (`pair_text`), and its score is a 1-wide row. So the
scores are sharded over the processes, written in resumable blocks, and reused per pair by a later run, as the
teacher's vectors are.

Two kinds, chosen by --reranker_base_url:

- `CrossEncoderTeacher`: a sentence-transformers `CrossEncoder` loaded here (a Hub name or a folder), its raw
  logits, each process on its share of the pairs;
- `RerankEndpoint` (distill/teachers/rerank_endpoint.py): a served reranker answering `POST <url>/rerank`.

The phase-2 losses (distill/losses.py: `reranker_loss`) read the scores of each query's candidates: its positive,
then its negatives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate.logging import get_logger

from distill.errors import DistillError
from distill.hub import resolve_model
from distill.store import Role
from distill.teachers.local import free_device_memory, weights_identity
from distill.teachers.sources import Encoder, TeacherContext

if TYPE_CHECKING:
    from accelerate import Accelerator
    from sentence_transformers.cross_encoder import CrossEncoder

    from distill.stages.cost import CostTexts, ModelCost, TeacherCosts

logger = get_logger(__name__)


def pair_text(query: str, passage: str) -> str:
    """One pair as the cache keys it: a JSON array, which no two different pairs share."""
    return json.dumps([query, passage], ensure_ascii=False)


def split_pair(text: str) -> tuple[str, str]:
    query, passage = json.loads(text)
    return query, passage


def candidate_pairs(queries: Sequence[str], passages: Sequence[str], rows: np.ndarray) -> list[str]:
    """Each query's pairs with its candidates, `passages[rows[i, j]]`, query by query: (queries x candidates)."""
    return [pair_text(queries[i], passages[j]) for i in range(len(queries)) for j in rows[i].tolist()]


def check_scores(name: str) -> object:
    """A check of a block of scores: one finite number per pair."""

    def check(scores: np.ndarray, rows: np.ndarray) -> None:
        if scores.ndim != 2 or scores.shape[1] != 1:
            raise DistillError(
                f"reranker {name} gives {scores.shape[-1]} scores per pair; expected one (a CrossEncoder with "
                "num_labels=1, as rerankers are); pass a reranker as --reranker_model"
            )
        bad = np.flatnonzero(~np.isfinite(scores).all(axis=1))
        if len(bad):
            raise DistillError(
                f"reranker {name} scored {len(bad)} pairs as NaN or inf (the first is pair {int(rows[bad[0]])}); "
                "check the model, or run it in float32"
            )

    return check


class CrossEncoderTeacher:
    """A sentence-transformers CrossEncoder loaded here, scoring each process's share of the pairs."""

    revision: str | None = None
    cost_note = "a reranker scores pairs: its speed does not compare with an embedding model's"

    def __init__(self, name: str, context: TeacherContext):
        self.name = name
        self.path_ = resolve_model(name)
        self.context = context
        self.model: CrossEncoder | None = None
        self.loaded, self.load_seconds = False, 0.0

    @property
    def path(self) -> str:
        return self.path_

    @property
    def max_seq_length(self) -> int | None:
        return self.model.max_length if self.model is not None else None

    def prompt(self, role: Role) -> str:
        return ""

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        return "cross-encoder:" + weights_identity(accelerator, self.path_, None, memo)

    def key_fields(self, role: Role) -> dict[str, object]:
        return {"scores": "logits", "compute_dtype": "float32"}  # loaded as saved: float32 on every device

    def load(self, accelerator: Accelerator) -> CrossEncoder:
        if self.model is None:
            started = time.perf_counter()
            from sentence_transformers.cross_encoder import CrossEncoder

            with accelerator.local_main_process_first():  # one download per machine
                self.model = CrossEncoder(
                    self.path_, device=str(accelerator.device), trust_remote_code=self.context.trust_remote_code
                ).eval()
            self.loaded = True
            self.load_seconds += time.perf_counter() - started
        return self.model

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        """The raw logits of the pairs at each batch's indices (no sigmoid: the losses read margins and softmaxes)."""
        model = self.load(accelerator)
        lengths = np.fromiter((len(text) for text in texts), dtype=np.int64, count=len(texts))

        @torch.inference_mode()
        def score(indices: list[int]) -> torch.Tensor:
            pairs = [split_pair(texts[i]) for i in indices]
            logits = model.predict(
                pairs,
                batch_size=len(pairs),
                activation_fn=torch.nn.Identity(),
                convert_to_tensor=True,
                show_progress_bar=False,
            )
            return logits.float().reshape(len(pairs), -1).cpu()

        return Encoder(
            lengths=lengths,
            encode=score,
            too_long_hint="lower --teacher_batch_size or run the reranker on a device with more memory",
            check=check_scores(self.name),  # type: ignore[arg-type]
        )

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        return None

    def release(self) -> None:
        self.model = None
        free_device_memory()
