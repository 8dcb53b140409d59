"""The local launcher: `parity exec -- torchrun ...` on this machine, one process group per job.

Each job's leader starts in a new session (its own process group). torchrun itself starts every
worker in yet another session, so killing the leader's group is not enough once torchrun is gone:
the launcher also follows the job's process tree through /proc (parent links, plus the sessions
its descendants created) and remembers every process it has seen, so that a timeout, a cancel or
a leader that exits while workers linger kills all of them: SIGTERM, a grace period, SIGKILL.
Processes are identified by (pid, start time), so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from parity.sweep.launcher import (CANCELLED, FAILED, NOT_FOUND, OK, TIMEOUT, Job, JobResult,
                                   Launcher, collect_rank_logs, exec_prefix, failure_detail,
                                   torchrun_argv)

_PROC = Path("/proc")
_TREE_REFRESH = 0.5  # seconds between /proc scans of a running job

# ---------------------------------------------------------------------------- /proc process table


def _proc_table() -> dict[int, tuple[int, int, int, int, str]]:
    """pid -> (ppid, pgid, sid, starttime, state) for every process (empty without /proc)."""
    table = {}
    try:
        names = os.listdir(_PROC)
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        try:
            rest = data[data.rindex(b")") + 2:].split()
            state = rest[0].decode()
            ppid, pgid, sid = int(rest[1]), int(rest[2]), int(rest[3])
            start = int(rest[19])
        except (ValueError, IndexError):
            continue
        table[int(name)] = (ppid, pgid, sid, start, state)
    return table


def _alive(pid: int, start: int | None, table=None) -> bool:
    """Is the process (pid, start time) still running (a zombie counts as gone)?"""
    if table is not None:
        info = table.get(pid)
        return bool(info) and (start is None or info[3] == start) and info[4] not in ("Z", "X")
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return (start is None or int(rest[19]) == start) and rest[0] not in (b"Z", b"X")
    except (OSError, ValueError, IndexError):
        if not _PROC.is_dir():
            try:
                os.kill(pid, 0)
                return True
            except OSError:
                return False
        return False


def free_port(host: str = "127.0.0.1", _recent: list[int] = []) -> int:  # noqa: B006
    """A TCP port that is free now and was not handed out by this process recently."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _recent:
            _recent.append(port)
            del _recent[:-64]
            return port
    return port


# ------------------------------------------------------------------------------------- launcher


@dataclass
class LocalHandle:
    job: Job
    command: list[str]
    started: float
    proc: subprocess.Popen | None = None
    log_file: object = None
    result: JobResult | None = None
    seen: dict[int, int] = field(default_factory=dict)  # pid -> start time: the job's processes
    sessions: set[int] = field(default_factory=set)
    last_scan: float = 0.0
    killed_by: str | None = None  # "timeout" | "cancel"
    exited_at: float | None = None  # set by the waiter thread the moment the leader exits


