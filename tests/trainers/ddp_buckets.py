"""Plain DDP over a small MLP whose gradients fill two DDP buckets (``bucket_cap_mb``), with a
knob that registers the layers in another order (DDP's bucket payload order follows it) and one
that puts a sparse embedding in front (``nn.Embedding(sparse=True)``: DDP all-reduces its
gradient as a sparse tensor). It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/ddp_buckets.py

Knobs (environment): DB_STEPS=N (default 2); DB_REORDER=1 registers the two hidden layers the
other way round (same initial values, same forward); DB_SPARSE=1 feeds the MLP from a sparse
embedding of token ids.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

DIM = 256


class Model(nn.Module):
    def __init__(self, reorder: bool, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(100, DIM, sparse=True) if sparse else None
        a, b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        if reorder:
            self.b, self.a = b, a
        else:
            self.a, self.b = a, b
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x).mean(1)
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    sparse = os.environ.get("DB_SPARSE") == "1"
    model = DDP(Model(os.environ.get("DB_REORDER") == "1", sparse), bucket_cap_mb=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(int(os.environ.get("DB_STEPS", "2"))):
        x = torch.randint(0, 100, (8, 5), generator=gen) if sparse else \
            torch.randn(8, DIM, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
