"""The SLURM launcher without a cluster: the scripts it writes, and how it reads job states,
with stand-in ``sbatch``/``squeue``/``scontrol``/``scancel`` on PATH. (tests/test_slurm.py runs
it against a real cluster.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from parity.sweep.launch_slurm import HOPELESS, SlurmLauncher, slurm_time
from parity.sweep.launcher import CANCELLED, FAILED, NOT_FOUND, OK, TIMEOUT
from test_multinode import make_job

FAKES = {
    "sbatch": 'cat "$FAKE/sbatch.out"; exit "$(cat "$FAKE/sbatch.rc" 2>/dev/null || echo 0)"',
    # squeue -h -t all -j IDS -o FORMAT
    "squeue": '[ -s "$FAKE/state" ] && echo "42|$(cat "$FAKE/state")"; exit 0',
    "scontrol": '[ -s "$FAKE/state" ] || { echo "Invalid job id specified" >&2; exit 1; }\n'
                'echo "JobId=42 JobState=$(cut -d"|" -f1 "$FAKE/state") '
                'ExitCode=$(cat "$FAKE/exit" 2>/dev/null || echo 0:0)"',
    "scancel": 'echo "$@" >> "$FAKE/scancel.log"; echo "CANCELLED|None" > "$FAKE/state"',
}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in FAKES.items():
        p = bindir / name
        p.write_text(f"#!/bin/bash\n{body}\n")
        p.chmod(0o755)
    state = tmp_path / "fake"
    state.mkdir()
    (state / "sbatch.out").write_text("42\n")
    monkeypatch.setenv("FAKE", str(state))
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    return state


def poll_until_done(launcher, h, limit=50):
    for _ in range(limit):
        res = launcher.poll(h)
        if res is not None:
            return res
    raise AssertionError(f"still {h.state}")


def test_scripts(tmp_path):
    opts = {"partition": "debug", "account": "acct", "gpus_per_node": 8, "ntasks_per_node": 1,
            "sbatch_options": ["--qos=high", "--exclusive"]}
    launcher = SlurmLauncher(opts)
    job = make_job(tmp_path, "cell-1", "compiled", 2, 8, timeout=600)
    job.env = {"NCCL_DEBUG": "INFO", "ODD": "it's $HOME"}
    lines = launcher.sbatch_lines(job)
    for want in ("--nodes=2", "--ntasks-per-node=1", "--partition=debug", "--account=acct",
                 "--gpus-per-node=8", "--time=11", "--qos=high", "--exclusive",
                 "--job-name=parity-cell-1-compiled",
                 f"--output={job.log_dir.resolve()}/slurm-%j.out",
                 f"--error={job.log_dir.resolve()}/slurm-%j.err"):
        assert want in lines, want
    batch, node = launcher.batch_script(job), launcher.node_script(job)
    for text in (batch, node):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1" in batch
    assert "srun --nodes=\"$SLURM_JOB_NUM_NODES\"" in batch and "--ntasks-per-node=1" in batch
    assert "launch_multinode merge" in batch
    # the node command, as bash sees it on node 1 of job 7
    env = {"SLURM_NODEID": "1", "SLURM_JOB_ID": "7", "PARITY_RDZV_ENDPOINT": "n1:555",
           "PATH": "/usr/bin:/bin"}
    probe = node.replace("exec ", "printf '%s\\n' ", 1).replace("echo \"parity:", ": \"", 1)
    probe += 'printf "ENV %s|%s\\n" "$NCCL_DEBUG" "$ODD"\n'
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout
    argv = out.splitlines()
    assert argv[argv.index("--out") + 1] == str(job.run_dir / "nodes" / "node-1")
    assert argv[argv.index("--rdzv-endpoint") + 1] == "n1:555"
    assert argv[argv.index("--rdzv-id") + 1] == "parity-7"
    assert argv[argv.index("--log-dir") + 1] == str(job.log_dir / "node-1")
    assert argv[argv.index("--nproc_per_node") + 1] == "8"
    assert argv[-len(job.entry_argv) - 1:] == [*job.entry_argv, "ENV INFO|it's $HOME"]


def test_time_and_requirements():
    assert slurm_time({}, None) is None
    assert slurm_time({}, 3) == "2" and slurm_time({}, 1800) == "31"
    assert slurm_time({"time": "1:00:00"}, 3) == "1:00:00"
    gpu = SlurmLauncher({"gpus_per_node": 4})
    assert gpu.unmet("cuda", 2) is None and gpu.unmet("gpus:4", 2) is None
    assert "gpus_per_node = 4" in gpu.unmet("gpus:8", 2)
    assert "gpus_per_node" in SlurmLauncher().unmet("cuda", 1)
    assert SlurmLauncher({"nodes": 2}).unsupported(4, 1)


@pytest.mark.parametrize("state, exit_code, status, reason", [
    ("COMPLETED|None", "0:0", OK, ""),
    ("FAILED|NonZeroExitCode", "1:0", FAILED, "SLURM state FAILED, exit code 1"),
    ("TIMEOUT|TimeLimit", "0:15", TIMEOUT, "SLURM time limit (state TIMEOUT)"),
    ("CANCELLED|None", "0:15", CANCELLED, "cancelled outside parity (state CANCELLED)"),
    ("NODE_FAIL|None", "0:0", FAILED, "SLURM state NODE_FAIL"),
])
def test_final_states(fake, tmp_path, state, exit_code, status, reason):
    launcher = SlurmLauncher(poll_interval=0)
    h = launcher.start(make_job(tmp_path, "c", "eager", 2, 1, capture=False))
    assert h.job_id == "42" and h.result is None
    (fake / "state").write_text("RUNNING|None\n")
    assert launcher.poll(h) is None and h.running_since is not None
    (fake / "state").write_text(state + "\n")
    (fake / "exit").write_text(exit_code)
    res = poll_until_done(launcher, h)
    assert res.status == status and res.reason.startswith(reason), res
    assert Path(res.console_log).name == "slurm-42.out"
    assert Path(h.job.console_log).is_symlink()


def test_purged_job_is_judged_by_its_exit_file(fake, tmp_path):
    launcher = SlurmLauncher(poll_interval=0)
    job = make_job(tmp_path, "c", "eager", 2, 1, capture=False)
    h = launcher.start(job)
    (job.log_dir / "slurm-42.exit").write_text("3\n")  # squeue and scontrol know nothing
    res = poll_until_done(launcher, h)
    assert (res.status, res.exit_code) == (FAILED, 3)
    h = launcher.start(make_job(tmp_path, "d", "eager", 2, 1, capture=False))
    res = poll_until_done(launcher, h)
    assert res.status == FAILED and "left the queue without a result" in res.reason


def test_timeout_cancel_and_hopeless_pending(fake, tmp_path):
    launcher = SlurmLauncher(poll_interval=0)
    (fake / "state").write_text("RUNNING|None\n")
    h = launcher.start(make_job(tmp_path, "t", "eager", 2, 1, timeout=0.01, capture=False))
    res = poll_until_done(launcher, h)
    assert res.status == TIMEOUT and "timeout after 0.01 s" in res.reason
    assert (fake / "scancel.log").read_text().split() == ["42"]

    (fake / "state").write_text("RUNNING|None\n")
    h = launcher.start(make_job(tmp_path, "c", "eager", 2, 1, capture=False))
    launcher.cancel(h)
    assert launcher.poll(h).status == CANCELLED

    reason = sorted(HOPELESS)[0]
    (fake / "state").write_text(f"PENDING|{reason}\n")
    h = launcher.start(make_job(tmp_path, "p", "eager", 2, 1, capture=False))
    res = poll_until_done(launcher, h)
    assert res.status == FAILED and f"never scheduled: pending reason {reason}" in res.reason

    (fake / "state").write_text("PENDING|Resources\n")
    h1 = launcher.start(make_job(tmp_path, "x", "eager", 2, 1, capture=False))
    h2 = launcher.start(make_job(tmp_path, "y", "eager", 2, 1, capture=False))
    assert launcher.poll(h1) is None and launcher.poll(h2) is None
    launcher.close()  # Ctrl-C: everything still queued is scancelled
    assert launcher.poll(h1).status == CANCELLED and launcher.poll(h2).status == CANCELLED


def test_submission_problems(fake, tmp_path, monkeypatch):
    (fake / "sbatch.out").write_text("sbatch: error: Batch job submission failed: "
                                     "Invalid account or account/partition combination\n")
    (fake / "sbatch.rc").write_text("1")
    h = SlurmLauncher().start(make_job(tmp_path, "c", "eager", 2, 1))
    assert h.result.status == FAILED and "Invalid account" in h.result.reason
    monkeypatch.setenv("PATH", "/nonexistent")
    h = SlurmLauncher().start(make_job(tmp_path, "d", "eager", 2, 1))
    assert h.result.status == NOT_FOUND and "sbatch not found" in h.result.reason
