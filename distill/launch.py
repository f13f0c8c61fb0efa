"""Process topology: relaunch through `accelerate launch` when `--num_processes N` reaches the script itself.

`accelerate launch -m distill.train --num_processes 8` passes the flag to the module, not to accelerate;
a plain `python -m distill.train --num_processes 8` does too. Rather than silently train on one process,
distill starts itself again under `accelerate launch --num_processes 8`. Without CUDA it runs N CPU
processes over gloo (`ACCELERATE_USE_CPU=true`, without which each CPU process would train alone).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from distill.errors import DistillError

RELAUNCHED = "DISTILL_RELAUNCHED"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None  # resolved before forks


def arm_parent_death_signal() -> bool:
    """Linux: have the kernel send this process SIGTERM when its parent dies. Returns whether it is armed."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0


def stop_with_the_launcher() -> bool:
    """Under torch elastic (`accelerate launch`, torchrun), have the kernel send SIGTERM if the launcher dies.

    torch elastic starts each rank in a session of its own, so a SIGKILL to the launcher (kill -9, the OOM
    killer) never reaches the ranks: they would train on with nobody to collect them, holding their devices
    and rotating checkpoints. With the parent-death signal they stop as on preemption: they finish the step,
    write a checkpoint and exit 143. Linux only; elsewhere, and outside torch elastic, nothing changes (a
    plain `python -m distill.train`, nohup'ed or not, keeps running when its shell goes). A launcher that died
    before this call leaves the rank to init (pid 1) in most containers: that too is taken as the signal.
    Returns whether the signal is armed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not arm_parent_death_signal():
        return False
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


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
    if accelerate_config:  # the file names one machine (checked in maybe_relaunch)
        command += ["--config_file", accelerate_config]
    else:
        command += ["--num_machines", "1"]
    command += ["--num_processes", str(num_processes)]
    if num_processes > 1:
        command += ["--multi_gpu"]
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


def config_file_topology(accelerate_config: str) -> tuple[int, int | None]:
    """(machines, processes) an accelerate config file names; processes None when it leaves them open."""
    from accelerate.commands.config.config_args import load_config_from_file

    settings = load_config_from_file(accelerate_config)
    processes = int(settings.num_processes or 0)
    return int(settings.num_machines or 1), processes if processes > 0 else None


def maybe_relaunch(num_processes: int | None, argv: list[str], accelerate_config: str | None = None) -> int | None:
    """Exit code of a relaunched run, or None when this process should train itself.

    With `accelerate_config`, a process not started by a launcher starts itself again under that file, on
    its `num_processes` unless `--num_processes` is given. The relaunch runs on this machine only, so a file
    that names several machines is an error that says how to launch each one.
    """
    world = current_world_size()
    if accelerate_config and world == 1 and not os.environ.get(RELAUNCHED):
        machines, file_processes = config_file_topology(accelerate_config)
        if machines > 1:
            raise DistillError(
                f"--accelerate_config {accelerate_config} names {machines} machines, but distill relaunches itself "
                f"on this machine only; on each machine run `accelerate launch --config_file {accelerate_config} "
                "--machine_rank R -m distill.train [flags]` (README: Using it), without --accelerate_config"
            )
        num_processes = num_processes or file_processes or 1
        check_num_processes(num_processes)
        return _relaunch(num_processes, argv, accelerate_config)
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
    return _relaunch(num_processes, argv, accelerate_config)


def _relaunch(num_processes: int, argv: list[str], accelerate_config: str | None) -> int:
    if not torch.cuda.is_available() and num_processes > 1:
        print(
            f"distill: no CUDA GPU here: running {num_processes} CPU processes (gloo). This checks the "
            "distributed path but brings no speed-up over one process.",
            file=sys.stderr,
        )
    command, env = relaunch_command(num_processes, argv, accelerate_config)
    # If this process is killed, `accelerate launch` gets SIGTERM and passes it to its ranks (which checkpoint).
    # A Ctrl-C reaches `accelerate launch` too (same process group), which passes it on as SIGINT: this process
    # only waits for it, rather than killing it on KeyboardInterrupt (its ranks would then stop as on SIGTERM).
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.call(command, env=env, preexec_fn=_launcher_child)
    finally:
        signal.signal(signal.SIGINT, before)


def _launcher_child() -> None:
    """In the relaunched `accelerate launch`, before exec: parent-death signal armed, Ctrl-C not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # an ignored signal would stay ignored across exec
    arm_parent_death_signal()


def join_group_of_this_attempt(timeout: timedelta) -> bool:
    """Form the process group in a store namespace of this restart attempt when torchelastic shares its store.

    Under `--max_restarts`, torchelastic keeps one TCPStore for every attempt (the agent's, always with the
    static rendezvous, by default with c10d) and hands it to the workers without a per-attempt prefix
    (pytorch/pytorch#135712). A restarted group then reads the addresses its killed predecessors left there
    and hangs in gloo's or NCCL's connect. Prefixing the store with the attempt number gives each attempt
    its own keys; Accelerate then finds the group formed and uses it. Returns whether it formed the group.
    Multi-node elastic runs with the c10d rendezvous should also export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (each node counts its own restarts, so attempt numbers can differ between nodes; see the README).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) <= 0:
        return False
    world_size = current_world_size()
    if dist.is_initialized() or world_size <= 1:
        return False
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    use_cuda = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")  # Accelerate's own rule
    if use_cuda:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=dist.PrefixStore(f"distill/attempt-{attempt}", store),
        rank=int(env["RANK"]),
        world_size=world_size,
        timeout=timeout,
    )
    return True
