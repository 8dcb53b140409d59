"""Multi-node torchrun on one machine (parity.sweep.launch_multinode).

The integration test runs the built-in workload eager vs compiled as 2 nodes x 1 process (two
torchrun agents meeting through a c10d rendezvous on 127.0.0.1, each under its own
``parity exec``) and as 1 node x 2 processes, and checks that both layouts give the same
artifacts, bit for bit, and so the same diff.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from parity.artifacts import read_run
from parity.rundir import NODES_DIR, live_rank_dir
from parity.sweep.launch_local import LocalLauncher
from parity.sweep.launch_multinode import (MultiNodeLauncher, combine,
                                           merge_node_runs, node_command)
from parity.sweep.launcher import CANCELLED, FAILED, OK, TIMEOUT, Job, JobResult

CAPTURE = importlib.util.find_spec("parity.capture.launch") is not None
WORKLOAD = ["-m", "parity.workloads.train", "--steps", "2", "--bucket-order", "registration"]


def make_job(root: Path, name: str, mode: str, nnodes: int, nproc: int, timeout: float = 240,
             entry: list[str] | None = None, capture: bool = True) -> Job:
    d = root / name
    return Job(cell_id=name, side=mode, entry_argv=entry or [*WORKLOAD, "--mode", mode],
               nnodes=nnodes, nproc_per_node=nproc, env={}, run_dir=d / "run",
               log_dir=d / "logs", timeout=timeout, console_log=d / "console.log",
               capture=capture)


def run_all(pairs, limit: float = 300) -> list[JobResult]:
    """Start every (launcher, job) at once, poll until all have finished."""
    handles = [(launcher, launcher.start(job)) for launcher, job in pairs]
    results: list[JobResult | None] = [None] * len(handles)
    deadline = time.monotonic() + limit
    try:
        while any(r is None for r in results):
            assert time.monotonic() < deadline, "jobs did not finish in time"
            for i, (launcher, h) in enumerate(handles):
                if results[i] is None:
                    results[i] = launcher.poll(h)
            time.sleep(0.2)
    finally:
        for (launcher, h), r in zip(handles, results):
            if r is None:
                launcher.cancel(h)
    return results


_LOCAL_PAIR: dict[str, Path] = {}  # mode -> run dir of the 1 node x 2 processes reference


def run_with_local_pair(pairs) -> tuple[list[JobResult], dict[str, Path]]:
    """Run ``pairs`` (launcher, job) and, the first time in this pytest session, alongside them
    the local 1 node x 2 processes eager and compiled jobs that both multi-node tests compare
    with (test_slurm.py reuses them). Returns the results of ``pairs`` and the local run dirs."""
    extra = []
    if not _LOCAL_PAIR:
        root = Path(tempfile.mkdtemp(prefix="parity-local-pair-"))
        atexit.register(shutil.rmtree, root, True)
        extra = [(LocalLauncher(), make_job(root, f"1x2-{mode}", mode, 1, 2))
                 for mode in ("eager", "compiled")]
    results = run_all(list(pairs) + extra)
    for (_, job), res in zip(extra, results[len(pairs):]):
        assert res.status == OK, (job.side, res.reason, Path(job.console_log).read_text()[-2000:])
        _LOCAL_PAIR[job.side] = job.run_dir
    assert len(_LOCAL_PAIR) == 2
    return results[:len(pairs)], dict(_LOCAL_PAIR)


def step_table(run_dir: Path) -> list[tuple]:
    """(rank, step, param digest, grad digest, loss hash) of every captured step."""
    run = read_run(run_dir)
    assert not run.missing_ranks, run.problems
    df = run.steps_frame()
    return sorted(tuple(r) for r in df[["rank", "step", "param_digest", "grad_digest",
                                        "loss_hash"]].itertuples(index=False))


def bucket_table(run_dir: Path) -> list[tuple]:
    df = read_run(run_dir).buckets_frame()
    return sorted(tuple(str(x) for x in r) for r in df.itertuples(index=False))


def digest_diff(a: Path, b: Path) -> list[tuple]:
    """Where two runs' roll-up digests differ: (rank, step, column)."""
    ta = {(r[0], r[1]): r[2:] for r in step_table(a)}
    tb = {(r[0], r[1]): r[2:] for r in step_table(b)}
    out = []
    for key in sorted(set(ta) | set(tb)):
        va, vb = ta.get(key), tb.get(key)
        for i, col in enumerate(("param", "grad", "loss")):
            if va is None or vb is None or va[i] != vb[i]:
                out.append((*key, col))
    return out


