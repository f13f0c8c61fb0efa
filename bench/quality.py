"""Quality benchmark: distill's two-phase recipe against sentence-transformers' own distillation recipe.

One run, one config file, the same teacher, student, texts and evaluation set for both:

(a) distill: `python -m distill.train --config CONFIG --output_dir OUT/toolkit` (a subprocess, as users run it);
(b) the peer, sentence-transformers' recipe: the teacher's vectors of every training text in a `label` column
    (read from distill's teacher cache, so they are the very vectors (a) trained on), then
    `SentenceTransformerTrainer` with `losses.MSELoss` when student and teacher have the same width, or
    `losses.EmbedDistillLoss(projection_dim=teacher_dim)` in projection mode. It trains on the same texts
    (phase-1 texts, phase-2 queries and passages, of the phases (a) runs), from the same initial (pruned)
    student, and stops when it has trained as long as (a) did (wall-clock seconds of training, its phases together).

Both students are scored by `distill.stages.scoring.evaluate_student` on the embedded held-out set against the
cached teacher vectors, and the table, the machine, the versions and the command go into a report,
runs/quality/QUALITY.md by default (between markers, one section per --name; the rest of the file is left alone).
docs/QUALITY.md summarises such reports.

    python bench/quality.py --skip_phase2 True                 # configs/demo.yaml's phase 1 (make quality)
    python bench/quality.py --config configs/mpnet_projection.yaml   # projection mode, mpnet teacher
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml", help="distill config both sides share")
    parser.add_argument("--output_dir", default="runs/quality/bench", help="toolkit/ and peer/ go here")
    parser.add_argument("--name", default=None, help="section name in the report (default: the config's stem)")
    parser.add_argument("--doc", default="runs/quality/QUALITY.md", help="the report the section is written into")
    parser.add_argument("--peer_lr", type=float, default=1e-4, help="peer learning rate")
    parser.add_argument("--peer_epochs", type=int, default=1, help="peer epochs over the texts (time-capped)")
    parser.add_argument(
        "--peer_distance",
        default="cosine",
        help="projection mode: EmbedDistillLoss distance(s), comma-separated, one peer each (mse, cosine, l2)",
    )
    parser.add_argument("--peer_budget_s", type=float, default=None, help="peer training seconds (default: toolkit's)")
    parser.add_argument(
        "--peer_max_steps",
        type=int,
        default=0,
        help="lay the peer's warm-up and linear decay out over this many optimizer steps instead of its full "
        "epochs (0: the epochs; set it to the steps the peer reaches in its time budget so its lr decays to 0)",
    )
    parser.add_argument(
        "--reuse_toolkit",
        default=None,
        help="output_dir of a finished distill run with the same config and flags: take its results.json "
        "instead of training the toolkit again (the section says so)",
    )
    parser.add_argument(
        "--pool",
        nargs="+",
        default=None,
        metavar="OUTPUT_DIR",
        help="train nothing: pool the paired comparison of finished benchmark runs (their --output_dir, e.g. one "
        "per seed) into one interval, written as section --name (default: pooled)",
    )
    # Anything else is a distill flag, given to the toolkit run and used to build the peer's data too.
    return parser.parse_known_args()


def run_toolkit(config_path: str, output_dir: Path, extra: list[str]) -> tuple[dict, list[str], float]:
    command = [
        sys.executable,
        "-m",
        "distill.train",
        "--config",
        config_path,
        "--output_dir",
        str(output_dir),
        "--save_to_artifacts",
        "False",
        *extra,
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    return json.loads((output_dir / "results.json").read_text()), command, seconds


class TimeBudget:
    """A TrainerCallback that stops training once `seconds` of training have passed."""

    def __new__(cls, seconds: float):
        from transformers import TrainerCallback

        class _Budget(TrainerCallback):
            def __init__(self) -> None:
                self.started = None
                self.stopped_early = False

            def on_train_begin(self, args, state, control, **kwargs):
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if time.perf_counter() - self.started >= seconds:
                    control.should_training_stop = True
                    self.stopped_early = True
                return control

        return _Budget()


def run_peer(config, output_dir: Path, args: argparse.Namespace, budget_s: float, distance: str) -> dict:
    from accelerate import Accelerator
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses
    from torch import nn

    from distill.data import load_data
    from distill.data.containers import passage_texts
    from distill.pipeline import teacher_stage
    from distill.stages.scoring import eval_inputs, evaluate_student
    from distill.students import student_kind
    from distill.students.head import DistillationModel, dense_module, embedding_dim, matryoshka_dims
    from distill.students.transformer import load_student

    accelerator = Accelerator()
    # the texts the toolkit trains on: a skipped phase brings none
    training = config.training
    data = load_data(config.data, training.seed, not training.skip_phase1, not training.skip_phase2)
    described = student_kind(config.student.student_model).describe(config.student, config.teacher)
    teacher = teacher_stage(accelerator, config, data, None, described)  # cache hits: the toolkit encoded these
    student = load_student(
        config.student.student_model, config.student.student_num_layers, config.student.max_seq_length
    )
    student_dim = embedding_dim(student)
    texts = data.phase1_texts + data.phase2.queries + passage_texts(data.phase2)[0]
    labels = np.concatenate([v for v in (teacher.phase1, teacher.queries, teacher.passages) if v is not None]).astype(
        np.float32
    )
    if config.mode.use_projection:
        loss = losses.EmbedDistillLoss(student, distance_metric=distance, projection_dim=labels.shape[1])
        recipe = f"EmbedDistillLoss(distance_metric={distance!r}, projection_dim={labels.shape[1]})"
    else:  # the same target the toolkit's MRL mode uses: the teacher truncated to the student's width, unit length
        labels = labels[:, :student_dim] / np.linalg.norm(labels[:, :student_dim], axis=1, keepdims=True)
        loss = losses.MSELoss(student)
        recipe = "MSELoss"
    dataset = Dataset.from_dict({"text": texts, "label": labels.tolist()})
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir / "trainer"),
        per_device_train_batch_size=config.training.batch_size,
        num_train_epochs=args.peer_epochs,
        max_steps=args.peer_max_steps if args.peer_max_steps > 0 else -1,
        learning_rate=args.peer_lr,
        warmup_steps=config.training.warmup_ratio,  # transformers 5: a float below 1 is a ratio
        weight_decay=config.training.weight_decay,
        seed=config.training.seed,
        save_strategy="no",
        report_to="none",
        logging_steps=50,
        disable_tqdm=True,
    )
    budget = TimeBudget(budget_s)
    trainer = SentenceTransformerTrainer(
        model=student, args=training_args, train_dataset=dataset, loss=loss, callbacks=[budget]
    )
    started = time.perf_counter()
    output = trainer.train()
    train_seconds = time.perf_counter() - started
    projection = None
    if config.mode.use_projection:
        linear: nn.Linear = loss.projection
        projection = dense_module()(
            linear.in_features,
            linear.out_features,
            bias=True,
            activation_function=nn.Identity(),
            init_weight=linear.weight.detach().cpu().clone(),
            init_bias=linear.bias.detach().cpu().clone(),
        )
    model = DistillationModel(student.cpu(), projection)
    dims = None if config.mode.use_projection else matryoshka_dims(student_dim, config.mode.matryoshka_dims)
    metrics = evaluate_student(
        accelerator, model, eval_inputs(student, data, teacher.evaluation), 2 * config.training.batch_size, dims
    )
    steps = output.global_step
    result = {
        "recipe": f"SentenceTransformerTrainer + losses.{recipe}",
        "student_after": metrics,
        "train_seconds": round(train_seconds, 1),
        "optimizer_steps": steps,
        "train_samples": steps * config.training.batch_size,
        "texts_available": len(texts),
        "stopped_by_budget": budget.stopped_early,
        "lr": args.peer_lr,
        "schedule_steps": args.peer_max_steps or None,
        "budget_s": round(budget_s, 1),
    }
    (output_dir / "results.json").write_text(json.dumps(result, indent=2))
    return result


def versions() -> str:
    import accelerate
    import sentence_transformers
    import torch
    import transformers

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"sentence-transformers {sentence_transformers.__version__}, accelerate {accelerate.__version__}, "
        f"numpy {np.__version__}"
    )


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, {platform.system()} {platform.release()}"


def paired_difference(ours: list[int], theirs: list[int], resamples: int = 10_000) -> dict[str, float]:
    """distill minus peer, query by query on the same evaluation set: mean nDCG@10 difference, its 95% CI.

    A paired bootstrap (scipy's `bootstrap` over the per-query differences, percentile interval, fixed seed):
    both students answer the same queries, so most of the evaluation set's sampling noise cancels out, and the
    interval says whether the difference is larger than what the choice of 867 queries can explain.
    """
    from scipy.stats import bootstrap

    from distill.metrics import ndcg_per_query

    if len(ours) != len(theirs):
        raise ValueError(f"paired comparison needs the same queries on both sides, got {len(ours)} and {len(theirs)}")
    diff = ndcg_per_query(np.asarray(ours)) - ndcg_per_query(np.asarray(theirs))
    interval = bootstrap(
        (diff,), np.mean, confidence_level=0.95, n_resamples=resamples, method="percentile", random_state=0
    ).confidence_interval
    return {
        "mean": float(diff.mean()),
        "low": float(interval.low),
        "high": float(interval.high),
        "better": int((diff > 0).sum()),
        "worse": int((diff < 0).sum()),
        "queries": len(diff),
    }


def _interval(paired: dict[str, float]) -> str:
    return f"[{paired['low']:+.4f}, {paired['high']:+.4f}]"


def paired_cells(paired: dict[str, float], bold: bool = False) -> str:
    """The difference, its interval and the queries higher / lower, as three cells of a Markdown table row."""
    mean = f"{paired['mean']:+.4f}"
    return f"{f'**{mean}**' if bold else mean} | {_interval(paired)} | {paired['better']} / {paired['worse']}"


def verdict(paired: dict[str, float]) -> str:
    interval = f"95% paired-bootstrap CI {_interval(paired)} over {paired['queries']} queries"
    if paired["low"] > 0:
        return f"distill higher: {interval}"
    if paired["high"] < 0:
        return f"distill NOT higher: {interval}"
    return f"a tie, the interval holds 0: {interval}"


def pooled_section(name: str, runs: list[str], command: str) -> str:
    """One paired interval over the queries of several finished runs (their evaluation sets side by side)."""
    ours: list[int] = []
    theirs: list[int] = []
    lines = [
        f"<!-- quality:{name} -->",
        f"### Benchmark `{name}`: distill vs the best peer, pooled over {len(runs)} runs",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| run | seed | distill nDCG@10 | best peer nDCG@10 | distill − peer | 95% CI | queries higher / lower |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        toolkit = json.loads((Path(run) / "toolkit" / "results.json").read_text())
        peers = [json.loads(p.read_text()) for p in sorted(Path(run).glob("peer*/results.json"))]
        if not peers or any("ranks@10" not in r["student_after"] for r in [toolkit, *peers]):
            raise SystemExit(
                f"{run}: expected toolkit/results.json and peer*/results.json with per-query ranks (ranks@10); "
                "re-run that benchmark with this version of bench/quality.py"
            )
        peer = max(peers, key=lambda p: p["student_after"]["ndcg@10"])
        a, b = toolkit["student_after"], peer["student_after"]
        paired = paired_difference(a["ranks@10"], b["ranks@10"])
        ours += a["ranks@10"]
        theirs += b["ranks@10"]
        lines.append(
            f"| {run} | {toolkit['config'].get('seed')} | {a['ndcg@10']:.4f} | {b['ndcg@10']:.4f} "
            f"| {paired_cells(paired)} |"
        )
    paired = paired_difference(ours, theirs)
    lines += [
        f"| **pooled** | | | | {paired_cells(paired, bold=True)} |",
        "",
        f"Pooled: {verdict(paired)}.",
        f"<!-- /quality:{name} -->",
    ]
    return "\n".join(lines)


def trained(phases: dict) -> str:
    """The phases a toolkit run trained, from its results.json."""
    return "two phases" if len(phases) == 2 else f"{', '.join(phases).replace('phase', 'phase ')} only"


def peer_texts(phases: dict) -> str:
    """What the peer trained on: the texts of the phases the toolkit ran."""
    parts = (["phase-1 texts"] if "phase1" in phases else []) + (
        ["phase-2 queries + passages"] if "phase2" in phases else []
    )
    return " + ".join(parts)


def peer_schedule(peer: dict) -> str:
    steps = peer.get("schedule_steps")
    if steps:
        return f"warm-up and linear decay over {steps} steps"
    return "warm-up and linear decay laid out over the full epochs"


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else ("–" if value is None else str(value))


def section(name: str, toolkit: dict, peers: list[dict], command: str, toolkit_seconds: float) -> str:
    from distill.allocator import heap_allocator

    teacher = toolkit["teacher"]["ndcg@10"]
    after = toolkit["student_after"]
    projection = toolkit["mode"] == "projection"
    extra = "asymmetric nDCG@10" if projection else "half-dim nDCG@10 (% of full)"

    def extra_value(metrics: dict) -> str:
        if projection:
            return _fmt(metrics.get("ndcg@10_asymmetric"))
        mrl = metrics.get("matryoshka_ndcg@10") or {}
        dims = sorted(int(d) for d in mrl)
        if not dims:
            return "–"
        half = min(dims, key=lambda d: abs(d - dims[-1] / 2))
        return f"{mrl[str(half)]:.3f} ({100 * mrl[str(half)] / mrl[str(dims[-1])]:.1f}%) at {half}"

    phases = toolkit["phases"]
    toolkit_train = sum(p["train_seconds"] for p in phases.values())
    toolkit_samples = sum(p["train_samples"] for p in phases.values())
    rows = [
        ("teacher", toolkit["teacher"], None, None),
        ("student, untrained", toolkit["student_before"], None, None),
        (f"**distill** ({trained(phases)})", after, toolkit_train, toolkit_samples),
    ]
    rows += [(f"peer: {p['recipe']}", p["student_after"], p["train_seconds"], p["train_samples"]) for p in peers]
    lines = [
        f"<!-- quality:{name} -->",
        f"### Benchmark `{name}`: distill vs sentence-transformers' recipe",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}  ",
        f"Versions: {versions()}  ",
        f"Heap allocator: distill {toolkit.get('heap_allocator', 'not recorded')}, peer {heap_allocator()} "
        "(`make quality` preloads tcmalloc when installed)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        + (
            f"the toolkit run took {toolkit_seconds:.0f} s in all (data, teacher cache, evaluations, "
            f"{trained(phases)})."
            if toolkit_seconds == toolkit_seconds
            else f"toolkit figures taken from the finished run {toolkit.get('config', {}).get('output_dir')} "
            "(same config; not re-trained by this command)."
        ),
        "",
        f"| model | nDCG@10 | % of teacher | MRR@10 | STS Spearman | cosine to teacher | {extra} "
        "| train s | samples trained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, metrics, seconds, samples in rows:
        lines.append(
            f"| {label} | {metrics['ndcg@10']:.3f} | {100 * metrics['ndcg@10'] / teacher:.1f}% "
            f"| {metrics['mrr@10']:.3f} | {_fmt(metrics.get('sts_spearman'))} | {_fmt(metrics.get('teacher_cosine'))} "
            f"| {extra_value(metrics) if label != 'teacher' else '–'} | {_fmt(seconds)} | {_fmt(samples)} |"
        )
    peer = max(peers, key=lambda p: p["student_after"]["ndcg@10"])
    margin = after["ndcg@10"] - peer["student_after"]["ndcg@10"]
    if "ranks@10" in after and "ranks@10" in peer["student_after"]:
        paired = paired_difference(after["ranks@10"], peer["student_after"]["ranks@10"])
        judged = f"{verdict(paired)}; distill ranks {paired['better']} queries higher, {paired['worse']} lower"
    else:  # results written before per-query ranks were kept
        judged = (
            "below 0.005: a tie, not a win"
            if abs(margin) < 0.005
            else ("distill higher" if margin > 0 else "distill NOT higher")
        ) + "; no per-query ranks in these results, so no interval"
    lines += [
        "",
        f"distill − best peer: {margin:+.4f} nDCG@10 ({judged}). Each peer trained on the same "
        f"{peer['texts_available']} texts ({peer_texts(phases)}, labels from the same teacher "
        f"cache), lr {peer['lr']} ({peer_schedule(peer)}), batch as the config, stopped by the time budget of "
        f"{peer['budget_s']} s: {peer['stopped_by_budget']}.",
        f"<!-- /quality:{name} -->",
    ]
    return "\n".join(lines)


def write_section(doc: Path, name: str, text: str) -> None:
    start, end = f"<!-- quality:{name} -->", f"<!-- /quality:{name} -->"
    current = doc.read_text() if doc.exists() else "# Quality\n"
    if start in current and end in current:
        before, rest = current.split(start, 1)
        current = before + text + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(current)


def main() -> int:
    args, extra = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.chdir(ROOT)
    from distill.config import load_config

    bench_command = " ".join(["python", "bench/quality.py", *sys.argv[1:]])
    if args.pool:
        text = pooled_section(args.name or "pooled", args.pool, bench_command)
        write_section(Path(args.doc), args.name or "pooled", text)
        print(text)
        return 0
    output_dir = Path(args.output_dir)
    name = args.name or Path(args.config).stem
    config = load_config(["--config", args.config, "--output_dir", str(output_dir / "peer"), *extra])
    if args.reuse_toolkit:
        toolkit = json.loads((Path(args.reuse_toolkit) / "results.json").read_text())
        toolkit_seconds = float("nan")
    else:
        toolkit, _, toolkit_seconds = run_toolkit(args.config, output_dir / "toolkit", extra)
    budget = args.peer_budget_s or sum(p["train_seconds"] for p in toolkit["phases"].values())
    distances = args.peer_distance.split(",") if config.mode.use_projection else ["mse"]
    peers = []
    for distance in distances:
        peer_dir = output_dir / ("peer" if len(distances) == 1 else f"peer_{distance}")
        peer_dir.mkdir(parents=True, exist_ok=True)
        peers.append(run_peer(config, peer_dir, args, budget, distance))
    text = section(name, toolkit, peers, bench_command, toolkit_seconds)
    write_section(Path(args.doc), name, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
