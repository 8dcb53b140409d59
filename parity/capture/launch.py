"""``parity exec``: run a command with capture active in every rank it starts.

The command runs as given (an argv list, no shell) in its own process group, with the user's
environment plus:

* ``PYTHONPATH`` = ``parity/capture/bootstrap`` + the previous value, so every Python process
  of the job imports the bootstrap ``sitecustomize`` (which chains to the user's own);
* ``PARITY_CAPTURE_DIR`` (absolute run directory) and ``PARITY_CAPTURE_EVERY`` / ``_GRADS`` /
  ``_MANIFESTS`` / ``_HASHER`` (the options). An inherited ``PARITY_CAPTURE_ACTIVE`` is dropped.

``run.json`` is written atomically at start (status ``running``) and at the end (exit code and
status). SIGTERM, SIGINT and SIGHUP received by parity are forwarded to the command's process
group; parity then waits for the command and returns its exit code (128 + N if it was killed by
signal N), or 2 if it could not be started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from parity import __version__
from parity.artifacts import SCHEMA_VERSION, write_json_atomic
from parity.capture import env as cenv
from parity.errors import EXIT_INCOMPLETE, EXIT_USAGE, ParityError
from parity.rundir import META_FILE, RUN_FILE, count_steps, rank_dirs

STEP_ON_ENV = "PARITY_CAPTURE_STEP_ON"  # parity/capture/step_on.py (imports torch: not here)
BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "bootstrap")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def capture_env(out_dir: str | os.PathLike, *, every: int = 1, grads: bool = True,
                manifests: bool = True, hasher: str = "auto",
                base: dict[str, str] | None = None, step_on: str | None = None,
                emulate_nccl: str | None = None) -> dict[str, str]:
    """The environment of a captured command: ``base`` (default os.environ) plus parity's vars."""
    env = dict(os.environ if base is None else base)
    env.pop(cenv.ENV_ACTIVE, None)
    env.pop(cenv.ENV_EMULATE_NCCL, None)
    if emulate_nccl:
        env[cenv.ENV_EMULATE_NCCL] = emulate_nccl
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + old if old else "")
    env[cenv.ENV_DIR] = os.path.abspath(os.fspath(out_dir))
    env[cenv.ENV_EVERY] = str(int(every))
    env[cenv.ENV_GRADS] = "1" if grads else "0"
    env[cenv.ENV_MANIFESTS] = "1" if manifests else "0"
    env[cenv.ENV_HASHER] = hasher
    env.pop(STEP_ON_ENV, None)
    if step_on:
        env[STEP_ON_ENV] = step_on
    return env


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


NOTHING_CAPTURED = ("nothing was captured: no process of the command imported torch and stepped "
                    "an optimizer (a wrapper that imports torch before starting the trainer "
                    "keeps its child out of capture)")
# Each process whose capture session started (after its ``import torch``) appends its pid here
# (activation.py), so that "nothing captured" can say whether torch was imported at all.
STARTED_FILE = ".parity-sessions"


def nothing_captured(out: Path, step_on: str | None = None) -> str:
    """Why a command that exited 0 recorded no step, as accurately as the run directory tells."""
    try:
        started = len((out / STARTED_FILE).read_text().split())
    except OSError:
        started = 0
    started = max(started, len(list(rank_dirs(out))))
    if not started:
        return ("nothing was captured: no process of the command imported torch under capture "
                "(a wrapper that imports torch before starting the trainer keeps its child out "
                "of capture)")
    if step_on:
        return (f"nothing was captured: {started} process(es) imported torch, but --step-on "
                f"{step_on} was never called (see the capture warnings above)")
    return (f"nothing was captured: {started} process(es) imported torch, but no torch.optim "
            "optimizer stepped (a hand-written update or an optimizer outside torch.optim: name "
            "the function that applies the update with parity exec --step-on MODULE:FUNCTION)")


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"parity: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def summarize(out: Path) -> tuple[str, bool]:
    """One line about what the command's ranks recorded, and whether any step was recorded.

    Cheap on purpose (meta.json and a line count per rank): it runs after every job."""
    import json

    ranks, steps, sources, warnings, disabled, world = [], [], set(), 0, 0, None
    for _, child in rank_dirs(out):
        try:
            meta = json.loads((child / META_FILE).read_text())
        except (OSError, ValueError):
            meta = {}
        cap = meta.get("capture") if isinstance(meta.get("capture"), dict) else {}
        n = count_steps(child)
        ranks.append(child.name)
        steps.append(max(n - 1, 0) if n else 0)  # line 0 is step 0 (before the first step)
        sources.update(x for x in cap.get("manifests") or () if isinstance(x, str))
        warnings += len(cap.get("warnings") or ())
        disabled += bool(cap.get("disabled"))
        if isinstance(meta.get("world_size"), int):
            world = meta["world_size"]
    captured = any(steps)
    if not ranks:
        return "captured no rank", False
    lo, hi = min(steps), max(steps)
    line = (f"captured {len(ranks)}" + (f" of {world}" if world and world != len(ranks) else "")
            + f" rank(s) x {lo if lo == hi else f'{lo}-{hi}'} recorded step(s), manifests: "
            + (", ".join(sorted(sources)) or "none") + f", {warnings} warning(s)")
    if disabled:
        line += f", capture disabled on {disabled} rank(s)"
    return line, captured


