"""Round 10a trainer: an AutoParallel job whose compiled graphs' collectives are recorded as they
run (imports nothing from parity). The ground truth for parity's manifests of AutoParallel graphs.

AutoParallel (meta-pytorch/autoparallel, not on PyPI) plans AutoParallel's test llama3 (2 layers,
dim 64) on a 1-D CPU mesh of 2 ranks (gloo); its cost model is told that compute is slow, which
gives an FSDP-like plan (parameter shards all-gathered, gradients reduce-scattered). The parallel
module is compiled with ``autoparallel_backend`` (overlap scheduling off) and stepped with SGD.
The recorder: ``autoparallel.compile.compile_fx`` is wrapped so that inductor's compiled forward
and backward (what ``compile_fx_inner`` returns) each run under a ``TorchDispatchMode`` that keeps
the input of every ``_c10d_functional`` collective inductor's code issues, in order (inductor's
code has no FX node names), as round 9b's inductor recorder does. A dispatch mode around the
compiled model would make dynamo skip the frame (round 9b), so it is entered inside.

R10_SAVE gets (per rank, ``.RANK`` appended for rank > 0) torch.save of round 9b's format:
{"records": [{"graph", "cid", "step", "node": None, "op", "input", "reduce_op"}], "shards": [per
step, before it: {fqn: local shard}], "grads": [per step: {fqn: local sharded gradient}],
"losses", "model" (final local state dict), "extra": {dynamo's counters, graphs compiled},
"world", "order"}.

Knobs (environment):
  R10_BUCKET  none | fsdp: inductor's FX bucketing (``bucket_all_gathers_fx = "only_fsdp"``,
              ``bucket_reduce_scatters_fx = "all"``, AutoParallel's greedy bucketing installed)
  R10_ORDER   graph | reversed: each reduce-scatter and all-gather bucket's members reversed
              before inductor merges them (the payload order; the values are the same) |
              rs_reversed: reduce-scatter buckets only
  R10_OVERLAP 1: ``autoparallel_backend``'s overlap scheduling on (``control_deps`` wrappers; on a
              CPU with analytical estimates and fixed bandwidth / TFLOPS figures)
  R10_BATCH, R10_SEQ  global batch (4) and sequence length (16)
  R10_REC     1: record (default) | 0: the wrapper is not installed (to show it changes nothing)
  R10_STEPS   (2)

    torchrun --standalone --nproc_per_node 2 tests/trainers/round10a.py
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

E = os.environ.get
STEPS = int(E("R10_STEPS", "2"))
COLLECTIVES = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor",
               "_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor_out",
               "_c10d_functional::all_gather_into_tensor_coalesced",
               "_c10d_functional::reduce_scatter_tensor_coalesced",
               "_c10d_functional::all_reduce_", "_c10d_functional::reduce_scatter_tensor_out")
# inductor lowers ``all_reduce`` to the in-place ``all_reduce_``: its input is read before it runs
RECORDS = []
GRAPHS = []
STATE = {"step": -1}
VOCAB, SEQ, BATCH = 64, int(E("R10_SEQ", "16")), int(E("R10_BATCH", "4"))  # global batch


def cpu_shims():
    """What AutoParallel needs on a CPU (docs/autoparallel.md): a device name for its cost model,
    slow compute / memory so that the solver shards instead of replicating."""
    import autoparallel.cost_models.compute_estimation as ce

    torch.cpu.get_device_name = lambda *a, **k: "A10G"
    ce._get_device_tflops = lambda *a, **k: 1e-4
    ce._get_device_gmem_bandwidth = lambda *a, **k: 1e6


def overlap_shims():
    """Inductor's overlap scheduler on a CPU: analytical estimates, fixed GPU figures (its
    queries need Triton and CUDA otherwise; docs/autoparallel.md)."""
    import torch._inductor.config as ic
    import torch._inductor.utils as iu
    import torch.utils._runtime_estimation as re_

    ic.aten_distributed_optimizations.compute_estimator = "analytical"
    ic.aten_distributed_optimizations.collective_estimator = "analytical"
    for mod in (iu, re_):
        mod.get_gpu_dram_gbps = lambda *a, **k: 1000
        mod.get_device_tflops = lambda *a, **k: 100.0


def _keep(t):
    if isinstance(t, (list, tuple)):
        return [x.detach().clone() for x in t]
    return t.detach().clone()


class DispatchRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Inductor's compiled code: each ``_c10d_functional`` op it issues, in order."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in COLLECTIVES:
            reduce_op = args[1] if "reduce" in name else None
            RECORDS.append({"graph": self.kind, "cid": 0, "step": STATE["step"], "node": None,
                            "op": name, "input": _keep(args[0]), "reduce_op": reduce_op})
        return func(*args, **(kwargs or {}))


def install_recorder():
    """``autoparallel.compile.compile_fx`` -> inductor's ``compile_fx`` with an inner compiler
    whose compiled forward / backward run under a ``DispatchRecorder``."""
    import autoparallel.compile as apc
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(g, inputs, **kw):
        compiled = compile_fx_inner(g, inputs, **kw)
        kind = "backward" if kw.get("is_backward") else "forward"
        GRAPHS.append((kind, len(g.graph.nodes)))
        call = type(compiled).__call__

        def recorded(self, args):
            with DispatchRecorder(kind):
                return call(self, args)

        compiled.__class__ = type(f"Recorded{type(compiled).__name__}", (type(compiled),),
                                  {"__call__": recorded})
        return compiled

    def wrapped(gm, example_inputs, **kw):
        GRAPHS.append(("dynamo", len(gm.graph.nodes)))
        return compile_fx(gm, example_inputs, inner_compile=inner, **kw)

    apc.compile_fx = wrapped


def configure_bucketing():
    """Inductor's FSDP bucketing as AutoParallel's users turn it on; R10_ORDER=reversed reverses
    each bucket's members before inductor merges them."""
    import torch._inductor.config as ic
    from torch._inductor.fx_passes import bucketing

    import autoparallel.graph_passes.auto_bucketing  # noqa: F401  (#481's greedy bucketing)

    ic.bucket_all_gathers_fx = "only_fsdp"
    ic.bucket_reduce_scatters_fx = "all"
    order = E("R10_ORDER", "graph")
    if order in ("reversed", "rs_reversed"):
        names = ("merge_reduce_scatter", "merge_all_gather")
        for name in names[:1] if order == "rs_reversed" else names:
            real = getattr(bucketing, name)

            def merge(gm, buckets, *a, _real=real, **k):
                return _real(gm, [list(reversed(b)) for b in buckets], *a, **k)

            setattr(bucketing, name, merge)
            from torch._inductor.fx_passes import fsdp
            if hasattr(fsdp, name):
                setattr(fsdp, name, merge)


