"""Round 14b trainer: a run resumed from a checkpoint (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round14b.py

FSDP2 on gloo: an MLP with dropout (so the default generator's state matters), Adam, and a
LambdaLR (lr = 0.01 * 0.7 ** last_epoch: a scheduler restored wrong shows at its first step;
R14B_SCHED=step: a StepLR(1, 0.7), whose chainable form multiplies the lr it finds, so the lr the
optimizer state restores decides and a forgotten ``last_epoch`` changes nothing). The
batch of global step ``i`` (counted from the start of the uninterrupted run) depends only on
``i`` and the rank. The checkpoint is torchtitan's way: ``get_state_dict`` / ``dcp.save`` of the
model and optimizer, the scheduler's ``state_dict`` in it, and each rank's CPU generator state
beside it (``<ckpt>.rng<rank>``, torch.save); loading is ``get_state_dict`` / ``dcp.load`` /
``set_state_dict``, ``load_state_dict`` of the scheduler, ``torch.set_rng_state``.

Ground truth: R14B_SAVE (rank r > 0: ``R14B_SAVE.r``) gets torch.save of ``{"init": the
parameters right before the first step of this job (after any load), "params": [per step],
"losses": [per step], "model": final, "opt": the optimizer's final state dict, "lr": [the lr
each step used]}``, DTensors as their local shards.

Knobs (environment):
  R14B_STEPS    training steps this job runs (4)
  R14B_START    the global step this job starts after (0; a resumed run: k)
  R14B_CKPT     write a checkpoint there after global step R14B_CKPT_AT (2)
  R14B_LOAD     a checkpoint to load before the first step
  R14B_SKIP     opt | sched | rng: what the resumed run forgets to restore
  R14B_SCHED    lambda (default) | step
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R14B_STEPS", "4"))
START = int(E("R14B_START", "0"))
SKIP = E("R14B_SKIP", "")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.25)
        self.l1 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l1(self.drop(torch.relu(self.l0(x))))


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


def save_ckpt(path, model, opt, sched, rank):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, checkpoint_id=path)
    torch.save(torch.get_rng_state(), f"{path}.rng{rank}")


def load_ckpt(path, model, opt, sched, rank):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "sched": sched.state_dict()}
    dcp.load(state, checkpoint_id=path)
    if SKIP == "opt":  # the model alone (the optimizer keeps the state get_state_dict gave it)
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    if SKIP != "sched":
        sched.load_state_dict(state["sched"])
    if SKIP != "rng":
        torch.set_rng_state(torch.load(f"{path}.rng{rank}"))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.l0)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.9))
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
             if E("R14B_SCHED") == "step" else
             torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.7 ** e))
    if E("R14B_LOAD"):
        load_ckpt(E("R14B_LOAD"), model, opt, sched, rank)
    truth = {"init": local(model.state_dict()), "params": [], "losses": [], "lr": []}
    ckpt, ckpt_at = E("R14B_CKPT"), int(E("R14B_CKPT_AT", "2"))
    for i in range(START + 1, START + STEPS + 1):
        x, y = batch(i, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        truth["losses"].append(loss.detach().clone())
        truth["lr"].append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        truth["params"].append(local(model.state_dict()))
        if ckpt and i == ckpt_at:
            save_ckpt(ckpt, model, opt, sched, rank)
    truth["model"] = local(model.state_dict())
    truth["opt"] = local(opt.state_dict())
    if E("R14B_SAVE"):
        torch.save(truth, E("R14B_SAVE") + (f".{rank}" if rank else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
