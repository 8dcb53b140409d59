"""A held-out FSDP2 trainer (imports nothing from parity): bf16 mixed precision, AdamW, an EMA
copy updated through .data, on CUDA with NCCL (or CPU with gloo for a local try).

    torchrun --standalone --nproc_per_node 1 heldout_gpu.py [cpu]
Env: PERTURB=K  after optimizer step K, add 1e-3 to blocks.1.up.weight through .data (between
steps: what parity's entry record is for).  STEPS=N (default 6)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

cpu = len(sys.argv) > 1 and sys.argv[1] == "cpu"
dist.init_process_group("gloo" if cpu else "nccl")
rank = dist.get_rank()
dev = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
if not cpu:
    torch.cuda.set_device(dev)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab=512, d=128, n=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, tok):
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


model = Net().to(dev)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for b in model.blocks:
    fully_shard(b, mp_policy=mp)
fully_shard(model, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator(device="cpu").manual_seed(1)
perturb = int(os.environ.get("PERTURB", "0"))
for step in range(1, int(os.environ.get("STEPS", "6")) + 1):
    tok = torch.randint(0, 512, (4, 64), generator=g).to(dev)
    loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1).float(), tok[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == perturb:
        w = model.blocks[1].up.weight
        w.data.to_local().add_(1e-3) if hasattr(w.data, "to_local") else w.data.add_(1e-3)
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
