"""The one exception type users see: a bad input, said in one line with how to fix it."""

from __future__ import annotations


class DistillError(ValueError):
    """A problem with the user's input (config, data, model, cache), reported as one clear line.

    `train.main` catches it, prints ``error: <message>`` once (on the main process) and exits with
    code 2, so no rank prints a traceback for a typo.
    """

    every_rank = False  # True: a problem of the process that met it, which it reports itself


class TrainingStopped(DistillError):
    """Training stopped on purpose (preemption, non-finite loss) after writing a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfMemory(DistillError):
    """This process's device ran out of memory: reported by every rank that meets it, with its rank."""

    every_rank = True


def first_sentences(text: str, count: int, limit: int) -> str:
    """The first `count` sentences of `text`'s first line, without the closing full stop, at most `limit` characters."""
    sentences = (text.splitlines() or [""])[0].split(". ")
    return ". ".join(sentences[:count]).rstrip(".")[:limit]


def first_line(error: BaseException | str, limit: int | None = 200, named: bool = False) -> str:
    """The first line of an error's message (its type's name when it has none), at most `limit` characters.

    `named`: prefixed with the type's name, as in `OfflineModeIsEnabled: Cannot reach ...`.
    """
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(error, BaseException) and (named or not line):
        line = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return line[:limit] if limit else line


def memory_message(error: BaseException) -> str:
    """The useful start of a torch out-of-memory message ('CUDA out of memory. Tried to allocate 2.00 GiB. ...')."""
    return first_sentences(str(error) or type(error).__name__, 3, 240)
