"""FSDP2 (2 ranks, gloo), three steps, then an eval forward (the root keeps its unsharded
parameters: FSDP2 sets them on the modules without a registration hook) and a buffer
registered on the root. Imports nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/fsdp2_eval_after.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

KEEP = []  # the model, alive to the end of the process (a script's module-level model)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(m[0])
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
    with torch.no_grad():
        m(torch.randn(4, 8, generator=g))  # eval: the root stays unsharded
    print(f"root weight after eval: {type(m[2].weight).__name__}", flush=True)
    m.register_buffer("calib", torch.ones(2))
    KEEP.append(m)
    dist.barrier()


if __name__ == "__main__":
    main()
