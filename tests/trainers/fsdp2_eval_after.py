"""FSDP2 (2 ranks, gloo), three steps, then an eval forward (the root keeps its unsharded
parameters: FSDP2 sets them on the modules without a registration hook) and a buffer
registered on the root. Imports nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/fsdp2_eval_after.py

``RESHARD_AFTER_FORWARD=2`` (4 ranks): the first layer reshards after its forward to groups of 2
ranks (``fully_shard(..., reshard_after_forward=2)``), so after the eval forward it holds its
post-forward shards (FSDP2's ``_sharded_post_forward_param``, set without a hook as well).
"""

import os

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
    raf = os.environ.get("RESHARD_AFTER_FORWARD")
    fully_shard(m[0], reshard_after_forward=int(raf) if raf else True)
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
    if raf:
        mesh = m[0].weight.device_mesh
        print(f"first weight after eval: mesh {tuple(mesh.shape)}", flush=True)
    m.register_buffer("calib", torch.ones(2))
    KEEP.append(m)
    dist.barrier()


if __name__ == "__main__":
    main()
