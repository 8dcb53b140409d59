"""Compare two capture outputs: ``diff_runs(a_dir, b_dir) -> DiffResult``.

A package: result.py (the data model, its JSON and verdict), engine.py (reads the runs, checks
they are comparable, assembles the result), hashes.py (per-parameter hashes: alignment,
roll-ups, drill-down), buckets.py (bucket layouts, and whether every rank of a side agrees),
bucket_summary.py (what the bucketing passes did, per graph; also ``parity inspect``), env.py
(numerics-relevant environment differences). Nothing here prints. ``ranges`` lives in
parity/text.py (re-exported here).
"""

from parity.diff.engine import diff_runs
from parity.diff.hashes import KINDS
from parity.diff.result import (FAIL_ON, SCHEMA_PATH, SCHEMA_VERSION, VERDICTS, CaptureWarning,
                                ComparedRun, DiffResult, Divergence, FirstDivergence,
                                LossComparison, LossStep, Problem, load_diff_json)
from parity.text import ranges

__all__ = ["diff_runs", "DiffResult", "CaptureWarning", "ComparedRun", "Problem", "Divergence",
           "FirstDivergence", "LossStep", "LossComparison", "load_diff_json", "SCHEMA_VERSION",
           "SCHEMA_PATH", "VERDICTS", "FAIL_ON", "KINDS", "ranges"]
