"""Issue 23 item 3 on a real SLURM cluster (tests/slurm_cluster.py): ``stop_after_divergence``
``scancel``s both 2-node jobs of a diverged cell once K steps past the divergence are recorded
(read live from each node's folder, before the merge), and the cell stays a divergence."""

from __future__ import annotations

import pytest

from test_early_stop import check_stopped, run_sweep, spec_text
from test_slurm import cluster  # noqa: F401 - the module fixture

pytestmark = pytest.mark.slurm


def test_early_stop_slurm(cluster, tmp_path):  # noqa: F811
    text = spec_text("stop-slurm", launcher="slurm", nnodes=2) + "ntasks_per_node = 1\n"
    r, sweep = run_sweep(tmp_path, text)
    cell = check_stopped(r, sweep)
    ref = cell["sides"]["reference"]
    assert ref["command"][0] == "sbatch"
    print(f"SLURM early stop: cell wall {cell['wall']:.1f} s")
