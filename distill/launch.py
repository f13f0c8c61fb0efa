"""Process topology: relaunch through `accelerate launch` when `--num_processes N` reaches the script itself.

`accelerate launch -m distill.train --num_processes 8` passes the flag to the module, not to accelerate;
a plain `python -m distill.train --num_processes 8` does too. Rather than silently train on one process,
distill starts itself again under `accelerate launch --num_processes 8`. Without CUDA it runs N CPU
processes over gloo (`ACCELERATE_USE_CPU=true`, without which each CPU process would train alone).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from distill.errors import DistillError

RELAUNCHED = "DISTILL_RELAUNCHED"


def current_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `--flag VALUE` / `--flag=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == f"--{flag}":
            skip = True
            continue
        if arg.startswith(f"--{flag}="):
            continue
        out.append(arg)
    return out


def relaunch_command(
    num_processes: int, argv: list[str], accelerate_config: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command and environment that run this module on `num_processes` processes."""
    env = dict(os.environ, **{RELAUNCHED: "1"})
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if accelerate_config:
        command += ["--config_file", accelerate_config]
    command += [
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--multi_gpu",
    ]
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
    return command + ["-m", "distill.train", *strip_flag(argv, "num_processes")], env


def check_num_processes(num_processes: int) -> None:
    gpus = torch.cuda.device_count()
    if gpus and num_processes > gpus:
        raise DistillError(
            f"--num_processes {num_processes} asks for more processes than the {gpus} visible GPUs; pass at most "
            f"{gpus}, or set CUDA_VISIBLE_DEVICES to expose more"
        )


def maybe_relaunch(num_processes: int | None, argv: list[str], accelerate_config: str | None = None) -> int | None:
    """Exit code of a relaunched run, or None when this process should train itself."""
    world = current_world_size()
    if num_processes is None or num_processes == world:
        return None
    if world > 1 or os.environ.get(RELAUNCHED):
        raise DistillError(
            f"--num_processes {num_processes} disagrees with the {world} processes this run was launched with; "
            "drop --num_processes or launch with the same number"
        )
    check_num_processes(num_processes)
    if num_processes == 1:
        return None
    if not torch.cuda.is_available():
        print(
            f"distill: no CUDA GPU here: running {num_processes} CPU processes (gloo). This checks the "
            "distributed path but brings no speed-up over one process.",
            file=sys.stderr,
        )
    command, env = relaunch_command(num_processes, argv, accelerate_config)
    return subprocess.call(command, env=env)
