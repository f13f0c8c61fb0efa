"""Distributed mechanics, in one place: the Accelerator, the relaunch, and what processes agree on.

- `make_accelerator`: precision, accumulation, torch.compile, DDP's gradient compression, trackers.
- `maybe_relaunch`: `accelerate launch -m distill.train --num_processes 8` passes the flag to the module, not
  to accelerate; a plain `python -m distill.train --num_processes 8` does too. Rather than silently train on
  one process, distill starts itself again under `accelerate launch --num_processes 8`. Without CUDA it runs N
  CPU processes over gloo (`ACCELERATE_USE_CPU=true`, without which each CPU process would train alone).
- `main_decides`: the main process decides (probes a folder, picks a checkpoint, fits a basis) and every
  process learns the verdict, or the error, so all of them stop together and none waits alone.
- `everyone`, `smallest`: agreements across ranks; `machine_first`: work done once per machine.
- `rank`, `world_size`, `is_first_rank`: this process's place, before an Accelerator exists.

No other module reads rank variables from the environment or branches on the main process, except the leaf
writers (the cache writer, the exporter, the checkpoint and results writers), each followed by a barrier.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from accelerate import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    PartialState,
)
from accelerate.utils import (
    DDPCommunicationHookType,
    TorchDynamoPlugin,
    broadcast_object_list,
    gather_object,
)
from tqdm.auto import tqdm

from distill.config.schema import Config
from distill.errors import DistillError, first_sentences
from distill.precision import training_precision, trains_on_cuda
from distill.tracking import resolve_trackers

T = TypeVar("T")

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


def world_size() -> int:
    """Processes in this job, as the launcher set them (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class OneProcessLines(logging.Filter):
    """accelerate's logger prefixes every line with its process's rank, "[RANK 0] "; a job of one process has no
    other, so its lines go without it. Several processes keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if world_size() == 1 and isinstance(record.msg, str):
            record.msg = record.msg.removeprefix("[RANK 0] ")
        return True


def rank() -> int:
    """This process's rank in the job, as the launcher set it (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def is_first_rank() -> bool:
    """Whether this process speaks for the job where one line is said once (the command line's errors)."""
    return rank() == 0


def speaks_for_the_job() -> bool:
    """Whether this process says what is said once before training: the first rank, unless distill relaunched it
    (then the process that relaunched it has said it already)."""
    return is_first_rank() and not os.environ.get(RELAUNCHED)


def job_id() -> str:
    """What this job's processes share and no other live job does (the rendezvous address; this process for a job of
    one): written into the locks it takes, so a lock held by a machine of the same job is told from another run's."""
    if world_size() > 1 and "MASTER_ADDR" in os.environ:
        return f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    return f"{socket.gethostname()}:{os.getpid()}"


def elastic_restart() -> bool:
    """Whether torchelastic restarted this group after a failure (`--max_restarts`)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `--flag VALUE` / `--flag=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg != f"--{flag}" and not arg.startswith(f"--{flag}="):
            out.append(arg)
        skip = arg == f"--{flag}" and not skip  # the next one is its value
    return out


def relaunch_command(
    num_processes: int, argv: list[str], accelerate_config: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command and environment that run this module on `num_processes` processes."""
    env = dict(os.environ, **{RELAUNCHED: "1"})
    command = [sys.executable, "-m", "distill.launch"]  # checks the inputs, then accelerate launch (quiet on our stops)
    if accelerate_config:  # the file names one machine (checked in maybe_relaunch)
        command += ["--config_file", accelerate_config]
    else:  # one machine: a free port, so two runs on it do not collide on 29500
        command += ["--num_machines", "1", "--main_process_port", "0"]
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


def maybe_relaunch(
    num_processes: int | None,
    argv: list[str],
    accelerate_config: str | None = None,
    check: Callable[[], None] = lambda: None,
) -> int | None:
    """Exit code of a relaunched run, or None when this process should train itself.

    With `accelerate_config`, a process not started by a launcher starts itself again under that file, on
    its `num_processes` unless `--num_processes` is given. The relaunch runs on this machine only, so a file
    that names several machines is an error that says how to launch each one. `check` runs before a relaunch.
    """
    world = world_size()
    if accelerate_config and world == 1 and not os.environ.get(RELAUNCHED):
        machines, file_processes = config_file_topology(accelerate_config)
        if machines > 1:
            raise DistillError(
                f"--accelerate_config {accelerate_config} names {machines} machines, but distill relaunches itself "
                f"on this machine only; on each machine run `accelerate launch --config_file {accelerate_config} "
                "--machine_rank R -m distill.train [flags]` (README: Using it), without --accelerate_config"
            )
        return _relaunch(num_processes or file_processes or 1, argv, accelerate_config, check)
    if num_processes is None or num_processes == world:
        return None
    if world > 1 or os.environ.get(RELAUNCHED):
        raise DistillError(
            f"--num_processes {num_processes} disagrees with the {world} processes this run was launched with; "
            "drop --num_processes or launch with the same number"
        )
    return None if num_processes == 1 else _relaunch(num_processes, argv, accelerate_config, check)


def _relaunch(num_processes: int, argv: list[str], accelerate_config: str | None, check: Callable[[], None]) -> int:
    check_num_processes(num_processes)
    check()  # a bad input ends here, before a new interpreter imports torch to find it (about 7 s on 2 cores)
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
    world = world_size()
    if dist.is_initialized() or world <= 1:
        return False
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    use_cuda = trains_on_cuda()
    if use_cuda:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=dist.PrefixStore(f"distill/attempt-{attempt}", store),
        rank=rank(),
        world_size=world,
        timeout=timeout,
    )
    return True


