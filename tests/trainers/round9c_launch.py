"""Round 9c: torchtitan's GraphTrainer, unmodified, with a recorder of what its graphs send
(imports nothing from parity). The ground truth for parity's GraphTrainer manifests.

    torchrun --nproc_per_node 2 tests/trainers/round9c_launch.py [torchtitan.train args]

The CPU shims are tests/torchtitan_cpu/launch.py's (no torchtitan file is edited); then, before
``runpy`` of ``torchtitan.train`` with the same argv, this launcher wraps, by name in the module
that calls them:

* ``trainer.run_traced`` (aot_fx_trace): the runner it returns is entered under a
  ``TorchDispatchMode`` that keeps a copy of the input of every ``_c10d_functional`` collective
  the traced graph (after GraphTrainer's passes) executes. The i-th collective dispatched in a
  step is the graph's i-th collective node in node order (``gm.forward`` runs its nodes in
  order); the op names are checked to agree, so each record carries its node's name;
* ``jit_backend.transformer_block_bucketing_reordering_pass`` / ``autobucketing_reordering_pass``
  (jit + aot_eager): the aot_autograd forward / backward compilers; the graph they return runs
  under the same mode (entered inside the compiled region: a mode around the compiled model makes
  dynamo skip the frame, round 9b);
* ``GraphTrainer.forward_backward_step``: each parameter's local shard before it, its local
  (sharded) gradient and the loss after it (before torchtitan clips the gradients).

R9C_SAVE=PREFIX: torch.save per rank (``.RANK`` appended for rank > 0) of {"world", "records":
[{"step", "graph", "node", "op", "input", "reduce_op", "gid", "ranks": the group's
global ranks}], "shards": {step: {fqn: tensor}},
"grads": {step: {fqn: tensor}}, "losses": {step: tensor}, "nodes": {gid: [collective node names
in order]}, "mismatch": [op names that did not agree]}. R9C_RECORD=0: no dispatch mode (shards,
gradients and losses still saved): the values of a run without the recorder.
R9C_ORDER=graph registers a pass pipeline ``r9c_graph_order`` (``--compile.pass_pipeline
r9c_graph_order``): torchtitan's default passes with the joint bucketing pass given no FSDP
parameter order (buckets packed in graph order), through GraphTrainer's own registry.
"""

import functools
import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torchtitan_cpu"))
import launch as cpu  # noqa: E402  (tests/torchtitan_cpu/launch.py: the CPU shims)

E = os.environ.get
RECORD = E("R9C_RECORD", "1") != "0"
TRUTH = {"records": [], "shards": {}, "grads": {}, "losses": {}, "nodes": {}, "mismatch": []}
STATE = {"step": 0, "gid": 0}


def _collective(name: str) -> bool:
    return name.startswith("_c10d_functional::") and "wait" not in name


