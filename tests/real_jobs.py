"""Real torchrun jobs captured with ``parity exec``, for the tests that need recorded runs
(test_reduction_real.py, test_nccl_emulation_real.py): one place that finds the executables and
says why a job failed, so a module-scoped fixture is a table of jobs and one loop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def exe(name: str, module: str) -> list[str]:
    """The console script ``name`` next to this interpreter (or on PATH), else
    ``python -m module``: the tests run from a venv that may not be activated."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def capture(run: Path, entry: list[str], *, nproc: int = 4, exec_args: list[str] = (),
            env: dict[str, str] | None = None) -> Path:
    """``parity exec [exec_args] --out run -- torchrun --standalone --nproc_per_node nproc
    entry...`` in ``run``'s parent, one thread per rank; a failed job fails the test with its
    stderr's end (the fixture's other jobs would be compared against nothing)."""
    cmd = [*exe("parity", "parity"), "exec", *exec_args, "--out", str(run), "--",
           *exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
           str(nproc), *entry]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=run.parent, capture_output=True, text=True, timeout=900,
                          env=full_env)
    if proc.returncode != 0:
        pytest.fail(f"{run.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return run
