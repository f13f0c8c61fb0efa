"""Where a GPU training step's time goes: kernels, host time and GPU time per step, against the card's matmul rate.

    python bench/gpu_step.py --out OUT [--mpnet DIR] [--bert DIR] [--decoder_config DIR] [--quick]

Rows (bf16 autocast, fused AdamW, the toolkit's length-grouped batches and alignment loss; weights drawn from
each model's config, so no download is needed beyond the tokenizers):
- mpnet student (all-mpnet-base-v2's shape, 110M) at batch 256, with transformers' eager attention and with
  the toolkit's fused attention (distill/students/attention.py);
- the same, fused, under `torch.compile` (Accelerate's regional compilation, dynamic shapes), with the
  recompiles and graph breaks dynamo counted;
- BERT-base student (12 layers, 768-d, MiniLM's tokenizer) with at least 32,768 real tokens a step, padded
  (transformers' SDPA) and unpadded (the batch's texts end to end, PyTorch's variable-length FlashAttention);
- a 7B-shaped decoder teacher (Qwen2-7B's config, `bench/models/gte-qwen2-7b-config`) encoding 8 x 512-token
  texts a batch without gradients, as the toolkit's cache fill does.

Each row gives ms per step, FLOPs per step (the linear layers' matmuls counted by `torch.utils.flop_counter` on
the same batches; for BERT-base on the texts' real tokens, padding not counted), the achieved TFLOP/s and its
share of the card's bf16 matmul rate measured in the same run, and over 10 steps under
`torch.profiler`: kernels per step, GPU-busy ms per step (the kernels' summed time) and host-busy ms per step
(the host's time to issue a step, timed without the profiler and without waiting for the GPU). A step whose
host time is near its wall time is host-bound. Results go to OUT/gpu-step.json after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu  # noqa: E402 - the GPU benchmark's pieces: matmul rate, random copies, batches, FLOP counting
from variants import synchronize  # noqa: E402

PROFILED_STEPS = 10
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}


def cuda() -> bool:
    return torch.cuda.is_available()


def timed_steps(step, batches: list) -> dict:
    """Run `step` over `batches` twice: timed (host issue time, then wall time), then under the profiler."""
    sync = lambda: synchronize("cuda" if cuda() else "cpu")  # noqa: E731
    sync()
    started = time.perf_counter()
    for batch in batches:
        step(batch)
    host = time.perf_counter() - started  # the host's issue time: nothing waited for the GPU
    sync()
    wall = time.perf_counter() - started
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda() else [])
    with torch.profiler.profile(activities=activities) as profiler:
        for batch in batches:
            step(batch)
        sync()
    device_events = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = len(batches)
    return {
        "steps": steps,
        "ms_per_step": round(1000 * wall / steps, 2),
        "host_busy_ms_per_step": round(1000 * host / steps, 2),
        "gpu_busy_ms_per_step": round(sum(e.time_range.elapsed_us() for e in device_events) / 1000 / steps, 2)
        if cuda()
        else None,
        "kernels_per_step": round(len(device_events) / steps) if cuda() else None,
        "cpu_ops_per_step": round(sum(1 for e in profiler.events() if e.cpu_parent is None) / steps),
    }


def rates(result: dict, flops_per_step: float, matmul_tflops: float | None) -> dict:
    achieved = flops_per_step / (result["ms_per_step"] / 1000) / 1e12
    share = round(100 * achieved / matmul_tflops, 1) if matmul_tflops else None
    return {**result, "tflops_per_step": float(f"{flops_per_step / 1e12:.4g}"), "achieved_tflops": round(achieved, 1),
            "share_of_matmul_percent": share}  # fmt: skip


def student_row(path: Path, texts: list[str], batch_size: int, args: argparse.Namespace, **options) -> dict:
    """A training step of the student at `path` over the toolkit's batches of `texts` (bf16, fused AdamW).

    With `min_tokens`, the batch is the smallest multiple of `batch_size` whose mean real tokens reach it.
    """
    from accelerate.utils import compile_regions

    from distill.losses import LossWeights, alignment_loss
    from distill.students import kind_of
    from distill.students.attention import choose_attention, use_unpadded_batches
    from distill.students.head import embedding_dim
    from distill.students.transformer import load_student
    from distill.tokens import TokenizedTexts

    student = load_student(str(path), max_seq_length=gpu.MAX_LENGTH, attention_dropout=0.0)
    if options.get("eager"):
        student = load_eager(path)
    attention = None
    if options.get("unpadded"):  # as the toolkit decides under bf16; on a CPU (--quick) each text's own attention
        attention = choose_attention(student, gpu.device(), "bf16").to_dict()
        if not cuda():
            use_unpadded_batches(student)
        elif not attention["unpadded"]:
            raise RuntimeError(f"the toolkit keeps this student padded here: {attention['reason']}")
    batching = kind_of(student).texts(student) if options.get("unpadded") else TokenizedTexts
    tokens = batching(student.tokenizer, texts, gpu.MAX_LENGTH)
    dim = embedding_dim(student)
    if options.get("min_tokens"):
        step_rows = -(-options["min_tokens"] // float(tokens.lengths.mean()))
        batch_size = int(-(-step_rows // batch_size) * batch_size)
    batches = gpu.grouped_batches(tokens, batch_size)[: args.warmup + PROFILED_STEPS]
    collated = gpu.collate(tokens, batches, dim)
    student = student.to(gpu.device()).train()
    if options.get("unpadded"):  # its own batches are the texts' real tokens
        flops = linear_flops(student, collated[args.warmup :])
    elif options.get("real_tokens"):  # the work of the texts themselves: counted on their unpadded batches
        counter = load_student(str(path), max_seq_length=gpu.MAX_LENGTH, attention_dropout=0.0)
        use_unpadded_batches(counter)
        flat = kind_of(counter).texts(counter)(counter.tokenizer, texts, gpu.MAX_LENGTH)
        flops = linear_flops(counter.to(gpu.device()), gpu.collate(flat, batches[args.warmup :], dim))
    else:
        flops = linear_flops(student, collated[args.warmup :])
    model = compile_regions(student, dynamic=True) if options.get("compile") else student
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4, fused=cuda() or None)
    autocast = torch.autocast(gpu.device().type, dtype=torch.bfloat16)

    def step(batch: tuple[dict, torch.Tensor]) -> None:
        features, target = batch
        with autocast:
            embedding = model(dict(features))["sentence_embedding"]
        alignment_loss(embedding.float(), target, LossWeights(), None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    counters = dynamo_counters()
    for batch in collated[: args.warmup]:
        step(batch)
    result = timed_steps(step, collated[args.warmup :])
    real = sum(int(tokens.lengths[b].sum()) for b in batches[args.warmup :]) / PROFILED_STEPS
    result.update(batch_size=batch_size, real_tokens_per_step=round(real), **counters())
    if attention is not None:
        result["attention"] = attention
    return rates(result, flops, args.matmul_tflops)


def linear_flops(student, collated: list) -> float:
    """The mean FLOPs per step of the student's matrix multiplies (forward and backward) over these batches.

    Only `mm`/`addmm`: the linear layers, which hold almost all of a step's work at these lengths (attention's
    score and value products are 2-3% at 128 tokens). Attention kernels differ between the rows (eager, SDPA,
    variable-length FlashAttention) and FlopCounterMode knows some of them only, so they are left out of every
    row alike. Counted under the steps' own bf16 autocast: the variable-length kernel takes no float32.
    """
    from torch.utils.flop_counter import FlopCounterMode

    total = 0.0
    for features, target in collated:
        with FlopCounterMode(display=False) as counter, torch.autocast(gpu.device().type, dtype=torch.bfloat16):
            ((student(dict(features))["sentence_embedding"].float() - target) ** 2).sum().backward()
        counts = counter.get_flop_counts()["Global"]
        total += sum(v for k, v in counts.items() if str(k) in ("aten.mm", "aten.addmm"))
    student.zero_grad(set_to_none=True)
    return total / len(collated)


def load_eager(path: Path):
    """The student as sentence-transformers loads it: transformers' own (eager) MPNet attention."""
    from sentence_transformers import SentenceTransformer

    student = SentenceTransformer(str(path), device="cpu")
    student.max_seq_length = gpu.MAX_LENGTH
    return student


