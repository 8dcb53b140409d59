"""Make ``tests.*`` helpers (synth, slurm_cluster, trainers) importable from any test file,
whatever order pytest collects them in."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
