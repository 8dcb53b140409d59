"""Trainers whose state is not all in an optimizer, and one that keeps a fake copy of its model.
It imports nothing from parity.

    HS_CASE=ema|probe|fake_copy python tests/trainers/held_state.py

Cases (environment):
  ema        an EMA copy of the weights lives inside the model tree (``model.ema``, frozen
             parameters no optimizer holds), updated by hand after each ``step()`` with
             decay HS_DECAY (default 0.9)
  probe      linear probe: a frozen backbone with BatchNorm in train mode (momentum
             HS_MOMENTUM, default 0.1) and a head; only the head is in the optimizer. The
             backbone is its own module tree (HS_TREE=own, default) or the model's child
             (HS_TREE=inside)
  fake_copy  the model trains while a FakeTensorMode copy of it (the way AutoParallel keeps the
             model it traced), a meta-device copy, and a copy that holds the model's own
             parameters beside a fake buffer (AutoParallel's copy after apply_placement) stay
             alive
  odd_tensor the model holds a buffer that is a tensor subclass (not a DTensor): capture names
             it instead of hashing it
HS_STEPS (default 3).
"""

import copy
import os

import torch
import torch.nn as nn

STEPS = int(os.environ.get("HS_STEPS", "3"))
CASE = os.environ.get("HS_CASE", "ema")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class WithEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Net()
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x):
        return self.net(x)


class Tagged(torch.Tensor):
    """A tensor subclass that is no DTensor."""


class Probe(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone  # None: the backbone is its own module tree
        self.head = nn.Linear(8, 4)

    def forward(self, h):
        return self.head(self.backbone(h) if self.backbone is not None else h)


def backbone():
    bn = nn.BatchNorm1d(8, momentum=float(os.environ.get("HS_MOMENTUM", "0.1")))
    return nn.Sequential(nn.Linear(8, 8), bn, nn.ReLU()).requires_grad_(False).train()


def fake_copy(model):
    """A FakeTensorMode copy: parameters and buffers swapped for fake tensors (AutoParallel's
    ``move_to_fake``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = copy.deepcopy(model)
    for mod in fake.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(mode.from_tensor(p), p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = mode.from_tensor(b)
    return fake


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    keep = []  # objects the trainer keeps alive without training them
    tree = os.environ.get("HS_TREE", "own")
    if CASE == "ema":
        model = WithEMA()
        params = model.net.parameters()
    elif CASE == "probe":
        bb = backbone()
        model = Probe(bb if tree == "inside" else None)
        run_bb = (lambda x: x) if tree == "inside" else bb
        params = model.head.parameters()
    elif CASE == "fake_copy":
        shared = fake_copy(Net())  # older than the model, as AutoParallel's traced copy is
        model = Net()
        keep.append(fake_copy(model))
        with torch.device("meta"):
            keep.append(Net())
        for name in ("l1", "l2"):  # it ends up holding the model's own parameters
            setattr(shared, name, getattr(model, name))
        shared.register_buffer("freqs", keep[0].l1.weight.new_zeros(4))  # a fake buffer
        keep.append(shared)
        params = model.parameters()
    elif CASE == "late_copy":  # a deepcopy of the model made mid-run (an EMA started late)
        model = Net()
        params = model.parameters()
    elif CASE == "odd_tensor":
        model = Net()
        model.register_buffer("tag", torch.zeros(3).as_subclass(Tagged))
        params = model.parameters()
    else:
        raise SystemExit(f"unknown HS_CASE {CASE}")
    opt = torch.optim.SGD(params, lr=0.1)
    decay = float(os.environ.get("HS_DECAY", "0.9"))
    for step in range(STEPS):
        x = torch.randn(16, 8)
        h = run_bb(x) if CASE == "probe" else x
        loss = model(h).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if CASE == "late_copy" and step + 1 == 5:
            keep.append(copy.deepcopy(model).requires_grad_(False))  # its own tree
        if CASE == "late_copy" and step + 1 > 5:
            with torch.no_grad():
                for e, p in zip(keep[-1].parameters(), model.parameters()):
                    e.mul_(decay).add_(p, alpha=1 - decay)
        if CASE == "ema":
            with torch.no_grad():
                for e, p in zip(model.ema.parameters(), model.net.parameters()):
                    e.mul_(decay).add_(p, alpha=1 - decay)
        print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    assert all(k is not None for k in keep)


if __name__ == "__main__":
    main()
