"""Teacher embeddings: computed once, sharded across processes, cached on disk under a content key.

A cache entry is a folder `<teacher_cache_dir>/<key>/` holding `embeddings.npy` (float16, memory-mapped
on read) and `manifest.json`. The key hashes everything that changes the vectors: the teacher's weights
(file hash or Hub commit), the prompt, the max length, normalisation, the compute dtype, and the texts.
Entries are written to a temporary folder and renamed, so a crash never leaves half an entry; an entry
whose manifest or sizes do not match is reported and rebuilt. A run whose entries all exist loads no
teacher at all.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.batching import map_sharded
from distill.config import ModelConfig
from distill.errors import DistillError
from distill.hub import model_fingerprint, read_json, resolve_model, shipped_models_hint

logger = get_logger(__name__)

CACHE_FORMAT = 1
CACHE_DTYPE = np.float16

Role = Literal["query", "document"]


def load_teacher(name: str, device: torch.device | str, revision: str | None = None, trust_remote_code: bool = False):  # noqa: ANN201 - SentenceTransformer, imported lazily
    """Load a SentenceTransformer teacher for inference; half precision on CUDA, float32 elsewhere."""
    return load_sentence_transformer(
        resolve_model(name), device, revision=revision, trust_remote_code=trust_remote_code, half=True
    ).eval()


def load_sentence_transformer(
    path: str,
    device: torch.device | str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    half: bool = False,
):  # noqa: ANN201
    """SentenceTransformer(path) with errors turned into one line that says how to fix them."""
    from sentence_transformers import SentenceTransformer

    kwargs = {}
    if half and torch.device(device).type == "cuda":
        kwargs["model_kwargs"] = {"torch_dtype": torch.bfloat16}
    try:
        return SentenceTransformer(
            path, device=str(device), revision=revision, trust_remote_code=trust_remote_code, **kwargs
        )
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise DistillError(
                f"model {path!r} ships its own code, which runs only if you allow it: pass --trust_remote_code "
                "if you trust its authors"
            ) from None
        raise
    except OSError as e:
        raise DistillError(
            f"model {path!r} could not be loaded ({str(e).splitlines()[0][:160]}); {shipped_models_hint()}"
        ) from None


@dataclass(frozen=True)
class TeacherSpec:
    """Everything about the teacher that changes its embeddings, hence part of every cache key."""

    path: str  # local folder or Hub name, as resolved
    revision: str | None
    max_seq_length: int | None
    query_prompt: str
    trust_remote_code: bool
    compute_dtype: str

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device) -> TeacherSpec:
        path = resolve_model(config.teacher_model)
        prompt = config.teacher_query_prompt
        if prompt is None:
            prompt = teacher_prompts(path).get("query", "")
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        return cls(path, config.teacher_revision, config.max_seq_length, prompt, config.trust_remote_code, dtype)


def teacher_prompts(path: str) -> dict[str, str]:
    """The teacher's prompts from its sentence-transformers config, read without loading its weights."""
    if Path(path).is_dir():
        return read_json(Path(path) / "config_sentence_transformers.json").get("prompts", {}) or {}
    try:
        from huggingface_hub import hf_hub_download

        return read_json(Path(hf_hub_download(path, "config_sentence_transformers.json"))).get("prompts", {}) or {}
    except Exception:  # noqa: BLE001 - a model without that file has no prompts
        return {}


