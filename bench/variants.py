"""The benchmark's variants that are not the toolkit itself, each run alone in its own process by bench/run.py.

    python bench/variants.py VARIANT SPEC.json RESULT.json

- `eval_teacher`: writes the evaluation set (queries, corpus, relevant) and scores the teacher on it, once.
- `peer`: sentence-transformers' own recipe: teacher `encode` into a label column, then
  `SentenceTransformerTrainer` + `MSELoss` (random batches, as the trainer makes them), then scored
  (on the CPU by default; bench/gpu.py passes `"device": "cuda", "bf16": true` and no evaluation file).
- `floor_grouped` / `floor_random`: the bare cost of the student: a plain PyTorch loop (forward, the toolkit's
  alignment loss to precomputed teacher vectors, backward, fused AdamW step) over pre-collated batches: the
  toolkit's own length-grouped batches, or random batches padded to their longest member.
- `score`: nDCG@10 of saved SentenceTransformer folders (the toolkit's exported students).

Every variant writes its figures as JSON; the parent reads its peak RSS from the kernel (wait4).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

EVAL_BATCH = 64


def load_texts(spec: dict) -> list[str]:
    """The workload exactly as the toolkit reads it (same cleaning, same cap)."""
    from accelerate import PartialState

    from distill.data import load_phase1_texts

    PartialState()  # distill's loaders log through accelerate, which wants its state initialised
    return load_phase1_texts(spec["texts_file"], spec["samples"])


def load_eval(spec: dict) -> dict:
    return json.loads(Path(spec["eval_file"]).read_text())


def retrieval_scores(model, evaluation: dict, max_length: int) -> dict[str, float]:
    """nDCG@10 / MRR@10 of a SentenceTransformer on the evaluation set, scored as the toolkit scores."""
    from distill.metrics import retrieval_metrics

    model.eval()
    model.max_seq_length = max_length
    kwargs = {"batch_size": EVAL_BATCH, "normalize_embeddings": True, "show_progress_bar": False}
    queries = model.encode(evaluation["queries"], **kwargs)
    corpus = model.encode(evaluation["corpus"], **kwargs)
    return retrieval_metrics(queries, corpus, evaluation["relevant"])


def eval_teacher(spec: dict) -> dict:
    """Build the evaluation set once (file shared by every variant) and score the teacher on it."""
    from distill.data.reading import embedded_eval_set
    from distill.teachers.local import load_teacher

    e = embedded_eval_set(spec["seed"], spec["eval_queries"])
    queries, corpus, relevant = e.queries, e.corpus, e.relevant
    if spec.get("eval_corpus_of_queries_only"):  # --quick: a small corpus, only the queries' own passages
        corpus, relevant = [corpus[r] for r in relevant], list(range(len(relevant)))
    evaluation = {"queries": queries, "corpus": corpus, "relevant": relevant}
    Path(spec["eval_file"]).write_text(json.dumps(evaluation))
    teacher = load_teacher(spec["teacher"], "cpu")
    return {"queries": len(queries), "corpus": len(corpus), **retrieval_scores(teacher, evaluation, spec["max_length"])}


def peer(spec: dict) -> dict:
    """sentence-transformers' recipe: encode into a label column, then the trainer with MSELoss."""
    from datasets import Dataset
    from transformers import set_seed

    from distill.hub import resolve_model

    texts = load_texts(spec)
    # The teacher's time starts before sentence-transformers is first imported, as in the toolkit, which
    # imports it lazily when it loads the teacher: both figures carry that import (a few seconds).
    started = time.perf_counter()
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MSELoss

    from distill.students.transformer import load_student

    device, bf16 = spec.get("device", "cpu"), spec.get("bf16", False)
    kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if bf16 else {}  # the toolkit's teacher on GPUs
    teacher = SentenceTransformer(resolve_model(spec["teacher"]), device=device, **kwargs)
    teacher.max_seq_length = spec["max_length"]
    synchronize(device)
    encode_started = time.perf_counter()
    labels = teacher.encode(texts, batch_size=spec["batch_size"], show_progress_bar=False)  # (n, dim), unit
    labels = np.asarray(labels, dtype=np.float32)
    synchronize(device)
    teacher_seconds = time.perf_counter() - started
    encode_seconds = time.perf_counter() - encode_started  # the `encode` call alone, without import and loading
    del teacher

    set_seed(spec["seed"])
    student = load_student(spec["student"], num_layers=spec["layers"], max_seq_length=spec["max_length"])
    dataset = Dataset.from_dict({"text": texts, "label": labels.tolist()})
    steps = math.ceil(len(texts) / spec["batch_size"])
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(spec["out_dir"]) / "trainer"),
        per_device_train_batch_size=spec["batch_size"],
        num_train_epochs=1,
        learning_rate=spec["lr"],
        warmup_steps=int(spec["warmup_ratio"] * steps),  # the toolkit's warm-up, in steps
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_grad_norm"],
        seed=spec["seed"],
        report_to="none",
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        bf16=bf16,
        use_cpu=device == "cpu",
    )
    trainer = SentenceTransformerTrainer(model=student, args=args, train_dataset=dataset, loss=MSELoss(student))
    started = time.perf_counter()
    trainer.train()
    synchronize(device)
    train_seconds = time.perf_counter() - started
    result = {
        "teacher_seconds": teacher_seconds,
        "teacher_encode_seconds": encode_seconds,
        "train_seconds": train_seconds,
        "train_samples": len(texts),
    }
    if spec.get("eval_file"):
        result.update(retrieval_scores(student, load_eval(spec), spec["max_length"]))
    return result


