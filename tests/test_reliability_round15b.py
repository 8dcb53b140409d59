"""Round 15b: optimizers implemented otherwise, and gradient accumulation (docs/reliability.md,
"Round 15b"). ``parity exec`` of tests/trainers/round15b.py (imports nothing from parity; FSDP2
at 2 ranks on gloo, Adam, 2 micro-batches per step), whose ground truth (``R15B_SAVE``) is every
step's parameters, gradients, loss and how many reduce-scatters FSDP2 ran.

Was: ``fused=True`` or ``maximize=True`` against the default read "gradients equal, parameters
differ" with "not another learning rate" and no cause; ``foreach=False`` against the default
(bitwise equal on the CPU) HELD without a word; a loss divided per micro-batch before backward
against the gradients divided after (bitwise identical training) FAILED "loss differs,
gradients equal: the loss computation"; FSDP2 syncing at every micro-batch was explained as
"2 reduce-scatters in B's graph ... (chunked reduce-scatters)". Now each names its cause.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from parity.artifacts import read_rank
from parity.capture.opt_impl import optimizer_impl
from parity.diff.loss_factor import exact_factor, near_factor, near_factor_words
from parity.diff.opt_impl import compare_impl, impl_phrase, impl_words
from parity.diff.result import from_dict
from parity.errors import EXIT_MISMATCH, EXIT_OK
from parity.policy import loss_factor_phrase
from tests.real_jobs import diff_cli, run_ok, run_table, saved, start_trainer, values_equal

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round15b.py")
SCHEMA = json.loads((HERE.parent / "parity" / "schemas" / "diff.schema.json").read_text())
TIMEOUT = 900

BASE = {"R15B_MICRO": 2, "R15B_STEPS": 2}
JOBS = {
    "last": BASE, "grad": {**BASE, "R15B_DIV": "grad"}, "every": {**BASE, "R15B_SYNC": "every"},
    "fused": {**BASE, "R15B_IMPL": "fused"}, "forloop": {**BASE, "R15B_IMPL": "forloop"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round15b")
    return run_table(JOBS, lambda name, knobs: (root / name, start_trainer(
        root / name, "R15B_", knobs, [TRAINER])), at_once=3, timeout=TIMEOUT)


def _truth_equal(a: Path, b: Path, keys=("params", "grads", "losses")) -> dict[str, bool]:
    ta, tb = [saved(f"{a}.truth", r) for r in (0, 1)], [saved(f"{b}.truth", r) for r in (0, 1)]
    return {k: all(values_equal(x[k], y[k]) for x, y in zip(ta, tb)) for k in keys}


def _diff(runs, a: str, b: str, *extra) -> tuple[int, str, dict]:
    rc, line, js = diff_cli(run_ok(runs, a), run_ok(runs, b), *extra)
    jsonschema.validate(js, SCHEMA)
    return rc, line, js


# ------------------------------------------------------------------ real jobs (one fixture)

def test_fused_against_the_default_names_fused(runs):
    """Ground truth: gradients equal, parameters differ from step 1 (the fused CPU kernel rounds
    otherwise). Was: no cause named; now the label and the explanation name ``fused``."""
    t = _truth_equal(run_ok(runs, "last"), run_ok(runs, "fused"), ("grads", "params"))
    assert t == {"grads": False, "params": False}  # grads of step 2 follow step 1's params
    rc, line, js = _diff(runs, "last", "fused")
    assert rc == EXIT_MISMATCH
    assert "gradients equal, parameters differ" in line and "optimizer fused differs" in line
    fd = js["first_divergence"]
    assert fd["step"] == 1 and "fused None (the default) against True" in fd["explanation"]
    assert "likely cause" in fd["explanation"] and js["opt_impl"]["kernel_only"] is True


def test_foreach_false_against_the_default_holds_and_says_so(runs):
    """Ground truth: bitwise equal (the CPU's default is the for-loop too); the optimizer state
    dicts differ only in ``foreach``. Was: HOLDS, nothing said; now HOLDS (exit 0: a flag
    that changed no value is no FAIL) with the difference among what is tolerated."""
    a, b = run_ok(runs, "last"), run_ok(runs, "forloop")
    assert all(_truth_equal(a, b).values())
    rc, line, js = _diff(runs, "last", "forloop")
    assert rc == EXIT_OK, line
    assert ("tolerated: optimizer implementation differs from step 1 (foreach None (the "
            "default) against False; other kernels: equal here, may round otherwise") in line
    assert js["first_divergence"] is None
    assert from_dict(js).judge().line() == line  # a sweep's reports read the JSON back


def test_loss_divided_before_backward_against_gradients_divided_after_holds(runs):
    """Ground truth: parameters and gradients bitwise equal (dividing by 2 is exact); the
    backpropagated losses differ by exactly 2. Was: FAILS "loss differs, gradients equal";
    now HOLDS, the factor said."""
    a, b = run_ok(runs, "last"), run_ok(runs, "grad")
    assert all(_truth_equal(a, b, ("params", "grads")).values())
    rc, line, js = _diff(runs, "last", "grad")
    assert rc == EXIT_OK, line
    assert "B's loss is exactly 2 x the other's at every step on every rank" in line
    assert js["loss"]["factor"] == 1
    assert from_dict(js).judge().line() == line
    rc, line, _ = _diff(runs, "grad", "last")  # the other way round: A's is twice B's
    assert rc == EXIT_OK and "A's loss is exactly 2 x" in line


def test_sync_at_every_micro_batch_is_explained_and_not_predicted_same(runs):
    """Ground truth: 1 against 2 reduce-scatters per step, gradients differ from step 1. The
    explanation says one reduce-scatter per micro-batch (was: "B's graph ... chunked"), and
    ``--at 8x8`` counts the collectives: never "same"."""
    a, b = run_ok(runs, "last"), run_ok(runs, "every")
    assert saved(f"{a}.truth")["rs"] == [1, 1] and saved(f"{b}.truth")["rs"] == [2, 2]
    assert not _truth_equal(a, b)["grads"]
    rc, line, js = _diff(runs, "last", "every")
    assert rc == EXIT_MISMATCH
    expl = js["first_divergence"]["explanation"]
    assert "2 reduce-scatters per step in B (fsdp2 bucket 0: one per micro-batch" in expl
    assert "graph" not in expl.split("l0.weight's gradient")[1].split(".")[0]
    rc, line, js = _diff(runs, "last", "every", "--fail-on", "reduction", "--at", "8x8")
    assert rc == EXIT_MISMATCH and "by another number of collectives" in line
    assert js["reduction_order"]["verdict"] != "same"


def test_recorded_implementation(runs):
    """steps.jsonl ``opt_impl``: the class and each group's flags, as the reader gives every
    recorded step; written on the first line only while it stays the same (lead, round 15)."""
    rank_dir = run_ok(runs, "fused") / "rank-00001"
    lines = [json.loads(x) for x in (rank_dir / "steps.jsonl").read_text().splitlines()
             if x.strip()]
    written = [x for x in lines if isinstance(x.get("step"), int) and x["step"] >= 1]
    assert len(written) == 2 and "opt_impl" in written[0] and "opt_impl" not in written[1]
    steps = read_rank(rank_dir, 1).steps
    impl = [steps[k]["opt_impl"] for k in sorted(steps) if k >= 1]
    assert len(impl) == 2 and impl[0] == impl[1]
    assert impl[0][0]["class"] == "torch.optim.adam.Adam" and impl[0][0]["flags"][0]["fused"]


# ------------------------------------------------------------------ pure logic, no job

def _steps(a: list, b: list):
    return [SimpleNamespace(equal=x == y, a_ranks=x, b_ranks=y) for x, y in zip(a, b)]


def test_exact_and_near_factor():
    assert exact_factor(_steps([[1.5, 0.75]], [[3.0, 1.5]])) == 1
    assert exact_factor(_steps([[3.0], [0.5]], [[0.75], [0.125]])) == -2
    assert exact_factor(_steps([[1.0]], [[3.0]])) is None  # not a power of two
    assert exact_factor(_steps([[1.0], [1.0]], [[2.0], [4.0]])) is None  # not one k
    assert exact_factor(_steps([[1.0, 2.0]], [[2.0, 2.0]])) is None  # a rank equal
    assert exact_factor(_steps([[0.0]], [[0.0]])) is None
    assert exact_factor(_steps([[1.0]], [[1.0]])) is None  # equal: no factor
    assert exact_factor(_steps([[1.0]], [[None]])) is None
    assert exact_factor(_steps([[float("inf")]], [[float("inf")]])) is None
    assert near_factor(_steps([[1.0, 2.0], [3.0, 1.0]], [[3.0000002, 6.0], [9.0, 3.0]])) == 3.0
    assert near_factor(_steps([[3.0]], [[1.0000001]])) == 1 / 3
    assert near_factor(_steps([[1.0]], [[-1.0]])) is None  # maximize on -loss
    assert near_factor(_steps([[1.0]], [[1.4]])) is None  # no whole ratio
    assert near_factor(_steps([[1.0], [1.0]], [[3.0], [2.0]])) is None  # not one ratio
    assert near_factor(_steps([[1.0]], [[1.0]])) is None
    assert "A's loss is 3 x" in near_factor_words(1 / 3)
    assert "B's loss is exactly 4 x" in loss_factor_phrase(2)
    assert "A's loss is exactly 2 x" in loss_factor_phrase(-1)


def test_optimizer_impl_and_its_comparison():
    p = [torch.nn.Parameter(torch.zeros(2))]
    default, fused = torch.optim.Adam(p), torch.optim.Adam(p, fused=True)
    adamw, amsgrad = torch.optim.AdamW(p, weight_decay=0.0), torch.optim.Adam(p, amsgrad=True)
    x = {0: {1: [optimizer_impl(default)]}}

    def cmp(o):
        return compare_impl(x, {0: {1: [optimizer_impl(o)]}}, [0])

    assert compare_impl(x, x, [0]) is None
    c = cmp(fused)
    assert c["kernel_only"] and c["first_differs"] == 1 and c["ranks"] == [0]
    assert impl_words(c, "param", 1)[0] == "optimizer fused differs"
    assert impl_words(c, "backward", 1)[0] == ""  # said, not as the cause
    assert impl_words(c, "param", 0) == ("", "")  # differs only after the divergence
    c = cmp(torch.optim.Adam(p, maximize=True))  # measured: "maximize differs" (the docs)
    assert not c["kernel_only"]
    assert impl_words(c, "optimizer", 1)[0] == "optimizer maximize differs"
    assert "another update rule" in impl_words(c, "optimizer", 1)[1]
    c = cmp(adamw)
    assert not c["kernel_only"] and c["differences"][0]["a"] == "Adam"
    assert "Adam against AdamW" in impl_phrase(c)
    assert "amsgrad False against True" in impl_phrase(cmp(amsgrad))
    assert compare_impl({0: {1: []}}, {0: {2: []}}, [0]) is None  # no common step
    assert optimizer_impl(object()) is None


def test_an_option_one_torch_lacks_is_no_difference_when_off_on_the_other():
    """A run of an older torch (an Adam without ``decoupled_weight_decay``) against a newer
    one that has it off: not another update rule; on, it is (lead, round 15)."""
    new = {"class": "torch.optim.adam.Adam", "flags": [{"decoupled_weight_decay": False,
                                                        "foreach": None, "fused": None}]}
    old = {"class": "torch.optim.adam.Adam", "flags": [{"foreach": None}]}
    assert compare_impl({0: {1: [old]}}, {0: {1: [new]}}, [0]) is None
    on = {**new, "flags": [{**new["flags"][0], "decoupled_weight_decay": True}]}
    c = compare_impl({0: {1: [old]}}, {0: {1: [on]}}, [0])
    assert c is not None and not c["kernel_only"]
    assert "decoupled_weight_decay absent against True" in impl_phrase(c)
