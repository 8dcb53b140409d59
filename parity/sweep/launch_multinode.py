"""Multi-node torchrun with capture: the per-node command, the run-directory merge, and a launcher
that runs ``nnodes`` torchrun agents on this machine (multi-node rendezvous without SLURM).

One job on N nodes is N torchrun agents, one per node, that meet through a c10d rendezvous
(``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``), each wrapped in its own ``parity exec``.
Ranks write ``rank-NNNNN/`` by global rank, so they never clash across nodes; but every
``parity exec`` also writes ``run.json`` (start, then end), and two in one directory overwrite
each other: the last to finish wins and can hide a failed node. So node K's ``parity exec``
writes into ``RUN_DIR/nodes/node-K/``, and once no process of the job is left
:func:`merge_node_runs` moves the rank folders up into ``RUN_DIR`` and writes one
``RUN_DIR/run.json`` that summarizes the nodes (their own files stay in ``nodes/node-K/``).
After the merge ``RUN_DIR`` reads like a one-node run. A one-node job writes ``RUN_DIR``
directly and needs no merge.

Logs: every agent keeps each rank's stdout/stderr under ``LOG_DIR/node-K/`` (torchrun
``--log-dir``); console lines are prefixed with the global rank (``[rank3]:``) so that the nodes'
consoles can share one file.

The SLURM launcher (:mod:`parity.sweep.launch_slurm`) uses the same command and merge. The
merge is also a command, which the SLURM batch script runs after its job step:

    python -m parity.sweep.launch_multinode merge RUN_DIR NNODES   # idempotent
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parity.artifacts import SCHEMA_VERSION, write_json_atomic
from parity.errors import EXIT_OK, EXIT_USAGE
from parity.rundir import NODES_DIR, RUN_FILE, node_out_dir, rank_of
from parity.sweep.launch_local import LocalLauncher, free_port
from parity.sweep.launcher import (CANCELLED, FAILED, NOT_FOUND, OK, TIMEOUT, Job, JobResult,
                                   Launcher, collect_rank_logs, exec_prefix, failure_hint,
                                   torchrun_argv)

# torchrun's console prefix (global rank instead of the local one), unless the job sets its own
PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX = "[rank${rank}]:"


# ------------------------------------------------------------------------------ commands


def node_log_dir(log_dir: str | os.PathLike, node: int | str, nnodes: int) -> Path:
    """Node ``node``'s torchrun ``--log-dir``."""
    return Path(log_dir) if nnodes == 1 else Path(log_dir) / f"node-{node}"


def node_job(job: Job, node: int | str) -> Job:
    """``job`` as node ``node`` runs it: its own capture folder and torchrun log folder."""
    return dataclasses.replace(job, run_dir=node_out_dir(job.run_dir, node, job.nnodes),
                               log_dir=node_log_dir(job.log_dir, node, job.nnodes))


def node_command(job: Job, node: int | str, endpoint: str,
                 torchrun_options: list[str] = ()) -> list[str]:
    """Node ``node``'s command: ``parity exec --out RUN_DIR[/nodes/node-K] -- torchrun ...``.

    ``node`` may be a placeholder that a caller substitutes in a shell script. No
    ``--node-rank``: torchrun ignores it with the c10d backend (and warns); group ranks follow
    the sorted node addresses (``torchrun_options`` may set ``--local-addr``).
    """
    nj = node_job(job, node)
    argv = exec_prefix(nj) + torchrun_argv(nj, endpoint)
    if torchrun_options:
        cut = len(argv) - len(job.entry_argv)  # torchrun's options end where the entry begins
        argv[cut:cut] = list(torchrun_options)
    return argv


def node_rank_logs(job: Job, summary: dict | None = None,
                   rel_to: Path | None = None) -> list[dict]:
    """Every rank's log files, node by node.

    With the c10d backend node K's agent gets whichever group rank the rendezvous gives it, so
    its ranks are group_rank * nproc_per_node + local rank. The merge ``summary`` knows each
    node's ranks (the rank folders its ``parity exec`` held); without it (an uncaptured job)
    node K is assumed to hold group rank K.
    """
    if job.nnodes == 1:
        return collect_rank_logs(Path(job.log_dir), job.nproc_per_node, rel_to)
    group = {}
    for n in (summary or {}).get("nodes", []):
        if n.get("ranks"):
            group[n["node"]] = min(n["ranks"]) // job.nproc_per_node
    out = []
    for k in range(job.nnodes):
        out += collect_rank_logs(node_log_dir(job.log_dir, k, job.nnodes), job.nproc_per_node,
                                 rel_to, node_rank=group.get(k, k))
    return sorted(out, key=lambda e: e["rank"])


