"""The SLURM launcher: each job is one ``sbatch`` script that runs one torchrun agent per node.

    sbatch LOG_DIR/job.sbatch          # --nodes=N --ntasks-per-node=1, --output/--error in LOG_DIR
      -> srun --ntasks-per-node=1 bash LOG_DIR/node.sh        (once per node, SLURM_NODEID = K)
           -> parity exec --out RUN_DIR/nodes/node-K -- torchrun --nnodes N --rdzv-backend c10d
                  --rdzv-endpoint FIRST_NODE:FREE_PORT --log-dir LOG_DIR/node-K ... ENTRY
      -> python -m parity.sweep.launch_multinode merge RUN_DIR N   (rank folders into RUN_DIR)

The rendezvous host is the first node of the allocation (``scontrol show hostnames
$SLURM_JOB_NODELIST | head -1``, address from its ``NodeAddr``), where the batch script runs and
picks a free port. RUN_DIR and LOG_DIR must be on a filesystem every node sees (as the Python
environment: nodes run ``sys.executable`` of the submitting process). A one-node job writes
RUN_DIR directly.

Jobs are watched with ``squeue`` (one call for all live jobs per poll interval) and, once
finished, ``scontrol show job`` for the exit code; ``sacct`` is never needed (accounting is often
absent). A job that has left slurmctld's memory is judged by the exit file its batch script
writes. The runner's timeout counts from the moment the job is seen running, and is enforced
with ``scancel``; ``--time`` (the job's timeout plus a margin, unless the spec sets ``time``) is
the scheduler's backstop, and SLURM's own TIMEOUT state is reported as a timeout too. ``cancel``
and ``close`` ``scancel`` and wait until the jobs have left the queue. Clients read
``SLURM_CONF`` (and every other SLURM variable) from the environment.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parity.sweep.launch_multinode import (PREFIX, PREFIX_ENV, merge_node_runs, node_command,
                                           node_rank_logs, prepare_run_dir)
from parity.sweep.launcher import (CANCELLED, FAILED, NOT_FOUND, OK, TIMEOUT, Job, JobResult,
                                   Launcher, check_local_requirement, failure_detail)

# squeue %T states
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
          "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
          "RESV_DEL_HOLD", "SPECIAL_EXIT", "REVOKED", "PREEMPTED"}
DONE_STATUS = {"COMPLETED": OK, "TIMEOUT": TIMEOUT, "DEADLINE": TIMEOUT, "CANCELLED": CANCELLED,
               "FAILED": FAILED, "NODE_FAIL": FAILED, "BOOT_FAIL": FAILED,
               "OUT_OF_MEMORY": FAILED}
# Pending reasons that never resolve by waiting: cancel and report instead of waiting forever.
HOPELESS = {"PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
            "InvalidQOS", "DependencyNeverSatisfied", "PartitionConfig", "QOSMaxNodePerJobLimit"}
TIME_MARGIN = 60.0  # seconds added to the job's timeout for --time (SLURM's backstop)
CANCEL_WAIT = 90.0  # longest wait for a cancelled job to leave the queue (KillWait is 30 s)
SQUEUE_GIVE_UP = 300.0  # squeue failing for this long fails the live jobs


@dataclass
class SlurmHandle:
    job: Job
    command: list[str]  # the sbatch command
    submitted: float
    job_id: str | None = None
    state: str | None = None
    reason: str = ""
    running_since: float | None = None
    killed_by: str | None = None  # "timeout" | "cancel" | "hopeless"
    kill_sent: float | None = None
    kill_note: str = ""  # the pending reason that made us give up on a job
    result: JobResult | None = None

    @property
    def out_file(self) -> Path:
        return Path(self.job.log_dir) / f"slurm-{self.job_id}.out"

    @property
    def err_file(self) -> Path:
        return Path(self.job.log_dir) / f"slurm-{self.job_id}.err"

    @property
    def exit_file(self) -> Path:
        return Path(self.job.log_dir) / f"slurm-{self.job_id}.exit"


def _q(word: str) -> str:
    """Single-quote always, so that placeholders can be spliced in as "$VAR" afterwards."""
    return "'" + word.replace("'", "'\\''") + "'"


def _shell(argv: list[str], subs: dict[str, str]) -> str:
    text = " ".join(_q(a) for a in argv)
    for token, var in subs.items():
        text = text.replace(token, f"'\"{var}\"'")
    # tidy the empty '' a splice leaves at either end of a word
    return re.sub(r"(?<=\")''(?=\s|$)", "", re.sub(r"(^|\s)''(?=\")", r"\1", text))


def slurm_time(options: dict, timeout: float | None) -> str | None:
    """``--time``: the spec's ``time`` as given, else the timeout plus a margin, in minutes."""
    if "time" in options:
        return str(options["time"])
    if timeout is None:
        return None
    return str(max(1, math.ceil((timeout + TIME_MARGIN) / 60)))


