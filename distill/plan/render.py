"""The plan as text: every figure, with the assumptions it rests on."""

from __future__ import annotations

from distill.plan import Plan
from distill.plan.host import host_lines
from distill.plan.texts import SAMPLE


def plan_text(plan: Plan) -> str:
    """The plan as the terminal shows it."""
    lines = [f"distill plan: {plan.processes} process(es) on {plan.machines} machine(s), {plan.device}", ""]
    lines.append(f"{'texts the teacher encodes':<28}{'texts':>12}{'teacher tokens':>16}{'student tokens':>16}")
    for name, count in plan.texts.items():
        lines.append(f"{name:<28}{count:>12,}")
    for phase, tokens in plan.tokens.items():
        lines.append(
            f"{'  ' + phase + ' (one epoch)':<28}{'':>12}{tokens['teacher']:>16,.0f}{tokens['student']:>16,.0f}"
        )
    lines += ["", *teacher_lines(plan)]
    if plan.table_tokens:
        lines.append(
            f"static table: {plan.table_tokens:,} vocabulary tokens through the model, {plan.table_flops:.3g} FLOPs, "
            f"{duration(plan.table_seconds)} on each machine (once; kept in the teacher cache)"
        )
    for phase, seconds in plan.train_seconds_by_phase.items():
        lines.append(
            f"student training, {phase}: {plan.train_flops[phase]:.3g} FLOPs, {plan.optimizer_steps[phase]:,} "
            f"optimizer steps, {duration(seconds)}"
        )
    lines += host_lines(plan.host) if plan.host else []
    lines += [
        f"student training in all: {duration(plan.train_seconds)}",
        f"peak memory per process: teacher {plan.teacher_memory_bytes / 2**30:.2f} GiB, "
        f"student {plan.student_memory_bytes / 2**30:.2f} GiB",
        "all-reduce per optimizer step: "
        + (
            f"{plan.allreduce_bytes_per_step / 1e6:,.0f} MB in and out of each process, "
            f"{plan.allreduce_seconds_per_step * 1e3:.1f} ms"
            if plan.allreduce_bytes_per_step
            else "none (one process)"
        ),
        f"checkpoints on disk: {plan.checkpoint_bytes / 1e6:,.0f} MB",
    ]
    limit = plan.device_memory_bytes
    if limit and plan.student_memory_bytes > limit:
        lines.append(
            f"does not fit: the student needs {plan.student_memory_bytes / 2**30:.0f} GiB of the device's "
            f"{limit / 2**30:.0f} GiB; lower --batch_size, or pass --gradient_checkpointing True"
        )
    if limit and plan.teacher_memory_bytes > limit:
        lines.append(
            f"does not fit: the teacher needs {plan.teacher_memory_bytes / 2**30:.0f} GiB of the device's "
            f"{limit / 2**30:.0f} GiB; lower --teacher_batch_size"
        )
    total = plan.teacher_seconds + plan.table_seconds + plan.train_seconds
    share = max(plan.teacher_seconds + plan.table_seconds, plan.train_seconds) / total if total else 0
    device_hours = total * plan.processes / 3600
    lines += [
        "",
        f"the bill: {plan.dominant} dominates ({share:.0%} of {duration(total)}; {device_hours:,.2f} device-hours "
        "before loading, evaluation and checkpoints)",
        f"assumed: {plan.assumptions['rates']}; teacher tokens counted with {plan.assumptions['teacher_tokenizer']} "
        f"on up to {SAMPLE:,} texts per list",
    ]
    return "\n".join(lines)


def teacher_lines(plan: Plan) -> list[str]:
    """The teacher's size and encoding, or for an endpoint the tokens it will be sent; and a reranker's pairs."""
    reranker = [
        f"reranker {plan.reranker}: {plan.reranker_pairs:,} (query, candidate) pairs scored once, about "
        f"{plan.reranker_tokens:,.0f} tokens (cached per pair)"
    ]
    return own_teacher_lines(plan) + (reranker if plan.reranker_pairs else [])


def own_teacher_lines(plan: Plan) -> list[str]:
    """The teacher's size and encoding, or for an endpoint the tokens it will be sent."""
    p = plan.parameters
    cache = f"teacher cache on disk: {plan.cache_bytes / 1e6:,.1f} MB (float16, one vector per text; paid once)"
    phase1 = f"; phase 1's target: {p['phase1_teacher'] / 1e6:,.1f}M" if "phase1_teacher" in p else ""
    if plan.teacher.startswith("vectors"):
        return [f"teacher: {plan.teacher}; student: {p['student'] / 1e6:,.1f}M{phase1}", cache]
    if plan.teacher:  # an endpoint: each text is sent once, whatever the epochs
        own = "phase1_teacher" in p  # phase 1's texts then go through its own target, here
        sent = sum(tokens["teacher"] for phase, tokens in plan.tokens.items() if not (own and phase == "phase1"))
        return [
            f"teacher: {plan.teacher}, nothing of it runs here; student: {p['student'] / 1e6:,.1f}M{phase1}",
            f"tokens sent to the endpoint: {sent:,.0f} (counted with the student's tokenizer; the endpoint's own "
            "count, which it bills, may differ)",
            cache,
        ]
    return [
        f"teacher: {p['teacher'] / 1e6:,.1f}M parameters ({p['teacher_dense'] / 1e6:,.1f}M outside the embeddings); "
        f"student: {p['student'] / 1e6:,.1f}M ({p['student_dense'] / 1e6:,.1f}M){phase1}",
        cache,
        f"teacher encoding: {plan.teacher_flops:.3g} FLOPs, {duration(plan.teacher_seconds)} per process",
    ]


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds:,.0f} s ({seconds / 60:,.1f} min)"
    return f"{seconds:,.0f} s ({seconds / 3600:,.2f} h)"
