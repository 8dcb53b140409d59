"""Round 15b trainer: optimizer implementations and gradient accumulation (imports nothing
from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round15b.py

FSDP2 on gloo at 2 ranks: a two-layer MLP (float32), one optimizer over every parameter, lr
0.01. Each step runs R15B_MICRO micro-batches; the batch of (step i, micro-batch m) depends only
on i, m and the rank.

Ground truth: R15B_SAVE (rank r > 0: ``R15B_SAVE.r``) gets torch.save of ``{"params": [per
step], "grads": [per step: the gradients the optimizer step consumed], "losses": [per step: the
sum of the micro-batch losses as backpropagated], "model": final, "opt": the optimizer's final
state dict, "rs": [per step: how many reduce-scatters FSDP2 ran]}``, DTensors as local shards.

Knobs (environment):
  R15B_STEPS   training steps (3)
  R15B_OPT     sgd (momentum 0.9) | adam (default) | adamw (weight_decay R15B_WD)
  R15B_WD      weight decay of adam / adamw (0.0)
  R15B_IMPL    default (torch's choice) | foreach | forloop (foreach=False) | fused
  R15B_FLAGS   comma-separated optimizer flags set True: maximize, amsgrad, capturable,
               differentiable, nesterov (sgd)
  R15B_MICRO   micro-batches per step (1)
  R15B_SYNC    last (default: ``set_requires_gradient_sync(False)`` on all but the last
               micro-batch: one reduce-scatter per step) | every (a reduce-scatter on every
               micro-batch, as a compiled job typically does)
  R15B_DIV     loss (default: ``(loss / MICRO).backward()``) | grad (``loss.backward()``, the
               gradients divided by MICRO in place before the optimizer step)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R15B_STEPS", "3"))
MICRO = int(E("R15B_MICRO", "1"))
LR = 0.01


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


def local(x):
    if hasattr(x, "to_local"):
        return x.to_local().detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [local(v) for v in x]
    return x


def batch(i, m, rank):
    g = torch.Generator().manual_seed(10000 * i + 100 * m + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def optimizer(params):
    kind = E("R15B_OPT", "adam")
    impl = E("R15B_IMPL", "default")
    flags = {f: True for f in E("R15B_FLAGS", "").split(",") if f}
    kw = dict(lr=LR, **flags)
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "forloop":
        kw["foreach"] = False
    elif impl == "fused":
        kw["fused"] = True
    if kind == "sgd":
        return torch.optim.SGD(params, momentum=0.9, **kw)
    wd = float(E("R15B_WD", "0.0"))
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, weight_decay=wd, **kw)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    opt = optimizer(model.parameters())
    every = E("R15B_SYNC", "last") == "every"
    by_grad = E("R15B_DIV", "loss") == "grad"
    counts = [0]
    name = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
            else "reduce_scatter_tensor")  # what FSDP2 calls (torch 2.13: the former)
    real_rs = getattr(dist, name)

    def counting(*a, **k):
        counts[0] += 1
        return real_rs(*a, **k)

    setattr(dist, name, counting)
    truth = {"params": [], "grads": [], "losses": [], "rs": []}
    for i in range(1, STEPS + 1):
        opt.zero_grad()
        counts[0] = 0
        total = torch.zeros(())
        for m in range(MICRO):
            model.set_requires_gradient_sync(every or m == MICRO - 1)
            x, y = batch(i, m, rank)
            loss = nn.functional.mse_loss(model(x), y)
            (loss if by_grad else loss / MICRO).backward()
            total += loss.detach()
        if by_grad and MICRO > 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.div_(MICRO)
        truth["rs"].append(counts[0])
        truth["losses"].append(total)
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()})
        opt.step()
        truth["params"].append(local(model.state_dict()))
    truth["model"] = local(model.state_dict())
    truth["opt"] = local(opt.state_dict())
    if E("R15B_SAVE"):
        torch.save(truth, E("R15B_SAVE") + (f".{rank}" if rank else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
