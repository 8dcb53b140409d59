"""Reduction-order prediction (parity/diff/reduction.py) and consequence classes
(parity/consequences.py) on hand-built layouts: pure logic, checked against cases derived by
hand from the NCCL Ring model (parity/nccl)."""

import pytest

from parity import consequences as cq
from parity.diff.buckets import Bucket, Entry, Layout
from parity.diff.reduction import derive_layout, predict
from parity.nccl import parse_topology, reduce_scatter_segments, same_sum, sum_order


def _bucket(index, fqns, shapes, world, dtype="float32", esize=4):
    entries, off = [], 0
    for f in fqns:
        dim0, row = shapes[f][0], (shapes[f][1] if len(shapes[f]) > 1 else 1)
        n = -(-dim0 // world) * row
        entries.append(Entry(f, off * esize, n * esize, n, dtype))
        off += n
    return Bucket("reduce_scatter", index, "g", dtype, off * esize, entries)


def _layouts(a_order, b_order, shapes, world=4):
    la = Layout("fsdp2", 0, {"all_gather": [], "reduce_scatter": [
        _bucket(i, fq, shapes, world) for i, fq in enumerate(a_order)]})
    lb = Layout("graph", 0, {"all_gather": [], "reduce_scatter": [
        _bucket(i, fq, shapes, world) for i, fq in enumerate(b_order)]})
    return {"a": la, "b": lb}


SHAPES = {"p0": [98304, 1], "p1": [32768, 1], "s0": [8, 4], "s1": [8, 4]}  # 512 KiB: 4 channels


def _brute(layouts, shapes, topo):
    """Elements at risk per parameter, element by element (the definition)."""
    out = {}
    W = topo.world
    per_side = {}
    for side in ("a", "b"):
        m = {}
        for b in layouts[side].buckets["reduce_scatter"]:
            slots, count, esize = derive_layout(b, shapes, W)
            segs = reduce_scatter_segments(topo, count, esize)
            for s in slots:
                m[s.fqn] = (s, segs)
        per_side[side] = m
    for f in per_side["a"]:
        (sa, ga), (sb, gb) = per_side["a"][f], per_side["b"][f]
        n = 0
        for d in range(W):
            real = max(0, min(sa.rows, sa.dim0 - d * sa.rows)) * sa.row
            for i in range(real):
                ra = next(g.order for g in ga if g.lo <= sa.offset + i < g.hi)
                rb = next(g.order for g in gb if g.lo <= sb.offset + i < g.hi)
                n += not same_sum(sum_order(ra, d), sum_order(rb, d))
        if n:
            out[f] = n
    return out


def test_swapping_payloads_across_channels_puts_them_at_risk_across_nodes_only():
    lay = _layouts([["p0", "p1"]], [["p1", "p0"]], SHAPES)
    multi = predict(lay, SHAPES, "2x2:channels=4", capture_world=4)
    assert multi.verdict == "differs"
    assert {x.fqn: x.elements for x in multi.at_risk} == _brute(lay, SHAPES, multi.topology)
    assert multi.fqns() == {"p0", "p1"}
    one = predict(lay, SHAPES, "1x4:channels=4", capture_world=4)
    assert one.verdict == "same" and not one.at_risk  # one node: every channel, one ring


def test_a_swap_inside_one_channel_predicts_nothing():
    lay = _layouts([["s0", "s1"]], [["s1", "s0"]], SHAPES)
    p = predict(lay, SHAPES, "8x8:channels=16", capture_world=4)
    assert p.verdict == "same" and p.params_checked == 2


@pytest.mark.parametrize("topo", ["2x2:channels=4", "4x2:channels=3", "2x4", "3x2:channels=2"])
def test_vectorized_count_equals_the_element_by_element_definition(topo):
    shapes = {"p0": [4100, 3], "p1": [1000, 7], "s0": [9, 4], "p2": [3333, 2]}
    lay = _layouts([["p0", "s0", "p1", "p2"]], [["p2", "p1", "s0", "p0"]], shapes)
    p = predict(lay, shapes, topo, capture_world=4)
    assert {x.fqn: x.elements for x in p.at_risk} == _brute(lay, shapes, p.topology)


def test_structure_and_unpredicted():
    shapes = dict(SHAPES)
    lay = _layouts([["p0", "p1"]], [["p1"]], shapes)  # p0 reduced by no bucket on B
    p = predict(lay, shapes, "2x2:channels=4", capture_world=4)
    risk = {x.fqn: x for x in p.at_risk}
    assert risk["p0"].why == "structure" and risk["p0"].fraction == 1.0
    # a recorded layout the model does not reproduce is said, never guessed
    lay = _layouts([["p0", "p1"]], [["p1", "p0"]], shapes)
    lay["b"].buckets["reduce_scatter"][0].entries[1] = Entry("p0", 4, 4096, 1024, "float32")
    p = predict(lay, shapes, "2x2:channels=4", capture_world=4)
    assert p.verdict == "unknown" and "not FSDP2 dim-0 shards" in p.unpredicted[0]["reason"]
    assert p.to_dict()["verdict"] == "unknown"


def test_consequence_classes_and_lead():
    assert cq.classify("all_gather", "order_differs") == cq.COPY_ONLY
    assert cq.classify("reduce_scatter", "layout_differs") == cq.REDUCTION_ORDER
    assert cq.classify("reduce_scatter", "partition_differs", True) == cq.REDUCTION_STRUCTURE
    assert cq.classify("reduce_scatter", "identical") is None
    keys = sorted([(cq.lead_key(cq.COPY_ONLY, "order_differs", 0), "ag"),
                   (cq.lead_key(cq.REDUCTION_ORDER, "layout_differs", 5), "rs-layout"),
                   (cq.lead_key(cq.REDUCTION_ORDER, "order_differs", 3), "rs")])
    assert [k[1] for k in keys] == ["rs", "rs-layout", "ag"]
    assert "values unchanged" in cq.counts_phrase({cq.COPY_ONLY: 1})


# NCCL log reading: tests/test_nccl_log.py

# ------------------------------------------------------------------------- the policy


def _d(order_verdict, consequences, ro=None, verdict="match"):
    return {"verdict": verdict, "incomplete": [], "kinds_compared": ["param"], "loss": {},
            "steps_compared": [0], "ranks_compared": [0], "params_compared": 1,
            "order": {"verdict": order_verdict, "consequences": consequences,
                      "first_bucket": {"collective": "all_gather", "index": 0, "position": 0,
                                       "consequence": "copy_only"}},
            "reduction_order": ro}


def test_policy_reduction():
    from parity import policy

    copy = _d("order_differs", {"copy_only": 1})
    v = policy.judge_pair(copy, "reduction")
    assert v.code == 0 and "values unchanged" in v.line() and "tolerated" in v.line()
    assert policy.judge_pair(copy, "any").code == 1
    red = _d("order_differs", {"reduction_order": 2, "copy_only": 1})
    assert policy.judge_pair(red, "reduction").code == 1
    assert policy.judge_pair(red, "hash").code == 0
    topo = {"spec": "8x8"}
    same = _d("order_differs", {"reduction_order": 2}, {"verdict": "same", "topology": topo,
                                                        "model": "m", "at_risk": []})
    v = policy.judge_pair(same, "reduction")
    assert v.code == 0 and "same sums predicted" in v.line()
    risky = _d("order_differs", {"reduction_order": 2}, {
        "verdict": "differs", "topology": topo, "model": "m",
        "at_risk": [{"fqn": "w", "elements": 10, "fraction": 0.5, "bucket": {}}]})
    v = policy.judge_pair(risky, "reduction")
    assert v.code == 1 and "10 elements of 1 parameter at risk" in v.line()
    unknown = _d("order_differs", {"reduction_order": 1}, {"verdict": "unknown", "topology": topo,
                                                           "model": "m", "at_risk": []})
    assert policy.judge_pair(unknown, "reduction").code == 3
    old = _d("order_differs", None)  # a diff written before consequence classes
    assert policy.judge_pair(old, "reduction").code == 1
    assert policy.judge_pair(_d("order_differs", {"copy_only": 1}, verdict="hash_mismatch"),
                             "reduction").code == 1
    assert policy.judge_pair(_d("unavailable", {}), "reduction").code == 3


# ------------------------------------------------------------------ reports and the sweep key


def test_html_draws_every_differing_bucket_reductions_first(tmp_path):
    from tests.synth import make_run

    from parity.diff import diff_runs
    from parity.report.html import render_diff_html

    a = make_run(tmp_path / "a", world_size=2, steps=1, n_params=8)
    b = make_run(tmp_path / "b", world_size=2, steps=1, n_params=8, bucket_order="reversed")
    d = diff_runs(a, b, at="2x2:channels=4").to_dict()
    page = render_diff_html(d, "reduction")
    heads = [x.split("</h3>")[0] for x in page.split("<h3>")[1:]]
    colls = [h.split(" bucket")[0] for h in heads if " bucket " in h]
    assert colls.count("reduce_scatter") == 2 and colls.count("all_gather") == 2
    assert colls.index("all_gather") > max(i for i, c in enumerate(colls) if c == "reduce_scatter")
    assert "values unchanged" in page and "Reduction order at 2x2:channels=4" in page


def test_sweep_spec_at():
    from parity.errors import ParityError
    from parity.sweep.spec import parse_spec

    base = ('name = "x"\n[axes.mode]\nvalues = ["a"]\n[reference]\nargv = ["echo"]\n'
            '[candidate]\nargv = ["echo"]\n')
    assert parse_spec(base).at is None
    assert parse_spec('at = "8x8"\n' + base).at == "8x8"
    with pytest.raises(ParityError) as e:
        parse_spec('at = "8by8"\n' + base)
    assert "at: topology" in str(e.value) and e.value.exit_code == 2


def test_a_gradient_reduced_by_more_collectives_is_reduction_structure():
    from parity.diff.buckets import compare_layouts
    from parity.diff.reduction import annotate

    lay = _layouts([["p0", "p1"]], [["p1"], ["p0"]], SHAPES)
    lay["b"].repeats[("reduce_scatter", "p0")] = 8  # a chunked loss: 8 reduce-scatters of p0
    order = compare_layouts(lay["a"], lay["b"])
    annotate(order, lay, SHAPES)
    assert order.structure == [{"fqn": "p0", "a": 1, "b": 8}]
    assert order.consequences == {"reduction_structure": 1}
    assert order.first_bucket["consequence"] == "reduction_structure"
    p = predict(lay, SHAPES, "1x4", capture_world=4)  # even on one node: summed differently
    assert {x.fqn: x.why for x in p.at_risk} == {"p0": "structure"}


def test_a_sweep_cell_is_diffed_at_the_spec_topology(tmp_path):
    from tests.synth import make_run

    from parity import policy
    from parity.sweep.results import compare_cell

    a = make_run(tmp_path / "a", world_size=2, steps=1, n_params=8)
    b = make_run(tmp_path / "b", world_size=2, steps=1, n_params=8, bucket_layout="graph",
                 bucket_order="reversed-rs")
    status, reason, d = compare_cell(a, b, tmp_path / "diff.json", tmp_path, at="1x2")
    assert status == "order_mismatch" and d["reduction_order"]["verdict"] == "same"
    assert "reduction order at 1x2" in reason and "sums may change" in reason

    class Cell:  # what policy.cell_code reads of a sweep cell
        status, diff = "order_mismatch", d
    assert policy.cell_code(Cell, "reduction") == 0 and policy.cell_code(Cell, "any") == 1
    Cell.diff = {**d, "reduction_order": None}
    assert policy.cell_code(Cell, "reduction") == 1


@pytest.mark.parametrize("topo", ["2x2:channels=4", "4x2:channels=3", "8x8:channels=16"])
def test_vectorized_count_across_several_buckets_equals_the_definition(topo):
    """The count lays every bucket of a side end to end on one axis: payloads moved between
    buckets of different sizes (different channel splits) and a bucket the same on both sides
    (skipped, predicts nothing) give the element-by-element count."""
    shapes = {"p0": [4100, 3], "p1": [1000, 7], "s0": [9, 4], "p2": [3333, 2], "q0": [2048, 5],
              "q1": [77, 3]}
    lay = _layouts([["p0", "s0"], ["p1", "p2"], ["q0", "q1"]],
                   [["p2"], ["p1", "s0", "p0"], ["q0", "q1"]], shapes)
    p = predict(lay, shapes, topo, capture_world=4)
    assert {x.fqn: x.elements for x in p.at_risk} == _brute(lay, shapes, p.topology)
    assert "q0" not in p.fqns() and p.params_checked == 4


def test_assess_reads_b_shapes_only_where_its_table_is_not_a_s(tmp_path):
    """Equal parameter tables (same digest) are decoded once; the prediction is the one made
    with both tables decoded."""
    from parity.artifacts import read_run
    from parity.diff.buckets import compare_buckets
    from parity.diff.reduction import assess
    from tests.synth import make_run

    a = make_run(tmp_path / "a", world_size=4, steps=1, n_params=18)
    b = make_run(tmp_path / "b", world_size=4, steps=1, n_params=18, bucket_layout="graph",
                 bucket_order="reversed-rs")

    def run(force_decode):
        ra, rb = read_run(a), read_run(b)
        ranks = sorted(ra.ranks)
        if force_decode:
            for rd in rb.ranks.values():
                rd.table.digest = "not A's"
        layouts, order = compare_buckets(ra, rb, {"a": ranks, "b": ranks}, ranks)
        pred = assess(ra, rb, ranks, layouts, order, 4, "32x8:channels=16")
        return pred.to_dict(), rb.ranks[layouts["b"].rank].table.rows is None

    fast, b_undecoded = run(False)
    slow, b_undecoded_slow = run(True)
    assert fast == slow and fast["verdict"] == "differs" and fast["params_checked"] == 18
    assert b_undecoded and not b_undecoded_slow
