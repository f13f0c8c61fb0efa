"""Benchmark the toolkit against sentence-transformers' own recipe and a bare PyTorch floor, on one machine.

    python bench/run.py                       # the comparison (median of 3 repeats) -> runs/bench/BENCHMARKS.md
    python bench/run.py --memory              # the toolkit's peak RSS at 4k and 40k training samples
    python bench/run.py --scaling             # wall time and peak RSS at 1k, 4k, 16k, 64k samples
    python bench/run.py --all                 # all three (what `make bench` runs)
    python bench/run.py --quick --repeats 1 --out /tmp/bench_quick.md   # tiny sizes: checks every variant runs

Same teacher (all-MiniLM-L6-v2), student (its 3-layer copy), data (the embedded Wikipedia training
sentences), batch size, epoch, max length, learning rate and seed for every variant; the student's attention
dropout while it trains is the toolkit's default (0) in the toolkit and the floor, the model's own (0.1) in the
peer, as its recipe leaves it:
1. peer: teacher `encode` into a label column, `SentenceTransformerTrainer` + `MSELoss`;
2. toolkit: `python -m distill.train`, phase 1 only, with a fresh teacher cache (cold) and again with it (warm);
3. floor: a bare loop over the toolkit's length-grouped batches, and over random batches.
Each variant runs alone in its own process; its peak RSS is the kernel's figure for that process (wait4).
Figures are medians over the repeats with their min-max range; ratios are taken within each repeat
(variants of one repeat run back to back), then their median.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distill.allocator import allocator_named_in, find_tcmalloc, preload_value
from distill.students.transformer import TRAINING_ATTENTION_DROPOUT

ROOT = Path(__file__).resolve().parent.parent
VARIANTS_SCRIPT = Path(__file__).resolve().parent / "variants.py"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# The toolkit's student trains without attention dropout: the floor trains the same student.
ATTENTION_DROPOUT = TRAINING_ATTENTION_DROPOUT
VERSIONED = ("torch", "transformers", "sentence-transformers", "accelerate", "datasets", "numpy")
HAND_WRITTEN_MARKER = "<!-- hand-written below: bench/run.py rewrites only the bench:* blocks above it -->"
BLOCKS = ("main", "memory", "scaling")
PLACEHOLDER = "Not measured yet: this table is produced by `make bench` (`python bench/run.py --all`)."

# Sizes: the default workload is the demo's phase 1 (8,000 sentences); --quick only checks that it all runs.
FULL = {"samples": 8000, "memory": (4000, 40000), "scaling": (1000, 4000, 16000, 64000), "eval_queries": 1000}
QUICK = {"samples": 64, "memory": (32, 320), "scaling": (32, 64, 96, 128), "eval_queries": 32}


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------- workload


def workload_texts(count: int) -> tuple[list[str], str]:
    """`count` distinct training texts and how they were made.

    The embedded Wikipedia training sentences first (15,844 after cleaning), then the Lee background
    sentences (2,528); past those, the same pool again with a numbered prefix ("2: ...") so every text is
    distinct (the toolkit drops exact duplicates). The evaluation articles are never used.
    """
    from distill.embedded import corpus

    wikipedia = _clean(corpus.wikipedia_sentences(corpus.train_articles()))
    if count <= len(wikipedia):
        return wikipedia[:count], f"the first {count:,} embedded Wikipedia training sentences"
    pool = _clean(wikipedia + corpus.lee_background())
    texts = list(pool)
    copy = 2
    while len(texts) < count:
        texts += [f"{copy}: {t}" for t in pool[: count - len(texts)]]
        copy += 1
    lee_used = min(count, len(pool)) - len(wikipedia)
    how = f"{count:,} texts: the {len(wikipedia):,} embedded Wikipedia training sentences and {lee_used:,} Lee "
    how += "background sentences"
    if count > len(pool):
        how += f", then that pool repeated with a numbered prefix ('2: ...') to reach {count:,} distinct texts"
    return texts[:count], how


def _clean(texts: list[str]) -> list[str]:
    """What distill.data.cleaning.clean_texts keeps: non-empty strings, whitespace collapsed, first of each repeat."""
    cleaned = (" ".join(t.split()) for t in texts if isinstance(t, str) and t.strip())
    return list(dict.fromkeys(cleaned))


# ----------------------------------------------------------------------------------------------- processes


@dataclass
class Process:
    wall_seconds: float
    peak_rss_mib: float
    result: dict = field(default_factory=dict)
    peak_file_mib: float | None = None  # of peak_rss_mib: pages of mapped files (libraries, weights, teacher cache)


POLL_SECONDS = 0.1  # how often run_process reads the child's resident set


def resident_mib(pid: int) -> tuple[float, float] | None:
    """(resident, of which file-backed) MiB of a running process, from /proc; None where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def run_process(command: list[str], log: Path, preload: str) -> Process:
    """Run `command` to the end; its wall time and its own peak RSS (the kernel's ru_maxrss of that child).

    `preload` is the child's LD_PRELOAD: its heap allocator ("" for glibc's malloc). The child's resident set
    is also read every POLL_SECONDS: `peak_file_mib` is the file-backed part of the largest one read.
    """
    env = dict(os.environ, LD_PRELOAD=preload)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_DISABLE", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # every variant on the CPU: the toolkit would otherwise take a GPU alone
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    largest, file_backed = 0.0, None
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)  # this child's rusage only, not its siblings'
            if pid:
                break
            sample = resident_mib(child.pid)
            if sample is not None and sample[0] >= largest:
                largest, file_backed = sample
            time.sleep(POLL_SECONDS)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BenchError(f"{shlex.join(command)} exited with {child.returncode}; end of {log}:\n{tail}")
    return Process(wall, usage.ru_maxrss / 1024, peak_file_mib=file_backed)  # Linux reports KiB


