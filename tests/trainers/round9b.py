"""Round 9b trainer: a compiled SimpleFSDP-style job whose collectives are recorded as they run
(imports nothing from parity). The ground truth for parity's compiled-graph bucket manifests.

Every parameter is a ``Shard(0)`` DTensor read through a class property that all-gathers it
(``redistribute`` to ``Replicate``, gradient ``Partial``: a reduce-scatter in backward), as
torchtitan's SimpleFSDP and parity's own workload do; a small version of its own here. The
model is compiled with this file's own ``aot_autograd`` backend: its forward/backward compilers
apply torch's bucketing passes (``torch._inductor.fx_passes``), then run the final graph with
a ``torch.fx.Interpreter`` subclass that saves the concrete input of every
``_c10d_functional`` collective node it executes: what the graph actually sends, read by
executing it, not from the graph's structure. With ``R9_BACKEND=inductor`` inductor compiles
(its own bucketing options set) and a ``TorchDispatchMode`` entered around each call records
the collectives inductor's code issues (by order; inductor's code has no FX node names).

R9_SAVE gets (per rank, ``.RANK`` appended for rank > 0) torch.save of {"records": [{"graph",
"cid", "step", "node", "op", "input"}], "shards": [per step, before it: {fqn: local shard}],
"grads": [per step: {fqn: local sharded gradient}], "losses", "model": the final local
state dict, "extra": {dynamo's counters, the graphs compiled}, "world", "order"}.

Knobs (environment):
  R9_BACKEND  aot (own backend + interpreter) | inductor (torch.compile(backend="inductor"))
  R9_PASS     fsdp (bucket_fsdp_*) | plain (bucket_all_gather / bucket_reduce_scatter) | none
              | manual (ManualOverlapScheduler, one plan entry per module)
  R9_MODE     the passes' bucket mode: default | custom_ops | custom_ops_multidtype
  R9_CAP      bucket cap in MB (2000: one bucket per graph; small values split the model)
  R9_ORDER    graph | registration | reversed: each bucket's node list sorted before merging
  R9_PDTYPE   bf16: parameters all-gathered in bfloat16 (cast before the collective)
  R9_RDTYPE   bf16 | fp32: gradients reduce-scattered in that dtype
  R9_REDUCE   avg | sum (the gradient's Partial reduce op)
  R9_PAD      1: dims not divisible by the world size (padded shards)
  R9_UNUSED   1: a parameter the forward never uses;  R9_TIED=1: a weight used twice
  R9_FROZEN   1: one layer's parameters frozen (requires_grad False)
  R9_REPLICATE 1: biases Replicate (gradients all-reduced; bucket_all_reduce)
  R9_ACT      1: an activation all-gathered and a statistic all-reduced in the forward
  R9_STEPS    (2)
  R9_TDM      inductor: inner (a TorchDispatchMode entered inside inductor's compiled forward /
              backward: the ground truth) | 1 (entered around the compiled model: dynamo then
              skips the frame, the job runs eagerly; kept to show it)

    torchrun --standalone --nproc_per_node 2 tests/trainers/round9b.py
"""

import functools
import os
import re

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

E = os.environ.get
STEPS = int(E("R9_STEPS", "2"))
COLLECTIVES = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor",
               "_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor_out",
               "_c10d_functional::all_gather_into_tensor_coalesced",
               "_c10d_functional::reduce_scatter_tensor_coalesced")
RECORDS = []  # what each executed collective node received
GRAPHS = []  # (kind, number of nodes) of each graph compiled
STATE = {"step": -1, "cid": 0}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------- SimpleFSDP, small version


class Gather(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.pdtype = DTYPES.get(E("R9_PDTYPE", ""))
        self.rdtype = DTYPES.get(E("R9_RDTYPE", ""))
        self.grad = [Partial(E("R9_REDUCE", "avg"))]

    def forward(self, x):
        full = x.redistribute(placements=[Replicate()], forward_dtype=self.pdtype,
                              backward_dtype=self.rdtype)
        return full.to_local(grad_placements=self.grad)


def shard_model(model, mesh):
    gather, done = Gather(mesh), {}
    for module in list(model.modules()):
        names = []
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in done:  # a tied weight is sharded once, the same Parameter twice
                # R9_REPLICATE=1: biases replicated, their gradients all-reduced (HSDP-like)
                place = Replicate() if E("R9_REPLICATE") == "1" and p.dim() == 1 else Shard(0)
                done[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [place]),
                                           requires_grad=p.requires_grad)
            module.register_parameter(name, done[id(p)])
            names.append(name)
        if names:
            props = {n: property(lambda self, n=n: gather(self._parameters[n])) for n in names}
            module.__class__ = type(f"SimpleFSDP{module.__class__.__name__}",
                                    (module.__class__,), props)
    return model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        odd = E("R9_PAD") == "1"
        self.inp = nn.Linear(6, 15 if odd else 16)
        d = 15 if odd else 16
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.out = nn.Linear(d, 3 if odd else 4)
        if E("R9_UNUSED") == "1":
            self.spare = nn.Linear(d, d)
        if E("R9_TIED") == "1":
            self.l2.weight = self.l1.weight
        if E("R9_FROZEN") == "1":
            self.inp.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.l1(h)) + h
        h = torch.tanh(self.l2(h)) + h
        out = self.out(h)
        if E("R9_ACT") == "1":  # collectives of activations (no parameter): a gathered
            # activation and an all-reduced statistic, used (unused ones would be removed)
            from torch.distributed import _functional_collectives as funcol

            group = STATE["mesh"].get_group()
            gathered = funcol.all_gather_tensor(h.detach(), 0, group)
            stat = funcol.all_reduce(h.detach().pow(2).mean(), "avg", group)
            out = out + 0.0 * (gathered.mean() + stat)
        return out


