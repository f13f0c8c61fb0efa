"""The command line: `python -m distill.train [flags]`, `distill-train [flags]`, `accelerate launch -m distill.train`.

Reads the flags and the --config file, relaunches itself through `accelerate launch` when `--num_processes N`
reaches it, runs the pipeline (distill/pipeline.py) on this process, and turns the ways a run ends into one
line and an exit code:

    0  done
    1  another process of the job failed (its own error says why)
    2  a bad input (`error: ...`, once, from the first rank)
    3  a non-finite loss stopped training (a checkpoint from before it is kept)
  130  Ctrl-C, 143  SIGTERM: stopped with a checkpoint; --resume_from_checkpoint latest continues
"""

from __future__ import annotations

import os
import sys
import time

from distill.config import Config, load_config
from distill.errors import DistillError, TrainingStopped

# torch, accelerate and the model libraries are imported once the flags are read: --help and a bad flag answer
# in well under a second, and a process that only relaunches itself never loads sentence-transformers.


def _set_up_logging() -> None:
    """distill's own log lines on stderr, as bare messages, at info (each stage with its seconds, cache hits, where
    outputs went) or at accelerate's ACCELERATE_LOG_LEVEL; other libraries stay at warnings."""
    import logging

    from distill.distributed import OneProcessLines

    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(message)s")  # what Python prints for a warning with no logging set up
        for handler in logging.getLogger().handlers:
            handler.addFilter(OneProcessLines())
    logging.getLogger("distill").setLevel(os.environ.get("ACCELERATE_LOG_LEVEL", "info").upper())


def _quiet_libraries() -> None:
    import transformers

    from distill.distributed import is_first_rank

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if not is_first_rank():
        os.environ.setdefault("TQDM_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    """Run distill with `argv` (default: the command line); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return train(load_config(argv), argv)
    except DistillError as e:  # a bad input, or a stop on purpose (TrainingStopped)
        return report(e)
    finally:
        signals = sys.modules.get("distill.signals")
        if signals is not None:  # training began: Ctrl-C interrupts at once again
            signals.release_stop_signals()
        reports = sys.modules.get("distill.report")
        if reports is not None:  # another run may use the output_dir now
            reports.release_output_dir()


def train(config: Config, argv: list[str]) -> int:
    """Relaunch on N processes if asked, else run the pipeline on this process; the exit code."""
    from accelerate.logging import get_logger

    from distill.distributed import (
        is_first_rank,
        lost_a_peer,
        maybe_relaunch,
        speaks_for_the_job,
        stop_with_the_launcher,
    )

    if speaks_for_the_job():  # settings of the --config file that a flag made irrelevant
        for warning in config.dropped:
            print(f"warning: {warning}", file=sys.stderr)
    from distill.launch import check_inputs

    launch = config.launch
    code = maybe_relaunch(launch.num_processes, argv, launch.accelerate_config, lambda: check_inputs(config))
    if code is not None:
        return code
    stop_with_the_launcher()
    _set_up_logging()
    _quiet_libraries()
    from distill.pipeline import run  # the models' libraries: only in a process that trains

    started = time.perf_counter()
    try:
        run(config)
    except RuntimeError as e:  # torch.distributed.DistError is one
        lost = lost_a_peer(e)
        if lost is None:
            raise
        if is_first_rank():  # the process that died said why; one line for all who waited on it
            print(
                f"\nerror: [rank 0] stopped: another process of this job failed ({lost}); its own error line "
                "(or traceback) above, or in its machine's log, says why",
                file=sys.stderr,
            )
        return 1
    get_logger(__name__).info(f"done in {time.perf_counter() - started:.1f}s", main_process_only=True)
    return 0


def report(error: DistillError) -> int:
    """Say why the run stopped, once for the job (or by each rank, for a problem of its own); the exit code."""
    from distill.distributed import is_first_rank, rank, world_size

    if isinstance(error, TrainingStopped):
        if is_first_rank():
            print(f"distill: {error}", file=sys.stderr)
        return error.exit_code
    if error.every_rank:  # its own problem, said by every rank that met it, on a line of its own
        label = f"[rank {rank()}] " if world_size() > 1 else ""
        newline = "" if is_first_rank() else "\n"  # not after rank 0's progress bar
        print(f"{newline}error: {label}{error}", file=sys.stderr)
    elif is_first_rank():  # one line from one process, not one per rank
        print(f"error: {error}", file=sys.stderr)
    return 2


def leave(code: int) -> None:
    """Exit with `code`. A process of a multi-process job leaves without the interpreter's teardown: there, on a
    loaded CPU machine, a gloo job's process can abort after its last line ("terminate called without an active
    exception", seen under the test suite's load), turning a finished run's exit code into -6. By now every file
    is written and the process group is ended (`pipeline.finish`)."""
    from distill.distributed import world_size

    if world_size() > 1:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
