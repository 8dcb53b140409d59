"""Round 12a trainer: reductions outside the gradient reduce-scatter / all-reduce that change
every parameter (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round12a.py   (R12A_* knobs below)

Gradient-norm clipping (the total norm is all-reduced across ranks, then every gradient is
multiplied by ``max_norm / (norm + 1e-6)`` where that is below 1) and global token
normalisation (the loss divided by the token weight summed over every rank, torchtitan's
``global_valid_tokens``). A one-ulp difference in either scalar's sum changes every parameter,
though no gradient's own reduction changed.

With R12A_SAVE=PATH each rank saves ``PATH.<rank>`` (torch.save of a dict): ``steps`` (per
step: ``loss``, ``norm`` (the total norm the clip used, or None), ``tokens`` (the global token
weight, or None), ``grads`` (each local gradient after the clip), ``shards`` (each local
parameter before the step)), ``final`` (local parameters at the end), ``opt`` (the optimizer's
state dict), ``names``. Compared with ``torch.equal`` between runs.

Knobs (environment):
  R12A_MESH     fsdp (1-D FSDP2 over the world, default) | hsdp ((2, 2): replicate x shard, 4
                ranks) | ddp (DDP, plain tensors)
  R12A_STEPS    steps (default 3);  R12A_SEED  the data's seed (default 0)
  R12A_CLIP     none (default) | torch (``torch.nn.utils.clip_grad_norm_``: over DTensor
                gradients the norm is a Partial DTensor, all-reduced by DTensor when the
                clip coefficient meets the gradients) | titan (torchtitan 0.3.0's
                ``torchtitan.distributed.utils.clip_grad_norm_``: ``full_tensor()`` of the norm)
                | hand (the local shards' ``norm ** p`` summed by a hand-written
                ``dist.all_reduce`` over the world, MAX for inf; DDP's way, also over FSDP2's
                local shards)
  R12A_NORM     2 (default) | inf
  R12A_MAXNORM  max_norm (default 0.05: clipping active; 100: inactive)
  R12A_FOREACH  none (default) | 1 | 0
  R12A_COMPILE=1  torch's clip under torch.compile(backend="aot_eager"); dynamo's counters saved
  R12A_PORDER=rev  the parameters handed to the clip in reverse order (the optimizer's order
                unchanged): the per-parameter norms the clip's all-reduce carries in reverse
  R12A_VEC=1    hand clip: one all-reduce of the vector of per-parameter norms ** p (as
                DTensor's foreach clip sends them), summed locally in the parameters' order; with
                R12A_PORDER=rev that vector goes on the wire reversed and is put back after
                (gloo sums elementwise: the same values; NCCL's ring sums each chunk in its own
                rank order)
  R12A_SPLIT=1  hand clip under hsdp: the norm summed over the whole world and halved (each
                shard is held by two replicas) instead of over the shard group
  R12A_TOK      none (default) | world (each rank's token weight, a float, all-reduced with a
                hand-written ``dist.all_reduce`` over the world; the loss is the weighted sum over
                it) | split (hsdp: over the shard group, then the replicate group) | rsplit
                (replicate group first) | titan (torchtitan's ``dist_sum``: a functional
                all-reduce, run eagerly, over a flattened mesh)
  R12A_LOG=1    a logging-only all-reduce of the loss (detached copy; changes nothing)
  R12A_LOGFIRST=1  with R12A_LOG: the logging all-reduce before the token all-reduce
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
MESH = E("R12A_MESH", "fsdp")
STEPS = int(E("R12A_STEPS", "3"))
TRUTH = {"steps": []}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank + 100000 * int(E("R12A_SEED", "0")))
    n = 6 + rank  # uneven token counts per rank
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    w = torch.rand(n, generator=g) * 0.7 + 0.1  # per-token weights: a non-integer count
    return x, y, w


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _groups():
    """(world group, shard group, replicate group, mesh) for the knobs' mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if MESH == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        return mesh, mesh.get_group("shard"), mesh.get_group("rep")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return mesh, mesh.get_group("dp"), None


def _wrap(model, mesh):
    if MESH == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.fsdp import fully_shard

    for m in (model.l0, model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _foreach():
    f = E("R12A_FOREACH", "none")
    return None if f == "none" else f == "1"


def _norm_type():
    return math.inf if E("R12A_NORM", "2") == "inf" else float(E("R12A_NORM", "2"))


def _hand_clip(params, max_norm, p, shard_g, rep_g):
    """DDP's way: the local gradients' norm ** p summed (MAX for inf) by the trainer's own
    all-reduce, then every gradient scaled by the clip coefficient."""
    grads = [_local(q.grad) for q in params if q.grad is not None]
    norms = [torch.linalg.vector_norm(g, p) for g in grads]
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    if E("R12A_VEC") == "1":  # one all-reduce of the per-parameter norm ** p, as DTensor's
        vec = torch.stack(norms if math.isinf(p) else [n ** p for n in norms])
        rev = E("R12A_PORDER") == "rev"  # the vector on the wire in reverse, put back after
        vec = vec.flip(0).contiguous() if rev else vec
        if rep_g is None or E("R12A_SPLIT") == "1":
            dist.all_reduce(vec, op=op)
        else:
            dist.all_reduce(vec, op=op, group=shard_g)
        vec = vec.flip(0) if rev else vec
        total = vec[0].clone()
        for v in vec[1:]:  # summed in the parameters' order, one add at a time
            total = torch.maximum(total, v) if math.isinf(p) else total + v
        norm = total if math.isinf(p) else total ** (1.0 / p)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for q in params:
            if q.grad is not None:
                q.grad.mul_(coef)
        return norm
    if math.isinf(p):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n ** p for n in norms]).sum()
    if MESH != "ddp":  # FSDP2's shards: a sum over the ranks (DDP's grads are replicated)
        if E("R12A_SPLIT") == "1" and rep_g is not None:
            dist.all_reduce(total, op=op)  # every shard twice (two replicas): halved, exact
            total = total if math.isinf(p) else total / 2
        elif rep_g is not None:  # HSDP: the replicas hold the same shards: the shard group
            dist.all_reduce(total, op=op, group=shard_g)
        else:
            dist.all_reduce(total, op=op)
    norm = total if math.isinf(p) else total ** (1.0 / p)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for q in params:
        if q.grad is not None:
            q.grad.mul_(coef)  # a DTensor gradient times a plain scalar: its local shard scaled
    return norm


