"""Score an exported model on the benchmarks people compare.

    python -m distill.evaluate MODEL [--nanobeir [DATASET]] [--mteb TASKS] [--backend onnx[:FILE]] [--output FILE]

- `--nanobeir [DATASET]`: sentence-transformers' `NanoBEIREvaluator` on its 13 small BEIR datasets (or those
  `--nanobeir_datasets` names). DATASET is another copy on the Hub (`lightonai/NanoBEIR-de`) or a local folder in
  the same format; the default is sentence-transformers/NanoBEIR-en.
- `--mteb TASKS`: MTEB tasks by name (`SciFact,STS12`), through `mteb.evaluate` (`pip install 'distill[mteb]'`).

`--backend onnx` scores the folder's ONNX form (`onnx/model.onnx`, or `onnx:FILE`, e.g.
`onnx:onnx/model_qint8_avx512_vnni.onnx`) through `distill.runtime`: ONNX Runtime and the folder's tokenizer,
pooling, Dense and Normalize, as a CPU server runs it.

The scores print as a table, and `--output FILE` keeps them as JSON. Both benchmarks read their data from the Hub:
where it cannot be reached, the command stops with one line that says what needs it. A run scores NanoBEIR itself
with `--eval_data nanobeir` (teacher and student, sharded over its processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from unittest.mock import patch

from distill.data.reading import NANOBEIR_HUB
from distill.errors import DistillError, first_line
from distill.runtime import ONNX_FILE, OnnxEncoder

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m distill.evaluate",
        description="Score an exported model (a SentenceTransformer folder or Hub name) on NanoBEIR and MTEB tasks.",
    )
    p.add_argument("model", help="The model: <artifacts_dir>/model, any SentenceTransformer folder, or a Hub name.")
    p.add_argument(
        "--nanobeir",
        nargs="?",
        const=NANOBEIR_HUB,
        default=None,
        metavar="DATASET",
        help=f"NanoBEIR, from {NANOBEIR_HUB} or DATASET (a Hub id or a local folder in its format).",
    )
    p.add_argument("--nanobeir_datasets", default=None, help="NanoBEIR datasets, comma-separated (default: all 13).")
    p.add_argument("--mteb", default=None, metavar="TASKS", help="MTEB task names, comma-separated (SciFact,STS12).")
    p.add_argument(
        "--backend",
        default="torch",
        help="torch (the folder as sentence-transformers loads it), or onnx[:FILE]: its ONNX form through ONNX "
        "Runtime (FILE in the folder, default onnx/model.onnx).",
    )
    p.add_argument("--batch_size", type=int, default=32, help="Texts per encode batch.")
    p.add_argument("--output", default=None, help="Write the scores to this JSON file too.")
    return p


def load_model(name: str, backend: str = "torch") -> SentenceTransformer:
    """The model as the evaluators call it; with `onnx[:FILE]`, its `encode` is the folder's ONNX form's."""
    import torch

    from distill.hub import load_sentence_transformer, resolve_model

    kind, _, file_name = backend.partition(":")
    if kind not in ("torch", "onnx"):
        raise DistillError(f"--backend: expected torch or onnx[:FILE], got {backend!r}")
    device = "cuda" if torch.cuda.is_available() and kind == "torch" else "cpu"
    model = load_sentence_transformer(resolve_model(name), device)
    if kind == "onnx":
        serve_with_onnx(model, resolve_model(name), file_name or ONNX_FILE)
    return model


def serve_with_onnx(model: SentenceTransformer, folder: str, file_name: str) -> None:
    """`model.encode` (which `encode_query` and `encode_document` call) answered by `OnnxEncoder`: what the
    evaluators and MTEB score is the ONNX form's vectors. The exported folder has no prompts to apply."""
    import numpy as np
    import torch

    encoder = OnnxEncoder(folder, file_name)

    def encode(inputs: Any = None, batch_size: int = 32, convert_to_tensor: bool = False, **kwargs: Any) -> Any:
        texts = kwargs.pop("sentences", None) if inputs is None else inputs  # sentence-transformers 5 named it so
        single = isinstance(texts, str)
        vectors = encoder.encode([texts] if single else list(texts), batch_size)
        if kwargs.get("truncate_dim"):
            vectors = vectors[:, : kwargs["truncate_dim"]]
        if kwargs.get("normalize_embeddings"):
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        out = torch.from_numpy(vectors) if convert_to_tensor else vectors
        return out[0] if single else out

    model.encode = encode


