"""A compiled graph's reduce-scatter op in its manifest, and the reduction model reading it.

Why: the op decides which of NCCL's algorithms may run a reduce-scatter (AVG on floats is
PreMulSum, which neither PAT nor NVLS takes: parity/nccl/api.py). Until 2026-11-27 a graph's
reduce-scatter lines had no ``op`` and the model counted it as a SUM, so on one NVSwitch node the
built-in workload's graph-order pair read ``unknown`` (NVLS may run a SUM) where both sides in
fact reduce with AVG (SimpleFSDP's ``Partial("avg")``, eager FSDP2's divide factors) and run
Ring: the same sums. Graphs are made by torch itself on CPU with a fake process group; the
real-job side is in tests/test_reduction_real.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from parity.capture.sources.graph_walk import extract_buckets  # noqa: E402
from parity.diff.buckets import select_layout  # noqa: E402
from parity.diff.reduction_steps import annotate_buckets, op_of  # noqa: E402
from parity.records import SOURCE_GRAPH  # noqa: E402
from test_graph_subgraphs import group  # noqa: F401,E402 - the fake process group fixture

RS = torch.ops._c10d_functional.reduce_scatter_tensor
RS_COALESCED = torch.ops._c10d_functional.reduce_scatter_tensor_coalesced
WAIT = torch.ops._c10d_functional.wait_tensor
FQNS = ["w.a", "w.b"]


def _graph(group_name: str, op: str, coalesced: bool):
    """A backward graph reducing two weight gradients with ``op``: one bucket (``cat`` of the
    two, as torch's bucketing pass packs it) or one coalesced call."""

    def bwd(x, dy):
        ga, gb = x.t() @ dy, (x.t() @ dy) * 2
        if coalesced:
            outs = [WAIT(o) for o in RS_COALESCED([ga, gb], op, 2, group_name)]
            return outs
        flat = torch.cat([ga.reshape(2, -1), gb.reshape(2, -1)], dim=1)
        out = WAIT(RS(flat, op, 2, group_name))
        a, b = out.split([ga.numel() // 2, gb.numel() // 2], dim=1)
        return [a.reshape(ga.shape[0] // 2, -1), b.reshape(gb.shape[0] // 2, -1)]

    return make_fx(bwd, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 6))


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_a_graph_reduce_scatter_records_its_op(group, op, coalesced):  # noqa: F811
    gm = _graph(group, op, coalesced)
    warnings: list[str] = []
    recs = [b.to_dict() for b in extract_buckets(gm, [None, None], FQNS, "backward",
                                                 warnings=warnings)]
    rs = [r for r in recs if r["collective"] == "reduce_scatter"]
    assert rs and all(r["op"] == op for r in rs), rs
    assert all(r["world_size"] == 2 for r in rs)


def _records(op: str | None) -> list[dict]:
    entry = {"fqn": "w.a", "offset": 0, "size": 96, "numel": 24, "dtype": "float32",
             "shape": [4, 6]}
    r = {"v": 2, "source": SOURCE_GRAPH, "collective": "reduce_scatter", "graph": "backward",
         "graph_id": 0, "step": 1, "index": 0, "group": "w", "node": "reduce_scatter_tensor",
         "dtype": "float32", "world_size": 2, "total_bytes": 96, "entries": [entry]}
    if op is not None:
        r["op"] = op
    return [r]


@pytest.mark.parametrize("op", ["avg", "sum", "premul_sum"])
def test_the_diff_reads_a_recorded_op(op):
    recs = _records(op)
    lay = select_layout(recs, (SOURCE_GRAPH,), 0)
    annotate_buckets(lay, recs)
    (b,) = lay.buckets["reduce_scatter"]
    assert op_of(b) == op and not getattr(b, "op_guessed", False)


def test_a_graph_recorded_without_an_op_counts_as_a_sum_and_says_so():
    """Runs recorded before the op was written: a SUM, marked as a guess (the reduction
    model's reason then says the op was not recorded)."""
    recs = _records(None)
    lay = select_layout(recs, (SOURCE_GRAPH,), 0)
    annotate_buckets(lay, recs)
    (b,) = lay.buckets["reduce_scatter"]
    assert op_of(b) == "sum" and b.op_guessed is True
