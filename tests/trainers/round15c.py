"""Round 15c trainer: compiled optimizer steps, stateless training, activation memory tricks
(imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round15c.py   (FSDP2 on gloo)
    python tests/trainers/round15c.py                                     (one process)

A two-layer MLP (8 -> 16 -> 4, ReLU), a batch of step ``i`` that depends only on ``i`` and the
rank, mean-squared-error loss. Under torchrun each Linear is its own FSDP2 group and the model
the root.

Ground truth: R15C_SAVE (rank r > 0: ``R15C_SAVE.r``) gets torch.save of ``{"params": [per
step: the trained tensors after the step, by name], "grads": [per step], "losses": [per step],
"model": final, "extra": {"counters": dynamo's counters (less the caches'), "error": the
exception a step raised, or None}}``, DTensors as local shards.

Knobs (environment):
  R15C_STEPS     training steps (3)
  R15C_CASE      copt (default) | func | act
    copt  Adam (lr 0.01; R15C_OPT=hand: HandSGD, the trainer's own optimizer, lr 0.05) stepped
          through torch.compile: R15C_COMPILE=step
          (``torch.compile(opt.step)``, default) | fn (a compiled function calling
          ``opt.step()``: the "compiled optimizer" tutorial's shape) | whole (a compiled
          training step: forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``;
          no gradients in the ground truth) | none (eager);
          R15C_ADAM=foreach,capturable (Adam's flags, comma-separated); R15C_CLIP=1 registers a step pre-hook that halves the gradients;
          R15C_FULLGRAPH=1 compiles with ``fullgraph=True``; R15C_BACKEND eager | aot_eager
          (default) | inductor
    func  stateless training through ``torch.func.functional_call(model, params, x)`` over a
          dict of tensors no module holds: R15C_FUNC=grad (default: ``torch.func.grad`` of the
          loss, the dict updated by hand ``p - lr * g``: no ``.grad``, no optimizer) | autograd
          (``torch.autograd.grad``, updated by hand in place under no_grad) | optim
          (``torch.autograd.grad`` assigned to ``.grad`` of the dict's tensors, a torch.optim
          SGD over them); R15C_LR (0.05)
    act   activation memory tricks around each Linear's forward: R15C_ACT=none (default) |
          hooks (``torch.autograd.graph.saved_tensors_hooks`` packing a clone) | cpu
          (``torch.autograd.graph.save_on_cpu``) | reentrant (``torch.utils.checkpoint`` of each
          block, ``use_reentrant=True``) | nonreentrant (``use_reentrant=False``); SGD lr 0.05
"""

import os

import torch
import torch.nn as nn

E = os.environ.get
STEPS = int(E("R15C_STEPS", "3"))
CASE = E("R15C_CASE", "copt")


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


def batch(i, rank):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def counters():
    from torch._dynamo.utils import counters as c

    return {k: {n: v for n, v in d.items() if "cache" not in n} for k, d in c.items() if d}


