"""Capture: runs inside every rank of a training job and records hashes and bucket layouts.

``parity exec`` injects it without touching the trainer (inject.py, launch.py); trainers may
also call :func:`start` themselves. Importing this package is cheap (no torch): the bootstrap
imports ``parity.capture.inject`` in every rank at startup.
"""

from __future__ import annotations

__all__ = ["start", "stop", "Session"]


def start(out_dir, **options):
    """Start capturing this process into ``out_dir``; returns the Session (see api.start)."""
    from parity.capture.api import start as _start

    return _start(out_dir, **options)


def stop() -> None:
    """Stop the active capture session, if any."""
    from parity.capture.api import stop as _stop

    _stop()


def __getattr__(name):
    if name == "Session":
        from parity.capture.session import Session

        return Session
    raise AttributeError(f"module 'parity.capture' has no attribute {name!r}")
