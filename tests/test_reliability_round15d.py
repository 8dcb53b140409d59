"""Round 15d: a compiled backward run once per micro-batch against eager FSDP2 (docs/
reliability.md, "Round 15d"). ``parity exec --emulate-nccl 1x2`` of parity's built-in workload
at 2 ranks, 2 steps of 2 micro-batches (tests/round15d_workload.py: its ground truth is every
step's local gradient shards): eager FSDP2 with ``set_requires_gradient_sync(False)`` on the
first micro-batch (one reduce-scatter a step), eager FSDP2 syncing at both, and SimpleFSDP
compiled (its backward graph, and its reduce-scatters, run once per micro-batch).

Was: a graph's bucket lines are written once, so the compiled job read as reducing once a
step: against the sync-on-the-last job (gradients differ) "bucket layouts identical" and
``--at 8x8`` "same sums predicted" (emulated: "12 NOT predicted"); against the sync-at-every
job (bitwise identical) "a gradient reduced by a different number of collectives (2 in A, 1
in B)" and ``--at 8x8`` FAILED. Now capture writes the backward graph's reduce-scatter lines
again with ``passes`` (capture/sources/graph_runs.py) and the diff counts them.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from parity.capture import patches
from parity.capture.sources.graph_runs import BackwardPasses, reaches_compiled
from parity.capture.sources.manifest_source import GraphRecord
from parity.diff.buckets import explain_eager, graph_passes, select_layout
from parity.errors import EXIT_MISMATCH, EXIT_OK
from parity.records import BucketEntry, BucketRecord
from tests.real_jobs import diff_cli, run_ok, run_table, saved, start_trainer

HERE = Path(__file__).resolve().parent
WORKLOAD = str(HERE / "round15d_workload.py")
SCHEMA = json.loads((HERE.parent / "parity" / "schemas" / "diff.schema.json").read_text())
ARGS = ["--layers", "1", "--dim", "32", "--heads", "2", "--vocab-size", "64", "--seq-len", "8",
        "--batch-size", "2", "--steps", "2", "--micro-batches", "2"]
JOBS = {  # run_table's knobs: here the workload's arguments
    "last": {"args": ["--mode", "eager"]},  # set_requires_gradient_sync(False) on the first
    "every": {"args": ["--mode", "eager", "--sync", "every"]},
    "compiled": {"args": ["--mode", "compiled", "--bucket-order", "registration"]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round15d")
    return run_table(JOBS, lambda name, knobs: (root / name, start_trainer(
        root / name, "R15D_", {}, [WORKLOAD, *ARGS, *knobs["args"]],
        exec_args=("--emulate-nccl", "1x2"))), at_once=3)


def _grads_equal(runs, a: str, b: str) -> bool:
    ta = [saved(f"{run_ok(runs, a)}.truth", r)["grads"] for r in (0, 1)]
    tb = [saved(f"{run_ok(runs, b)}.truth", r)["grads"] for r in (0, 1)]
    return all(torch.equal(x, y) for ra, rb in zip(ta, tb) for sa, sb in zip(ra, rb)
               for x, y in zip(sa, sb))


def _diff(runs, a: str, b: str, *extra):
    rc, line, js = diff_cli(run_ok(runs, a), run_ok(runs, b), *extra)
    jsonschema.validate(js, SCHEMA)
    return rc, line, js


# ------------------------------------------------------------------ real jobs (one fixture)

@pytest.mark.parametrize("a,b,per_step", [("last", "compiled", "1 in A, 2 in B"),
                                          ("compiled", "last", "2 in A, 1 in B")])
def test_compiled_per_micro_batch_against_eager_sync_on_the_last(runs, a, b, per_step):
    """Ground truth: every gradient differs from step 1 (emulated NCCL at 1x2). Was: "bucket
    layouts identical", ``--at 8x8`` "same sums predicted", emulated "12 NOT predicted"."""
    assert not _grads_equal(runs, a, b)
    rc, line, js = _diff(runs, a, b)
    assert rc == EXIT_MISMATCH and "(loss equal, gradients differ)" in line
    assert "a gradient reduced by a different number of collectives (" in line
    assert per_step + " per step; 12 gradients)" in line
    why = js["first_divergence"]["explanation"]
    assert "2 reduce-scatters per step in" in why and "(graph bucket 0: one per micro-batch" in why
    assert "a compiled backward reduce-scatters at every micro-batch" in why
    rc, line, _ = _diff(runs, a, b, "--fail-on", "reduction", "--at", "8x8")
    assert rc == EXIT_MISMATCH and "same sums predicted" not in line
    assert "12 parameters at risk (12 by another number of collectives)" in line
    rc, line, _ = _diff(runs, a, b, "--fail-on", "reduction", "--at", "1x2")
    assert "emulated at 1x2: 12 gradient(s) diverged at step 1, every one predicted" in line


