"""Stop signals: SIGTERM (preemption) and Ctrl-C are noted here, and the training loop's guard acts on them.

A scheduler that preempts a job sends SIGTERM and waits a grace period; a user stops a run with Ctrl-C. Either
one sets a flag; at the next step every rank learns of it in the same collective as the loss, writes a
checkpoint and exits (143 for SIGTERM, 130 for SIGINT). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from distill.distributed import any_process, is_first_rank

if TYPE_CHECKING:
    from accelerate import Accelerator


class Preemption:
    """SIGTERM and a first SIGINT (Ctrl-C) set a flag; the guard turns it into a collective decision at the next step.

    The handlers stay once the first phase installs them, and installing them again keeps the flags: a signal that
    comes between the phases (during the end-of-phase evaluation, say) stops the run at phase 2's first step. The
    stop that acts on a flag clears it. A first SIGINT puts Python's own handler back, so a second one interrupts
    at once (KeyboardInterrupt); `release` puts back the SIGINT handler found at install, once training is over.
    One instance, `PREEMPTION`, serves the process: signal handlers are process-wide.
    """

    def __init__(self) -> None:
        self.requested = False  # SIGTERM
        self.interrupted = False  # SIGINT
        self._sigint_before: object = None  # the SIGINT handler install found

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) != self._handle:
            self.requested = False
            signal.signal(signal.SIGTERM, self._handle)
        before = signal.getsignal(signal.SIGINT)
        # not when Ctrl-C came already (a second one interrupts), nor where SIGINT is ignored (nohup, `cmd &`)
        if before not in (self._interrupt, signal.SIG_IGN) and not self.interrupted:
            self._sigint_before = before
            signal.signal(signal.SIGINT, self._interrupt)

    def release(self) -> None:
        """Ctrl-C interrupts at once again, and a SIGINT no step acted on is forgotten."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == self._interrupt:
            signal.signal(signal.SIGINT, self._previous_sigint())
        self.interrupted = False

    def clear(self) -> None:
        """A stop acted on the flags."""
        self.requested = self.interrupted = False

    def _previous_sigint(self) -> Any:
        before = self._sigint_before
        return before if callable(before) else signal.default_int_handler  # SIG_DFL or None: KeyboardInterrupt

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def _interrupt(self, signum: int, frame: object) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, self._previous_sigint())  # a second Ctrl-C: at once
        if is_first_rank():  # os.write: print is not safe in a signal handler
            os.write(2, b"\ndistill: Ctrl-C: stopping with a checkpoint after this step; Ctrl-C again stops at once\n")


PREEMPTION = Preemption()


def agreed_stop(accelerator: Accelerator) -> tuple[str, int] | None:
    """The stop any process was asked for since the last one acted on (SIGTERM before Ctrl-C), agreed by every
    process: its name and exit code (143, 130); None to go on. The training loop asks every step, and the pipeline
    between the stages after training."""
    terminated, interrupted = any_process(accelerator, (PREEMPTION.requested, PREEMPTION.interrupted))
    if terminated:
        return "SIGTERM", 143
    return ("SIGINT", 130) if interrupted else None


def release_stop_signals() -> None:
    """Once training is over: Ctrl-C interrupts at once again (SIGTERM keeps being noted, as it was)."""
    PREEMPTION.release()