# ---------------------------------------------------------------- which parameter a node is


def source_fqn(name):
    """``L['self']._modules['l1']._parameters['weight']`` -> ``l1.weight``."""
    if not name.startswith("L['self']"):
        return None
    keys = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]", name[len("L['self']"):])
    return ".".join(keys) or None


def dynamo_fqns(gm):
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        src = getattr(node, "_dynamo_source", None)
        if src is None and "grapharg" in node.meta:
            src = getattr(node.meta["grapharg"], "source", None)
        out.append(source_fqn(src.name) if src is not None else None)
    return out


def plain_index(desc):
    while desc is not None:
        if hasattr(desc, "grad_of"):
            desc = desc.grad_of
        elif hasattr(desc, "base"):
            desc = desc.base
        elif type(desc).__name__ == "PlainAOTInput":
            return desc.idx
        else:
            return None
    return None


def op_name(node):
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema.name if schema is not None else ""


def node_fqn(node, fqns):
    """An unbucketed all-gather: back through unary ops to its placeholder; a reduce-scatter:
    forward through single users to the graph output it is."""
    if "all_gather" in op_name(node):
        cur = node.args[0]
        while cur.op != "placeholder":
            if len(cur.all_input_nodes) != 1:
                return None
            cur = cur.all_input_nodes[0]
        idx = plain_index(cur.meta.get("desc"))
    else:
        cur, idx = node, None
        while idx is None:
            users = list(cur.users)
            if len(users) != 1:
                return None
            if users[0].op == "output":
                for out, desc in zip(users[0].args[0], users[0].meta.get("desc") or ()):
                    if out is cur:
                        idx = plain_index(desc)
                if idx is None:
                    return None
                break
            cur = users[0]
    return fqns[idx] if idx is not None and idx < len(fqns) else None


# ---------------------------------------------------------------- passes and the interpreter


def cap_fn(_idx):
    return float(E("R9_CAP", "2000"))


def run_passes(gm, fqns, registration):
    from torch._inductor.fx_passes import bucketing, fsdp
    from torch._inductor.pattern_matcher import stable_topological_sort

    kind, mode, order = E("R9_PASS", "fsdp"), E("R9_MODE", "default"), E("R9_ORDER", "graph")
    if kind == "none":
        return

    def sort(buckets):
        if order == "registration":
            index = {f: i for i, f in enumerate(registration)}
            return [sorted(b, key=lambda n: index[node_fqn(n, fqns)]) for b in buckets]
        if order == "reversed":
            return [list(reversed(b)) for b in buckets]
        return buckets

    if kind == "manual":  # torchtitan's per-block plan (overlap_manual_scheduling)
        return manual(gm, sort if order != "graph" else None)
    rs_filter = fsdp.is_fsdp_reduce_scatter_wait if kind == "fsdp" else None
    ag_filter = fsdp.is_fsdp_all_gather_wait if kind == "fsdp" else None
    rs_mode = "custom_ops" if mode == "custom_ops_multidtype" else mode  # AG only, in 2.13
    rs = sort(bucketing.bucket_reduce_scatter_by_mb(gm, cap_fn, rs_filter, rs_mode))
    if rs:
        bucketing.merge_reduce_scatter(gm, rs, rs_mode)
    ag = sort(bucketing.bucket_all_gather_by_mb(gm, cap_fn, ag_filter, mode))
    if ag:
        bucketing.merge_all_gather(gm, ag, mode)
    if E("R9_REPLICATE") == "1":
        bucketing.bucket_all_reduce(gm, cap_fn, "default" if mode != "default" else mode)
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()


def manual(gm, sort):
    """``ManualOverlapScheduler`` with one plan entry per module (what torchtitan's
    ``transformer_block_bucketing`` builds); its roofline estimate needs triton and a GPU: 0
    here (the manual plan does not use it)."""
    from torch._inductor.fx_passes import overlap_scheduling
    from torch._inductor.fx_passes.overlap_manual_scheduling import ManualOverlapScheduler

    saved = getattr(overlap_scheduling, "estimate_roofline_runtime_ms", None)
    if saved is not None:
        overlap_scheduling.estimate_roofline_runtime_ms = lambda node: 0.0
    try:
        plans = [n for n in ("inp", "l1", "l2", "out")]
        scheduler = ManualOverlapScheduler(gm, plans, insert_overlap_deps=False)
        if sort is not None:
            group = scheduler.bucketer._bucket_group
            scheduler.bucketer._bucket_group = lambda nodes: group(sort([list(nodes)])[0])
        scheduler.run()
    finally:
        if saved is not None:
            overlap_scheduling.estimate_roofline_runtime_ms = saved
    gm.recompile()


