"""Teacher embeddings: computed once, sharded across processes, cached on disk under a content key.

A cache entry is a folder `<teacher_cache_dir>/<key>/` holding `embeddings.npy` (float16, memory-mapped
on read) and `manifest.json`. The key hashes everything that changes the vectors: the teacher's weights
(file hash or Hub commit), the prompt, the max length, normalisation, the compute dtype, and the texts.
Entries are written to a staging folder and renamed, so a crash never leaves half an entry; an entry
whose manifest or sizes do not match is reported and rebuilt. A run whose entries all exist loads no
teacher at all. Encoding goes in blocks of texts, longest first, and the staging folder records after
each block how far it got: a run killed while encoding (preemption, a node failure) is continued by the
next run with the same inputs instead of started over.
"""

from __future__ import annotations

import contextlib
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
BLOCK_ROWS_PER_PROCESS = 16384  # texts each process encodes between two progress marks: what a kill can cost

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
    config_kwargs: dict | None = None,
):  # noqa: ANN201
    """SentenceTransformer(path) with errors turned into one line that says how to fix them.

    `config_kwargs` override fields of the backbone's transformers config before it is built.
    """
    from sentence_transformers import SentenceTransformer

    kwargs = {}
    if half and torch.device(device).type == "cuda":
        kwargs["model_kwargs"] = {"torch_dtype": torch.bfloat16}
    if config_kwargs:
        kwargs["config_kwargs"] = config_kwargs
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
        max_length = config.teacher_max_seq_length or config.max_seq_length
        return cls(path, config.teacher_revision, max_length, prompt, config.trust_remote_code, dtype)


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
        self.load_seconds = 0.0  # the loading part of it (import, weights, move to the device)
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
        # Only one process per machine writes; the others gather the same chunks and drop them, so no rank
        # ever holds all the vectors in memory.
        writer = (
            CacheWriter(entry, key, len(texts), role, self.spec) if self.accelerator.is_local_main_process else None
        )
        try:
            self._encode_sharded(texts, role, writer)
        except BaseException:
            if writer is not None:
                writer.close()  # the staging folder stays for the next run to continue from
            raise
        self.seconds += time.perf_counter() - started
        problem = writer.commit() if writer else None  # an error is raised after the barrier: nobody waits alone
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

    def _encode_sharded(self, texts: list[str], role: Role, writer: CacheWriter | None) -> None:
        """Each process encodes its share of the texts, block by block, longest first, into `writer`.

        Per batch this does what `SentenceTransformer.encode` does (`preprocess` with the prompt, forward,
        normalise), but texts are sorted by their exact token count (a tokenizer pass first), not by
        characters as `encode` sorts: by characters, batches of the benchmark's texts carry 32% (8,000 texts,
        batch 32) to 43% (40,000, batch 256) padding, against 0.8-1.2% by tokens, and a large teacher pays
        for every padded token. On a GPU the next batch is tokenized in a background thread while this one
        runs, since a small teacher otherwise waits for the tokenizer between batches; on a CPU the forward
        pass already keeps every core busy. A batch that runs the GPU out of memory is encoded in halves, and
        so is every later one of its block (`map_sharded`): too large a --teacher_batch_size costs one failed
        batch per block.

        The texts, longest first, are cut into blocks of BLOCK_ROWS_PER_PROCESS per process; after each block
        the writers mark how many texts of that order are done. A restart begins after the texts every
        machine's writer has marked, whatever the number of processes now.
        """
        teacher = self._load()  # first, so that importing sentence-transformers counts as loading
        from sentence_transformers.util import batch_to_device

        prompt = self.spec.query_prompt if role == "query" else ""
        lengths = np.asarray(token_lengths(teacher, [prompt + t for t in texts], teacher.max_seq_length))
        order = np.argsort(-lengths, kind="stable")  # the longest block first: a size that fits it fits the rest

        @torch.inference_mode()
        def encode(features: dict) -> torch.Tensor:
            embeddings = teacher(batch_to_device(features, teacher.device))["sentence_embedding"]
            return torch.nn.functional.normalize(embeddings.float(), p=2, dim=1)

        hint = (
            f"lower --teacher_max_seq_length (the teacher reads up to {teacher.max_seq_length} tokens) or run the "
            "teacher on a GPU with more memory"
        )
        ahead = tokenize_ahead(teacher.device)
        done = rows_done_everywhere(self.accelerator, writer.resume() if writer else len(texts))
        if done:
            logger.warning(
                f"teacher cache: continuing an interrupted encoding at {done} of {len(texts)} {role} texts",
                main_process_only=True,
            )
        block = BLOCK_ROWS_PER_PROCESS * self.accelerator.num_processes
        for start in range(done, len(texts), block):
            rows = np.sort(order[start : start + block])  # in text order; map_sharded shards and sorts them

            def tokenize(indices: list[int], rows: np.ndarray = rows) -> dict:
                return teacher.preprocess([texts[rows[i]] for i in indices], prompt=prompt or None)

            def sink(indices: np.ndarray, vectors: np.ndarray, rows: np.ndarray = rows) -> None:
                if writer is not None:
                    writer.write(rows[indices], vectors)

            map_sharded(
                self.accelerator,
                lengths[rows],
                self.batch_size,
                encode if ahead else lambda indices, tokenize=tokenize: encode(tokenize(indices)),
                sink=sink,
                prepare=tokenize if ahead else None,
                too_long_hint=hint,
            )
            if writer is not None:
                writer.mark(min(start + block, len(texts)))

    def _load(self):  # noqa: ANN202
        if self.teacher is None:
            started = time.perf_counter()
            with self.accelerator.local_main_process_first():  # one download per machine
                self.teacher = load_teacher(
                    self.spec.path, self.accelerator.device, self.spec.revision, self.spec.trust_remote_code
                )
            if self.spec.max_seq_length:
                self.teacher.max_seq_length = self.spec.max_seq_length
            self.load_seconds = time.perf_counter() - started
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