class SlurmLauncher(Launcher):
    """Jobs as ``sbatch`` scripts (see the module docstring). ``options``: the spec's
    ``[launcher]`` keys: partition, nodes, ntasks_per_node, gpus_per_node, time, account,
    sbatch_options (a list of extra ``sbatch`` arguments, e.g. ``["--qos=debug"]``).

    ``grace`` is accepted for the common interface; after ``scancel`` the cluster's ``KillWait``
    decides when SIGKILL follows SIGTERM. ``poll_interval`` bounds how often ``squeue`` runs."""

    def __init__(self, options: dict | None = None, grace: float = 5.0,
                 poll_interval: float = 1.0, python: str = sys.executable):
        self.options = dict(options or {})
        self.grace = grace
        self.poll_interval = poll_interval
        self.python = python
        self._live: list[SlurmHandle] = []
        self._last_query = 0.0
        self._squeue_failing_since: float | None = None
        self._squeue_error = ""

    # ------------------------------------------------------------------------------ shape

    def unsupported(self, nnodes: int, nproc_per_node: int) -> str | None:
        nodes = self.options.get("nodes")
        if nodes is not None and nodes != nnodes:
            return f"launcher.nodes = {nodes} but the job needs {nnodes} nodes"
        return None

    def unmet(self, requirement: str, nnodes: int) -> str | None:
        """GPUs are the allocation's (``gpus_per_node``), not this machine's; other requirements
        (modules, commands, environment) are checked here, assuming nodes share the software."""
        head, _, arg = requirement.partition(":")
        gpus = int(self.options.get("gpus_per_node", 0))
        if requirement == "cuda":
            return None if gpus > 0 else "requires cuda: set launcher.gpus_per_node"
        if head == "gpus":
            return None if gpus >= int(arg) else (
                f"requires {arg} GPUs per node: launcher.gpus_per_node = {gpus}")
        return check_local_requirement(requirement, self.name)

    # ------------------------------------------------------------------------------ scripts

    def sbatch_lines(self, job: Job) -> list[str]:
        o = self.options
        log_dir = str(Path(job.log_dir).resolve()).replace("%", "%%")  # sbatch file patterns
        lines = [f"--job-name=parity-{job.cell_id}-{job.side}", f"--nodes={job.nnodes}",
                 f"--ntasks-per-node={o.get('ntasks_per_node', 1)}",
                 f"--output={log_dir}/slurm-%j.out", f"--error={log_dir}/slurm-%j.err",
                 f"--chdir={Path(job.cwd or os.getcwd()).resolve()}"]
        t = slurm_time(o, job.timeout)
        if t is not None:
            lines.append(f"--time={t}")
        if o.get("partition"):
            lines.append(f"--partition={o['partition']}")
        if o.get("account"):
            lines.append(f"--account={o['account']}")
        if o.get("gpus_per_node"):
            lines.append(f"--gpus-per-node={o['gpus_per_node']}")
        return lines + list(o.get("sbatch_options", []))

    def node_script(self, job: Job) -> str:
        argv = node_command(job, "@NODE@", "@ENDPOINT@", ["--rdzv-id", "parity-@JOBID@"])
        env = {PREFIX_ENV: PREFIX, **job.env}
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
        cmd = _shell(argv, {"@NODE@": "${SLURM_NODEID}", "@ENDPOINT@": "${PARITY_RDZV_ENDPOINT}",
                            "@JOBID@": "${SLURM_JOB_ID}"})
        return f"""#!/bin/bash
# One torchrun agent of parity job {job.cell_id}/{job.side}: srun runs this once per node
# (SLURM_NODEID = node index); the batch script sets PARITY_RDZV_ENDPOINT.
set -u
{exports}
echo "parity: node $SLURM_NODEID ($(hostname)) agent, rendezvous $PARITY_RDZV_ENDPOINT" >&2
exec {cmd}
"""

    def batch_script(self, job: Job) -> str:
        log_dir = Path(job.log_dir).resolve()
        py = shlex.quote(self.python)
        header = "\n".join(f"#SBATCH {line}" for line in self.sbatch_lines(job))
        merge = ""
        if job.capture and job.nnodes > 1:
            merge = (f"{py} -m parity.sweep.launch_multinode merge "
                     f"{shlex.quote(str(Path(job.run_dir).resolve()))} {job.nnodes} "
                     "|| echo 'parity: merge of node run folders failed' >&2\n")
        return f"""#!/bin/bash
# parity job: cell {job.cell_id}, side {job.side} (written by parity.sweep.launch_slurm).
{header}
set -u
# Rendezvous on the first node of the allocation (this script runs there), on a free port.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol show node "$head" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)
port=$({py} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
export PARITY_RDZV_ENDPOINT="${{addr:-$head}}:$port"
echo "parity: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $PARITY_RDZV_ENDPOINT"
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\
  --kill-on-bad-exit=1 --label bash {shlex.quote(str(log_dir / 'node.sh'))}
rc=$?
{merge}echo "$rc" > {shlex.quote(str(log_dir))}/slurm-"$SLURM_JOB_ID".exit
exit "$rc"
"""

    def command(self, job: Job) -> list[str]:
        """The submission: the script's own #SBATCH options repeated on the command line, so
        that --dry-run and the record show the allocation (LOG_DIR/node.sh has the node
        command; the script resubmits as it is with ``sbatch LOG_DIR/job.sbatch``)."""
        return ["sbatch", "--parsable", *self.sbatch_lines(job),
                str(Path(job.log_dir).resolve() / "job.sbatch")]

    # ------------------------------------------------------------------------------ start

    def start(self, job: Job) -> SlurmHandle:
        h = SlurmHandle(job, self.command(job), time.time())
        if shutil.which("sbatch") is None:
            h.result = self._result(h, NOT_FOUND, None, "sbatch not found: is SLURM's client "
                                    "installed and on PATH?")
            return h
        try:
            log_dir = Path(job.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            Path(job.run_dir).mkdir(parents=True, exist_ok=True)
            prepare_run_dir(job)
            (log_dir / "node.sh").write_text(self.node_script(job))
            (log_dir / "job.sbatch").write_text(self.batch_script(job))
            r = subprocess.run(h.command, capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            h.result = self._result(h, FAILED, None, f"cannot submit: {e}")
            return h
        out = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not out.isdigit():
            msg = (r.stderr.strip() or r.stdout.strip() or f"exit code {r.returncode}")
            h.result = self._result(h, FAILED, None, f"sbatch failed: {msg.splitlines()[-1]}")
            return h
        h.job_id = out
        h.state = "PENDING"
        self._link_console(h)
        self._live.append(h)
        return h

    def _link_console(self, h: SlurmHandle) -> None:
        """job.console_log -> the job's SLURM stdout (every node's labelled console)."""
        link = Path(h.job.console_log)
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(h.out_file, link.parent))
        except OSError:
            pass

    # ------------------------------------------------------------------------------ watch

    def _squeue(self, ids: list[str]) -> dict[str, tuple[str, str]] | None:
        """job id -> (state, reason) for the jobs slurmctld still knows; None if squeue failed."""
        try:
            r = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids),
                                "-o", "%i|%T|%r"], capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            self._squeue_error = str(e)
            return None
        if r.returncode != 0 and "Invalid job id" not in r.stderr and r.stderr.strip():
            self._squeue_error = r.stderr.strip().splitlines()[-1]
            return None
        states = {}
        for line in r.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3:
                states[parts[0]] = (parts[1], parts[2])
        return states

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_query < self.poll_interval:
            return
        self._last_query = now
        live = [h for h in self._live if h.result is None and h.job_id]
        if not live:
            return
        states = self._squeue([h.job_id for h in live])
        if states is None:
            self._squeue_failing_since = self._squeue_failing_since or now
            return
        self._squeue_failing_since = None
        wall = time.time()
        for h in live:
            state, reason = states.get(h.job_id, ("GONE", ""))
            h.state, h.reason = state, reason
            if state == "RUNNING" and h.running_since is None:
                h.running_since = wall

    def poll(self, h: SlurmHandle) -> JobResult | None:
        if h.result is not None:
            return h.result
        self._refresh()
        if self._squeue_failing_since and time.monotonic() - self._squeue_failing_since > SQUEUE_GIVE_UP:
            self._scancel([h])
            return self._finish(h, f"squeue failing for {SQUEUE_GIVE_UP:.0f} s: "
                                f"{self._squeue_error}")
        now = time.time()
        timeout = h.job.timeout
        if (h.killed_by is None and timeout is not None and h.running_since is not None
                and now - h.running_since > timeout):
            h.killed_by, h.kill_sent = "timeout", now
            self._scancel([h])
        if h.killed_by is None and h.state == "PENDING" and h.reason in HOPELESS:
            h.killed_by, h.kill_sent, h.kill_note = "hopeless", now, h.reason
            self._scancel([h])
        if h.state in ACTIVE:
            if h.kill_sent is not None and now - h.kill_sent > CANCEL_WAIT:
                return self._finish(h, f"still {h.state} {CANCEL_WAIT:.0f} s after scancel")
            return None
        return self._finish(h)

    def _finish(self, h: SlurmHandle, problem: str | None = None) -> JobResult:
        """The job has left the active states, or ``problem`` says why we stop waiting for it."""
        info = self._scontrol(h.job_id) if h.job_id else {}
        state = info.get("JobState", h.state or "GONE")
        exit_code, sig = None, 0
        m = re.match(r"(\d+):(\d+)$", info.get("ExitCode", ""))
        if m:
            exit_code, sig = int(m.group(1)), int(m.group(2))
        if exit_code is None:
            try:  # purged from slurmctld's memory: the batch script's own record
                exit_code = int(h.exit_file.read_text().strip())
            except (OSError, ValueError):
                pass
        if h.killed_by == "timeout":
            status, reason = TIMEOUT, f"timeout after {h.job.timeout:g} s running (scancel)"
        elif h.killed_by == "cancel":
            status, reason = CANCELLED, "cancelled (scancel)"
        elif h.killed_by == "hopeless":
            status, reason = FAILED, f"never scheduled: pending reason {h.kill_note} (scancel)"
        elif problem is not None:
            status, reason = FAILED, ""
        elif state in DONE_STATUS:
            status = DONE_STATUS[state]
            if status == OK and exit_code not in (0, None):
                status = FAILED
            reason = {OK: "", TIMEOUT: f"SLURM time limit (state {state})",
                      CANCELLED: f"cancelled outside parity (state {state})"}.get(
                status, f"SLURM state {state}, exit code {exit_code}"
                + (f", signal {sig}" if sig else ""))
        elif exit_code is not None:
            status = OK if exit_code == 0 else FAILED
            reason = "" if exit_code == 0 else f"exit code {exit_code}"
        else:
            status = FAILED
            reason = f"job {h.job_id} left the queue without a result (state {state})"
        if problem is not None:
            reason = f"{reason}; {problem}" if reason else problem
        return self._collect(h, status, exit_code, reason)

    def _collect(self, h: SlurmHandle, status: str, exit_code: int | None,
                 reason: str) -> JobResult:
        job = h.job
        summary = None
        if job.capture:
            try:
                summary = merge_node_runs(job.run_dir, job.nnodes,
                                          error=reason if status in (TIMEOUT, CANCELLED) else None)
            except Exception as e:  # never lose the result over the summary file
                reason = f"{reason}; merge of node run folders failed: {e}"
        h.result = self._result(h, status, exit_code, reason, summary)
        if h in self._live:
            self._live.remove(h)
        return h.result

    def _result(self, h: SlurmHandle, status: str, exit_code: int | None, reason: str,
                summary: dict | None = None) -> JobResult:
        job = h.job
        rank_logs = node_rank_logs(job, summary) if h.job_id else []
        if status in (FAILED, TIMEOUT) and h.job_id:
            hint = (failure_detail(job, rank_logs, h.out_file, reason=reason)
                    or _last_line(h.err_file))
            if hint:
                reason = f"{reason}; {hint}"
        started = h.running_since or h.submitted
        return JobResult(status=status, exit_code=exit_code, reason=reason, started=started,
                         ended=time.time(), command=h.command,
                         console_log=str(h.out_file) if h.job_id else None,
                         rank_logs=rank_logs)

    def _scontrol(self, job_id: str) -> dict[str, str]:
        try:
            r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                               text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return {}
        if r.returncode != 0:
            return {}
        return dict(w.split("=", 1) for w in r.stdout.split() if "=" in w)

    # ------------------------------------------------------------------------------ stop

    def _scancel(self, handles: list[SlurmHandle]) -> None:
        ids = [h.job_id for h in handles if h.job_id]
        if ids:
            try:
                subprocess.run(["scancel", *ids], capture_output=True, timeout=60,
                               stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError):
                pass

    def cancel(self, handle: SlurmHandle) -> None:
        self.cancel_many([handle])

    def cancel_many(self, handles: list[SlurmHandle]) -> None:
        """``scancel`` all at once, then wait (bounded) until they have left the queue."""
        todo = [h for h in handles if h.result is None]
        if not todo:
            return
        now = time.time()
        for h in todo:
            if h.killed_by is None:
                h.killed_by = "cancel"
            h.kill_sent = h.kill_sent or now
        self._scancel(todo)
        deadline = time.monotonic() + CANCEL_WAIT
        while todo and time.monotonic() < deadline:
            self._refresh(force=True)
            for h in list(todo):
                if h.state not in ACTIVE:
                    self._finish(h)
                    todo.remove(h)
            if todo:
                time.sleep(0.25)
        for h in todo:
            self._finish(h, f"still {h.state} {CANCEL_WAIT:.0f} s after scancel")

    def close(self) -> None:
        """Cancel every job this launcher submitted that has not finished (Ctrl-C, errors)."""
        self.cancel_many(list(self._live))


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    interesting = [ln for ln in lines if "error" in ln.lower()] or lines
    return interesting[-1][:200] if interesting else ""