# ------------------------------------------------------------------------------ merge


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def merge_node_runs(run_dir: str | os.PathLike, nnodes: int, *, error: str | None = None) -> dict | None:
    """Move every ``nodes/node-K/rank-*`` into ``run_dir`` and write the summary ``run.json``.

    Idempotent; call it once no process of the job is left (a rank still writing would lose
    its folder). ``error`` (a timeout, a cancel) marks the summary failed with that reason.
    Returns the summary (None for a one-node job: its ``run.json`` is ``parity exec``'s own).
    """
    run_dir = Path(run_dir)
    if nnodes == 1:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = _read_json(run_dir / RUN_FILE) or {}
    before = {n.get("node"): n.get("ranks") for n in previous.get("nodes", [])
              if isinstance(n, dict)}
    nodes = []
    for k in range(nnodes):
        d = node_out_dir(run_dir, k, nnodes)
        ranks = []
        if d.is_dir():
            for child in sorted(d.iterdir()):
                r = rank_of(child.name)
                if child.is_dir() and r is not None:
                    target = run_dir / child.name
                    if target.exists():
                        shutil.rmtree(target)
                    os.replace(child, target)
                    ranks.append(r)
        rec = _read_json(d / RUN_FILE)
        nodes.append({"node": k, **(rec or {"status": "missing", "exit_code": None,
                                            "error": f"node {k} wrote no {RUN_FILE}"}),
                      "ranks": ranks or before.get(k) or []})
    bad = [n for n in nodes if n.get("status") not in ("ok", "running")]
    if error is None and bad:
        n = bad[0]
        error = f"node {n['node']}: {n.get('error') or 'exit code ' + str(n.get('exit_code'))}"
    if error is not None:
        status = "failed"
    else:
        status = "running" if any(n.get("status") == "running" for n in nodes) else "ok"
    codes = [n.get("exit_code") for n in nodes]
    exit_code = next((c for c in codes if c not in (0, None)), 0 if all(c == 0 for c in codes) else None)
    started = [n["started"] for n in nodes if isinstance(n.get("started"), (int, float))]
    ended = [n["ended"] for n in nodes if isinstance(n.get("ended"), (int, float))]
    first = next((n for n in nodes if n.get("argv")), {})
    summary = {
        "v": SCHEMA_VERSION, "argv": first.get("argv"), "cwd": first.get("cwd", os.getcwd()),
        "started": min(started) if started else None,
        "ended": max(ended) if ended and len(ended) == nnodes else None,
        "exit_code": exit_code, "status": status, "error": error,
        "parity": first.get("parity"), "host": first.get("host"),
        "nnodes": nnodes, "nodes": nodes,
    }
    write_json_atomic(run_dir / RUN_FILE, summary)
    return summary


def prepare_run_dir(job: Job) -> None:
    """Before a multi-node captured job: drop what an earlier run left in ``RUN_DIR`` (rank
    folders, ``run.json``, ``nodes/``), as ``parity exec`` does for a one-node run."""
    if not job.capture or job.nnodes == 1:
        return
    run_dir = Path(job.run_dir)
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.is_dir() and (rank_of(child.name) is not None or child.name == NODES_DIR):
                shutil.rmtree(child, ignore_errors=True)
        try:
            (run_dir / RUN_FILE).unlink()
        except FileNotFoundError:
            pass
    run_dir.mkdir(parents=True, exist_ok=True)


def combine(results: list[JobResult], command: list[str]) -> JobResult:
    """One job's result from its nodes' results (the worst status wins)."""
    order = (TIMEOUT, CANCELLED, NOT_FOUND, FAILED, OK)
    status = min((r.status for r in results), key=order.index)
    worst = [(k, r) for k, r in enumerate(results) if r.status == status]
    k, r = worst[0]
    exit_code = next((x.exit_code for x in results if x.exit_code not in (0, None)), r.exit_code)
    reason = "" if status == OK else (r.reason if status in (TIMEOUT, CANCELLED)
                                      else f"node {k}: {r.reason}")
    return JobResult(status=status, exit_code=exit_code, reason=reason,
                     started=min(x.started for x in results), ended=max(x.ended for x in results),
                     command=command, console_log=r.console_log,
                     leftovers_killed=sum(x.leftovers_killed for x in results))


# ------------------------------------------------------------------------------ local launcher


class _NodeAgent(LocalLauncher):
    """The local launcher, running one node's agent of a multi-node job."""

    def __init__(self, grace: float, command: list[str]):
        super().__init__(grace=grace)
        self._command = command

    def command(self, job: Job, port: int | None = None) -> list[str]:
        return list(self._command)


@dataclass
class MultiNodeHandle:
    job: Job
    agents: list  # (_NodeAgent, LocalHandle) per node
    result: JobResult | None = None
    first_failure: float | None = None  # when the first agent ended without success
    single: object = None  # a one-node job: the LocalHandle


