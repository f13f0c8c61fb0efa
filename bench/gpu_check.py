"""Every path that is on by default on a GPU, run once: `make gpu-check` (about 4 minutes on one H100).

    python bench/gpu_check.py [--quick] [--out OUT]

Checks (random-init models built from configs, synthetic texts: nothing is downloaded):
- student-{bert,mpnet}-{fp32,bf16}: a training step of the student stage, forward and backward. BERT padded
  against unpadded (FlashAttention's variable-length kernel on a GPU that takes it; each text's own attention
  elsewhere), MPNet's fused attention against transformers' eager one; vectors and gradients within TOLERANCES.
- e2e-{fp32,bf16}: a short run end to end (both phases, evaluation, export, the cost stage), the exported folder
  loaded by plain sentence-transformers, and the attention path the run recorded as the decision expects.
- resume: `--torch_compile`, `--max_tokens_per_batch`, `--gradient_accumulation_steps 2` and a checkpoint every
  2 steps; a second run resumed from the first's step-2 checkpoint ends with the same weights (within RESUME_TOLERANCE).
- nan: a NaN loss injected at step 5 stops the run with exit code 3 and a checkpoint equal to a clean step 4.
- loader: the training loader's worker processes and pinned memory (CUDA only) give the same batches as none.

Writes OUT/gpu-check.json (each check: passed, failed or skipped with the reason, its figures and seconds) and
exits 1 if any check failed. Without CUDA the checks that need it are skipped with the reason, the others run,
and it exits 0. `--quick` uses toy sizes (and compiles with the aot_eager backend on a CPU, where inductor's C++
build takes minutes); the test suite runs it (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# (vectors: largest absolute difference, gradients: |g_a - g_b| / |g_a| over all parameters), by precision.
# fp32: float32 rounding through kernels that sum in another order; bf16: 8 bits of mantissa in every matmul.
TOLERANCES = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 5e-2)}
# A rolled-back or resumed run's weights against the reference run's. On a CPU the same steps give the same bits. On
# a GPU FlashAttention's backward sums with atomics, so two runs of the same steps differ in their last bits, and
# Adam carries those into the weights: there the difference must stay under MOVEMENT_SHARE of what the reference
# moved over the next steps (a run that skipped or repeated a step differs by about that whole movement).
# A compiled run resumed: inductor compiles the resumed run's first shapes into kernels of their own, which sum in
# another order (1.9e-7 on a CPU at the full size); aot_eager (--quick on a CPU) gives the same weights exactly.
MOVEMENT_SHARE = 0.05
RESUME_TOLERANCE = 1e-5


def tolerance(reference_movement: float, floor: float) -> float:
    return max(floor, MOVEMENT_SHARE * reference_movement) if cuda() else floor


class Skipped(Exception):
    """A check that cannot run here, and why."""


def cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if cuda() else "cpu")


# ------------------------------------------------------------------------------------------------ models


def build_models(root: Path, quick: bool) -> dict[str, Path]:
    """Random-init SentenceTransformer folders over the fixtures' word-level tokenizer: a BERT teacher, a BERT
    student and an MPNet student (toy sizes with `quick`, MiniLM's shape otherwise)."""
    from transformers import BertConfig, BertModel, MPNetConfig, MPNetModel

    from conftest import save_sentence_transformer, tiny_tokenizer

    hidden, layers = (32, 2) if quick else (384, 6)
    shapes = {"teacher": (BertConfig, BertModel, 48, 2), "bert": (BertConfig, BertModel, hidden, layers)}
    shapes["mpnet"] = (MPNetConfig, MPNetModel, hidden, layers)
    folders = {}
    for name, (config_class, model_class, width, depth) in shapes.items():
        raw = root / name / "hf"
        raw.mkdir(parents=True, exist_ok=True)
        config = config_class(
            vocab_size=tiny_tokenizer(raw),
            hidden_size=width,
            num_hidden_layers=depth,
            num_attention_heads=max(2, width // 32),
            intermediate_size=4 * width,
            max_position_embeddings=130,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,  # the tokenizer's [PAD]; MPNet counts positions after it
        )
        torch.manual_seed(len(folders))
        model_class(config).save_pretrained(raw)
        folders[name] = save_sentence_transformer(raw, "mean")
    return folders


def write_data(root: Path, quick: bool) -> dict[str, Path]:
    from conftest import sentences

    texts, pairs = (256, 160) if quick else (4096, 1024)
    (root / "texts.txt").write_text("\n".join(sentences(texts, seed=1)) + "\n")
    queries, passages, negatives = sentences(pairs, 2), sentences(pairs, 3), sentences(pairs, 4)
    with open(root / "pairs.jsonl", "w") as out:
        for q, p, n in zip(queries, passages, negatives):
            out.write(json.dumps({"query": q, "passage": p + " " + q, "negative": n}) + "\n")
    return {"texts": root / "texts.txt", "pairs": root / "pairs.jsonl"}


# ------------------------------------------------------------------------------------------ student stage


def training_step(student, features: dict, precision: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The student's sentence vectors and every parameter's gradient, for a fixed random weighting of them."""
    from accelerate.utils import send_to_device

    student.to(device()).train()
    features = send_to_device(features, device())
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        vectors = student(dict(features))["sentence_embedding"].float()
    weights = torch.randn(vectors.shape, generator=torch.Generator().manual_seed(0)).to(vectors.device)
    (vectors * weights).sum().backward()
    grads = {n: p.grad.float().cpu() for n, p in student.named_parameters() if p.grad is not None}
    return vectors.detach().cpu(), grads


def differences(a: tuple, b: tuple) -> dict[str, float]:
    (vectors_a, grads_a), (vectors_b, grads_b) = a, b
    if grads_a.keys() != grads_b.keys():
        raise AssertionError(
            f"the two students have gradients for different parameters: {grads_a.keys() ^ grads_b.keys()}"
        )
    flat_a = torch.cat([g.reshape(-1) for g in grads_a.values()])
    flat_b = torch.cat([grads_b[n].reshape(-1) for n in grads_a])
    return {
        "vectors_max_abs": float((vectors_a - vectors_b).abs().max()),
        "gradients_relative": float((flat_a - flat_b).norm() / flat_a.norm()),
    }


def within(found: dict[str, float], precision: str) -> dict:
    vectors, gradients = TOLERANCES[precision]
    if not (found["vectors_max_abs"] <= vectors and found["gradients_relative"] <= gradients):
        raise AssertionError(f"{found} beyond the {precision} tolerance (vectors {vectors}, gradients {gradients})")
    return {**found, "tolerance": {"vectors_max_abs": vectors, "gradients_relative": gradients}}


def check_bert(models: dict[str, Path], precision: str) -> dict:
    """The BERT student padded and as the run's attention decision would train it unpadded."""
    from conftest import sentences
    from distill.students import kind_of
    from distill.students.attention import choose_attention, use_unpadded_batches
    from distill.students.transformer import load_student
    from distill.tokens import TokenizedTexts

    padded = load_student(str(models["bert"]), attention_dropout=0.0)
    unpadded = load_student(str(models["bert"]), attention_dropout=0.0)
    decision = choose_attention(unpadded, device(), "bf16" if precision == "bf16" else "no")
    if cuda() and precision == "bf16" and not decision.unpadded:  # the run trains it padded: nothing to compare
        raise Skipped(f"the run keeps this student padded here: {decision.reason}")
    use_unpadded_batches(unpadded)  # on a CPU or in fp32: each text's own attention, the path the tests cover
    texts = sentences(48, seed=3)
    rows = list(range(len(texts)))
    a = training_step(padded, TokenizedTexts(padded.tokenizer, texts, 64).features(rows), precision)
    b = training_step(
        unpadded, kind_of(unpadded).texts(unpadded)(unpadded.tokenizer, texts, 64).features(rows), precision
    )
    kernel = "varlen_attn" if cuda() and precision == "bf16" else "each text's own scaled_dot_product_attention"
    return {"decision": decision.to_dict(), "unpadded_kernel": kernel, **within(differences(a, b), precision)}


def check_mpnet(models: dict[str, Path], precision: str) -> dict:
    """The MPNet student with the toolkit's fused attention against transformers' eager attention."""
    from sentence_transformers import SentenceTransformer

    from conftest import sentences
    from distill.students.transformer import load_student
    from distill.tokens import TokenizedTexts

    fused = load_student(str(models["mpnet"]), attention_dropout=0.0)
    if not all(getattr(m, "fused_attention", False) for m in fused.modules() if type(m).__name__ == "MPNetEncoder"):
        raise AssertionError("load_student left an MPNet encoder on transformers' eager attention")
    eager = SentenceTransformer(str(models["mpnet"]), device="cpu")
    texts = sentences(48, seed=3)
    features = TokenizedTexts(fused.tokenizer, texts, 64).features(list(range(len(texts))))
    found = differences(training_step(eager, features, precision), training_step(fused, features, precision))
    return within(found, precision)


# ---------------------------------------------------------------------------------------------- whole runs


def run_flags(models: dict[str, Path], data: dict[str, Path], out: Path, quick: bool, **overrides) -> list[str]:
    flags = {
        "teacher_model": models["teacher"],
        "student_model": models["bert"],
        "phase1_data": data["texts"],
        "phase2_data": data["pairs"],
        "eval_data": "auto",
        "max_eval_queries": 16 if quick else 128,
        "batch_size": 8 if quick else 64,
        "phase1_lr": 1e-3,
        "phase2_lr": 1e-3,
        "max_seq_length": 32 if quick else 64,
        "output_dir": out,
        "artifacts_dir": out / "artifacts",
        "teacher_cache_dir": out.parent / "cache",
        "log_with": "none",
        "seed": 7,
        **overrides,
    }
    return [x for key, value in flags.items() for x in (f"--{key}", str(value))]


def train(argv: list[str]) -> int:
    """`python -m distill.train` in this process, with Accelerate's process-wide state reset before."""
    from accelerate.state import AcceleratorState, GradientState

    from distill.train import main

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return main(argv)


def check_e2e(models: dict[str, Path], data: dict[str, Path], work: Path, quick: bool, precision: str) -> dict:
    from sentence_transformers import SentenceTransformer

    from distill.students.attention import attention_path, has_varlen

    out = work / f"e2e-{precision}"
    argv = run_flags(models, data, out, quick, mixed_precision="bf16" if precision == "bf16" else "no")
    if train([*argv, "--save_to_artifacts", "True"]) != 0:
        raise AssertionError(f"the run exited non-zero; its log is above ({out})")
    results = json.loads((out / "results.json").read_text())
    capability = torch.cuda.get_device_capability() if cuda() else None
    backbone = SentenceTransformer(str(models["bert"]), device="cpu")[0].auto_model
    expected = attention_path(
        backbone, device().type, "bf16" if precision == "bf16" else "no", capability, has_varlen()
    )
    if results["attention"] != expected.to_dict():
        raise AssertionError(f"attention {results['attention']}, the decision says {expected.to_dict()}")
    exported = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    if not torch.isfinite(torch.from_numpy(exported.encode(["a river", "the king"]))).all():
        raise AssertionError("the exported model gives non-finite vectors")
    return {
        "attention": results["attention"],
        "ndcg@10": {row: results[row]["ndcg@10"] for row in ("teacher", "student_before", "student_after")},
        "final_losses": {name: phase["final_loss"] for name, phase in results["phases"].items()},
    }


def weights_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    got, want = load_file(str(a)), load_file(str(b))
    if got.keys() != want.keys():
        raise AssertionError(f"{a} and {b} hold different tensors")
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in got)


def check_resume(models: dict[str, Path], data: dict[str, Path], work: Path, quick: bool) -> dict:
    """Compiled, token-budget batches, two micro-batches a step, a checkpoint every 2 steps; resumed from step 2."""
    if quick and not cuda():
        os.environ["ACCELERATE_DYNAMO_BACKEND"] = "aot_eager"  # compiles graphs without inductor's C++ build
    options = dict(
        torch_compile=True,
        max_tokens_per_batch=128 if quick else 2048,
        gradient_accumulation_steps=2,
        checkpoint_steps=2,
        checkpoints_total_limit=100,
        skip_phase2=True,
        eval_data="none",
        efficiency_texts=0,  # the e2e checks run the cost stage
        mixed_precision="bf16" if cuda() else "no",
    )
    try:
        whole, resumed = work / "resume-whole", work / "resume-resumed"
        if train(run_flags(models, data, whole, quick, **options)) != 0:
            raise AssertionError("the uninterrupted run exited non-zero")
        start = whole / "checkpoints" / "checkpoint-phase1-0000002"
        argv = run_flags(models, data, resumed, quick, **options, resume_from_checkpoint=start)
        if train(argv) != 0:
            raise AssertionError("the resumed run exited non-zero")
    finally:
        os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
    last = sorted((whole / "checkpoints").glob("checkpoint-phase1-*"))[-1]
    ends = [sorted((run / "checkpoints").glob("checkpoint-phase1-*"))[-1] for run in (whole, resumed)]
    if ends[0].name != ends[1].name or ends[0] != last:
        raise AssertionError(f"the runs ended at different steps: {ends}")
    difference = weights_difference(ends[0] / "model.safetensors", ends[1] / "model.safetensors")
    movement = weights_difference(start / "model.safetensors", ends[0] / "model.safetensors")
    allowed = tolerance(movement, RESUME_TOLERANCE)
    if difference > allowed:
        raise AssertionError(f"resumed weights differ by {difference} (tolerance {allowed}; moved {movement})")
    return {"steps": int(last.name.rsplit("-", 1)[1]), "weights_max_abs": difference, "tolerance": allowed}


def check_nan(models: dict[str, Path], data: dict[str, Path], work: Path, quick: bool) -> dict:
    """A NaN loss at the 5th step: exit code 3, and the checkpoint left holds a clean run's step-4 weights."""
    from distill.phases import AlignmentPhase

    options = dict(skip_phase2=True, eval_data="none", checkpoints_total_limit=100, efficiency_texts=0)
    options["mixed_precision"] = "bf16" if cuda() else "no"
    clean, poisoned = work / "nan-clean", work / "nan-poisoned"
    if train(run_flags(models, data, clean, quick, checkpoint_steps=4, **options)) != 0:
        raise AssertionError("the clean run exited non-zero")
    calls, loss = [0], AlignmentPhase.loss

    def nan_at_5(*args, **kwargs):
        calls[0] += 1
        value, reported = loss(*args, **kwargs)
        return (value * float("nan"), reported * float("nan")) if calls[0] == 5 else (value, reported)

    AlignmentPhase.loss = nan_at_5  # type: ignore[method-assign]
    try:
        code = train(run_flags(models, data, poisoned, quick, **options))
    finally:
        AlignmentPhase.loss = loss  # type: ignore[method-assign]
    if code != 3:
        raise AssertionError(f"the poisoned run exited {code}, not 3")
    left = sorted((poisoned / "checkpoints").glob("checkpoint-phase1-*"))
    reference = clean / "checkpoints" / "checkpoint-phase1-0000004"
    if [c.name for c in left] != [reference.name]:
        raise AssertionError(f"the poisoned run left {[c.name for c in left]}, not {reference.name}")
    difference = weights_difference(left[0] / "model.safetensors", reference / "model.safetensors")
    later = clean / "checkpoints" / "checkpoint-phase1-0000008"
    allowed = tolerance(weights_difference(reference / "model.safetensors", later / "model.safetensors"), 0.0)
    if difference > allowed:
        raise AssertionError(f"rolled-back weights differ from a clean step 4 by {difference} (tolerance {allowed})")
    return {"exit_code": code, "weights_max_abs": difference, "tolerance": allowed}


def check_loader() -> dict:
    """The training loader as a GPU run makes it: worker processes collating into pinned memory."""
    import numpy as np

    from distill.batching import LOADER_WORKERS, make_loader

    if not cuda():
        raise Skipped("the loader uses worker processes and pinned memory on CUDA only")
    lengths = np.random.default_rng(0).integers(4, 64, size=512)

    def collate(indices: list[int]) -> dict:
        return {"ids": torch.tensor(indices), "lengths": torch.from_numpy(lengths[indices])}

    loader = make_loader(lengths, 32, seed=0, collate=collate)
    if (loader.num_workers, loader.pin_memory) != (LOADER_WORKERS, True):
        raise AssertionError(f"workers {loader.num_workers}, pinned {loader.pin_memory}")
    batches = list(loader)
    if not all(t.is_pinned() for b in batches for t in b.values()):
        raise AssertionError("a batch is not in pinned memory")
    expected = [collate(b) for b in loader.batch_sampler]
    if not all(torch.equal(b["ids"], e["ids"]) for b, e in zip(batches, expected)) or len(batches) != len(expected):
        raise AssertionError("the workers' batches differ from the sampler's")
    return {"workers": loader.num_workers, "batches": len(batches)}


# ---------------------------------------------------------------------------------------------------- main


def machine() -> dict:
    found = {"torch": torch.__version__, "python": platform.python_version(), "device": device().type}
    if cuda():
        found |= {
            "gpu": torch.cuda.get_device_name(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        }
    return found


def run_check(name: str, check: Callable[[], dict], report: dict, path: Path) -> None:
    started = time.perf_counter()
    print(f"gpu-check: {name} ...", flush=True)
    try:
        entry = {"status": "passed", **check()}
    except Skipped as why:
        entry = {"status": "skipped", "reason": str(why)}
    except Exception as e:  # every check runs; the report keeps each failure
        traceback.print_exc()
        entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:1000]}
    entry["seconds"] = round(time.perf_counter() - started, 1)
    report["checks"][name] = entry
    path.write_text(json.dumps(report, indent=1) + "\n")  # a run cut short keeps what it checked
    print(f"gpu-check: {name}: {entry['status']} ({entry.get('reason') or entry.get('error') or ''})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes: what the test suite runs")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu-check.json"
    report: dict = {"command": ["python", "bench/gpu_check.py", *(argv or [])], "machine": machine(), "checks": {}}
    work = Path(tempfile.mkdtemp(prefix="distill-gpu-check-"))
    try:
        models, data = build_models(work / "models", args.quick), write_data(work, args.quick)
        checks: dict[str, Callable[[], dict]] = {}
        for precision in ("fp32", "bf16"):
            checks[f"student-bert-{precision}"] = lambda p=precision: check_bert(models, p)
            checks[f"student-mpnet-{precision}"] = lambda p=precision: check_mpnet(models, p)
        for precision in ("fp32", "bf16"):
            checks[f"e2e-{precision}"] = lambda p=precision: check_e2e(models, data, work, args.quick, p)
        checks["resume"] = lambda: check_resume(models, data, work, args.quick)
        checks["nan"] = lambda: check_nan(models, data, work, args.quick)
        checks["loader"] = check_loader
        for name, check in checks.items():
            run_check(name, check, report, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    statuses = {name: entry["status"] for name, entry in report["checks"].items()}
    print(json.dumps(statuses, indent=1))
    failed = [name for name, status in statuses.items() if status == "failed"]
    print(f"gpu-check: {len(statuses) - len(failed)} of {len(statuses)} passed or skipped; report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
