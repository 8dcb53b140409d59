"""A late gradient: each block's ``adapter`` is used from step 2 on, so at step 1 FSDP2's
reduce-scatter of the block leaves it out (no gradient) and from step 2 packs it, at the place
its registration order gives. One knob moves the adapter to the front: the step-1 buckets are the
same either way, the step-2 buckets carry the same parameters in another order (the issue's
late-activated adapter or expert). Big blocks: each bucket spans several NCCL channels at
2x2:channels=4. It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/late_grad.py

Knobs (environment): LG_STEPS=N (default 2); LG_ADAPTER_FIRST=1 registers each block's adapter
before its two linears (same initial values, same forward).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from tiny_lm import TinyLM, gloo_mesh, lm_steps

VOCAB, DIM, HIDDEN = 32, 64, 256


class Block(nn.Module):
    def __init__(self, adapter_first: bool):
        super().__init__()
        fc1, fc2, adapter = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM), nn.Linear(DIM, DIM)
        if adapter_first:
            self.adapter, self.fc1, self.fc2 = adapter, fc1, fc2
        else:
            self.fc1, self.fc2, self.adapter = fc1, fc2, adapter
        self.active = False  # the adapter joins from step 2

    def forward(self, x):
        h = x + self.fc2(torch.relu(self.fc1(x)))
        return h + self.adapter(h) if self.active else h


def main():
    rank, _, mesh = gloo_mesh(deterministic=False)
    torch.manual_seed(0)
    first = os.environ.get("LG_ADAPTER_FIRST") == "1"
    model = TinyLM(VOCAB, DIM, lambda: [Block(first) for _ in range(2)])
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def activate(step):
        for block in model.layers:
            block.active = step >= 2

    lm_steps(model, opt, int(os.environ.get("LG_STEPS", "2")), rank, VOCAB, before=activate)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