class MultiNodeLauncher(Launcher):
    """``job.nnodes`` torchrun agents on this machine, meeting at ``127.0.0.1:<free port>``.

    This is the launcher named ``local`` (launchers.py), not :class:`LocalLauncher`: one class
    serves every job shape this machine can run. A one-node job is handed to LocalLauncher
    unchanged; the class is named for what it adds (one agent per node, their rendezvous, the
    merge of their run folders), which a one-node job does not need. Agent K runs as its
    own local job (process tree killed on timeout or cancel) and passes ``--local-addr
    127.0.0.<K+1>`` so that it gets group rank K (c10d orders nodes by address; all of 127/8 is
    this machine). All agents append to ``job.console_log``. When an agent fails the others
    are stopped after the grace period (a lone agent would wait for its peers until timeout).
    """

    def __init__(self, grace: float = 5.0, host: str = "127.0.0.1"):
        self.grace = grace
        self.host = host
        self._local = LocalLauncher(grace=grace, host=host)

    def commands(self, job: Job, endpoint: str) -> list[list[str]]:
        if job.nnodes == 1:
            return [self._local.command(job, int(endpoint.rpartition(":")[2]))]
        return [node_command(job, k, endpoint, _local_addr(k, job.nnodes))
                for k in range(job.nnodes)]

    def command(self, job: Job) -> list[str]:
        """Node 0's command (node K differs in ``nodes/node-K``, ``--log-dir`` and
        ``--local-addr``); PORT is picked at start."""
        if job.nnodes == 1:
            return self._local.command(job)
        return self.commands(job, f"{self.host}:PORT")[0]

    def start(self, job: Job) -> MultiNodeHandle:
        if job.nnodes == 1:
            return MultiNodeHandle(job, [], single=self._local.start(job))
        prepare_run_dir(job)
        endpoint = f"{self.host}:{free_port(self.host)}"
        env = dict(job.env)
        env.setdefault(PREFIX_ENV, PREFIX)
        agents = []
        for k, argv in enumerate(self.commands(job, endpoint)):
            agent = _NodeAgent(self.grace, argv)
            agents.append((agent, agent.start(dataclasses.replace(node_job(job, k), env=env))))
        return MultiNodeHandle(job, agents)

    def poll(self, h: MultiNodeHandle) -> JobResult | None:
        if h.single is not None:
            return self._local.poll(h.single)
        if h.result is not None:
            return h.result
        results = [agent.poll(lh) for agent, lh in h.agents]
        if any(r is None for r in results):
            if any(r is not None and r.status != OK for r in results):
                now = time.time()
                h.first_failure = h.first_failure or now
                if now - h.first_failure > self.grace:
                    for (agent, lh), r in zip(h.agents, results):
                        if r is None:
                            agent.cancel(lh)
                    results = [agent.poll(lh) for agent, lh in h.agents]
                    failed = next(k for k, r in enumerate(results) if r.status != CANCELLED)
                    return self._finish(h, results, failed)
            return None
        return self._finish(h, results)

    def _finish(self, h: MultiNodeHandle, results: list[JobResult],
                failed_node: int | None = None) -> JobResult:
        job = h.job
        if failed_node is not None:  # the others were stopped because of this one
            r = results[failed_node]
            result = combine([r], h.agents[0][1].command)
            result.reason = f"node {failed_node}: {r.reason} (other nodes stopped)"
        else:
            result = combine(results, h.agents[0][1].command)
        result.console_log = str(job.console_log)
        summary = None
        if job.capture:
            summary = merge_node_runs(job.run_dir, job.nnodes,
                                      error=None if result.status in (OK, FAILED) else result.reason)
        result.rank_logs = node_rank_logs(job, summary)
        if result.status in (FAILED, TIMEOUT) and "rank " not in result.reason:
            hint = failure_hint(result.rank_logs)
            if hint:
                result.reason = f"{result.reason}; {hint}"
        h.result = result
        return result

    def cancel(self, h: MultiNodeHandle) -> None:
        if h.single is not None:
            self._local.cancel(h.single)
            return
        if h.result is not None:
            return
        for agent, lh in h.agents:
            agent.cancel(lh)
        self.poll(h)


def _local_addr(node: int, nnodes: int) -> list[str]:
    # String order of the addresses must be node order: 127.0.0.1 ... 127.0.0.9.
    return ["--local-addr", f"127.0.0.{node + 1}"] if nnodes <= 9 else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "merge" and argv[2].isdigit():
        merge_node_runs(argv[1], int(argv[2]))
        return EXIT_OK
    print("usage: python -m parity.sweep.launch_multinode merge RUN_DIR NNODES", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