def run_variant(variant: str, spec: dict, folder: Path) -> Process:
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = folder / "spec.json", folder / "result.json"
    spec_path.write_text(json.dumps({**spec, "out_dir": str(folder)}, indent=2))
    command = [sys.executable, str(VARIANTS_SCRIPT), variant, str(spec_path), str(result_path)]
    process = run_process(command, folder / "log.txt", spec["preload"])
    process.result = json.loads(result_path.read_text())
    return process


def toolkit_command(spec: dict, output_dir: Path, cache_dir: Path, export: bool) -> list[str]:
    flags = {
        "teacher_model": spec["teacher"],
        "student_model": spec["student"],
        "student_num_layers": spec["layers"],
        "use_projection": False,
        "max_seq_length": spec["max_length"],
        "phase1_data": spec["texts_file"],
        "max_samples_phase1": spec["samples"],
        "phase1_epochs": 1,
        "phase1_lr": spec["lr"],
        "batch_size": spec["batch_size"],
        "seed": spec["seed"],
        "warmup_ratio": spec["warmup_ratio"],
        "weight_decay": spec["weight_decay"],
        "max_grad_norm": spec["max_grad_norm"],
        "pad_to_multiple_of": spec["pad_to_multiple_of"],
        "skip_phase2": True,
        "eval_data": "none",
        "output_dir": output_dir,
        "teacher_cache_dir": cache_dir,
        "save_to_artifacts": export,
        "artifacts_dir": output_dir,
        "log_with": "none",
    }
    return [sys.executable, "-m", "distill.train", *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]


def run_toolkit(spec: dict, folder: Path, cache_dir: Path, export: bool) -> Process:
    process = run_process(toolkit_command(spec, folder, cache_dir, export), folder / "log.txt", spec["preload"])
    results = json.loads((folder / "results.json").read_text())
    if results["heap_allocator"] != spec["allocator"]:
        raise BenchError(f"the toolkit ran on {results['heap_allocator']}, not on {spec['allocator']} as asked")
    phase = results["phases"]["phase1"]
    process.result = {
        "teacher_seconds": phase["teacher_seconds"],
        "teacher_encode_seconds": phase["teacher_seconds"] - results["teacher_load_seconds"],
        "train_seconds": phase["train_seconds"],
        "train_samples": phase["train_samples"],
        "teacher_loaded": results["teacher_loaded"],
    }
    return process


def base_spec(args: argparse.Namespace, workdir: Path, samples: int) -> dict:
    texts, how = workload_texts(samples)
    texts_file = workdir / f"texts-{samples}.txt"
    texts_file.parent.mkdir(parents=True, exist_ok=True)
    texts_file.write_text("\n".join(texts) + "\n")
    return {
        "teacher": MODEL,
        "student": MODEL,
        "layers": 3,
        "max_length": 128,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_ratio": 0.1,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "pad_to_multiple_of": args.pad_to_multiple_of,
        "attention_dropout": ATTENTION_DROPOUT,  # the toolkit's and the floor's student; the peer keeps the model's
        "seed": args.seed,
        "samples": samples,
        "texts_file": str(texts_file),
        "texts_how": how,
        "eval_file": str(workdir / "eval.json"),
        "allocator": args.allocator,  # every process of the run: peer, toolkit and floor alike
        "preload": args.preloads[args.allocator],
    }


