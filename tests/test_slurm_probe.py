"""``parity nccl-probe`` on a real SLURM cluster on localhost (two emulated nodes, see
tests/slurm_cluster.py), gloo ranks under ``--emulate-nccl``: started by a sweep spec's SLURM
launcher (``--spec``: one sbatch job, one torchrun agent per node), and as plain ``srun`` tasks
(ranks from SLURM_PROCID, the rendezvous at the first node's NodeAddr). Skipped, with the reason,
where SLURM cannot be installed or started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_nccl_probe_real import two_node_spec
from test_slurm import cluster  # noqa: F401 - the module-scoped local SLURM cluster fixture
from tests.real_jobs import exe

pytestmark = pytest.mark.slurm
CLUSTER = "2x2:channels=4"
QUICK = ["--emulate-nccl", CLUSTER, "--sizes", "1K-256K", "--dtypes", "fp32", "--ops", "sum",
         "--repeat", "1"]


def test_a_sweep_specs_slurm_launcher_starts_the_probe(cluster, tmp_path):
    spec = two_node_spec(tmp_path / "spec.toml", "slurm")
    out = tmp_path / "probe"
    r = subprocess.run([*exe("parity", "parity"), "nccl-probe", "--spec", str(spec), "--out",
                        str(out), *QUICK], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "with the slurm launcher" in r.stderr
    assert "MODEL HOLDS: agreement 100.0%" in r.stdout
    rec = json.loads((out / "probe.json").read_text())
    assert rec["world"] == 4 and {m["launcher"] for m in rec["ranks"]} == {"torchrun"}
    assert list((out / "job" / "ranks").glob("slurm-*.out"))


def test_plain_srun_tasks_are_the_ranks(cluster, tmp_path):
    out = tmp_path / "probe"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    r = subprocess.run(["srun", "-N2", "-n4", "--ntasks-per-node=2", "--time=5",
                        sys.executable, "-m", "parity", "nccl-probe", "--out", str(out), *QUICK],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODEL HOLDS: agreement 100.0%" in r.stdout
    rec = json.loads((out / "probe.json").read_text())
    assert {m["launcher"] for m in rec["ranks"]} == {"srun"}
    assert sorted(m["rank"] for m in rec["ranks"]) == [0, 1, 2, 3]
