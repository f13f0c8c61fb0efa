"""A teacher loaded here: a SentenceTransformer whose forward pass each process runs on its share of the texts.

The model is loaded on the first cache miss (one download per machine), in the compute dtype the device runs
fast and safely (`teacher_dtype`), with the prompts it declares for queries and documents unless the flags name
others. Texts are sorted by their exact token count before they are batched: `encode` sorts by characters, which
leaves 32-43% padding on the benchmark's texts against about 1% (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.errors import DistillError
from distill.files import read_json
from distill.hub import (
    ModelShape,
    config_folder,
    hub_snapshot,
    load_sentence_transformer,
    model_fingerprint,
    model_shape,
    resolve_model,
)
from distill.stages.cost import CostTexts, ModelCost, TeacherCosts, measure
from distill.store import Role
from distill.teachers.sources import Encoder, TeacherContext, TeacherKind
from distill.tokens import TOKENIZE_CHUNK

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.config.schema import TeacherConfig

logger = get_logger(__name__)


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
    def from_config(
        cls, config: TeacherConfig, context: TeacherContext, name: str | None = None, phase1: bool = False
    ) -> TeacherSpec:
        """The teacher `name` (default: --teacher_model); with `phase1`, phase 1's own target
        (`phase1_teacher_model`: its own prompts, its latest revision)."""
        dtype = teacher_dtype(config.teacher_dtype, context.device)
        # Unset, the teacher reads what the student reads; the teacher's own limit only when the student's is unknown.
        max_length = config.teacher_max_seq_length or context.student_tokens
        trust = context.trust_remote_code
        if phase1:
            assert config.phase1_teacher_model is not None
            path = resolve_model(config.phase1_teacher_model)
            declared = teacher_prompts(path)
            query, document = (role_prompt(declared, None, role, path) for role in ("query", "document"))
            return cls(path, None, max_length, query, trust, dtype, document)
        name = name or config.teacher_model
        assert name is not None, "a local teacher is a model"
        path = resolve_model(name, config.teacher_revision)
        declared = teacher_prompts(path, config.teacher_revision)
        query = role_prompt(declared, config.teacher_query_prompt, "query", path)
        document = role_prompt(declared, config.teacher_document_prompt, "document", path)
        return cls(path, config.teacher_revision, max_length, query, trust, dtype, document)

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


NON_FINITE_FIX = {
    "float16": "float16 overflows in this teacher's activations: pass --teacher_dtype bfloat16 (GPUs of compute "
    "capability 8+) or float32",
    "bfloat16": "pass --teacher_dtype float32",
    "float32": "check the teacher's weights for NaN or inf values (a broken or partly written checkpoint)",
}


def weights_identity(accelerator: Accelerator | None, path: str, revision: str | None, memo: Path) -> str:
    """A model's weights' digest (or its Hub commit), remembered in `memo`. Collective: each machine's first process
    reads the weights, the others find its digests."""
    if accelerator is None or accelerator.num_processes == 1:
        return model_fingerprint(path, revision, memo=memo)
    with accelerator.local_main_process_first():
        return model_fingerprint(path, revision, memo=memo)


def free_device_memory() -> None:
    """What a released model held: its host objects collected, and the GPU's cached blocks returned."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_finite(vectors: np.ndarray, rows: np.ndarray, texts: Sequence[str], role: Role, spec: TeacherSpec) -> None:
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


def tokenize_ahead(device: torch.device) -> bool:
    """Whether the teacher's next batch is tokenized in a background thread: on accelerators, not on a CPU."""
    return device.type != "cpu"


