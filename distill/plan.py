"""The planner: what a run will cost, before it is paid for.

    python -m distill.plan [the run's flags or --config] [--device h100] [--num_machines 2] [--json]

It reads the data as the run would (`load_data`: the same caps, cleaning and held-out split), tokenizes a
seeded sample of every text list with the teacher's and the student's tokenizers (the teacher's prompts
included), and builds both models on PyTorch's meta device from their configs: configs and tokenizers only,
no weight is loaded. From these it counts, for the topology given:

- texts and tokens per phase, and the teacher cache's bytes on disk (float16 vectors, one per text);
- FLOPs: a forward pass costs 2 x (parameters outside the embedding tables) per token, plus 4 x layers x width
  x length per token for attention; training costs three forward passes;
- seconds: FLOPs / (processes x the device's achieved FLOP/s). A GPU's achieved rate is its bf16 dense peak
  times a stated utilisation (`DEVICES`), or what `--teacher_tflops` / `--student_tflops` say (measured by
  `make bench-gpu`, say). On a CPU the planner times a float32 matmul on this machine and takes a stated
  fraction of it;
- peak memory per process, all-reduce bytes per optimizer step, and the disk the checkpoints need;
- for a static student distilled here, its table's pass: each vocabulary token through the model once, as three
  tokens, on each machine.

Every assumption is printed with the figures; `--json` prints them as one object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.cache import Role
from distill.config import Config, load_config
from distill.errors import DistillError
from distill.hub import declared_max_seq_length

if TYPE_CHECKING:
    from distill.teachers.local import TeacherSpec

SAMPLE = 2000  # texts per list tokenized for the length statistics
CACHE_ENTRY_OVERHEAD = 128 + 400  # an entry's .npy header and its manifest.json
# A checkpoint's files besides the weights and AdamW's moments: RNG states, the scheduler, state.json (about 25 KB),
# and the optimizer's pickle, about 1.4 KB per parameter tensor (measured on the tiny test models).
CHECKPOINT_FIXED_BYTES, CHECKPOINT_BYTES_PER_TENSOR = 25_000, 1_400


@dataclass(frozen=True)
class DeviceKind:
    """A GPU: its dense bf16 peak, its memory and its interconnect within a machine (spec sheets)."""

    name: str
    peak_flops: float
    memory_bytes: float
    link_bytes_per_s: float  # all-reduce bus bandwidth within a machine


DEVICES = {
    "h100": DeviceKind("NVIDIA H100 SXM", 989e12, 80e9, 400e9),
    "h200": DeviceKind("NVIDIA H200", 989e12, 141e9, 400e9),
    "a100": DeviceKind("NVIDIA A100 SXM", 312e12, 80e9, 300e9),
    "l4": DeviceKind("NVIDIA L4", 121e12, 24e9, 16e9),
}
# The fractions of a GPU's peak reached. The teacher's 0.40 is assumed for a large teacher over length-sorted
# batches; the student's 0.08 is what `make bench-gpu` measured for the 110M mpnet at batch 256 on one H100
# (docs/BENCHMARKS.md, "On a GPU"). --teacher_tflops / --student_tflops replace them with measured rates.
GPU_TEACHER_UTILISATION = 0.40
GPU_STUDENT_UTILISATION = 0.08
# The fractions of this CPU's own float32 matmul rate that a run reaches, fitted on one cold `make demo` on 2 AMD
# EPYC cores (103 GFLOP/s matmul; the teacher encoded 1.47e13 FLOPs in 145 s, the student trained 1.83e13 in
# 248 s). docs/BENCHMARKS.md checks them against other runs.
CPU_TEACHER_UTILISATION = 0.95
CPU_STUDENT_UTILISATION = 0.70
INTER_MACHINE_BYTES_PER_S = 25e9  # assumed: 200 Gb/s between machines


@dataclass(frozen=True)
class Device:
    """What the plan assumes of the device each process runs on."""

    name: str
    teacher_rate: float  # achieved FLOP/s while the teacher encodes
    student_rate: float  # achieved FLOP/s while the student trains
    rates: str  # where the two rates come from
    link_bytes_per_s: float
    bytes_per_param: int  # the teacher's compute dtype: bf16 on a GPU, float32 on a CPU
    activation_bytes: int  # float32 on a CPU; bf16 autocast on a GPU keeps some tensors in float32
    base_bytes: int  # a process's memory before its models (a CPU's RSS, with the data once read; a GPU's is its own)
    memory_bytes: float = 0.0  # a GPU's memory; 0: not checked (a CPU)


def device_for(name: str, teacher_tflops: float | None, student_tflops: float | None) -> Device:
    """The device `name` (a key of DEVICES, or cpu) with its rates: measured ones where given."""
    if name == "cpu":
        from distill.efficiency import cpu_matmul_flops

        peak = cpu_matmul_flops()
        rates = f"{CPU_TEACHER_UTILISATION:.0%} / {CPU_STUDENT_UTILISATION:.0%} of this CPU's float32 matmul rate"
        rates += f" ({peak / 1e9:.0f} GFLOP/s, timed now)"
        teacher, student = peak * CPU_TEACHER_UTILISATION, peak * CPU_STUDENT_UTILISATION
        device = Device("CPU (this machine)", teacher, student, rates, 0.0, 4, 4, process_base_bytes())
    else:
        kind = DEVICES[name]
        rates = f"{GPU_TEACHER_UTILISATION:.0%} / {GPU_STUDENT_UTILISATION:.0%} of the bf16 dense peak"
        rates += f" ({kind.peak_flops / 1e12:.0f} TFLOP/s)"
        teacher, student = kind.peak_flops * GPU_TEACHER_UTILISATION, kind.peak_flops * GPU_STUDENT_UTILISATION
        device = Device(kind.name, teacher, student, rates, kind.link_bytes_per_s, 2, 3, 0, kind.memory_bytes)
    if teacher_tflops or student_tflops:
        device = replace(
            device,
            teacher_rate=teacher_tflops * 1e12 if teacher_tflops else device.teacher_rate,
            student_rate=student_tflops * 1e12 if student_tflops else device.student_rate,
            rates="measured (--teacher_tflops / --student_tflops)",
        )
    return device


@dataclass
class ModelShape:
    """A model's size and shape, from its config on the meta device."""

    parameters: int
    embedding_parameters: int  # lookup tables: no FLOPs per token
    frozen_parameters: int  # a pooler sentence-transformers never calls: no FLOPs, no gradients
    tensors: int  # parameter tensors
    layers: int
    width: int
    ffn: int
    dim: int  # the embedding the model outputs

    @property
    def dense_parameters(self) -> int:
        return self.parameters - self.embedding_parameters - self.frozen_parameters

    @property
    def trainable_parameters(self) -> int:
        return self.parameters - self.frozen_parameters

    def forward_flops(self, texts: int, mean_tokens: float, mean_square_tokens: float) -> float:
        """2 x dense parameters per token, plus attention's 4 x layers x width x length per token."""
        return texts * (2 * self.dense_parameters * mean_tokens + 4 * self.layers * self.width * mean_square_tokens)