def train_steps(
    student,
    collated: list[tuple[dict, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    dims: list[int] | None,
    precision: str = "fp32",
    split: bool = False,
) -> dict:
    """The floor's loop: per batch, forward, the toolkit's alignment loss to the targets, backward, optimizer step.

    Returns the seconds taken (the GPU's queued work included) and the last loss; with `split`, the device is
    synchronised between forward, backward and optimizer step, and their mean milliseconds are returned too.
    """
    from distill.losses import LossWeights, alignment_loss

    weights = LossWeights()
    device = collated[0][1].device.type
    autocast = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    sync = functools.partial(synchronize, device)
    sync()
    started = time.perf_counter()
    for features, target in collated:
        t0 = time.perf_counter()
        with autocast:
            embedding = student(dict(features))["sentence_embedding"]
            loss = alignment_loss(embedding.float(), target, weights, dims)
        if split:
            sync()
            t1 = time.perf_counter()
        loss.backward()
        if split:
            sync()
            t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if split:
            sync()
            t3 = time.perf_counter()
            parts["forward"] += t1 - t0
            parts["backward"] += t2 - t1
            parts["optimizer"] += t3 - t2
    sync()
    seconds = time.perf_counter() - started
    result = {"seconds": seconds, "final_loss": float(loss.detach())}
    if split:
        result["split_ms_per_step"] = {k: round(1000 * v / len(collated), 2) for k, v in parts.items()}
    return result


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that a host clock read next times it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cached_teacher_vectors(spec: dict, texts: list[str]) -> np.ndarray:
    """The toolkit's own cached teacher vectors of `texts` (float16), looked up by the toolkit's cache key."""
    from distill.config import TeacherConfig
    from distill.stages.targets import TeacherCache
    from distill.store import read_entry
    from distill.teachers import TeacherContext
    from distill.teachers.local import LocalTeacher, TeacherSpec

    context = TeacherContext("cpu", student_tokens=spec["max_length"])
    source = LocalTeacher(TeacherSpec.from_config(TeacherConfig(teacher_model=spec["teacher"]), context))
    cache = TeacherCache(None, source, spec["cache_dir"], 1)
    key = cache.key(texts, "document")
    vectors = read_entry(Path(spec["cache_dir"]).expanduser() / key, key, len(texts))
    if vectors is None:
        raise SystemExit(f"no teacher cache entry for these texts under {spec['cache_dir']}; run the toolkit first")
    return vectors


def floor(spec: dict, grouped: bool) -> dict:
    """Forward, loss, backward, AdamW step over pre-collated batches; nothing else is timed."""
    from distill.batching import LengthGroupedBatchSampler
    from distill.students.head import embedding_dim, matryoshka_dims
    from distill.students.transformer import load_student
    from distill.tokens import TokenizedTexts

    texts = load_texts(spec)
    targets = cached_teacher_vectors(spec, texts)
    torch.manual_seed(spec["seed"])
    student = load_student(
        spec["student"],
        num_layers=spec["layers"],
        max_seq_length=spec["max_length"],
        attention_dropout=spec["attention_dropout"],  # the toolkit's student, so the same compute per batch
    )
    tokens = TokenizedTexts(
        student.tokenizer, texts, student.max_seq_length, pad_to_multiple_of=spec["pad_to_multiple_of"]
    )
    size = spec["batch_size"]
    if grouped:  # the toolkit's batches: same sampler, same seed, same global batch size, epoch 0
        batches = list(LengthGroupedBatchSampler(tokens.lengths, size, spec["seed"]))
    else:  # what a plain DataLoader(shuffle=True) gives, last partial batch dropped like the toolkit's
        order = np.random.default_rng(spec["seed"]).permutation(len(tokens)).tolist()
        batches = [order[i : i + size] for i in range(0, len(order) - size + 1, size)]
    collated = [
        (tokens.features(b), torch.from_numpy(np.asarray(targets[b], dtype=np.float32)))  # (batch, 384)
        for b in batches
    ]
    real = sum(int(tokens.lengths[b].sum()) for b in batches)
    padded = sum(int(f["input_ids"].numel()) for f, _ in collated)
    dims = matryoshka_dims(embedding_dim(student), None)  # the toolkit's Matryoshka loss: 384, 192, 96
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=spec["lr"], fused=True)  # the one-kernel update, as the toolkit's
    student.train()
    timing = train_steps(student, collated, optimizer, dims)
    return {
        "teacher_seconds": 0.0,
        "train_seconds": timing["seconds"],
        "train_samples": len(batches) * size,
        "padding_fraction": 1 - real / padded,
        "final_loss": timing["final_loss"],
    }


def score(spec: dict) -> dict:
    """nDCG@10 / MRR@10 of each saved model in spec["models"] (name -> folder)."""
    from distill.hub import load_sentence_transformer

    evaluation = load_eval(spec)
    return {
        name: retrieval_scores(load_sentence_transformer(folder, "cpu"), evaluation, spec["max_length"])
        for name, folder in spec["models"].items()
    }


VARIANTS = {
    "eval_teacher": eval_teacher,
    "peer": peer,
    "floor_grouped": lambda spec: floor(spec, grouped=True),
    "floor_random": lambda spec: floor(spec, grouped=False),
    "score": score,
}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in VARIANTS:
        print(f"usage: python bench/variants.py {{{','.join(VARIANTS)}}} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    variant, spec_path, result_path = argv
    result = VARIANTS[variant](json.loads(Path(spec_path).read_text()))
    Path(result_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
