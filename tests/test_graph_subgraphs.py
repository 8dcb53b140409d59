"""Collectives nested in higher-order-op subgraphs, and AutoParallel's figures (issue 31), on
graphs made by torch itself on CPU (a fake process group: one process, no job):

* torch's overlap scheduler (``schedule_overlap_bucketing(insert_overlap_deps=True)``, the pass
  AutoParallel's backend turns on) wraps collectives, waits and matmuls in ``control_deps``
  subgraphs: the manifests, counts and payload classes see every collective an independent
  walk of every subgraph finds, traced to the same parameters as without the wrappers;
* the flat graph is the scheduled graph (the same ops in the same order), so AutoParallel's
  ``_max_consec_compute_between_rs`` computed on it equals AutoParallel's own definition on the
  graph before the wrappers (the top-level walk sees no reduce-scatter and no matmul at all);
* ``invoke_subgraph`` is inlined and a ``cond`` branch's collective is found and labelled;
* the span at bucketing is AutoParallel's: ranks in the graph the bucketing pass received.
"""

from __future__ import annotations

import collections
import inspect

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from parity.capture.sources import graph_bucketing, graph_flat, graph_passes, graph_walk  # noqa: E402

D = 64
PARAMS = [f"layers.{i}.weight" for i in range(4)]
INPUT_FQNS = [None, None, *PARAMS]  # x, tokens, then the four weight shards
OUTPUT_FQNS = [None, *PARAMS]  # the loss, then each weight's reduced gradient


@pytest.fixture(scope="module")
def group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    if created:
        dist.destroy_process_group()