class LocalLauncher(Launcher):
    """One torchrun on this machine: how the ``local`` launcher (launch_multinode.py) runs a
    one-node job."""

    def __init__(self, grace: float = 5.0, host: str = "127.0.0.1"):
        self.grace = grace
        self.host = host

    def command(self, job: Job, port: int | None = None) -> list[str]:
        endpoint = f"{self.host}:{port if port is not None else 'PORT'}"
        return exec_prefix(job) + torchrun_argv(job, endpoint)

    # --------------------------------------------------------------------------------- start

    def start(self, job: Job) -> LocalHandle:
        command = self.command(job, free_port(self.host))
        handle = LocalHandle(job, command, time.time())
        env = {**os.environ, **job.env}
        try:
            job.console_log.parent.mkdir(parents=True, exist_ok=True)
            handle.log_file = open(job.console_log, "ab")
            handle.proc = subprocess.Popen(
                command, cwd=job.cwd, env=env, stdin=subprocess.DEVNULL, stdout=handle.log_file,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except FileNotFoundError as e:
            what = e.filename or command[0]
            if job.cwd is not None and not Path(job.cwd).is_dir():
                what = f"working directory {job.cwd}"
            handle.result = self._result(handle, NOT_FOUND, None, f"command not found: {what}")
        except OSError as e:
            handle.result = self._result(handle, FAILED, None,
                                         f"cannot start {command[0]}: {e.strerror or e}")
        else:
            handle.seen[handle.proc.pid] = self._start_time(handle.proc.pid)
            handle.sessions.add(handle.proc.pid)
            threading.Thread(target=_wait_for_exit, args=(handle,), daemon=True,
                             name=f"parity-wait-{handle.proc.pid}").start()
        return handle

    @staticmethod
    def _start_time(pid: int) -> int | None:
        info = _proc_table_one(pid)
        return info[3] if info else None

    # ---------------------------------------------------------------------------------- poll

    def poll(self, handle: LocalHandle) -> JobResult | None:
        if handle.result is not None:
            return handle.result
        now = time.time()
        if now - handle.last_scan >= _TREE_REFRESH:
            self._scan(handle)
        rc = handle.proc.poll()
        if rc is None:
            timeout = handle.job.timeout
            if timeout is not None and now - handle.started > timeout:
                handle.killed_by = "timeout"
                self._kill_tree(handle)
                rc = handle.proc.returncode
            else:
                return None
        # the leader is gone: anything of the job still alive is a leftover
        leftovers = self._kill_tree(handle) if handle.killed_by is None else 0
        if handle.killed_by == "timeout":
            result = self._result(handle, TIMEOUT, rc, f"timeout after {handle.job.timeout:g} s "
                                  "(process group killed)")
        elif handle.killed_by == "cancel":
            result = self._result(handle, CANCELLED, rc, "cancelled")
        elif rc == 0:
            result = self._result(handle, OK, 0, "")
        else:
            result = self._result(handle, FAILED, rc, _exit_reason(rc))
        result.leftovers_killed = leftovers
        if leftovers and result.status == OK:
            result.reason = f"killed {leftovers} leftover process(es) after exit"
        handle.result = result
        return result

    def cancel(self, handle: LocalHandle) -> None:
        if handle.result is not None or handle.proc is None:
            return
        handle.killed_by = "cancel"
        self._kill_tree(handle)
        self.poll(handle)

    # ------------------------------------------------------------------------------- helpers

    def _scan(self, handle: LocalHandle, table=None) -> dict:
        """Add the job's current processes to handle.seen (tree, group and sessions)."""
        table = table if table is not None else _proc_table()
        handle.last_scan = time.time()
        if not table:
            return table
        children: dict[int, list[int]] = {}
        for pid, (ppid, _pgid, _sid, _start, _state) in table.items():
            children.setdefault(ppid, []).append(pid)
        roots = [p for p, st in handle.seen.items() if p in table and table[p][3] == st]
        stack = list(roots)
        while stack:
            pid = stack.pop()
            for c in children.get(pid, ()):
                if c not in handle.seen:
                    handle.seen[c] = table[c][3]
                    stack.append(c)
        leader = handle.proc.pid
        for pid, (ppid, pgid, sid, start, _state) in table.items():
            if pid not in handle.seen and (pgid == leader or sid in handle.sessions):
                handle.seen[pid] = start
        for pid, start in handle.seen.items():  # sessions the job's processes created (torchrun's
            info = table.get(pid)                 # workers each start one)
            if info and info[3] == start and info[2] == pid:
                handle.sessions.add(pid)
        return table

    def _living(self, handle: LocalHandle, table) -> list[int]:
        if not table:  # no /proc: only the leader's process group is known
            return [p for p in handle.seen if _alive(p, None)]
        return [p for p, st in handle.seen.items() if _alive(p, st, table)]

    def _signal_all(self, handle: LocalHandle, sig: int, table) -> None:
        try:
            os.killpg(handle.proc.pid, sig)
        except OSError:
            pass
        for pid in self._living(handle, table):
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _kill_tree(self, handle: LocalHandle) -> int:
        """SIGTERM the job's processes, wait up to the grace period, SIGKILL the rest.

        Returns how many processes other than the leader were alive when this started.
        """
        table = self._scan(handle)
        living = [p for p in self._living(handle, table) if p != handle.proc.pid]
        leader_alive = handle.proc.poll() is None
        if not living and not leader_alive:
            handle.proc.wait()
            return 0
        self._signal_all(handle, signal.SIGTERM, table)
        deadline = time.time() + self.grace
        while time.time() < deadline:
            handle.proc.poll()
            table = self._scan(handle)
            if not self._living(handle, table):
                break
            time.sleep(0.05)
        else:
            self._signal_all(handle, signal.SIGKILL, table)
            end = time.time() + 5
            while time.time() < end:
                handle.proc.poll()
                if not self._living(handle, _proc_table()):
                    break
                time.sleep(0.05)
        try:
            handle.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return len(living)

    def _result(self, handle: LocalHandle, status: str, rc: int | None, reason: str) -> JobResult:
        if handle.log_file is not None:
            handle.log_file.close()
            handle.log_file = None
        job = handle.job
        rank_logs = collect_rank_logs(job.log_dir, job.nproc_per_node)
        if status == FAILED:
            detail = failure_detail(job, rank_logs, reason=reason)
            if detail:
                reason = f"{reason}; {detail}"
        return JobResult(status=status, exit_code=rc, reason=reason, started=handle.started,
                         ended=handle.exited_at or time.time(), command=handle.command,
                         console_log=str(job.console_log), rank_logs=rank_logs)


def _wait_for_exit(handle: LocalHandle) -> None:
    """Record the exact exit time of the job's leader (job wall times exclude poll latency)."""
    try:
        handle.proc.wait()
    finally:
        handle.exited_at = time.time()


def _proc_table_one(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]), rest[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def _exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    if rc == 127:
        return "exit code 127 (command not found)"
    return f"exit code {rc}"