def make_accelerator(config: Config, resuming: bool = False) -> Accelerator:
    """The Accelerator of this process: precision, accumulation, torch.compile, DDP's gradient compression, trackers.

    `resuming`: the run continues an earlier one, so the trackers append to its logs.
    """
    t, performance = config.training, config.performance
    precision = training_precision(performance.mixed_precision)
    world = world_size()
    if world > 1 and not torch.cuda.is_available():
        # Launched as several processes on a machine without CUDA: without this, accelerate (1.x) makes each
        # process train alone; with it they form one gloo group (DistributedType.MULTI_CPU).
        os.environ["ACCELERATE_USE_CPU"] = "true"
        if performance.ddp_comm_hook == "bf16":  # PyTorch refuses the bf16 hook without CUDA and NCCL >= 2.10
            raise DistillError(
                "ddp_comm_hook bf16 needs CUDA GPUs (NCCL); these processes run on CPUs over gloo, "
                "so drop --ddp_comm_hook or pass --ddp_comm_hook fp16"
            )
    timeout = timedelta(seconds=config.launch.ddp_timeout)
    join_group_of_this_attempt(timeout)  # only under torchelastic restarts; Accelerate forms the group otherwise
    handlers: list = [InitProcessGroupKwargs(timeout=timeout)]
    if performance.ddp_comm_hook != "none":  # registered when Accelerate wraps the model in DDP; one process has none
        hook = DDPCommunicationHookType(performance.ddp_comm_hook)
        handlers.append(DistributedDataParallelKwargs(comm_hook=hook))
    names = [n.strip() for n in config.output.log_with.split(",") if n.strip() and n.strip() != "none"]
    return Accelerator(
        log_with=resolve_trackers(names, config.output.output_dir, resuming) or None,
        project_dir=config.output.output_dir,
        mixed_precision=precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        # global batches, split over processes; on a GPU copied from pinned memory while the host runs on
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=torch.cuda.is_available()),
        kwargs_handlers=handlers,
        # without --torch_compile, None: the dynamo settings of the accelerate config, if any
        dynamo_plugin=compile_plugin() if performance.torch_compile else None,
    )


def compile_plugin() -> TorchDynamoPlugin:
    """torch.compile as Accelerate applies it in `prepare`: regional, with dynamic shapes. The backend is inductor,
    or the one `accelerate launch --dynamo_backend` names (ACCELERATE_DYNAMO_BACKEND; aot_eager and eager compile
    no kernels, to debug). Regional compilation compiles the repeated transformer layer once and reuses the graph
    for the others, so compiling takes seconds rather than minutes. Shapes are dynamic because padded lengths change
    from batch to batch; left unset, `accelerate launch` passes its `--dynamo_use_dynamic` default (False), and every
    new length recompiles until dynamo's recompile limit (8) makes the rest run uncompiled.
    With mixed_precision no on CUDA, Accelerate also turns on TF32 matmuls whenever a backend is set.
    """
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    backend = "inductor" if backend == "no" else backend
    return TorchDynamoPlugin(backend=backend, use_regional_compilation=True, dynamic=True)


def main_decides(accelerator: Accelerator | None, decide: Callable[[], T]) -> T:
    """`decide()` on the main process; every process returns its value, or raises the DistillError it raised.
    Without an `accelerator` (a stage that has none at hand), the processes accelerate's state knows.

    The value travels by pickle (`broadcast_object_list`): the same array or verdict everywhere, even where
    linear algebra or a view of a shared folder would differ from machine to machine.
    """
    state = PartialState() if accelerator is None else accelerator
    outcome: list = [None]  # (value, error message or None)
    if state.is_main_process:
        try:
            outcome[0] = (decide(), None)
        except DistillError as e:
            outcome[0] = (None, str(e))
    if state.num_processes > 1:
        broadcast_object_list(outcome)
    value, problem = outcome[0]
    if problem is not None:
        raise DistillError(problem)
    return value


def everyone(accelerator: Accelerator, flag: bool) -> bool:
    """Whether `flag` holds on every process (one process: whether it does)."""
    return smallest(accelerator, int(flag)) == 1


ONCE_TIMEOUT = timedelta(days=2)  # reading or tokenizing a corpus once per machine: hours, not ddp_timeout's minutes
_ONCE_GROUP: list = []  # the gloo group `machine_first` waits in, made once per process