def nanobeir_scores(
    model: SentenceTransformer, dataset_id: str, names: str | None, batch_size: int
) -> dict[str, float]:
    """sentence-transformers' NanoBEIREvaluator's scores: the mean over the datasets and each one's."""
    from sentence_transformers.sentence_transformer.evaluation import NanoBEIREvaluator, nano_beir

    chosen = [n.strip() for n in names.split(",") if n.strip()] if names else None
    quiet = partial(nano_beir.tqdm, disable=True)  # its loading bar would leave an unfinished line before an error
    try:
        with patch.object(nano_beir, "tqdm", quiet):
            evaluator = NanoBEIREvaluator(
                dataset_names=chosen, dataset_id=dataset_id, batch_size=batch_size, write_csv=False
            )
    except ValueError as e:  # no such dataset name, or its data cannot be read
        cause = f"{e} ({e.__cause__})" if e.__cause__ else str(e)
        raise DistillError(
            f"--nanobeir: {first_line(cause, 300)}; NanoBEIR needs the Hub, or a local copy in the same format: "
            "--nanobeir FOLDER"
        ) from None
    return {k: float(v) for k, v in evaluator(model).items() if k.endswith(("ndcg@10", "mrr@10"))}


def mteb_scores(model: SentenceTransformer, names: str, batch_size: int) -> dict[str, float]:
    """Each MTEB task's main score, from `mteb.evaluate` (no result cache: every call runs)."""
    try:
        import mteb
    except ImportError:
        raise DistillError("--mteb needs the mteb package: pip install 'distill[mteb]' (or pip install mteb)") from None
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    try:
        tasks = mteb.get_tasks(tasks=wanted)
    except KeyError as e:
        why = first_line(str(e.args[0]) if e.args else "", 300).removeprefix("KeyError: ")
        raise DistillError(f"--mteb: {why}; give task names as MTEB spells them") from None
    scores = {}
    for task in tasks:
        name = task.metadata.name
        try:
            result = mteb.evaluate(
                model, task, cache=None, show_progress_bar=False, encode_kwargs=cast(Any, {"batch_size": batch_size})
            )
        except Exception as e:  # the task's data, from the Hub, is the usual failure
            raise DistillError(
                f"MTEB task {name} could not run ({type(e).__name__}: {first_line(str(e), 300)}); its data comes from "
                f"the Hub ({task.metadata.dataset.get('path')}): run it where the Hub is reachable"
            ) from None
        scores[name] = float(result.task_results[0].get_score())
    return scores


def scores_table(scores: dict[str, dict[str, float]]) -> str:
    lines = ["| benchmark | score | value |", "|---|---|---|"]
    for benchmark, values in scores.items():
        lines += [f"| {benchmark} | {name} | {value:.4f} |" for name, value in values.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Score the model; 0 on success, 2 on a bad input or a benchmark that cannot run here."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.nanobeir and not args.mteb:
        print("error: nothing to evaluate; pass --nanobeir, --mteb TASKS, or both", file=sys.stderr)
        return 2
    scores: dict[str, Any] = {}
    try:
        model = load_model(args.model, args.backend)
        if args.nanobeir:
            scores["nanobeir"] = nanobeir_scores(model, args.nanobeir, args.nanobeir_datasets, args.batch_size)
        if args.mteb:
            scores["mteb"] = mteb_scores(model, args.mteb, args.batch_size)
    except DistillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(scores_table(scores))
    if args.output:
        Path(args.output).write_text(json.dumps({"model": args.model, **scores}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