@dataclass
class TextList:
    """One list of texts: how many, and their lengths in the teacher's and the student's tokens."""

    name: str
    phase: str  # "phase1", "phase2" or "evaluation"
    count: int
    teacher_tokens: float  # mean per text, prompt included, truncated as the teacher reads it
    teacher_square: float  # mean squared length, for attention
    student_tokens: float
    student_square: float
    student_longest: int  # the longest sampled text, as the student reads it
    teacher_longest: int = 0  # and as the teacher reads it

    @property
    def total_teacher_tokens(self) -> float:
        return self.count * self.teacher_tokens

    @property
    def total_student_tokens(self) -> float:
        return self.count * self.student_tokens


@dataclass
class Plan:
    """Every figure the planner prints."""

    device: str
    processes: int
    machines: int
    texts: dict[str, int]
    tokens: dict[str, dict[str, float]]  # phase -> {"teacher": ..., "student": ...} (one epoch)
    cache_bytes: int
    teacher_flops: float
    teacher_seconds: float
    train_flops: dict[str, float]
    train_seconds_by_phase: dict[str, float]
    train_seconds: float
    optimizer_steps: dict[str, int]
    teacher_memory_bytes: int
    student_memory_bytes: int
    allreduce_bytes_per_step: int
    allreduce_seconds_per_step: float
    checkpoint_bytes: int  # every checkpoint kept at once (--checkpoints_total_limit, plus the one being written)
    checkpoint_bytes_each: int
    parameters: dict[str, int]
    dominant: str
    device_memory_bytes: float = 0.0
    assumptions: dict[str, Any] = field(default_factory=dict)
    teacher: str = ""  # a model run here: empty; else what stands behind it (an endpoint, a vectors file)
    table_tokens: int = 0  # a static student distilled here: its vocabulary, each token through the model once
    table_flops: float = 0.0
    table_seconds: float = 0.0  # on each machine, split over its processes


def config_folder(name: str, revision: str | None) -> Path:
    """A local folder with the model's config and tokenizer files: the folder itself, the shipped copy, or the
    Hub's (configs and tokenizer only, never the weights)."""
    from distill.hub import hub_snapshot, resolve_model

    path = Path(resolve_model(name, revision))
    if path.is_dir():
        return path
    return Path(hub_snapshot(name, revision, ("*.json", "*.txt", "*.model", "tokenizer*", "*.tiktoken")))