def _clear_previous(out: Path) -> None:
    """A run directory holds one run: drop the artifacts an earlier run left (ours only)."""
    for _, child in rank_dirs(out):
        shutil.rmtree(child, ignore_errors=True)
    for name in (RUN_FILE, STARTED_FILE):
        try:
            (out / name).unlink()
        except FileNotFoundError:
            pass


def exec_command(out_dir: str | os.PathLike, command: list[str], *, every: int = 1,
                 grads: bool = True, manifests: bool = True, hasher: str = "auto",
                 step_on: str | None = None, emulate_nccl: str | None = None) -> int:
    """Run ``command`` with capture injected; return its exit code (2 if it cannot start).

    ``emulate_nccl`` (a topology, ``NODESxGPUS[:channels=C]``): every rank's reduce-scatters and
    all-reduces follow the NCCL Ring model (nccl_emulation.py); checked here, before the job
    starts, against the torchrun world size when the command line says it."""
    if not command:
        raise ParityError("exec: no command given")
    if every < 1:
        raise ParityError(f"exec: --every must be >= 1, got {every}")
    if step_on:
        from parity.capture.step_on import parse

        try:
            parse(step_on)
        except ValueError as e:
            raise ParityError(f"exec: {e}") from None
    if emulate_nccl:
        from parity.capture.emulation_launch import check_emulation

        emulate_nccl = check_emulation(emulate_nccl, command)
    out = Path(out_dir).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        _clear_previous(out)
    except OSError as e:
        raise ParityError(f"cannot create run directory {out}: {e.strerror or e}") from None

    run = {"v": SCHEMA_VERSION, "argv": list(command), "cwd": os.getcwd(),
           "started": time.time(), "ended": None, "exit_code": None, "status": "running",
           "error": None, "parity": __version__, "host": socket.gethostname(),
           "capture": {"every": every, "grads": grads, "manifests": manifests, "hasher": hasher,
                       **({"step_on": step_on} if step_on else {})}}
    if emulate_nccl:
        run["capture"]["emulate_nccl"] = emulate_nccl
    write_json_atomic(out / RUN_FILE, run)

    def finish(exit_code: int | None, status: str, error: str | None) -> None:
        run.update(ended=time.time(), exit_code=exit_code, status=status, error=error)
        write_json_atomic(out / RUN_FILE, run)

    env = capture_env(out, every=every, grads=grads, manifests=manifests, hasher=hasher,
                      step_on=step_on, emulate_nccl=emulate_nccl)
    received: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        received.append(signum)
        if child:
            try:
                os.killpg(child[0].pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    # Handlers go in before the child starts: a signal in between is forwarded once it exists.
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED_SIGNALS:
            try:
                old_handlers[sig] = signal.signal(sig, forward)
            except (OSError, ValueError):
                pass
    try:
        try:
            proc = subprocess.Popen(list(command), env=env, start_new_session=True)
        except (OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError):
                reason = f"command not found: {command[0]}"
            elif isinstance(e, PermissionError):
                reason = f"command not executable: {command[0]}"
            else:
                reason = f"cannot run {command[0]}: {getattr(e, 'strerror', None) or e}"
            finish(None, "failed", reason)
            sys.stderr.write(f"parity: error: {reason}\n")
            sys.stderr.flush()
            return EXIT_USAGE
        child.append(proc)
        for sig in list(received):  # arrived before the child existed
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # SIGINT with Python's default handler (not main thread)
                forward(signal.SIGINT, None)
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)

    summary, captured = summarize(out)
    _say(summary)
    if rc == 0 and not captured:
        # The command "worked" but there is nothing to compare: never let that pass as success.
        why = nothing_captured(out, step_on)
        finish(EXIT_INCOMPLETE, "failed", why)
        _say(f"warning: {why}; exiting with {EXIT_INCOMPLETE}")
        return EXIT_INCOMPLETE
    if rc == 0:
        finish(0, "ok", None)
        return 0
    if rc < 0:
        code = 128 - rc
        reason = f"killed by {_signal_name(-rc)}"
    else:
        code = rc
        reason = f"exited with code {rc}"
    if received:
        reason += f" after parity forwarded {_signal_name(received[0])}"
    finish(code, "failed", reason)
    return code
