"""Round 13b: randomness. ``parity exec`` of tests/trainers/round13b.py (imports nothing from
parity; FSDP2 on 2 ranks, two blocks with dropout, optionally compiled with inductor; saves every
step's loss, gradients, shards and the CPU generator's state, the final model and optimizer
state, dynamo's counters), compared with ``torch.equal`` between runs (the ground truth).

Found and fixed (docs/reliability.md, "Round 13b"): a pair whose dropout masks differ (eager
against inductor, whose compiled dropout draws its own seeds from the default generator;
another seed on one rank; a ``torch.rand`` for logging on one rank; activation checkpointing
that recomputes without ``preserve_rng_state``) FAILED "hash mismatch from step 1 (loss
differs, gradients differ); bucket layouts identical", the explanation pointing at the forward
computation and ``parity bisect``: nothing said that the runs drew other random numbers, and a
pair whose generators agree (inductor with ``fallback_random``: its gradients differ by
inductor's numerics alone) read the same. Capture now records the default generators' state
after each step (steps.jsonl ``rng``, capture/rng_state.py) and the first divergence says
"RNG state differs from step k" or that the states were equal (diff/rng.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.diff.rng import compare_rng, rng_words
from parity.errors import EXIT_MISMATCH
from tests.real_jobs import diff_cli, run_ok, saved, trainer_runs, values_equal

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round13b.py")
TIMEOUT = 900
# the compile caches off in the job without parity too (parity exec turns them off: a cache
# hit would give no manifest), so that dynamo's and inductor's counters are comparable
_NO_CACHE = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}

JOBS = {  # name: knobs (plain: also run without parity exec); 3 steps, dropout 0.25
    "eager": {},
    "inductor": {"R13B_COMPILE": "inductor", "plain": True, **_NO_CACHE},
    "fallback": {"R13B_COMPILE": "inductor", "R13B_FALLBACK": 1, **_NO_CACHE},
    "log1": {"R13B_EXTRA": "log", "R13B_EXTRA_RANK": 1},  # a torch.rand on rank 1 only
    "ac_nopreserve": {"R13B_AC": "nopreserve"},
}
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round13b")
    return trainer_runs(root, JOBS, TRAINER, "R13B_", timeout=TIMEOUT)


def truth(runs, name: str, rank: int) -> dict:
    run_ok(runs, name)
    return saved(str(runs[name][0]) + ".truth", rank)


def first_truth_step(runs, a: str, b: str, key: str) -> int | None:
    """The first step (1-based; ``rng``: the state after that step) whose saved ``key`` differs
    on some rank."""
    ks = []
    for rank in (0, 1):
        x, y = truth(runs, a, rank)[key], truth(runs, b, rank)[key]
        start = 1 if key == "rng" else 0  # rng[k]: after step k (rng[0]: before step 1)
        ks += [k + (0 if key == "rng" else 1) for k in range(start, len(x))
               if not values_equal(x[k], y[k])][:1]
    return min(ks) if ks else None


def test_capture_changes_nothing(runs):
    for name in ("inductor",):
        for rank in (0, 1):
            x, y = truth(runs, name, rank), truth(runs, name + ".plain", rank)
            assert values_equal({k: v for k, v in x.items() if k != "extra"},
                                {k: v for k, v in y.items() if k != "extra"}), (name, rank)
            assert x["extra"] == y["extra"], (name, rank)  # dynamo's and inductor's counters
    assert truth(runs, "inductor", 0)["extra"]["counters"]["stats"]["unique_graphs"] >= 1


def test_recorded_state_is_the_generators(runs):
    """steps.jsonl's ``rng.cpu`` at step k is the xxh3-128 of the state the trainer read after
    step k's optimizer step (at the top of the next iteration)."""
    from parity.capture.hashing import host_digest

    for rank in (0, 1):
        run = run_ok(runs, "eager") / f"rank-{rank:05d}" / "steps.jsonl"
        lines = [json.loads(x) for x in run.read_text().splitlines()]
        got = {x["step"]: x["rng"]["cpu"] for x in lines if "rng" in x}
        want = {k: host_digest(t).hex() for k, t in enumerate(truth(runs, "eager", rank)["rng"])
                if k >= 1}
        assert got == want


@pytest.mark.parametrize("b,ranks", [("inductor", [0, 1]), ("log1", [1]),
                                     ("ac_nopreserve", [0, 1])])
def test_another_random_stream_is_said(runs, b, ranks):
    """Eager against inductor (its own seeds), a logging draw on rank 1 only, a recomputation
    without preserve_rng_state: the generators differ after step 1 (ground truth), and so do
    the gradients; the verdict line says the RNG state differs from step 1 (was: only "bucket
    layouts identical")."""
    assert first_truth_step(runs, "eager", b, "rng") == 1
    assert first_truth_step(runs, "eager", b, "grads") == 1
    rc, line, js = diff_cli(run_ok(runs, "eager"), run_ok(runs, b))
    assert rc == EXIT_MISMATCH
    assert "hash mismatch from step 1" in line and "RNG state differs from step 1" in line, line
    rng = js["first_divergence"]["rng"]
    assert rng["first_differs"] == 1 and rng["ranks"] == ranks, rng
    assert rng["generators"] == ["cpu"] and rng["steps"] == [1, 2, 3]


def test_fallback_random_draws_as_eager(runs):
    """Inductor with fallback_random draws eager's numbers (ground truth: the generator states
    equal throughout, the losses equal) and its gradients differ all the same (inductor's
    numerics): no RNG claim on the verdict line, and the explanation says the states agreed."""
    assert first_truth_step(runs, "eager", "fallback", "rng") is None
    assert first_truth_step(runs, "eager", "fallback", "losses") is None
    assert first_truth_step(runs, "eager", "fallback", "grads") == 1
    rc, line, js = diff_cli(run_ok(runs, "eager"), run_ok(runs, "fallback"))
    assert rc == EXIT_MISMATCH and "RNG" not in line, line
    fd = js["first_divergence"]
    assert fd["rng"]["first_differs"] is None and fd["rng"]["equal_before"] == STEPS
    assert "random generators' states (CPU) are equal" in fd["explanation"]


# ------------------------------------------------------------------ pure logic (diff/rng.py)

def _side(states: dict[int, list[str]]) -> dict[int, dict[int, dict]]:
    """{rank: [digest after step 1, 2, ...]} as rng_by_rank gives it."""
    return {r: {k + 1: {"cpu": d} for k, d in enumerate(ds)} for r, ds in states.items()}


def test_compare_rng_unit():
    a = _side({0: ["a", "b", "c"], 1: ["x", "y", "z"]})
    assert compare_rng(a, a, [0, 1])["first_differs"] is None
    b = _side({0: ["a", "b", "c"], 1: ["x", "Y", "Z"]})
    got = compare_rng(a, b, [0, 1])
    assert (got["first_differs"], got["ranks"], got["equal_before"]) == (2, [1], 1)
    label, words = rng_words(got, 2)
    assert label == "RNG state differs from step 2" and "equal after step 1" in words
    assert rng_words(got, 1) == ("", rng_words(got, 1)[1])  # after the divergence: no label
    assert "after this divergence" in rng_words(got, 1)[1]
    # runs recorded before round 13b: nothing said; one side only: said, not compared
    assert compare_rng({0: {}}, {0: {}}, [0]) is None and rng_words(None, 1) == ("", "")
    one = compare_rng(a, {0: {}, 1: {}}, [0, 1])
    assert one["recorded"] == "a" and "recorded by A only" in rng_words(one, 1)[1]
    # a CUDA state on one side only: the common generator (CPU) is compared
    c = {0: {1: {"cpu": "a", "cuda": "q"}}}
    assert compare_rng(c, {0: {1: {"cpu": "a"}}}, [0])["first_differs"] is None
    assert compare_rng(c, {0: {1: {"cpu": "a", "cuda": "r"}}}, [0])["first_differs"] == 1


def test_reading_the_state_advances_no_generator():
    import torch

    from parity.capture.rng_state import rng_digests

    torch.manual_seed(7)
    want = torch.rand(5)
    torch.manual_seed(7)
    first = rng_digests()
    assert rng_digests() == first and set(first) == {"cpu"}  # no CUDA initialised here
    assert torch.equal(torch.rand(5), want)


def test_bisect_says_a_random_op_drew_other_numbers():
    """parity bisect of a pair whose seeds differ on rank 1 named ``aten.bernoulli_.float in
    blocks.0.drop (forward)`` with "inputs already differed: yes: B's input(s) 0 are values A
    never had before this op: the difference arose earlier" (the empty tensor the mask is drawn
    into), and with equal inputs "this op itself computed a different result"; it now says the
    op is random and the generator's state differed."""
    from parity.bisect import _inputs_verdict

    # dropout's bernoulli_ fills an empty_like tensor: its input is whatever memory held (it
    # read "B's input(s) 0 are values A never had ...: the difference arose earlier")
    a = {"i": 5, "op": "aten.bernoulli_.float", "in": ["garbage-a"]}
    got = _inputs_verdict(a, {**a, "in": ["garbage-b"]}, [])
    assert got["differed"] is False and got["random"] is True
    assert "random op" in got["detail"] and "generator's state" in got["detail"]
    mul = {"i": 5, "op": "aten.mul.Tensor", "in": ["x", "y"]}
    assert "itself computed" in _inputs_verdict(mul, dict(mul), [])["detail"]
    # a random fill whose probability tensor differs: that input is named by its own index
    p = {"i": 5, "op": "aten.bernoulli_.Tensor", "in": ["garbage", "p-a"]}
    got = _inputs_verdict(p, {**p, "in": ["other", "p-b"]}, [])
    assert got["differed"] is True and "input(s) 1 " in got["detail"], got
