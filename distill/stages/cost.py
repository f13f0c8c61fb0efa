"""The cost stage: what the student saves against the teacher, measured on the run's own device.

Both models encode the same texts with the same batch size through sentence-transformers' `encode` (the
path users deploy), after a warm-up:

- parameters, output dimension and the bytes of their weights (for the student, what the exported folder's
  weight files hold; for the teacher, its weight files, or its tensors where it has no local folder);
- throughput: texts per second over `efficiency_texts` evaluation passages, batch `batch_size`, encoded again
  until the timing has run for MIN_TIMED_SECONDS;
- latency: the median over LATENCY_REPEATS single-query `encode` calls.

A static student on a CPU is also timed as model2vec's own runtime (`StaticModel.encode`, numpy) encodes its
model2vec folder, at the same batch size and threads: the deployment its users pick for speed. On the demo's
passages the two runtimes encode at much the same rate, both mostly tokenizing; a single query takes a quarter of
the time through model2vec (no torch call, no per-text modality check).

Both are timed with the fast tokenizers free to use every core (`parallel_tokenization`), as they are where a
model serves: `make` and the tests turn that off for a training run, whose loader may fork. A transformer hardly
notices; a static table, whose encoding is mostly tokenizing, runs 1.6x faster on 2 cores.

The main process measures, the others wait; with several machines the figures are those of the main
process's device, and they say which device that is. The teacher is measured while the teacher stage has it
loaded, and its figures are kept beside the teacher cache, so a warm run does not load the teacher again; a
run that finds no record for its device loads the teacher once to measure it.

On a CPU, other work on the machine slows both models alike only if it runs during both timings. Each timing
therefore records the CPU's float32 matmul rate just before it (`machine_gflops`). A kept teacher figure timed
at a rate more than LOAD_TOLERANCE away from the rate now is timed again, and a student timed under another
load than the teacher says so in the trade-off line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator

from distill.distributed import main_decides
from distill.errors import DistillError
from distill.files import read_json, write_json_atomic

if TYPE_CHECKING:
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from distill.data.containers import DistillData

logger = logging.getLogger(__name__)

LATENCY_REPEATS = 50  # single-query encodes; the median is reported
ENDPOINT_LATENCY_REPEATS = 10  # single-query requests to a served teacher
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
COSTS_FILE = "costs.json"  # the teacher's measured figures, beside the teacher cache's entries
LOAD_TOLERANCE = 1.25  # two CPU timings compare when the CPU's matmul rates before them differ by less than this
PROBE_SECONDS = 0.2  # each of the matmul probe's three timings
MIN_TIMED_SECONDS = 1.0  # the passages are encoded again until the throughput timing has run this long


@dataclass
class ModelCost:
    """What one model costs to run: its size, and how fast it encodes on the measuring device."""

    parameters: int
    dim: int
    weights_bytes: int
    texts_per_second: float
    latency_ms: float  # median of LATENCY_REPEATS single-text encodes
    machine_gflops: float | None = None  # on a CPU: its float32 matmul rate just before the timing; None on a GPU


@dataclass(frozen=True)
class CostTexts:
    """What both models encode: a seeded sample of passages (throughput) and of queries (latency)."""

    passages: list[str]
    queries: list[str]
    batch_size: int

    @classmethod
    def from_data(cls, data: DistillData, count: int, batch_size: int, seed: int) -> CostTexts | None:
        """Evaluation passages and queries (else training texts); None when `count` is 0 (not measured)."""
        if count <= 0:
            return None
        passages: Sequence[str]
        queries: Sequence[str]
        if data.evaluation is not None:
            passages, queries = data.evaluation.corpus, data.evaluation.queries
        elif data.phase1_texts:
            passages = queries = data.phase1_texts
        else:
            passages, queries = data.phase2.passages, data.phase2.queries
        pick = random.Random(seed)
        return cls(
            pick.sample(passages, min(count, len(passages))),
            pick.sample(queries, min(LATENCY_REPEATS, len(queries))),
            batch_size,
        )

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps([self.passages, self.queries, self.batch_size]).encode())
        return digest.hexdigest()[:16]


def device_label(device: torch.device) -> str:
    """The measuring device in words: the GPU's name, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"{cpu_model()} (CPU, {torch.get_num_threads()} threads)"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_matmul_flops(seconds: float = 0.3, repeats: int = 3) -> float:
    """This machine's float32 matmul rate (FLOP/s) on the threads torch uses: the best of `repeats` timings.

    Its random matrices come from a generator of its own: drawn from torch's global one, they would shift the
    student's dropout masks by whether a run had to time its teacher (a cold cache) or not.
    """
    n = 1024
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=generator), torch.randn(n, n, generator=generator)
    a @ b  # warm-up
    best = 0.0
    for _ in range(repeats):
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            done += 1
        best = max(best, 2 * n**3 * done / (time.perf_counter() - started))
    return best


