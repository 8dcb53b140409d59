"""Round 14c: the optimizers' group numbers per step (steps.jsonl ``opt``,
parity/capture/opt_numbers.py; compared by parity/diff/opt_numbers.py). ``parity exec`` of
tests/trainers/round14c.py (imports nothing from parity; FSDP2 at 2 ranks on gloo, SGD with
momentum, a second group holding a parameter no loss reaches), whose ground truth
(``R14C_SAVE``) is every step's parameters, gradients, loss and each group's lr as the step used
it.

Was (docs/reliability.md, "Round 14c"): the lr was recorded in the final state only, so a
schedule that differs read "gradients equal, parameters differ" with nothing more, and one that
differed only in the middle of the run for a group without gradients HELD. Now the first
divergence says from which step the numbers differ and what they were, and a difference of the
numbers alone FAILS.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from parity.artifacts import RankData, read_rank
from parity.capture.opt_numbers import group_numbers
from parity.diff.opt_numbers import compare_numbers, numbers_by_rank, numbers_words
from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, run_ok, saved, trainer_runs, values_equal

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round14c.py")
SCHEMA = json.loads((HERE.parent / "parity" / "schemas" / "diff.schema.json").read_text())
TIMEOUT = 900

JOBS = {
    "float": {}, "float2": {},
    "tensor": {"R14C_LR": "tensor"}, "tensor32": {"R14C_LR": "tensor32"},
    "w2": {"R14C_SCHED": "warmup", "R14C_WARMUP": 2},
    "w3": {"R14C_SCHED": "warmup", "R14C_WARMUP": 3},
    "after": {"R14C_SCHED": "step"}, "before": {"R14C_SCHED": "step", "R14C_ORDER": "before"},
    "mid": {"R14C_IDLE_MID": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("round14c"), JOBS, TRAINER, "R14C_",
                        timeout=TIMEOUT)


def _truth(run: Path, rank: int) -> dict:
    return saved(f"{run}.truth", rank)


def _first_differing(a: Path, b: Path) -> int | None:
    """Ground truth: the first step whose parameters, gradients or loss differ on either rank."""
    ta, tb = [_truth(a, r) for r in (0, 1)], [_truth(b, r) for r in (0, 1)]
    for i in range(len(ta[0]["params"])):
        for x, y in zip(ta, tb):
            if not all(values_equal(x[k][i], y[k][i]) for k in ("params", "grads", "losses")):
                return i + 1
    return None


def _first_lr_differing(a: Path, b: Path) -> int | None:
    la, lb = _truth(a, 0)["lr"], _truth(b, 0)["lr"]
    return next((i + 1 for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)


def _lines(run: Path, rank: int) -> list[dict]:
    return [json.loads(x) for x in (run / f"rank-{rank:05d}" / "steps.jsonl").read_text()
            .splitlines() if x.strip()]


def _recorded(run: Path, rank: int) -> dict[int, list[dict]]:
    """{step: the groups' numbers} as the reader gives them (lines after the first hold the
    changes since the rank's last line: round 15a, parity/opt_changes.py)."""
    return numbers_by_rank([read_rank(run / f"rank-{rank:05d}", rank)])[rank]


def _recorded_lr(run: Path, rank: int) -> list[list[float]]:
    return [[g["lr"] for g in groups] for _, groups in sorted(_recorded(run, rank).items())]


def test_recorded_numbers_are_the_ones_each_step_used(runs):
    """steps.jsonl ``opt``: each group's lr of every step on every rank is the lr the trainer
    saw right before ``optimizer.step()`` (a scheduler stepped before it included; a 0-d tensor
    read as its value: float32's rounding of 0.01 shows)."""
    for name in JOBS:
        run = run_ok(runs, name)
        for r in (0, 1):
            assert _recorded_lr(run, r) == _truth(run, r)["lr"], (name, r)
    rec = json.loads((run_ok(runs, "float") / "rank-00000" / "steps.jsonl").read_text()
                     .splitlines()[1])["opt"]
    assert rec == [{"dampening": 0, "lr": 0.01, "momentum": 0.9, "weight_decay": 0},
                   {"dampening": 0, "lr": 0.1, "momentum": 0.9, "weight_decay": 0}]


def test_lines_after_the_first_carry_only_the_groups_that_changed(runs):
    """Round 15a: the first step's line holds every group's numbers; each later line (schema
    ``v`` 3) the groups whose numbers changed since the rank's previous line, and the reader
    gives every step the full list (checked against the ground truth above). Constant numbers
    write no group after step 1; the idle group's lr halved for step 2 and restored writes that
    group at steps 2 and 3 only; a warmup writes the lr of both groups while it changes."""
    for name in JOBS:
        run = run_ok(runs, name)
        for r in (0, 1):
            lines = [x for x in _lines(run, r) if isinstance(x.get("step"), int) and x["step"] >= 1]
            full = _recorded(run, r)
            assert lines[0]["v"] == 2 and lines[0]["opt"] == full[1], (name, r)
            for prev, x in zip(lines, lines[1:]):
                s, opt = x["step"], x["opt"]
                assert x["v"] == 3 and opt["since"] == prev["step"] and opt["groups"] == 2
                changed = [i for i, (g, h) in enumerate(zip(full[s], full[prev["step"]]))
                           if g != h]
                assert [e[0] for e in opt["changed"]] == changed, (name, r, s)
    mid = {x["step"]: x["opt"]["changed"] for x in _lines(run_ok(runs, "mid"), 0)
           if isinstance(x.get("opt"), dict)}
    assert mid == {2: [[1, {"lr": 0.05}]], 3: [[1, {"lr": 0.1}]], 4: []}
    assert all(not x["opt"]["changed"] for x in _lines(run_ok(runs, "float"), 1)
               if isinstance(x.get("opt"), dict))


@pytest.mark.parametrize("a, b, step, said", [
    # LambdaLR warmup over 2 against 3 steps: 0.5 against 1/3 of the lr from step 1
    ("w2", "w3", 1, "lr 0.005 against 0.003333333333333333 (group 0)"),
    # StepLR(2, 0.5) stepped after against before optimizer.step(): step 2 already halved on B
    ("after", "before", 2, "equal through step 1: lr 0.01 against 0.005 (group 0)"),
])
def test_a_schedule_that_differs_is_said(runs, a, b, step, said):
    """Ground truth: gradients equal and parameters differ first at ``step``, where the lr
    first differs. Was: ``(gradients equal, parameters differ)`` alone."""
    ra, rb = run_ok(runs, a), run_ok(runs, b)
    assert _first_differing(ra, rb) == step == _first_lr_differing(ra, rb)
    rc, line, js = diff_cli(ra, rb, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH, line
    assert (f"hash mismatch from step {step} on rank 0, 1 (gradients equal, parameters differ; "
            f"optimizer lr differs from step {step})") in line, line
    fd = js["first_divergence"]
    assert said in fd["explanation"], fd["explanation"]
    assert fd["opt_numbers"]["first_differs"] == step and fd["opt_numbers"]["ranks"] == [0, 1]
    jsonschema.validate(js, SCHEMA)


def test_a_difference_of_the_numbers_alone_fails(runs):
    """The idle group's lr halved for step 2 only: every hash equal (ground truth: parameters,
    gradients, losses bitwise equal; the final state too), the lr of step 2 differs. Was:
    HOLDS. Now a FAIL of its own, whose line says the hashes are equal."""
    ra, rb = run_ok(runs, "float"), run_ok(runs, "mid")
    assert _first_differing(ra, rb) is None and _first_lr_differing(ra, rb) == 2
    assert all(values_equal(_truth(ra, r)["model"], _truth(rb, r)["model"]) for r in (0, 1))
    rc, line, js = diff_cli(ra, rb, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH, line
    assert ("hashes equal, but the optimizer's group numbers differ from step 2 on rank 0, 1 "
            "(optimizer lr differs from step 2)") in line, line
    fd = js["first_divergence"]
    assert fd["origin"] == "optimizer" and fd["params"] == 0 and js["divergent"] == []
    assert "lr 0.1 against 0.05 (group 1)" in fd["explanation"]
    assert fd["opt_numbers"]["equal_before"] == 1
    jsonschema.validate(js, SCHEMA)


def test_equal_numbers_hold_and_nothing_is_added(runs):
    """Identical runs, and an lr given as a float against a float64 0-d tensor of the same
    value (ground truth: every step bitwise equal, the lr equal): HOLDS, the line as before."""
    base = run_ok(runs, "float")
    for other in ("float2", "tensor"):
        rb = run_ok(runs, other)
        assert _first_differing(base, rb) is None and _first_lr_differing(base, rb) is None
        rc, line, js = diff_cli(base, rb, timeout=TIMEOUT)
        assert rc == EXIT_OK, line
        assert line == ("PARITY HOLDS under --fail-on hash (exit 0): hashes bitwise identical "
                        "over 5 steps x 2 ranks x 5 parameters (param, grad, loss, final state "
                        "with optimizer state); bucket layouts identical"), line
        assert js["first_divergence"] is None
        jsonschema.validate(js, SCHEMA)


def test_a_float32_tensor_lr_is_another_number(runs):
    """lr = torch.tensor(0.01) (float32): training bitwise equal (ground truth: the float32
    parameters' update rounds 0.01 to float32 anyway), the number differs. It FAILED in the
    final state before this round (the ``param_group`` rows); the explanation now says from
    step 1 which number."""
    ra, rb = run_ok(runs, "float"), run_ok(runs, "tensor32")
    assert _first_differing(ra, rb) is None and _first_lr_differing(ra, rb) == 1
    rc, line, js = diff_cli(ra, rb, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "in the final state" in line, line
    assert "optimizer lr differs from step 1" in js["first_divergence"]["label"]
    assert "lr 0.01 against 0.009999999776482582 (group 0)" in js["first_divergence"]["explanation"]


# ----------------------------------------------------------------------------- pure logic

def _rank(rank: int, steps: dict) -> RankData:
    rd = RankData.__new__(RankData)
    rd.rank, rd.steps = rank, steps
    return rd


def test_group_numbers_unit():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5, dtype=torch.float64), betas=(0.8, 0.9))
    assert group_numbers(opt) == [{"betas": [0.8, 0.9], "eps": 1e-08, "lr": 0.5,
                                   "weight_decay": 0}]  # booleans and None left out

    class Device:  # what an accelerator tensor looks like to the reader (never .item()'d)
        param_groups = [{"params": [p], "lr": torch.empty((), device="meta"), "momentum": 0.9}]
    assert group_numbers(Device()) == [{"momentum": 0.9}]

    class Broken:
        @property
        def param_groups(self):
            raise RuntimeError("no")
    assert group_numbers(Broken()) is None


def test_compare_numbers_unit():
    g = lambda lr: [{"lr": lr, "momentum": 0.9}]  # noqa: E731
    a = {0: {1: g(0.1), 2: g(0.1), 3: g(0.1)}}
    b = {0: {1: g(0.1), 2: g(0.05), 3: g(0.1)}}
    c = compare_numbers(a, b, [0])
    assert (c["first_differs"], c["equal_before"], c["ranks"]) == (2, 1, [0])
    label, words = numbers_words(c, 3)  # said at a later divergence
    assert label == "optimizer lr differs from step 2" and "lr 0.1 against 0.05 (group 0)" in words
    label, words = numbers_words(c, 1)  # the divergence came first
    assert label == "" and "differ from step 2, after this divergence" in words
    same = compare_numbers(a, a, [0])
    assert same["first_differs"] is None and numbers_words(same, 3)[0] == ""
    assert "equal through step 3" in numbers_words(same, 3)[1]
    # old runs: nothing said; one side only: said, not compared
    assert compare_numbers({0: {}}, {0: {}}, [0]) is None and numbers_words(None, 1) == ("", "")
    one = compare_numbers(a, {0: {}}, [0])
    assert one["recorded"] == "a" and "recorded by A only" in numbers_words(one, 1)[1]
    # a key or a group on one side only; numbers not read (an accelerator's): said, not compared
    c = compare_numbers({0: {1: [{"lr": 0.1}]}}, {0: {1: [{"lr": 0.1, "initial_lr": 0.1},
                                                           {"lr": 1.0}]}}, [0])
    assert {d["key"] for d in c["differences"]} == {"groups", "initial_lr"}
    c = compare_numbers({0: {1: [{"lr": 0.1}]}}, {0: {1: [{"lr": 0.1}, {"lr": 0.1}]}}, [0])
    assert numbers_words(c, 1)[0] == "optimizer param group count differs from step 1"
    assert "1 param group(s) against 2" in numbers_words(c, 1)[1]
    c = compare_numbers({0: {1: [{"lr": None}]}}, {0: {1: [{"lr": 0.2}]}}, [0])
    assert c["first_differs"] is None and c["unread"] == 1
    assert "1 number(s) held on an accelerator were not read" in numbers_words(c, 1)[1]
    # steps.jsonl lines as the reader gives them
    by = numbers_by_rank([_rank(1, {0: {"step": 0}, 1: {"opt": g(0.1)}, "final": {}})])
    assert by == {1: {1: g(0.1)}}
