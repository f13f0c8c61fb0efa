"""The devices the planner knows: a GPU's spec-sheet figures (devices.json) and the fractions of them a run reaches;
on a CPU, the rates of the run's own work timed on this machine (distill/plan/calibration.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from distill.errors import DistillError


@dataclass(frozen=True)
class DeviceKind:
    """A GPU: its dense bf16 peak, its memory and its interconnect within a machine (spec sheets)."""

    name: str
    peak_flops: float
    memory_bytes: float
    link_bytes_per_s: float  # all-reduce bus bandwidth within a machine


# spec sheets: dense bf16 peak FLOP/s, memory bytes, all-reduce bus bandwidth within a machine
DEVICES = {
    key: DeviceKind(**fields)
    for key, fields in json.loads((Path(__file__).parent / "devices.json").read_text()).items()
}


# The fractions of a GPU's peak reached. The teacher's 0.40 is assumed for a large teacher over length-sorted
# batches; the student's 0.08 is what `make bench-gpu` measured for the 110M mpnet at batch 256 on one H100
# (docs/BENCHMARKS.md, "On a GPU"). --teacher_tflops / --student_tflops replace them with measured rates.
GPU_TEACHER_UTILISATION = 0.40


GPU_STUDENT_UTILISATION = 0.08


# On a CPU, what calibration cannot time (a static student's table, mining's search): fractions of this CPU's own
# float32 matmul rate, fitted on one cold `make demo` on 2 AMD EPYC cores (103 GFLOP/s matmul; the teacher encoded
# 1.47e13 FLOPs in 145 s, the student trained 1.83e13 in 248 s).
CPU_TEACHER_UTILISATION = 0.95


CPU_STUDENT_UTILISATION = 0.70


INTER_MACHINE_BYTES_PER_S = 25e9  # assumed: 200 Gb/s between machines


@dataclass(frozen=True)
class Device:
    """What the plan assumes of the device each process runs on."""

    name: str
    teacher_rate: float  # achieved FLOP/s while the teacher encodes
    student_rate: float  # achieved FLOP/s while the student trains
    rates: str  # where the two rates come from
    link_bytes_per_s: float
    bytes_per_param: int  # the teacher's compute dtype: bf16 on a GPU, float32 on a CPU
    activation_bytes: int  # float32 on a CPU; bf16 autocast on a GPU keeps some tensors in float32
    base_bytes: int  # a process's memory before its models (a CPU's RSS, with the data once read; a GPU's is its own)
    memory_bytes: float = 0.0  # a GPU's memory; 0: not checked (a CPU)
    calibration: str = ""  # a CPU's: "kept" (read kept rates, else time them), "again" (time them); "": none
    student_rates: dict[str, float] = field(default_factory=dict)  # phase -> FLOP/s, where timed

    def student_rate_of(self, phase: str) -> float:
        return self.student_rates.get(phase, self.student_rate)


def device_for(
    name: str, teacher_tflops: float | None, student_tflops: float | None, recalibrate: bool = False
) -> Device:
    """The device `name` (a key of DEVICES, or cpu) with its rates: measured ones where given. A CPU's rates are
    calibrated once the plan knows the run's models and lengths (`calibrated`); until then, and for what calibration
    cannot time, fractions of its matmul rate."""
    if name == "cpu":
        from distill.stages.cost import cpu_matmul_flops

        peak = cpu_matmul_flops()
        rates = f"{CPU_TEACHER_UTILISATION:.0%} / {CPU_STUDENT_UTILISATION:.0%} of this CPU's float32 matmul rate"
        rates += f" ({peak / 1e9:.0f} GFLOP/s, timed now)"
        teacher, student = peak * CPU_TEACHER_UTILISATION, peak * CPU_STUDENT_UTILISATION
        calibration = "again" if recalibrate else "kept"
        base = process_base_bytes()
        device = Device("CPU (this machine)", teacher, student, rates, 0.0, 4, 4, base, 0.0, calibration)
    else:
        kind = DEVICES[name]
        rates = f"{GPU_TEACHER_UTILISATION:.0%} / {GPU_STUDENT_UTILISATION:.0%} of the bf16 dense peak"
        rates += f" ({kind.peak_flops / 1e12:.0f} TFLOP/s)"
        teacher, student = kind.peak_flops * GPU_TEACHER_UTILISATION, kind.peak_flops * GPU_STUDENT_UTILISATION
        device = Device(kind.name, teacher, student, rates, kind.link_bytes_per_s, 2, 3, 0, kind.memory_bytes)
    if teacher_tflops or student_tflops:
        device = replace(
            device,
            teacher_rate=teacher_tflops * 1e12 if teacher_tflops else device.teacher_rate,
            student_rate=student_tflops * 1e12 if student_tflops else device.student_rate,
            rates="measured (--teacher_tflops / --student_tflops)",
            calibration="",
        )
    return device


def calibrated(device: Device, teacher_rate: float | None, student_rates: dict[str, float], line: str) -> Device:
    """The device with the rates calibration timed (or read kept): what it could not time keeps its matmul share."""
    untimed = []
    if teacher_rate is None:
        untimed.append(f"the teacher's side {CPU_TEACHER_UTILISATION:.0%}")
    if not student_rates:
        untimed.append(f"the student {CPU_STUDENT_UTILISATION:.0%}")
    if untimed:
        line = "; ".join(filter(None, [line, f"{' and '.join(untimed)} of this CPU's float32 matmul rate"]))
    return replace(
        device,
        teacher_rate=teacher_rate or device.teacher_rate,
        student_rates=student_rates,
        rates=line or device.rates,
        calibration="",
    )


def process_base_bytes() -> int:
    """This process's resident memory now, with torch, transformers and sentence-transformers imported (and, once
    the planner has read them, the data and tokenizers): what every process of a run holds before its models."""
    import psutil
    import sentence_transformers  # noqa: F401  (what a run imports)

    return int(psutil.Process().memory_info().rss)


def resident_bytes() -> int:
    """This process's resident memory now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_bytes() -> int:
    """This process's peak resident memory so far (VmHWM; the resident memory now where the system has none)."""
    try:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(status["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return resident_bytes()


def default_device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    kind = next((key for key in DEVICES if key in name), None)
    if kind is None:
        raise DistillError(
            f"the planner has no figures for {torch.cuda.get_device_name(0)}; pass --device "
            f"({', '.join(DEVICES)}) or measured rates with --teacher_tflops and --student_tflops"
        )
    return kind