def test_compiled_per_micro_batch_against_eager_sync_at_every_holds(runs):
    """Ground truth: bitwise equal gradients (both reduce each micro-batch's). Was: HOLDS but
    "a gradient reduced by a different number of collectives (2 in A, 1 in B)", and ``--at
    8x8`` FAILED "12 parameters at risk"."""
    assert _grads_equal(runs, "every", "compiled")
    rc, line, _ = _diff(runs, "every", "compiled")
    assert rc == EXIT_OK and "different number of collectives" not in line
    assert "bucket layouts identical" in line
    rc, line, _ = _diff(runs, "every", "compiled", "--fail-on", "reduction", "--at", "8x8")
    assert rc == EXIT_OK and "same sums predicted" in line


# ------------------------------------------------------------------ pure logic, no job

def _graph_rs(fqns, index, graph_id=0, **extra):
    return {"source": "graph", "collective": "reduce_scatter", "step": 1, "index": index,
            "graph": "backward", "graph_id": graph_id, "group": "g", "dtype": "float32",
            "total_bytes": 4 * len(fqns), **extra,
            "entries": [{"fqn": f, "offset": 4 * i, "size": 4, "numel": 1, "dtype": "float32",
                         "shape": [1]} for i, f in enumerate(fqns)]}


def test_graph_passes_count_each_graph_reduce_scatter_per_step():
    """A graph's lines written again with ``passes`` multiply its gradients' count; another
    graph without them stays at one; junk values are ignored."""
    recs = [_graph_rs(["a", "b"], 0), _graph_rs(["c"], 0, graph_id=1),
            _graph_rs(["a", "b"], 0, passes=2), _graph_rs(["a", "b"], 0, passes=3),
            _graph_rs(["c"], 0, graph_id=1, passes=True)]
    assert graph_passes(recs) == {0: 3}
    lay = select_layout(recs, ("graph",), 0)
    assert lay.repeats == {("reduce_scatter", "a"): 3, ("reduce_scatter", "b"): 3}
    assert lay.graph_passes == 3 and [b.fqns for b in lay.buckets["reduce_scatter"]] == [
        ["a", "b"], ["c"]]
    once = select_layout([_graph_rs(["a", "b"], 0)], ("graph",), 0)
    assert once.repeats == {} and once.graph_passes == 1
    line = explain_eager("a", "1", once, lay, [], [])
    assert "one reduce-scatter in A (graph bucket 0" in line
    assert "3 reduce-scatters per step in B (graph bucket 0: one per micro-batch" in line


def test_backward_passes_write_a_graph_again_once_per_larger_count():
    """Lines again at the 2nd and 3rd backward of a step, not again for a step of as many;
    forward graphs, graphs before their passes and all-gathers are not kept."""
    out: list[GraphRecord] = []
    bp = BackwardPasses(out.append)
    rs = BucketRecord("graph", "reduce_scatter", 0,
                      [BucketEntry("w", 0, 4, 1, "float32")], graph="backward", graph_id=7)
    ag = BucketRecord("graph", "all_gather", 0, [BucketEntry("w", 0, 4, 1, "float32")],
                      graph="backward", graph_id=7)
    bp.keep(GraphRecord("forward", 6, [rs]))
    bp.keep(GraphRecord("backward", 8, [rs], stage="before_passes"))
    bp.on_backward()  # the first backward compiles the graph: counted without a walk
    bp.keep(GraphRecord("backward", 7, [rs, ag]))
    patches.BACKWARD_OF[0] = torch.ones(1, requires_grad=True) * 2  # reaches no compiled graph
    bp.on_backward()
    patches.BACKWARD_OF[0] = _Compiled()
    try:
        for _ in range(2):
            bp.on_backward()
        bp.new_step()
        for _ in range(3):
            bp.on_backward()
    finally:
        patches.BACKWARD_OF[0] = None
    assert [(r.graph_id, [b.extra["passes"] for b in r.buckets], [b.collective for b in
                                                                 r.buckets]) for r in out] == [
        (7, [2], ["reduce_scatter"]), (7, [3], ["reduce_scatter"])]
    assert "passes" not in rs.extra and out[0].buckets[0].to_dict()["passes"] == 2


class CompiledFunctionBackward:  # named as aot_autograd's node
    next_functions = ()


class _Compiled:
    """A loss whose autograd graph holds a compiled function."""
    grad_fn = CompiledFunctionBackward()


def test_reaches_compiled_walks_the_autograd_graph():
    """A chunk's loss (no compiled function behind it) is not a backward pass of the graph; a
    graph past the cap counts (not known)."""
    x = torch.ones(3, requires_grad=True)
    assert not reaches_compiled((x * 2).sum()) and not reaches_compiled(None)
    assert reaches_compiled([(x * 2).sum(), _Compiled()])
    deep = x
    for _ in range(5):
        deep = deep * 2
    assert reaches_compiled(deep.sum(), cap=3) and not reaches_compiled(deep.sum())
