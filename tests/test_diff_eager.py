"""Eager DTensor collectives in the diff (pure logic on synthetic manifests)."""

from types import SimpleNamespace

from torch.distributed.tensor import Partial, Replicate, Shard

from parity.capture.sources.eager_collectives import kind_of
from parity.diff.buckets import eager_collectives, explain_eager, select_layout


def _spec(*placements):
    return SimpleNamespace(placements=placements)


def test_kind_of_placement_changes():
    assert kind_of(_spec(Shard(0)), _spec(Replicate())) == "all_gather"
    assert kind_of(_spec(Partial()), _spec(Shard(0))) == "reduce_scatter"
    assert kind_of(_spec(Partial()), _spec(Replicate())) == "all_reduce"
    assert kind_of(_spec(Replicate()), _spec(Shard(0))) == "local_chunk"
    assert kind_of(_spec(Shard(0)), _spec(Shard(1))) == "all_to_all"
    assert kind_of(_spec(Shard(0), Partial()), _spec(Replicate(), Shard(0))) == \
        "all_gather+reduce_scatter"


def _dt(coll, fqn, shape, module, step=1):
    return {"source": "dtensor", "collective": coll, "step": step, "module": module,
            "dtype": "float32", "index": 0,
            "entries": [{"fqn": fqn, "offset": 0, "size": 4, "numel": 1, "dtype": "float32",
                         "shape": shape}]}


def _rs(fqns, index, source="fsdp2", graph=None):
    return {"source": source, "collective": "reduce_scatter", "step": 1, "index": index,
            "graph": graph, "graph_id": 0 if graph else None, "group": "g", "dtype": "float32",
            "total_bytes": 4 * len(fqns),
            "entries": [{"fqn": f, "offset": 4 * i, "size": 4, "numel": 1, "dtype": "float32",
                         "shape": [1]} for i, f in enumerate(fqns)]}


CHUNKS = []
for _ in range(8):  # interleaved, as under a chunked loss
    CHUNKS.append(_dt("all_gather", "lm_head.weight", [16, 4], "loss_fn(Chunked) > lm_head"))
    CHUNKS.append(_dt("reduce_scatter", None, [16, 4], "loss_fn(Chunked)"))


def test_eager_runs_are_counted_per_kind_of_call():
    runs = eager_collectives(CHUNKS + [_dt("reduce_scatter", None, [16, 4], "x", step=2)])
    assert [(r["collective"], r["fqn"], r["count"]) for r in runs] == [
        ("all_gather", "lm_head.weight", 8), ("reduce_scatter", None, 8)]


def test_explanation_names_one_reduce_scatter_against_eight_chunks():
    la = select_layout([_rs(["norm.weight", "lm_head.weight"], 0)], ("fsdp2", "graph"), 0)
    lb = select_layout([_rs(["norm.weight"], 0, "graph", "backward")], ("graph",), 0)
    line = explain_eager("lm_head.weight", "16x4", la, lb, [], eager_collectives(CHUNKS))
    assert line.startswith("lm_head.weight's gradient: one reduce-scatter in A (fsdp2 bucket 0")
    assert "8 reduce_scatters of [16x4 float32] under module loss_fn(Chunked) in B" in line
    assert line.endswith("(chunked reduce-scatters)")
    assert explain_eager("norm.weight", "4", la, lb, [], eager_collectives(CHUNKS)) is None


def test_repeated_graph_reduce_scatters_are_counted_and_explained():
    graph = [_rs(["lm_head.weight"], i, "graph", "backward") for i in range(8)]
    graph.append(_rs(["norm.weight"], 8, "graph", "backward"))
    graph.append(dict(_rs(["x.weight"], 9, "graph", "backward"), stage="before_passes"))
    lb = select_layout(graph, ("graph",), 0)
    assert lb.repeats == {("reduce_scatter", "lm_head.weight"): 8}
    assert [b.fqns for b in lb.buckets["reduce_scatter"]] == [["lm_head.weight"], ["norm.weight"]]
    la = select_layout([_rs(["lm_head.weight"], 0)], ("fsdp2",), 0)
    line = explain_eager("lm_head.weight", "16x4", la, lb, [], [])
    assert "8 reduce-scatters in B's graph" in line
