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
signal N), or 2 if it could not be started. Interrupted (a forwarded signal, and the command did
not exit 0): one line on stderr, exit 130, and what the ranks recorded before is kept; the run
directory is marked (``env.INTERRUPTED_FILE``) so that the job's processes end without printing
the traceback of the signal parity sent them (inject.quiet_when_interrupted).
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
from parity.capture import env_record
from parity.errors import (EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK, EXIT_SIGNALED, EXIT_USAGE,
                           ParityError, one_line)
from parity.pidlock import PidLock
from parity.rundir import (META_FILE, RUN_FILE, STEPS_FILE, looks_like_run, rank_dirs,
                           refused_records)

LOCK_FILE = ".parity-exec.lock"

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


# A rank that ``--emulate-nccl`` refuses (nccl_emulation._refuse: a collective or backend it
# cannot emulate) appends its one line here before it exits 2, so that ``parity exec`` exits 2
# as documented even when torchrun reports the failed worker as its own exit 1.
EMULATION_REFUSED_FILE = ".parity-emulation-refused"


def note_refusal(msg: str) -> None:
    """Called in a rank (see EMULATION_REFUSED_FILE); never raises."""
    out = os.environ.get(cenv.ENV_DIR)
    if not out:
        return
    try:
        with open(os.path.join(out, EMULATION_REFUSED_FILE), "a") as f:
            f.write(" ".join(msg.split()) + "\n")
    except OSError:
        pass