@contextmanager
def machine_first() -> Iterator[None]:
    """Each machine's first process runs the block, then the machine's others do: work kept on a machine's disk is
    done there once. accelerate's `local_main_process_first` waits within --ddp_timeout, which reading and
    tokenizing a large corpus can outlast; here they wait in a gloo group of their own, with ONCE_TIMEOUT (a
    process that dies closes its connections, so the others fail at once)."""
    state = PartialState()
    several, first = state.num_processes > 1, state.is_local_main_process
    if several and not _ONCE_GROUP:  # collective: every process makes it at its first block
        _ONCE_GROUP.append(dist.new_group(backend="gloo", timeout=ONCE_TIMEOUT))
    if several and not first:
        dist.barrier(group=_ONCE_GROUP[0])
    yield
    if several and first:
        dist.barrier(group=_ONCE_GROUP[0])


def agreed(accelerator: Accelerator, flags: np.ndarray) -> np.ndarray:
    """Each of `flags` (a boolean per item, the same items on every process) where it holds on every process."""
    if accelerator.num_processes == 1:
        return flags
    local = torch.from_numpy(flags.astype(np.uint8)).to(accelerator.device)
    every = accelerator.gather(local).reshape(accelerator.num_processes, -1)
    return every.min(dim=0).values.cpu().numpy().astype(bool)


def smallest(accelerator: Accelerator, value: int) -> int:
    """The smallest of every process's `value` (one gather; one process: its own)."""
    if accelerator.num_processes == 1:
        return value
    values = accelerator.gather(torch.tensor([value], dtype=torch.int64, device=accelerator.device))
    return int(values.min())


_HOST_GROUP: list = []  # the gloo group `any_process` agrees over, made once per process


def host_group(accelerator: Accelerator) -> object | None:
    """A process group whose collectives run on the CPU: the default group on CPUs, a gloo group beside NCCL (made
    on every process at the same point: `new_group` is collective); None for one process."""
    if accelerator.num_processes == 1:
        return None
    if not _HOST_GROUP:
        backend = dist.get_backend()
        _HOST_GROUP.append(dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def any_process(accelerator: Accelerator, flags: tuple[bool, ...]) -> tuple[bool, ...]:
    """Each flag or-ed over every process, agreed on the CPU: the GPU's queue is neither waited for nor touched. The
    loop agrees on a stop signal every step this way, without the GPU synchronisation a device collective costs."""
    group = host_group(accelerator)
    if group is None:
        return flags
    values = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    dist.all_reduce(values, group=group)
    return tuple(bool(v) for v in values.tolist())


def progress_bar(
    accelerator: Accelerator, total: int, description: str, done: int = 0, unit: str = "it", leave: bool = True
) -> tqdm:
    """A bar with rate and time left, drawn by one process per machine (the others count silently)."""
    disable = not accelerator.is_local_main_process
    return tqdm(
        total=total, initial=done, desc=description, unit=unit, disable=disable, dynamic_ncols=True, leave=leave
    )


def writes_for_this_machine(accelerator: Accelerator) -> bool:
    """Whether this process writes its machine's files (its local main process): the teacher cache, which each
    machine may keep on its own disk. Every process of a machine still takes part in the collectives."""
    return accelerator.is_local_main_process


def machine_share(accelerator: Accelerator) -> tuple[int, int]:
    """This process's index among its machine's processes, and their count: for work each machine does once,
    split over its own devices (a static student's token vectors), where the files stay on the machine's disk.

    torchrun and `accelerate launch` say both (LOCAL_RANK, LOCAL_WORLD_SIZE); under a launcher that does not, the
    processes find them from each other's host names, in rank order (a collective: every process calls it).
    """
    count = os.environ.get("LOCAL_WORLD_SIZE")
    if count is not None:
        return accelerator.local_process_index, int(count)
    if accelerator.num_processes == 1:
        return 0, 1
    host = socket.gethostname()
    hosts = gather_object([host])
    return hosts[: accelerator.process_index].count(host), hosts.count(host)


def on_main_process(accelerator: Accelerator, write: Callable[[], T]) -> T | None:
    """`write()` on the main process only, then a barrier: for the leaf writers (results, reports, exports)."""
    value = write() if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return value


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words


def lost_a_peer(error: BaseException) -> str | None:
    """The first sentence of a collective's error when another process of the job died under it, else None.

    gloo raises a plain RuntimeError ("[.../pair.cc:553] Connection closed by peer [10.0.0.2]:29500. This is
    typically caused by a remote worker crashing ..."); NCCL and the store raise torch.distributed.DistError.
    """
    if world_size() < 2 or not isinstance(error, (RuntimeError, torch.distributed.DistError)):
        return None
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(error, torch.distributed.DistError) and not any(words in text for words in PEER_GONE):
        return None
    return first_sentences(re.sub(r"^\[[^\]]*\]\s*", "", text), 1, 200)  # without gloo's [source file:line]