def machine_gflops(device: torch.device) -> float | None:
    """On a CPU, its float32 matmul rate now (GFLOP/s): what other work on the machine leaves it. None on a GPU."""
    if device.type != "cpu":
        return None
    return round(cpu_matmul_flops(seconds=PROBE_SECONDS) / 1e9, 1)


def same_load(first: float | None, second: float | None) -> bool:
    """Whether two timings saw the machine alike: both off a CPU, or matmul rates within LOAD_TOLERANCE."""
    if first is None or second is None:
        return first is None and second is None
    return max(first, second) <= LOAD_TOLERANCE * min(first, second)


def weights_bytes(model: torch.nn.Module, folder: str | os.PathLike | None = None) -> int:
    """Bytes of `folder`'s weight files where it is a local folder that has some, else of the model's tensors."""
    if folder is not None and Path(folder).is_dir():
        files = [p for p in Path(folder).rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
        if files:
            return sum(p.stat().st_size for p in files)
    tensors = list(model.state_dict().values())
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def parallel_tokenization() -> Iterator[None]:
    """Let Hugging Face's fast tokenizers run on every core (their default), whatever TOKENIZERS_PARALLELISM says
    outside; read by the tokenizers on each call, so it takes effect at once."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def measure(
    model: SentenceTransformer,
    texts: CostTexts,
    folder: str | os.PathLike | None = None,
    query_prompt: str = "",
    document_prompt: str = "",
) -> ModelCost:
    """`model`'s size and encoding speed on its own device (see the module docstring); prompts as it is deployed."""
    encode_kwargs: dict[str, Any] = {"batch_size": texts.batch_size, "show_progress_bar": False}
    passages = dict(encode_kwargs, prompt=document_prompt or None)
    dim, speed, latency, rate = timed(
        lambda batch: model.encode(batch, **passages),  # numpy out: the device has finished
        lambda query: model.encode([query], **encode_kwargs, prompt=query_prompt or None),
        texts,
        model.device,
    )
    return ModelCost(
        parameters=sum(p.numel() for p in model.parameters()),
        dim=dim,
        weights_bytes=weights_bytes(model, folder),
        texts_per_second=speed,
        latency_ms=latency,
        machine_gflops=rate,
    )


def measure_model2vec(model: Any, texts: CostTexts) -> ModelCost:
    """A static student as model2vec's `StaticModel` encodes it on a CPU (numpy, no torch), at the same batch size,
    in one process as the transformer's timing runs, the tokenizers on every core alike."""
    encode_kwargs: dict[str, Any] = {"batch_size": texts.batch_size, "use_multiprocessing": False}
    dim, speed, latency, rate = timed(
        lambda batch: model.encode(batch, **encode_kwargs),
        lambda query: model.encode([query], **encode_kwargs),
        texts,
        torch.device("cpu"),
    )
    return ModelCost(
        parameters=int(model.embedding.size),
        dim=dim,
        weights_bytes=int(model.embedding.nbytes),
        texts_per_second=speed,
        latency_ms=latency,
        machine_gflops=rate,
    )


def timed(
    passages: Callable[[list[str]], np.ndarray], query: Callable[[str], Any], texts: CostTexts, device: torch.device
) -> tuple[int, float, float, float | None]:
    """One encoder's output width, texts per second over the passages, median single-query ms, and the CPU's
    matmul rate just before (None off a CPU); after a warm-up batch (kernels, allocator, caches)."""
    with parallel_tokenization():
        passages(texts.passages[: texts.batch_size])
        rate = machine_gflops(device)
        done, started = 0, time.perf_counter()
        while not done or time.perf_counter() - started < MIN_TIMED_SECONDS:  # a static table: 40 ms a pass
            vectors = passages(texts.passages)
            done += len(texts.passages)
        seconds = time.perf_counter() - started
        latencies = []
        for text in texts.queries:
            started = time.perf_counter()
            query(text)
            latencies.append(time.perf_counter() - started)
    speed = round(done / max(seconds, 1e-9), 1)
    return int(vectors.shape[1]), speed, round(1000 * statistics.median(latencies), 2), rate


def measure_endpoint(
    request: Callable[[list[str]], np.ndarray], texts: CostTexts, query_prompt: str = "", document_prompt: str = ""
) -> ModelCost:
    """A served teacher's speed through its endpoint from this machine, as `measure` times a model: the passages in
    requests of the batch size, then single queries (fewer: each is a round trip). Its size is not known here."""
    request([document_prompt + t for t in texts.passages[: texts.batch_size]])  # warm-up: the connection
    started = time.perf_counter()
    widths = [
        request([document_prompt + t for t in texts.passages[i : i + texts.batch_size]]).shape[1]
        for i in range(0, len(texts.passages), texts.batch_size)
    ]
    seconds = time.perf_counter() - started
    latencies = []
    for query in texts.queries[:ENDPOINT_LATENCY_REPEATS]:
        started = time.perf_counter()
        request([query_prompt + query])
        latencies.append(time.perf_counter() - started)
    return ModelCost(
        parameters=0,
        dim=int(widths[0]),
        weights_bytes=0,
        texts_per_second=round(len(texts.passages) / max(seconds, 1e-9), 1),
        latency_ms=round(1000 * statistics.median(latencies), 2),
    )


class TeacherCosts:
    """The teacher's measured figures, kept in the teacher cache folder per (teacher, device, texts)."""

    def __init__(self, cache_dir: str | os.PathLike, teacher_key: str, device: str, texts: CostTexts):
        self.path = Path(cache_dir).expanduser() / COSTS_FILE
        fields = {"teacher": teacher_key, "device": device, "texts": texts.fingerprint(), "torch": torch.__version__}
        self.key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]

    def get(self, device: torch.device) -> ModelCost | None:
        """The kept figures, or None: none kept, or (on a CPU) timed under another load than the machine has now."""
        try:
            record = read_json(self.path).get(self.key)
            cost = ModelCost(**record) if record else None
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable, or another format: measure again
            return None
        if cost is None:
            return None
        now = machine_gflops(device)
        if not same_load(cost.machine_gflops, now):
            logger.info(
                f"the teacher's kept speed was timed with the CPU at {cost.machine_gflops} GFLOP/s of matmul, it runs "
                f"at {now} now (other work on the machine): timing the teacher again"
            )
            return None
        return cost

    def put(self, cost: ModelCost) -> None:
        """Keep `cost`; a cache folder that cannot take it is a warning (the run has its figures either way)."""
        try:
            records = read_json(self.path)
        except (OSError, ValueError):
            records = {}
        records[self.key] = asdict(cost)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, records)
        except (OSError, DistillError) as e:
            logger.warning(f"the teacher's measured costs are not kept in {self.path} ({e})")