def mine_hard_negatives(
    queries: np.ndarray, passages: np.ndarray, count: int, margin: float = 0.05, chunk_size: int = 1024
) -> np.ndarray:
    """For query i (whose positive is passage i), the `count` passages the teacher ranks highest among the rest.

    Passages scoring above (1 - margin) x the positive's own score are skipped: they are more likely
    unlabelled positives than negatives (sentence-transformers' `relative_margin`). Exhaustive, O(n^2 d)
    on the cached vectors. Returns (len(queries), count) passage indices.
    """
    if len(passages) <= count:
        raise DistillError(
            f"mine_hard_negatives {count} needs more than {count} passages, the data has {len(passages)}; "
            "lower --mine_hard_negatives or give more pairs"
        )
    mined = np.zeros((len(queries), count), dtype=np.int64)
    for start in range(0, len(queries), chunk_size):
        q = torch.from_numpy(np.asarray(queries[start : start + chunk_size], dtype=np.float32))
        scores = q @ torch.from_numpy(np.asarray(passages, dtype=np.float32)).T  # (chunk, passages)
        own = torch.arange(start, start + len(q))
        positive = scores[torch.arange(len(q)), own].clone()
        scores[torch.arange(len(q)), own] = float("-inf")
        scores[scores > (1 - margin) * positive[:, None]] = float("-inf")
        mined[start : start + len(q)] = torch.topk(scores, count, dim=1).indices.numpy()
    return mined


def tokenize_ahead(device: torch.device) -> bool:
    """Whether the teacher's next batch is tokenized in a background thread: on accelerators, not on a CPU."""
    return device.type != "cpu"


def token_lengths(model, texts: list[str], max_length: int | None, chunk_size: int = 4096) -> list[int]:  # noqa: ANN001
    """Token count of each text under `model`'s tokenizer, truncated as the model will truncate it.

    Tokenized in chunks: the fast tokenizer's per-token bookkeeping for 40k texts at once costs a few
    hundred MB that the heap keeps afterwards.
    """
    tokenizer = model.tokenizer
    lengths: list[int] = []
    for start in range(0, len(texts), chunk_size):
        batch = texts[start : start + chunk_size]
        encoded = tokenizer(batch, truncation=True, max_length=max_length, add_special_tokens=True)
        lengths.extend(len(ids) for ids in encoded["input_ids"])
    return lengths


def rows_done_everywhere(accelerator: Accelerator, rows_done: int) -> int:
    """The texts every machine's writer has marked done (non-writers pass the total): the smallest count."""
    counts = accelerator.gather(torch.tensor([rows_done], dtype=torch.int64, device=accelerator.device))
    return int(counts.min())


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


