"""Round 6 of verdicts that cannot be fooled, with real processes: `parity exec` of
tests/trainers/round6.py (which imports nothing from parity), then the real CLI, each verdict
checked against the ground truth the trainer saves (``torch.equal`` of every iteration's state
dict, gradients and loss, and of the final state dict).

- a job whose rank 1 trains one step fewer than rank 0 (uneven inputs, each rank ending
  cleanly): two identical runs of it were ``PARITY INCOMPLETE`` (exit 3, "step(s) 4 recorded
  by some ranks only ... its run stopped earlier there"), so a gate over such a job could never
  pass. Both sides recorded the same steps there and nothing either side recorded was left
  out: now it holds and says the steps under ``not compared``; a rank that did not end cleanly
  (killed, raising) keeps the pair incomplete;
- DDP under ``Join`` (uneven inputs) issues two all-reduces of one unnamed flag tensor per
  step besides its gradient buckets: the bucket comparison linked every bucket holding an
  unnamed tensor through their shared (absent) name, made them one group and called it
  "partition differs" on byte-identical records: ``--fail-on any`` and ``reduction`` FAILED
  two identical runs. Buckets of unnamed tensors only are now paired in issue order;
- shapes that held or failed rightly (optimizer steps inside backward hooks, pruning made
  permanent after the last step, an ``AveragedModel`` EMA), kept as regressions.
"""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, exe, knob_env, run_ok, run_table

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round6.py")
PARITY = [sys.executable, "-m", "parity"]
TIMEOUT = 900


def _start(out: Path, nproc: int = 0, **knobs):
    knobs["R6_SAVE"] = str(out) + ".truth"
    cmd = ([*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
            str(nproc), TRAINER] if nproc else [sys.executable, TRAINER])
    return subprocess.Popen([*PARITY, "exec", "--out", str(out), "--", *cmd],
                            env=knob_env("R6_", **knobs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE.parent)


JOBS = {  # name: trainer knobs (nproc: a torchrun job of that many ranks)
    "ranks": {"R6_CASE": "ranks", "nproc": 2},
    "fewer": {"R6_CASE": "ranks", "R6_MODE": "fewer", "nproc": 2},
    "fewer_again": {"R6_CASE": "ranks", "R6_MODE": "fewer", "nproc": 2},
    "fewer_lr": {"R6_CASE": "ranks", "R6_MODE": "fewer", "R6_LR": 0.05, "nproc": 2},
    "join": {"R6_CASE": "join", "nproc": 2},
    "join_again": {"R6_CASE": "join", "nproc": 2},
    "inbwd": {"R6_CASE": "inbwd"},
    "inbwd_again": {"R6_CASE": "inbwd"},
    "inbwd_lr1": {"R6_CASE": "inbwd", "R6_LR1": 0.05},
    "prune_end": {"R6_CASE": "prune", "R6_MODE": "end"},
    "prune_end_05": {"R6_CASE": "prune", "R6_MODE": "end", "R6_X": 0.5},
    "ema": {"R6_CASE": "swa"},
    "ema_05": {"R6_CASE": "swa", "R6_X": 0.5},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, exit code, stderr)} of every job above, two at a time."""
    root = tmp_path_factory.mktemp("round6")

    def start(name, knobs):
        nproc = knobs.pop("nproc", 0)
        return root / name, _start(root / name, nproc, **knobs)

    return run_table(JOBS, start, at_once=2, timeout=TIMEOUT)



def _equal(x, y) -> bool:
    import torch

    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    return x is None and y is None


def truth(a: Path, b: Path) -> bool:
    """Whether the two runs' saved states (every rank, every iteration, the end) are equal."""
    import torch

    def load(run):
        return [torch.load(f, weights_only=False)
                for f in sorted(glob.glob(str(run) + ".truth.[0-9]*"))]

    ta, tb = load(a), load(b)
    assert ta and tb
    return _equal(ta, tb)


def _diff(a, b, *extra):
    return diff_cli(a, b, *extra, timeout=TIMEOUT)


def test_a_rank_that_trains_fewer_steps_on_both_sides_is_no_gap(runs):
    a, b = run_ok(runs, "fewer"), run_ok(runs, "fewer_again")
    assert truth(a, b)
    rc, line, d = _diff(a, b)
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    assert not d["incomplete"], d["incomplete"]
    assert "step(s) 4 on rank(s) 1 (their training ended earlier on both sides" in line, line
    # a difference at rank 1's last step still fails
    rc, line, _ = _diff(a, run_ok(runs, "fewer_lr"))
    assert rc == EXIT_MISMATCH and "from step 1 on rank 0, 1" in line, line
    # one side's rank 1 trained a step more: the other lacks it, incomplete
    full = run_ok(runs, "ranks")
    assert not truth(full, a)
    rc, line, d = _diff(full, a)
    assert rc == EXIT_INCOMPLETE, line
    assert any("B lacks 1 (rank, step) record(s) that A has: step(s) 4" in m
               for m in d["incomplete"]), d["incomplete"]


def test_unnamed_all_reduces_are_paired_in_order_not_merged_into_one_group(runs):
    """DDP ``Join``: rank 1 one batch fewer (the fix above too), two flag all-reduces per
    step; two identical runs hold under every policy, bucket layouts identical."""
    a, b = run_ok(runs, "join"), run_ok(runs, "join_again")
    assert truth(a, b)
    for policy in ("hash", "any", "reduction"):
        rc, line, d = _diff(a, b, "--fail-on", policy)
        assert d["order"]["verdict"] == "identical", d["order"]["first_bucket"]
        assert rc == EXIT_OK and "bucket layouts identical" in line, line


@pytest.mark.parametrize("a, b", [("inbwd", "inbwd_again"), ("inbwd", "inbwd_lr1"),
                                  ("prune_end", "prune_end_05"), ("ema", "ema_05")])
def test_round6_shapes_agree_with_the_ground_truth(runs, a, b):
    """Optimizers stepped inside backward (one per parameter: one step, not four), pruning
    made permanent after the last step (a new Parameter ``weight``: the final state), an
    ``AveragedModel`` EMA with another decay (the update between steps)."""
    a, b = run_ok(runs, a), run_ok(runs, b)
    same = truth(a, b)
    rc, line, d = _diff(a, b)
    assert rc == (EXIT_OK if same else EXIT_MISMATCH), line
    assert d["steps_compared"] == [0, 1, 2, 3, 4], d["steps_compared"]
