"""Trainers of round 6 (verdicts that cannot be fooled). Imports nothing from parity.

    python tests/trainers/round6.py                                   (one-process cases)
    torchrun --standalone --nproc_per_node 2 tests/trainers/round6.py (R6_CASE=zero|ddp|tp|ranks)

Every case saves its ground truth when R6_SAVE=PATH is set (``PATH.<rank>``, torch.save of a
dict): ``steps``, one entry per iteration with the model's state dict (parameters and
buffers), its gradients (None kept) and the loss, and ``final``, the state dict at the end.
The test compares the two sides' files with ``torch.equal``.

Knobs (environment):
  R6_CASE   the shape (default plain); see ``CASES`` at the end
  R6_STEPS  iterations (default 4)
  R6_LR     learning rate (default 0.1)
  R6_LR1    (inbwd) learning rate of the first parameter's own optimizer (default R6_LR)
  R6_MODE   a per-case variant, described at each case
  R6_X      a per-case number, described at each case
  R6_SEED   model seed (default 1)
"""

import os

import torch
import torch.nn as nn

CASE = os.environ.get("R6_CASE", "plain")
STEPS = int(os.environ.get("R6_STEPS", "4"))
LR = float(os.environ.get("R6_LR", "0.1"))
MODE = os.environ.get("R6_MODE", "")
X = os.environ.get("R6_X", "")
SEED = int(os.environ.get("R6_SEED", "1"))
_TRUTH = {"steps": [], "final": None}
_KEEP = []


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _model(seed=None):
    torch.manual_seed(SEED if seed is None else seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(k=0):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _sd(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def note(model, loss, extra=None):
    """One iteration's ground truth: state dict, gradients, loss."""
    grads = {n: (None if p.grad is None else _full(p.grad).detach().clone())
             for n, p in model.named_parameters()}
    sd = {k: _full(v) for k, v in _sd(model).items()}
    _TRUTH["steps"].append({"state": sd, "grads": grads,
                            "loss": None if loss is None else loss.detach().clone(),
                            "extra": extra})


def finish(model, extra=None):
    _TRUTH["final"] = {k: _full(v) for k, v in _sd(model).items()}
    if extra is not None:
        _TRUTH["final_extra"] = extra
    if os.environ.get("R6_SAVE"):
        torch.save(_TRUTH, f"{os.environ['R6_SAVE']}.{_rank()}")
    _KEEP.append(model)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _loop(model, opt, steps=STEPS, before=None, after=None):
    for k in range(1, steps + 1):
        if before:
            before(k)
        x, y = _data(k)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        if after:
            after(k)
        note(model, loss)


# ------------------------------------------------------------------ optimizer in backward
def inbwd():
    """Per-parameter SGD optimizers stepped in ``register_post_accumulate_grad_hook`` (the
    PyTorch tutorial "optimizer step in backward"); R6_MODE=plain: one SGD stepped after
    backward. R6_LR1: the first parameter's lr. R6_MODE=keep: the hook keeps the gradient
    (the tutorial sets it to None)."""
    model = _model()
    lr1 = float(os.environ.get("R6_LR1", LR))
    params = list(model.parameters())
    if MODE == "plain":
        opt = torch.optim.SGD(params, lr=LR)
        _loop(model, opt)
        return finish(model)
    opts = {p: torch.optim.SGD([p], lr=lr1 if i == 0 else LR) for i, p in enumerate(params)}

    def hook(p):
        opts[p].step()
        if MODE != "keep":
            p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    for k in range(1, STEPS + 1):
        x, y = _data(k)
        for o in opts.values():
            o.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        note(model, loss)
    finish(model)


# ------------------------------------------------------------------ module utilities
def prune():
    """l1_unstructured pruning of layer 0's weight (R6_X amount, default 0.3) at iteration
    R6_MODE (default 1: before training; 0: never); R6_MODE=end: after the last step, pruned
    and made permanent (``prune.remove``: a new Parameter ``weight``), as before an export."""
    import torch.nn.utils.prune as P

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if MODE == "end":
        _loop(model, opt)
        P.l1_unstructured(model[0], "weight", amount=float(X or "0.3"))
        P.remove(model[0], "weight")
        return finish(model)
    at = int(MODE or "1")
    amount = float(X or "0.3")

    def before(k):
        if k == at:
            P.l1_unstructured(model[0], "weight", amount=amount)

    if at == 1:
        before(1)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        _loop(model, opt)
    else:
        _loop(model, opt, before=before)
    finish(model)


def lazy():
    """nn.LazyLinear layers materialised at the first forward; the optimizer is built before
    (R6_MODE=after: after one dry forward)."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(4))
    if MODE == "after":
        model(_data(0)[0])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


def orth():
    """An orthogonal parametrization of layer 0's weight (16x8); R6_MODE=matrix_exp|cayley|
    householder (default: torch's default)."""
    from torch.nn.utils.parametrizations import orthogonal

    model = _model()
    kw = {"orthogonal_map": MODE} if MODE else {}
    orthogonal(model[0], "weight", **kw)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


def swa():
    """An ``AveragedModel`` EMA (``get_ema_multi_avg_fn(R6_X)``, default 0.9) updated after each
    step; R6_MODE=buffers: use_buffers=True over a model with BatchNorm."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _model()
    if MODE == "buffers":
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(float(X or "0.9")),
                        use_buffers=MODE == "buffers")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt, after=lambda k: ema.update_parameters(model))
    finish(model, extra=_sd(ema))
    _KEEP.append(ema)


def qat():
    """Fake quantization with moving-average observers (buffers updated in forward):
    FakeQuantize modules on layer 0's output, averaging constant R6_X (default 0.01)."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    torch.manual_seed(SEED)
    fq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                      averaging_constant=float(X or "0.01"))
    model = nn.Sequential(nn.Linear(8, 16), fq, nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


def spectral():
    """Spectral norm of layer 0 (power-iteration buffers _u, _v updated in forward):
    R6_X power iterations (default 1)."""
    from torch.nn.utils.parametrizations import spectral_norm

    model = _model()
    spectral_norm(model[0], n_power_iterations=int(X or "1"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


# ------------------------------------------------------------------ checkpoint / resume
def resume():
    """At iteration 3: R6_MODE=inplace loads a saved state (taken at that point) back into the
    same model and optimizer; R6_MODE=rebuild builds a new model and Adam and loads it into
    them (the old ones dropped); R6_MODE=perturb loads it with one weight changed by 1e-3;
    R6_MODE=dcp saves and loads with torch.distributed.checkpoint (one process); R6_MODE=optim
    perturbs only Adam's exp_avg; default: no load."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for k in range(1, STEPS + 1):
        if k == 3 and MODE:
            sd, osd = _sd(model), opt.state_dict()
            import copy

            osd = copy.deepcopy(osd)
            if MODE == "perturb":
                sd["0.weight"][0, 0] += 1e-3
            if MODE == "optim":
                osd["state"][0]["exp_avg"][0, 0] += 1e-3
            if MODE == "dcp":
                import torch.distributed.checkpoint as dcp

                path = os.environ["R6_SAVE"] + ".dcp"
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.save(state, checkpoint_id=path, no_dist=True)
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=path, no_dist=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
            elif MODE == "rebuild":
                del opt
                model = _model(seed=99)
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                model.load_state_dict(sd)
                opt.load_state_dict(osd)
            else:
                model.load_state_dict(sd)
                opt.load_state_dict(osd)
        x, y = _data(k)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(model, loss)
    finish(model)


# ------------------------------------------------------------------ schedules and groups
def sched():
    """R6_MODE=onecycle: OneCycleLR (total_steps R6_X, default STEPS); R6_MODE=lambda: LambdaLR
    whose factor is 1 up to iteration R6_X (default STEPS) and 0.5 after."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if MODE == "onecycle":
        s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=int(X or STEPS) + 1)
    else:
        last = int(X or STEPS)
        s = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 if e < last else 0.5)
    _loop(model, opt, after=lambda k: s.step())
    finish(model)


def groups():
    """Layer 2 joins the optimizer by add_param_group at iteration R6_X (default 2);
    R6_MODE=wd: instead two groups from the start, weight decay R6_X on layer 2's only."""
    model = _model()
    if MODE == "wd":
        opt = torch.optim.SGD([{"params": model[0].parameters()},
                               {"params": model[2].parameters(), "weight_decay": float(X)}],
                              lr=LR)
        _loop(model, opt)
        return finish(model)
    opt = torch.optim.SGD(model[0].parameters(), lr=LR)
    at = int(X or "2")

    def before(k):
        if k == at:
            opt.add_param_group({"params": model[2].parameters()})

    _loop(model, opt, before=before)
    finish(model)


def impl():
    """Adam with R6_MODE=foreach|forloop|fused (default: torch's default); R6_X=adamw: AdamW."""
    model = _model()
    kw = {"foreach": {"foreach": True}, "forloop": {"foreach": False},
          "fused": {"fused": True}}.get(MODE, {})
    cls = torch.optim.AdamW if X == "adamw" else torch.optim.Adam
    opt = cls(model.parameters(), lr=0.01, **kw)
    _loop(model, opt)
    finish(model)


# ------------------------------------------------------------------ backward shapes
def backward():
    """R6_MODE=retain: two losses, two backward passes (the first with retain_graph);
    sum: one backward of their sum; grad: torch.autograd.grad and the gradients assigned by
    hand; inputs: loss.backward(inputs=layer 2's parameters) with layer 0 frozen by
    requires_grad_(False) (R6_X=frozen) or not (default: layer 0 simply gets no gradient)."""
    model = _model()
    if MODE == "inputs" and X == "frozen":
        model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for k in range(1, STEPS + 1):
        x, y = _data(k)
        opt.zero_grad()
        out = model(x)
        l1, l2 = _mse(out, y), out.abs().mean()
        if MODE == "retain":
            l1.backward(retain_graph=True)
            l2.backward()
            loss = l1 + l2
        elif MODE == "grad":
            loss = l1 + l2
            params = [p for p in model.parameters()]
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        elif MODE == "inputs":
            loss = l1 + l2
            if X == "frozen":
                loss.backward()
            else:
                loss.backward(inputs=list(model[2].parameters()))
        else:
            loss = l1 + l2
            loss.backward()
        opt.step()
        note(model, loss)
    finish(model)


# ------------------------------------------------------------------ names
class _Dict(nn.Module):
    def __init__(self, order):
        super().__init__()
        torch.manual_seed(SEED)
        vals = {"a": torch.randn(8, 16), "b": torch.randn(16, 4), "c": torch.randn(4)}
        keys = list(vals)[::-1] if order == "reverse" else list(vals)
        self.p = nn.ParameterDict({k: nn.Parameter(vals[k]) for k in keys})

    def forward(self, x):
        return torch.tanh(x @ self.p["a"]) @ self.p["b"] + self.p["c"]


class _List(nn.Module):
    def __init__(self, order):
        super().__init__()
        torch.manual_seed(SEED)
        vals = [torch.randn(8, 16), torch.randn(16, 4)]
        self.order = order
        self.p = nn.ParameterList(vals[::-1] if order == "reverse" else vals)

    def forward(self, x):
        a, b = (self.p[1], self.p[0]) if self.order == "reverse" else (self.p[0], self.p[1])
        return torch.tanh(x @ a) @ b


class _Renamed(nn.Module):
    def __init__(self):
        super().__init__()
        m = _model()
        self.enc, self.act, self.head = m[0], m[1], m[2]

    def forward(self, x):
        return self.head(self.act(self.enc(x)))


def names():
    """R6_MODE=dict|dict_reverse: a ParameterDict filled in another key order; list|
    list_reverse: a ParameterList holding the same tensors in the other order; seq|renamed:
    the same model as a Sequential or with named attributes (enc/act/head)."""
    if MODE.startswith("dict"):
        model = _Dict("reverse" if MODE.endswith("reverse") else "")
    elif MODE.startswith("list"):
        model = _List("reverse" if MODE.endswith("reverse") else "")
    elif MODE == "renamed":
        model = _Renamed()
    else:
        model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


# ------------------------------------------------------------------ distributed
def _init():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist


def zero():
    """ZeroRedundancyOptimizer (Adam) over DDP, 2 ranks; R6_MODE=plain: plain Adam over DDP.
    R6_LR: Adam's lr (default 0.01 here)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    model = DDP(_model())
    lr = float(os.environ.get("R6_LR", "0.01"))
    if MODE == "plain":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + dist.get_rank())
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(model.module, loss)
    finish(model.module)
    dist.destroy_process_group()


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = _model()
        self.extra = nn.Linear(8, 4)

    def forward(self, x, k):
        out = self.m(x)
        if k % 2 == 0:
            out = out + self.extra(x)
        return out


def ddp():
    """DDP over 2 ranks with R6_MODE a comma list of static_graph, find_unused,
    bucket_view (gradient_as_bucket_view), unused (a layer used at even iterations only:
    needs find_unused), small (bucket_cap_mb tiny)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    opts = set(MODE.split(",")) - {""}
    inner = _Unused() if "unused" in opts else _model()
    kw = {}
    if "static_graph" in opts:
        kw["static_graph"] = True
    if "find_unused" in opts:
        kw["find_unused_parameters"] = True
    if "bucket_view" in opts:
        kw["gradient_as_bucket_view"] = True
    if "small" in opts:
        kw["bucket_cap_mb"] = 0.0001
    model = DDP(inner, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + dist.get_rank())
        opt.zero_grad()
        out = model(x, k) if "unused" in opts else model(x)
        loss = _mse(out, y)
        loss.backward()
        opt.step()
        note(inner, loss)
    finish(inner)
    dist.destroy_process_group()


def tp():
    """Tensor parallel over 2 ranks (gloo): layer 0 ColwiseParallel, layer 2 RowwiseParallel;
    R6_MODE=eager: the same model replicated, no DTensor, the same global batch;
    R6_MODE=swapped: the mesh lists the ranks in reverse (rank 0 holds shard 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist = _init()
    model = _model()
    if MODE != "eager":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        if MODE == "swapped":  # rank r holds shard 1 - r: the same global tensors
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()).flip(0))
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(),
                                                 "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)
    dist.destroy_process_group()


def ranks():
    """Each rank trains its own model (no collectives but a barrier). R6_MODE=late: rank 1's
    lr changes at iteration 3; fewer: rank 1 runs one iteration fewer."""
    dist = _init()
    rank = dist.get_rank()
    model = _model(seed=SEED + rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = STEPS - 1 if (MODE == "fewer" and rank == 1) else STEPS

    def before(k):
        if MODE == "late" and rank == 1 and k == 3:
            for g in opt.param_groups:
                g["lr"] = LR / 2

    _loop(model, opt, steps=steps, before=before)
    finish(model)
    dist.barrier()
    dist.destroy_process_group()


def join():
    """DDP over 2 ranks with uneven inputs under ``torch.distributed.algorithms.Join``: rank 1
    has one batch fewer (it shadows rank 0's last all-reduce and takes no step)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    inner = _model()
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n = STEPS - dist.get_rank()
    with Join([model]):
        for k in range(1, n + 1):
            x, y = _data(10 * k + dist.get_rank())
            opt.zero_grad()
            loss = _mse(model(x), y)
            loss.backward()
            opt.step()
            note(inner, loss)
    finish(inner)
    dist.destroy_process_group()


# ------------------------------------------------------------------ others
def plain():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


def rawema():
    """An EMA kept as a dict of plain tensors (no module, no optimizer), decay R6_X."""
    model = _model()
    ema = {k: v.detach().clone() for k, v in model.named_parameters()}
    d = float(X or "0.9")
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def after(k):
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].lerp_(p, 1 - d)

    _loop(model, opt, after=after)
    finish(model, extra=ema)


def freeze():
    """Layer 0 frozen (requires_grad_(False)) from iteration R6_X (default never)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    at = int(X or "0")

    def before(k):
        if k == at:
            model[0].requires_grad_(False)
            model[0].weight.grad = None
            model[0].bias.grad = None

    _loop(model, opt, before=before)
    finish(model)


def bnmom():
    """BatchNorm with momentum R6_X (default 0.1; 'none': cumulative average)."""
    torch.manual_seed(SEED)
    mom = None if X == "none" else float(X or "0.1")
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=mom), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _loop(model, opt)
    finish(model)


def maximize():
    """SGD on the loss (default) or maximize=True on its negation (R6_MODE=max)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, maximize=MODE == "max")
    for k in range(1, STEPS + 1):
        x, y = _data(k)
        opt.zero_grad()
        loss = _mse(model(x), y)
        (-loss if MODE == "max" else loss).backward()
        opt.step()
        note(model, loss)
    finish(model)


CASES = {f.__name__: f for f in (inbwd, prune, lazy, orth, swa, qat, spectral, resume, sched,
                                  groups, impl, backward, names, zero, ddp, tp, ranks, join, plain,
                                  rawema, freeze, bnmom, maximize)}

if __name__ == "__main__":
    CASES[CASE]()
