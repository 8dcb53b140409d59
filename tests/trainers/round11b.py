"""Round 11b trainer: mixture-of-experts with expert parallelism, the way torchtitan's
DeepSeek-V3 / Llama4 run it, on 4 ranks (gloo); imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/round11b.py

Model: tied input/output embeddings (``tok.weight`` is also the output projection), per block a
dense ``wq`` and a MoE: a router (top-1 of ``E`` experts), grouped experts held as 3-D
parameters (``w1`` [e, H, D], ``w2`` [e, D, H], ``w3`` [e, H, D]: the rank's ``e`` local
experts, as torchtitan's GroupedExperts) and a shared expert (two Linears). Expert parallel over
``ep`` (2): the ranks are a 2-D mesh (efsdp, ep) = (2, 2); rank r holds experts
``[ep_rank * e, (ep_rank + 1) * e)``; tokens go to the rank owning their expert and back with
all_to_all_single of uneven splits (counts exchanged first). The experts are sharded by FSDP2
over the efsdp group (ranks {0, 2} and {1, 3}), every other parameter over all 4 ranks.

Ground truth: the round 9a recorder (tests/trainers/round9a.py's ``Wire``: a dispatch mode that
keeps every c10d op's input before it runs; the funcol wrapper for functional collectives), and
per step each parameter's local shard before the forward, its local gradient after the backward
and the loss; ``final`` the local parameters at the end. R11_SAVE=PATH saves ``PATH.<rank>``.

Knobs (environment):
  R11_STYLE  pp (default: torchtitan 0.3.0, one ``fully_shard`` per block whose
             ``shard_placement_fn`` returns ``ShardPlacementResult`` with the efsdp mesh for the
             experts: one FSDP state, two param groups) | sep (``fully_shard(moe.experts,
             mesh=edp_mesh)`` then the block on the dense mesh: torchtitan's earlier way)
  R11_SHARD1=1  the experts Shard(1) (torchtitan when efsdp * ep > num experts); with
             R11_E=2 (one expert a rank) as torchtitan would choose it
  R11_E      number of experts (default 4)
  R11_EORDER=rev  the experts' parameters registered in another order (w3, w2, w1)
  R11_DORDER=rev  the shared expert registered before the router (a dense group's layout)
  R11_A2A    funcol (default: ``all_to_all_single_autograd``) | c10d (``dist.all_to_all_single``
             in an autograd Function) | perm (funcol; each destination's tokens sent in reverse
             order, the receiver puts them back: another payload order, same tokens) | perm2
             (each expert's tokens sent reversed and left so: the experts see them in another
             order, the same tokens; the combine puts them back)
  R11_DIV=titan  torchtitan's gradient scaling: ``set_gradient_divide_factor(1.0)`` on every
             FSDP module and the loss divided by the dense world instead
  R11_MESH=t  the 2-D mesh transposed (ep outer): the same group sizes, other ranks
  R11_STEPS  iterations (default 2);  R11_WIRE=0  no recorder;  R11_BLOCKS  (default 1)
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from round9a import TRUTH, Wire, _local  # noqa: E402 - round 9a's recorder, reused

E = os.environ.get
STEPS = int(E("R11_STEPS", "2"))
A2A = E("R11_A2A", "funcol")
D, H, V, T = 8, 6, 16, 12  # dim, expert hidden, vocab, tokens per rank


def _a2a(x, out_splits, in_splits, group):
    """Token exchange (autograd): funcol's autograd all_to_all_single, or c10d's."""
    if A2A == "c10d":
        return _C10dA2A.apply(x, out_splits, in_splits, group)
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    return funcol.wait_tensor(y) if hasattr(y, "wait") else y


class _C10dA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.s = (out_splits, in_splits, group)
        y = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, group = ctx.s
        y = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(y, g.contiguous(), in_splits, out_splits, group=group)
        return y, None, None, None


class Experts(nn.Module):
    """The rank's local experts, 3-D parameters (grouped experts)."""

    def __init__(self, n_local, first):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        full = {k: torch.randn(s, generator=g) * 0.3 for k, s in
                (("w1", (NE, H, D)), ("w2", (NE, D, H)), ("w3", (NE, H, D)))}
        names = ("w3", "w2", "w1") if E("R11_EORDER") == "rev" else ("w1", "w2", "w3")
        for k in names:
            self.register_parameter(k, nn.Parameter(full[k][first:first + n_local].clone()))

    def forward(self, x, counts):
        outs, start = [], 0
        for i, n in enumerate(counts):
            xi = x[start:start + n]
            h = F.silu(xi @ self.w1[i].t()) * (xi @ self.w3[i].t())
            outs.append(h @ self.w2[i].t())
            start += n
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    def __init__(self, ep_group, ep_rank, ep):
        super().__init__()
        self.ep_group, self.ep = ep_group, ep
        self.n_local = NE // ep
        router = nn.Linear(D, NE, bias=False)
        experts = Experts(self.n_local, ep_rank * self.n_local)
        shared = (nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False))
        if E("R11_DORDER") == "rev":  # the shared expert registered first (dense layout)
            self.shared_w1, self.shared_w2 = shared
        self.router, self.experts = router, experts
        self.shared_w1, self.shared_w2 = shared

    def forward(self, x):
        scores = torch.softmax(self.router(x), -1)
        top, eid = scores.max(-1)  # top-1
        order = torch.argsort(eid, stable=True)
        counts = torch.bincount(eid, minlength=NE)
        xs = x[order]
        # the count exchange (no grad), then the uneven token exchange
        send = counts.view(self.ep, self.n_local)
        recv = torch.empty_like(send)
        with torch.no_grad():
            dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        if A2A == "perm":  # each destination's tokens in reverse order
            xs = torch.cat([c.flip(0) for c in xs.split(in_splits)])
        if A2A == "perm2":  # each expert's tokens in reverse order, left so at the expert
            xs = torch.cat([c.flip(0) for c in xs.split(counts.tolist())])
        got = _a2a(xs, out_splits, in_splits, self.ep_group)
        if A2A == "perm":
            got = torch.cat([c.flip(0) for c in got.split(out_splits)])
        # rank-major (peer, local expert) -> expert-major
        chunks = got.split(recv.reshape(-1).tolist())
        idx = [p * self.n_local + e for e in range(self.n_local) for p in range(self.ep)]
        grouped = torch.cat([chunks[i] for i in idx])
        y = self.experts(grouped, [int(recv[:, e].sum()) for e in range(self.n_local)])
        # back to rank-major, then home
        sizes = [int(recv.reshape(-1)[i]) for i in idx]
        back = dict(zip(idx, y.split(sizes)))
        y = torch.cat([back[i] for i in range(self.ep * self.n_local)])
        if A2A == "perm":
            y = torch.cat([c.flip(0) for c in y.split(out_splits)])
        home = _a2a(y, in_splits, out_splits, self.ep_group)
        if A2A == "perm":
            home = torch.cat([c.flip(0) for c in home.split(in_splits)])
        if A2A == "perm2":
            home = torch.cat([c.flip(0) for c in home.split(counts.tolist())])
        out = torch.empty_like(home)
        out[order] = home
        shared = self.shared_w2(F.silu(self.shared_w1(x)))
        return out * top.unsqueeze(-1) + shared