# ----------------------------------------------------------------------------------------------- the modes


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_main(args: argparse.Namespace, sizes: dict, workdir: Path) -> dict:
    """Peer, toolkit cold and warm, and the two floors, `repeats` times back to back."""
    spec = base_spec(args, workdir, sizes["samples"])
    spec["eval_queries"] = sizes["eval_queries"]
    spec["eval_corpus_of_queries_only"] = args.quick
    log(f"evaluation set and teacher score ({spec['texts_how']})")
    teacher = run_variant("eval_teacher", spec, workdir / "eval_teacher").result
    runs: list[dict[str, Process]] = []
    for repeat in range(args.repeats):
        folder = workdir / f"repeat-{repeat}"
        cache = folder / "teacher-cache"
        shutil.rmtree(cache, ignore_errors=True)  # cold means cold: a fresh cache every repeat
        found: dict[str, Process] = {}
        log(f"repeat {repeat + 1}/{args.repeats}: peer")
        found["peer"] = run_variant("peer", spec, folder / "peer")
        toolkit = ("toolkit_cold", "toolkit_warm")
        for name in toolkit:
            log(f"repeat {repeat + 1}/{args.repeats}: {name}")
            found[name] = run_toolkit(spec, folder / name, cache, export=True)
        models = {name: str(folder / name / "model") for name in toolkit}
        scored = run_variant("score", {**spec, "models": models}, folder / "toolkit_score").result
        for name in toolkit:
            found[name].result.update(scored[name])
        if found["toolkit_warm"].result["teacher_loaded"]:
            raise BenchError("the warm toolkit run loaded the teacher although its cache was complete")
        for name in ("floor_grouped", "floor_random"):
            log(f"repeat {repeat + 1}/{args.repeats}: {name}")
            found[name] = run_variant(name, {**spec, "cache_dir": str(cache)}, folder / name)
        runs.append(found)
        log("  " + ", ".join(f"{k} train {v.result['train_seconds']:.1f}s" for k, v in found.items()))
    return {"spec": spec, "teacher": teacher, "runs": runs}


def run_sweep(
    args: argparse.Namespace, sizes: tuple[int, ...], workdir: Path, name: str, allocators: tuple[str, ...]
) -> dict:
    """The toolkit, cold, at each size (`--sweep_repeats` times) on each allocator: time and peak RSS."""
    rows = []
    for allocator in allocators:
        for samples in sizes:
            spec = base_spec(args, workdir, samples)
            spec.update(allocator=allocator, preload=args.preloads[allocator])
            found = []
            for repeat in range(args.sweep_repeats):
                folder = workdir / f"{allocator}-{samples}-{repeat}"
                shutil.rmtree(folder, ignore_errors=True)
                log(f"{name}: toolkit, cold, {allocator}, {samples:,} samples (run {repeat + 1}/{args.sweep_repeats})")
                found.append(run_toolkit(spec, folder, folder / "teacher-cache", export=False))
            rows.append({"samples": samples, "how": spec["texts_how"], "allocator": allocator, "runs": found})
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------- the report


def median_range(values: list[float], digits: int = 1) -> str:
    if not values:
        return "n/a"
    middle = statistics.median(values)
    if len(values) == 1:
        return f"{middle:.{digits}f}"
    return f"{middle:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def per_run(runs: list[dict[str, Process]], variant: str, key: str) -> list[float]:
    out = []
    for found in runs:
        process = found[variant]
        if key == "wall_seconds":
            out.append(process.wall_seconds)
        elif key == "peak_rss_mib":
            out.append(process.peak_rss_mib)
        elif key == "total_seconds":
            out.append(process.result["teacher_seconds"] + process.result["train_seconds"])
        elif key == "samples_per_second":
            out.append(process.result["train_samples"] / process.result["train_seconds"])
        elif key in process.result:
            out.append(float(process.result[key]))
    return out


def ratios(runs: list[dict[str, Process]], numerator: tuple[str, str], denominator: tuple[str, str]) -> list[float]:
    """numerator / denominator within each repeat."""
    tops, bottoms = per_run(runs, *numerator), per_run(runs, *denominator)
    return [a / b for a, b in zip(tops, bottoms) if b]


