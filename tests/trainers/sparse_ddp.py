"""DDP over a model with a sparse embedding gradient (``nn.Embedding(sparse=True)``) and a dense
head: DDP all-reduces the sparse gradient as a sparse tensor and the dense ones in a bucket. It
imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/sparse_ddp.py

Knob (environment): SD_STEPS=N (default 2).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(int(os.environ.get("SD_STEPS", "2"))):
        idx = torch.randint(0, 100, (8, 5), generator=gen)
        loss = model(idx).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