def claim(path: Path) -> int | None:
    """A file descriptor holding an exclusive lock on `path`, or None: another process holds it, or no locks here."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its last holder removed it while we opened it
            raise OSError("lock file replaced")
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


class CacheWriter:
    """Streams gathered vectors into a staging folder's `embeddings.npy` (a memory map), then renames it into place.

    The staging folder `.<key>.partial-<host>` outlives a killed run: `mark(n)` records (after flushing the
    vectors) that the first n texts of the encoding order are in it, and `resume()` in the next run on this
    machine returns that n. A lock file keeps two runs on one machine from sharing it; a run that cannot
    take the lock (another run is encoding the same texts, or the filesystem has no locks) stages under its
    process id and cannot be resumed. Write errors (a full disk) are remembered, not raised, so the writer
    keeps taking part in the gathers; `commit` returns the error message, or None once the entry is in place.
    """

    def __init__(self, entry: Path, key: str, count: int, role: Role, spec: TeacherSpec):
        self.entry, self.key, self.count, self.role, self.spec = entry, key, count, role, spec
        host = socket.gethostname()
        self.lock_path = entry.parent / f".{entry.name}.lock-{host}"
        self.lock = claim(self.lock_path)
        suffix = f"partial-{host}" if self.lock is not None else f"tmp-{host}-{os.getpid()}"
        self.staging = entry.parent / f".{entry.name}.{suffix}"
        self.vectors: np.ndarray | None = None
        self.problem: str | None = None

    def resume(self) -> int:
        """Texts an interrupted run on this machine left done in the staging folder; 0 (and it cleared) if none."""
        progress = {}
        if self.lock is not None:
            with contextlib.suppress(ValueError, OSError):  # unreadable: start over
                progress = read_json(self.staging / "progress.json")
        if isinstance(progress, dict) and progress.get("key") == self.key and progress.get("count") == self.count:
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                vectors = np.load(self.staging / "embeddings.npy", mmap_mode="r+")
                done = int(progress["rows_done"])
                if vectors.shape[0] == self.count and vectors.dtype == CACHE_DTYPE and 0 <= done <= self.count:
                    self.vectors = vectors
                    return done
        shutil.rmtree(self.staging, ignore_errors=True)
        return 0

    def write(self, indices: np.ndarray, vectors: np.ndarray) -> None:
        if self.problem:
            return
        try:
            if self.vectors is None:
                self.entry.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging.mkdir()
                self.vectors = np.lib.format.open_memmap(
                    self.staging / "embeddings.npy", mode="w+", dtype=CACHE_DTYPE, shape=(self.count, vectors.shape[1])
                )
            self.vectors[indices] = vectors.astype(CACHE_DTYPE)
        except OSError as e:
            self._fail(e)

    def mark(self, rows_done: int) -> None:
        """The first `rows_done` texts of the encoding order are written: flush them, then say so."""
        if self.problem or self.vectors is None or self.lock is None:
            return
        try:
            self.vectors.flush()
            progress = self.staging / "progress.json"
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": self.key, "count": self.count, "rows_done": rows_done}))
            os.replace(tmp, progress)
        except OSError as e:
            self._fail(e)

    def commit(self) -> str | None:
        if self.problem is None and self.vectors is not None:
            try:
                dim = int(self.vectors.shape[1])
                self.vectors.flush()
                self.vectors = None  # close the memory map before the rename
                manifest = {
                    "key": self.key,
                    "count": self.count,
                    "dim": dim,
                    "dtype": np.dtype(CACHE_DTYPE).name,
                    "bytes": (self.staging / "embeddings.npy").stat().st_size,
                    "role": self.role,
                    "teacher": self.spec.path,
                    "revision": self.spec.revision,
                    "prompt": self.spec.query_prompt if self.role == "query" else "",
                    "max_seq_length": self.spec.max_seq_length,
                }
                (self.staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
                (self.staging / "progress.json").unlink(missing_ok=True)
                if self.entry.exists():  # a corrupt entry: move it aside, then swap in the good one
                    stale = self.entry.parent / f".{self.entry.name}.stale-{os.getpid()}"
                    os.replace(self.entry, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                os.replace(self.staging, self.entry)
            except OSError as e:
                if read_entry(self.entry, self.key, self.count) is None:
                    self._fail(e)
                # else: another machine sharing this folder wrote the same entry first
        if self.problem is None or self.lock is None:  # a failed write keeps what a rerun can continue from
            shutil.rmtree(self.staging, ignore_errors=True)
        self.close()
        return self.problem

    def close(self) -> None:
        """Let go of the staging folder (kept as it is) and its lock."""
        self.vectors = None
        if self.lock is not None:
            with contextlib.suppress(OSError):
                self.lock_path.unlink()  # while still held: a process that opened it before sees another inode
            os.close(self.lock)
            self.lock = None

    def _fail(self, error: OSError) -> None:
        self.vectors = None
        self.problem = (
            f"cannot write the teacher cache under {self.entry.parent} ({error.strerror or error}); make it "
            "writable, free space, or pass --teacher_cache_dir elsewhere"
        )
