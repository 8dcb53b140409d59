"""The explicit API, for trainers that prefer a call to ``parity exec``.

    import parity.capture
    session = parity.capture.start("runs/eager", every=1)
    ...train...
    session.stop()          # optional: also done at interpreter exit

It is the same :class:`~parity.capture.session.Session` that injection starts, so the artifacts
are identical. Under ``parity exec`` a session is already running: ``start`` then returns it
(and says so once) instead of starting a second one.
"""

from __future__ import annotations

import os

from parity.capture.session import Session, current

OPTIONS = ("every", "grads", "manifests", "hasher", "rank", "world_size", "local_rank")


def start(out_dir: str | os.PathLike, **options) -> Session:
    """Start capturing this process into ``out_dir`` (``rank-NNNNN/`` per docs/artifacts.md).

    Options: ``every`` (int, default 1), ``grads`` (bool, True), ``manifests`` (bool, True),
    ``hasher`` ("auto" | "xxh3" | "device"), and ``rank`` / ``world_size`` / ``local_rank``
    (default: the default process group if initialized, else RANK / WORLD_SIZE / LOCAL_RANK,
    else 0 / 1 / 0). Raises ParityError on a bad option; later failures fail soft.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        from parity.errors import ParityError

        raise ParityError(f"capture: unknown option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(OPTIONS)}")
    active = current()
    if active is not None:
        if os.path.abspath(os.fspath(out_dir)) != active.out_dir:
            active.warn(f"capture already active (writing {active.out_dir}); "
                        f"start({os.fspath(out_dir)!r}) ignored")
        return active
    return Session(out_dir, **options).start()


def stop() -> None:
    """Stop the active session, if any."""
    s = current()
    if s is not None:
        s.stop()
