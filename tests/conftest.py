"""Tiny offline fixtures: random-init BERT SentenceTransformers built once per session, and small data files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import string
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a 2-core machine: one thread each (and in each process a test starts), or
    # their OpenMP threads spin against each other and a tiny run takes 8x as long
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
# Started in the background of a shell without job control (`make test &` in a script), the suite inherits SIGINT
# ignored, and so would every process it starts; distill keeps an ignored SIGINT ignored (such a run is not meant to
# stop on Ctrl-C), so the tests that send SIGINT need Python's own handler back. A terminal or CI start has it already.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

WORDS = (
    "the a of and to in is was for on that with as by at from his her it an were are which this be or "
    "has had not but their one its first new after who they have two been year city time more other "
    "query passage river music king war state film team game church school world water light stone"
).split()


def tiny_tokenizer(raw: Path, padding_side: str = "right") -> int:
    """A word-level BERT tokenizer over WORDS (each one token) saved to `raw`; returns its vocabulary size."""
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits, *".,!?'-"]
    vocab += [f"##{c}" for c in string.ascii_lowercase + string.digits] + WORDS
    ids = {token: i for i, token in enumerate(dict.fromkeys(vocab))}
    # transformers 5 ignores `vocab_file` here (the tokenizer kept its 5 special tokens and read every word as
    # [UNK]); the mapping itself is what it takes.
    tokenizer = BertTokenizerFast(vocab=ids, do_lower_case=True, padding_side=padding_side)
    assert len(tokenizer) == len(ids) and "[UNK]" not in tokenizer.tokenize(" ".join(WORDS) + ".")
    tokenizer.save_pretrained(raw)
    return len(ids)


def save_sentence_transformer(raw: Path, pooling_mode: str) -> Path:
    """The Hugging Face model in `raw` as a SentenceTransformer (`pooling_mode` pooling + Normalize) in `../st`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(raw), max_seq_length=64)
    pooling = Pooling(transformer.get_word_embedding_dimension(), pooling_mode)
    folder = raw.parent / "st"
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(
        str(folder), create_model_card=False
    )
    saved = SentenceTransformer(str(folder), device="cpu").tokenizer  # what every test loads
    assert all(saved.tokenize(word) == [word] for word in WORDS), "a tiny-model word is not one vocabulary token"
    return folder


def build_tiny_model(folder: Path, hidden: int, layers: int, seed: int, dropout: float = 0.0) -> Path:
    """A random-init BERT SentenceTransformer (mean pooling + Normalize), dropout off unless given, saved to
    `folder`."""
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "hf"
    raw.mkdir(exist_ok=True)
    vocab_size = tiny_tokenizer(raw)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(raw)
    return save_sentence_transformer(raw, "mean")


def build_tiny_decoder(folder: Path, seed: int = 4) -> Path:
    """A Qwen3-Embedding-like SentenceTransformer: a 4-layer 32-d decoder saved in bfloat16, left padding,
    last-token pooling + Normalize (the layout of today's LLM-based embedding models, at toy size)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    raw = folder / "hf"
    raw.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        vocab_size=tiny_tokenizer(raw, padding_side="left"),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    Qwen3Model(config).to(torch.bfloat16).save_pretrained(raw)
    return save_sentence_transformer(raw, "lasttoken")


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """A folder `make` fills once per test session: under pytest-xdist, by the first worker that asks, while the
    others wait for it (a file lock) and then read it. Runs compared against by several tests, and the tiny
    models they name by path (a checkpoint or a teacher cache entry records the path), are made this way."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder = base / name
    with FileLock(str(base / f"{name}.lock")):
        if not (folder / ".made").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / ".made").touch()
    return folder