def _step_graph(group: str):
    """A SimpleFSDP-like joint step: an int64 token all-gather, one all-gather per weight
    shard, an activation all-gather, and a reduce-scatter per weight gradient."""
    ag = torch.ops._c10d_functional.all_gather_into_tensor
    rs = torch.ops._c10d_functional.reduce_scatter_tensor
    wait = torch.ops._c10d_functional.wait_tensor

    def step(x, tokens, *shards):
        tok = wait(ag(tokens, 2, group))
        h, fulls = x, []
        for s in shards:
            full = wait(ag(s, 2, group))
            fulls.append(full)
            h = torch.relu(h @ full.t())
        act = wait(ag(h, 2, group))
        loss = act.sum() + tok.float().sum() * 0
        grads = torch.autograd.grad(loss, fulls)
        return [loss] + [wait(rs(g.contiguous(), "avg", 2, group)) for g in grads]

    torch.manual_seed(0)
    shards = [torch.randn(D // 2, D, requires_grad=True) for _ in range(4)]
    return make_fx(step, tracing_mode="fake")(torch.randn(8, D), torch.randint(0, 9, (8,)),
                                               *shards)


def _scheduled(group: str, deps: bool, monkeypatch):
    """torch's overlap scheduler on CPU (analytical estimates, fixed bandwidth: its GPU queries
    need a driver), with or without the control_deps wrappers."""
    import torch.utils._runtime_estimation as estimation
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    # (2.15 passes a device too)
    monkeypatch.setattr(estimation, "get_gpu_dram_gbps", lambda *a, **k: 2000, raising=False)
    monkeypatch.setattr(estimation, "get_device_tflops", lambda *a, **k: 100.0, raising=False)
    # analytical estimates: by name where this torch has the option; 2.11 has no
    # compute_estimator and benchmarks compute nodes on the GPU unless a custom estimate
    # answers for them, and logs their analytical estimate, which asks for CUDA: there a
    # fixed 10 us a compute node for both (collectives: None, its analytical estimator)
    accepted = inspect.signature(schedule_overlap_bucketing).parameters
    estimators = {k: "analytical" for k in ("compute_estimator", "collective_estimator")
                  if k in accepted}
    if "compute_estimator" not in accepted:
        import torch._inductor.fx_passes.overlap_scheduling as scheduling

        def compute_only(node, size=None):
            if graph_walk.collective_kind(graph_walk.op_name(node)) is not None:
                return None
            return 0.01

        monkeypatch.setattr(scheduling, "estimate_runtime_analytical",
                            lambda node: compute_only(node) or 0.0)
        estimators["custom_runtime_estimation"] = compute_only
    return schedule_overlap_bucketing(
        _step_graph(group), insert_overlap_deps=deps, collective_bucketing=True, **estimators)


def _every_collective(gm) -> collections.Counter:
    """Independent count: every collective call in the graph and in every submodule graph."""
    kinds = collections.Counter()
    for _, mod in gm.named_modules():
        for node in getattr(getattr(mod, "graph", None), "nodes", ()):
            found = graph_walk.collective_kind(graph_walk.op_name(node))
            if found is not None:
                kinds[found[0]] += 1
    return kinds


def _ap_max_consec_compute_between_rs(graph) -> int:
    """AutoParallel's definition, as written in autoparallel/graph_passes/auto_bucketing.py
    (a54c252), with torch's own is_compute_node."""
    from torch._inductor.fx_passes.overlap_scheduling import is_compute_node

    max_run = cur = 0
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        target = str(n.target)
        if is_compute_node(n):
            cur += 1
            max_run = max(max_run, cur)
        elif "reduce_scatter" in target and "wait" not in target:
            cur = 0
    return max_run


def test_control_deps_collectives_are_recorded(group, monkeypatch):
    gm = _scheduled(group, True, monkeypatch)
    top = [graph_flat.hop_name(n) for n in gm.graph.nodes]
    assert "control_deps" in top  # torch's pass nested nodes
    independent = _every_collective(gm)
    on_top = collections.Counter(graph_walk.collective_kind(graph_walk.op_name(n))[0]
                                 for n in gm.graph.nodes
                                 if graph_walk.collective_kind(graph_walk.op_name(n)))
    assert sum(on_top.values()) < sum(independent.values())  # a flat walk would miss some

    warnings: list[str] = []
    buckets = graph_walk.extract_buckets(gm, INPUT_FQNS, OUTPUT_FQNS, "joint", warnings=warnings)
    assert collections.Counter(b.collective for b in buckets) == independent
    counted = graph_passes.count_collectives(gm, "joint")
    assert {k.split("/")[0]: v for k, v in counted.items()} == dict(independent)
    assert warnings == []
    # (which payloads share a bucket is the scheduler's choice: on 2.11 the token all-gather
    # joins three weights' bucket, a float32 bucket with an int64 entry at byte 24576)
    by_params: dict = {}
    for b in buckets:
        by_params.setdefault(b.collective, []).extend(e.fqn for e in b.entries if e.fqn)
    assert sorted(by_params["all_gather"]) == PARAMS
    assert sorted(by_params["reduce_scatter"]) == PARAMS
    others = sorted((b.collective, e.dtype, e.payload) for b in buckets for e in b.entries
                    if e.fqn is None)
    assert others == [("all_gather", "float32", "activation"), ("all_gather", "int64", "token"),
                      ("reduce_scatter", "float32", "activation")]
    for b in buckets:  # a parameter's reduce-scatter is issued for the module that owns it
        if b.collective == "reduce_scatter" and b.entries[0].fqn:
            assert [e.module for e in b.entries] == [f.rsplit(".", 1)[0] for f in
                                                     (e.fqn for e in b.entries)]


def test_flat_graph_is_the_scheduled_graph(group, monkeypatch):
    plain = _scheduled(group, False, monkeypatch)
    wrapped = _scheduled(group, True, monkeypatch)
    ops = [graph_walk.op_name(n) for n in plain.graph.nodes if n.op == "call_function"]
    flat = graph_flat.flatten(wrapped)
    assert [graph_walk.op_name(n) for n in flat.graph.nodes if n.op == "call_function"] == ops
    expected = _ap_max_consec_compute_between_rs(plain.graph)
    assert expected > 0
    assert graph_walk.max_consec_compute_between_rs(wrapped) == expected
    # AutoParallel's walk of the wrapped graph's top level misses what the wrappers hold (on
    # 2.13-2.15 every matmul and reduce-scatter: 0; on 2.11 the scheduler wraps fewer: 1)
    assert _ap_max_consec_compute_between_rs(wrapped.graph) < expected
    # the records of the wrapped graph are those of the plain one
    key = [(b.collective, b.total_bytes, [e.fqn for e in b.entries], b.node)
           for b in graph_walk.extract_buckets(plain, INPUT_FQNS, OUTPUT_FQNS, "joint")]
    assert [(b.collective, b.total_bytes, [e.fqn for e in b.entries], b.node)
            for b in graph_walk.extract_buckets(wrapped, INPUT_FQNS, OUTPUT_FQNS, "joint")] == key


def test_invoke_subgraph_inlined_and_cond_branch_found(group):
    ag = torch.ops._c10d_functional.all_gather_into_tensor
    wait = torch.ops._c10d_functional.wait_tensor

    def gather(w):
        return (wait(ag(w, 2, group)),)

    def f(x, w, w2):
        full, = torch.ops.higher_order.invoke_subgraph(make_fx(gather)(w), "gather_0", w)
        h = x @ full.t()
        return torch.cond(h.sum() > 0,
                          lambda a, b: (wait(ag(b, 2, group)).sum() + a).clone(),
                          lambda a, b: a.clone(), (h, w2))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8))
    assert {graph_flat.hop_name(n) for n in gm.graph.nodes} >= {"invoke_subgraph", "cond"}
    warnings: list[str] = []
    buckets = graph_walk.extract_buckets(gm, ["x", "w", "w2"], [None], "forward",
                                         warnings=warnings)
    assert [(e.fqn, b.extra.get("nested")) for b in buckets for e in b.entries] == [
        ("w", None), ("w2", "cond true_graph_0")]
    assert warnings == []
    names = [n.name for n in graph_flat.flatten(gm).graph.nodes]
    assert names[:3] == ["x_1", "w_1", "w2_1"] and "mm" in names  # top-level names kept