def diff_summary(a: Path, b: Path) -> dict | None:
    """``parity diff``'s result (``parity.diff.diff_runs``) without paths and timings, or None
    where that module does not exist."""
    try:
        from parity.diff import diff_runs
    except ImportError:
        return None
    d = diff_runs(a, b).to_dict()
    d.pop("stats", None)
    for side in ("a", "b"):
        if isinstance(d.get(side), dict):
            d[side].pop("path", None)
    return d


def assert_same_diff(one_node: dict[str, Path], two_nodes: dict[str, Path]) -> None:
    """The 2-node runs equal the 1-node runs bit for bit, and so does eager-vs-compiled."""
    for mode in ("eager", "compiled"):
        assert step_table(two_nodes[mode]) == step_table(one_node[mode]), mode
        assert bucket_table(two_nodes[mode]) == bucket_table(one_node[mode]), mode
    assert (digest_diff(two_nodes["eager"], two_nodes["compiled"])
            == digest_diff(one_node["eager"], one_node["compiled"]))
    assert (diff_summary(two_nodes["eager"], two_nodes["compiled"])
            == diff_summary(one_node["eager"], one_node["compiled"]))


# ------------------------------------------------------------------------------ unit


def _write_node(run_dir: Path, node: int, ranks: list[int], status="ok", exit_code=0) -> None:
    d = run_dir / NODES_DIR / f"node-{node}"
    for r in ranks:
        (d / f"rank-{r:05d}").mkdir(parents=True)
        (d / f"rank-{r:05d}" / "meta.json").write_text(json.dumps({"v": 1, "rank": r}))
    (d / "run.json").write_text(json.dumps({
        "v": 1, "argv": ["torchrun", str(node)], "cwd": "/", "started": 10.0 + node,
        "ended": 20.0 + node, "exit_code": exit_code, "status": status,
        "error": None if status == "ok" else f"exited with code {exit_code}", "parity": "0",
        "host": "h"}))


def test_merge_moves_rank_folders_and_summarizes(tmp_path):
    _write_node(tmp_path, 0, [0, 1])
    _write_node(tmp_path, 1, [2, 3])
    (tmp_path / "rank-00002").mkdir()  # a stale folder from an earlier run is replaced
    summary = merge_node_runs(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("rank-*")) == [f"rank-{r:05d}" for r in range(4)]
    assert (tmp_path / "rank-00002" / "meta.json").exists()
    assert not list((tmp_path / NODES_DIR).glob("*/rank-*"))
    run = json.loads((tmp_path / "run.json").read_text())
    assert run == summary
    assert (run["status"], run["exit_code"], run["started"], run["ended"]) == ("ok", 0, 10.0, 21.0)
    assert [n["node"] for n in run["nodes"]] == [0, 1] and run["nnodes"] == 2
    assert merge_node_runs(tmp_path, 2) == summary  # idempotent
    assert read_run(tmp_path).run_meta["status"] == "ok"


def test_merge_reports_the_failed_or_missing_node(tmp_path):
    _write_node(tmp_path, 0, [0], status="failed", exit_code=1)
    _write_node(tmp_path, 1, [1])
    run = merge_node_runs(tmp_path, 2)
    assert (run["status"], run["exit_code"]) == ("failed", 1)
    assert run["error"].startswith("node 0: exited with code 1")
    run = merge_node_runs(tmp_path, 3)  # node 2 never started
    assert run["status"] == "failed" and run["nodes"][2]["status"] == "missing"
    run = merge_node_runs(tmp_path, 2, error="timeout after 5 s")
    assert (run["status"], run["error"]) == ("failed", "timeout after 5 s")
    assert merge_node_runs(tmp_path, 1) is None  # one node: parity exec's own run.json