# hidden, layers, seed, dropout: the students train without dropout, so runs that should match do so exactly; the
# one with dropout is for a resume, which must continue torch's generator as the stopped run left it
TINY_MODELS = {
    "teacher": (48, 2, 1, 0.0),
    "student": (32, 4, 2, 0.0),
    "wide_student": (64, 2, 3, 0.0),
    "dropout_student": (32, 4, 2, 0.1),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{'teacher': 48-d 2-layer, 'student': 32-d 4-layer, 'wide_student': 64-d 2-layer, 'dropout_student'}
    model folders."""

    def make(root: Path) -> None:
        for name, (hidden, layers, seed, dropout) in TINY_MODELS.items():
            build_tiny_model(root / name, hidden=hidden, layers=layers, seed=seed, dropout=dropout)

    root = shared_folder(tmp_path_factory, "tiny_models", make)
    return {name: root / name / "st" for name in TINY_MODELS}


def build_tiny_reranker(folder: Path, hidden: int = 32, seed: int = 5) -> Path:
    """A random-init 2-layer BERT cross-encoder (one score per pair), dropout off, saved by sentence-transformers."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    raw = folder / "hf"
    raw.mkdir(parents=True, exist_ok=True)
    config = BertConfig(
        vocab_size=tiny_tokenizer(raw),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=1,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(raw)
    saved = folder / "cross-encoder"
    CrossEncoder(str(raw), max_length=64, device="cpu").save_pretrained(str(saved))
    return saved


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory) -> Path:
    """A tiny cross-encoder folder (`build_tiny_reranker`)."""
    return shared_folder(tmp_path_factory, "tiny_reranker", build_tiny_reranker) / "cross-encoder"


def sentences(count: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + "." for _ in range(count)]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Phase-1 texts (.txt) and phase-2 pairs with one hard negative (.jsonl)."""

    def make(root: Path) -> None:
        (root / "texts.txt").write_text("\n".join(sentences(256, seed=1)) + "\n")
        queries, passages, negatives = sentences(160, 2), sentences(160, 3), sentences(160, 4)
        with open(root / "pairs.jsonl", "w") as out:
            for q, p, n in zip(queries, passages, negatives):
                out.write(json.dumps({"query": q, "passage": p + " " + q, "negative": n}) + "\n")

    root = shared_folder(tmp_path_factory, "tiny_data", make)
    return {"texts": root / "texts.txt", "pairs": root / "pairs.jsonl"}


NANOBEIR_STAND_IN = ("scifact", "nfcorpus")


def write_dataset_folder(root: Path, subsets: dict[str, dict[str, list[dict]]]) -> Path:
    """A local folder `datasets.load_dataset(root, SUBSET, split=SPLIT)` reads, as a Hub dataset with subsets does:
    `subsets[SUBSET][SPLIT]` is that split's rows, written as SUBSET/SPLIT.jsonl and named in README.md's `configs`."""
    header = ""
    for subset, splits in subsets.items():
        header += f"- config_name: {subset}\n  data_files:\n"
        for split, records in splits.items():
            (root / subset).mkdir(parents=True, exist_ok=True)
            (root / subset / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            header += f"  - split: {split}\n    path: {subset}/{split}.jsonl\n"
    (root / "README.md").write_text(f"---\nconfigs:\n{header}---\n")
    return root


def write_nanobeir_stand_in(root: Path) -> Path:
    """A local folder in sentence-transformers/NanoBEIR-en's format (subsets corpus, queries, qrels; one split per
    dataset, NanoSciFact...), small: 24 passages and 8 queries per dataset, some with two relevant passages."""
    subsets: dict[str, dict[str, list[dict]]] = {"corpus": {}, "queries": {}, "qrels": {}}
    for number, name in enumerate(NANOBEIR_STAND_IN):
        split = {"scifact": "NanoSciFact", "nfcorpus": "NanoNFCorpus"}[name]
        passages, queries = sentences(24, 10 + number), sentences(8, 20 + number)
        corpus = [{"_id": f"d{i}", "text": p} for i, p in enumerate(passages)] + [{"_id": "empty", "text": ""}]
        corpus[:7] = [{"_id": f"d{i}", "text": f"{passages[i]} {queries[i]}"} for i in range(7)]
        subsets["corpus"][split] = corpus
        subsets["queries"][split] = [{"_id": f"q{i}", "text": q} for i, q in enumerate(queries)]
        # query i: passage i (its words added), and query 0 also passage 5; query 7 has no judgement
        subsets["qrels"][split] = [{"query-id": f"q{i}", "corpus-id": f"d{i}"} for i in range(7)] + [
            {"query-id": "q0", "corpus-id": "d5"}
        ]
    return write_dataset_folder(root, subsets)


def write_mteb_retrieval_stand_in(root: Path) -> Path:
    """A local folder in MTEB's retrieval format (subsets corpus, queries, default = qrels; split test)."""
    passages, queries = sentences(30, 11), sentences(10, 12)
    corpus = [
        {"_id": f"d{i}", "title": "", "text": f"{p} {queries[i] if i < 10 else ''}"} for i, p in enumerate(passages)
    ]
    return write_dataset_folder(
        root,
        {
            "corpus": {"test": corpus},
            "queries": {"test": [{"_id": f"q{i}", "text": q} for i, q in enumerate(queries)]},
            "default": {"test": [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in range(10)]},
        },
    )


