"""Capture never changes the job it observes when the job traces (issue 11, issue 17 item 4).

A trainer that compiles its model (dynamo) and traces a training step with make_fx whose loss
calls ``.backward()`` inside the trace (torchtitan GraphTrainer's chunked loss does): under
``parity exec`` torch prints no warning about global module hooks, dynamo builds the one graph it
builds without parity, and the backward inside the trace is neither a step nor a loss. Runs
without torchtitan (tests/test_torchtitan.py covers the real trainer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "tests" / "trainers" / "traced_steps.py"


def _run(cmd, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_traced_job_is_unchanged_by_capture(tmp_path):
    plain, _ = _run([sys.executable, str(TRAINER)], tmp_path)
    out = tmp_path / "run"
    captured, err = _run([sys.executable, "-m", "parity", "exec", "--out", str(out), "--",
                          sys.executable, str(TRAINER)], tmp_path)
    assert "global hooks on modules" not in err
    assert "capture disabled" not in err
    assert captured["unique_graphs"] == plain["unique_graphs"] == 1  # no recompile
    assert captured["losses"] == plain["losses"]
    meta = json.loads((out / "rank-00000" / "meta.json").read_text())
    assert meta["capture"]["disabled"] is None
    steps = [json.loads(line) for line in (out / "rank-00000" / "steps.jsonl").read_text()
             .splitlines()]
    # the end-of-run state is its own record, after the steps
    assert steps[-1]["step"] == "final"
    steps = [s for s in steps if s["step"] != "final"]
    # 4 compiled steps; the make_fx step's optimizer continues step 4 (its backward ran inside
    # the trace, on fake tensors: not a new step, not a loss)
    assert max(s["step"] for s in steps) == 4
    last = {s["step"]: s for s in steps}
    assert [last[k]["loss"] for k in range(1, 5)] == captured["losses"]
