"""Printing to a stdout that may be closed (``parity diff ... | head -1``) or full (``> /dev/full``).

A console report is a convenience; the files a command writes and its exit code are the result.
So commands write their files first, then print through :func:`print_safely`: if stdout is gone,
the rest of the output is dropped and the exit code stays the verdict's. A reader that closed
the pipe (``| head -1``, ``| grep -m1``) asked for no more: nothing is said, as ``cat`` says
nothing. A full or failing stdout (``> /dev/full``, a disk out of space) is an error the user
did not ask for: one line on stderr.
"""

from __future__ import annotations

import errno
import os
import sys

_GONE = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT)


def make_rich_console(**kwargs):
    """A rich Console whose closed pipe raises BrokenPipeError instead of rich's default
    (``on_broken_pipe``: ``SystemExit(1)``, which turned ``parity diff A B | head -1`` into exit 1
    with nothing said); :func:`print_safely` then keeps the command's exit code."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "stdout closed")

    return _Console(**kwargs)


def closed_stdout_exit(code: int) -> None:
    """Point fd 1 at /dev/null (the interpreter's final flush must not fail and exit 120) and
    exit with ``code``: the last resort for a closed stdout that escaped print_safely."""
    _to_devnull()
    raise SystemExit(code)


def _to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def print_safely(render) -> bool:
    """Call ``render()`` (which prints to stdout) and flush; False if stdout was closed or full
    (said on stderr only when full: a closed pipe is a reader that has read enough)."""
    try:
        render()
        sys.stdout.flush()
        return True
    except OSError as e:
        if not isinstance(e, BrokenPipeError) and e.errno not in _GONE:
            raise
        closed = isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE
    # Point fd 1 at /dev/null: the interpreter's final flush must not fail (and exit 120) too.
    _to_devnull()
    if closed:
        return False
    try:
        sys.stderr.write("parity: stdout is full or failing; the rest of the console output "
                         "was dropped (files written and the exit code are not affected)\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return False