def verdict(values: list[float], ok) -> str:
    return "yes" if values and ok(statistics.median(values)) else "no"


def machine() -> list[str]:
    cpuinfo, meminfo = _read("/proc/cpuinfo").splitlines(), _read("/proc/meminfo").splitlines()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    cpu = models[0] if models else platform.processor() or "unknown CPU"
    mem_kib = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal")), 0)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = ", ".join(f"{name} {_version(name)}" for name in VERSIONED)
    return [
        f"- Machine: {usable} usable CPU cores (nproc), {cpu}, {mem_kib / 2**20:.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}; no GPU used.",
        f"- Versions: Python {platform.python_version()}, {versions}.",
    ]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(
    args: argparse.Namespace,
    started: float,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
    allocators: tuple[str, ...],
) -> list[str]:
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"Measured {when} in {(time.time() - started) / 60:.1f} min with:",
        "",
        "```",
        args.command,
        "```",
        "",
        *machine(),
        "- Heap allocator (LD_PRELOAD) of every process: "
        + "; ".join(
            f"{a} ({args.preloads[a]})" if args.preloads[a] else f"{a} (malloc, nothing preloaded)" for a in allocators
        )
        + f". `make` and `run_ddp.sh` preload {'nothing' if args.launchers == 'glibc' else args.launchers} here.",
        f"- Load average (1, 5, 15 min) at the start {_loads(loads[0])}, at the end {_loads(loads[1])}: "
        "anything else running on the cores shows up here and in the spread.",
    ]
    if args.quick:
        lines += ["", "**`--quick`: tiny sizes that only check that every variant runs. Not a measurement.**"]
    return lines


