"""The precision a run trains its student in: `--mixed_precision auto` resolved on this machine, fp16 refused where
it cannot run, and oneDNN told to keep few bf16 kernels on a CPU.

`auto` is bf16 on a CPU that computes it natively (AVX512-BF16 or AMX) and float32 on other CPUs, where emulated bf16
is slower than float32. On a GPU it leaves the choice to the accelerate config: the GPU paths that run by default
are those `make gpu-check` checks, and `auto` adds none. The teacher's dtype is `teachers.local.teacher_dtype`'s.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import parse_flag_from_env

from distill.errors import DistillError

logger = get_logger(__name__)

ONEDNN_KERNELS_KEPT = 8  # oneDNN kernels a bf16 run on a CPU keeps (its default: 1,024)


def trains_on_cuda() -> bool:
    """Whether this process trains on a CUDA GPU: Accelerate's own rule."""
    return torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")


def native_bf16_cpu() -> str | None:
    """The instructions this CPU computes bf16 matrix products with (AVX512-BF16 or AMX), or None where bf16 is
    emulated in float32 arithmetic and slower than float32 itself."""
    # torch's own probes of the CPU (the ones oneDNN dispatches on); private, so absent ones read as no
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    return next((name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)()), None)


def auto_precision() -> tuple[str | None, str]:
    """What `auto` gives on this machine, and why: bf16 on a CPU that computes it natively (the demo's phases train
    1.32x and 1.40x as fast on a 2-core EPYC, and the student ties float32: docs/QUALITY.md), `no` on other CPUs,
    and on a GPU None, what the accelerate config says."""
    if trains_on_cuda():
        return None, "the accelerate config's; auto decides on CPUs"
    native = native_bf16_cpu()
    if native:
        return "bf16", f"this CPU computes bf16 natively: {native}"
    return "no", "this CPU has no native bf16 instructions, and emulated bf16 is slower than float32"


def resolve_precision(mixed_precision: str | None) -> str | None:
    """The precision Accelerate is given: `auto` resolved on this machine (`auto_precision`); any other value stands."""
    return auto_precision()[0] if mixed_precision == "auto" else mixed_precision


def log_auto_precision(accelerator: Accelerator, mixed_precision: str | None) -> None:
    """One line on what `auto` chose for this run, and why; nothing for another value."""
    if mixed_precision == "auto":
        reason = auto_precision()[1]
        logger.info(f"mixed precision auto: {accelerator.mixed_precision} ({reason})", main_process_only=True)


def training_precision(mixed_precision: str | None) -> str | None:
    """What the Accelerator is given for `--mixed_precision`: resolved, checked, and on a CPU in bf16, oneDNN's kernel
    cache kept small."""
    precision = resolve_precision(mixed_precision)
    check_precision(precision)
    if precision == "bf16" and not trains_on_cuda():
        # oneDNN keeps the bf16 kernels it builds for each batch shape, up to 1,024 of them; length-grouped batches
        # bring new shapes all the time, and the kept kernels raised the demo's peak memory by 12%, which the
        # planner does not count. Keeping 8 costs the demo's training 3-10% (docs/BENCHMARKS.md). oneDNN
        # reads the variable when it builds its first kernel, which is after this.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS_KEPT))
    return precision


def check_precision(mixed_precision: str | None) -> None:
    """fp16 needs CUDA, whether the flag or the launcher asks for it."""
    # without the flag, the precision `accelerate launch` passes on (its --mixed_precision or its config file)
    from_launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if (mixed_precision or from_launcher) == "fp16" and not torch.cuda.is_available():
        if mixed_precision:
            raise DistillError("mixed_precision fp16 needs a CUDA GPU; use bf16 or no on a CPU")
        # Accelerate would take it and train in float32 without a word
        raise DistillError(
            "mixed_precision fp16 (from accelerate launch: its --mixed_precision or the accelerate config) needs a "
            "CUDA GPU; pass --mixed_precision bf16 or no, or set mixed_precision to bf16 or no in the accelerate config"
        )
