"""An FSDP2 trainer that can be nondeterministic, diverge on purpose, or train slowly: for the
determinism control, shared reference jobs and early stop tests. It imports nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/noisy.py --steps 6 --noise 1:3

  --steps N        optimizer steps (default 3)
  --noise R:K      on rank R, from optimizer step K on, add noise seeded from the clock and the
                   pid to a gradient shard: two runs of the same command differ from step K on
  --perturb R:K    on rank R, at optimizer step K, add 1e-3 to a gradient shard (the same in
                   every run: a systematic divergence)
  --sleep S        sleep S seconds after every step (a slow job, for early stop)
  --tag T          ignored (lets a spec give cells distinct arguments)
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB, DIM = 13, 8


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.out(x)


def _pair(text):
    if not text:
        return None
    r, k = text.split(":")
    return int(r), int(k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--noise", default=None)
    ap.add_argument("--perturb", default=None)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    noise, perturb = _pair(args.noise), _pair(args.perturb)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    # the source of nondeterminism: a generator seeded from the clock and the pid
    noisy = torch.Generator().manual_seed(time.time_ns() ^ (os.getpid() << 16))

    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grad = model.out.weight.grad.to_local()
        with torch.no_grad():
            if noise is not None and noise[0] == rank and step >= noise[1]:
                grad.add_(torch.rand(grad.shape, generator=noisy) * 1e-3)
            if perturb is not None and perturb[0] == rank and step == perturb[1]:
                grad.add_(1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
