"""The ``PARITY_CAPTURE_*`` variables and the rank test, shared by the launcher side
(launch.py sets the variables), the rank side (inject.py, session.py read them) and the
bootstrap ``sitecustomize`` (which applies :func:`rank_skip_reason`'s rules with ``os``/``sys``).

The bottom of the capture package: it imports nothing from parity and nothing but ``os`` and
``sys``, because every process of a captured job imports it at startup.
"""

from __future__ import annotations

import os
import sys

ENV_DIR = "PARITY_CAPTURE_DIR"
ENV_EVERY = "PARITY_CAPTURE_EVERY"
ENV_GRADS = "PARITY_CAPTURE_GRADS"
ENV_MANIFESTS = "PARITY_CAPTURE_MANIFESTS"
ENV_HASHER = "PARITY_CAPTURE_HASHER"
# A topology (NODESxGPUS[:channels=C]): reduce-scatters and all-reduces follow the NCCL Ring model
# (parity exec --emulate-nccl; nccl_emulation.py).
ENV_EMULATE_NCCL = "PARITY_CAPTURE_EMULATE_NCCL"
# Set (to the pid) by a process once it is a capturing rank; its children inherit it and stay out.
ENV_ACTIVE = "PARITY_CAPTURE_ACTIVE"
ALL_ENV = (ENV_DIR, ENV_EVERY, ENV_GRADS, ENV_MANIFESTS, ENV_HASHER, ENV_ACTIVE,
           ENV_EMULATE_NCCL)
# Written into the run directory by `parity exec` when it forwards Ctrl-C or SIGTERM to the job
# (launch.py): the job's processes then end without the traceback of the signal parity sent them
# (inject.quiet_when_interrupted); parity says it in one line.
INTERRUPTED_FILE = ".parity-interrupted"

# Programs that are never ranks, recognized from the command line.
AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")
AGENT_SCRIPTS = ("torchrun",)
HELPER_MARKERS = ("torch._inductor.compile_worker", "compile_worker/__main__",
                  "multiprocessing.forkserver", "multiprocessing.resource_tracker")
_FLAGS_WITH_ARG = ("-W", "-X", "-Q")


def _program(argv: list[str]) -> tuple[str, str]:
    """("module" | "script" | "command" | "", name) of a Python command line."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m" and i + 1 < len(argv):
            return "module", argv[i + 1]
        if a.startswith("-m") and len(a) > 2:
            return "module", a[2:]
        if a == "-c" or (a.startswith("-c") and len(a) > 2):
            return "command", argv[i + 1] if a == "-c" and i + 1 < len(argv) else a[2:]
        if a in _FLAGS_WITH_ARG:
            i += 2
            continue
        if a.startswith("-") and a != "-":
            i += 1
            continue
        return "script", a
    return "", ""


def rank_skip_reason(environ=os.environ, argv=None) -> str | None:
    """Why this process must not capture, or None if it is a rank (or may become one).

    bootstrap/sitecustomize.py applies the same rules with ``os``/``sys`` only (it must not
    import parity in processes that are not ranks); keep the two in step.
    """
    if not environ.get(ENV_DIR):
        return "capture not requested"
    active = environ.get(ENV_ACTIVE)
    if active and active != str(os.getpid()):
        return "a parent process is already a capturing rank"
    if argv is None:
        argv = list(getattr(sys, "orig_argv", sys.argv))
    kind, name = _program(argv)
    if (kind == "module" and name in AGENT_MODULES) or (
            kind == "script" and os.path.basename(name) in AGENT_SCRIPTS):
        return "torchrun agent"
    if any(m in name for m in HELPER_MARKERS) or (
            kind == "command" and any(m in name for m in HELPER_MARKERS)):
        return "helper subprocess"
    return None


def env_int(name: str, default: int) -> int:
    """An integer environment variable (``default`` when unset or not an integer)."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def env_bool(name: str, default: bool) -> bool:
    """A boolean environment variable: 0/false/no/off/empty are false."""
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {msg[0]}" if msg else e.__class__.__name__


def say(msg: str) -> None:
    try:
        sys.stderr.write(f"parity: {msg}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr closed: nothing to do
        pass
