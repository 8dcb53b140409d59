"""The launcher interface: start a job, watch it, stop it. Launchers know nothing about hashes.

A job is one side of one cell: an entry argv (what follows torchrun's own options), the torchrun
shape, the environment to add, where `parity exec` writes artifacts and where logs go, and a
timeout. The runner calls ``start`` and then ``poll`` until it returns a :class:`JobResult`;
``cancel`` stops a job (the next ``poll`` returns its result). A launcher enforces the timeout
itself, so that a SLURM launcher can hand it to the scheduler.

Implementations: launch_local.py (one node), launch_multinode.py (several torchrun agents on this
machine), launch_slurm.py; they import this module, and launchers.py (the registry of names,
imported by the runner) imports them and picks one by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from parity.rundir import RUN_FILE


# JobResult.status values
OK, FAILED, TIMEOUT, CANCELLED, NOT_FOUND = "ok", "failed", "timeout", "cancelled", "not_found"


@dataclass
class Job:
    cell_id: str
    side: str
    entry_argv: list[str]  # e.g. ["-m", "parity.workloads.train", "--mode", "eager", ...]
    nnodes: int
    nproc_per_node: int
    env: dict[str, str]  # added to the launcher's environment
    run_dir: Path  # `parity exec --out` (the side's artifacts)
    log_dir: Path  # torchrun --log-dir: one stdout.log/stderr.log per rank
    timeout: float | None  # seconds of wall time, then the whole job is killed
    console_log: Path  # the launcher process's own stdout+stderr (torchrun's tee of every rank)
    cwd: Path | None = None
    capture: bool = True  # wrap in `parity exec --out run_dir --` (False: the trainer writes itself)
    emulate_nccl: str | None = None  # `parity exec --emulate-nccl TOPOLOGY` (with capture)


@dataclass
class JobResult:
    status: str  # ok | failed | timeout | cancelled | not_found
    exit_code: int | None
    reason: str  # one line, empty when ok
    started: float
    ended: float
    command: list[str]
    console_log: str | None = None
    rank_logs: list[dict] = field(default_factory=list)  # {rank, stdout, stderr, error}
    leftovers_killed: int = 0  # processes still alive after the job's leader exited

    @property
    def wall(self) -> float:
        return max(0.0, self.ended - self.started)


class Launcher(ABC):
    """start(job) -> handle; poll(handle) -> JobResult | None; cancel(handle)."""

    name = "?"  # the registry's name for it, set by launchers.make_launcher

    @abstractmethod
    def start(self, job: Job):
        """Start ``job`` and return an opaque handle. Never raises for a job that cannot start:
        the handle's first ``poll`` returns a failed result instead."""

    @abstractmethod
    def poll(self, handle) -> JobResult | None:
        """The job's result once it has finished (or was killed), else None. Cheap; called often."""

    @abstractmethod
    def cancel(self, handle) -> None:
        """Stop the job and everything it started; ``poll`` then returns a 'cancelled' result."""

    def cancel_many(self, handles: list) -> None:
        """Stop several jobs at once (SLURM sends one scancel, so queued jobs cannot start
        while earlier ones are being cancelled one by one)."""
        for handle in handles:
            self.cancel(handle)

    def command(self, job: Job) -> list[str]:
        """The command that would run ``job`` (for --dry-run and the record)."""
        return list(job.entry_argv)

    def close(self) -> None:
        """Release anything the launcher holds (called once, at the end of a sweep)."""

    def unmet(self, requirement: str, nnodes: int) -> str | None:
        """Why ``requirement`` cannot be met by this launcher (None when it can)."""
        return check_local_requirement(requirement, self.name)

    def unsupported(self, nnodes: int, nproc_per_node: int) -> str | None:
        """Why this launcher cannot run a job of this shape (None when it can)."""
        return None


# ------------------------------------------------------------------------------------ helpers


