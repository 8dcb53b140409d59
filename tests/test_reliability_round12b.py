"""Round 12b: state loaded from a checkpoint. ``parity exec`` of tests/trainers/round12b.py
(imports nothing from parity), whose ground truth (``R12B_SAVE``) is every step's parameters,
gradients and loss, the parameters right before the first step (after the load), and the final
model and optimizer state dicts.

Found and fixed (docs/reliability.md, "Round 12b"): torch.distributed.checkpoint's
``get_state_dict`` / ``set_state_dict`` (torchtitan's way of loading FSDP2 state) step an
optimizer that has no state yet once, with zero gradients and lr 0, to make its state
(``_init_optim_state``). Capture counted that as training step 1: a 3-step job loading a
checkpoint recorded 4 steps, step 0 was the parameters *before* the load, a checkpoint
differing in one parameter read as "between steps: after step 1's optimizer step", one
differing in the optimizer's ``exp_avg`` diverged "from step 2" (the ground truth: step 1),
and such a run against one that loaded without that step was incomplete with a loss "recorded
by B only". That step is no longer a step (parity/capture/steps.py ``_initialising_step``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, run_ok, saved, trainer_runs, values_equal

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round12b.py")
TIMEOUT = 900
_SCHED = {"R12B_WRAP": "none", "R12B_SCHED": 1, "nproc": 0}


def _jobs(root: Path) -> tuple[dict, dict]:
    """Checkpoint jobs (without parity, run first) and the compared jobs."""
    ck = {name: root / f"{name}.dcp" for name in ("ck0", "ckp", "cke")}
    first = {  # a checkpoint after one step: as is, l1.weight times 1.5, exp_avg times 1.5
        "ck0": {"R12B_STEPS": 1, "R12B_CKPT": ck["ck0"], "R12B_CKPT_AT": 1, "exec": 0},
        "ckp": {"R12B_STEPS": 1, "R12B_CKPT": ck["ckp"], "R12B_CKPT_AT": 1,
                "R12B_EDIT": "param", "exec": 0},
        "cke": {"R12B_STEPS": 1, "R12B_CKPT": ck["cke"], "R12B_CKPT_AT": 1,
                "R12B_EDIT": "exp_avg", "exec": 0},
        # one process with a StepLR (step 2, gamma 0.5): a checkpoint after step 1, and one
        # whose scheduler's last_epoch is one more (its lr halves a step earlier)
        "sk0": {**_SCHED, "R12B_STEPS": 1, "R12B_CKPT": root / "sk0.pt", "R12B_CKPT_AT": 1,
                "exec": 0},
        "sk1": {**_SCHED, "R12B_STEPS": 1, "R12B_CKPT": root / "sk1.pt", "R12B_CKPT_AT": 1,
                "R12B_EDIT": "sched", "exec": 0},
        # one process: 4 steps, a checkpoint (torch.save) after step 2
        "full": {"R12B_WRAP": "none", "R12B_STEPS": 4, "R12B_CKPT": root / "full.pt",
                 "R12B_CKPT_AT": 2, "nproc": 0},
    }
    then = {  # FSDP2 at 2 ranks, 3 steps after a DCP load (get_state_dict / set_state_dict)
        "load": {"R12B_LOAD": ck["ck0"], "plain": True},
        "loadp": {"R12B_LOAD": ck["ckp"]},
        "loade": {"R12B_LOAD": ck["cke"]},
        # one step after each scheduler checkpoint: the same update, other lr after it
        "sched0": {**_SCHED, "R12B_STEPS": 1, "R12B_START": 1, "R12B_LOAD": root / "sk0.pt"},
        "sched1": {**_SCHED, "R12B_STEPS": 1, "R12B_START": 1, "R12B_LOAD": root / "sk1.pt"},
        # resumed from full's checkpoint: full's steps 3 and 4, numbered 1 and 2
        "resumed": {"R12B_WRAP": "none", "R12B_STEPS": 2, "R12B_START": 2,
                    "R12B_LOAD": root / "full.pt", "nproc": 0},
    }
    return first, then


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round12b")
    first, then = _jobs(root)
    out = trainer_runs(root, first, TRAINER, "R12B_", timeout=TIMEOUT)
    for name in first:
        assert out[name][1] == EXIT_OK, out[name][2][-3000:]
    return {**out, **trainer_runs(root, then, TRAINER, "R12B_", timeout=TIMEOUT)}


def _truth(run: Path, rank: int = 0) -> dict:
    return saved(f"{run}.truth", rank)


def _differs(a: Path, b: Path, ranks=(0, 1)) -> set[str]:
    """Ground truth: which of A's and B's saved values differ (``params@1``: step 1)."""
    out = set()
    for r in ranks:
        x, y = _truth(a, r), _truth(b, r)
        out |= {k for k in ("init", "model", "opt") if not values_equal(x[k], y[k])}
        for k in ("params", "grads", "losses"):
            out |= {f"{k}@{i + 1}" for i, (u, v) in enumerate(zip(x[k], y[k]))
                    if not values_equal(u, v)}
    return out


def _steps(run: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run / "rank-00000" / "steps.jsonl").read_text()
            .splitlines() if json.loads(ln).get("kind", "step") == "step"]


def test_capture_changes_nothing_and_counts_the_training_steps(runs):
    """The same DCP load with and without parity: bitwise equal. The job ran 3 training
    steps; capture counted 4 (get_state_dict's initialising step was step 1)."""
    a, plain = run_ok(runs, "load"), run_ok(runs, "load.plain")
    assert _differs(a, plain) == set()
    assert "x 3 step(s) (3 recorded)" in runs["load"][2], runs["load"][2][-600:]


def test_step_0_is_the_loaded_state(runs):
    """A checkpoint differing in one parameter: the ground truth differs before step 1 (the
    loaded values); the verdict says step 0, not an edit between steps 1 and 2."""
    a, b = run_ok(runs, "load"), run_ok(runs, "loadp")
    assert "init" in _differs(a, b)
    rc, line, _ = diff_cli(a, b, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH, line
    assert "from step 0" in line and "before the first optimizer step" in line, line


def test_optimizer_state_loaded_differs_from_step_1(runs):
    """A checkpoint differing only in ``exp_avg``: equal before step 1 and in step 1's
    gradients, parameters differ after step 1 (ground truth); parity says step 1 (said step
    2), and the final state's optimizer rows are compared (3 steps, not 4)."""
    a, b = run_ok(runs, "load"), run_ok(runs, "loade")
    d = _differs(a, b)
    assert "init" not in d and "grads@1" not in d and "params@1" in d, d
    rc, line, js = diff_cli(a, b, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "from step 1 " in line, line
    assert "gradients equal, parameters differ" in line, line


def test_resumed_run_against_the_uninterrupted_one(runs):
    """A run resumed from step 2's checkpoint is the
    uninterrupted run's steps 3-4, bitwise (ground truth), but parity compares steps by their
    number: step 0 (the resumed run's loaded state) against the full run's initial state. The
    verdict FAILS at step 0 and says the full run's steps 3-4 are missing: never a match; it
    now also says that B's step 0 is A's step 2, and (round 14b) the option that aligns them:
    with it, one process and torch.save, the pair HOLDS."""
    full, res = run_ok(runs, "full"), run_ok(runs, "resumed")
    x, y = _truth(full), _truth(res)
    assert values_equal(y["init"], x["params"][1])
    assert values_equal(y["params"], x["params"][2:])
    assert values_equal(y["model"], x["model"]) and values_equal(y["opt"], x["opt"])
    assert _steps(full)[:1] == [0] and _steps(res)[:1] == [0]
    rc, line, _ = diff_cli(full, res, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "from step 0" in line, line
    assert "B lacks 2 (rank, step) record(s) that A has: step(s) 3-4" in line, line
    # said where they line up (was: "parameters differ before the first optimizer step" alone)
    assert "B's step 0 has A's step 2 parameters on every rank" in line, line
    rc, line, _ = diff_cli(res, full, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "A's step 0 has B's step 2 parameters" in line, line
    assert "--align-steps A+2 (or auto) compares them so" in line, line
    rc, line, _ = diff_cli(full, res, "--align-steps", "auto", timeout=TIMEOUT)
    assert rc == EXIT_OK and "steps aligned (--align-steps auto" in line, line
    assert "final state with optimizer state" in line, line


def test_a_schedule_that_differs_after_the_last_step_fails(runs):
    """Checkpoints whose StepLR ``last_epoch`` differs by one, one step each: parameters,
    gradients and loss equal, the lr the scheduler set after the step not (0.005 against 0.01:
    the optimizers' state dicts differ, ground truth). Was: HOLDS "final state with optimizer
    state" (the groups' numbers were no rows); now the ``param_group`` rows differ."""
    a, b = run_ok(runs, "sched0"), run_ok(runs, "sched1")
    assert _differs(a, b, ranks=(0,)) == {"opt"}
    assert _truth(a)["opt"]["param_groups"][0]["lr"] != _truth(b)["opt"]["param_groups"][0]["lr"]
    rc, line, js = diff_cli(a, b, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "in the final state" in line, line
    assert {x["fqn"].split(":")[1] for x in js["divergent"]} == {"param_group"}, js["divergent"]