def dynamo_counters():
    """A function returning the recompiles and graph breaks dynamo counted since this call."""
    from torch._dynamo.utils import counters

    before = {k: sum(counters[k].values()) for k in ("recompiles", "graph_break")}

    def since() -> dict:
        return {f"dynamo_{k}": sum(counters[k].values()) - v for k, v in before.items()}

    return since


def decoder_row(config_dir: Path, args: argparse.Namespace) -> dict:
    """The 7B-shaped decoder teacher (random bf16 weights) encoding batches of 512-token texts, no gradients."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(config_dir)
    if args.quick:  # the same code on a model a CPU runs in seconds
        config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "num_hidden_layers": 2})  # fmt: skip
        config.layer_types = config.layer_types[:2]
    config._attn_implementation = "sdpa"
    rows, length = (2, 32) if args.quick else (8, 512)
    with torch.device(gpu.device()):
        model = AutoModel.from_config(config, dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (rows, length), generator=generator).to(gpu.device())
               for _ in range(args.warmup + PROFILED_STEPS)]  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())

    @torch.inference_mode()
    def step(ids: torch.Tensor) -> None:
        hidden = model(input_ids=ids).last_hidden_state[:, -1]  # last-token pooling, as gte-Qwen2 does
        torch.nn.functional.normalize(hidden.float(), dim=-1)

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step(batches[0][:1])
    flops = counter.get_total_flops() * rows
    for ids in batches[: args.warmup]:
        step(ids)
    result = timed_steps(step, batches[args.warmup :])
    result.update(parameters=parameters, texts_per_step=rows, tokens_per_step=rows * length)
    return rates(result, flops, args.matmul_tflops)


def release() -> None:
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def random_student(source: Path, target: Path, overrides: dict | None = None) -> Path:
    """`source`'s tokenizer and pooling with weights drawn from its config (changed by `overrides`)."""
    from transformers import AutoConfig, AutoModel

    copy = gpu.random_copy(source, target, seed=0)
    if overrides:
        config = AutoConfig.from_pretrained(copy)
        config.update(overrides)
        torch.manual_seed(0)
        AutoModel.from_config(config).save_pretrained(copy)
    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mpnet", default="sentence-transformers/all-mpnet-base-v2", help="mpnet folder or name")
    parser.add_argument("--bert", default="sentence-transformers/all-MiniLM-L6-v2", help="a BERT folder (tokenizer)")
    parser.add_argument("--decoder_config", type=Path, default=ROOT / "bench" / "models" / "gte-qwen2-7b-config")
    parser.add_argument("--texts", type=Path, required=True, help="training texts, one per line")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every row runs (CPU)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/distill-gpu-bench"))
    args = parser.parse_args(argv)
    from distill.hub import resolve_model

    args.out.mkdir(parents=True, exist_ok=True)
    results = gpu.Results(args.out / "gpu-step.json", ["python", "bench/gpu_step.py", *(argv or sys.argv[1:])])
    args.warmup = 1 if args.quick else 5
    args.matmul_tflops = None
    if cuda():
        results.add("matmul_bf16", gpu.matmul_rate())
        args.matmul_tflops = results.data["results"]["matmul_bf16"]["tflops"]
    texts = gpu.load_texts(args.texts, None)
    mpnet = random_student(Path(resolve_model(args.mpnet)), args.workdir / "step" / "mpnet")
    bert_shape = {} if args.quick else BERT_BASE
    bert = random_student(Path(resolve_model(args.bert)), args.workdir / "step" / "bert-base", bert_shape)
    mpnet_batch, bert_tokens, bert_rows = (8, 96, 8) if args.quick else (256, 32768, 64)
    rows = {
        "mpnet-b256-eager": lambda: student_row(mpnet, texts, mpnet_batch, args, eager=True),
        "mpnet-b256-fused": lambda: student_row(mpnet, texts, mpnet_batch, args),
        "mpnet-b256-fused-compile": lambda: student_row(mpnet, texts, mpnet_batch, args, compile=True),
        "bert-base-32k-tokens-padded": lambda: student_row(
            bert, texts, bert_rows, args, min_tokens=bert_tokens, real_tokens=True
        ),
        "bert-base-32k-tokens-unpadded": lambda: student_row(
            bert, texts, bert_rows, args, min_tokens=bert_tokens, unpadded=True
        ),
        "decoder-7b-encode": lambda: decoder_row(args.decoder_config, args),
    }
    if args.quick:  # inductor's C++ build takes minutes on a CPU
        del rows["mpnet-b256-fused-compile"]
    failed = []
    for name, row in rows.items():
        try:
            results.add(name, row())  # the row's models are gone once it returns
        except Exception as e:  # one row's failure (out of memory, a compile error) leaves the others measured
            results.add(name, {"error": f"{type(e).__name__}: {e}"[:500]})
            failed.append(name)
        release()
    print(json.dumps(results.data["results"], indent=1))
    if failed:
        print(f"bench/gpu_step.py: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