def token_lengths(
    model: SentenceTransformer, texts: Sequence[str], max_length: int | None, chunk_size: int = TOKENIZE_CHUNK
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


class LocalTeacher:
    """A SentenceTransformer teacher loaded on the first cache miss, encoding each process's share of the texts."""

    cost_note: str | None = None

    def __init__(self, spec: TeacherSpec, name: str | None = None):
        self.spec = spec
        self.name = name or spec.path  # as the flags name it (a Hub name rather than the folder it resolved to)
        self.model: SentenceTransformer | None = None
        self.loaded = False  # whether it was loaded to encode (it is freed afterwards)
        self.load_seconds = 0.0  # importing sentence-transformers, reading the weights, moving them to the device

    # what a cache entry's manifest records (distill.cache.TeacherDescription)
    @property
    def path(self) -> str:
        return self.spec.path

    @property
    def revision(self) -> str | None:
        return self.spec.revision

    @property
    def max_seq_length(self) -> int | None:
        return self.spec.max_seq_length

    def prompt(self, role: Role) -> str:
        return self.spec.prompt(role)

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        """The digest of its weights' files (or its Hub commit), remembered in `memo`."""
        return weights_identity(accelerator, self.spec.path, self.spec.revision, memo)

    def key_fields(self, role: Role) -> dict[str, object]:
        return {
            "prompt": self.spec.prompt(role),
            "max_seq_length": self.spec.max_seq_length,
            "normalize": True,
            "compute_dtype": self.spec.compute_dtype,
        }

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        """Per batch what `SentenceTransformer.encode` does (`preprocess` with the prompt, forward, normalise),
        batches sorted by exact token count. On a GPU the next batch is tokenized in a background thread while this
        one runs, since a small teacher otherwise waits for the tokenizer between batches; on a CPU the forward
        pass already keeps every core busy."""
        teacher = self.load(accelerator)  # first, so that importing sentence-transformers counts as loading
        from sentence_transformers.util import batch_to_device

        prompt = self.spec.prompt(role)
        lengths = np.asarray(token_lengths(teacher, [prompt + t for t in texts], teacher.max_seq_length))

        @torch.inference_mode()
        def encode(features: dict) -> torch.Tensor:
            embeddings = teacher(batch_to_device(features, teacher.device))["sentence_embedding"]
            return torch.nn.functional.normalize(embeddings.float(), p=2, dim=1)

        def tokenize(indices: list[int]) -> dict:
            return teacher.preprocess([texts[i] for i in indices], prompt=prompt or None)

        def tokenize_and_encode(indices: list[int]) -> torch.Tensor:
            return encode(tokenize(indices))

        ahead = tokenize_ahead(teacher.device)
        return Encoder(
            lengths=lengths,
            encode=encode if ahead else tokenize_and_encode,
            prepare=tokenize if ahead else None,
            too_long_hint=(
                f"lower --teacher_max_seq_length (the teacher reads up to {teacher.max_seq_length} tokens) or run "
                "the teacher on a GPU with more memory"
            ),
            check=lambda vectors, rows: check_finite(vectors, rows, texts, role, self.spec),
        )

    def load(self, accelerator: Accelerator) -> SentenceTransformer:
        if self.model is None:
            started = time.perf_counter()
            with accelerator.local_main_process_first():  # one download per machine
                self.model = self.load_here(accelerator.device)
            self.loaded = True
            self.load_seconds += time.perf_counter() - started
        return self.model

    def load_here(self, device: torch.device) -> SentenceTransformer:
        """The teacher on this process alone (no barrier): `load` keeps it, the cost stage measures it once."""
        spec = self.spec
        teacher = load_teacher(spec.path, device, spec.revision, spec.trust_remote_code, spec.compute_dtype)
        if spec.max_seq_length:
            teacher.max_seq_length = spec.max_seq_length
        return teacher

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost:
        """Its size and speed on this device: kept figures, else measured (loading it on this process)."""
        cost = costs.get(accelerator.device)
        if cost is None:
            teacher = self.model or self.load_here(accelerator.device)
            folder = self.spec.path if Path(self.spec.path).is_dir() else None
            cost = measure(teacher, texts, folder, self.spec.prompt("query"), self.spec.prompt("document"))
            costs.put(cost)
        return cost

    def release(self) -> None:
        self.model = None
        free_device_memory()


class LocalKind(TeacherKind):
    """A SentenceTransformer loaded here: the kind every name falls back to."""

    name = "local model"
    scope = "a teacher loaded here"
    how = "pass a model's name or folder to --teacher_model"

    def claims(self, name: str) -> bool:
        return True

    def make(self, name: str, settings: TeacherConfig, context: TeacherContext) -> LocalTeacher:
        return LocalTeacher(TeacherSpec.from_config(settings, context, name), name)

    def figures(self, name: str, settings: TeacherConfig, trust_remote_code: bool) -> tuple[Path, ModelShape]:
        folder = config_folder(name, settings.teacher_revision)
        return folder, model_shape(folder, None, trust_remote_code)


LOCAL = LocalKind()
