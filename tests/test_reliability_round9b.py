"""Round 9b: compiled-graph bucket manifests against what the graph actually sends, with real
processes. tests/trainers/round9b.py (which imports nothing from parity) compiles a
SimpleFSDP-style model with its own ``aot_autograd`` backend applying torch's bucketing passes
and runs the final graph with an ``fx.Interpreter`` that saves the concrete input of every
``_c10d_functional`` collective it executes (inductor: a ``TorchDispatchMode`` entered inside
inductor's compiled forward/backward); tests/round9b_truth.py checks every ``"source":
"graph"`` manifest entry against those bytes, the parameters' local shards and their sharded
gradients, and that every executed collective is in the manifest.

Found and fixed:

- an all-gather in bfloat16 of float32 parameters (the cast before the collective), torch
  2.13's default bucket mode, aot backend and inductor alike: the pass folds the cast into the
  bucket (``copy_(slice(bf16 buffer), cat(fp32 shards))``) and parity read the entries in the
  shards' dtype: every offset and size doubled, "entries cover 1448 bytes of a 724-byte
  payload" (graph_walk.py: the copy's destination dtype);
- a tied weight (one parameter read by two modules): its two reduce-scatters meet in an ``add``
  before the gradient output, and both were recorded as ``payload: activation`` with no name,
  so the parameter's gradient was in no named entry (graph.py: every path forward searched,
  as graph_makefx.py does for make_fx graphs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import (capture_differences, diff_cli, edited_copy, first_differing,
                             graph_lines, run_ok, saved, trainer_runs, values_equal)
from tests.round9b_truth import problems

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round9b.py")
TIMEOUT = 900

CAP = {"R9_CAP": "0.0005"}  # 524 bytes: the model splits into several buckets per graph
JOBS = {  # name: trainer knobs; "plain": run without parity exec as well
    "graph": {**CAP, "plain": True},
    "graph_again": {**CAP},
    "registration": {**CAP, "R9_ORDER": "registration"},
    "mixed": {**CAP, "R9_PDTYPE": "bf16", "R9_RDTYPE": "bf16", "R9_PAD": "1",
              "R9_REPLICATE": "1"},  # biases replicated: their gradients all-reduced, bucketed
    "shapes": {"R9_TIED": "1", "R9_UNUSED": "1", "R9_FROZEN": "1", "R9_REDUCE": "sum",
               "R9_PASS": "plain", "R9_ACT": "1"},  # + an activation gathered, one all-reduced
    "four": {"R9_PAD": "1", "R9_PASS": "manual", "R9_ORDER": "registration",
             "R9_REPLICATE": "1", "nproc": 4},
    "inductor": {**CAP, "R9_BACKEND": "inductor", "R9_TDM": "inner", "R9_PDTYPE": "bf16",
                 "plain": True},
    # parity's own compiled workload, bf16 all-gathers bucketed by bucket_fsdp_* (default mode)
    "workload": {"entry": [str(HERE / "round9b_workload.py"), "--mode", "compiled",
                           "--bucketing", "auto", "--param-dtype", "bfloat16", "--steps", "2",
                           "--layers", "2", "--dim", "32", "--vocab-size", "64", "--seq-len", "8"]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, exit code, stderr)}; ``name.plain``: the same job without parity."""
    return trainer_runs(tmp_path_factory.mktemp("round9b"), JOBS, TRAINER, "R9_",
                        timeout=TIMEOUT)


@pytest.mark.parametrize("name", [n for n in JOBS])
def test_every_graph_manifest_entry_is_what_the_graph_sends(runs, name):
    """Each entry's bytes are its parameter's shard (all-gather, exact) or its slice reduces to
    the parameter's gradient and no other slice does (reduce-scatter); every executed collective
    is in the manifest. mixed (bf16 all-gather and reduce, padded shards) failed before the
    dtype fix: entries in float32 at doubled offsets; shapes (a tied weight, an unused and a
    frozen layer, ``sum``) before the naming fix: the tied weight's reduce-scatters marked
    ``activation``; workload (parity's own, ``--bucketing auto --param-dtype bfloat16``) before
    the dtype fix, as mixed."""
    d = run_ok(runs, name)
    found = problems(d, f"{d}.truth")
    assert not found, "\n".join(found[:10])
    assert graph_lines(d), "no graph manifest"


def test_the_check_finds_a_wrong_manifest(runs, tmp_path):
    """The ground-truth check is not vacuous: two parameters' names exchanged in one
    reduce-scatter bucket line and an all-gather offset moved, in a copy of a right run, are
    each reported."""
    d = run_ok(runs, "graph")
    for what in ("swap", "shift"):
        copy = tmp_path / what

        def edit(b, what=what):
            e = b["entries"]
            if len(e) < 2:
                return False
            if what == "swap" and b["collective"] == "reduce_scatter":
                e[0]["fqn"], e[1]["fqn"] = e[1]["fqn"], e[0]["fqn"]
                return True
            if what == "shift" and b["collective"] == "all_gather":
                e[1]["offset"] += 4
                return True
            return False

        assert edited_copy(d, copy, edit)
        found = problems(copy, f"{d}.truth")
        assert found and all(x.startswith("rank 0 ") for x in found), found


def test_payload_order_pair_fails_on_the_first_reordered_bucket(runs):
    """Graph order against FSDP2 registration order, equal values: ``--fail-on any`` fails and
    names the reduce-scatter bucket whose executed input first differs."""
    a, b = run_ok(runs, "graph"), run_ok(runs, "registration")
    assert values_equal(saved(f"{a}.truth")["grads"], saved(f"{b}.truth")["grads"])
    index = first_differing(a, b, "reduce_scatter")
    assert index is not None and first_differing(a, b, "all_gather") is None
    rc, line, d = diff_cli(a, b, "--fail-on", "any")
    assert rc == EXIT_MISMATCH and "bucket order differs (reduce_scatter bucket" in line, line
    first = d["order"]["first_bucket"]
    assert (first["collective"], first["index"]) == ("reduce_scatter", index), first


def test_identical_pair_holds(runs):
    a, b = run_ok(runs, "graph"), run_ok(runs, "graph_again")
    rc, line, _ = diff_cli(a, b, "--fail-on", "any")
    assert rc == EXIT_OK and "bucket layouts identical" in line, line


@pytest.mark.parametrize("name", ["graph", "inductor"])
def test_capture_changes_nothing(runs, name):
    """Values (every step's shards, gradients, losses, the final model, every collective's
    input), dynamo's counters and the graphs compiled (compile caches' counters aside: off
    under parity exec) are those of the run without parity."""
    d, alone = run_ok(runs, name), run_ok(runs, name + ".plain")
    assert capture_differences(d, alone) == []
