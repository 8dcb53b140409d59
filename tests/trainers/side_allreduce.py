"""An FSDP2 model next to a small replicated side module whose gradients the trainer all-reduces
itself, as a trainer with a replicated head, a value model or an EMA tower does: one
``dist.all_reduce`` per gradient, or one flat buffer (``torch.cat`` of the gradients, all-reduced,
copied back). One knob packs the flat buffer in reverse order (what a compiled job that collects
the gradients in backward order would do). It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/side_allreduce.py

Knobs (environment): SA_STEPS=N (default 1); SA_MODE=each|flat (default flat);
SA_REVERSED=1 packs the flat buffer in reverse parameter order; SA_GROUPS=pairs|strided
all-reduces over groups of two ranks ({0, 1}, {2, 3} or {0, 2}, {1, 3}: hand-written replicate
groups on a mesh and on its transpose) and feeds the side module the same input on every rank,
so that either grouping gives the same values.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from tiny_lm import MLPBlock, TinyLM, gloo_mesh, lm_steps

VOCAB, DIM, SIDE = 32, 32, 96


def sync(side: nn.Module, mode: str, reverse: bool, group=None) -> None:
    """Average the side module's gradients over every rank (or ``group``), by hand."""
    world = dist.get_world_size(group)
    grads = [p.grad for p in side.parameters() if p.grad is not None]
    if mode == "each":
        for g in grads:
            dist.all_reduce(g, group=group)
            g.div_(world)
        return
    order = list(reversed(grads)) if reverse else grads
    flat = torch.cat([g.reshape(-1) for g in order])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    off = 0
    for g in order:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def main():
    rank, _, mesh = gloo_mesh(deterministic=False)
    torch.manual_seed(0)
    model = TinyLM(VOCAB, DIM, lambda: [MLPBlock(DIM)])
    side = nn.Sequential(nn.Linear(VOCAB, SIDE), nn.Tanh(), nn.Linear(SIDE, SIDE),
                         nn.Linear(SIDE, 1))  # ~13k parameters, replicated on every rank
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD([*model.parameters(), *side.parameters()], lr=0.1)
    mode, reverse = os.environ.get("SA_MODE", "flat"), os.environ.get("SA_REVERSED") == "1"
    grouping, group = os.environ.get("SA_GROUPS"), None
    if grouping:  # every rank creates every group, in the same order (c10d's rule)
        world = dist.get_world_size()
        sets = ([[r, r + 1] for r in range(0, world, 2)] if grouping == "pairs"
                else [list(range(i, world, 2)) for i in range(2)])
        for ranks in sets:
            g = dist.new_group(ranks)
            if rank in ranks:
                group = g
        same = torch.linspace(-1, 1, VOCAB)  # the side module's input, equal on every rank
        side_input = lambda logits: same.expand_as(logits)  # noqa: E731
    else:
        side_input = lambda logits: logits.detach()  # noqa: E731
    lm_steps(model, opt, int(os.environ.get("SA_STEPS", "1")), rank, VOCAB,
             extra_loss=lambda logits: side(side_input(logits)).pow(2).mean(),
             after_backward=lambda: sync(side, mode, reverse, group))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
