"""Teacher embeddings: computed once, sharded across processes, cached on disk under a content key.

A cache entry is a folder `<teacher_cache_dir>/<key>/` holding `embeddings.npy` (float16, memory-mapped
on read) and `manifest.json`. The key hashes everything that changes the vectors: the teacher's weights
(file hash or Hub commit), the prompt, the max length, normalisation, the compute dtype, and the texts.
Entries are written to a staging folder and renamed, so a crash never leaves half an entry; an entry
whose manifest or sizes do not match is reported and rebuilt. A run whose entries all exist loads no
teacher at all. Encoding goes in blocks of texts, longest first, and the staging folder records after
each block how far it got: a run killed while encoding (preemption, a node failure) is continued by the
next run with the same inputs instead of started over. The on-disk side (entries, staging folders, locks, and
`python -m distill.cache list|prune`) is distill/cache.py.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.allocator import release_freed_memory
from distill.batching import TOKENIZE_CHUNK, map_sharded
from distill.cache import CACHE_FORMAT, CacheWriter, Role, read_entry, touch
from distill.config import Config, ModelConfig
from distill.data import DistillData, EvalVectors, passage_texts
from distill.distributed import everyone, main_decides, progress_bar, smallest, writes_for_this_machine
from distill.efficiency import CostTexts, ModelCost, TeacherCosts, device_label, measure
from distill.errors import DistillError
from distill.files import read_json
from distill.hub import hub_snapshot, load_sentence_transformer, model_fingerprint, resolve_model

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = get_logger(__name__)

BLOCK_ROWS_PER_PROCESS = 16384  # texts each process encodes between two progress marks: what a kill can cost


def teacher_dtype(choice: str, device: torch.device | str) -> str:
    """The teacher's compute dtype: `choice`, or for "auto" what the device runs fast and safely.

    bfloat16 on GPUs that have it natively (compute capability 8+: A100, H100, L4, RTX 30xx on); below that
    torch accepts bfloat16 but emulates it in float32 arithmetic (pytorch#148322), so older GPUs (V100, T4)
    get float16, whose overflow the encoding catches (non-finite vectors are an error). Elsewhere float32.
    """
    if choice != "auto":
        return choice
    device = torch.device(device)
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability(device)[0] >= 8 else "float16"


def load_teacher(
    name: str,
    device: torch.device | str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> SentenceTransformer:
    """Load a SentenceTransformer teacher for inference, its weights in `dtype` (see `teacher_dtype`)."""
    return load_sentence_transformer(
        resolve_model(name, revision),
        device,
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=getattr(torch, teacher_dtype(dtype, device)),
    ).eval()


# SentenceTransformer.encode_document's order: the first of these the teacher declares is its document prompt.
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")


@dataclass(frozen=True)
class TeacherSpec:
    """Everything about the teacher that changes its embeddings, hence part of every cache key."""

    path: str  # local folder or Hub name, as resolved
    revision: str | None
    max_seq_length: int | None
    query_prompt: str
    trust_remote_code: bool
    compute_dtype: str
    document_prompt: str = ""

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device, phase1: bool = False) -> TeacherSpec:
        """The teacher; with `phase1`, phase 1's own target where `phase1_teacher_model` names one (its own
        prompts, its latest revision), else the teacher."""
        dtype = teacher_dtype(config.teacher_dtype, device)
        # Unset, the teacher reads what the student reads; the teacher's own limit only when the student's is unknown.
        max_length = (
            config.teacher_max_seq_length or config.max_seq_length or student_max_seq_length(config.student_model)
        )
        if phase1 and config.phase1_teacher_model:
            path = resolve_model(config.phase1_teacher_model)
            declared = teacher_prompts(path)
            query, document = (role_prompt(declared, None, role, path) for role in ("query", "document"))
            return cls(path, None, max_length, query, config.trust_remote_code, dtype, document)
        path = resolve_model(config.teacher_model, config.teacher_revision)
        declared = teacher_prompts(path, config.teacher_revision)
        query = role_prompt(declared, config.teacher_query_prompt, "query", path)
        document = role_prompt(declared, config.teacher_document_prompt, "document", path)
        return cls(path, config.teacher_revision, max_length, query, config.trust_remote_code, dtype, document)

    def prompt(self, role: Role) -> str:
        """The text prepended to every text of `role` before the teacher encodes it."""
        return self.query_prompt if role == "query" else self.document_prompt


def role_prompt(declared: dict[str, str], given: str | None, role: Role, teacher: str) -> str:
    """The teacher's prompt for `role`: `given` (a prompt text, or the name of one the teacher declares), else its own.

    Its own is the 'query' prompt for queries, the first of DOCUMENT_PROMPT_NAMES for documents. Empty
    prompts count as absent (sentence-transformers >= 6 saves empty 'query' and 'document' placeholders).
    """
    if given is not None:
        return declared.get(given, given)  # "" (no prompt) is no prompt name
    names = ("query",) if role == "query" else DOCUMENT_PROMPT_NAMES
    own = next((declared[name] for name in names if declared.get(name)), "")
    others = sorted(name for name, text in declared.items() if text and name not in ("query", *DOCUMENT_PROMPT_NAMES))
    if role == "query" and not own and others:
        raise DistillError(
            f"teacher {teacher!r} declares the prompts {', '.join(others)} but none named 'query', so distill cannot "
            f"tell which instruction its queries need; pass --teacher_query_prompt with one of these names (e.g. "
            f"--teacher_query_prompt {others[0]}), a prompt text, or '' for none"
        )
    return own


def teacher_prompts(path: str, revision: str | None = None) -> dict[str, str]:
    """The teacher's prompts from its sentence-transformers config, read without loading its weights.

    A teacher without that file has none. Offline, a Hub teacher whose file is not in the local cache is
    taken to have none, with a warning; a teacher that cannot be found at all is a DistillError saying so.
    """
    if Path(path).is_dir():
        return _prompts(read_json(Path(path) / "config_sentence_transformers.json"))
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return _prompts(read_json(Path(hf_hub_download(path, "config_sentence_transformers.json", revision=revision))))
    except EntryNotFoundError as e:
        if not isinstance(e, LocalEntryNotFoundError):  # the teacher has no such file: no prompts
            return {}
        problem = e  # offline and not cached: unknown, not absent
    except (OSError, ValueError) as e:  # offline, unreachable, or no such repo/revision
        problem = e
    hub_snapshot(path, revision)  # the model itself cannot be found: that one error line, not a warning first
    logger.warning(
        f"could not read the prompts of teacher {path!r} ({type(problem).__name__}); encoding with none. Pass "
        "--teacher_query_prompt and --teacher_document_prompt if it needs them",
        main_process_only=True,
    )
    return {}


def _prompts(sentence_transformers_config: dict) -> dict[str, str]:
    return {name: text or "" for name, text in (sentence_transformers_config.get("prompts") or {}).items()}


def student_max_seq_length(student_model: str) -> int | None:
    """The student's own token limit from its sentence_bert_config.json, read without loading it; None if unknown."""
    path = resolve_model(student_model)
    if Path(path).is_dir():
        return read_json(Path(path) / "sentence_bert_config.json").get("max_seq_length")
    from huggingface_hub import hf_hub_download

    try:
        return read_json(Path(hf_hub_download(path, "sentence_bert_config.json"))).get("max_seq_length")
    except (OSError, ValueError):  # unknown (offline, no such file): the teacher reads up to its own limit
        return None


