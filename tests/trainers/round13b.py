"""Round 13b trainer: randomness (dropout) in eager and compiled FSDP2 jobs (imports nothing
from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round13b.py   (R13B_* knobs below)

Two blocks (Linear, ReLU, dropout) and a head, each block its own FSDP2 group, the root too.
The model is initialised under ``torch.manual_seed(0)``; then the default generator is seeded
again for training (``R13B_SEED``, per rank with ``R13B_SEEDS=rank``). The data comes from a
generator of its own (never the default one), so the dropout masks are the only thing that
reads the default generator unless a knob adds a draw.

Why each case: dropout draws its mask from the default generator. A compiled block (inductor)
draws its own seeds from the default generator (``inductor_seeds``: one ``randint`` per graph
call) and generates the mask with its own kernel, so other masks and another generator state
than eager's; ``torch._inductor.config.fallback_random = True`` makes it call eager's ops.
Anything else that reads the generator (a sampler's seed, a probe layer built after seeding,
a ``torch.rand`` for logging) shifts every later mask.

With R13B_SAVE=PATH each rank saves ``PATH`` (rank 0) / ``PATH.<rank>`` (torch.save of a dict):
``shards`` (per step, each local parameter before it), ``grads`` (per step, each local
gradient), ``losses``, ``rng`` (per step, ``torch.get_rng_state()`` at its start, and the state
after the last step), ``model`` (final local state dict), ``opt`` (optimizer state),
``extra`` (dynamo's counters). Compared with ``torch.equal`` between runs.

Knobs (environment):
  R13B_STEPS    steps (default 3)
  R13B_DROP     dropout probability (default 0.25; 0: no dropout module)
  R13B_COMPILE  none (default) | inductor | aot_eager: each block ``block.compile(backend=...,
                fullgraph=True)`` before ``fully_shard`` (torchtitan's way)
  R13B_FALLBACK=1  ``torch._inductor.config.fallback_random = True``
  R13B_SEED     the training seed (default 1234)
  R13B_SEEDS    same (default: every rank the same seed) | rank (seed + rank)
  R13B_EXTRA    none (default) | log (``torch.rand(1)`` every step before the forward, for
                logging) | logafter (the same ``torch.rand(1)`` after the backward: as many
                draws per step as ``log``, in another order) | sampler (every step, the seed a DataLoader's RandomSampler without a
                generator draws: ``torch.empty((), dtype=torch.int64).random_()``) | init (a
                probe ``nn.Linear(16, 16)`` built after seeding, never used)
  R13B_EXTRA_RANK  all (default) | N: the extra draw on rank N only
  R13B_AC       none (default) | preserve | nopreserve: each block under
                ``torch.utils.checkpoint`` (non-reentrant), ``preserve_rng_state`` True / False
  R13B_RNGSAVE=PATH  save ``torch.get_rng_state()`` after the last step (``PATH.<rank>``)
  R13B_RNGLOAD=PATH  after seeding, ``torch.set_rng_state`` from ``PATH.<rank>`` (a run resumed
                with the RNG state of a checkpoint, against one that seeds again)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

E = os.environ.get
STEPS = int(E("R13B_STEPS", "3"))
DROP = float(E("R13B_DROP", "0.25"))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(DROP) if DROP > 0 else nn.Identity()

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            if E("R13B_AC", "none") == "none":
                h = b(h)
            else:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(b, h, use_reentrant=False,
                               preserve_rng_state=E("R13B_AC") == "preserve")
        return self.head(h)


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _extra(rank):
    """The extra draw from the default generator the knobs ask for at this rank, if any."""
    who = E("R13B_EXTRA_RANK", "all")
    return E("R13B_EXTRA", "none") if who in ("all", str(rank)) else "none"


def counters():
    from torch._dynamo.utils import counters as c

    return {k: {n: v for n, v in d.items() if "cache" not in n} for k, d in c.items() if d}


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if E("R13B_FALLBACK") == "1":
        import torch._inductor.config as ic

        ic.fallback_random = True
    torch.manual_seed(0)
    model = Net()
    backend = E("R13B_COMPILE", "none")
    for b in model.blocks:
        if backend != "none":
            b.compile(backend=backend, fullgraph=True)
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(int(E("R13B_SEED", "1234")) + (rank if E("R13B_SEEDS") == "rank" else 0))
    if E("R13B_RNGLOAD"):
        torch.set_rng_state(torch.load(f"{E('R13B_RNGLOAD')}.{rank}"))
    if _extra(rank) == "init":
        nn.Linear(16, 16)  # a probe built after seeding: its init reads the generator
    named = list(model.named_parameters())
    opt = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    truth = {"shards": [], "grads": [], "losses": [], "rng": []}
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        truth["rng"].append(torch.get_rng_state())  # at the step boundary
        truth["shards"].append({n: _local(p) for n, p in named})
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        if _extra(rank) == "sampler":
            torch.empty((), dtype=torch.int64).random_()
        if _extra(rank) == "log":
            torch.rand(1)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if _extra(rank) == "logafter":
            torch.rand(1)
        truth["grads"].append({n: _local(p.grad) for n, p in named if p.grad is not None})
        truth["losses"].append(loss.detach().clone())
        opt.step()
    truth["rng"].append(torch.get_rng_state())
    truth["model"] = {k: _local(v) for k, v in model.state_dict().items()}
    truth["opt"] = {i: {k: _local(v) if torch.is_tensor(v) else v for k, v in s.items()}
                    for i, s in opt.state_dict()["state"].items()}
    truth["extra"] = {"counters": counters()}
    if E("R13B_RNGSAVE"):
        torch.save(torch.get_rng_state(), f"{E('R13B_RNGSAVE')}.{rank}")
    if E("R13B_SAVE"):
        torch.save(truth, E("R13B_SAVE") + (f".{rank}" if rank else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