def texts_fingerprint(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf8")
        digest.update(len(encoded).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        digest.update(encoded)
    return digest.hexdigest()


class TeacherCache:
    """Content-keyed teacher embeddings; the teacher is loaded only on the first cache miss."""

    def __init__(self, accelerator: Accelerator, spec: TeacherSpec, cache_dir: str | os.PathLike, batch_size: int):
        self.accelerator = accelerator
        self.spec = spec
        self.cache_dir = Path(cache_dir).expanduser()
        self.batch_size = batch_size
        self.teacher = None
        self.seconds = 0.0  # wall time spent loading the teacher and encoding
        self._model_key: str | None = None

    def key(self, texts: list[str], role: Role) -> str:
        if self._model_key is None:
            self._model_key = model_fingerprint(self.spec.path, self.spec.revision)
        fields = {
            "format": CACHE_FORMAT,
            "model": self._model_key,
            "prompt": self.spec.query_prompt if role == "query" else "",
            "max_seq_length": self.spec.max_seq_length,
            "normalize": True,
            "compute_dtype": self.spec.compute_dtype,
            "texts": texts_fingerprint(texts),
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def embeddings(self, texts: list[str], role: Role) -> np.ndarray:
        """(len(texts), teacher_dim) float16, memory-mapped read-only; computed on a miss."""
        key = self.key(texts, role)
        entry = self.cache_dir / key
        cached = read_entry(entry, key, len(texts))
        if cached is not None:
            return cached
        if entry.exists():
            logger.warning(
                f"teacher cache entry {entry} is incomplete or corrupt; rebuilding it", main_process_only=True
            )
        self.accelerator.wait_for_everyone()  # every rank has decided before the writer replaces anything
        started = time.perf_counter()
        vectors = self._encode_sharded(texts, role)
        self.seconds += time.perf_counter() - started
        problem = None
        if self.accelerator.is_local_main_process:
            try:
                write_entry(entry, key, vectors, role, self.spec)
            except DistillError as e:
                problem = str(e)  # raised after the barrier, so no process is left waiting in it
        self.accelerator.wait_for_everyone()
        if problem:
            raise DistillError(problem)
        cached = read_entry(entry, key, len(texts))
        if cached is None:
            raise DistillError(
                f"teacher cache entry {entry} could not be read back after writing; check that "
                f"{self.cache_dir} is writable and not full (or pass --teacher_cache_dir elsewhere)"
            )
        return cached

    def _encode_sharded(self, texts: list[str], role: Role) -> np.ndarray:
        """Each process encodes its share of the texts, sorted by token length; every rank gets all rows."""
        teacher = self._load()
        prompt = self.spec.query_prompt if role == "query" else ""
        lengths = token_lengths(teacher, [prompt + t for t in texts], teacher.max_seq_length)

        def encode(indices: list[int]) -> torch.Tensor:
            return teacher.encode(
                [texts[i] for i in indices],
                prompt=prompt or None,
                batch_size=len(indices),
                convert_to_tensor=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )

        return map_sharded(self.accelerator, np.asarray(lengths), self.batch_size, encode).astype(CACHE_DTYPE)

    def _load(self):  # noqa: ANN202
        if self.teacher is None:
            started = time.perf_counter()
            with self.accelerator.local_main_process_first():  # one download per machine
                self.teacher = load_teacher(
                    self.spec.path, self.accelerator.device, self.spec.revision, self.spec.trust_remote_code
                )
            if self.spec.max_seq_length:
                self.teacher.max_seq_length = self.spec.max_seq_length
            self.seconds += time.perf_counter() - started
        return self.teacher

    @property
    def loaded(self) -> bool:
        return self.teacher is not None

    def release(self) -> None:
        """Free the teacher's memory before the student trains."""
        self.teacher = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def token_lengths(model, texts: list[str], max_length: int | None) -> list[int]:  # noqa: ANN001
    """Token count of each text under `model`'s tokenizer, truncated as the model will truncate it."""
    tokenizer = model.tokenizer
    encoded = tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=True)
    return [len(ids) for ids in encoded["input_ids"]]


def read_entry(entry: Path, key: str, count: int) -> np.ndarray | None:
    """The entry's embeddings if its manifest and sizes match what was asked for, else None."""
    manifest = read_json(entry / "manifest.json") if entry.is_dir() else {}
    data = entry / "embeddings.npy"
    if manifest.get("key") != key or manifest.get("count") != count or not data.is_file():
        return None
    if data.stat().st_size != manifest.get("bytes"):
        return None
    try:
        vectors = np.load(data, mmap_mode="r")
    except (ValueError, OSError):
        return None
    if vectors.shape != (count, manifest.get("dim")) or vectors.dtype != CACHE_DTYPE:
        return None
    return vectors


def write_entry(entry: Path, key: str, vectors: np.ndarray, role: Role, spec: TeacherSpec) -> None:
    """Write to a temporary folder beside the entry, then rename it into place."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = entry.parent / f".{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        np.save(staging / "embeddings.npy", vectors)
        manifest = {
            "key": key,
            "count": int(vectors.shape[0]),
            "dim": int(vectors.shape[1]),
            "dtype": np.dtype(CACHE_DTYPE).name,
            "bytes": (staging / "embeddings.npy").stat().st_size,
            "role": role,
            "teacher": spec.path,
            "revision": spec.revision,
            "prompt": spec.query_prompt if role == "query" else "",
            "max_seq_length": spec.max_seq_length,
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if entry.exists():  # a corrupt entry: move it aside, then swap in the good one
            stale = entry.parent / f".{entry.name}.stale-{os.getpid()}"
            os.replace(entry, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, entry)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if read_entry(entry, key, int(vectors.shape[0])) is not None:
            return  # another machine sharing this folder wrote the same entry first
        raise DistillError(
            f"cannot write the teacher cache under {entry.parent} ({e.strerror or e}); make it writable, free "
            "space, or pass --teacher_cache_dir elsewhere"
        ) from None
