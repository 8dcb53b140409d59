"""The diff's shortcuts for speed (issue 23 item 5, issue 20 item 6) give the results of the
paths they skip: shared parses, identity caches, buckets not derived because equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.artifacts import read_run
from parity.diff import diff_runs
from parity.diff.buckets import A_PREFERS, B_PREFERS, compare_buckets, select_layout
from parity.diff.hashes import Aligner, ParamIndex
from parity.diff.reduction import predict, shapes_of
from tests.synth import make_run

ROOT = Path(__file__).resolve().parents[1]
TOPO = "32x8:channels=16"  # small synthetic tensors: rings differ only here


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shortcuts")
    common = {"world_size": 4, "steps": 2, "n_params": 24}
    a = make_run(tmp / "a", **common)
    b = make_run(tmp / "b", **common, bucket_layout="graph", bucket_order="reversed-rs")
    return a, b


def test_bucket_lines_parsed_once_give_the_same_layouts_and_fresh_buckets(pair):
    a, _ = pair
    recs = read_run(a).ranks[0].buckets
    memo: dict = {}
    plain = select_layout(recs, A_PREFERS, 0)
    first = select_layout(recs, A_PREFERS, 0, memo)
    again = select_layout(recs, B_PREFERS, 0, memo)  # served from the memo
    assert memo and first.signature() == plain.signature() == again.signature()
    b1 = [b for bs in first.buckets.values() for b in bs]
    b2 = [b for bs in again.buckets.values() for b in bs]
    assert b1 and all(x is not y and x.entries is not y.entries for x, y in zip(b1, b2))


def test_alignment_by_identity_equals_alignment_by_value():
    keys = tuple(f"p{i}" for i in range(5))
    other = tuple(reversed(keys))
    al = Aligner(ParamIndex())
    x = al.align(keys, other)
    y = al.align(tuple(list(keys)), tuple(list(other)))  # equal, distinct objects
    assert x is y and al.align(keys, other) is x
    assert list(x.ia) == [0, 1, 2, 3, 4] and list(x.ib) == [4, 3, 2, 1, 0]


def test_prediction_of_equal_layouts_skips_nothing_it_must_check(pair):
    a, b = pair
    same = diff_runs(a, a, at=TOPO).reduction_order
    assert same.verdict == "same" and same.params_checked == 0 and not same.unpredicted
    run_a, run_b = read_run(a), read_run(b)
    usable = {"a": sorted(run_a.ranks), "b": sorted(run_b.ranks)}
    layouts, order = compare_buckets(run_a, run_b, usable, usable["a"])
    pred = predict(layouts, shapes_of(run_a.ranks[0].params), TOPO, 4, order.eager)
    got = diff_runs(a, b, at=TOPO).reduction_order
    assert got.params_checked == pred.params_checked > 0 and got.verdict == "differs"
    assert [x.to_dict() for x in got.at_risk] == [x.to_dict() for x in pred.at_risk]


def test_at_risk_order_does_not_depend_on_the_string_hash_seed(pair, tmp_path):
    a, b = pair
    code = ("import json,sys; from parity.diff import diff_runs; "
            f"r = diff_runs({str(a)!r}, {str(b)!r}, at={TOPO!r}).reduction_order; "
            "print(json.dumps([x.fqn for x in r.at_risk]))")
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        outs.append(json.loads(out))
    assert outs[0] == outs[1] and len(outs[0]) > 1
