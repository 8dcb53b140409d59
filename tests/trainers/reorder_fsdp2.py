"""An eager FSDP2 trainer whose blocks are big enough to span several NCCL channels, with one
knob that changes a block's parameter registration order (FSDP2's bucket payload order). It
imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/reorder_fsdp2.py

Knobs (environment):
  RO_STEPS=N     optimizer steps (default 1)
  RO_REORDER=I,J  blocks I, J register their parameters in another order (same initial values,
                 same forward). Blocks 0-2 are big (their buckets span several NCCL channels);
                 block 3 is two small LayerNorms (its bucket fits in one channel's first cell).
  RO_FORCE_SUM=1  every fully_shard group reduce-scatters with SUM and divides after
                 (``set_force_sum_reduction_for_comms``) instead of FSDP2's AVG
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from tiny_lm import TinyLM, gloo_mesh

VOCAB, DIM, HIDDEN = 32, 64, 256


class Block(nn.Module):
    def __init__(self, reorder: bool):
        super().__init__()
        fc1, fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)  # created in one order
        if reorder:  # registered in another: the bucket payload order changes
            self.fc2, self.fc1 = fc2, fc1
        else:
            self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class NormBlock(nn.Module):
    def __init__(self, reorder: bool):
        super().__init__()
        first, second = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        if reorder:  # FSDP2 packs child modules in registration order
            self.second, self.first = second, first
        else:
            self.first, self.second = first, second

    def forward(self, x):
        return x + self.second(self.first(x))


class Model(TinyLM):
    def __init__(self, reorder: set[int]):
        super().__init__(VOCAB, DIM, lambda: [Block(i in reorder) for i in range(3)]
                         + [NormBlock(3 in reorder)])


def main():
    rank, _, mesh = gloo_mesh(deterministic=False)
    torch.manual_seed(0)
    model = Model({int(i) for i in os.environ.get("RO_REORDER", "").split(",") if i})
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if os.environ.get("RO_FORCE_SUM") == "1":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(int(os.environ.get("RO_STEPS", "1"))):
        tokens = torch.randint(0, VOCAB, (4, 17), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
