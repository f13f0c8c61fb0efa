"""The one exception type users see: a bad input, said in one line with how to fix it."""

from __future__ import annotations


class DistillError(ValueError):
    """A problem with the user's input (config, data, model, cache), reported as one clear line.

    `train.main` catches it, prints ``error: <message>`` once (on the main process) and exits with
    code 2, so no rank prints a traceback for a typo.
    """
