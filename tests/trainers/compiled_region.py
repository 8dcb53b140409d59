"""An FSDP2 trainer whose transformer-like blocks can run through ``torch.compile``, as
torchtitan compiles each block (``block.compile(...)``: names stay the same). It imports
nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/compiled_region.py

Options (on the command line, so that `parity bisect` reruns them from run.json's argv):
  --steps N           optimizer steps (default 2)
  --backend NAME      eager (default: nothing compiled) | inductor | aot_eager: the backend each
                      block is compiled with. Inductor fuses the RMSNorm and the SiLU gate into
                      its own CPU kernel, which computes the bfloat16 norm in float32
                      and rounds once: other values than eager's op-by-op rounding.
  --alt-norm          the norm computes ``x / sqrt(ms + eps)`` instead of ``x * rsqrt(ms + eps)``
                      (a deliberate formula change, found op by op under eager and aot_eager)
  --compile-blocks I  compile only these blocks (comma-separated indexes, default all): a
                      process that compiles some blocks and runs the rest eagerly
  --eps E             the norm's epsilon (default 1e-6): a planted forward change
  --wrap              compile a block as ``model.layers[i] = torch.compile(block)`` (an
                      OptimizedModule in the model) instead of ``block.compile()``
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB = 64
DIM = 48
ALT_NORM = False
EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in bfloat16, as mixed-precision trainers run norms: eager rounds every op's output to
        # bfloat16, inductor's fused kernel keeps float32 inside and rounds once
        x = x.to(torch.bfloat16)
        ms = x.pow(2).mean(-1, keepdim=True) + EPS
        h = x / torch.sqrt(ms) if ALT_NORM else x * torch.rsqrt(ms)
        return (h * self.weight.to(torch.bfloat16)).float()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def main():
    global ALT_NORM, EPS
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--alt-norm", action="store_true")
    ap.add_argument("--compile-blocks", default=None)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--wrap", action="store_true")
    args = ap.parse_args()
    ALT_NORM = args.alt_norm
    EPS = args.eps
    only = None if args.compile_blocks is None else {int(i) for i in args.compile_blocks.split(",")}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Model()
    backend = args.backend
    for i, block in enumerate(model.layers):
        compiled = backend != "eager" and (only is None or i in only)
        if compiled and not args.wrap:
            block.compile(backend=backend, fullgraph=True)
        fully_shard(block, mesh=mesh)
        if compiled and args.wrap:
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f} ({loss.item().hex()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