def _loads(values: tuple[float, ...]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _dropout_words(dropout: float | None) -> str:
    """The students' attention dropout while training: the toolkit's and the floor's, and the peer's (its recipe's)."""
    if dropout is None:
        return "attention dropout: the model's own in every variant"
    return f"attention dropout {dropout:g} (toolkit and floor; the toolkit's default), the model's own in the peer"


def main_block(args: argparse.Namespace, found: dict, head: list[str]) -> str:
    spec, runs, teacher = found["spec"], found["runs"], found["teacher"]
    names = {
        "peer": "peer: `encode` + `SentenceTransformerTrainer` + `MSELoss`",
        "toolkit_cold": "toolkit, cold cache",
        "toolkit_warm": "toolkit, warm cache",
        "floor_grouped": "floor: bare loop, the toolkit's length-grouped batches",
        "floor_random": "floor: bare loop, random batches",
    }
    lines = [
        f"## The toolkit against the peer recipe and the floor ({spec['samples']:,} samples)",
        "",
        *head,
        "",
        f"Workload: {spec['texts_how']}; teacher {MODEL}, student its 3-layer copy (Matryoshka mode, no "
        f"projection; {_dropout_words(spec['attention_dropout'])}), batch {spec['batch_size']}, 1 epoch, "
        f"max length {spec['max_length']}, lr {spec['lr']} "
        f"(linear, {spec['warmup_ratio']:.0%} warm-up), weight decay {spec['weight_decay']}, seed {spec['seed']}. "
        f"nDCG@10: {teacher['queries']} inverse-cloze queries over {teacher['corpus']} passages of the held-out "
        f"articles (teacher: {teacher['ndcg@10']:.4f}). Median of {len(runs)} repeat(s), min–max in brackets.",
        "",
        "| variant | teacher s | training s | teacher + training s | training samples/s | peak RSS MiB "
        "| nDCG@10 | process wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label in names.items():
        ndcg = per_run(runs, key, "ndcg@10")
        lines.append(
            f"| {label} | {median_range(per_run(runs, key, 'teacher_seconds'))} "
            f"| {median_range(per_run(runs, key, 'train_seconds'))} "
            f"| {median_range(per_run(runs, key, 'total_seconds'))} "
            f"| {median_range(per_run(runs, key, 'samples_per_second'))} "
            f"| {median_range(per_run(runs, key, 'peak_rss_mib'), 0)} "
            f"| {median_range(ndcg, 4) if ndcg else '—'} "
            f"| {median_range(per_run(runs, key, 'wall_seconds'))} |"
        )
    speedup = ratios(runs, ("toolkit_warm", "samples_per_second"), ("peer", "samples_per_second"))
    speedup_cold = ratios(runs, ("toolkit_cold", "samples_per_second"), ("peer", "samples_per_second"))
    overhead = ratios(runs, ("toolkit_warm", "train_seconds"), ("floor_grouped", "train_seconds"))
    overhead_cold = ratios(runs, ("toolkit_cold", "train_seconds"), ("floor_grouped", "train_seconds"))
    grouping = ratios(runs, ("floor_random", "train_seconds"), ("floor_grouped", "train_seconds"))
    teacher_speed = ratios(runs, ("peer", "teacher_seconds"), ("toolkit_cold", "teacher_seconds"))
    encode_speed = ratios(runs, ("peer", "teacher_encode_seconds"), ("toolkit_cold", "teacher_encode_seconds"))
    end_to_end = ratios(runs, ("peer", "total_seconds"), ("toolkit_cold", "total_seconds"))
    ndcg_gap = [a - b for a, b in zip(per_run(runs, "toolkit_warm", "ndcg@10"), per_run(runs, "peer", "ndcg@10"))]
    warm_teacher = per_run(runs, "toolkit_warm", "teacher_seconds")
    warm_loaded = any(found_run["toolkit_warm"].result["teacher_loaded"] for found_run in runs)
    warm_met = "yes" if not warm_loaded and max(warm_teacher) == 0 else "no"
    padding = {k: per_run(runs, k, "padding_fraction") for k in ("floor_grouped", "floor_random")}
    lines += [
        "",
        "Ratios, taken within each repeat, then the median (min–max):",
        "",
        "| ratio | value | target | met |",
        "|---|---|---|---|",
        f"| training samples/s, toolkit (warm) / peer | {median_range(speedup, 2)} | ≥ 1.5 "
        f"| {verdict(speedup, lambda m: m >= 1.5)} |",
        f"| training samples/s, toolkit (cold) / peer | {median_range(speedup_cold, 2)} | ≥ 1.5 "
        f"| {verdict(speedup_cold, lambda m: m >= 1.5)} |",
        f"| nDCG@10, toolkit − peer | {median_range(ndcg_gap, 4)} | ≥ −0.005 (equal or better, within noise) "
        f"| {verdict(ndcg_gap, lambda m: m >= -0.005)} |",
        f"| training time, toolkit (warm) / floor (same batches) | {median_range(overhead, 2)} | ≤ 1.10 "
        f"| {verdict(overhead, lambda m: m <= 1.10)} |",
        f"| training time, toolkit (cold) / floor (same batches) | {median_range(overhead_cold, 2)} | ≤ 1.10 "
        f"| {verdict(overhead_cold, lambda m: m <= 1.10)} |",
        f"| training time, floor random batches / floor grouped batches | {median_range(grouping, 2)} "
        "| (what grouping saves) | |",
        f"| teacher time (load + encode), peer / toolkit (cold) | {median_range(teacher_speed, 2)} | ≥ 1 "
        f"| {verdict(teacher_speed, lambda m: m >= 1.0)} |",
        f"| teacher encoding alone (no import, no loading), peer / toolkit (cold) | {median_range(encode_speed, 2)} "
        f"| ≥ 1 | {verdict(encode_speed, lambda m: m >= 1.0)} |",
        f"| teacher + training time, peer / toolkit (cold) | {median_range(end_to_end, 2)} | | |",
        f"| warm run: teacher seconds, teacher loaded | {median_range(warm_teacher, 2)} s, "
        f"{'yes' if warm_loaded else 'no'} | 0 s, no | {warm_met} |",
        "",
        f"Padding: {median_range([100 * p for p in padding['floor_grouped']], 1)}% of the tokens in the "
        f"length-grouped batches, {median_range([100 * p for p in padding['floor_random']], 1)}% in random batches. "
        "The nDCG@10 tolerance is 0.005 (run-to-run noise of one seed); the toolkit's loss is the Matryoshka "
        "alignment (cosine + squared distance at 384/192/96 dims), the peer's plain MSE.",
        "",
        "What each figure is: *teacher s* loads the teacher and encodes every training text (the toolkit "
        "counts the same, 0 on a warm cache); *encoding alone* leaves out importing sentence-transformers and "
        "loading the weights (the peer's `encode` call; the toolkit's teacher seconds less its loading), which "
        "the two processes do not pay alike (the peer imports `datasets` and `transformers` before its clock); "
        "*training s* is the training loop alone (the peer's "
        "`trainer.train()`, the toolkit's `train_seconds` from results.json, the floor's loop over "
        "pre-collated batches); *process wall s* is the whole process including imports, model loading, "
        "tokenization and (toolkit) export; *peak RSS* is that process's maximum resident set (ru_maxrss).",
    ]
    return "\n".join(lines)


def memory_block(args: argparse.Namespace, found: dict, head: list[str]) -> str:
    rows = found["rows"]
    lines = [
        "## Memory: the toolkit's peak RSS when the training set grows tenfold",
        "",
        *head,
        "",
        f"The toolkit, cold cache (teacher encoding and training in one process), phase 1 only; {_runs_label(args)}.",
        "",
        "| heap allocator | samples | texts | peak RSS MiB | of which file-backed MiB | teacher s | training s "
        "| process wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row["runs"]
        file_backed = [p.peak_file_mib for p in r if p.peak_file_mib is not None]
        lines.append(
            f"| {row['allocator']} | {row['samples']:,} | {row['how']} "
            f"| {median_range([p.peak_rss_mib for p in r], 0)} | {median_range(file_backed, 0)} "
            f"| {median_range([p.result['teacher_seconds'] for p in r])} "
            f"| {median_range([p.result['train_seconds'] for p in r])} | {median_range([p.wall_seconds for p in r])} |"
        )
    lines.append("")
    for allocator in dict.fromkeys(row["allocator"] for row in rows):
        mine = [row for row in rows if row["allocator"] == allocator]
        small = statistics.median(p.peak_rss_mib for p in mine[0]["runs"])
        large = statistics.median(p.peak_rss_mib for p in mine[-1]["runs"])
        growth = large / small - 1
        launchers = " (what `make` and `run_ddp.sh` use here)" if allocator == args.launchers else ""
        lines.append(
            f"- {allocator}{launchers}: peak RSS grows by {growth:+.1%} for "
            f"{mine[-1]['samples'] / mine[0]['samples']:.0f}x the data (target: less than +10%): "
            f"{'met' if growth < 0.10 else 'NOT met'}."
        )
    lines += [
        "",
        "Peak RSS is the kernel's maximum resident set of the process (ru_maxrss), file-backed pages included. "
        "*Of which file-backed*: the resident pages of mapped files (shared libraries, the memory-mapped model "
        "weights and teacher cache: clean pages the kernel can drop and read again) at the largest resident set "
        f"read every {POLL_SECONDS} s; the rest is the process's own heap.",
    ]
    return "\n".join(lines)


def scaling_block(args: argparse.Namespace, found: dict, head: list[str]) -> str:
    lines = [
        "## How cost grows with the data",
        "",
        *head,
        "",
        f"The toolkit, cold cache, phase 1 only; {_runs_label(args)}. Teacher = loading the teacher and "
        "encoding every text; training = the loop alone.",
        "",
        "| samples | teacher s | teacher texts/s | training s | training samples/s | process wall s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in found["rows"]:
        r = row["runs"]
        teacher = [p.result["teacher_seconds"] for p in r]
        train = [p.result["train_seconds"] for p in r]
        teacher_rate = [row["samples"] / t for t in teacher]
        train_rate = [p.result["train_samples"] / t for p, t in zip(r, train)]
        lines.append(
            f"| {row['samples']:,} | {median_range(teacher)} | {median_range(teacher_rate, 0)} "
            f"| {median_range(train)} | {median_range(train_rate, 0)} "
            f"| {median_range([p.wall_seconds for p in r])} | {median_range([p.peak_rss_mib for p in r], 0)} |"
        )
    lines += ["", "Texts: " + "; ".join(f"{row['samples']:,}: {row['how']}" for row in found["rows"]) + "."]
    return "\n".join(lines)


def _runs_label(args: argparse.Namespace) -> str:
    if args.sweep_repeats == 1:
        return "one run per size (timings of single runs: ±10–20% here)"
    return f"median of {args.sweep_repeats} runs per size, min–max in brackets"


def write_report(path: Path, blocks: dict[str, str]) -> None:
    """Replace the given bench:* blocks of `path`, keeping every other block and the hand-written part."""
    text = path.read_text() if path.exists() else ""
    if not text:
        text = "# Benchmarks\n\n" + "\n\n".join(_wrap(name, PLACEHOLDER) for name in BLOCKS) + "\n"
    for name, body in blocks.items():
        begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
        if begin in text and end in text:
            before, rest = text.split(begin, 1)
            text = before + _wrap(name, body) + rest.split(end, 1)[1]
        else:  # a block this file does not have yet: before the hand-written part
            before, marker, after = text.partition(HAND_WRITTEN_MARKER)
            text = before.rstrip("\n") + "\n\n" + _wrap(name, body) + "\n\n" + marker + after
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _wrap(name: str, body: str) -> str:
    return f"<!-- bench:{name}:begin -->\n{body.strip()}\n<!-- bench:{name}:end -->"


# ----------------------------------------------------------------------------------------------- entry point


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main", action="store_true", help="the comparison (the default when no mode is given)")
    parser.add_argument("--memory", action="store_true", help="the toolkit's peak RSS at 4k and 40k samples")
    parser.add_argument("--scaling", action="store_true", help="time and peak RSS at 1k, 4k, 16k, 64k samples")
    parser.add_argument("--all", action="store_true", help="the comparison, --memory and --scaling")
    parser.add_argument(
        "--samples", type=int, help="training samples of the comparison (default 8000; 64 with --quick)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the comparison (default 3)")
    parser.add_argument("--sweep_repeats", type=int, default=1, help="runs per size in --memory/--scaling")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate, the demo's phase 1")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--pad_to_multiple_of",
        type=int,
        default=1,
        help="batch width rounding, toolkit and floor (the toolkit's default: 1)",
    )
    parser.add_argument(
        "--scaling_sizes", help="comma-separated sample counts for --scaling (default 1000,4000,16000,64000)"
    )
    parser.add_argument(
        "--allocator",
        choices=("auto", "glibc", "tcmalloc"),
        default="auto",
        help="heap allocator (LD_PRELOAD) of every process; auto: what make and run_ddp.sh use, tcmalloc when "
        "installed (DISTILL_ALLOCATOR=glibc turns it off); --memory then measures glibc as well",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every variant runs")
    parser.add_argument(
        "--out",
        type=Path,
        help="the report to update (default <workdir>/BENCHMARKS.md; with --quick <workdir>/quick/BENCHMARKS.md)",
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench", help="scratch folder")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.sweep_repeats < 1:
        parser.error("--repeats and --sweep_repeats must be at least 1")
    if args.all:
        args.main = args.memory = args.scaling = True
    tcmalloc = find_tcmalloc()
    args.preloads = {"glibc": "", **({"tcmalloc": tcmalloc} if tcmalloc else {})}
    try:  # the allocator `make` and `run_ddp.sh` would preload in this environment
        args.launchers = allocator_named_in(preload_value()) or "glibc"
    except ValueError as e:
        parser.error(str(e))
    args.memory_allocators = (args.allocator,)
    if args.allocator == "auto":
        args.allocator = args.launchers if args.launchers in args.preloads else "glibc"
        args.memory_allocators = tuple(args.preloads)
    elif args.allocator not in args.preloads:
        parser.error(
            "--allocator tcmalloc: no libtcmalloc_minimal found; install it (apt-get install libtcmalloc-minimal4)"
        )
    if not (args.memory or args.scaling):
        args.main = True
    args.command = shlex.join(["python", "bench/run.py", *argv])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.samples:
        sizes["samples"] = args.samples
    if args.scaling_sizes:
        sizes["scaling"] = tuple(int(n) for n in args.scaling_sizes.split(","))
    workdir = args.workdir / ("quick" if args.quick else "full")
    if args.out is None:  # beside the runs: docs/BENCHMARKS.md summarises such reports
        args.out = workdir / "BENCHMARKS.md"
    modes = [m for m in BLOCKS if getattr(args, m)]
    blocks = {}
    try:
        for mode in modes:
            started, load_start = time.time(), os.getloadavg()
            allocators = args.memory_allocators if mode == "memory" else (args.allocator,)
            if mode == "main":
                found = run_main(args, sizes, workdir / "main")
            else:
                found = run_sweep(args, sizes[mode], workdir / mode, mode, allocators)
            head = header(args, started, (load_start, os.getloadavg()), allocators)
            render = {"main": main_block, "memory": memory_block, "scaling": scaling_block}[mode]
            blocks[mode] = render(args, found, head)
            write_report(args.out, {mode: blocks[mode]})  # each finished mode is kept even if a later one fails
            print("\n" + blocks[mode] + "\n", flush=True)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
