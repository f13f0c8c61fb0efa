"""The host's share of a run: its memory per process, its preparation before the first step, and mining.

The planner reads the data as the run reads it, so it measures what it can on this machine:

- memory: every process of the run holds the data it reads (texts as Python strings) beside the imports. The planner
  holds the same: its RSS before reading, plus the peak that reading added (scaled for a planned count beyond the
  data read, `--phase1_texts`, `--phase2_pairs`), plus the run's own start (the Accelerator, the student, the
  caches' memory maps);
- preparation, cold: reading and cleaning the data (timed here), tokenizing every text once per machine (the
  student's tokenizer timed on the sample, per text), copying a vectors file into the teacher cache, and the fixed
  start (imports, the Accelerator, the student);
- preparation, rerun: the same without tokenizing or copying (the token cache and the teacher cache are warm), plus
  one pass of hashing over the texts (the caches' keys);
- mining (`--mine_hard_negatives`): an exhaustive search, 2 x queries x passages x width FLOPs at the teacher's
  rate; its memory beyond the memory-mapped vectors is a bounded chunk, whatever the pairs.

The fixed start and the hashing rate are fitted on `make bench-scale` (docs/BENCHMARKS.md), as the devices'
utilisations are on their runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from distill.plan.figures import TextList

# Fitted on `make bench-scale` at 125,000 texts (docs/BENCHMARKS.md, 2-core AMD EPYC) and checked there at 1M:
START_SECONDS = 12.0  # imports, the Accelerator and the student, to the first step (the rerun, less its reading)
START_BYTES = 0.5 * 2**30  # the run's resident memory beyond the planner's: the student, the caches' maps
COPY_BYTES_PER_SECOND = 56e6  # a vectors file into the teacher cache (float16 rows, digests): cold less rerun
HASH_SECONDS_PER_TEXT = 1.0e-6  # the caches' keys: each text hashed (texts_fingerprint and the token cache's)


@dataclass(frozen=True)
class HostFigures:
    """What the host spends per process before the first step, and on mining."""

    bytes_per_process: int  # RSS to the first step: imports, the data as read, the run's start
    data_bytes: int  # of which the data
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
    data_bytes = int(max(reading.bytes_after - reading.bytes_before, 0) * scale)
    read_seconds = reading.seconds * scale
    tokenize_seconds = sum(t.count * t.tokenize_seconds for t in measured if t.phase != "evaluation")
    copy_seconds = vectors_file_bytes * scale / COPY_BYTES_PER_SECOND
    hashing = planned * HASH_SECONDS_PER_TEXT
    mining_flops = mining_seconds = 0.0
    lists = {t.name: t for t in measured}
    if mined and "phase2 queries" in lists and "phase2 passages" in lists:
        mining_flops = 2.0 * lists["phase2 queries"].count * lists["phase2 passages"].count * width
        mining_seconds = mining_flops / teacher_rate
    return HostFigures(
        bytes_per_process=int(reading.bytes_before + START_BYTES) + data_bytes,
        data_bytes=data_bytes,
        read_seconds=read_seconds,
        tokenize_seconds=tokenize_seconds,
        copy_seconds=copy_seconds,
        cold_seconds=START_SECONDS + read_seconds + tokenize_seconds + copy_seconds + hashing,
        rerun_seconds=START_SECONDS + read_seconds + hashing,
        mined=mined,
        mining_flops=mining_flops,
        mining_seconds=mining_seconds,
    )


def host_lines(host: HostFigures) -> list[str]:
    """The host's figures as the plan prints them."""
    lines = [
        f"host memory per process to the first step: {host.bytes_per_process / 2**30:.2f} GiB (the data as read: "
        f"{host.data_bytes / 2**30:.2f} GiB)",
        f"host preparation to the first step: {host.cold_seconds:,.0f} s cold (reading {host.read_seconds:,.0f} s, "
        f"tokenizing {host.tokenize_seconds:,.0f} s once per machine, copying vectors {host.copy_seconds:,.0f} s), "
        f"{host.rerun_seconds:,.0f} s on a rerun",
    ]
    if host.mining_flops:
        lines.append(
            f"mining {host.mined} negatives a query: {host.mining_flops:.3g} FLOPs, {host.mining_seconds:,.0f} s (an "
            "exhaustive search in chunks; memory beyond the mapped vectors does not grow with the pairs)"
        )
    return lines