def _planned_spans(group: str, cap) -> list[int]:
    """AutoParallel's spans of torch's own greedy all-gather buckets under ``cap`` on the step
    graph: the last member's position in the graph minus the first's, buckets of two or more."""
    from torch._inductor.fx_passes import bucketing, fsdp

    reference = _step_graph(group)
    ranks = {n.name: i for i, n in enumerate(reference.graph.nodes)}
    planned = bucketing.bucket_all_gather_by_mb(reference, cap,
                                                filter_wait_node=fsdp.is_fsdp_all_gather_wait)
    return [ranks[b[-1].name] - ranks[b[0].name] for b in planned if len(b) > 1]


def _bucketed(group: str, cap):
    """A fresh step graph after inductor's FSDP all-gather bucketing pass run under parity's
    wrapper (installed, then removed): (the graph, the calls the wrapper saw)."""
    from torch._inductor.fx_passes import fsdp

    gm = _step_graph(group)
    graph_bucketing.install()
    try:
        graph_bucketing.begin()
        fsdp.bucket_fsdp_all_gather(gm, cap)
        calls = graph_bucketing.end()
    finally:
        graph_bucketing.uninstall()
    return gm, calls


def test_span_at_bucketing_is_autoparallels(group):
    """Spans measured by wrapping inductor's FSDP bucketing passes equal AutoParallel's
    definition computed from torch's own greedy buckets on the same graph."""
    from torch._inductor.fx_passes import fsdp

    cap = lambda _: 0.04  # noqa: E731 - 40 kB: two 16 kB all-gathers a bucket, two buckets
    expected = _planned_spans(group, cap)
    assert expected

    gm, calls = _bucketed(group, cap)
    assert fsdp.bucket_fsdp_all_gather.__name__ == "bucket_fsdp_all_gather"
    assert not hasattr(fsdp.bucket_fsdp_all_gather, "_parity_original")  # restored
    assert calls == [{"pass": "bucket_fsdp_all_gather", "collective": "all_gather",
                      "spans": expected}]
    buckets = graph_walk.extract_buckets(gm, INPUT_FQNS, OUTPUT_FQNS, "joint")
    graph_bucketing.attach(calls, buckets)
    ags = [b for b in buckets if b.collective == "all_gather"]
    assert all(b.extra["spans_at_bucketing"]["spans"] == expected for b in ags)
    assert not any("spans_at_bucketing" in b.extra for b in buckets
                   if b.collective == "reduce_scatter")


def test_span_of_a_bucket_merged_in_another_order_is_not_negative(group, monkeypatch):
    """A pass that merges each bucket with its members in another order than the graph's (a
    payload order, as round 10a's AutoParallel trainer sets through inductor's merge): the span
    is the same positions' (latest minus earliest), AutoParallel's figure for those members;
    it read ``last - first`` in bucket order before, negative (-7, -2 on AutoParallel's llama3)."""
    from torch._inductor.fx_passes import fsdp

    cap = lambda _: 0.04  # noqa: E731 - two 16 kB all-gathers a bucket, two buckets
    expected = _planned_spans(group, cap)
    assert expected and all(s > 0 for s in expected)
    real = fsdp.merge_all_gather
    monkeypatch.setattr(fsdp, "merge_all_gather", lambda gm, buckets, *a, **k: real(
        gm, [list(reversed(b)) for b in buckets], *a, **k))
    _, calls = _bucketed(group, cap)
    assert calls[0]["spans"] == expected


def test_reduce_scatter_attribution_follows_the_parameters(group):
    """AutoParallel's backward nodes all carry the first module's ``fwd_nn_module_stack`` (seen
    on its llama3: every reduce-scatter "issued under tok_embeddings"): a reduce-scatter of a
    parameter's gradient is attributed to the module owning that parameter all the same."""
    gm = _step_graph(group)
    for node in gm.graph.nodes:
        node.meta["fwd_nn_module_stack"] = {"tok": ("L['self'].tok_embeddings", object)}
    buckets = graph_walk.extract_buckets(gm, INPUT_FQNS, OUTPUT_FQNS, "joint")
    rs = [b for b in buckets if b.collective == "reduce_scatter" and b.entries[0].fqn]
    assert rs and all(b.module == b.entries[0].fqn.rsplit(".", 1)[0] for b in rs)
    assert all(e.module == e.fqn.rsplit(".", 1)[0] for b in rs for e in b.entries)
