"""issue 22 item 5 (inspect figures) and item 2's report logic, as pure unit tests: HOPs count as
compute, counts around the bucketing passes, buckets matched by content across index shifts,
the verdict line naming the first bucket's own class, and bisect's wording when a side recorded
too few ops or the difference enters in a region not recorded op by op."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from parity.bisect import analyse_rank, format_report
from parity.capture.sources import graph_passes, graph_walk
from parity.diff.buckets import select_layout
from parity.policy import order_phrase


def test_higher_order_ops_are_compute():
    from torch._higher_order_ops.flex_attention import flex_attention

    g = fx.Graph()
    q = g.placeholder("q")
    node = g.call_function(flex_attention, (q, q, q, None, (), 1.0, {}, (), ()))
    assert graph_walk.op_name(node) == "higher_order::flex_attention"
    assert graph_walk.is_compute(node)


def _gm_with(n_ag: int, n_rs: int) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    for _ in range(n_ag):
        g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    for _ in range(n_rs):
        n = g.call_function(torch.ops._c10d_functional.reduce_scatter_tensor.default,
                            (x, "sum", 2, "0"))
        n.meta["autograd_backward"] = True
    g.output(x)
    return fx.GraphModule(torch.nn.Module(), g)


def test_counts_around_the_bucketing_passes_only():
    def dedup_pass(gm, example_inputs):  # removes a re-gather before bucketing
        return _gm_with(7, 8)

    def bucketing_pass(gm, example_inputs, n=3):
        return _gm_with(n, 2)

    def remat_pass(gm, example_inputs):  # re-gathers created after bucketing
        return _gm_with(5, 2)

    runs: list[dict] = []
    passes = graph_passes.wrap_passes(
        [dedup_pass, functools.partial(bucketing_pass, n=4), remat_pass], runs)
    # torchtitan names a pass by its function (a partial's .func): the wrappers keep the names
    assert [p.__name__ for p in passes] == ["dedup_pass", "bucketing_pass", "remat_pass"]
    gm = _gm_with(8, 8)
    for p in passes:
        gm = p(gm, ())
    around = graph_passes.around_bucketing(runs)
    assert around["all_gather/forward"] == {"before": 7, "after": 4, "passes": "bucketing_pass"}
    assert around["reduce_scatter/backward"]["before"] == 8
    assert around["reduce_scatter/backward"]["after"] == 2
    assert graph_passes.around_bucketing(runs[:1]) is None


def test_counts_around_a_jit_compiler_that_is_the_bucketing_pass():
    """GraphTrainer jit + aot_eager: aot_autograd's backward compiler IS torchtitan's bucketing
    pass (a partial); the counts around it are the "at bucketing" figures, phase = the graph's."""
    def transformer_block_bucketing_reordering_pass(gm, example_inputs, *, fsdp_manual_buckets):
        gm.graph.erase_node(next(n for n in gm.graph.nodes if "reduce_scatter" in str(n.target)))
        return gm

    gm = _gm_with(0, 3)
    compiler = functools.partial(transformer_block_bucketing_reordering_pass,
                                 fsdp_manual_buckets=[])
    def wrap_bw_compiler(bw_compiler_fn):  # as torch._dynamo.backends.common does
        def _wrapped_bw_compiler(*args, **kwargs):
            return bw_compiler_fn(*args, **kwargs)
        return _wrapped_bw_compiler

    around = graph_passes.AroundCompiler(wrap_bw_compiler(compiler), gm, "backward")
    compiler(gm, ())
    assert around.counts(gm) == {"reduce_scatter/backward": {
        "before": 3, "after": 2, "passes": "transformer_block_bucketing_reordering_pass"}}
    # a compiler that is not a bucketing pass (inductor's compile_fx): no figure
    assert graph_passes.AroundCompiler(lambda gm, ex: gm, gm, "backward").counts(gm) is None


