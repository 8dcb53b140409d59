"""Round 14a trainer: collectives whose groups or layouts differ only on ranks other than the
lowest (imports nothing from parity).

    torchrun --standalone --nproc_per_node 6 tests/trainers/round14a.py   (R14A_* knobs below)

Three Linear layers (``l0``, ``l1``, ``l2``), SGD, a few steps. A mesh or grouping is written
as rows of global ranks: ``0,1/2,3/4,5`` is three groups of two (as a 2-D mesh: 3 rows, 2
columns; a row is a shard group, a column a replicate group).

With R14A_SAVE=PATH each rank saves ``PATH.<rank>`` (torch.save of a dict): ``steps`` (per step:
``loss``, ``tokens`` (the all-reduced token count or None), ``grads`` (each local gradient after
the reduction), ``params`` (each local parameter before the step)), ``final``, ``names``.
Compared with ``torch.equal`` between runs (the ground truth).

Knobs (environment):
  R14A_STEPS  steps (default 2);  R14A_SEED  the data's seed (default 0)
  R14A_SAME=1  every rank takes rank 0's data (sums over any groups of one size are then equal,
              bitwise, whichever ranks they hold)
  R14A_MODE   hand (default: a replicated model; the gradients flattened into one vector and
              all-reduced by ``dist.all_reduce`` over R14A_GROUPS, or the world) |
              hsdp (FSDP2 over a 2-D DeviceMesh of R14A_MESH: rows shard, columns replicate) |
              fsdp (FSDP2 over the rows of R14A_MESH only: each row an independent replica) |
              ddp (DDP over the row the rank is in, ``bucket_cap_mb`` tiny: one bucket per
              gradient or so)
  R14A_MESH   rows of ranks (default ``0,1,2/3,4,5``)
  R14A_GROUPS rows of ranks for hand mode's gradient all-reduce (default: the world)
  R14A_TOK    rows of ranks: the local token count (a float) all-reduced over the rank's row of
              this grouping by ``dist.all_reduce`` on a ``dist.new_group``, the loss divided by it
              (default: none, the local mean)
  R14A_REORDER_FROM=k  ranks >= k register the layers in the reverse order (``l2``, ``l1``,
              ``l0``), loaded with the same values: FSDP2's bucket, DDP's buckets and hand mode's
              flat vector carry the gradients in another order on those ranks only
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R14A_STEPS", "2"))
TRUTH = {"steps": []}


class Net(nn.Module):
    def __init__(self, reverse: bool = False):
        super().__init__()
        dims = {"l0": (8, 16), "l1": (16, 16), "l2": (16, 4)}
        for name in (reversed(list(dims)) if reverse else dims):
            setattr(self, name, nn.Linear(*dims[name]))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


def _rows(spec: str) -> list[list[int]]:
    return [[int(x) for x in row.split(",")] for row in spec.split("/")]


def _model(rank: int) -> Net:
    torch.manual_seed(0)
    ref = Net()
    k = E("R14A_REORDER_FROM")
    model = Net(reverse=k is not None and rank >= int(k))
    model.load_state_dict(ref.state_dict())
    return model


def _data(step: int, rank: int):
    if E("R14A_SAME") == "1":
        rank = 0
    g = torch.Generator().manual_seed(1000 * step + rank + 100000 * int(E("R14A_SEED", "0")))
    n = 6
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


_GROUPS: dict = {}


def _my_group(spec: str, rank: int):
    """The ``new_group`` of the row holding ``rank`` (every rank creates every row's group, in
    order, as ``new_group`` requires)."""
    if spec not in _GROUPS:
        mine = None
        for row in _rows(spec):
            g = dist.new_group(row)
            if rank in row:
                mine = g
        _GROUPS[spec] = mine
    return _GROUPS[spec]


def _mesh_2d(rank: int):
    from torch.distributed.device_mesh import DeviceMesh

    rows = _rows(E("R14A_MESH", "0,1,2/3,4,5"))
    return DeviceMesh("cpu", torch.tensor(rows), mesh_dim_names=("replicate", "shard"))


def _wrap(model: nn.Module, rank: int):
    mode = E("R14A_MODE", "hand")
    if mode == "hand":
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, process_group=_my_group(E("R14A_MESH", "0,1,2/3,4,5"), rank),
                   bucket_cap_mb=0.0005)
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh_2d(rank)
    if mode == "fsdp":
        mesh = mesh["shard"]
    elif mode != "hsdp":
        raise SystemExit(f"R14A_MODE={mode}?")
    fully_shard(model, mesh=mesh)
    return model


def _reduce_grads(model: nn.Module, rank: int) -> None:
    if E("R14A_MODE", "hand") != "hand":
        return
    spec = E("R14A_GROUPS")
    group = _my_group(spec, rank) if spec else None
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    off = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


def _tokens(n: int, rank: int):
    spec = E("R14A_TOK")
    if not spec:
        return None
    t = torch.tensor(float(n))
    dist.all_reduce(t, group=_my_group(spec, rank))
    return t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _wrap(_model(rank), rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = getattr(model, "module", model)
    names = sorted(n for n, _ in inner.named_parameters())
    by_name = dict(inner.named_parameters())
    for step in range(1, STEPS + 1):
        x, y = _data(step, rank)
        params = [_local(by_name[n]).detach().clone() for n in names]
        tok = _tokens(x.shape[0], rank)
        per_tok = ((model(x) - y) ** 2).mean(dim=1)
        loss = per_tok.sum() / tok if tok is not None else per_tok.mean()
        loss.backward()
        _reduce_grads(inner, rank)
        grads = [_local(by_name[n].grad).detach().clone() for n in names]
        opt.step()
        opt.zero_grad()
        TRUTH["steps"].append({"loss": loss.detach().clone(), "tokens": tok, "grads": grads,
                               "params": params})
    TRUTH["final"] = [_local(by_name[n]).detach().clone() for n in names]
    TRUTH["names"] = names
    if E("R14A_SAVE"):
        torch.save(TRUTH, f"{E('R14A_SAVE')}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
