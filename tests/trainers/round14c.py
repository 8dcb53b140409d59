"""Round 14c trainer: learning-rate schedules per step (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round14c.py

FSDP2 on gloo at 2 ranks: a two-layer MLP, SGD with momentum (lr 0.01) and a second param
group holding ``idle``, a parameter no loss reaches (its gradient stays None, so SGD never moves
it: whatever its group's lr, no hash changes). The batch of step ``i`` depends only on ``i`` and
the rank.

Ground truth: R14C_SAVE (rank r > 0: ``R14C_SAVE.r``) gets torch.save of ``{"params": [per step],
"grads": [per step], "losses": [per step], "lr": [per step: each group's lr as the step used it,
a float], "model": final, "opt": the optimizer's final state dict}``, DTensors as local shards.

Knobs (environment):
  R14C_STEPS     training steps (4)
  R14C_SCHED     none (default) | warmup (LambdaLR, linear warmup over R14C_WARMUP steps) |
                 step (StepLR(step_size=2, gamma=0.5))
  R14C_WARMUP    warmup steps of R14C_SCHED=warmup (2)
  R14C_ORDER     after (default: scheduler.step() after optimizer.step()) | before
  R14C_LR        float (default) | tensor (the lr a 0-d float64 tensor of the same value) |
                 tensor32 (a 0-d float32 tensor: 0.01 rounded to float32)
  R14C_IDLE_MID  a step whose optimizer step runs with the idle group's lr halved (set by hand
                 before it, restored after it): a difference in the middle of the run that
                 reaches no hash (0: none)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R14C_STEPS", "4"))
LR = 0.01


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 4)
        self.idle = nn.Parameter(torch.zeros(4))  # in the optimizer, never in the loss

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


def batch(i, rank):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    kind = E("R14C_LR", "float")
    lr = (torch.tensor(LR, dtype=torch.float64) if kind == "tensor" else
          torch.tensor(LR) if kind == "tensor32" else LR)
    main_params = [p for n, p in model.named_parameters() if n != "idle"]
    opt = torch.optim.SGD([{"params": main_params},
                           {"params": [model.idle], "lr": 0.1}], lr=lr, momentum=0.9)
    sched = E("R14C_SCHED", "none")
    if sched == "warmup":
        w = int(E("R14C_WARMUP", "2"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / w))
    elif sched == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        sched = None
    before = E("R14C_ORDER", "after") == "before"
    mid = int(E("R14C_IDLE_MID", "0"))
    truth = {"params": [], "grads": [], "losses": [], "lr": []}
    for i in range(1, STEPS + 1):
        x, y = batch(i, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        truth["losses"].append(loss.detach().clone())
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()
                               if p.grad is not None})
        if sched is not None and before:
            sched.step()
        if i == mid:
            opt.param_groups[1]["lr"] = 0.05
        truth["lr"].append([float(g["lr"]) for g in opt.param_groups])
        opt.step()
        if i == mid:
            opt.param_groups[1]["lr"] = 0.1
        if sched is not None and not before:
            sched.step()
        truth["params"].append(local(model.state_dict()))
    truth["model"] = local(model.state_dict())
    truth["opt"] = local(opt.state_dict())
    if E("R14C_SAVE"):
        torch.save(truth, E("R14C_SAVE") + (f".{rank}" if rank else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
