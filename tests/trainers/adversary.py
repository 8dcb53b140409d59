"""Trainers that once fooled parity's verdict (issue 21). Imports nothing from parity.

    python tests/trainers/adversary.py

Knobs (environment):
  AD_CASE=gan|sparse|meta|spawn|twice|slow
      gan    two models (G and D, both with BatchNorm and a layer named l1), one optimizer each,
             stepped one after the other; D's optimizer has a pre-hook that scales its
             gradients; G registers a persistent buffer after step 1; G's optimizer gets a
             parameter swapped into its group in place before the last step
      sparse an Embedding with sparse gradients (SGD)
      meta   a parameter on the meta device in the optimizer (capture cannot hash it)
      spawn  two workers started with multiprocessing (spawn), no RANK, each training alone
      twice  this script run twice, one after the other, as child processes (no RANK)
      slow   a one-layer training that sleeps AD_SLEEP seconds before its steps
  AD_PERTURB=bn|buffer|hook|swap   (gan) what B changes: G's BatchNorm momentum (buffers only),
             the late buffer's value, D's gradient scale in its pre-hook, the swapped-in value
  AD_STEPS=N  iterations (default 3)
"""

import multiprocessing as mp
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self, momentum):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8, momentum=momentum)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.bn(self.l1(x))))


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.bn(self.l1(x))))


def gan(steps, perturb):
    g = Generator(0.2 if perturb == "bn" else 0.1)
    d = Discriminator()
    opt_g = torch.optim.SGD(g.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.05)
    scale = 0.25 if perturb == "hook" else 0.5

    def scale_grads(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)

    opt_d.register_step_pre_hook(scale_grads)
    real = torch.randn(16, 4)
    for step in range(1, steps + 1):
        z = torch.randn(16, 4)
        opt_d.zero_grad()
        loss_d = d(real).mean() - d(g(z).detach()).mean()
        loss_d.backward()
        opt_d.step()
        if step == 2:
            value = 2.0 if perturb == "buffer" else 1.0
            g.register_buffer("temperature", torch.full((3,), value))
        opt_g.zero_grad()
        loss_g = -d(g(z)).mean()
        loss_g.backward()
        if step == steps:  # swap a parameter into G's group in place (same grad, new value)
            old = opt_g.param_groups[0]["params"][0]
            new = nn.Parameter(old.detach().clone())
            if perturb == "swap":
                with torch.no_grad():
                    new[0, 0] += 1e-3
            new.grad = old.grad.clone()
            g.l1.weight = new
            opt_g.param_groups[0]["params"][0] = new
        opt_g.step()


def plain(steps, seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def worker(i, steps):
    torch.set_num_threads(1)
    plain(steps, seed=100 + i)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = os.environ.get("AD_CASE", "gan")
    steps = int(os.environ.get("AD_STEPS", "3"))
    if case == "gan":
        gan(steps, os.environ.get("AD_PERTURB", ""))
    elif case == "sparse":
        emb = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        idx = torch.tensor([1, 2, 2, 5])
        for _ in range(steps):
            opt.zero_grad()
            emb(idx).pow(2).sum().backward()
            opt.step()
    elif case == "meta":
        p = nn.Parameter(torch.zeros(3, device="meta"))
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(steps):
            p.grad = torch.ones(3, device="meta")
            opt.step()
    elif case == "spawn":
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(i, steps)) for i in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(1)
    elif case == "twice":
        env = {**os.environ, "AD_CASE": "slow", "AD_SLEEP": "0"}
        for _ in range(2):
            subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True)
    elif case == "slow":
        time.sleep(float(os.environ.get("AD_SLEEP", "0")))
        plain(steps, seed=int(os.environ.get("AD_SEED", "0")))
    print("done", flush=True)


if __name__ == "__main__":
    main()
