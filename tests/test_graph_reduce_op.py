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


def test_twins_but_for_the_op_are_predicted_with_each_sides_op():
    """Identical layouts, A eager FSDP2 (AVG, by rule), B a graph recording SUM (torchtitan's
    SimpleFSDP: ``Partial(reduce_op="sum")``). They were skipped as the same bucket; on one
    NVSwitch node B's SUM may run NVLS where A's PreMulSum cannot, so the answer is unknown,
    and with Ring pinned the same sums, with the op difference said under assumptions."""
    from test_reduction import SHAPES, _layouts

    from parity.diff.reduction import predict

    order = [["p0", "p1"], ["s0", "s1"]]
    one = "1x4:channels=4"
    same_op = predict(_layouts(order, order, SHAPES, b_op="avg"), SHAPES, one, capture_world=4)
    assert same_op.verdict == "same" and not same_op.to_dict()["assumptions"]
    got = predict(_layouts(order, order, SHAPES, b_op="sum"), SHAPES, one, capture_world=4)
    assert got.verdict == "unknown" and "NVLS" in got.unknown[0]["reason"], got.to_dict()
    ring = predict(_layouts(order, order, SHAPES, b_op="sum"), SHAPES, one + ",algo=Ring",
                   capture_world=4)
    assert ring.verdict == "same", ring.to_dict()
    said = " ".join(ring.to_dict()["assumptions"])
    assert "(avg in A, sum in B)" in said and "powers of two" in said
    assert sum("alike but for the reduce op" in x for x in ring.to_dict()["assumptions"]) == 1


def _scaled(order, op, scale=None):
    from test_reduction import SHAPES, _layouts

    lays = _layouts(order, order, SHAPES, b_op=op)
    for b in lays["b"].buckets["reduce_scatter"]:
        b.op_scale = scale
    return lays


@pytest.mark.parametrize("op, scale, at, want", [
    ("sum", None, "1x4", "same"),  # 1/4 and 1: powers of two, exact on both sides
    ("sum", None, "3x8", "differs"),  # 1/24 rounds, a SUM divided elsewhere rounds elsewhere
    ("sum", None, "1x3", "differs"),
    ("avg", None, "3x8", "same"),  # the same op: the same factor
    ("premul_sum", 1.0, "3x8", "differs"),  # torchtitan's factor 1.0 against FSDP2's AVG
    ("premul_sum", 1 / 24, "3x8", "same"),  # a PREMUL_SUM of 1/24 is what AVG applies
    ("premul_sum", None, "3x8", "unknown"),  # its factor not recorded
])
def test_the_ops_scaling_at_the_group_size(op, scale, at, want):
    """A's eager FSDP2 AVG (NCCL: every payload times 1/g before the sum, hostToDevRedOp)
    against B's op, the same layout and Ring: the summation order is the same, but at a group
    size that is not a power of two the factors round differently (why: scaling), which the
    prediction said was the same sums."""
    from test_reduction import SHAPES

    from parity.diff.reduction import predict

    order = [["p0", "p1"], ["s0", "s1"]]
    got = predict(_scaled(order, op, scale), SHAPES, at + ":algo=Ring", capture_world=4)
    assert got.verdict == want, got.to_dict()
    whys = {x["why"] for x in got.to_dict()["at_risk"]}
    assert whys == ({"scaling"} if want == "differs" else set())
    if want == "differs":  # the verdict line says why identical layouts are at risk
        from parity.consequences import reduction_phrase

        assert "by the reduce op's scaling" in reduction_phrase(got.to_dict())
    if want == "unknown":
        assert "premul_sum factor not recorded" in got.unpredicted[0]["reason"]


def test_a_premul_sum_records_its_factor(tmp_path):
    """FSDP2 under ``set_gradient_divide_factor(f)`` reduce-scatters with PREMUL_SUM(1/f): the
    record carries ``op_scale`` and the diff reads it."""
    recs = _records("premul_sum")
    recs[0]["op_scale"] = 0.5
    lay = select_layout(recs, (SOURCE_GRAPH,), 0)
    annotate_buckets(lay, recs)
    (b,) = lay.buckets["reduce_scatter"]
    assert b.op_scale == 0.5


class _Group:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize("dtype, factor, force, hsdp, want", [
    (torch.float32, None, False, None, "avg"),  # FSDP2's default on 4 ranks
    (torch.bfloat16, 1.0, False, None, "premul_sum"),  # torchtitan's divide factor 1.0
    (torch.float32, 4.0, False, None, "avg"),  # a factor equal to the group size
    (torch.float16, None, False, None, "sum"),  # overflow risk: pre/post divide, SUM
    (torch.float32, None, True, None, "sum"),  # forced sum (symmetric memory)
    (torch.float32, None, False, 2, "avg"),  # HSDP
])
def test_fsdp2_records_the_op_its_own_rule_gives(dtype, factor, force, hsdp, want):
    """The eager FSDP2 source asks FSDP2's ``_get_gradient_divide_factors`` with the call's
    arguments (no collective, no state): the op the job reduce-scatters with, not a guess."""
    from parity.capture.sources.fsdp2 import FSDP2Recorder, _op_rule
    from parity.capture.sources.manifest_source import SourceHooks

    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401

    def nothing(*a, **k):
        return None

    src = FSDP2Recorder(SourceHooks(nothing, nothing, nothing, lambda: 0, nothing, nothing,
                                  nothing))
    src._rule = _op_rule()
    assert src._rule is not None
    args = {"gradient_divide_factor": factor, "all_reduce_group": hsdp and _Group(hsdp),
            "device": torch.device("cpu"), "force_sum_reduction_for_comms": force}
    got = src._reduce_op(_Group(4), dtype, lambda: args)
    assert got == (want, 1.0 / factor if want == "premul_sum" else None)
    assert src._reduce_op(_Group(4), dtype, None) is None  # arguments not readable: not known


def test_every_source_spells_a_reduce_op_alike():
    """One spelling for the record's ``op`` (records.reduce_op_name): the c10d all-reduce source
    named a PREMUL_SUM object ``other`` (its str() is an object address) while FSDP2's source
    named it ``premul_sum``; the reduction model knows ``premul_sum`` (PreMulSum: no PAT, no
    NVLS) and not ``other``."""
    import torch.distributed as dist

    from parity.records import reduce_op_name

    assert reduce_op_name(dist.ReduceOp.SUM) == "sum"
    assert reduce_op_name(dist.ReduceOp.AVG) == "avg"
    assert reduce_op_name(dist.ReduceOp.RedOpType.MAX) == "max"
    assert reduce_op_name(dist._make_nccl_premul_sum(0.5)) == "premul_sum"
    assert reduce_op_name(object()) == "other"
    from parity.capture.sources import c10d_allreduce, fsdp2

    assert c10d_allreduce.reduce_op_name is reduce_op_name  # both sources write this spelling
    assert fsdp2.reduce_op_name is reduce_op_name
