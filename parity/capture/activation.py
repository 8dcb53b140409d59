"""Starting the injected session from the ``PARITY_CAPTURE_*`` variables (``parity exec``).

inject.py calls :func:`activate_from_env` right after the trainer imports torch.
"""

from __future__ import annotations

import os

from parity.capture import env as cenv
from parity.capture import session, step_on
from parity.capture.env import env_bool, env_int
from parity.capture.env import one_line as _one_line
from parity.capture.env import say as _say


def activate_from_env() -> session.Session | None:
    """Start the injected session (``parity exec``); fails soft (emulation does not: a job
    asked to emulate NCCL never runs plain)."""
    if os.environ.get(cenv.ENV_EMULATE_NCCL):
        from parity.capture import nccl_emulation

        nccl_emulation.install_or_refuse(os.environ[cenv.ENV_EMULATE_NCCL])
    try:
        out = os.environ.get(cenv.ENV_DIR)
        active = session.current()
        if not out or active is not None:
            return active
        every = env_int(cenv.ENV_EVERY, 1)
        s = session.Session(out, every=max(every, 1), grads=env_bool(cenv.ENV_GRADS, True),
                          manifests=env_bool(cenv.ENV_MANIFESTS, True),
                          hasher=os.environ.get(cenv.ENV_HASHER, "auto") or "auto",
                          lazy="RANK" not in os.environ, source="exec")
        s.start()
        _note_started(out)
        if os.environ.get(step_on.ENV_STEP_ON):  # parity exec --step-on MODULE:FUNCTION
            step_on.install(os.environ[step_on.ENV_STEP_ON], s)
        return s
    except Exception as e:  # noqa: BLE001
        _say(f"capture disabled: {_one_line(e)}")
        return None


def _note_started(out: str) -> None:
    """Tell ``parity exec`` that this process imported torch (launch.nothing_captured)."""
    try:
        fd = os.open(os.path.join(out, ".parity-sessions"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass
