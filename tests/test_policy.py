"""parity.policy: the one place the fail-on rule, the pair status and the verdict words live."""

import itertools

import pytest

from parity import policy
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, ParityError

HASH = ("match", "hash_mismatch", "incomplete")
ORDER = ("identical", "order_differs", "partition_differs", "layout_differs", "unavailable")


@pytest.mark.parametrize("hv,ov,incomplete,pol", itertools.product(
    HASH, ORDER, (False, True), tuple(policy.POLICIES)))
def test_verdict_words_never_contradict_the_exit_code(hv, ov, incomplete, pol):
    d = {"verdict": hv, "incomplete": ["b: rank 1 missing"] if incomplete else [],
         "order": {"verdict": ov}, "steps_compared": [0, 1], "ranks_compared": [0],
         "params_compared": 3, "kinds_compared": ["param"],
         "first_divergent_step": 1 if hv == "hash_mismatch" else None}
    v = policy.judge_pair(d, pol)
    assert v.code == policy.pair_code(hv, ov, incomplete, pol)
    assert v.line().startswith(f"PARITY {policy.WORDS[v.code]} under --fail-on {pol} "
                               f"(exit {v.code})")
    if v.code == EXIT_MISMATCH:
        assert v.failed  # says what failed it
    # every policy fails on at least what its name says
    if hv == "hash_mismatch" and pol in ("hash", "any"):
        assert v.code == EXIT_MISMATCH
    if ov in policy.ORDER_FAILURES and pol in ("any", "order-only"):
        assert v.code == EXIT_MISMATCH
    # a finding the policy does not fail on is named as tolerated, never silently dropped
    if hv == "hash_mismatch" and pol == "order-only":
        assert any("hash mismatch" in t for t in v.tolerated)
    if ov in policy.ORDER_FAILURES and pol == "hash":
        assert any("bucket" in t for t in v.tolerated)
    if v.code == EXIT_OK:
        assert not incomplete and (hv == "match" or pol == "order-only")


def test_status_vocabulary():
    assert policy.status("hash_mismatch", "order_differs") == "hash_mismatch"
    assert policy.status("match", "partition_differs") == "order_mismatch"
    assert policy.status("match", "unavailable") == "match"
    assert policy.status("incomplete", "identical") == "incomplete"


def test_unknown_policy_is_a_usage_error():
    with pytest.raises(ParityError) as e:
        policy.check("order")
    assert e.value.exit_code == EXIT_USAGE and "order-only" in str(e.value)
    assert EXIT_INCOMPLETE == policy.pair_code("match", "unavailable", False, "any")
    assert EXIT_OK == policy.pair_code("match", "unavailable", False, "hash")


def test_layouts_not_compared_because_one_side_issued_no_bucketed_collective_say_so():
    """A one-rank compiled job issues no collective: its layouts cannot be compared with eager
    FSDP2's reduce-scatters, and the verdict says that, not 'no manifests'."""
    from parity.policy import judge_pair

    d = {"verdict": "match", "steps_compared": [0, 1], "ranks_compared": [0],
         "params_compared": 3, "kinds_compared": ["param"],
         "order": {"verdict": "unavailable", "compared": [],
                   "notes": ["reduce_scatter: only A recorded buckets; not compared"]}}
    line = judge_pair(d, "hash").line()
    assert "only A recorded reduce_scatter buckets, B issued none" in line
    assert "no manifests" not in line


def test_identical_layouts_still_name_the_collectives_only_one_side_recorded():
    """Reduce-scatters compared and identical while only one side recorded all-gathers (or a
    loss all-reduce only one side's graph holds): the line says 'identical' for what was
    compared and names what was not, never 'identical' alone."""
    from parity.policy import judge_pair

    d = {"verdict": "match", "steps_compared": [0, 1], "ranks_compared": [0, 1],
         "params_compared": 3, "kinds_compared": ["param", "grad"],
         "order": {"verdict": "identical", "compared": ["reduce_scatter"],
                   "notes": ["all_gather: only B recorded buckets; not compared",
                             "all_reduce: 1 all-reduce(s) of B carrying no parameter (a loss or "
                             "metric) have no such all-reduce on the other side to compare "
                             "with: not compared"]}}
    v = judge_pair(d, "hash")
    assert v.code == EXIT_OK
    line = v.line()
    assert "bucket layouts identical" in line
    assert ("not compared: bucket layouts all_gather: only B recorded buckets "
            "(+1 more in the layout notes)") in line, line
    d["order"]["notes"] = []
    assert "not compared" not in judge_pair(d, "hash").line()
