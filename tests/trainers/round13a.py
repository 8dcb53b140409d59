"""Round 13a trainer: functional collectives (``torch.distributed._functional_collectives``) run
eagerly, outside any graph, on plain tensors (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round13a.py   (R13A_* knobs below)

A replicated model whose gradients the trainer all-reduces itself (one ``dist.all_reduce`` per
gradient, SUM); the loss is the per-token weighted sum divided by the global token weight (a
float summed over ranks: torchtitan's ``global_valid_tokens``), so a one-ulp change in that sum
changes every parameter.

With R13A_SAVE=PATH each rank saves ``PATH.<rank>`` (torch.save of a dict): ``steps`` (per
step: ``loss``, ``tokens`` (the global token weight or None), ``logged`` (the logged value or
None), ``grads`` (each gradient after the reduction), ``shards`` (each parameter before the
step)), ``final`` (parameters at the end), ``opt`` (the optimizer's state dict), ``names``.
Compared with ``torch.equal`` between runs.

Knobs (environment):
  R13A_STEPS  steps (default 3);  R13A_SEED  the data's seed (default 0)
  R13A_TOK    none (default; the loss is the local mean) | c10d (a hand-written
              ``dist.all_reduce`` over the world) | funcol (``funcol.all_reduce(t, "sum",
              group=WORLD)``, waited) | titan (torchtitan 0.3.0's ``dist_sum`` over a 1-D world
              mesh) | sub (``funcol.all_reduce`` over mesh dimension 1 of a (2, world/2) mesh,
              times 2: the same value in exact arithmetic when the two halves' weights sum
              alike, which they do not exactly) | max (``funcol.all_reduce(t, "max")``) |
              coal (``funcol.all_reduce_coalesced([t, t * 0.5], "sum")``, the first used) |
              compiled (``funcol.all_reduce`` inside a ``torch.compile``d function, aot_eager;
              dynamo's counters saved as ``dynamo``)
  R13A_MIRROR=1  rank r takes rank r % 2's data: with R13A_TOK=sub on 4 ranks the sub-group's
              sum doubled is the world's sum in exact arithmetic (a + b + a + b)
  R13A_LOG    none (default) | funcol (a logging-only ``funcol.all_reduce`` of the detached
              loss, AVG, kept in ``logged``) | titanmax (torchtitan's ``dist_max`` of it)
  R13A_GRAD   c10d (default: one ``dist.all_reduce`` per gradient) | funcol (one
              ``funcol.all_reduce`` per gradient) | rs (the gradients flattened, padded,
              reduce-scattered with ``funcol.reduce_scatter_tensor`` and all-gathered back
              with ``funcol.all_gather_tensor``: a hand-written ZeRO-like reduction)
"""

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R13A_STEPS", "3"))
TRUTH = {"steps": []}
warnings.filterwarnings("ignore", category=FutureWarning)  # funcol's *_tensor deprecations


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l1(torch.tanh(self.l0(x)))


def _data(step, rank):
    if E("R13A_MIRROR") == "1":
        rank = rank % 2  # ranks 2 and 3 hold ranks 0 and 1's data
    g = torch.Generator().manual_seed(1000 * step + rank + 100000 * int(E("R13A_SEED", "0")))
    n = 5 + rank  # uneven token counts per rank
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    w = torch.rand(n, generator=g) * 0.7 + 0.1  # per-token float weights
    return x, y, w


_MESH = {}


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESH:
        _MESH[shape] = init_device_mesh("cpu", shape)
    return _MESH[shape]


def _tokens(w):
    kind = E("R13A_TOK", "none")
    if kind == "none":
        return None
    t = w.sum().detach().clone()
    if kind == "c10d":
        dist.all_reduce(t)
        return t
    if kind == "titan":
        from torchtitan.distributed.utils import dist_sum

        return torch.tensor(dist_sum(t, _mesh((dist.get_world_size(),))), dtype=t.dtype)
    if kind == "funcol":
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
    if kind == "compiled":
        return _compiled_sum(t)
    if kind == "sub":
        mesh = _mesh((2, dist.get_world_size() // 2))
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", (mesh, 1))) * 2
    if kind == "max":
        return funcol.wait_tensor(funcol.all_reduce(t, "max", dist.group.WORLD))
    if kind == "coal":
        out = funcol.all_reduce_coalesced([t, t * 0.5], "sum", dist.group.WORLD)
        return funcol.wait_tensor(out[0])
    raise SystemExit(f"R13A_TOK={kind}?")


@torch.compile(backend="aot_eager")
def _compiled_sum(t):
    """R13A_TOK=compiled: the functional all-reduce inside a compiled graph (a trace)."""
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD)) + 0.0


def _log(loss):
    kind = E("R13A_LOG", "none")
    if kind == "none":
        return None
    t = loss.detach().clone()
    if kind == "funcol":
        return funcol.wait_tensor(funcol.all_reduce(t, "avg", dist.group.WORLD)).clone()
    if kind == "titanmax":
        from torchtitan.distributed.utils import dist_max

        return torch.tensor(dist_max(t, _mesh((dist.get_world_size(),))))
    raise SystemExit(f"R13A_LOG={kind}?")


def _reduce_grads(model):
    kind = E("R13A_GRAD", "c10d")
    params = [p for p in model.parameters() if p.grad is not None]
    if kind == "c10d":
        for p in params:
            dist.all_reduce(p.grad)
    elif kind == "funcol":
        for p in params:
            p.grad.copy_(funcol.wait_tensor(funcol.all_reduce(p.grad, "sum", dist.group.WORLD)))
    elif kind == "rs":
        world = dist.get_world_size()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        pad = (-flat.numel()) % world
        flat = torch.cat([flat, flat.new_zeros(pad)])
        shard = funcol.reduce_scatter_tensor(flat, "sum", 0, dist.group.WORLD)
        full = funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, dist.group.WORLD))
        off = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(full[off:off + n].view_as(p.grad))
            off += n
    else:
        raise SystemExit(f"R13A_GRAD={kind}?")


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    for step in range(1, STEPS + 1):
        x, y, w = _data(step, rank)
        shards = [p.detach().clone() for p in model.parameters()]
        per_tok = ((model(x) - y) ** 2).mean(dim=1)
        tok = _tokens(w)
        loss = (per_tok * w).sum() / tok if tok is not None else per_tok.mean()
        loss.backward()
        logged = _log(loss)
        _reduce_grads(model)
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        TRUTH["steps"].append({"loss": loss.detach().clone(), "tokens": tok, "logged": logged,
                               "grads": grads, "shards": shards})
    TRUTH["final"] = [p.detach().clone() for p in model.parameters()]
    TRUTH["opt"] = opt.state_dict()
    TRUTH["names"] = names
    if E("R13A_TOK") == "compiled":
        from torch._dynamo.utils import counters

        TRUTH["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "frames")}
    if E("R13A_SAVE"):
        torch.save(TRUTH, f"{E('R13A_SAVE')}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
