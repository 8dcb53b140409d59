"""Printing to a stdout that may be closed (``parity diff ... | head -1``) or full (``> /dev/full``).

A console report is a convenience; the files a command writes and its exit code are the result.
So commands write their files first, then print through :func:`print_safely`: if stdout is gone,
the rest of the output is dropped with one line on stderr, and the exit code stays the verdict's.
"""

from __future__ import annotations

import errno
import os
import sys

_GONE = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT)


def print_safely(render) -> bool:
    """Call ``render()`` (which prints to stdout) and flush; False if stdout was closed or full."""
    try:
        render()
        sys.stdout.flush()
        return True
    except OSError as e:
        if not isinstance(e, BrokenPipeError) and e.errno not in _GONE:
            raise
    # Point fd 1 at /dev/null: the interpreter's final flush must not fail (and exit 120) too.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.write("parity: stdout closed or full; the rest of the console output was "
                         "dropped (files written and the exit code are not affected)\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return False
