"""`python -m distill.launch [accelerate launch arguments] -m distill.train [flags]`: how distill starts its processes.

distill relaunches itself through this module (`--num_processes N`, `--accelerate_config FILE`) and run_ddp.sh
calls it. It first checks what needs no model (the flags, the --config file, the data paths, the output folder),
so a bad input ends on one `error:` line before any process starts, then runs `accelerate launch` (`launch`).
Every process checks the same again: under a launcher the user typed, they are the first to see the flags.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from distill.config import Config, load_config
from distill.errors import DistillError


def check_inputs(config: Config) -> None:
    """The data paths a run reads and its output folder (a fresh run's must hold no checkpoints), without a model."""
    from distill.checkpoint import resume_requested
    from distill.data.reading import check_sources
    from distill.report import probe_output_dir
    from distill.teachers import check_teacher

    check_teacher(config.teacher)
    training = config.training
    check_sources(config.data, not training.skip_phase1, not training.skip_phase2)
    probe_output_dir(Path(config.output.output_dir).expanduser(), fresh=not resume_requested(config))


# Exit codes by which distill's ranks stop on purpose, having printed why: bad input (2), a non-finite loss (3),
# Ctrl-C (130), SIGTERM (143). A launcher's traceback after them would only bury that line.
STOPS_THAT_SAY_WHY = {2, 3, 130, 143}


def launch(launcher_argv: list[str]) -> int:
    """`accelerate launch` with `launcher_argv`; where every failed rank stopped on purpose, its code, quietly.

    torch elastic reports a failed rank with a traceback of the launcher itself and a summary; for a run that
    stopped on bad input, each rank has already printed the one line that matters. Any other failure (a
    crash, a rank killed by a signal) keeps the launcher's report.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(launcher_argv)
    try:
        launch_command(args)
    except ChildFailedError as e:
        # torch elastic SIGTERMs the other ranks once one fails; those show up as -SIGTERM, a consequence
        codes = [failure.exitcode for failure in e.failures.values()]
        stops = [code for code in codes if code in STOPS_THAT_SAY_WHY]
        if stops and set(codes) <= STOPS_THAT_SAY_WHY | {-signal.SIGTERM}:
            return stops[0]
        raise
    return 0


def main(launcher_argv: list[str]) -> int:
    """Check the training flags after `-m distill.train`, then launch; the exit code (2: a bad input)."""
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(launcher_argv)
    if args.module and args.training_script == "distill.train":
        try:
            check_inputs(load_config(args.training_script_args))
        except DistillError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return launch(launcher_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