def build(mesh):
    from autoparallel._testing.models.llama3 import Transformer, TransformerModelArgs
    from autoparallel.api import AutoParallel

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB,
                                max_seq_len=SEQ, multiple_of=32)
    with torch.device("meta"):
        model = Transformer(args)

    def input_fn():
        return torch.randint(0, VOCAB, (BATCH, SEQ))

    with AutoParallel(model, input_fn, mesh) as autop:
        autop.add_parameter_memory_constraint(low=None, high=None)
        autop.add_input_constraints([(Shard(0),)])
        autop.add_output_constraints([(Shard(0),)])
        placement = autop.optimize_placement()
        parallel = autop.apply_placement(placement)
    parallel.to_empty(device="cpu")
    parallel.init_weights(buffer_device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the test blocks' init_weights returns at once: initialise here
        for name, p in parallel.named_parameters():
            full = (torch.ones(p.shape) if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.05)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)
    return parallel


def counters():
    from torch._dynamo.utils import counters as c

    return {k: dict(v) for k, v in c.items() if v}


def local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    cpu_shims()
    if E("R10_BUCKET", "none") == "fsdp":
        configure_bucketing()
    if E("R10_REC", "1") == "1":
        install_recorder()
    from autoparallel.compile import autoparallel_backend

    model = build(mesh)
    placements = {n: str(p.placements) for n, p in model.named_parameters()
                  if isinstance(p, DTensor)}
    overlap = E("R10_OVERLAP") == "1"
    if overlap:
        overlap_shims()
    net = torch.compile(model, backend=autoparallel_backend(enable_ac=False,
                                                            overlap_scheduling=overlap))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = {"records": RECORDS, "shards": [], "grads": [], "losses": [],
             "world": dist.get_world_size(), "order": [n for n, _ in model.named_parameters()],
             "placements": placements}
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(STEPS):
        STATE["step"] = step
        truth["shards"].append({n: local(p) for n, p in model.named_parameters()})
        tokens = torch.randint(0, VOCAB, (BATCH // dist.get_world_size(), SEQ), generator=g)
        opt.zero_grad()
        out = net(tokens)
        out = out.to_local() if isinstance(out, DTensor) else out
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, VOCAB),
                                                 tokens.roll(-1, 1).reshape(-1))
        loss.backward()
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()
                               if p.grad is not None})
        opt.step()
        truth["losses"].append(loss.detach().clone())
    truth["model"] = {k: local(v) for k, v in model.state_dict().items()}
    truth["extra"] = {"counters": counters(), "graphs": GRAPHS}
    print("placements:", placements, flush=True)
    print("compile record:", truth["extra"], "records:", len(RECORDS), flush=True)
    if E("R10_SAVE"):
        torch.save(truth, E("R10_SAVE") + (f".{dist.get_rank()}" if dist.get_rank() else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
