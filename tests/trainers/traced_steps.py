"""A trainer whose steps go through traces: torch.compile of a module (dynamo) and a training
step traced with make_fx whose loss calls .backward() inside the trace (as torchtitan
GraphTrainer's chunked loss does). Prints one JSON line: dynamo's unique graph count and the
losses. Imports nothing from parity (capture, if any, is injected by ``parity exec``)."""

import json
import sys
import warnings

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

warnings.simplefilter("default")  # every torch warning reaches stderr
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend="eager")
losses = []
for step in range(4):
    x = torch.randn(4, 8)
    loss = compiled(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())


def traced_step(w, x):
    w = w.detach().requires_grad_(True)
    loss = (x @ w).pow(2).sum()
    loss.backward()  # inside the make_fx trace: fake tensors
    return loss.detach(), w.grad


w = torch.ones(8, 2)
gm = make_fx(traced_step)(w, torch.randn(4, 8))
p = torch.nn.Parameter(torch.ones(8, 2))
opt2 = torch.optim.SGD([p], lr=0.1)
loss, grad = gm(p.detach(), torch.randn(4, 8))
p.grad = grad
opt2.step()
print(json.dumps({"unique_graphs": counters["stats"]["unique_graphs"], "losses": losses}))
sys.stdout.flush()
