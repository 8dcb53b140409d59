"""A lock file that names its holder: one ``parity exec`` per run directory
(capture/launch.py) and one sweep per sweep directory (sweep/state.py).

An exclusive, non-blocking ``flock`` on the file, which holds the holder's pid while it is held;
the kernel drops the lock when the process dies, so a crashed holder never leaves a stale lock.
Subclasses say in :meth:`PidLock.busy` (and :meth:`PidLock.cannot_open`) what the user is told.
Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path


class PidLock:
    """``path`` locked by this process (``with`` or ``acquire``/``release``)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def busy(self, holder: str) -> Exception:
        """What ``acquire`` raises when another process holds the lock (``holder``: its pid,
        or ``"?"`` when the file cannot say)."""
        return BlockingIOError(f"{self.path}: held by pid {holder}")

    def cannot_open(self, error: OSError) -> Exception:
        """What ``acquire`` raises when the lock file cannot be opened or created."""
        return error

    def acquire(self):
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self.cannot_open(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            except OSError:
                holder = "?"
            os.close(fd)
            raise self.busy(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