class HandSGD(torch.optim.Optimizer):
    """An optimizer of the trainer's own: its step does not break dynamo's graph (torch.optim's
    do, at ``_use_grad_for_differentiable``), so ``fullgraph=True`` compiles it."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def train_copt(model, rank, truth):
    opt = (HandSGD(model.parameters(), lr=0.05) if E("R15C_OPT") == "hand" else
           torch.optim.Adam(model.parameters(), lr=0.01,
                            **{k: True for k in E("R15C_ADAM", "").split(",") if k}))
    if E("R15C_CLIP") == "1":  # a step pre-hook of the trainer's own that edits the gradients
        opt.register_step_pre_hook(lambda o, a, k: [p.grad.mul_(0.5) for g in o.param_groups
                                                    for p in g["params"] if p.grad is not None]
                                   and None)
    how, full = E("R15C_COMPILE", "step"), E("R15C_FULLGRAPH") == "1"
    backend = E("R15C_BACKEND", "aot_eager")
    if how == "step":
        step = torch.compile(opt.step, backend=backend, fullgraph=full)
    elif how == "fn":
        @torch.compile(backend=backend, fullgraph=full)
        def step():
            opt.step()
    elif how == "whole":  # the whole training step compiled
        @torch.compile(backend=backend, fullgraph=full)
        def whole(x, y):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
    else:
        step = opt.step
    for i in range(1, STEPS + 1):
        x, y = batch(i, rank)
        if how == "whole":
            truth["losses"].append(whole(x, y).detach().clone())
            truth["params"].append(local(dict(model.named_parameters())))
            continue
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        truth["losses"].append(loss.detach().clone())
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()})
        step()
        truth["params"].append(local(dict(model.named_parameters())))


def sgd_update(params, grads, lr):
    """The stateless update of R15C_FUNC=grad: a new dict (what ``--step-on`` can name)."""
    return {n: p - lr * grads[n] for n, p in params.items()}


def train_func(model, rank, truth):
    from torch.func import functional_call, grad

    how, lr = E("R15C_FUNC", "grad"), float(E("R15C_LR", "0.05"))
    params = {n: p.detach().clone().requires_grad_(how != "grad")
              for n, p in model.named_parameters()}
    opt = torch.optim.SGD(list(params.values()), lr=lr) if how == "optim" else None

    def loss_of(ps, x, y):
        return nn.functional.mse_loss(functional_call(model, ps, (x,)), y)

    for i in range(1, STEPS + 1):
        x, y = batch(i, rank)
        if how == "grad":
            loss = loss_of(params, x, y)
            gs = grad(loss_of)(params, x, y)
            params = sgd_update(params, gs, lr)
        else:
            loss = loss_of(params, x, y)
            gs = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            if opt is None:
                with torch.no_grad():
                    for n, p in params.items():
                        p.sub_(lr * gs[n])
            else:
                for n, p in params.items():
                    p.grad = gs[n]
                opt.step()
        truth["losses"].append(loss.detach().clone())
        truth["grads"].append(local(gs))
        truth["params"].append(local(params))
    return params


def train_act(model, rank, truth):
    from torch.utils.checkpoint import checkpoint

    how = E("R15C_ACT", "none")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def forward(x):
        if how == "hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                return model(x)
        if how == "cpu":
            with torch.autograd.graph.save_on_cpu():
                return model(x)
        if how in ("reentrant", "nonreentrant"):
            h = checkpoint(lambda t: torch.relu(model.l0(t)), x,
                           use_reentrant=how == "reentrant")
            return checkpoint(model.l1, h, use_reentrant=how == "reentrant")
        return model(x)

    for i in range(1, STEPS + 1):
        x, y = batch(i, rank)
        if how == "reentrant":
            x.requires_grad_(True)  # a reentrant checkpoint needs an input that requires grad
        loss = nn.functional.mse_loss(forward(x), y)
        opt.zero_grad()
        loss.backward()
        truth["losses"].append(loss.detach().clone())
        truth["grads"].append({n: local(p.grad) for n, p in model.named_parameters()})
        opt.step()
        truth["params"].append(local(dict(model.named_parameters())))


def main():
    torch.set_num_threads(1)
    dist = None
    rank = 0
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if dist is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.l0)
        fully_shard(model.l1)
        fully_shard(model)
    truth = {"params": [], "grads": [], "losses": [], "extra": {"error": None}}
    final = None
    try:
        if CASE == "copt":
            train_copt(model, rank, truth)
        elif CASE == "func":
            final = train_func(model, rank, truth)
        else:
            train_act(model, rank, truth)
    except Exception as e:  # the ground truth says it; the job still fails
        truth["extra"]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise
    finally:
        truth["model"] = local(final if final is not None else dict(model.named_parameters()))
        truth["extra"]["counters"] = counters()
        if E("R15C_SAVE"):
            torch.save(truth, E("R15C_SAVE") + (f".{rank}" if rank else ""))
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
