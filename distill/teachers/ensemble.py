"""Several teachers as one: `--teacher_model A,B --teacher_weights 0.3,0.7`.

The combined teacher's vector of a text is the weighted concatenation of its members' unit vectors,
sqrt(w_1)·v_1 ⊕ sqrt(w_2)·v_2 ⊕ ..., with the weights summing to 1: a unit vector whose cosine to another text's is
w_1·cos_1 + w_2·cos_2 + ..., the weighted mean of the members' similarities (the Jasper and Stella recipe). Each
member is any other kind of teacher (a model here, an endpoint, a vectors file) and keeps its own cache entries,
so adding a member encodes nothing another run cached; the combination is cached under the members' keys and the
weights. Matryoshka mode reads it in its principal axes like any teacher; projection mode projects to its width.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from distill.stages.cost import ModelCost
from distill.store import Role
from distill.teachers.sources import Caches, Encoder, Source

if TYPE_CHECKING:
    from accelerate import Accelerator

    from distill.stages.cost import CostTexts, TeacherCosts


class EnsembleTeacher:
    """Members' unit vectors, each scaled by the square root of its weight, concatenated."""

    def __init__(self, members: list[Source], weights: list[float], caches: Caches):
        total = sum(weights)
        self.members, self.weights = members, [w / total for w in weights]
        # one cache per member, made once on every process: their keys (collective the first time) are then known
        self.member_caches = [caches(member) for member in members]
        self.name = " + ".join(f"{w:g}×{m.name}" for m, w in zip(members, self.weights))
        self.path = ",".join(m.path for m in members)  # what a cache manifest records
        self.revision: str | None = None
        self.max_seq_length: int | None = None

    @property
    def loaded(self) -> bool:
        return any(m.loaded for m in self.members)

    @property
    def load_seconds(self) -> float:
        return sum(m.load_seconds for m in self.members)

    cost_note: str | None = None

    def prompt(self, role: Role) -> str:
        return ""  # each member prepends its own

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        members = [m.identity(accelerator, memo) for m in self.members]
        return json.dumps({"ensemble": members, "weights": self.weights})

    def key_fields(self, role: Role) -> dict[str, object]:
        return {"members": [m.key_fields(role) for m in self.members]}

    def member_embeddings(self, texts: Sequence[str], role: Role) -> list[np.ndarray]:
        """Each member's vectors of `texts`, through its own cache entries (collective); members freed in turn."""
        vectors = []
        for member, cache in zip(self.members, self.member_caches):
            vectors.append(cache.embeddings(texts, role))
            member.release()  # one member's model in memory at a time
        return vectors

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        parts = self.member_embeddings(texts, role)
        scales = [float(np.sqrt(w)) for w in self.weights]

        def encode(indices: list[int]) -> torch.Tensor:
            combined = np.concatenate(
                [s * np.asarray(p[indices], dtype=np.float32) for s, p in zip(scales, parts)], axis=1
            )
            combined /= np.maximum(np.linalg.norm(combined, axis=1, keepdims=True), 1e-12)
            return torch.from_numpy(combined)

        return Encoder(lengths=np.zeros(len(texts), dtype=np.int64), encode=encode, batch_size=4096)

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        """The members run one after the other: their sizes add up, and so do their seconds per text."""
        parts = []
        for cache in self.member_caches:
            part = cache.cost(texts, cache.key(texts.passages, "document"))  # keys known: no collective here
            if part is None:
                return None
            parts.append(part)
        return ModelCost(
            parameters=sum(p.parameters for p in parts),
            dim=sum(p.dim for p in parts),
            weights_bytes=sum(p.weights_bytes for p in parts),
            texts_per_second=round(1 / sum(1 / max(p.texts_per_second, 1e-9) for p in parts), 1),
            latency_ms=round(sum(p.latency_ms for p in parts), 2),
            machine_gflops=parts[0].machine_gflops,
        )

    def release(self) -> None:
        for member in self.members:
            member.release()