_COMPILED = []


def _torch_clip():
    """torch's clip, or with R12A_COMPILE=1 the same under ``torch.compile(backend=
    "aot_eager")`` (dynamo traces the clip: nothing of a wrapper around it may enter the
    graph or cause a recompile; dynamo's counters are saved as ``dynamo``)."""
    if E("R12A_COMPILE") != "1":
        return torch.nn.utils.clip_grad_norm_
    if not _COMPILED:
        _COMPILED.append(torch.compile(torch.nn.utils.clip_grad_norm_, backend="aot_eager"))
    return _COMPILED[0]


def _clip(params, shard_g, rep_g):
    kind = E("R12A_CLIP", "none")
    max_norm, p = float(E("R12A_MAXNORM", "0.05")), _norm_type()
    if kind == "none":
        return None
    if kind == "torch":
        norm = _torch_clip()(params, max_norm, norm_type=p, foreach=_foreach())
    elif kind == "titan":
        from torchtitan.distributed.utils import clip_grad_norm_

        norm = clip_grad_norm_(params, max_norm, norm_type=p, foreach=_foreach())
    else:
        norm = _hand_clip(params, max_norm, p, shard_g, rep_g)
    return _local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _tokens(w, mesh, shard_g, rep_g):
    """The global token weight (None: the loss is the local mean)."""
    kind = E("R12A_TOK", "none")
    if kind == "none":
        return None
    t = w.sum().detach().clone()
    if kind == "titan":
        from torchtitan.distributed.utils import dist_sum

        flat = mesh._flatten("batch") if mesh.ndim > 1 else mesh
        return torch.tensor(dist_sum(t, flat), dtype=t.dtype)
    if kind == "world" or rep_g is None:
        dist.all_reduce(t)
    elif kind == "split":
        dist.all_reduce(t, group=shard_g)
        dist.all_reduce(t, group=rep_g)
    else:  # rsplit
        dist.all_reduce(t, group=rep_g)
        dist.all_reduce(t, group=shard_g)
    return t


def _log(loss):
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def main():
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    mesh, shard_g, rep_g = _groups()
    model = Net()
    wrapped = _wrap(model, mesh)
    named = list(model.named_parameters())
    TRUTH["names"] = [n for n, _ in named]
    params = [p for _, p in named]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    for k in range(1, STEPS + 1):
        shards = {n: _local(p) for n, p in named}
        opt.zero_grad()
        x, y, w = _data(k, rank)
        logged = None
        if E("R12A_LOG") == "1" and E("R12A_LOGFIRST") == "1":
            logged = _log(torch.tensor(float(k)))
        tokens = _tokens(w, mesh, shard_g, rep_g)
        per = ((wrapped(x) - y) ** 2).mean(dim=1)
        if tokens is None:
            loss = per.mean()
        else:
            # the global mean: each rank's weighted sum over the global weight, times the
            # ranks the gradient reduction averages over (FSDP2 / DDP divide by the world)
            loss = (per * w).sum() / tokens * dist.get_world_size()
        loss.backward()
        if E("R12A_LOG") == "1" and E("R12A_LOGFIRST") != "1":
            logged = _log(loss)
        TRUTH.setdefault("logged", []).append(logged)  # not among the values compared
        rev = E("R12A_PORDER") == "rev" and E("R12A_VEC") != "1"
        norm = _clip(params[::-1] if rev else params, shard_g, rep_g)
        TRUTH["steps"].append({"loss": loss.detach().clone(), "norm": norm, "tokens": tokens,
                               "grads": {n: None if p.grad is None else _local(p.grad)
                                         for n, p in named}, "shards": shards})
        opt.step()
    TRUTH["final"] = {n: _local(p) for n, p in named}
    TRUTH["opt"] = {i: {k: _local(v) if torch.is_tensor(v) else v for k, v in s.items()}
                    for i, s in opt.state_dict()["state"].items()}
    if E("R12A_COMPILE") == "1":
        from torch._dynamo.utils import counters

        TRUTH["dynamo"] = {k: dict(v) for k, v in counters.items()
                           if k in ("stats", "graph_break", "frames")}
    if E("R12A_SAVE"):
        torch.save(TRUTH, f"{E('R12A_SAVE')}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
