"""HSDP: FSDP2 on a 2-D mesh (replicate x shard), so every gradient is reduce-scattered over its
shard group and the result all-reduced over its replicate group. Under
``--emulate-nccl 4x1`` (four nodes of one GPU) the shard groups span two nodes. One knob changes a
block's registration order (its payload order in both collectives). It imports nothing from
parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/hsdp_fsdp2.py

Knobs (environment): HS_STEPS=N (default 1); HS_REPLICATE=R (default 2; shard = world / R);
HS_REORDER=1 registers block 0's linears in another order.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tiny_lm import TinyLM, lm_steps

VOCAB, DIM, HIDDEN = 32, 64, 256


class Block(nn.Module):
    def __init__(self, reorder: bool):
        super().__init__()
        fc1, fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        if reorder:
            self.fc2, self.fc1 = fc2, fc1
        else:
            self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicate = int(os.environ.get("HS_REPLICATE", "2"))
    mesh = init_device_mesh("cpu", (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    reorder = os.environ.get("HS_REORDER") == "1"
    model = TinyLM(VOCAB, DIM, lambda: [Block(reorder and i == 0) for i in range(2)])
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_steps(model, opt, int(os.environ.get("HS_STEPS", "1")), rank, VOCAB)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