def model_shape(folder: Path, num_layers: int | None = None, trust_remote_code: bool = False) -> ModelShape:
    """Parameters and shape of the model in `folder` (`num_layers`: cut to that many), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModel

    from distill.hub import declared_dimension

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    pooler = sum(p.numel() for n, p in model.named_parameters() if n.startswith("pooler."))
    total = sum(p.numel() for p in model.parameters())
    width = int(config.hidden_size)
    return ModelShape(
        parameters=total,
        embedding_parameters=embedding,
        frozen_parameters=pooler,
        tensors=len(list(model.parameters())),
        layers=int(config.num_hidden_layers),
        width=width,
        ffn=int(getattr(config, "intermediate_size", 4 * width) or 4 * width),
        dim=declared_dimension(str(folder)) or width,
    )


TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def tokenizer_of(folder: Path) -> Any | None:
    """The folder's tokenizer; None when it has no tokenizer files (transformers would make an empty one)."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):  # a folder with a config only
        return None


def length_stats(tokenizer: Any, texts: list[str], prompt: str, max_length: int | None) -> tuple[float, float, int]:
    """(mean, mean square, max) of the texts' lengths in tokens, as the model reads them."""
    if not texts:
        return 0.0, 0.0, 0
    encoded = tokenizer(
        [prompt + t for t in texts],
        truncation=max_length is not None,
        max_length=max_length,
        add_special_tokens=True,
        verbose=False,  # untruncated (an endpoint's texts) longer than the tokenizer's own limit is no error here
    )
    lengths = [len(ids) for ids in encoded["input_ids"]]
    return sum(lengths) / len(lengths), sum(n * n for n in lengths) / len(lengths), max(lengths)


def sample(texts: list[str], seed: int) -> list[str]:
    import numpy as np

    if len(texts) <= SAMPLE:
        return texts
    chosen = np.random.default_rng(seed).choice(len(texts), SAMPLE, replace=False)
    return [texts[i] for i in sorted(chosen)]


def text_lists(config: Config, need_phase1: bool, need_phase2: bool) -> dict[str, tuple[str, Role, list[str]]]:
    """{name: (phase, role, texts)} for every list the teacher encodes, read as the run reads them."""
    from distill.data import load_data, passage_texts

    data = load_data(config.data, config.training.seed, need_phase1, need_phase2)
    lists: dict[str, tuple[str, Role, list[str]]] = {}
    if need_phase1 and data.phase1_texts:
        lists["phase1 texts"] = ("phase1", "document", data.phase1_texts)
    if need_phase2 and len(data.phase2):
        lists["phase2 queries"] = ("phase2", "query", data.phase2.queries)
        lists["phase2 passages"] = ("phase2", "document", passage_texts(data.phase2)[0])
    if data.evaluation is not None:
        lists["evaluation queries"] = ("evaluation", "query", data.evaluation.queries)
        lists["evaluation corpus"] = ("evaluation", "document", data.evaluation.corpus)
        if data.evaluation.sts_texts:
            lists["evaluation sts"] = ("evaluation", "document", data.evaluation.sts_texts)
    return lists


def process_base_bytes() -> int:
    """This process's resident memory now, with torch, transformers and sentence-transformers imported (and, once
    the planner has read them, the data and tokenizers): what every process of a run holds before its models."""
    import psutil
    import sentence_transformers  # noqa: F401  (what a run imports)

    return int(psutil.Process().memory_info().rss)


