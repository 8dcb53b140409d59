"""Round 9a trainer: eager bucket manifests against the bytes actually sent (imports nothing from
parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round9a.py   (R9_CASE=fsdp|ddp|dtensor)
    torchrun --standalone --nproc_per_node 4 tests/trainers/round9a.py   (R9_MESH=hsdp|tp)

Ground truth of the wire: a ``TorchDispatchMode`` entered around the training loop sees every
c10d op call (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.allreduce_``,
... - the ProcessGroup methods reach the dispatcher, also those DDP's C++ reducer calls) and
keeps, per call, the op, the step, the group's global ranks and a flat copy of its input
tensor(s) taken before the op runs. A Python ProcessGroup subclass cannot see these calls
(torch 2.13's PyProcessGroup has no ``all_gather_single`` override), so a dispatch mode it is.

With R9_SAVE=PATH each rank saves ``PATH.<rank>`` (torch.save of a dict): ``wire`` (the calls,
in order: ``{"op", "step", "ranks", "inputs": [flat tensors]}``), ``steps`` (per iteration:
``shards``, each parameter's local shard taken before the forward - FSDP2/DTensor: its local
tensor, DDP: the parameter -, ``grads``, each local (sharded) gradient after the backward,
``loss``; ``micro``: with R9_ACCUM, the gradients after each micro-batch; ``pgrads``: the
DTensor gradients right after the backward, ``(local tensor, is Partial)``: a Partial one before
any sum, a Shard(0) one after its backward reduce-scatter),
``final`` (the
local parameters at the end) and ``names`` (parameter names in ``named_parameters`` order).
``steps`` and ``final`` are also the values compared with ``torch.equal`` between runs (with
and without the dispatch mode, with and without parity).

Knobs (environment):
  R9_CASE    fsdp | ddp | dtensor (default fsdp);  R9_STEPS iterations (default 3)
  R9_WIRE=0  no dispatch mode (the job as it would run without the recorder)
  R9_MESH    fsdp: fsdp (1-D, default) | hsdp ((2, 2) replicate x shard) | tp ((2, 2) dp x tp)
  R9_MP      fsdp: none | bf16 (param bf16, reduce fp32) | bf16r (param and reduce bf16)
  R9_RAF     fsdp: reshard_after_forward 1 (default) | 0 | an int (a smaller world after forward)
  R9_UNUSED=1  ``extra`` (a Linear in the root's group / a DDP parameter) unused at step 2
               (DDP: find_unused_parameters=True)
  R9_MIXED=1   ``extra`` in bfloat16 (DDP: a bucket per dtype)
  R9_FROZEN=1  mid.l1.bias frozen (requires_grad False)
  R9_SWAP=1    mid.l2 registered before mid.l1 (same values; another layout)
  R9_SHARD1  fsdp: 1 shard_placement_fn Shard(1) for 2-D parameters whose dim 1 divides evenly,
             2 for every 2-D parameter
  R9_GROUPS  fsdp: layers (l0, mid, l3 each a group, the root holds extra and scale; default) |
             root (one group) | extra (layers, and ``extra`` its own group)
  R9_CAP     ddp: bucket_cap_mb (default 25);  R9_GAV=1 gradient_as_bucket_view;
  R9_STATIC=1  ddp: static_graph
  R9_ACCUM   micro-batches per step (default 1);  R9_NOSYNC=1  DDP no_sync() / FSDP2
             set_requires_gradient_sync(False) on all but the last
  R9_QUIET=k ddp: every micro-batch of step k under no_sync() (that step all-reduces nothing)
  R9_DP=1    dtensor: l0 data parallel with Replicate DTensor parameters (gradients all-reduced
             by DTensor)
  R9_RED     dtensor + R9_DP: how l0's Partial gradients are summed: opt (default: inside the
             optimizer's step, DTensor's implicit all-reduce) | ar (the trainer's own
             ``p.grad = p.grad.redistribute([Replicate()])`` after the backward) | rs (the
             trainer's ``p.grad.redistribute([Shard(0)])``: a reduce-scatter; the optimizer then
             all-gathers the Shard gradient) | rsag (the trainer's reduce-scatter, then its
             all-gather back to Replicate: on 2 ranks bitwise ar's values, another reduction)
  R9_REV=1   the optimizer's parameters in reverse order (the implicit reductions run in it)
  R9_MOM     SGD momentum (default 0.9);  R9_OPT  sgd (default) | sgd_foreach | adam
  R9_STAT=1  dtensor + R9_DP: a batch statistic of l0's output (a Partial activation of
             l0.bias's shape) all-reduced in the forward under no_grad; it changes nothing
  R9_RSB=1   dtensor: l3.w_t's gathered weight leaves its gradient Partial
             (``to_local(grad_placements=[Partial()])``): its backward reduce-scatters it
  R9_HOOK=1  ddp: a communication hook that keeps bucket.buffer() and bucket.parameters()' names
             (``hook`` in the saved dict) and then all-reduces as DDP's default does
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

E = os.environ.get
CASE = E("R9_CASE", "fsdp")
STEPS = int(E("R9_STEPS", "3"))
TRUTH = {"wire": [], "steps": [], "final": None, "names": [], "hook": []}
_INPUT_ARGS = ("input_tensor", "inputs", "input", "input_tensors", "input_tensor_list",
               "tensors", "tensor")


def _flat(x):
    """Flat detached copies of every tensor in ``x`` (a tensor or nested lists)."""
    if isinstance(x, torch.Tensor):
        return [x.detach().reshape(-1).clone()]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


class Wire(TorchDispatchMode):
    """Records each c10d op call's inputs before it runs (the bytes that go on the wire)."""

    step = 0
    in_funcol = False
    active = False

    @staticmethod
    def wrap_funcol():
        """A mode does not see what runs inside an op it handles: DTensor's implicit
        redistributions (a Partial gradient all-reduced inside an op's dispatch) issue their
        functional collectives there. DTensor's placements call them as attributes of
        ``torch.distributed._functional_collectives`` at call time, so wrapping those records
        every one (``ns: "funcol"``); the mode skips the ops they issue (no double count).
        torch 2.13's Shard placement gathers and scatters through ``all_gather_single`` and
        ``reduce_scatter_single`` (an optimizer's implicit all-gather of a Shard gradient)."""
        import torch.distributed._functional_collectives as funcol

        for name, arg in (("all_reduce", 0), ("all_gather_tensor", 0),
                          ("reduce_scatter_tensor", 0), ("all_to_all_single", 0),
                          ("all_gather_single", 0), ("reduce_scatter_single", 0)):
            fn = getattr(funcol, name, None)
            if fn is None:
                continue

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                if Wire.active and not Wire.in_funcol:
                    group = args[2] if len(args) > 2 else kwargs.get("group")
                    ranks = None
                    try:
                        ranks = sorted(int(r) for r in group.mesh.flatten().tolist())
                    except Exception:  # noqa: BLE001 - a group, not a mesh
                        try:
                            ranks = dist.get_process_group_ranks(group)
                        except Exception:  # noqa: BLE001
                            pass
                    TRUTH["wire"].append({"op": _name, "step": Wire.step, "ns": "funcol",
                                          "ranks": ranks, "arg": "self",
                                          "inputs": _flat(args[0])})
                Wire.in_funcol, was = True, Wire.in_funcol
                try:
                    return _fn(*args, **kwargs)
                finally:
                    Wire.in_funcol = was

            setattr(funcol, name, wrapper)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" and Wire.in_funcol:
            pass  # recorded by the funcol wrapper (below)
        elif func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            schema = func._schema
            bound = {a.name: v for a, v in zip(schema.arguments, args)}
            bound.update(kwargs)
            ranks = None
            if isinstance(bound.get("group_name"), str):  # functional collectives
                try:
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    ranks = dist.get_process_group_ranks(
                        _resolve_process_group(bound["group_name"]))
                except Exception:  # noqa: BLE001
                    pass
            for v in bound.values():
                if isinstance(v, torch.ScriptObject):
                    try:
                        ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(v))
                    except Exception:  # noqa: BLE001 - not a process group
                        continue
                    break
            name = next((n for n in _INPUT_ARGS if n in bound), None)
            TRUTH["wire"].append({"op": schema.name.split("::")[-1], "step": self.step,
                                  "ns": func.namespace,
                                  "ranks": ranks, "arg": name,
                                  "inputs": _flat(bound[name]) if name else []})
        return func(*args, **kwargs)