@pytest.fixture(scope="session")
def nanobeir_stand_in(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "nanobeir", write_nanobeir_stand_in)


def teacher_spec(device: object, phase1: bool = False, **flags: object) -> object:
    """The TeacherSpec a run with these flags makes: the teacher's settings, and the student's token limit as its
    kind reports it (distill.pipeline.teacher_context)."""
    from distill.config import FLAGS, Config
    from distill.pipeline import teacher_context
    from distill.teachers.local import TeacherSpec

    config = Config()
    for flag, value in flags.items():
        leaf = FLAGS[flag]
        setattr(getattr(config, leaf.section), leaf.name, value)
    return TeacherSpec.from_config(config.teacher, teacher_context(config, device), phase1=phase1)


def tiny_run_flags(tiny_models: dict[str, Path], tiny_data: dict[str, Path], out: Path, **overrides) -> list[str]:
    """Flags for a fast end-to-end run on the tiny models and data."""
    flags = {
        "teacher_model": tiny_models["teacher"],
        "student_model": tiny_models["student"],
        "phase1_data": tiny_data["texts"],
        "phase2_data": tiny_data["pairs"],
        "eval_data": "auto",
        "max_eval_queries": 16,
        "batch_size": 8,
        "phase1_epochs": 1,
        "phase2_epochs": 1,
        "phase1_lr": 1e-3,
        "phase2_lr": 1e-3,
        "max_seq_length": 32,
        "output_dir": out,
        "artifacts_dir": out / "artifacts",
        "teacher_cache_dir": out / "cache",
        "seed": 7,
        "export_onnx": "false",  # the ONNX forms: tests/test_forms.py, and the MiniLM run in tests/test_train.py
        # the cost stage times each model for a second or more (distill/stages/cost.py): the tests of its figures
        # (tests/test_efficiency.py, and the runs here that check results.json's efficiency block) turn it on
        "efficiency_texts": 0,
    }
    flags.update(overrides)
    argv = []
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    return argv


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons, so the next Accelerator starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test's Accelerator starts clean."""
    yield
    reset_accelerate()


@pytest.fixture(autouse=True)
def steady_cpu_probe(monkeypatch):
    """The cost stage's CPU load probe reads one fixed rate in this process: a kept teacher figure is reused whatever
    the suite's workers do meanwhile, and no tiny run spends a second timing matmuls or passes. Runs started as
    separate processes probe and time for real."""
    monkeypatch.setattr("distill.stages.cost.machine_gflops", lambda device: 100.0 if device.type == "cpu" else None)
    monkeypatch.setattr("distill.stages.cost.MIN_TIMED_SECONDS", 0.0)  # one pass over a tiny run's passages


@pytest.fixture
def local_hub(monkeypatch):
    """The Hub's API served on this machine (tests/hub_server.py), and a token for it."""
    import huggingface_hub.constants
    from hub_server import HubServer

    with HubServer() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_local_stand_in")
        yield hub


@pytest.fixture
def partial_state():
    """A one-process CPU accelerate state: distill logs through accelerate's logger, which needs one (the pipeline
    makes it first). Reset after the test by `fresh_accelerate_state`."""
    from accelerate import PartialState

    return PartialState(cpu=True)


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator (reset after the test by `fresh_accelerate_state`)."""
    from accelerate import Accelerator

    return Accelerator(cpu=True)


# What an end-to-end test calls: the command line, a launcher, a child process. `make test-fast` leaves out the
# tests that call one of these, themselves or through a fixture, with the slow and multi-process ones.
PIPELINE_CALLS = ("main(", "launch(", "subprocess.", "run_ddp")


def _runs_the_pipeline(item: pytest.Item) -> bool:
    import inspect

    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        functions += [d.func for defs in info.name2fixturedefs.values() for d in defs]
    for function in functions:
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            continue
        if any(call in source for call in PIPELINE_CALLS):
            return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Import the libraries every test process uses, then freeze the garbage collector's view of them: the
    pipeline's `gc.collect()` between stages then walks what the tests made, not torch's and transformers'
    objects (half a second a call, three calls a run, here)."""
    import gc

    import sentence_transformers  # noqa: F401
    import torch  # noqa: F401

    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _runs_the_pipeline(item):
            item.add_marker(pytest.mark.e2e)