def parity_command() -> list[str]:
    """How to run `parity` as a child process, robust in a venv and from a source checkout.

    The same interpreter runs the same ``parity`` package this process imported: the directory
    holding it goes first on ``sys.path`` (replacing the current directory, so a job's working
    directory that happens to hold a ``parity/`` folder cannot shadow it).
    """
    spec = importlib.util.find_spec("parity")
    pkg_dir = str(Path(spec.origin).resolve().parent.parent) if spec and spec.origin else ""
    boot = ("import sys; d = sys.argv.pop(1); sys.path[:1] = [d] if d else sys.path[:1]; "
            "sys.argv[0] = 'parity'; from parity.cli import main; main()")
    return [sys.executable, "-c", boot, pkg_dir]


def exec_prefix(job: Job) -> list[str]:
    """``parity exec --out RUN_DIR --`` when the job is captured, else nothing."""
    if not job.capture:
        return []
    emulate = ["--emulate-nccl", job.emulate_nccl] if job.emulate_nccl else []
    return [*parity_command(), "exec", "--out", str(job.run_dir), "--force", *emulate, "--"]


def torchrun_argv(job: Job, endpoint: str, node_rank: int | None = None) -> list[str]:
    """torchrun with c10d rendezvous at ``endpoint`` keeping every rank's output in job.log_dir."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(job.nnodes),
            "--nproc_per_node", str(job.nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint]
    if node_rank is not None:
        argv += ["--node-rank", str(node_rank)]
    argv += ["--log-dir", str(job.log_dir), "--redirects", "3", "--tee", "3"]
    return argv + list(job.entry_argv)


def collect_rank_logs(log_dir: Path, nproc_per_node: int, rel_to: Path | None = None,
                      node_rank: int = 0) -> list[dict]:
    """Every rank's stdout/stderr (and torchrun error file) under a torchrun --log-dir.

    Layout: LOG_DIR/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log[, error.json]. Only the
    last attempt of each local rank is listed. Paths are relative to ``rel_to`` when given.
    """
    found: dict[int, tuple[int, Path]] = {}
    if log_dir.is_dir():
        for attempt_dir in log_dir.glob("*/attempt_*"):
            try:
                attempt = int(attempt_dir.name.split("_", 1)[1])
            except ValueError:
                continue
            for rdir in attempt_dir.iterdir():
                if rdir.is_dir() and rdir.name.isdigit():
                    lr = int(rdir.name)
                    if lr not in found or found[lr][0] <= attempt:
                        found[lr] = (attempt, rdir)

    def rel(p: Path) -> str | None:
        if not p.exists():
            return None
        return os.path.relpath(p, rel_to) if rel_to else str(p)

    out = []
    for lr, (attempt, rdir) in sorted(found.items()):
        out.append({"rank": node_rank * nproc_per_node + lr, "attempt": attempt,
                    "stdout": rel(rdir / "stdout.log"), "stderr": rel(rdir / "stderr.log"),
                    "error": rel(rdir / "error.json")})
    return out


def failure_hint(rank_logs: list[dict], base: Path | None = None, limit: int = 160) -> str:
    """'rank 3: RuntimeError: boom' from the rank whose stderr shows the earliest traceback.

    The earliest is usually the cause: the other ranks fail after it (a closed connection) or are
    killed by torchrun without a traceback. Without any traceback, the last stderr line of the
    earliest rank that wrote one (e.g. python's "can't open file").
    """
    found = []
    for entry in rank_logs:
        path = entry.get("stderr")
        if not path:
            continue
        p = Path(path) if base is None else base / path
        try:
            mtime = p.stat().st_mtime
            tail = _tail(p)
        except OSError:
            continue
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        if "Traceback" in tail:
            after = tail[tail.rindex("Traceback"):]
            lines = [ln.strip() for ln in after.splitlines()[1:] if ln.strip()]
            lines = [ln for ln in lines if not ln.startswith(("File ", "^", "~"))]
            if lines:
                found.append((0, mtime, entry["rank"], lines[-1][:limit]))
        elif lines:  # no traceback (e.g. "can't open file"): the last line, ranked after tracebacks
            found.append((1, mtime, entry["rank"], lines[-1][:limit]))
    if not found:
        return ""
    _, _, rank, line = min(found)
    return f"rank {rank}: {line}"


_RESTATES_EXIT = re.compile(
    r"^(node \d+: )?(exited with code -?\d+|exit code -?\d+|killed by \w+)$")


def _one_line(text: str, limit: int) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


def run_error(run_dir: Path | None, limit: int = 200) -> str:
    """``run.json``'s ``error`` (``parity exec``'s own account of why the job failed, e.g.
    "nothing was captured: no process of the command imported torch ..."), one line, shortened;
    "" when there is none or it only restates the exit code."""
    if run_dir is None:
        return ""
    try:
        obj = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return ""
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, str) or not err.strip():
        return ""
    line = _one_line(err, limit)
    return "" if _RESTATES_EXIT.match(line) else line


def console_hint(console_log: Path | str | None, limit: int = 160) -> str:
    """The last error line the launcher itself printed (torchrun's usage error "run.py: error:
    unrecognized arguments: -c", a rendezvous failure), skipping the ranks' tee'd lines
    ("[default0]:...", read from their own logs) and parity's own lines; "" if none."""
    if not console_log:
        return ""
    try:
        tail = _tail(console_log)
    except OSError:
        return ""
    for ln in reversed(tail.splitlines()):
        ln = ln.strip()
        if not ln or ln.startswith(("[default", "parity:", "File ", "^", "~")):
            continue
        if "error" in ln.lower():
            return _one_line(ln, limit)
    return ""


def failure_detail(job: "Job", rank_logs: list[dict], console_log=None, *,
                   reason: str = "") -> str:
    """What to add to a failed job's reason (every launcher uses this): ``run.json``'s error
    when ``parity exec`` recorded one, the first failing rank's error line
    (:func:`failure_hint`), and, when neither says anything, the launcher's own error line
    (:func:`console_hint`). "" when nothing is known; what ``reason`` already says is not
    repeated."""
    parts = []
    err = run_error(job.run_dir) if job.capture else ""
    if err and err not in reason:
        parts.append(err)
    hint = failure_hint(rank_logs)
    if hint:
        parts.append(hint)
    if not parts:
        hint = console_hint(console_log if console_log is not None else job.console_log)
        if hint:
            parts.append(hint)
    return "; ".join(parts)


_cuda_count: int | None = None


def _gpu_device_nodes() -> bool:
    """Is there any GPU driver here at all? (Saves importing torch, ~2 s, on CPU machines.)"""
    dev = Path("/dev")
    return (any(dev.glob("nvidia[0-9]*")) or Path("/proc/driver/nvidia").exists()
            or (dev / "kfd").exists() or not dev.is_dir())


def local_cuda_devices() -> int:
    """CUDA devices on this machine (0 without a GPU driver, without importing torch)."""
    global _cuda_count
    if _cuda_count is None and not _gpu_device_nodes():
        _cuda_count = 0
    if _cuda_count is None:
        try:
            import torch

            _cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            _cuda_count = 0
    return _cuda_count


def check_local_requirement(req: str, launcher_name: str) -> str | None:
    """The reason ``req`` is not met on this machine, or None. Vocabulary: docs/sweep.md."""
    head, _, arg = req.partition(":")
    if req == "cuda":
        return None if local_cuda_devices() > 0 else "requires cuda: no CUDA device here"
    if head == "gpus":
        n = local_cuda_devices()
        return None if n >= int(arg) else f"requires {arg} CUDA devices per node: {n} here"
    if head == "module":
        try:
            found = importlib.util.find_spec(arg) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"requires Python module {arg!r}: not importable here"
    if head == "command":
        return None if shutil.which(arg) else f"requires command {arg!r}: not on PATH"
    if head == "env":
        return None if os.environ.get(arg) else f"requires environment variable {arg}: not set"
    if head == "launcher":
        return None if arg == launcher_name else f"requires the {arg} launcher (this sweep: {launcher_name})"
    return f"unknown requirement {req!r}"


def _tail(path, size: int = 16384) -> str:
    """The last ``size`` bytes of a log, decoded (a rank's traceback, a launcher's error line
    are at its end; the whole file may be large)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read().decode("utf-8", "replace")