def _local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


class Mid(nn.Module):
    """Two layers in one FSDP2 group; R9_SWAP registers l2 first (a layout-only change)."""

    def __init__(self, l1, l2):
        super().__init__()
        if E("R9_SWAP") == "1":
            self.l2, self.l1 = l2, l1
        else:
            self.l1, self.l2 = l1, l2

    def forward(self, h, extra=None):
        h = torch.tanh(self.l1(h))
        if extra is not None:  # the root's branch, called inside this group's forward
            h = h + 0.5 * extra(h.to(extra.weight.dtype)).to(h.dtype)
        return self.l2(h)


class Net(nn.Module):
    """8 -> 6 -> 5 -> 7 -> 1: every weight and bias needs padding on 2 and 4 ranks (6, 5, 7 and
    1 rows), ``scale`` a one-element loose parameter of the root, ``extra`` a 5 x 5 branch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        ls = [nn.Linear(8, 6), nn.Linear(6, 5), nn.Linear(5, 7), nn.Linear(7, 1),
              nn.Linear(5, 5)]
        self.l0 = ls[0]
        self.mid = Mid(ls[1], ls[2])
        self.l3 = ls[3]
        self.extra = ls[4]
        self.scale = nn.Parameter(torch.ones(1) * 0.9)
        self.use_extra = True
        if E("R9_MIXED") == "1":  # a bf16 branch: DDP buckets parameters per dtype
            self.extra.to(torch.bfloat16)

    def forward(self, x):
        h = self.mid(torch.tanh(self.l0(x)), self.extra if self.use_extra else None)
        return self.l3(torch.tanh(h)) * self.scale


def _data(k, r):
    g = torch.Generator().manual_seed(100 * k + r)
    return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    world = dist.get_world_size()
    kind = E("R9_MESH", "fsdp")
    dp_rank = dist.get_rank()
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    elif kind == "tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, full["tp"], {"l0": ColwiseParallel(),
                                               "mid.l1": RowwiseParallel()})
        mesh = full["dp"]
        dp_rank = full["dp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (world,))
    kw = {"mesh": mesh}
    mp = E("R9_MP", "none")
    if mp != "none":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16 if mp == "bf16r" else torch.float32)
    raf = E("R9_RAF", "1")
    kw["reshard_after_forward"] = {"1": True, "0": False}[raf] if raf in "01" else int(raf)
    if E("R9_SHARD1") in ("1", "2"):  # 2: every 2-D parameter, uneven ones too
        n, every = mesh.size(), E("R9_SHARD1") == "2"
        kw["shard_placement_fn"] = lambda p: (
            Shard(1) if p.ndim == 2 and (every or p.shape[1] % n == 0) else Shard(0))
    if E("R9_FROZEN") == "1":
        model.mid.l1.bias.requires_grad_(False)
    if E("R9_GROUPS", "layers") in ("layers", "extra"):
        mods = (model.l0, model.mid, model.l3)
        if E("R9_GROUPS") == "extra":  # the branch its own group: unused, its collectives go
            mods = (model.l0, model.extra, model.mid, model.l3)
        for m in mods:
            fully_shard(m, **kw)
    root_kw = dict(kw)
    if isinstance(root_kw["reshard_after_forward"], int) and \
            not isinstance(root_kw["reshard_after_forward"], bool):
        root_kw["reshard_after_forward"] = True
    fully_shard(model, **root_kw)
    return model, dp_rank


def _ddp(model):
    kw = {"bucket_cap_mb": float(E("R9_CAP", "25")),
          "gradient_as_bucket_view": E("R9_GAV") == "1",
          "static_graph": E("R9_STATIC") == "1",
          "find_unused_parameters": E("R9_UNUSED") == "1"}
    if E("R9_FROZEN") == "1":
        model.mid.l1.bias.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(model, **kw)
    if E("R9_HOOK") == "1":
        by_id = {id(p): n for n, p in model.named_parameters()}

        def hook(state, bucket):
            TRUTH["hook"].append({"step": Wire.step, "index": bucket.index(),
                                  "buffer": bucket.buffer().detach().clone(),
                                  "params": [by_id[id(p)] for p in bucket.parameters()]})
            buf = bucket.buffer().div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(
                lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
    return ddp, dist.get_rank()


def _dtensor(model):
    """The root's ``scale`` and l3.weight made DTensors Shard(0) on the 1-D mesh, each
    redistributed to Replicate in the forward (an eager DTensor all-gather of a parameter); the
    rest replicated plain tensors whose gradients the trainer all-reduces by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = nn.Parameter(distribute_tensor(model.l3.weight.detach().t().contiguous(), mesh,
                                       [Shard(0)]))
    del model.l3.weight
    model.l3.w_t = w

    def l3_forward(h, _m=model.l3):
        from torch.distributed.tensor import Partial

        gp = [Partial()] if E("R9_RSB") == "1" else None
        full = _m.w_t.redistribute(mesh, [Replicate()]).to_local(grad_placements=gp)
        return h @ full + _m.bias

    model.l3.forward = l3_forward
    if E("R9_DP") == "1":  # l0 data parallel the DTensor way: Replicate parameters, the batch
        # Shard(0); their gradients come back Partial and are all-reduced by DTensor
        for name in ("weight", "bias"):
            p = getattr(model.l0, name)
            delattr(model.l0, name)
            model.l0.register_parameter(name, nn.Parameter(distribute_tensor(
                p.detach(), mesh, [Replicate()])))

        def l0_forward(x, _m=model.l0):
            from torch.distributed.tensor import DTensor

            xd = DTensor.from_local(x, mesh, [Shard(0)])
            h = torch.nn.functional.linear(xd, _m.weight, _m.bias)
            if E("R9_STAT") == "1":  # a Partial activation of l0.bias's shape, summed
                with torch.no_grad():
                    TRUTH.setdefault("stat", []).append(
                        h.detach().sum(0).redistribute(mesh, [Replicate()]).to_local().clone())
            return h.to_local()

        model.l0.forward = l0_forward
    return model, dist.get_rank()