def _keep(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return [_keep(y) for y in x]
    return x


def collective_nodes(gm):
    """The collective nodes of a graph, in node order (the order ``gm.forward`` runs them)."""
    out = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None and _collective(schema.name):
            out.append((node.name, schema.name))
    return out


_RANKS: dict = {}


def group_ranks(name):
    """The global ranks of a collective's group (its last argument, the group's name); a 2-D
    mesh reduces over sub-groups."""
    if not isinstance(name, str):
        return None
    if name not in _RANKS:
        from torch.distributed.distributed_c10d import _resolve_process_group

        _RANKS[name] = dist.get_process_group_ranks(_resolve_process_group(name))
    return _RANKS[name]


class Recorder(TorchDispatchMode):
    """Keeps the input of each ``_c10d_functional`` collective; everything runs unchanged.
    Higher-order ops (flex_attention in the traced graph) pass through as they are: a mode
    without this is refused by them."""

    supports_higher_order_operators = True

    def __init__(self, graph, gid, nodes):
        super().__init__()
        self.graph, self.gid, self.nodes, self.i = graph, gid, nodes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = getattr(func, "_schema", None)
        name = schema.name if schema is not None else ""
        if _collective(name):
            node = None
            if self.i < len(self.nodes):
                node, expected = self.nodes[self.i]
                if expected != name:
                    TRUTH["mismatch"].append((self.gid, self.i, expected, name))
                    node = None
            self.i += 1
            TRUTH["records"].append({"step": STATE["step"], "graph": self.graph, "gid": self.gid,
                                     "node": node, "op": name, "input": _keep(args[0]),
                                     "reduce_op": args[1] if "reduce" in name else None,
                                     "ranks": group_ranks(args[-1])})
        return func(*args, **(kwargs or {}))


def _new_graph(gm, graph):
    gid = STATE["gid"]
    STATE["gid"] += 1
    TRUTH["nodes"][gid] = collective_nodes(gm)
    return gid


def wrap_run_traced(original):
    def run_traced(traced, *args, **kwargs):
        runner = original(traced, *args, **kwargs)
        if not RECORD:
            return runner
        gm = traced.gm
        if getattr(gm, "_r9c_gid", None) is None:
            gm._r9c_gid = _new_graph(gm, "joint")

        def run(*a, **k):
            with Recorder("joint", gm._r9c_gid, TRUTH["nodes"][gm._r9c_gid]):
                return runner(*a, **k)

        return run

    return run_traced


def wrap_compiler(original, kind_of):
    """An aot_autograd fw/bw compiler (torchtitan's bucketing pass): its graph, run recorded."""
    calls = {"n": 0}

    def compiler(gm, example_inputs=None, **kwargs):
        out = original(gm, example_inputs, **kwargs)
        if not RECORD:
            return out
        kind = kind_of(calls["n"])
        calls["n"] += 1
        gid = _new_graph(out, kind)
        nodes = TRUTH["nodes"][gid]

        if getattr(out, "_boxed_call", False):
            def run(args):
                with Recorder(kind, gid, nodes):
                    return out(args)
            run._boxed_call = True
        else:
            def run(*args):
                with Recorder(kind, gid, nodes):
                    return out(*args)
        return run

    return compiler


def local(t):
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def install():
    from torchtitan.experiments.graph_trainer import jit_backend
    from torchtitan.experiments.graph_trainer import trainer as gt

    gt.run_traced = wrap_run_traced(gt.run_traced)
    # aot_autograd calls fw_compiler first, bw_compiler after: one pass object per direction
    for name in ("transformer_block_bucketing_reordering_pass", "autobucketing_reordering_pass"):
        orig = getattr(jit_backend, name)
        fw, bw = wrap_compiler(orig, lambda n: "forward"), wrap_compiler(orig, lambda n: "backward")

        def pick(gm, example_inputs=None, _fw=fw, _bw=bw, **kw):
            # forward graphs have no tangents: aot_autograd's backward graph's placeholders do
            is_bw = any(n.op == "placeholder" and n.name.startswith("tangents")
                        for n in gm.graph.nodes)
            return (_bw if is_bw else _fw)(gm, example_inputs, **kw)

        setattr(jit_backend, name, pick)

    orig_step = gt.GraphTrainer.forward_backward_step

    def forward_backward_step(self, **kwargs):
        step = STATE["step"] = self.step
        model = self.model_parts[0]
        TRUTH["shards"][step] = {n: local(p) for n, p in model.named_parameters()}
        loss = orig_step(self, **kwargs)
        TRUTH["grads"][step] = {n: local(p.grad) for n, p in model.named_parameters()
                                if p.grad is not None}
        TRUTH["losses"][step] = loss.detach().clone()
        return loss

    gt.GraphTrainer.forward_backward_step = forward_backward_step
    if E("R9C_ORDER") == "graph":
        register_graph_order()


def register_graph_order():
    """A pass pipeline equal to torchtitan's default except that the joint bucketing pass packs
    each bucket in graph order (no ``fsdp_param_module_order``): a layout-only change."""
    from torchtitan.experiments.graph_trainer import passes
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    def pipeline(traced, config, **kwargs):
        out = []
        for p in passes.construct_default_graph_passes(traced, config, **kwargs):
            if isinstance(p, functools.partial) and "fsdp_param_module_order" in p.keywords:
                p = functools.partial(p.func, *p.args,
                                      **dict(p.keywords, fsdp_param_module_order=None))
            out.append(p)
        return out

    PASS_PIPELINE_REGISTRY["r9c_graph_order"] = pipeline


def save():
    prefix = E("R9C_SAVE")
    if not prefix or not dist.is_initialized():
        return
    rank = dist.get_rank()
    TRUTH["world"] = dist.get_world_size()
    torch.save(TRUTH, prefix + (f".{rank}" if rank else ""))


def main():
    cpu._shim_device()
    cpu._shim_gloo()
    cpu._shim_inductor()
    cpu._shim_flex()
    install()
    # torchtitan destroys the process group at the end of main(): save before that
    orig_destroy = dist.destroy_process_group

    def destroy_process_group(*a, **k):
        save()
        return orig_destroy(*a, **k)

    dist.destroy_process_group = destroy_process_group
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
