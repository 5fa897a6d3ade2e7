"""Commands that print to a pipe: a reader that stops early (``ff data validate DIR | head``) ends them quietly."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: the status a shell reports for a writer whose reader went away (``yes | head``)."""


def pipe_safe(command: Callable[[], int]) -> int:
    """Run a command that prints to stdout; end quietly with :data:`EXIT_BROKEN_PIPE` if the reader goes away.

    Python's recipe (docs of :mod:`signal`, "Note on SIGPIPE"): catch BrokenPipeError and point stdout at devnull
    so the interpreter's final flush does not print a second error. SIGPIPE is not reset to its default instead:
    that would also kill ``ff fit`` on any broken socket.

    Args:
        command: returns the exit status (a ``SystemExit`` from ``--help`` passes through once flushed).
    """
    try:
        try:
            return command()
        finally:
            sys.stdout.flush()  # inside the guard: a small output is only written here
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (captured by a caller): nothing left to flush
            pass
        return EXIT_BROKEN_PIPE