@dataclass
class Efficiency:
    """The `efficiency` block of results.json: both models' costs on one device, and the Matryoshka widths."""

    device: str
    texts: int
    batch_size: int
    latency_repeats: int
    student: ModelCost
    teacher: ModelCost | None
    dtype: str = "float32"  # what both models computed in
    exported_bytes: int | None = None  # the whole exported folder (weights, tokenizer, config)
    teacher_note: str | None = None  # why the teacher's figures are missing or partial (an API, a vectors file)
    student_model2vec: ModelCost | None = None  # a static student on a CPU, as model2vec's own runtime encodes it
    forms: list[dict[str, Any]] | None = None  # its served forms (ONNX float32, int8): distill/stages/forms.py

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        if self.teacher is not None:
            values["ratios"] = self.ratios()
        return {k: v for k, v in values.items() if v is not None}

    def ratios(self) -> dict[str, float]:
        """Student against teacher: throughput as a speed-up; parameters, weights and latency as fractions."""
        assert self.teacher is not None
        t, s = self.teacher, self.student

        def speed(cost: ModelCost) -> tuple[float, float]:  # throughput as a speed-up, latency as a fraction
            throughput = round(cost.texts_per_second / max(t.texts_per_second, 1e-9), 2)
            return throughput, round(cost.latency_ms / max(t.latency_ms, 1e-9), 2)

        ratios = dict(zip(("throughput", "latency"), speed(s)))
        if self.student_model2vec is not None:
            ratios["throughput_model2vec"], ratios["latency_model2vec"] = speed(self.student_model2vec)
        if t.parameters:  # a served teacher's size is not known here
            ratios["parameters"] = round(s.parameters / max(t.parameters, 1), 2)
            ratios["weights"] = round(s.weights_bytes / max(t.weights_bytes, 1), 2)
        return ratios


def measure_student(
    accelerator: Accelerator,
    student: SentenceTransformer,
    teacher: ModelCost | None,
    texts: CostTexts,
    dtype: str = "float32",
    teacher_note: str | None = None,
    own_runtime: Callable[[SentenceTransformer, CostTexts], ModelCost | None] | None = None,
) -> Efficiency:
    """The deployable student measured on the main process (the others wait), beside the teacher's figures.

    It encodes in `dtype`, the teacher's compute dtype (a bfloat16 copy where a GPU runs the teacher in bfloat16),
    so that both models are timed alike; its weight bytes are those of the exported float32 folder. `own_runtime`:
    the student's kind's own figure, where it has one (a static table through model2vec's runtime).
    """

    def measured() -> tuple[ModelCost, ModelCost | None]:
        model = student if dtype == "float32" else copy.deepcopy(student).to(getattr(torch, dtype))
        cost = dataclasses.replace(measure(model, texts), weights_bytes=weights_bytes(student))
        return cost, own_runtime(student, texts) if own_runtime is not None else None

    cost, model2vec_cost = main_decides(accelerator, measured)
    return Efficiency(
        device=device_label(accelerator.device),
        texts=len(texts.passages),
        batch_size=texts.batch_size,
        latency_repeats=len(texts.queries),
        student=cost,
        teacher=teacher,
        dtype=dtype,
        teacher_note=teacher_note,
        student_model2vec=model2vec_cost,
    )
