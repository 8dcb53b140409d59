"""What several trainers here share (plain_fsdp2.py, grad_accum.py, reorder_fsdp2.py): a tiny
language model and the process setup. Like them it imports nothing from parity (a trainer parity
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