def _ag(index, step, group, fqns):
    entries, off = [], 0
    for f in fqns:
        entries.append({"fqn": f, "offset": off, "size": 64, "numel": 16, "dtype": "float32"})
        off += 64
    return {"source": "fsdp2", "collective": "all_gather", "graph": "forward", "graph_id": None,
            "step": step, "index": index, "group": group, "node": None, "dtype": "float32",
            "world_size": 2, "total_bytes": off, "entries": entries}


def test_index_shift_is_no_layout_change():
    root, l0, l1 = ["norm.weight", "out.weight"], ["l0.a", "l0.b"], ["l1.a", "l1.b"]
    step1 = [_ag(0, 1, "", root), _ag(1, 1, "l0", l0), _ag(2, 1, "l1", l1)]
    # step 2: an extra gather of the root group first; every later bucket one index on
    step2 = [_ag(0, 2, "", root), _ag(1, 2, "", root), _ag(2, 2, "l0", l0), _ag(3, 2, "l1", l1)]
    layout = select_layout(step1 + step2, ("fsdp2",), 0)
    assert layout.changes == []
    real = [_ag(1, 2, "l0", ["l0.b", "l0.a"])]  # a layout that was never issued before
    assert select_layout(step1 + real, ("fsdp2",), 0).changes


def test_verdict_line_names_the_first_buckets_own_class():
    fb = {"collective": "all_gather", "index": 1, "position": 0, "verdict": "order_differs"}
    line = order_phrase("partition_differs", fb)
    assert line == "bucket partition differs (all_gather bucket 1 position 0: its order differs)"
    fb["verdict"] = "partition_differs"
    assert order_phrase("partition_differs", fb) == ("bucket partition differs "
                                                     "(all_gather bucket 1 position 0)")


def _op(i, op, value, phase="forward", kind="compute", **kw):
    return {"i": i, "op": op, "kind": kind, "phase": phase, "module": kw.pop("module", "m"),
            "in": [], "out": [{"shape": [4], "dtype": "float32", "hash": value}], **kw}


def _grad(i, value):
    return {"i": i, "op": "parity.grad", "kind": "grad", "phase": "backward", "module": "lm_head",
            "param": "lm_head.weight", "in": None,
            "out": [{"shape": [4], "dtype": "float32", "hash": value}]}


def _report(res):
    return format_report({"step": 1, "step_source": "first divergent step", "rank": 0,
                          "out": "/tmp", "a": {"process": "eager", "ops": 0},
                          "b": {"process": "compiled", "ops": 0}, "ranks": {}, **res})


def test_too_few_ops_on_a_side_is_said_in_the_headline():
    a = [_op(i, "aten.mm.default", f"h{i}") for i in range(40)] + [_grad(40, "g1")]
    b = [_grad(0, "g2")]
    res = analyse_rank(a, b, "identical")
    assert res["too_few_ops"] == {"a": 40, "b": 0, "sides": ["b"]}
    assert "B recorded too few forward/backward ops" in _report(res).splitlines()[0]
    assert "no forward/backward op before it could be compared" in res["inputs"]["detail"]


def test_gradient_difference_names_the_opaque_region_not_the_bucketing():
    ops = [_op(i, "aten.mm.default", f"h{i}") for i in range(20)]
    a = ops + [_grad(20, "g1")]
    b = ops + [{"i": 20, "op": "inside inductor graph backward#3, not recorded op by op",
                "kind": "opaque", "phase": "backward", "module": "", "in": None,
                "out": [{"shape": [4], "dtype": "float32", "hash": "new"}]}, _grad(21, "g2")]
    res = analyse_rank(a, b, "identical")
    detail = res["inputs"]["detail"]
    assert "inside inductor graph backward#3, not recorded op by op (B)" in detail
    assert "bucketing" not in detail
    assert res["opaque_regions"]["b"] == ["inside inductor graph backward#3, not recorded op by op"]
    # the same region computing values A also had is not where the difference enters
    b[20]["out"][0]["hash"] = "h3"
    assert "not the bucketing" in analyse_rank(a, b, "identical")["inputs"]["detail"]
    assert "its bucketing" in analyse_rank(a, ops + [_grad(20, "g2")], "order_differs")[
        "inputs"]["detail"]
