"""Round 12b trainer: state loaded from a checkpoint (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round12b.py   (R12B_WRAP=fsdp|ddp)
    python tests/trainers/round12b.py                                    (R12B_WRAP=none)

A small MLP (``l0``, ``l1``, ``l2``; ``extra`` is never used in the forward, so it has no
gradient) trained with Adam (and a StepLR scheduler with R12B_SCHED=1). The batch of training
step ``i`` (counted from the start of the uninterrupted run: a run resumed at step k trains on
batches k+1, k+2, ...) depends only on ``i`` and the rank.

Ground truth: R12B_SAVE (rank r > 0: ``R12B_SAVE.r``) gets torch.save of ``{"init": the
parameters right before the first training step (after any load), "params": [per step],
"grads": [per step, as the step consumed them], "losses": [...], "model": final state dict,
"opt": the optimizer's final state dict, "sched": the scheduler's}``, DTensors as their local
shards.

Knobs (environment):
  R12B_WRAP   fsdp (FSDP2, default) | ddp | none (one process, no process group)
  R12B_STEPS  training steps this job runs (3)
  R12B_START  the global step this job starts after (0; a resumed run: k)
  R12B_LOAD   a checkpoint to load before step 1 (fsdp: a DCP directory; else a torch.save file)
  R12B_HOW    fsdp: dsd (get_state_dict, dcp.load, set_state_dict: torchtitan's way; default) |
              sd (dcp.load into model.state_dict() / optimizer.state_dict(), then
              load_state_dict: torch's state_dict() never steps the optimizer)
  R12B_PARTS  model+opt (default) | model | opt: what is loaded
  R12B_CKPT   write a checkpoint there after step R12B_CKPT_AT (0: before the first step)
  R12B_EDIT   param | exp_avg | exp_avg_extra | step | sched: a change made to the live state
              right before that checkpoint is written (the checkpoint job's own later steps
              see it too; it is meant to end there)
  R12B_DROP   a key dropped from the model state dict before ``load_state_dict(strict=False)``
              (wrap none/ddp)
  R12B_MID    a checkpoint loaded after step R12B_MID_AT (2): the run rolls back to it
  R12B_OPTLATE=1  the optimizer part of R12B_LOAD is loaded after step 1, not before
  R12B_SCHED=1    StepLR(step_size=2, gamma=0.5), saved and loaded with the checkpoint
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
WRAP = E("R12B_WRAP", "fsdp")
STEPS = int(E("R12B_STEPS", "3"))
START = int(E("R12B_START", "0"))
HOW = E("R12B_HOW", "dsd")
PARTS = E("R12B_PARTS", "model+opt")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 4)
        self.extra = nn.Linear(4, 4)  # never used: no gradient, Adam keeps no state for it

    def forward(self, x):
        return self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))


def local(x):
    """A value as saved: DTensors as their local shards, containers recursively, detached."""
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


def inner(model):
    return model.module if WRAP == "ddp" else model


def save_ckpt(path, model, opt, sched):
    if WRAP == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        if sched is not None:
            state["sched"] = sched.state_dict()
        dcp.save(state, checkpoint_id=path)
        return
    if WRAP == "ddp" and dist.get_rank() != 0:
        dist.barrier()
        return
    state = {"model": inner(model).state_dict(), "optim": opt.state_dict()}
    if sched is not None:
        state["sched"] = sched.state_dict()
    torch.save(state, path)
    if WRAP == "ddp":
        dist.barrier()


def load_ckpt(path, model, opt, sched, parts):
    """Load ``parts`` (``model``, ``opt``, ``sched``) of the checkpoint at ``path``."""
    if WRAP == "fsdp":
        import torch.distributed.checkpoint as dcp

        if HOW == "dsd":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_state_dict, set_state_dict)

            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            if sched is not None:
                state["sched"] = sched.state_dict()
            # a checkpoint written after a step holds no state for ``extra`` (no gradient),
            # which get_state_dict's initialising step gave it here
            dcp.load(state, checkpoint_id=path,
                     planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
            set_state_dict(model, opt,
                           model_state_dict=state["model"] if "model" in parts else {},
                           optim_state_dict=state["optim"] if "opt" in parts else {},
                           options=StateDictOptions(strict="model" in parts))
        else:
            state = {"model": model.state_dict()}
            if "opt" in parts:
                state["optim"] = opt.state_dict()
            if sched is not None:
                state["sched"] = sched.state_dict()
            dcp.load(state, checkpoint_id=path)
            if "model" in parts:
                model.load_state_dict(state["model"])
            if "opt" in parts:
                opt.load_state_dict(state["optim"])
    else:
        state = torch.load(path, weights_only=False)
        if "model" in parts:
            msd = dict(state["model"])
            drop = E("R12B_DROP")
            if drop:
                del msd[drop]
            missing, _ = inner(model).load_state_dict(msd, strict=not drop)
            assert list(missing) == ([drop] if drop else []), missing
        if "opt" in parts:
            opt.load_state_dict(state["optim"])
    if sched is not None and "sched" in state:
        sched.load_state_dict(state["sched"])


def edit(kind, model, opt, sched):
    net = inner(model)
    with torch.no_grad():
        if kind == "param":
            net.l1.weight.mul_(1.5)
        elif kind == "exp_avg":
            opt.state[net.l1.weight]["exp_avg"].mul_(1.5)
        elif kind == "exp_avg_extra":  # a parameter without gradient: Adam never moves it
            st = opt.state[net.extra.weight]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(net.extra.weight)
                st["exp_avg_sq"] = torch.zeros_like(net.extra.weight)
            st["exp_avg"].add_(0.5)
        elif kind == "step":
            for st in opt.state.values():
                st["step"].add_(1)
        elif kind == "sched":
            sched.last_epoch += 1
        else:
            raise SystemExit(f"unknown R12B_EDIT {kind}")


def main():
    rank = 0
    if WRAP != "none":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if WRAP == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.l0, model.l1, model.l2):
            fully_shard(layer)
        fully_shard(model)
    elif WRAP == "ddp":
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.9))
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
             if E("R12B_SCHED") == "1" else None)
    load, late = E("R12B_LOAD"), E("R12B_OPTLATE") == "1"
    if load:
        parts = PARTS.split("+")
        load_ckpt(load, model, opt, sched, [p for p in parts if not (late and p == "opt")]
                  + (["sched"] if sched is not None else []))
    truth = {"init": local(inner(model).state_dict()), "params": [], "grads": [], "losses": []}
    ckpt, ckpt_at = E("R12B_CKPT"), int(E("R12B_CKPT_AT", "0"))
    mid, mid_at = E("R12B_MID"), int(E("R12B_MID_AT", "2"))
    for i in range(1, STEPS + 1):
        if ckpt and START + i - 1 == ckpt_at:
            if E("R12B_EDIT"):
                edit(E("R12B_EDIT"), model, opt, sched)
            save_ckpt(ckpt, model, opt, sched)
        x, y = batch(START + i, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        truth["losses"].append(loss.detach().clone())
        truth["grads"].append({n: local(p.grad) for n, p in inner(model).named_parameters()
                               if p.grad is not None})
        opt.step()
        if sched is not None:
            sched.step()
        truth["params"].append(local(inner(model).state_dict()))
        if i == 1 and late and load:
            load_ckpt(load, model, opt, sched, ["opt"])
        if mid and i == mid_at:
            load_ckpt(mid, model, opt, sched, ["model", "opt"])
    if ckpt and START + STEPS == ckpt_at:
        if E("R12B_EDIT"):
            edit(E("R12B_EDIT"), model, opt, sched)
        save_ckpt(ckpt, model, opt, sched)
    truth["model"] = local(inner(model).state_dict())
    truth["opt"] = local(opt.state_dict())
    truth["sched"] = sched.state_dict() if sched is not None else None
    if E("R12B_SAVE"):
        torch.save(truth, E("R12B_SAVE") + (f".{rank}" if rank else ""))
    if WRAP != "none":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
