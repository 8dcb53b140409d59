"""A replicated (DDP-style) trainer whose gradient all-reduces run inside its compiled graph, as
SimpleFSDP's replicate mode and compiled data parallel do: every parameter passes through an
identity whose backward all-reduces its gradient with a functional collective
(``torch.distributed._functional_collectives.all_reduce``), so aot_autograd traces one
``_c10d_functional.all_reduce`` per gradient into the backward graph. The step also all-reduces
its loss for logging inside the forward graph (a metric all-reduce, no parameter). It imports
nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/compiled_allreduce.py

Options:
  --mode compiled|eager   compiled (default): the loss function runs through torch.compile;
                          eager: the same code op by op
  --eager-sync KIND       how eager mode averages the gradients: funcol (default: the same
                          functional collectives run by their eager kernels), flat (after
                          backward, one ``dist.all_reduce`` of ``torch.cat`` of the gradients in
                          parameter order, copied back, as a hand-written DDP bucket), or
                          flat-reversed (the same buffer packed in reverse parameter order: the
                          order the compiled backward produces the gradients in)
  --bucket                the backward graph's all-reduces merged by inductor's own pass
                          (``torch._inductor.fx_passes.bucketing.bucket_all_reduce``) in an
                          aot_autograd backend: one flat buffer, as a compiled DDP bucket
  --reverse               the parameters enter the model in reverse order (the backward graph
                          then all-reduces them in another order)
  --steps N               optimizer steps (default 3)
  --result DIR            each rank also writes its JSON line to DIR/rank-R.json

Prints one JSON line per rank: {"losses": [...], "global_losses": [...], "unique_graphs": N}.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


class SyncGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient averaged over every rank (sum, then divided:
    gloo has no AVG)."""

    @staticmethod
    def forward(ctx, p):
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        return funcol.all_reduce(g, "sum", dist.group.WORLD) / dist.get_world_size()


class Net(nn.Module):
    def __init__(self, sync=True):
        super().__init__()
        self.sync = sync
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, reverse=False):
        ps = [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias]
        order = range(3, -1, -1) if reverse else range(4)
        synced = [None] * 4
        for i in order:
            synced[i] = SyncGrad.apply(ps[i]) if self.sync else ps[i]
        w1, b1, w2, b2 = synced
        return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def loss_fn(model, x, y, reverse):
    loss = F.mse_loss(model(x, reverse), y)
    total = funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)
    return loss, total / dist.get_world_size()


def flat_sync(model, reverse):
    """One all-reduce of every gradient packed into one buffer, then copied back averaged."""
    grads = [p.grad for p in model.parameters()]
    if reverse:
        grads = grads[::-1]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def bucketing_backend():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.fx_passes.bucketing import bucket_all_reduce

    def fw(gm, inputs):
        return make_boxed_func(gm)

    def bw(gm, inputs):
        bucket_all_reduce(gm, lambda idx: 1000.0)
        gm.recompile()
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="compiled", choices=("compiled", "eager"))
    ap.add_argument("--bucket", action="store_true")
    ap.add_argument("--reverse", action="store_true")
    ap.add_argument("--eager-sync", default="funcol", choices=("funcol", "flat", "flat-reversed"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    flat = args.mode == "eager" and args.eager_sync != "funcol"
    model = Net(sync=not flat)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_fn = loss_fn
    if args.mode == "compiled":
        backend = bucketing_backend() if args.bucket else "aot_eager"
        step_fn = torch.compile(loss_fn, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, global_losses = [], []
    for _ in range(args.steps):
        x = torch.randn(6, 8, generator=gen)
        y = torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        loss, total = step_fn(model, x, y, args.reverse)
        loss.backward()
        if flat:
            flat_sync(model, args.eager_sync == "flat-reversed")
        opt.step()
        losses.append(loss.item())
        global_losses.append(torch.as_tensor(total).item())
    from torch._dynamo.utils import counters

    line = json.dumps({"losses": losses, "global_losses": global_losses,
                       "unique_graphs": counters["stats"]["unique_graphs"]})
    print(line, flush=True)
    if args.result:
        os.makedirs(args.result, exist_ok=True)
        with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
            f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