def _keep(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return [_keep(y) for y in x]
    return x


class Recorder(fx.Interpreter):
    """Runs the graph; every collective node's concrete input is kept, with the node's name."""

    def __init__(self, gm, kind, cid):
        super().__init__(gm)
        self.kind, self.cid = kind, cid

    def run_node(self, n):
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        name = getattr(getattr(target, "_schema", None), "name", "")
        if name in COLLECTIVES:
            RECORDS.append({"graph": self.kind, "cid": self.cid, "step": STATE["step"],
                            "node": self._node.name, "op": name, "input": _keep(args[0]),
                            "reduce_op": args[1] if "reduce" in name else None})
        return super().call_function(target, args, kwargs)


def make_backend(registration):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def backend(gm, example_inputs):
        fqns = dynamo_fqns(gm)
        cid = STATE["cid"]
        STATE["cid"] += 1
        GRAPHS.append(("dynamo", len(gm.graph.nodes)))

        def compiler(kind, g, _inputs):
            run_passes(g, fqns, registration)
            GRAPHS.append((kind, len(g.graph.nodes)))
            return make_boxed_func(lambda *args: Recorder(g, kind, cid).run(*args))

        return aot_autograd(fw_compiler=functools.partial(compiler, "forward"),
                            bw_compiler=functools.partial(compiler, "backward"),
                            partition_fn=min_cut_rematerialization_partition,
                            keep_inference_input_mutations=True)(gm, example_inputs)

    return backend


class DispatchRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Inductor's compiled code: each ``_c10d_functional`` op it issues, in order (no node names)."""

    def __init__(self, kind="inductor"):
        super().__init__()
        self.kind = kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in COLLECTIVES:
            RECORDS.append({"graph": self.kind, "cid": 0, "step": STATE["step"], "node": None,
                            "op": name, "input": _keep(args[0]),
                            "reduce_op": args[1] if "reduce" in name else None})
        return func(*args, **(kwargs or {}))


def inductor_recorded(gm, example_inputs):
    """Inductor, whose compiled forward/backward each run under a ``DispatchRecorder``: the
    mode is entered inside the compiled region (dynamo's frame is already running), where
    entering it around the call of the compiled model makes dynamo skip the frame."""
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

    GRAPHS.append(("dynamo", len(gm.graph.nodes)))
    return compile_fx(gm, example_inputs, inner_compile=inner)


def counters():
    from torch._dynamo.utils import counters as c

    return {k: dict(v) for k, v in c.items() if v}


def local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def main():
    dist.init_process_group("gloo")
    mesh = STATE["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net()
    registration = [n for n, _ in model.named_parameters()]  # FSDP2's order here: module order
    shard_model(model, mesh)
    if E("R9_BACKEND", "aot") == "inductor":
        import torch._inductor.config as ic

        if E("R9_PASS", "fsdp") != "none":
            ic.bucket_all_gathers_fx = "fsdp" if E("R9_PASS", "fsdp") == "fsdp" else "all"
            ic.bucket_reduce_scatters_fx = ic.bucket_all_gathers_fx
            cap = float(E("R9_CAP", "2000"))
            ic.bucket_all_gathers_fx_bucket_size_determinator = lambda _i: cap
            ic.bucket_reduce_scatters_fx_bucket_size_determinator = lambda _i: cap
        net = torch.compile(model, backend=inductor_recorded if E("R9_TDM") == "inner"
                            else "inductor")
    else:
        net = torch.compile(model, backend=make_backend(registration))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    truth = {"records": RECORDS, "shards": [], "grads": [], "losses": [], "world":
             dist.get_world_size(), "order": registration}
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(STEPS):
        STATE["step"] = step
        truth["shards"].append({n: local(p) for n, p in model.named_parameters()})
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3 if E("R9_PAD") == "1" else 4,
                                                             generator=g)
        x = x.to(DTYPES.get(E("R9_PDTYPE", ""), torch.float32))  # compute in the gathered dtype
        opt.zero_grad()
        if E("R9_TDM") == "1":  # around the compiled model: dynamo then skips the frame
            with DispatchRecorder():
                loss = (net(x).float() - y).pow(2).mean()
                loss.backward()
        else:
            loss = (net(x).float() - y).pow(2).mean()
            loss.backward()
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()
                               if p.grad is not None})
        opt.step()
        truth["losses"].append(loss.detach().clone())
    truth["model"] = {k: local(v) for k, v in model.state_dict().items()}
    truth["extra"] = {"counters": counters(), "graphs": GRAPHS}
    print("compile record:", truth["extra"], flush=True)
    if E("R9_SAVE"):
        torch.save(truth, E("R9_SAVE") + (f".{dist.get_rank()}" if dist.get_rank() else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
