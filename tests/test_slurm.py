"""The SLURM launcher against a real SLURM cluster on localhost (munge + slurmctld + slurmd node1,
node2; see tests/slurm_cluster.py). Skipped, with the reason, when SLURM cannot be installed or
started here. `.ci/slurm-up` starts the cluster once for CI; otherwise the first test starts a
private one (~1 s when the packages are present) and the module stops it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import slurm_cluster
from parity.artifacts import read_run
from parity.sweep.launch_slurm import SlurmLauncher
from parity.sweep.launcher import CANCELLED, OK, TIMEOUT
from test_multinode import CAPTURE, assert_same_diff, make_job, run_all, run_with_local_pair

pytestmark = pytest.mark.slurm

SLEEPER = "import time; print('sleeping', flush=True); time.sleep(600)\n"


@pytest.fixture(scope="module")
def cluster():
    t0 = time.monotonic()
    try:
        c = slurm_cluster.acquire()
    except slurm_cluster.Unavailable as e:
        pytest.skip(f"no SLURM cluster: {e}")
    print(f"\ncluster: {c.note or 'up'} ({time.monotonic() - t0:.1f} s)")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    yield c
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    slurm_cluster.release(c)


def squeue_ids(c) -> list[str]:
    return c.run("squeue", "-h", "-o", "%i").stdout.split()


def wait_running(launcher: SlurmLauncher, h, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while h.state != "RUNNING":
        assert time.monotonic() < deadline, f"job {h.job_id} still {h.state}"
        assert launcher.poll(h) is None
        time.sleep(0.2)


def no_process_with(text: str) -> bool:
    r = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True)
    return r.stdout.strip() == ""


@pytest.mark.skipif(not CAPTURE, reason="parity exec (parity.capture.launch) not available yet")
def test_two_node_job_matches_local(cluster, tmp_path):
    """Eager vs compiled (bucket order registration, 2 steps) as 2-node SLURM jobs, submitted
    together, give the same artifacts and diff as a local 1 node x 2 processes run."""
    launcher = SlurmLauncher(poll_interval=0.5)
    jobs = {mode: make_job(tmp_path, f"slurm-{mode}", mode, 2, 1, timeout=240)
            for mode in ("eager", "compiled")}
    t0 = time.monotonic()
    results, local = run_with_local_pair([(launcher, job) for job in jobs.values()])
    print(f"SLURM 2-node pair in {time.monotonic() - t0:.1f} s")
    for (mode, job), res in zip(jobs.items(), results):
        assert res.status == OK, (mode, res.reason, Path(job.console_log).read_text()[-2000:])
        assert res.command[0] == "sbatch" and Path(res.console_log).name.startswith("slurm-")
        assert Path(job.console_log).resolve() == Path(res.console_log).resolve()
        assert "[rank0]:step 2 loss" in Path(res.console_log).read_text()
        # every rank's own log, attributed to the right rank whichever node it ran on
        logs = {e["rank"]: e for e in res.rank_logs}
        assert sorted(logs) == [0, 1] and all(Path(e["stderr"]).exists() for e in logs.values())
        assert "step 2 loss" in Path(logs[0]["stdout"]).read_text()
        assert "step 2 loss" not in Path(logs[1]["stdout"]).read_text()
        assert (job.log_dir / "job.sbatch").exists() and (job.log_dir / "node.sh").exists()
        run = read_run(job.run_dir)
        assert run.run_meta["nnodes"] == 2 and run.run_meta["status"] == "ok"
        assert sorted(r for n in run.run_meta["nodes"] for r in n["ranks"]) == [0, 1]
    assert_same_diff(local, {m: job.run_dir for m, job in jobs.items()})


def test_cancel_scancels_and_leaves_the_queue(cluster, tmp_path):
    script = tmp_path / "sleeper-cancel.py"
    script.write_text(SLEEPER)
    launcher = SlurmLauncher(poll_interval=0.2)
    job = make_job(tmp_path, "cancel", "eager", 2, 1, timeout=120, entry=[str(script)],
                   capture=False)
    h = launcher.start(job)
    assert h.result is None and h.job_id, h.result
    wait_running(launcher, h)
    t0 = time.monotonic()
    launcher.cancel(h)
    res = launcher.poll(h)
    print(f"cancel took {time.monotonic() - t0:.1f} s")
    assert res.status == CANCELLED and res.reason.startswith("cancelled")
    assert h.job_id not in squeue_ids(cluster)
    deadline = time.monotonic() + 15  # slurmstepd reaps the step's processes
    while not no_process_with(str(script)):
        assert time.monotonic() < deadline, "job processes outlived scancel"
        time.sleep(0.2)


def test_timeout_kills_the_job_and_reports_timeout(cluster, tmp_path):
    script = tmp_path / "sleeper-timeout.py"
    script.write_text(SLEEPER)
    launcher = SlurmLauncher(poll_interval=0.2)
    job = make_job(tmp_path, "timeout", "eager", 2, 1, timeout=3, entry=[str(script)],
                   capture=False)
    t0 = time.monotonic()
    h = launcher.start(job)
    while (res := launcher.poll(h)) is None:
        assert time.monotonic() - t0 < 90, f"job {h.job_id} still {h.state}"
        time.sleep(0.2)
    took = time.monotonic() - t0
    print(f"timeout job ended in {took:.1f} s")
    assert res.status == TIMEOUT and "timeout after 3 s" in res.reason, res.reason
    assert 3 <= took < 60
    assert h.job_id not in squeue_ids(cluster)
    deadline = time.monotonic() + 15
    while not no_process_with(str(script)):
        assert time.monotonic() < deadline, "job processes outlived the timeout"
        time.sleep(0.2)


def test_failing_job_reports_failure_with_rank_traceback(cluster, tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise RuntimeError('boom')\n")
    launcher = SlurmLauncher(poll_interval=0.2)
    job = make_job(tmp_path, "boom", "eager", 2, 1, timeout=120, entry=[str(script)],
                   capture=False)
    [res] = run_all([(launcher, job)], limit=90)
    assert res.status == "failed" and res.exit_code not in (0, None)
    assert "RuntimeError: boom" in res.reason, res.reason
