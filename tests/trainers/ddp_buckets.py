"""Plain DDP over a small MLP whose gradients fill two DDP buckets (``bucket_cap_mb``), with one
knob that registers the layers in another order (DDP's bucket payload order follows it). It
imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/ddp_buckets.py

Knobs (environment): DB_STEPS=N (default 2); DB_REORDER=1 registers the two hidden layers the
other way round (same initial values, same forward).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Model(nn.Module):
    def __init__(self, reorder: bool):
        super().__init__()
        a, b = nn.Linear(256, 256), nn.Linear(256, 256)
        if reorder:
            self.b, self.a = b, a
        else:
            self.a, self.b = a, b
        self.head = nn.Linear(256, 1)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Model(os.environ.get("DB_REORDER") == "1"), bucket_cap_mb=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(int(os.environ.get("DB_STEPS", "2"))):
        loss = model(torch.randn(8, 256, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