def test_node_command_shape(tmp_path):
    job = make_job(tmp_path, "c", "eager", 2, 3)
    argv = node_command(job, 1, "127.0.0.1:1234", ["--local-addr", "127.0.0.2"])
    out = argv.index("--out")
    assert argv[out + 1] == str(tmp_path / "c" / "run" / NODES_DIR / "node-1")
    tr = argv.index("torch.distributed.run")
    opts = argv[tr + 1:len(argv) - len(job.entry_argv)]
    assert argv[len(argv) - len(job.entry_argv):] == job.entry_argv
    assert opts[opts.index("--nnodes") + 1] == "2" and "c10d" in opts
    assert opts[opts.index("--rdzv-endpoint") + 1] == "127.0.0.1:1234"
    assert opts[opts.index("--log-dir") + 1] == str(tmp_path / "c" / "logs" / "node-1")
    assert opts[-2:] == ["--local-addr", "127.0.0.2"] and "--node-rank" not in opts


def test_drop_in_for_local_and_live_rank_dir(tmp_path):
    one = make_job(tmp_path, "one", "eager", 1, 2)
    assert MultiNodeLauncher().command(one) == LocalLauncher().command(one)
    two = make_job(tmp_path, "two", "eager", 2, 1)
    argv = MultiNodeLauncher().command(two)
    assert "127.0.0.1:PORT" in argv and argv[argv.index("--out") + 1].endswith("nodes/node-0")
    assert live_rank_dir(tmp_path, 1) is None
    (tmp_path / NODES_DIR / "node-1" / "rank-00001").mkdir(parents=True)
    assert live_rank_dir(tmp_path, 1) == tmp_path / NODES_DIR / "node-1" / "rank-00001"
    (tmp_path / "rank-00001").mkdir()
    assert live_rank_dir(tmp_path, 1) == tmp_path / "rank-00001"


def test_combine_worst_status_wins():
    def r(status, code, t0, t1):
        return JobResult(status, code, "" if status == OK else "boom", t0, t1, ["x"])

    res = combine([r(OK, 0, 1, 5), r(FAILED, 1, 2, 4)], ["cmd"])
    assert (res.status, res.exit_code, res.reason, res.wall) == (FAILED, 1, "node 1: boom", 4)
    assert combine([r(CANCELLED, -15, 1, 2), r(TIMEOUT, -15, 1, 3)], []).status == TIMEOUT


# ------------------------------------------------------------------------------ integration


SLEEPER = "import sys, time; print('sleeping', flush=True); time.sleep(600)\n"


def test_local_two_agents_timeout_kills_both(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job = make_job(tmp_path, "t", "eager", 2, 1, timeout=4, entry=[str(script)], capture=False)
    t0 = time.monotonic()
    [res] = run_all([(MultiNodeLauncher(grace=2), job)], limit=60)
    assert res.status == TIMEOUT and time.monotonic() - t0 < 30
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
    assert left.strip() == ""


@pytest.mark.skipif(not CAPTURE, reason="parity exec (parity.capture.launch) not available yet")
def test_two_nodes_by_one_equal_one_node_by_two(tmp_path):
    launcher = MultiNodeLauncher()
    jobs = {mode: make_job(tmp_path, f"2x1-{mode}", mode, 2, 1) for mode in ("eager", "compiled")}
    t0 = time.monotonic()
    results, local = run_with_local_pair([(launcher, job) for job in jobs.values()])
    print(f"2x1 pair in {time.monotonic() - t0:.1f} s")
    for (mode, job), res in zip(jobs.items(), results):
        assert res.status == OK, (mode, res.reason, Path(job.console_log).read_text()[-2000:])
        run = read_run(job.run_dir)
        assert sorted(run.ranks) == [0, 1] and run.run_meta["nnodes"] == 2
        assert run.run_meta["status"] == "ok"
        assert [n["ranks"] for n in run.run_meta["nodes"]] == [[0], [1]]
    # rank 0 (the one that prints the losses) ran on node 0: --local-addr orders the rendezvous
    by_rank = {e["rank"]: e for e in results[0].rank_logs}
    assert sorted(by_rank) == [0, 1] and "/node-0/" in by_rank[0]["stdout"]
    assert "step 1 loss" in Path(by_rank[0]["stdout"]).read_text()
    assert_same_diff(local, {m: job.run_dir for m, job in jobs.items()})