def emulation_refusal(out: Path) -> str | None:
    """The first refusal a rank of this run noted (note_refusal), or None."""
    try:
        lines = (out / EMULATION_REFUSED_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return next((x for x in lines if x.strip()), None)


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


def _steps_of(rank_folder: Path) -> tuple[int, int, int]:
    """(last step number, steps recorded after step 0, lines written again for a step) of a
    rank's steps.jsonl. A step is counted once however many lines it has: optimizers stepping
    back to back (``opt_a.step(); opt_b.step()``) are one step, written again by each."""
    import json

    seen: set[int] = set()
    again = 0
    try:
        data = (rank_folder / STEPS_FILE).read_bytes()
    except OSError:
        return 0, 0, 0
    for line in data.split(b"\n"):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step >= 1:
            again += step in seen
            seen.add(step)
    return max(seen, default=0), len(seen), again


def summarize(out: Path) -> tuple[str, bool]:
    """One line about what the command's ranks recorded, and whether any step was recorded.

    Cheap on purpose (meta.json and steps.jsonl per rank): it runs after every job. It counts
    steps (the last step number: a step is an optimizer ``step()``, or several optimizers
    stepping back to back), not lines, and says how many of them were recorded (``--every``)."""
    import json

    ranks, steps, recs, sources, warnings, disabled, world = [], [], [], set(), 0, 0, None
    optimizers, together = 0, False
    unhashed: set[str] = set()  # tensors of the model capture found and could not hash
    unclosed = 0  # ranks whose meta.json still says running: ended without the exit handler
    skipped_trees = 0  # module trees of fake / meta tensors, not hashed (most on one rank)
    for _, child in rank_dirs(out):
        try:
            meta = json.loads((child / META_FILE).read_text())
        except (OSError, ValueError):
            meta = {}
        cap = meta.get("capture") if isinstance(meta.get("capture"), dict) else {}
        last, recorded, again = _steps_of(child)
        together = together or again > 0
        ranks.append(child.name)
        steps.append(last)
        recs.append(recorded)
        sources.update(x for x in cap.get("manifests") or () if isinstance(x, str))
        warnings += len(cap.get("warnings") or ())
        disabled += bool(cap.get("disabled"))
        unclosed += meta.get("status") == "running"
        unhashed.update(x["fqn"] for x in cap.get("unhashed") or ()
                        if isinstance(x, dict) and isinstance(x.get("fqn"), str))
        skipped_trees = max(skipped_trees, sum(isinstance(x, dict)
                                               for x in cap.get("skipped") or ()))
        if isinstance(cap.get("optimizers"), int):
            optimizers = max(optimizers, cap["optimizers"])
        if isinstance(meta.get("world_size"), int):
            world = meta["world_size"]
    captured = any(steps)
    if not ranks:
        return "captured no rank", False

    def span(xs):
        return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"

    line = (f"captured {len(ranks)}" + (f" of {world}" if world and world != len(ranks) else "")
            # a rank never closed (os._exit): steps after its last record are not known
            + f" rank(s) x {span(steps)}{'+' if unclosed else ''} step(s) ({span(recs)} recorded"
            + (f"; {optimizers} optimizers: " + (
                "those stepped back to back count as one step" if together else
                "each step() after its own backward is a step") if optimizers > 1 else "")
            + "), manifests: " + (", ".join(sorted(sources)) or "none")
            + f", {warnings} warning(s)")
    if unhashed:  # said here too, not only on a later diff's verdict line
        line += (f", {len(unhashed)} tensor(s) of the model NOT hashed (meta.json "
                 "capture.unhashed; a diff says the run is incomplete)")
    if skipped_trees:
        line += (f", {skipped_trees} module tree(s) of fake/meta tensors skipped "
                 "(capture.skipped)")
    if disabled:
        line += f", capture disabled on {disabled} rank(s)"
    if unclosed:  # os._exit, or a signal: a step --every skipped and the final state are lost
        line += (f", {unclosed} rank(s) never closed their records (the process ended without "
                 "parity's exit handler: os._exit or a signal; steps after the last record are not "
                 "known; a diff says the run is incomplete)")
    return line, captured


def disabled_reason(out: Path) -> str | None:
    """'nothing was captured: capture was disabled on rank R: <why>' when a rank says so."""
    import json

    for r, child in rank_dirs(out):
        try:
            cap = json.loads((child / META_FILE).read_text()).get("capture") or {}
        except (OSError, ValueError, AttributeError):
            continue
        why = cap.get("disabled") if isinstance(cap, dict) else None
        if why:
            return f"nothing was captured: capture was disabled on rank {r}: {why}"
    return None


def refused_claims(out: Path) -> str | None:
    """One line about the processes that claimed a rank already recorded (capture/claims.py)."""
    recs = [(r, rec) for r, child in rank_dirs(out) for rec in refused_records(child)]
    if not recs:
        return None
    r, rec = recs[0]
    return (f"{len(recs)} process(es) were not recorded: {rec.get('reason') or f'rank {r} was claimed twice'}")


class exec_lock(PidLock):
    """``OUT/.parity-exec.lock`` held (flock) while a ``parity exec`` writes to OUT: a second one
    into the same directory is refused (it would clear or interleave the first one's files)."""

    def __init__(self, out: Path):
        super().__init__(out / LOCK_FILE)

    def busy(self, holder: str) -> ParityError:
        return ParityError(f"exec: another parity exec (pid {holder}) is writing to "
                           f"{self.path.parent}; wait for it or give another --out")

    def cannot_open(self, error: OSError) -> ParityError:
        return ParityError(f"exec: cannot lock {self.path}: {error.strerror or error}")


def _clear_previous(out: Path) -> None:
    """A run directory holds one run: drop the artifacts an earlier run left (ours only)."""
    for _, child in rank_dirs(out):
        shutil.rmtree(child, ignore_errors=True)
    for name in (RUN_FILE, STARTED_FILE, cenv.INTERRUPTED_FILE, EMULATION_REFUSED_FILE):
        try:
            (out / name).unlink()
        except FileNotFoundError:
            pass


def cannot_start(command: list[str], env: dict[str, str]) -> str | None:
    """Why ``command`` cannot be started, found without starting it (None: it can be, as far as
    a look tells): its first element resolved as ``subprocess`` will, on the job's PATH when
    it has no slash, else as a path. ``parity exec --force`` asks this before it clears the
    run it replaces (the exec itself may still fail: a bad interpreter line; that is said when
    it is tried)."""
    prog = command[0]
    if not prog:
        return "command not found: '' (an empty program name)"
    if os.sep in prog:
        if not os.path.exists(prog):
            return f"command not found: {prog}"
        if os.path.isdir(prog) or not os.access(prog, os.X_OK):
            return f"command not executable: {prog}"
        return None
    path = env.get("PATH", os.defpath)
    if shutil.which(prog, path=path) is None:
        # found but not executable, or not found at all (as the shell says them)
        exists = any(os.path.isfile(os.path.join(d or ".", prog)) for d in path.split(os.pathsep))
        return f"command {'not executable' if exists else 'not found'}: {prog}"
    return None


def exec_command(out_dir: str | os.PathLike, command: list[str], *, every: int = 1,
                 grads: bool = True, manifests: bool = True, hasher: str = "auto",
                 step_on: str | None = None, emulate_nccl: str | None = None,
                 force: bool = False, base_env: dict[str, str] | None = None) -> int:
    """Run ``command`` with capture injected; return its exit code (2 if it cannot start).

    ``out_dir`` is locked for the command's lifetime (a second ``parity exec`` into it is
    refused) and must not hold a run unless ``force`` (then that run is replaced).
    ``base_env``: the environment to run with instead of this process's (bisect's reruns).
    ``emulate_nccl`` (a topology, ``NODESxGPUS[:channels=C]``): every rank's reduce-scatters and
    all-reduces follow the NCCL Ring model (nccl_emulation.py); checked here, before the job
    starts, against the torchrun world size when the command line says it."""
    if not command:
        raise ParityError("exec: no command given")
    if not os.fspath(out_dir):  # Path("") is ".": the current directory, never meant
        raise ParityError("exec: --out is empty; give the run directory")
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
        if emulate_nccl.endswith(".json"):  # a probe's topology file: say its agreement figure
            from parity.nccl import load_topology
            from parity.nccl.probe_file import file_line

            _say(f"--emulate-nccl: {file_line(load_topology(emulate_nccl))}")
    out = Path(out_dir).resolve()
    if force and looks_like_run(out):  # the run --force replaces is cleared only for a command
        why = cannot_start(command, dict(os.environ if base_env is None else base_env))
        if why:  # that can start: nothing in it is touched (not even the lock file made)
            raise ParityError(f"exec: {why}; the run in {out} was left as it was")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParityError(f"cannot create run directory {out}: {e.strerror or e}") from None
    with exec_lock(out):
        if not force and looks_like_run(out):
            raise ParityError(f"exec: {out} already holds a run; give --force to replace it, "
                              "or another --out")
        try:
            _clear_previous(out)
        except OSError as e:
            raise ParityError(f"cannot clear run directory {out}: {e.strerror or e}") from None
        return _exec_locked(out, command, every=every, grads=grads, manifests=manifests,
                            hasher=hasher, base_env=base_env, step_on=step_on,
                            emulate_nccl=emulate_nccl)


def _exec_locked(out: Path, command: list[str], *, every: int, grads: bool, manifests: bool,
                 hasher: str, base_env: dict[str, str] | None, step_on: str | None = None,
                 emulate_nccl: str | None = None) -> int:
    base = dict(os.environ if base_env is None else base_env)

    run = {"v": SCHEMA_VERSION, "argv": list(command), "cwd": os.getcwd(),
           "started": time.time(), "ended": None, "exit_code": None, "status": "running",
           "error": None, "parity": __version__, "host": socket.gethostname(),
           "capture": {"every": every, "grads": grads, "manifests": manifests, "hasher": hasher,
                       **({"step_on": step_on} if step_on else {})},
           "env": env_record.record(base)}
    if emulate_nccl:
        run["capture"]["emulate_nccl"] = emulate_nccl
    write_json_atomic(out / RUN_FILE, run)

    def finish(exit_code: int | None, status: str, error: str | None) -> None:
        run.update(ended=time.time(), exit_code=exit_code, status=status, error=error)
        write_json_atomic(out / RUN_FILE, run)

    env = capture_env(out, every=every, grads=grads, manifests=manifests, hasher=hasher,
                      base=base, step_on=step_on, emulate_nccl=emulate_nccl)
    received: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        if not received:  # before the job hears it: its processes end quietly (inject.py)
            try:
                (out / cenv.INTERRUPTED_FILE).write_text(_signal_name(signum) + "\n")
            except OSError:
                pass
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
            sys.stderr.write(f"parity: error: {one_line(reason)}\n")  # one line
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
    if received and rc != 0:  # interrupted: one line, what was recorded is kept
        how = (f"killed by {_signal_name(-rc)}" if rc < 0 else f"exited with code {rc}")
        finish(EXIT_INTERRUPTED, "failed",
               f"interrupted: parity forwarded {_signal_name(received[0])}; the command {how}")
        _say(f"interrupted ({_signal_name(received[0])}): the job was stopped; kept what it "
             f"recorded in {out}: {summary} (exit {EXIT_INTERRUPTED})")
        return EXIT_INTERRUPTED
    _say(summary)
    refused = refused_claims(out)
    emulation = emulation_refusal(out) if rc != 0 else None
    if emulation:
        # a rank stopped because --emulate-nccl cannot run its job: bad input (exit 2, as
        # documented), whatever code the launcher (torchrun: 1) made of the rank's exit 2
        finish(EXIT_USAGE, "failed", emulation)
        _say(f"error: {emulation} (exit {EXIT_USAGE}; the command exited {rc})")
        return EXIT_USAGE
    if rc == 0 and not captured:
        # The command "worked" but there is nothing to compare: never let that pass as success.
        why = disabled_reason(out) or nothing_captured(out, step_on)
        finish(EXIT_INCOMPLETE, "failed", why)
        _say(f"warning: {why}; exiting with {EXIT_INCOMPLETE}")
        return EXIT_INCOMPLETE
    if rc == 0 and refused:
        # a second process claimed a rank and was not recorded: part of the job is missing
        finish(EXIT_INCOMPLETE, "failed", refused)
        _say(f"warning: {refused}; exiting with {EXIT_INCOMPLETE}")
        return EXIT_INCOMPLETE
    if rc == 0:
        finish(EXIT_OK, "ok", None)
        return EXIT_OK
    if rc < 0:
        code = EXIT_SIGNALED - rc
        reason = f"killed by {_signal_name(-rc)}"
    else:
        code = rc
        reason = f"exited with code {rc}"
    if received:
        reason += f" after parity forwarded {_signal_name(received[0])}"
    finish(code, "failed", reason)
    return code
