"""Trainers of round 5 (verdicts that cannot be fooled). Imports nothing from parity.

    python tests/trainers/round5.py                                   (R5_CASE=funcall|abort)
    torchrun --standalone --nproc_per_node 2 tests/trainers/round5.py (R5_CASE=nosync)

Knobs (environment):
  R5_CASE=funcall|abort|teachers|cstep|drop|zeroing|nosync   (default funcall)
      funcall  a Linear-Tanh-Linear model trained through ``torch.func.functional_call`` with a
               params dict of clones (tensors no module holds: the optimizer's only
               parameters), SGD, R5_STEPS steps
      abort    the same model trained directly; at iteration R5_ABORT_AT (default 2) the batch
               is skipped: by ``continue`` before ``opt.step()`` (R5_SKIP=continue, default), or
               by a step pre-hook of the trainer that raises, caught around ``opt.step()``
               (R5_SKIP=raise): the same updates either way; R5_STEPS iterations are run
               besides the skipped one. R5_TWO=1: two optimizers stepped back to back (one
               step), layer 0's then layer 2's, and only the second refuses (R5_STEPS
               iterations in all)
      teachers two frozen teachers of one class (an ensemble, no optimizer holds them) and a
               Linear student; R5_BUILD=reverse builds the teachers in the other order (each
               seeded alone: the same models); R5_SEED2=S seeds the second teacher (default 10)
      cstep    the model trained with Adam whose step is compiled (R5_COMPILE=1:
               ``torch.compile(backend="eager")`` of a function calling ``opt.step()``, as the
               PyTorch tutorial on compiling the optimizer does; R5_COMPILE=train: the forward
               and ``loss.backward()`` compiled in one function, the step eager; default:
               eager); R5_SAVE=PATH
               saves every step's parameters (torch.save of a list of lists)
      drop     the model trained R5_STEPS steps, then R5_DROP: bias (``model[2].bias = None``,
               as an export step that drops a bias), move (an identity parametrization
               registered on ``model[2].weight``: the same Parameter moves to
               ``parametrizations.weight.original``), or nothing (default); the model lives on
      zeroing  a Linear and a ``gate`` Linear whose output is added, except at step 2 (the gate
               gets no gradient there); SGD without momentum, so the parameters do not care;
               ``opt.zero_grad(set_to_none=R5_NONE)`` (default 1: gradients set to None; 0:
               zeroed)
      nosync   FSDP2 (gloo), three Linear layers each sharded, one step of two micro-batches,
               with integer weights and inputs and a sum loss (every gradient exact, so any
               order of reduction gives the same bits); R5_SYNC=each (default) reduce-scatters
               the gradients at every micro-batch, R5_SYNC=last only at the last one
               (``set_requires_gradient_sync(False)`` before the first)
  R5_ORDER=reverse  (funcall) the params dict's tensors are handed to the optimizer in reverse
               order (the same tensors, the same updates)
  R5_LR=X      (funcall) learning rate (default 0.1)
  R5_STEPS=N   optimizer steps (default 3)
"""

import os

import torch
import torch.nn as nn

CASE = os.environ.get("R5_CASE", "funcall")
STEPS = int(os.environ.get("R5_STEPS", "3"))


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def funcall():
    from torch.func import functional_call

    model = _model()
    x, y = _data()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    tensors = list(params.values())
    if os.environ.get("R5_ORDER") == "reverse":
        tensors = tensors[::-1]
    opt = torch.optim.SGD(tensors, lr=float(os.environ.get("R5_LR", "0.1")))
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((functional_call(model, params, (x,)) - y) ** 2).mean()
        loss.backward()
        opt.step()


class _Skip(Exception):
    pass


def abort():
    model = _model()
    x, y = _data()
    two = os.environ.get("R5_TWO") == "1"
    first = torch.optim.SGD(model[0].parameters(), lr=0.1) if two else None
    opt = torch.optim.SGD(model[2].parameters() if two else model.parameters(), lr=0.1)
    skip_at = int(os.environ.get("R5_ABORT_AT", "2"))
    by_raise = os.environ.get("R5_SKIP", "continue") == "raise"
    it = {"k": 0}

    def refuse(o, args, kwargs):  # the trainer's own check, before the optimizer runs
        if it["k"] == skip_at:
            raise _Skip(f"batch {it['k']} refused")

    if by_raise:
        opt.register_step_pre_hook(refuse)
    for k in range(1, (STEPS if two else STEPS + 1) + 1):
        it["k"] = k
        opt.zero_grad()
        if two:
            first.zero_grad()
        loss = ((model(x * k) - y) ** 2).mean()
        loss.backward()
        if two:
            first.step()  # the first of two stepped back to back: it always runs
        if not by_raise and k == skip_at:
            continue
        try:
            opt.step()
        except _Skip:
            pass


def teachers():
    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).requires_grad_(False)

    seed2 = int(os.environ.get("R5_SEED2", "10"))
    if os.environ.get("R5_BUILD") == "reverse":
        t2 = build(seed2)
        t1 = build(9)
    else:
        t1 = build(9)
        t2 = build(seed2)
    torch.manual_seed(2)
    student = nn.Linear(8, 4)
    x, _ = _data()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.no_grad():
            target = t1(x) + 0.5 * t2(x)
        loss = ((student(x) - target) ** 2).mean()
        loss.backward()
        opt.step()


def cstep():
    model = _model()
    x, y = _data()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = opt.step

    def forward_backward():
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    if os.environ.get("R5_COMPILE") == "1":
        @torch.compile(backend="eager")
        def step():
            opt.step()
    elif os.environ.get("R5_COMPILE") == "train":
        forward_backward = torch.compile(forward_backward, backend="eager")
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        forward_backward()
        step()
        history.append([p.detach().clone() for p in model.parameters()])
    if os.environ.get("R5_SAVE"):
        torch.save(history, os.environ["R5_SAVE"])


_KEEP = []


def drop():
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    what = os.environ.get("R5_DROP", "")
    if what == "bias":
        model[2].bias = None
    elif what == "move":
        from torch.nn.utils import parametrize

        parametrize.register_parametrization(model[2], "weight", nn.Identity())
    _KEEP.append(model)  # alive when the process ends


def zeroing():
    torch.manual_seed(1)
    model = nn.ModuleDict({"a": nn.Linear(8, 4), "gate": nn.Linear(8, 4)})
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    to_none = os.environ.get("R5_NONE", "1") == "1"
    for k in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=to_none)
        out = model["a"](x)
        if k != 2:
            out = out + model["gate"](x)
        ((out - y) ** 2).mean().backward()
        opt.step()


def nosync():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(i)
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -12)
    sync_last_only = os.environ.get("R5_SYNC", "each") == "last"
    for k in range(1, STEPS + 1):
        opt.zero_grad()
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * rank + 10 * k + micro)
            x = torch.randint(-3, 4, (8, 8), generator=g).float()
            if sync_last_only:
                model.set_requires_gradient_sync(micro == 1)
            model(x).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"funcall": funcall, "abort": abort, "teachers": teachers, "cstep": cstep,
     "drop": drop, "zeroing": zeroing, "nosync": nosync}[CASE]()
