"""What several trainers here share (plain_fsdp2.py, grad_accum.py, reorder_fsdp2.py,
late_grad.py, side_allreduce.py, hsdp_fsdp2.py): a tiny language model, the process setup and a
training loop. Like them it imports nothing from parity (a trainer parity
has never seen); a trainer run as a script finds it next to itself (``sys.path[0]``)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh


class MLPBlock(nn.Module):
    """``x + fc2(relu(fc1(norm(x))))``, times a learned ``gate`` when built with one (a trainer
    clears ``use_gate`` to leave the gate without a gradient at some step)."""

    def __init__(self, dim, gate=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        if gate:
            self.gate = nn.Parameter(torch.ones(dim))
        self.use_gate = gate

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(self.norm(x))))
        if self.use_gate:
            h = h * self.gate
        return x + h


class TinyLM(nn.Module):
    """Embedding, then the blocks ``make_layers()`` builds, then the output projection; built in
    that order, so that one seed gives every trainer's parameters the same initial values."""

    def __init__(self, vocab, dim, make_layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(make_layers())
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def gloo_mesh(deterministic=True):
    """One thread per rank, the gloo process group and a 1-D CPU mesh over every rank:
    (rank, world size, mesh)."""
    torch.set_num_threads(1)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, init_device_mesh("cpu", (world,))


def lm_steps(model, opt, steps, rank, vocab, before=None, extra_loss=None, after_backward=None):
    """``steps`` optimizer steps of next-token cross-entropy on seeded random tokens (a
    generator per rank): ``before(step)`` runs before each step's forward (steps count from 1),
    ``extra_loss(logits)`` is added to the loss, ``after_backward()`` runs between backward and
    the optimizer step (a hand-written gradient sync)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, steps + 1):
        if before is not None:
            before(step)
        tokens = torch.randint(0, vocab, (4, 17), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if extra_loss is not None:
            loss = loss + extra_loss(logits)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