def make_plan(
    config: Config, device: Device, machines: int = 1, phase1_texts: int | None = None, phase2_pairs: int | None = None
) -> Plan:
    """The figures for `config` on `config.launch.num_processes` processes of `device` over `machines`
    (`phase1_texts`, `phase2_pairs`: plan for that many, with the lengths of the data read)."""
    processes = config.launch.num_processes or 1
    model, training = config.model, config.training
    models = model_shapes(config)
    student = models.student
    lists = text_lists(config, not training.skip_phase1, not training.skip_phase2)
    measured, teacher_tokenizer = measure_texts(config, lists, models)
    if device.base_bytes:  # a CPU: the process's base is its RSS with the data and tokenizers a run holds, too
        device = replace(device, base_bytes=process_base_bytes())
    del lists
    measured = scale_counts(measured, phase1_texts, phase2_pairs)
    projection = student.dim * models.teacher_dim + models.teacher_dim if model.use_projection else 0
    teacher_flops, teacher_seconds, teacher_memory, cache_bytes = teacher_figures(
        config, device, models, measured, projection
    )
    table = table_figures(config, device, models, machines)
    train_flops, steps = training_flops(config, student, measured, projection // max(models.teacher_dim, 1))
    train_seconds_by_phase = {phase: flops / (processes * device.student_rate) for phase, flops in train_flops.items()}
    train_seconds = sum(train_seconds_by_phase.values())
    allreduce, link = allreduce_bytes(config, device, student, projection, machines)
    student_memory = memory(config, device, models.teachers[0], student, measured, projection)[1]
    checkpoint_one, kept = checkpoint_bytes(config, student, projection)
    return Plan(
        device=device.name,
        processes=processes,
        machines=machines,
        texts={t.name: t.count for t in measured},
        tokens=token_counts(measured),
        cache_bytes=cache_bytes,
        teacher_flops=teacher_flops,
        teacher_seconds=teacher_seconds,
        train_flops=train_flops,
        train_seconds_by_phase=train_seconds_by_phase,
        train_seconds=train_seconds,
        optimizer_steps=steps,
        teacher_memory_bytes=teacher_memory,
        student_memory_bytes=student_memory,
        allreduce_bytes_per_step=allreduce,
        allreduce_seconds_per_step=allreduce / link if allreduce and link else 0.0,
        checkpoint_bytes=checkpoint_one * kept,
        checkpoint_bytes_each=checkpoint_one,
        parameters={
            "teacher": sum(t.parameters for t in models.teachers),
            "teacher_dense": sum(t.dense_parameters for t in models.teachers),
            "student": student.parameters,
            "student_dense": student.dense_parameters,
            **({"phase1_teacher": models.phase1_teacher.parameters} if models.phase1_teacher else {}),
        },
        dominant="the teacher's encoding"
        if teacher_seconds + table["table_seconds"] >= train_seconds
        else "the student's training",
        teacher=remote_teacher(config),
        **table,
        device_memory_bytes=device.memory_bytes,
        assumptions=assumptions(device, link, teacher_tokenizer),
    )


def token_counts(measured: list[TextList]) -> dict[str, dict[str, float]]:
    """Each phase's tokens, as the teacher and as the student read them."""
    phases = list(dict.fromkeys(t.phase for t in measured))
    return {
        phase: {
            "teacher": sum(t.total_teacher_tokens for t in measured if t.phase == phase),
            "student": sum(t.total_student_tokens for t in measured if t.phase == phase),
        }
        for phase in phases
    }


def assumptions(device: Device, link: float, teacher_tokenizer: str) -> dict[str, Any]:
    """What the plan's figures rest on: the device's rates and link, which tokenizer counted, the sample's size."""
    return {
        "teacher_flops_per_second": device.teacher_rate,
        "student_flops_per_second": device.student_rate,
        "rates": device.rates,
        "interconnect_bytes_per_second": link,
        "teacher_tokenizer": teacher_tokenizer,
        "sampled_texts_per_list": SAMPLE,
        "process_base_bytes": device.base_bytes,
    }


@dataclass(frozen=True)
class Models:
    """The run's models as the planner reads them: their folders (configs and tokenizers) and shapes."""

    teacher_folder: Path  # whose tokenizer counts the teacher's tokens: the first teacher run here, or the student
    student_folder: Path
    phase1_folder: Path | None  # phase 1's own target (phase1_teacher_model), if any
    teachers: list[ModelShape]  # several when combined; an endpoint or a vectors file costs nothing here
    student: ModelShape
    phase1_teacher: ModelShape | None  # phase 1's own target

    @property
    def teacher_dim(self) -> int:
        """The width of the vectors the student learns: the members' concatenated."""
        return sum(t.dim for t in self.teachers)

    def encoders(self, phase: str) -> list[ModelShape]:
        """The models that encode a phase's texts: phase 1's own target, else the teacher's members."""
        return [self.phase1_teacher] if phase == "phase1" and self.phase1_teacher else self.teachers


def model_shapes(config: Config) -> Models:
    """The teachers', the student's and phase 1's target's configs and shapes, with no weights loaded."""
    from distill.teachers import check_teacher, teacher_names
    from distill.teachers.base import ENDPOINT_PREFIX

    model = config.model
    check_teacher(model)
    student_folder, student = student_shape(config)
    elsewhere = ModelShape(0, 0, 0, 0, 0, 0, 0, model.teacher_dimensions or student.dim)  # an endpoint, a file
    names = teacher_names(model) or [""]
    here = [name for name in names if name and not name.startswith(ENDPOINT_PREFIX)]
    folders = {name: config_folder(name, model.teacher_revision) for name in here}
    teachers = [model_shape(folders[n], None, model.trust_remote_code) if n in folders else elsewhere for n in names]
    phase1_folder = config_folder(model.phase1_teacher_model, None) if model.phase1_teacher_model else None
    phase1_teacher = model_shape(phase1_folder, None, model.trust_remote_code) if phase1_folder else None
    teacher_folder = folders[here[0]] if here else student_folder
    return Models(teacher_folder, student_folder, phase1_folder, teachers, student, phase1_teacher)


def student_shape(config: Config) -> tuple[Path, ModelShape]:
    """The student's folder (its tokenizer counts its tokens) and shape; a static student is a table of vocabulary
    size x width, which costs no FLOPs worth counting (a mean of looked-up rows)."""
    from distill.students.static import DEFAULT_DIM, is_static, source_model

    model = config.model
    if not is_static(model.student_model):
        folder = config_folder(model.student_model, None)
        return folder, model_shape(folder, model.student_num_layers, model.trust_remote_code)
    name = model.student_model
    if Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
        dim = int(json.loads((folder / "config.json").read_text()).get("hidden_dim") or DEFAULT_DIM)
    else:
        folder, dim = config_folder(source_model(name, model.teacher_model), None), model.student_dim or DEFAULT_DIM
    tokenizer = tokenizer_of(config_folder(model.student_tokenizer, None) if model.student_tokenizer else folder)
    vocabulary = len(tokenizer) if tokenizer is not None else 0
    return folder, ModelShape(vocabulary * dim, vocabulary * dim, 0, 1, 0, dim, 0, dim)


def teacher_figures(
    config: Config, device: Device, models: Models, measured: list[TextList], projection: int
) -> tuple[float, float, int, int]:
    """(FLOPs, seconds per process, peak bytes per process, cache bytes) of every teacher encoding every list once;
    a combined teacher's members are loaded one after the other and each is cached, besides the combination."""
    processes = config.launch.num_processes or 1
    flops = sum(
        shape.forward_flops(t.count, t.teacher_tokens, t.teacher_square)
        for t in measured
        for shape in models.encoders(t.phase)
    )
    shapes = models.teachers + ([models.phase1_teacher] if models.phase1_teacher else [])
    peak = max(memory(config, device, shape, models.student, measured, projection)[0] for shape in shapes)
    combined = 1 if len(models.teachers) > 1 else 0
    cache = sum(
        t.count * 2 * (sum(s.dim for s in models.encoders(t.phase)) + combined * models.teacher_dim)
        + CACHE_ENTRY_OVERHEAD
        for t in measured
    )
    return flops, flops / (processes * device.teacher_rate), peak, cache


TABLE_TOKEN_LENGTH = 3  # a vocabulary token as model2vec's distillation runs it: the token and the special tokens


def table_figures(config: Config, device: Device, models: Models, machines: int) -> dict[str, Any]:
    """The Plan's table_tokens, table_flops and table_seconds: distilling a static student's table here, every
    vocabulary token through the model once on each machine, split over its processes (distill/students/static.py);
    zeros for any other student, and for a table that starts from a folder."""
    from distill.students.static import is_static, source_model

    name = config.model.student_model
    if not is_static(name) or Path(name).expanduser().is_dir():
        return {"table_tokens": 0, "table_flops": 0.0, "table_seconds": 0.0}
    source = source_model(name, config.model.teacher_model)
    shape = model_shape(config_folder(source, None), None, config.model.trust_remote_code)
    tokens = models.student.parameters // max(models.student.dim, 1)  # the table's rows
    flops = shape.forward_flops(tokens, TABLE_TOKEN_LENGTH, TABLE_TOKEN_LENGTH**2)
    per_machine = max((config.launch.num_processes or 1) // machines, 1)
    return {"table_tokens": tokens, "table_flops": flops, "table_seconds": flops / (per_machine * device.teacher_rate)}


def allreduce_bytes(
    config: Config, device: Device, student: ModelShape, projection: int, machines: int
) -> tuple[int, float]:
    """(bytes each process sends and receives in one step's gradient all-reduce (a ring), the link's bytes/s)."""
    processes = config.launch.num_processes or 1
    gradient_bytes = 2 if config.performance.ddp_comm_hook in ("fp16", "bf16") else 4
    ring = 2 * (processes - 1) / processes
    allreduce = int(ring * (student.trainable_parameters + projection) * gradient_bytes)
    link = device.link_bytes_per_s if machines == 1 else min(device.link_bytes_per_s, INTER_MACHINE_BYTES_PER_S)
    return allreduce, link


def checkpoint_bytes(config: Config, student: ModelShape, projection: int) -> tuple[int, int]:
    """(bytes of one checkpoint: weights, AdamW's moments, the files' own overhead; how many are kept at once)."""
    one = (
        (student.parameters + projection) * 4
        + (student.trainable_parameters + projection) * 8
        + CHECKPOINT_FIXED_BYTES
        + CHECKPOINT_BYTES_PER_TENSOR * (student.tensors + (2 if projection else 0))
    )
    kept = config.checkpoint.checkpoints_total_limit + 1 if config.checkpoint.checkpoint_steps else 1
    return one, kept


def remote_teacher(config: Config) -> str:
    """What stands behind a teacher that runs elsewhere ("" for a model run here): an endpoint, a vectors file."""
    from distill.teachers import local_model
    from distill.teachers.endpoint import OPENAI_API

    model = config.model
    if local_model(model) is not None:
        return ""
    if model.teacher_model is not None:
        return f"{model.teacher_model} at {model.teacher_base_url or OPENAI_API}"
    return f"vectors from {model.teacher_vectors}"


@dataclass(frozen=True)
class RemoteTeacher:
    """An endpoint's or a vectors file's prompts, as the planner reads texts: the flags' own, no length limit."""

    model: Any  # ModelConfig
    max_seq_length: int | None = None

    def prompt(self, role: Role) -> str:
        given = self.model.teacher_query_prompt if role == "query" else self.model.teacher_document_prompt
        return given or ""


def own_token_limit(folder: Path, spec: TeacherSpec | RemoteTeacher) -> int | None:
    """The token limit a local teacher's folder declares, which it reads up to when the run gives none; None for
    an endpoint or a file (whole texts), or a folder that declares none."""
    return None if isinstance(spec, RemoteTeacher) else declared_max_seq_length(folder)


def measure_texts(
    config: Config, lists: dict[str, tuple[str, Role, list[str]]], models: Models
) -> tuple[list[TextList], str]:
    """Every text list of the run (`text_lists`) with its lengths in both tokenizers; which tokenizer counted
    the teacher's. Phase 1's own target, if any, counts phase 1's texts with its tokenizer and prompts."""
    teacher_folder, student_folder, phase1_folder = models.teacher_folder, models.student_folder, models.phase1_folder
    import torch

    from distill.students.static import is_static
    from distill.teachers import teacher_names
    from distill.teachers.base import ENDPOINT_PREFIX
    from distill.teachers.local import TeacherSpec

    model, training = config.model, config.training
    spec: TeacherSpec | RemoteTeacher = RemoteTeacher(model)  # an endpoint's or a file's: the prompts given
    here = [name for name in teacher_names(model) if not name.startswith(ENDPOINT_PREFIX)]
    if here:  # prompts and length limit as the run's (first) teacher run here reads them
        spec = TeacherSpec.from_config(replace(model, teacher_model=here[0]), torch.device("cpu"))
    student_tokenizer = tokenizer_of(student_folder)
    if student_tokenizer is None:
        raise DistillError(f"the planner needs the student's tokenizer; {student_folder} has none")
    own = tokenizer_of(teacher_folder)
    teacher_tokenizer = own or student_tokenizer
    # a teacher given no limit reads up to its own (an endpoint: the whole text)
    teacher_encoder = (teacher_tokenizer, spec, spec.max_seq_length or own_token_limit(teacher_folder, spec))
    phase1_encoder = teacher_encoder
    if phase1_folder is not None:
        phase1_spec = TeacherSpec.from_config(model, torch.device("cpu"), phase1=True)
        phase1_limit = phase1_spec.max_seq_length or own_token_limit(phase1_folder, phase1_spec)
        phase1_encoder = (tokenizer_of(phase1_folder) or student_tokenizer, phase1_spec, phase1_limit)
    student_length = None if is_static(model.student_model) else model.max_seq_length or spec.max_seq_length
    measured = []
    for name, (phase, role, texts) in lists.items():
        chosen = sample(texts, training.seed)
        tokenizer, encoder, limit = phase1_encoder if phase == "phase1" else teacher_encoder
        t_mean, t_square, t_max = length_stats(tokenizer, chosen, encoder.prompt(role), limit)
        s_mean, s_square, s_max = length_stats(student_tokenizer, chosen, "", student_length)
        measured.append(TextList(name, phase, len(texts), t_mean, t_square, s_mean, s_square, s_max, t_max))
    return (
        measured,
        "the student's tokenizer (the teacher runs elsewhere)"
        if isinstance(spec, RemoteTeacher)
        else ("the first teacher's tokenizer" if len(models.teachers) > 1 else "the teacher's tokenizer")
        if own is not None
        else "the student's tokenizer (the teacher's folder has none)",
    )


def training_flops(
    config: Config, student: ModelShape, measured: list[TextList], projection_width: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Each phase's training FLOPs (three forward passes per text, every epoch) and optimizer steps."""
    training, processes = config.training, config.launch.num_processes or 1
    epochs = {"phase1": config.phase1.epochs, "phase2": config.phase2.epochs}
    flops: dict[str, float] = {}
    steps: dict[str, int] = {}
    for phase in ("phase1", "phase2"):
        trained = [t for t in measured if t.phase == phase]
        if not trained:
            continue
        mined = config.data.mine_hard_negatives  # other pairs' passages, forwarded again as negatives
        passes = 4 if config.performance.gradient_checkpointing else 3  # checkpointing recomputes the forward pass
        per_epoch = sum(
            passes
            * student.forward_flops(
                t.count * (1 + mined if t.name == "phase2 passages" else 1), t.student_tokens, t.student_square
            )
            for t in trained
        )
        per_epoch += sum(3 * 2 * student.dim * projection_width * t.count for t in trained)  # projection mode
        flops[phase] = per_epoch * epochs[phase]
        batches = trained[0].count // (training.batch_size * processes)  # the last partial batch is dropped
        if phase == "phase1" and training.max_tokens_per_batch:  # about; padding to each batch's longest left out
            batches = max(
                1, int(trained[0].count * trained[0].student_tokens / (training.max_tokens_per_batch * processes))
            )
        steps[phase] = epochs[phase] * batches // training.gradient_accumulation_steps
    return flops, steps


def memory(
    config: Config, device: Device, teacher: ModelShape, student: ModelShape, measured: list[TextList], projection: int
) -> tuple[int, int]:
    """Peak bytes per process while the teacher encodes, and while the student trains.

    The teacher: its weights, and one layer's activations for a batch of the longest texts (hidden states, Q, K,
    V, the attention output, the MLP's two intermediate tensors). The student: float32 weights, gradients and
    AdamW's two moments and the temporary of its update, and every layer's activations kept for the backward
    pass at the longest batch (phase 2 forwards its queries and passages together). Both on top of the device's
    base: on a CPU the process's RSS with the run's imports, data and tokenizers.
    """
    training, performance = config.training, config.performance
    longest = max((t.student_longest for t in measured), default=0)
    teacher_longest = max((t.teacher_longest for t in measured), default=0)
    teacher_batch = performance.teacher_batch_size or training.batch_size
    teacher_activations = teacher_batch * teacher_longest * (5 * teacher.width + 2 * teacher.ffn)
    teacher_bytes = teacher.parameters * device.bytes_per_param + teacher_activations * device.bytes_per_param
    texts_per_step = training.batch_size * (1 if training.skip_phase2 else 2 + config.data.mine_hard_negatives)
    per_layer = texts_per_step * longest * (10 * student.width + 2 * student.ffn)
    # with gradient checkpointing each layer keeps its input only, and one layer's activations are recomputed at once
    checkpointed = student.layers * texts_per_step * longest * student.width + per_layer
    kept = checkpointed if performance.gradient_checkpointing else student.layers * per_layer
    student_bytes = (
        (student.parameters + projection) * 4
        # gradients, AdamW's two moments and the parameter-sized temporary its update holds, float32
        # (measured on a CPU: 8.0 bytes of moments and 4.3-5.1 of temporaries per parameter)
        + (student.trainable_parameters + projection) * 16
        + kept * device.activation_bytes
    )
    return int(device.base_bytes + teacher_bytes), int(device.base_bytes + student_bytes)


def scale_counts(measured: list[TextList], phase1_texts: int | None, phase2_pairs: int | None) -> list[TextList]:
    """The lists with their counts set to what the real run will read; lengths stay the sample's."""
    scaled = []
    for t in measured:
        count = t.count
        if t.phase == "phase1" and phase1_texts:
            count = phase1_texts
        elif t.phase == "phase2" and phase2_pairs:
            queries = next(q.count for q in measured if q.name == "phase2 queries")
            count = phase2_pairs * t.count // max(queries, 1)  # passages: the positive and any negatives per pair
        scaled.append(replace(t, count=count))
    return scaled


def planner_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distill.plan",
        description="What a run costs, before it runs. Takes the run's own flags (or --config) and these.",
        add_help=False,
    )
    parser.add_argument("--device", default=None, help="cpu, " + ", ".join(DEVICES) + " (default: this machine's)")
    parser.add_argument("--num_machines", type=int, default=1, help="Machines the processes are spread over.")
    parser.add_argument("--teacher_tflops", type=float, help="Measured TFLOP/s of the teacher's encoding per process.")
    parser.add_argument("--student_tflops", type=float, help="Measured TFLOP/s of the student's training per process.")
    parser.add_argument("--phase1_texts", type=int, help="Plan for this many phase-1 texts (lengths: the data's).")
    parser.add_argument("--phase2_pairs", type=int, help="Plan for this many phase-2 pairs (lengths: the data's).")
    parser.add_argument("--json", action="store_true", help="Print the figures as one JSON object.")
    return parser


def default_device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    kind = next((key for key in DEVICES if key in name), None)
    if kind is None:
        raise DistillError(
            f"the planner has no figures for {torch.cuda.get_device_name(0)}; pass --device "
            f"({', '.join(DEVICES)}) or measured rates with --teacher_tflops and --student_tflops"
        )
    return kind


def main(argv: list[str] | None = None) -> int:
    """Print the plan for the run `argv` describes; returns the exit code (2: a bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        planner_parser().print_help()
        print("\nThe run's flags: python -m distill.train --help")
        return 0
    options, run_argv = planner_parser().parse_known_args(argv)
    import logging

    from accelerate import PartialState

    logging.basicConfig(format="%(message)s")
    PartialState(cpu=True)  # data's log lines go through accelerate's logger; the planner starts no group
    try:
        name = options.device or default_device()
        if name != "cpu" and name not in DEVICES:
            raise DistillError(f"--device: expected cpu or one of {', '.join(DEVICES)}, got {name!r}")
        config = load_config(run_argv)
        device = device_for(name, options.teacher_tflops, options.student_tflops)
        plan = make_plan(config, device, options.num_machines, options.phase1_texts, options.phase2_pairs)
    except DistillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if options.json else plan_text(plan))
    return 0


def plan_text(plan: Plan) -> str:
    """The plan as the terminal shows it."""
    lines = [f"distill plan: {plan.processes} process(es) on {plan.machines} machine(s), {plan.device}", ""]
    lines.append(f"{'texts the teacher encodes':<28}{'texts':>12}{'teacher tokens':>16}{'student tokens':>16}")
    for name, count in plan.texts.items():
        lines.append(f"{name:<28}{count:>12,}")
    for phase, tokens in plan.tokens.items():
        lines.append(
            f"{'  ' + phase + ' (one epoch)':<28}{'':>12}{tokens['teacher']:>16,.0f}{tokens['student']:>16,.0f}"
        )
    lines += ["", *teacher_lines(plan)]
    if plan.table_tokens:
        lines.append(
            f"static table: {plan.table_tokens:,} vocabulary tokens through the model, {plan.table_flops:.3g} FLOPs, "
            f"{duration(plan.table_seconds)} on each machine (once; kept in the teacher cache)"
        )
    for phase, seconds in plan.train_seconds_by_phase.items():
        lines.append(
            f"student training, {phase}: {plan.train_flops[phase]:.3g} FLOPs, {plan.optimizer_steps[phase]:,} "
            f"optimizer steps, {duration(seconds)}"
        )
    lines += [
        f"student training in all: {duration(plan.train_seconds)}",
        f"peak memory per process: teacher {plan.teacher_memory_bytes / 2**30:.2f} GiB, "
        f"student {plan.student_memory_bytes / 2**30:.2f} GiB",
        "all-reduce per optimizer step: "
        + (
            f"{plan.allreduce_bytes_per_step / 1e6:,.0f} MB in and out of each process, "
            f"{plan.allreduce_seconds_per_step * 1e3:.1f} ms"
            if plan.allreduce_bytes_per_step
            else "none (one process)"
        ),
        f"checkpoints on disk: {plan.checkpoint_bytes / 1e6:,.0f} MB",
    ]
    limit = plan.device_memory_bytes
    if limit and plan.student_memory_bytes > limit:
        lines.append(
            f"does not fit: the student needs {plan.student_memory_bytes / 2**30:.0f} GiB of the device's "
            f"{limit / 2**30:.0f} GiB; lower --batch_size, or pass --gradient_checkpointing True"
        )
    if limit and plan.teacher_memory_bytes > limit:
        lines.append(
            f"does not fit: the teacher needs {plan.teacher_memory_bytes / 2**30:.0f} GiB of the device's "
            f"{limit / 2**30:.0f} GiB; lower --teacher_batch_size"
        )
    total = plan.teacher_seconds + plan.table_seconds + plan.train_seconds
    share = max(plan.teacher_seconds + plan.table_seconds, plan.train_seconds) / total if total else 0
    device_hours = total * plan.processes / 3600
    lines += [
        "",
        f"the bill: {plan.dominant} dominates ({share:.0%} of {duration(total)}; {device_hours:,.2f} device-hours "
        "before loading, evaluation and checkpoints)",
        f"assumed: {plan.assumptions['rates']}; teacher tokens counted with {plan.assumptions['teacher_tokenizer']} "
        f"on up to {SAMPLE:,} texts per list",
    ]
    return "\n".join(lines)


def teacher_lines(plan: Plan) -> list[str]:
    """The teacher's size and encoding, or for an endpoint the tokens it will be sent."""
    p = plan.parameters
    cache = f"teacher cache on disk: {plan.cache_bytes / 1e6:,.1f} MB (float16, one vector per text; paid once)"
    phase1 = f"; phase 1's target: {p['phase1_teacher'] / 1e6:,.1f}M" if "phase1_teacher" in p else ""
    if plan.teacher.startswith("vectors"):
        return [f"teacher: {plan.teacher}; student: {p['student'] / 1e6:,.1f}M{phase1}", cache]
    if plan.teacher:  # an endpoint: each text is sent once, whatever the epochs
        own = "phase1_teacher" in p  # phase 1's texts then go through its own target, here
        sent = sum(tokens["teacher"] for phase, tokens in plan.tokens.items() if not (own and phase == "phase1"))
        return [
            f"teacher: {plan.teacher}, nothing of it runs here; student: {p['student'] / 1e6:,.1f}M{phase1}",
            f"tokens sent to the endpoint: {sent:,.0f} (counted with the student's tokenizer; the endpoint's own "
            "count, which it bills, may differ)",
            cache,
        ]
    return [
        f"teacher: {p['teacher'] / 1e6:,.1f}M parameters ({p['teacher_dense'] / 1e6:,.1f}M outside the embeddings); "
        f"student: {p['student'] / 1e6:,.1f}M ({p['student_dense'] / 1e6:,.1f}M){phase1}",
        cache,
        f"teacher encoding: {plan.teacher_flops:.3g} FLOPs, {duration(plan.teacher_seconds)} per process",
    ]


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds:,.0f} s ({seconds / 60:,.1f} min)"
    return f"{seconds:,.0f} s ({seconds / 3600:,.2f} h)"


if __name__ == "__main__":
    sys.exit(main())
