"""The host's share of a run: its memory per process, its preparation before the first step, and mining.

The planner reads the data as the run reads it, so it measures what it can on this machine:

- memory: each machine's first process reads the data once (texts as Python strings, the planner's own reading
  measures them) and writes it to disk; every process then memory-maps the texts (distill/data/kept.py) and holds
  their pages, not strings. A process to its first step holds the imports (the planner's RSS before reading), the
  run's own start (the Accelerator, the student, the caches' maps) and the texts' bytes; on a cold run the first
  process holds the tokens it is writing (4 bytes a token) on top, or the data as read, whichever is more. Counts
  beyond the data read (`--phase1_texts`, `--phase2_pairs`) scale the data's figures;
- preparation, cold: reading and cleaning the data (timed here), hashing and writing it once per machine,
  tokenizing every text once per machine (the student's tokenizer timed on the sample, per text), copying a
  vectors file into the teacher cache, and the fixed start (imports, the Accelerator, the student);
- preparation, rerun: the fixed start alone (the data, the tokens and the teacher's vectors are memory-mapped);
- mining (`--mine_hard_negatives`): an exhaustive search, 2 x queries x passages x width FLOPs at the teacher's
  rate; its memory beyond the memory-mapped vectors is a bounded chunk, whatever the pairs.

The fixed start, the hashing and the copy rates are fitted on `make bench-scale` (docs/BENCHMARKS.md), as the
devices' utilisations are on their runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from distill.plan.figures import TextList

# Fitted on `make bench-scale` at 125,000 texts (docs/BENCHMARKS.md, 2-core AMD EPYC) and checked there at 1M:
START_SECONDS = 12.0  # imports, the Accelerator and the student, to the first step (a rerun)
START_BYTES = 0.53 * 2**30  # the run's resident memory beyond the planner's before reading: the student, the maps
COPY_BYTES_PER_SECOND = 150e6  # a vectors file into the teacher cache (its texts' digests, float16 rows)
HASH_SECONDS_PER_TEXT = 1.0e-6  # the data written once: each text's fingerprint and digest
TOKEN_BYTES = 4  # a token id as the token cache writes it (int32)


@dataclass(frozen=True)
class HostFigures:
    """What the host spends per process before the first step, and on mining."""

    bytes_per_process: int  # RSS to the first step: imports, the run's start, the texts' pages
    data_bytes: int  # of which the texts, memory-mapped
    cold_bytes: int  # the machine's first process on a cold run: the tokens being written, or the data as read
    read_seconds: float  # reading, cleaning, deduplicating, splitting
    tokenize_seconds: float  # every text tokenized once per machine (cold)
    copy_seconds: float  # a vectors file into the teacher cache (cold)
    cold_seconds: float
    rerun_seconds: float
    mined: int = 0  # negatives mined a query (--mine_hard_negatives)
    mining_flops: float = 0.0
    mining_seconds: float = 0.0


@dataclass(frozen=True)
class DataReading:
    """What reading the data cost the planner: seconds, and resident bytes before and after."""

    seconds: float
    bytes_before: int
    bytes_after: int
    texts: int  # texts read (every list)
    text_bytes: int = 0  # their UTF-8 bytes


def host_figures(
    measured: list[TextList],
    reading: DataReading,
    vectors_file_bytes: int,
    mining: tuple[int, int],
    teacher_rate: float,
) -> HostFigures:
    """The host's figures for the lists as planned (`measured`, counts scaled), from what reading them cost here;
    `mining`: (negatives mined a query, the width of the vectors searched)."""
    mined, width = mining
    planned = sum(t.count for t in measured)
    scale = planned / max(reading.texts, 1)  # a planned count beyond the data read: its bytes and seconds scale
    read_bytes = int(max(reading.bytes_after - reading.bytes_before, 0) * scale)
    data_bytes = int(reading.text_bytes * scale)
    tokens = sum(t.count * t.student_tokens for t in measured if t.phase != "evaluation")
    read_seconds = reading.seconds * scale
    tokenize_seconds = sum(t.count * t.tokenize_seconds for t in measured if t.phase != "evaluation")
    copy_seconds = vectors_file_bytes * scale / COPY_BYTES_PER_SECOND
    mining_flops = mining_seconds = 0.0
    lists = {t.name: t for t in measured}
    if mined and "phase2 queries" in lists and "phase2 passages" in lists:
        mining_flops = 2.0 * lists["phase2 queries"].count * lists["phase2 passages"].count * width
        mining_seconds = mining_flops / teacher_rate
    steady = int(reading.bytes_before + START_BYTES) + data_bytes
    return HostFigures(
        bytes_per_process=steady,
        data_bytes=data_bytes,
        cold_bytes=max(steady + int(TOKEN_BYTES * tokens), reading.bytes_before + read_bytes),
        read_seconds=read_seconds,
        tokenize_seconds=tokenize_seconds,
        copy_seconds=copy_seconds,
        cold_seconds=START_SECONDS + read_seconds + planned * HASH_SECONDS_PER_TEXT + tokenize_seconds + copy_seconds,
        rerun_seconds=START_SECONDS,
        mined=mined,
        mining_flops=mining_flops,
        mining_seconds=mining_seconds,
    )


def host_lines(host: HostFigures) -> list[str]:
    """The host's figures as the plan prints them."""
    lines = [
        f"host memory per process to the first step: {host.bytes_per_process / 2**30:.2f} GiB (the texts, "
        f"memory-mapped: {host.data_bytes / 2**30:.2f} GiB); the machine's first process, cold: "
        f"{host.cold_bytes / 2**30:.2f} GiB",
        f"host preparation to the first step: {host.cold_seconds:,.0f} s cold (reading {host.read_seconds:,.0f} s, "
        f"tokenizing {host.tokenize_seconds:,.0f} s once per machine, copying vectors {host.copy_seconds:,.0f} s), "
        f"{host.rerun_seconds:,.0f} s on a rerun (the data, tokens and vectors memory-mapped)",
    ]
    if host.mining_flops:
        lines.append(
            f"mining {host.mined} negatives a query: {host.mining_flops:.3g} FLOPs, {host.mining_seconds:,.0f} s (an "
            "exhaustive search in chunks; memory beyond the mapped vectors does not grow with the pairs)"
        )
    return lines
