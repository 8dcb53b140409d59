"""Printing to a stdout that may be closed (``parity diff ... | head -1``) or full (``> /dev/full``).

A console report is a convenience; the files a command writes and its exit code are the result.
So commands write their files first, then print through :func:`print_safely`: if stdout is gone,
the rest of the output is dropped and the exit code stays the verdict's. A reader that closed
the pipe (``| head -1``, ``| grep -m1``) asked for no more: nothing is said, as ``cat`` says
nothing. A full or failing stdout (``> /dev/full``, a disk out of space) is an error the user
did not ask for: one line on stderr. What prints outside print_safely (click's ``--help``, a
dry run's plan) is caught in ``cli.main`` (:class:`watch_stdout`, :func:`stdout_failure`): the
command's exit code stands there too.
"""

from __future__ import annotations

import errno
import os
import sys

# a closed pipe, a full disk or quota, a file-size limit (ulimit -f), an I/O error
_GONE = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)
FULL_STDOUT = ("parity: stdout is full or failing; the rest of the console output was dropped "
               "(files written and the exit code are not affected)\n")


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
    _say_full()
    return False


def _say_full() -> None:
    try:
        sys.stderr.write(FULL_STDOUT)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class _Watched:
    """``sys.stdout`` as it was, recording the OSError its write or flush raised (the rest is
    the stream's own): how :func:`stdout_failure` tells a full stdout from another file's."""

    def __init__(self, stream):
        self._stream = stream
        self.failure: OSError | None = None

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self.failure = e
            raise

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            self.failure = e
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class watch_stdout:
    """``with watch_stdout():`` wraps ``sys.stdout`` so that an OSError raised by writing to it
    outside :func:`print_safely` (click's ``--help`` to a full disk) can be told apart from a
    file's (:func:`stdout_failure`); on leaving, stdout is flushed (a failure: one line on stderr
    when full, nothing when closed; never an exception) and restored."""

    def __enter__(self):
        self.original = sys.stdout
        self.watched = _Watched(sys.stdout) if sys.stdout is not None else None
        if self.watched is not None:
            sys.stdout = self.watched
        return self

    def __exit__(self, *exc):
        if self.watched is not None and self.watched in (sys.stdout,
                                                         getattr(sys.stdout, "wrapped", None)):
            sys.stdout = self.original  # also when click wrapped it (a closed pipe)
        if self.watched is not None and self.watched.failure is not None:
            try:  # already said (fd 1 now /dev/null): what is left goes nowhere, quietly
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
        else:
            print_safely(lambda: None)  # the last flush: a full stdout must not fail the exit
        return False


def stdout_error() -> OSError | None:
    """The OSError writing to stdout raised under :class:`watch_stdout` (None: none, or not
    watched); also through click's wrapper of a closed stdout."""
    watched = sys.stdout
    while watched is not None and not isinstance(watched, _Watched):
        watched = getattr(watched, "wrapped", None)  # click's _PacifyFlushWrapper
    return watched.failure if watched is not None else None


def stdout_failure(error: BaseException) -> bool:
    """Was ``error`` raised by writing to stdout (a closed pipe, a full disk, a size limit),
    under :class:`watch_stdout`? Then point fd 1 at /dev/null and say so when full (one line;
    nothing for a closed pipe, whose reader asked for no more)."""
    if not isinstance(error, OSError) or error.errno not in _GONE:
        return False
    seen = stdout_error()
    # rich re-raises a closed pipe as its own BrokenPipeError: the same failure
    if seen is None or not (seen is error or seen.errno == error.errno == errno.EPIPE):
        return False
    _to_devnull()
    if not (isinstance(error, BrokenPipeError) or error.errno == errno.EPIPE):
        _say_full()
    return True