class Block(nn.Module):
    def __init__(self, ep_group, ep_rank, ep):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(D))
        self.wq = nn.Linear(D, D)
        self.moe = MoE(ep_group, ep_rank, ep)

    def forward(self, h):
        h = h + torch.tanh(self.wq(h * self.norm))
        return h + self.moe(h)


class Net(nn.Module):
    def __init__(self, ep_group, ep_rank, ep, blocks):
        super().__init__()
        torch.manual_seed(1)
        self.tok = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(ep_group, ep_rank, ep) for _ in range(blocks)])
        self.out_norm = nn.Parameter(torch.ones(D))

    def forward(self, ids):
        h = self.tok(ids)
        for b in self.layers:
            h = b(h)
        return (h * self.out_norm) @ self.tok.weight.t()  # tied output projection


def _shard(model, world_mesh, dense_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    edp = world_mesh["efsdp"]
    expert_place = Shard(1) if E("R11_SHARD1") == "1" else Shard(0)
    for b in model.layers:
        ex = b.moe.experts
        if E("R11_STYLE", "pp") == "sep":
            fully_shard(ex, mesh=edp, shard_placement_fn=(lambda p: expert_place))
            fully_shard(b, mesh=dense_mesh)
        else:
            from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
            from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

            einfo, dinfo = _get_mesh_info(edp), _get_mesh_info(dense_mesh)
            eparams = set(ex.parameters())

            def fn(p, _e=eparams, _ei=einfo, _di=dinfo):
                if p in _e:
                    return ShardPlacementResult(placement=expert_place, mesh_info=_ei)
                return ShardPlacementResult(placement=Shard(0), mesh_info=_di)

            fully_shard(b, mesh=dense_mesh, shard_placement_fn=fn)
    fully_shard(model, mesh=dense_mesh)
    if E("R11_DIV") == "titan":
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)


def main():
    global NE
    NE = int(E("R11_E", "4"))
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    ep = 2
    if E("R11_MESH") == "t":  # ep the outer dim: ep groups {0, 2}, {1, 3}; efsdp {0, 1}, {2, 3}
        mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "efsdp"))
    else:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ep_rank = mesh["ep"].get_local_rank()
    model = Net(mesh["ep"].get_group(), ep_rank, ep, int(E("R11_BLOCKS", "1")))
    _shard(model, mesh, dense)
    named = list(model.named_parameters())
    TRUTH["names"] = [n for n, _ in named]
    opt = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    rec = E("R11_WIRE", "1") == "1"
    mode = Wire() if rec else None
    if rec:
        Wire.wrap_funcol()
        Wire.active = True
        mode.__enter__()
    for k in range(1, STEPS + 1):
        Wire.step = k
        g = torch.Generator().manual_seed(100 * k + dist.get_rank())
        ids = torch.randint(0, V, (T,), generator=g)
        tgt = torch.randint(0, V, (T,), generator=g)
        shards = {n: _local(p) for n, p in named}
        opt.zero_grad()
        loss = F.cross_entropy(model(ids), tgt)
        (loss / world if E("R11_DIV") == "titan" else loss).backward()
        TRUTH["steps"].append({"shards": shards, "loss": loss.detach().clone(), "pgrads": {},
                               "micro": None,
                               "grads": {n: None if p.grad is None else _local(p.grad)
                                         for n, p in named}})
        opt.step()
    if rec:
        mode.__exit__(None, None, None)
        Wire.active = False
    TRUTH["final"] = {n: _local(p) for n, p in named}
    if E("R11_SAVE"):
        torch.save(TRUTH, f"{E('R11_SAVE')}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
