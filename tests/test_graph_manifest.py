"""Compiled-graph bucket manifests (parity.capture.sources.graph) on the built-in workload.

The torchrun jobs run the compiled workload with ``graph.install`` and are
shared with tests/test_workload.py. The expected bucket order is read from a
real FSDP2 model (``fsdp_params`` of every ``FSDPParamGroup``), not from the
workload's own re-implementation of it.
"""

import json
import os
import subprocess
import sys

import pytest

from workload_harness import COMPILED_GRAPH, COMPILED_REGISTRATION, COMPILED_SWAPPED, NPROC, REPO, run_job


BUCKET_KEYS = {
    "source",
    "collective",
    "graph",
    "graph_id",
    "index",
    "node",
    "group",
    "dtype",
    "world_size",
    "total_bytes",
    "entries",
}
ENTRY_KEYS = {"fqn", "offset", "size", "numel", "dtype", "shape", "module"}
# Optional keys (issue 14): where the collective sits in its graph and the module it was issued under.
BUCKET_KEYS |= {"position", "compute_before", "module"}
# Figures of the graph after its passes (issue 31): AutoParallel's, on a graph's reduce-scatters.
GRAPH_FIGURES = {"max_consec_compute_between_rs", "spans_at_bucketing"}

_FSDP2_GROUPS = r"""
import json
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from parity.workloads.model import ModelArgs, Transformer
from parity.workloads.train import init_distributed

init_distributed("cpu")
model = Transformer(ModelArgs())
mesh = init_device_mesh("cpu", (1,))
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
state = model._get_fsdp_state()
state._lazy_init()
groups = {}
for s in state._state_ctx.all_states:
    # torch 2.13 keeps a list of groups per state; 2.11/2.12 one group or None
    gs = getattr(s, "_fsdp_param_groups", None)
    if gs is None:
        gs = [s._fsdp_param_group] if getattr(s, "_fsdp_param_group", None) else []
    for g in gs:
        groups[g._module_fqn] = [p._param_fqn for p in g.fsdp_params]
print(json.dumps(groups))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fsdp2_groups() -> dict[str, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _FSDP2_GROUPS], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def records(args: list[str], rank: int) -> dict[str, dict]:
    result = run_job(args, manifests=True)
    result.check_ok()
    graphs = result.graphs(rank)
    by_kind = {g["graph"]: g for g in graphs}
    assert set(by_kind) == {"forward", "backward"}, [g["graph"] for g in graphs]
    return by_kind


def fqns(bucket: dict) -> list[str]:
    return [e["fqn"] for e in bucket["entries"]]


@pytest.mark.parametrize("rank", range(NPROC))
def test_manifests_exist_and_are_well_formed(rank, fsdp2_groups):
    by_kind = records(COMPILED_REGISTRATION, rank)
    all_params = sorted(f for group in fsdp2_groups.values() for f in group)
    forward, backward = by_kind["forward"], by_kind["backward"]
    assert forward["graph_id"] == backward["graph_id"]
    assert forward["warnings"] == [] and backward["warnings"] == []
    for record, collective in ((forward, "all_gather"), (backward, "reduce_scatter")):
        buckets = [b for b in record["buckets"] if b["collective"] == collective]
        assert buckets, f"no {collective} in the {record['graph']} graph"
        assert [b["index"] for b in buckets] == list(range(len(buckets)))
        # Every parameter exactly once per direction.
        assert sorted(f for b in buckets for f in fqns(b)) == all_params
        for bucket in record["buckets"]:
            # a reduction's op as the node names it (2026-11-27: the reduction model reads it)
            op = {"op"} if bucket["collective"] == "reduce_scatter" else set()
            assert set(bucket) - GRAPH_FIGURES == BUCKET_KEYS | op
            if op:
                assert bucket["op"] == "avg"  # SimpleFSDP's Partial("avg")
            assert bucket["source"] == "graph" and bucket["graph"] == record["graph"]
            assert bucket["world_size"] == NPROC and bucket["dtype"] == "float32"
            offset = 0
            for entry in bucket["entries"]:
                assert set(entry) == ENTRY_KEYS
                assert entry["offset"] == offset
                assert entry["size"] == entry["numel"] * 4
                offset += entry["size"]
            assert bucket["total_bytes"] == offset


@pytest.mark.parametrize("rank", range(NPROC))
def test_registration_order_matches_fsdp2(rank, fsdp2_groups):
    by_kind = records(COMPILED_REGISTRATION, rank)
    for record in by_kind.values():
        groups = [b["group"] for b in record["buckets"]]
        assert sorted(groups) == sorted(fsdp2_groups), groups
        for bucket in record["buckets"]:
            assert fqns(bucket) == fsdp2_groups[bucket["group"]], (record["graph"], bucket["node"])


def test_graph_order_differs_in_a_reduce_scatter_bucket(fsdp2_groups):
    by_kind = records(COMPILED_GRAPH, 0)
    reordered = [
        b["group"]
        for b in by_kind["backward"]["buckets"]
        if b["collective"] == "reduce_scatter" and fqns(b) != fsdp2_groups[b["group"]]
    ]
    assert reordered, "expected backward graph order to differ from FSDP2 registration order"
    # Same parameters, different offsets: a consistent reorder.
    for bucket in by_kind["backward"]["buckets"]:
        assert sorted(fqns(bucket)) == sorted(fsdp2_groups[bucket["group"]])


def test_swapped_payloads_are_reported():
    backward = records(COMPILED_SWAPPED, 0)["backward"]
    (bucket,) = [b for b in backward["buckets"] if b["collective"] == "reduce_scatter"]
    swaps = [w for w in backward["warnings"] if "is the gradient of" in w]
    assert len(swaps) == 2, backward["warnings"]
    # The manifest shows which gradient really sits at each offset.
    assert len(fqns(bucket)) == len(set(fqns(bucket)))


def test_install_is_idempotent_and_reversible():
    import torch._dynamo.backends.common as dynamo_common
    import torch._functorch.aot_autograd as aot_autograd
    import torch._functorch.config as functorch_config

    from parity.capture.sources import graph

    before = (
        dynamo_common.aot_module_simplified,
        aot_autograd.aot_module_simplified,
        aot_autograd.aot_compile_joint_with_descriptors,
        functorch_config.enable_autograd_cache,
    )
    assert graph.install(lambda record: None) is None
    patched = dynamo_common.aot_module_simplified
    assert patched is not before[0]
    assert graph.install(lambda record: None) is None
    assert dynamo_common.aot_module_simplified is patched
    graph.uninstall()
    after = (
        dynamo_common.aot_module_simplified,
        aot_autograd.aot_module_simplified,
        aot_autograd.aot_compile_joint_with_descriptors,
        functorch_config.enable_autograd_cache,
    )
    assert after == before
    assert not graph.is_installed()


def test_callback_failure_does_not_break_training(capsys):
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    from parity.capture.sources import graph

    seen = []

    def on_graph(record):
        seen.append(record.graph)
        raise RuntimeError("writer is broken")

    graph._state["warned"] = False
    graph.install(on_graph)
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda x, w: (x @ w).sum(), backend=aot_autograd(fw_compiler=boxed_nop))
        w = torch.ones(3, 3, requires_grad=True)
        loss = fn(torch.ones(2, 3), w)
        loss.backward()
    finally:
        graph.uninstall()
        torch._dynamo.reset()
    assert loss.item() == 18.0
    assert torch.equal(w.grad, torch.full((3, 3), 2.0))
    assert seen == ["forward", "forward", "backward", "backward"]  # before and after the passes
    err = capsys.readouterr().err
    assert err.count("parity: compiled manifests unavailable: RuntimeError: writer is broken") == 1


def test_source_names_to_fqns():
    from parity.capture.sources.graph import normalize_fqn, source_to_fqn

    assert source_to_fqn("L['self']._modules['layers']._modules['0']._parameters['weight']") == "layers.0.weight"
    assert source_to_fqn("L['self']._modules['_orig_mod']._modules['norm']._parameters['weight']") == "norm.weight"
    assert (
        source_to_fqn(
            "G['model']._modules['wq']._modules['parametrizations']._modules['weight']._parameters['original']"
        )
        == "wq.weight"
    )
    assert source_to_fqn("L['tokens']") is None
    assert normalize_fqn("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"


def test_a_compile_cache_that_cannot_be_disabled_is_said(monkeypatch):
    """A cache hit skips the compilers, and so the manifest: failing to turn a cache off is a
    capture warning (the session's warn: meta.json), never silent."""
    import torch._inductor.config  # noqa: F401 (the real one, before it is replaced below)

    from parity.capture.sources import graph

    class ReadOnly:
        fx_graph_cache = True

        def __setattr__(self, name, value):
            raise AttributeError(f"{name} is read-only")

    monkeypatch.setitem(sys.modules, "torch._inductor.config", ReadOnly())
    said = []
    try:
        assert graph.install(lambda record: None, warn=said.append) is None
    finally:
        graph.uninstall()
    assert len(said) == 1 and "torch._inductor.config.fx_graph_cache" in said[0]
    assert "cache hit yields no compiled manifest" in said[0]
