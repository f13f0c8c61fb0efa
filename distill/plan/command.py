"""`python -m distill.plan [the run's flags or --config] [--device h100] [--num_machines 2] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from distill.config import load_config
from distill.errors import DistillError
from distill.plan import make_plan
from distill.plan.devices import DEVICES, default_device, device_for
from distill.plan.render import plan_text


def planner_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distill.plan",
        description="What a run costs, before it runs. Takes the run's own flags (or --config) and these.",
        add_help=False,
    )
    parser.add_argument("--device", default=None, help="cpu, " + ", ".join(DEVICES) + " (default: this machine's)")
    parser.add_argument("--num_machines", type=int, default=1, help="Machines the processes are spread over.")
    parser.add_argument("--teacher_tflops", type=float, help="Measured TFLOP/s of the teacher's encoding per process.")
    parser.add_argument("--student_tflops", type=float, help="Measured TFLOP/s of the student's training per process.")
    parser.add_argument("--phase1_texts", type=int, help="Plan for this many phase-1 texts (lengths: the data's).")
    parser.add_argument("--phase2_pairs", type=int, help="Plan for this many phase-2 pairs (lengths: the data's).")
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="On a CPU: time the run's work on this machine again instead of reading the rates kept for this "
        "processor (after a plan made while the machine was busy, say).",
    )
    parser.add_argument("--json", action="store_true", help="Print the figures as one JSON object.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the plan for the run `argv` describes; returns the exit code (2: a bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        planner_parser().print_help()
        print("\nThe run's flags: python -m distill.train --help")
        return 0
    options, run_argv = planner_parser().parse_known_args(argv)
    import logging

    from accelerate import PartialState

    logging.basicConfig(format="%(message)s")
    PartialState(cpu=True)  # data's log lines go through accelerate's logger; the planner starts no group
    try:
        name = options.device or default_device()
        if name != "cpu" and name not in DEVICES:
            raise DistillError(f"--device: expected cpu or one of {', '.join(DEVICES)}, got {name!r}")
        config = load_config(run_argv)
        device = device_for(name, options.teacher_tflops, options.student_tflops, options.recalibrate)
        plan = make_plan(config, device, options.num_machines, options.phase1_texts, options.phase2_pairs)
    except DistillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if options.json else plan_text(plan))
    return 0