def main():
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    model = Net()
    wrapped, dp_rank = {"fsdp": _fsdp, "ddp": _ddp, "dtensor": _dtensor}[CASE](model)
    named = list(model.named_parameters())
    TRUTH["names"] = [n for n, _ in named]
    trained = [p for _, p in named if p.requires_grad]
    trained = trained[::-1] if E("R9_REV") == "1" else trained
    if E("R9_OPT") == "adam":
        opt = torch.optim.Adam(trained, lr=0.01, foreach=False)
    else:
        opt = torch.optim.SGD(trained, lr=0.05, momentum=float(E("R9_MOM", "0.9")),
                              foreach=True if E("R9_OPT") == "sgd_foreach" else None)
    mode = Wire() if E("R9_WIRE", "1") == "1" else None
    if mode is not None:
        Wire.wrap_funcol()
        Wire.active = True
        mode.__enter__()
    for k in range(1, STEPS + 1):
        Wire.step = k
        model.use_extra = not (E("R9_UNUSED") == "1" and k == 2)
        shards = {n: _local(p) for n, p in named}
        opt.zero_grad()
        micro = int(E("R9_ACCUM", "1"))
        micro_grads = []  # the gradients after each micro-batch's backward
        for j in range(micro):  # micro-batches; R9_NOSYNC=1: DDP no_sync() but on the last
            x, y = _data(10 * k + j, dp_rank)
            quiet = (E("R9_NOSYNC") == "1" and j < micro - 1) or \
                (CASE == "ddp" and E("R9_QUIET") == str(k))
            if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
                wrapped.set_requires_gradient_sync(not quiet)
            with wrapped.no_sync() if quiet and hasattr(wrapped, "no_sync") else \
                    contextlib.nullcontext():
                loss = ((wrapped(x) - y) ** 2).mean()
                loss.backward()
            micro_grads.append({n: None if p.grad is None else _local(p.grad) for n, p in named})
        pgrads = {n: (_local(p.grad), p.grad.placements[0].is_partial()) for n, p in named
                  if p.grad is not None and hasattr(p.grad, "to_local")}
        if CASE == "dtensor" and E("R9_RED", "opt") != "opt":  # l0's Partial gradients
            from torch.distributed.tensor import Replicate, Shard

            for _, p in named:
                if hasattr(p.grad, "placements") and p.grad.placements[0].is_partial():
                    p.grad = p.grad.redistribute(placements=[
                        Replicate() if E("R9_RED") == "ar" else Shard(0)])
                    if E("R9_RED") == "rsag":
                        p.grad = p.grad.redistribute(placements=[Replicate()])
        if CASE == "dtensor":  # the plain tensors' gradients: averaged by hand, one by one
            for _, p in named:
                if p.grad is not None and not hasattr(p.grad, "to_local"):
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
        TRUTH["steps"].append({"shards": shards, "loss": loss.detach().clone(), "pgrads": pgrads,
                               "micro": micro_grads if micro > 1 else None,
                               "grads": {n: None if p.grad is None else _local(p.grad)
                                         for n, p in named}})
        opt.step()
    if mode is not None:
        mode.__exit__(None, None, None)
        Wire.active = False
    TRUTH["final"] = {n: _local(p) for n, p in named}
    if E("R9_SAVE"):
        torch.save(TRUTH, f"{E('R9_SAVE')}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
