"""An FSDP2 model next to a small replicated side module whose gradients the trainer all-reduces
itself, as a trainer with a replicated head, a value model or an EMA tower does: one
``dist.all_reduce`` per gradient, or one flat buffer (``torch.cat`` of the gradients, all-reduced,
copied back). One knob packs the flat buffer in reverse order (what a compiled job that collects
the gradients in backward order would do). It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/side_allreduce.py

Knobs (environment): SA_STEPS=N (default 1); SA_MODE=each|flat (default flat);
SA_REVERSED=1 packs the flat buffer in reverse parameter order.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from tiny_lm import MLPBlock, TinyLM, gloo_mesh, lm_steps

VOCAB, DIM, SIDE = 32, 32, 96


def sync(side: nn.Module, mode: str, reverse: bool) -> None:
    """Average the side module's gradients over every rank, by hand."""
    world = dist.get_world_size()
    grads = [p.grad for p in side.parameters() if p.grad is not None]
    if mode == "each":
        for g in grads:
            dist.all_reduce(g)
            g.div_(world)
        return
    order = list(reversed(grads)) if reverse else grads
    flat = torch.cat([g.reshape(-1) for g in order])
    dist.all_reduce(flat)
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
    lm_steps(model, opt, int(os.environ.get("SA_STEPS", "1")), rank, VOCAB,
             extra_loss=lambda logits: side(logits.detach()).pow(2).mean(),
             after_backward=lambda: sync(side, mode, reverse))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