def texts_fingerprint(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf8")
        digest.update(len(encoded).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        digest.update(encoded)
    return digest.hexdigest()


NON_FINITE_FIX = {
    "float16": "float16 overflows in this teacher's activations: pass --teacher_dtype bfloat16 (GPUs of compute "
    "capability 8+) or float32",
    "bfloat16": "pass --teacher_dtype float32",
    "float32": "check the teacher's weights for NaN or inf values (a broken or partly written checkpoint)",
}


def check_finite(vectors: np.ndarray, rows: np.ndarray, texts: list[str], role: Role, spec: TeacherSpec) -> None:
    """A DistillError if any teacher vector (row i is the text `texts[rows[i]]`) holds NaN or inf.

    Called on each gathered chunk before it is cached: a non-finite target would make the student's loss
    NaN at the first batch that holds it, far from its cause, and stay in the cache for every later run.
    """
    bad = np.unique(rows[~np.isfinite(vectors).all(axis=1)])
    if len(bad):
        raise DistillError(
            f"teacher {spec.path!r} computing in {spec.compute_dtype} gave non-finite vectors (NaN or inf) for "
            f"{len(bad)} of the {len(np.unique(rows))} {role} texts of the chunk where it first happened, the first "
            f"text #{bad[0]} ({texts[bad[0]][:60]!r}); {NON_FINITE_FIX[spec.compute_dtype]}. No cache entry was "
            "written"
        )


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
            memo = self.cache_dir.parent / f"{self.cache_dir.name}-fingerprints.json"  # beside the entries
            alone = self.accelerator is None or self.accelerator.num_processes == 1
            # collective: each machine's first process reads the weights, the others find its digests
            with contextlib.nullcontext() if alone else self.accelerator.local_main_process_first():
                self._model_key = model_fingerprint(self.spec.path, self.spec.revision, memo=memo)
        fields = {
            "format": CACHE_FORMAT,
            "model": self._model_key,
            "prompt": self.spec.prompt(role),
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
        # A hit only where every machine has the entry: a rank that skipped encoding while the others encode
        # would leave them waiting in a collective forever. A machine that has it writes it again.
        here = cached is not None
        if everyone(self.accelerator, here):
            if writes_for_this_machine(self.accelerator):
                touch(entry)  # its last use, for `python -m distill.cache prune --unused_days`
            logger.info(f"teacher cache: {len(texts):,} {role} texts found in {entry}")
            return cached
        logger.info(f"teacher cache: {len(texts):,} {role} texts not cached; encoding them into {entry}")
        cached = None  # the memory map is dropped before the writer replaces the entry
        if entry.exists() and not here:
            logger.warning(
                f"teacher cache entry {entry} is incomplete or corrupt; rebuilding it", main_process_only=True
            )
        self.accelerator.wait_for_everyone()  # every rank has decided before the writer replaces anything
        started = time.perf_counter()
        # Only one process per machine writes; the others gather the same chunks and drop them, so no rank
        # ever holds all the vectors in memory.
        machine = writes_for_this_machine(self.accelerator)
        writer = CacheWriter(entry, key, len(texts), role, self.spec) if machine else None
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

        prompt = self.spec.prompt(role)
        lengths = np.asarray(token_lengths(teacher, [prompt + t for t in texts], teacher.max_seq_length))
        order = np.argsort(-lengths, kind="stable")  # the longest block first: a size that fits it fits the rest

        @torch.inference_mode()
        def encode(features: dict) -> torch.Tensor:
            embeddings = teacher(batch_to_device(features, teacher.device))["sentence_embedding"]
            return torch.nn.functional.normalize(embeddings.float(), p=2, dim=1)

        ahead = tokenize_ahead(teacher.device)
        block = BLOCK_ROWS_PER_PROCESS * self.accelerator.num_processes
        done = self._texts_done(writer, len(texts), role)
        progress = progress_bar(self.accelerator, len(texts), f"teacher: {role} texts", done=done, unit="text")
        for start in range(done, len(texts), block):
            rows = np.sort(order[start : start + block])  # in text order; map_sharded shards and sorts them
            self._encode_block(teacher, texts, rows, lengths, role, encode, ahead, writer, progress.update)
            if writer is not None:
                writer.mark(min(start + block, len(texts)))
        progress.close()

    def _encode_block(
        self,
        teacher: SentenceTransformer,
        texts: list[str],
        rows: np.ndarray,
        lengths: np.ndarray,
        role: Role,
        encode: Callable[[dict], torch.Tensor],
        ahead: bool,
        writer: CacheWriter | None,
        progress: Callable[[int], None],
    ) -> None:
        """The texts at `rows`, sharded over the processes, into `writer` (tokenized ahead, in a thread, if `ahead`)."""
        prompt = self.spec.prompt(role)

        def tokenize(indices: list[int]) -> dict:
            return teacher.preprocess([texts[rows[i]] for i in indices], prompt=prompt or None)

        def tokenize_and_encode(indices: list[int]) -> torch.Tensor:
            return encode(tokenize(indices))

        def sink(indices: np.ndarray, vectors: np.ndarray) -> None:
            # every rank gets every gathered chunk, so every rank raises here at the same chunk: none waits
            check_finite(vectors, rows[indices], texts, role, self.spec)
            if writer is not None:
                writer.write(rows[indices], vectors)

        map_sharded(
            self.accelerator,
            lengths[rows],
            self.batch_size,
            encode if ahead else tokenize_and_encode,
            sink=sink,
            prepare=tokenize if ahead else None,
            too_long_hint=(
                f"lower --teacher_max_seq_length (the teacher reads up to {teacher.max_seq_length} tokens) or run "
                "the teacher on a GPU with more memory"
            ),
            progress=progress,
        )

    def _texts_done(self, writer: CacheWriter | None, count: int, role: Role) -> int:
        """The texts every machine's writer has marked done in an interrupted encoding (non-writers pass `count`)."""
        done = smallest(self.accelerator, writer.resume() if writer else count)
        if done:
            logger.warning(
                f"teacher cache: continuing an interrupted encoding at {done} of {count} {role} texts",
                main_process_only=True,
            )
        return done

    def _load(self) -> SentenceTransformer:
        if self.teacher is None:
            started = time.perf_counter()
            with self.accelerator.local_main_process_first():  # one download per machine
                self.teacher = self._load_here()
            self.load_seconds = time.perf_counter() - started
        return self.teacher

    @property
    def loaded(self) -> bool:
        return self.teacher is not None

    def cost(self, texts: CostTexts, key: str) -> ModelCost:
        """The teacher's size and speed on this device: kept figures, else measured (loading it on this process).

        `key` is `self.key(texts.passages, "document")`, made by every process beforehand (it can be collective).
        """
        costs = TeacherCosts(self.cache_dir, key, device_label(self.device), texts)
        cost = costs.get(self.device)
        if cost is None:
            teacher = self.teacher or self._load_here()
            folder = self.spec.path if Path(self.spec.path).is_dir() else None
            cost = measure(teacher, texts, folder, self.spec.prompt("query"), self.spec.prompt("document"))
            costs.put(cost)
        return cost

    def _load_here(self) -> SentenceTransformer:
        """The teacher on this process alone (no barrier): `_load` keeps it, the cost stage measures it once."""
        spec = self.spec
        teacher = load_teacher(spec.path, self.device, spec.revision, spec.trust_remote_code, spec.compute_dtype)
        if spec.max_seq_length:
            teacher.max_seq_length = spec.max_seq_length
        return teacher

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def release(self) -> None:
        """Free the teacher's memory before the student trains."""
        self.teacher = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def mine_hard_negatives(
    queries: np.ndarray,
    passages: np.ndarray,
    count: int,
    margin: float = 0.05,
    chunk_size: int = 1024,
    passage_ids: np.ndarray | None = None,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """For query i (whose positive is passage i), the `count` passages the teacher ranks highest among the rest.

    Passages scoring above the positive's own score less `margin` x its magnitude are skipped: they are more
    likely unlabelled positives than negatives (sentence-transformers' `relative_margin`, sign-safe as there).
    A query left with fewer than `count` passages below that line gets the highest-scoring skipped ones to make
    up its count (a warning says for how many queries), never its positive. `passage_ids` (equal for identical
    texts) keeps a text several pairs share from being mined for a query whose positive it is, or twice for one
    query. Exhaustive, O(n^2 d) on the cached vectors, on `device`: a launcher gives each GPU process one CPU thread
    (OMP_NUM_THREADS=1), at which 500k pairs of a 3584-d teacher would take hours. Returns (len(queries), count)
    passage indices.
    """
    ids = np.arange(len(passages)) if passage_ids is None else np.asarray(passage_ids, dtype=np.int64)
    distinct, first_rows = np.unique(ids, return_index=True)
    if len(distinct) <= count:
        raise DistillError(
            f"mine_hard_negatives {count} needs more than {count} passages of distinct text, the data has "
            f"{len(distinct)}; lower --mine_hard_negatives or give more pairs"
        )
    ids_of = torch.from_numpy(ids).to(device)
    repeated = torch.ones(len(passages), dtype=torch.bool, device=device)  # every row but the first of each text
    repeated[torch.from_numpy(first_rows).to(device)] = False
    mined = np.zeros((len(queries), count), dtype=np.int64)
    relaxed = 0  # queries that took passages within the margin to make up their count
    # the cache's float16 vectors are widened once, not once per chunk of queries (a full copy each time)
    candidates = torch.from_numpy(np.asarray(passages, dtype=np.float32)).to(device).T
    for start in range(0, len(queries), chunk_size):
        q = torch.from_numpy(np.asarray(queries[start : start + chunk_size], dtype=np.float32)).to(device)
        scores = q @ candidates  # (chunk, passages)
        own = torch.arange(start, start + len(q), device=device)
        positive = scores[torch.arange(len(q), device=device), own]
        threshold = positive - positive.abs() * margin  # (chunk,); (1 - margin) x positive would rise when it is < 0
        within = scores > threshold[:, None]  # likely unlabelled positives
        # below the threshold first, then (only for a query short of those) the skipped ones, each by score
        ranking = torch.where(within, scores - (scores.max() - scores.min() + 1), scores)
        ranking.masked_fill_(repeated[None, :] | (ids_of[None, :] == ids_of[own][:, None]), float("-inf"))
        top = torch.topk(ranking, count, dim=1).indices  # (chunk, count); finite: > count distinct texts
        relaxed += int(within.gather(1, top).any(dim=1).sum())
        mined[start : start + len(q)] = top.cpu().numpy()
    if relaxed:
        logger.warning(
            f"mine_hard_negatives {count}: {relaxed} of {len(queries)} queries have fewer than {count} other passages "
            f"the teacher scores at least {margin:.0%} below their positive; they also got the highest-scoring closer "
            "ones (likelier unlabelled positives)"
        )
    return mined


def tokenize_ahead(device: torch.device) -> bool:
    """Whether the teacher's next batch is tokenized in a background thread: on accelerators, not on a CPU."""
    return device.type != "cpu"


def token_lengths(
    model: SentenceTransformer, texts: list[str], max_length: int | None, chunk_size: int = TOKENIZE_CHUNK
) -> list[int]:
    """Token count of each text under `model`'s tokenizer, truncated as the model will truncate it.

    Tokenized in chunks (`TOKENIZE_CHUNK`): the fast tokenizer's per-token bookkeeping for 40k texts at once
    costs a few hundred MB that the heap keeps afterwards.
    """
    tokenizer = model.tokenizer
    lengths: list[int] = []
    for start in range(0, len(texts), chunk_size):
        batch = texts[start : start + chunk_size]
        encoded = tokenizer(batch, truncation=True, max_length=max_length, add_special_tokens=True)
        lengths.extend(len(ids) for ids in encoded["input_ids"])
    return lengths


@dataclass
class TeacherVectors:
    """Cached teacher embeddings (memory-mapped) of everything the run uses."""

    phase1: np.ndarray | None
    queries: np.ndarray | None
    passages: np.ndarray | None  # positives, then every query's negatives
    passage_rows: np.ndarray | None  # (queries, 1 + negatives): row of each query's positive, then its negatives
    evaluation: EvalVectors | None
    seconds: dict[str, float]  # teacher time spent per phase (0 on a warm cache), loading included
    loaded: bool  # whether any teacher model was loaded at all
    load_seconds: float  # the part of `seconds` spent loading the teacher (0 when not loaded)
    cost: ModelCost | None = None  # its size and speed on the main process's device (efficiency.py)

    def fit_sample(self, data: DistillData) -> tuple[list[str], np.ndarray | None]:
        """Texts and teacher vectors a projection or basis is fitted on: phase 1's, else phase 2's passages."""
        if data.phase1_texts and self.phase1 is not None:
            return data.phase1_texts, self.phase1
        return data.phase2.passages, self.passages

    @property
    def dim(self) -> int:
        """The teacher's dimension (phase 1's vectors come from another model under `phase1_teacher_model`)."""
        for vectors in (self.queries, self.evaluation.corpus if self.evaluation else None, self.phase1):
            if vectors is not None:
                return int(vectors.shape[1])
        raise DistillError("nothing to distill: both phases are skipped and there is no evaluation set")

    @property
    def fit_dim(self) -> int:
        """The dimension of the vectors `fit_sample` returns."""
        return int(self.phase1.shape[1]) if self.phase1 is not None else self.dim


def embed_with_teacher(
    accelerator: Accelerator, config: Config, data: DistillData, cost_texts: CostTexts | None = None
) -> TeacherVectors:
    """The teacher stage: every text the run needs, through the teacher cache; the teacher is freed afterwards.

    With `cost_texts`, the teacher's size and speed are measured too (efficiency.py): while it is loaded, or
    from the figures kept beside the cache for this device, or, with neither, by loading it once on the main
    process.
    """
    batch_size = config.performance.teacher_batch_size or config.training.batch_size
    spec = TeacherSpec.from_config(config.model, accelerator.device)
    cache = TeacherCache(accelerator, spec, config.output.teacher_cache_dir, batch_size)
    phase1_cache = cache  # phase 1's texts go through phase 1's own target where phase1_teacher_model names one
    if data.phase1_texts and config.model.phase1_teacher_model:
        phase1_spec = TeacherSpec.from_config(config.model, accelerator.device, phase1=True)
        phase1_cache = TeacherCache(accelerator, phase1_spec, config.output.teacher_cache_dir, batch_size)
    phase1 = phase1_cache.embeddings(data.phase1_texts, "document") if data.phase1_texts else None
    seconds = {"phase1": phase1_cache.seconds}
    own = phase1_cache is not cache  # loaded and freed before the teacher
    phase1_loaded, phase1_load_seconds = (phase1_cache.loaded, phase1_cache.load_seconds) if own else (False, 0.0)
    if own:
        phase1_cache.release()
    queries = passages = rows = None
    started = cache.seconds  # the teacher's time before phase 2: phase 1's, unless phase 1 has its own target
    if len(data.phase2):
        texts, rows = passage_texts(data.phase2)
        queries = cache.embeddings(data.phase2.queries, "query")
        passages = cache.embeddings(texts, "document")
    seconds["phase2"] = cache.seconds - started
    evaluation = None
    if data.evaluation is not None:
        e = data.evaluation
        evaluation = EvalVectors(
            np.asarray(cache.embeddings(e.queries, "query"), dtype=np.float32),
            np.asarray(cache.embeddings(e.corpus, "document"), dtype=np.float32),
            np.asarray(cache.embeddings(e.sts_texts, "document"), dtype=np.float32) if e.sts_texts else None,
        )
    seconds["evaluation"] = cache.seconds - started - seconds["phase2"]
    loaded = cache.loaded or phase1_loaded
    cost = None
    if cost_texts is not None:
        key = cache.key(cost_texts.passages, "document")  # collective the first time: on every process
        cost = main_decides(accelerator, lambda: cache.cost(cost_texts, key))
    cache.release()
    release_freed_memory()  # the teacher's freed weights and activations go back to the OS
    if rows is not None and config.data.mine_hard_negatives and rows.shape[1] == 1:  # the data brings none
        # after the teacher is gone: on a GPU the search needs the device memory the teacher held
        rows = np.concatenate([rows, mined_negatives(accelerator, config, texts, queries, passages)], axis=1)
    load_seconds = cache.load_seconds + phase1_load_seconds
    return TeacherVectors(phase1, queries, passages, rows, evaluation, seconds, loaded, load_seconds, cost)


def mined_negatives(
    accelerator: Accelerator, config: Config, texts: list[str], queries: np.ndarray, passages: np.ndarray
) -> np.ndarray:
    """The teacher's hardest negatives for each pair, other pairs' passages (nothing more to encode).

    On the accelerator's device; a GPU that runs out of memory for the exhaustive search hands it to the CPU.
    """
    first_row: dict[str, int] = {}  # identical texts share an id: a copy of a positive is not its negative
    ids = np.array([first_row.setdefault(text, len(first_row)) for text in texts], dtype=np.int64)
    count = config.data.mine_hard_negatives
    try:
        return mine_hard_negatives(queries, passages, count, passage_ids=ids, device=accelerator.device)
    except torch.OutOfMemoryError:
        release_freed_memory()
        logger.warning(
            f"mine_hard_negatives: {len(passages):,} passages do not fit in {accelerator.device}'s free memory; "
            "searching on the CPU instead (slower)",
            main_process_only=False,  # each process mines on its own device, and may run out alone
        )
        return mine_hard_negatives(queries, passages, count, passage_ids=ids, device="cpu")
