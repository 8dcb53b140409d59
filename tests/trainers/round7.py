"""Round 7 trainer: shapes aimed at the optimizers' state in the final state (imports nothing
from parity). Ground truth: R7_SAVE gets torch.save of {"model": state dict, "opts": [each
optimizer's state dict at the end], "steps": [per-step parameter state dicts]}.

Knobs (environment):
  R7_CASE   plain | phases | delopt | two | shared | addgroup | freeze | reload | handstate |
            dist | compile | big | fxfree (the optimizer freed inside a make_fx trace)
  R7_OPT    adam | adamw | bigadam | adagrad | rmsprop | sgd | lbfgs | sparse | custom
            | adafactor | nadam | radam | adamax | asgd | rprop | adadelta (default adam;
            custom keeps Python numbers in its state, R7_HALF=1 other ones)
  R7_IMPL   foreach | forloop | fused (Adam/AdamW; default: torch's choice)
  R7_CAPT=1 capturable;  R7_AMS=1 amsgrad;  R7_B1 beta1 (0.5);  R7_LR (0.01);  R7_MOM (0.9)
  R7_NEST=1 SGD nesterov;  R7_STEPS (3)
  R7_LAST_B1  phases: beta1 of the last phase only (one step: the same parameters)
  R7_PHASES (3), R7_DEL=1  phases: the old optimizer freed before the next is made (bigadam:
            the next one gets its id)
  R7_ONLY=1 shared: the second optimizer holds only the shared parameter
  R7_PERTURB=1  reload: exp_avg of the reloaded copy scaled by 1.5
  R7_WRAP   dist: ddp | fsdp2 | zero | none (2 ranks, gloo)
  R7_COMPILE=1  compile: the optimizer step under torch.compile
  R7_RESET=assign|clear|load  plain: the optimizer's state dropped (or a copy loaded, its
            exp_avg times R7_SCALE) after the last step
  R7_END=return|keep  the optimizer freed when main() returns (default) or kept globally

    python tests/trainers/round7.py
    torchrun --standalone --nproc_per_node 2 tests/trainers/round7.py   (R7_CASE=dist)
"""

import copy
import gc
import os
import weakref
from collections import defaultdict

import torch
import torch.nn as nn

E = os.environ.get
CASE = E("R7_CASE", "plain")
OPT = E("R7_OPT", "adam")
IMPL = E("R7_IMPL", "")
STEPS = int(E("R7_STEPS", "3"))
B1 = float(E("R7_B1", "0.5"))
LR = float(E("R7_LR", "0.01"))
KEEP = []


class Floaty(torch.optim.Optimizer):
    """SGD with momentum whose state also keeps Python floats and ints."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["buf"] = p.grad.clone()
                    st["count"] = 0
                    st["scale"] = 1.0
                else:
                    st["buf"].mul_(0.9).add_(p.grad)
                st["count"] += 1
                st["scale"] *= 0.5 if E("R7_HALF") == "1" else 1.0
                p.add_(st["buf"], alpha=-g["lr"])


class Pair:
    """Two optimizers stepped as one (SparseAdam for sparse gradients, Adam for the rest)."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self, closure=None):
        for o in self.opts:
            o.step()

    def state_dict(self):
        state = {}
        for j, o in enumerate(self.opts):
            state.update({(j, i): st for i, st in o.state_dict()["state"].items()})
        return {"state": state, "param_groups": []}


class BigAdam(torch.optim.Adam):
    """Adam whose objects are over 512 bytes (malloc'd, not pymalloc'd): one freed before the
    next is created lends it its block, so the new optimizer has the freed one's id()."""

    __slots__ = tuple(f"s{i}" for i in range(80))


def make_opt(params, lr=None, b1=None):
    lr = LR if lr is None else lr
    b1 = B1 if b1 is None else b1
    kw = {}
    if OPT in ("adam", "adamw", "bigadam"):
        if IMPL == "foreach":
            kw["foreach"] = True
        elif IMPL == "forloop":
            kw["foreach"] = False
        elif IMPL == "fused":
            kw["fused"] = True
        if E("R7_CAPT") == "1":
            kw["capturable"] = True
        if E("R7_AMS") == "1":
            kw["amsgrad"] = True
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "bigadam": BigAdam}[OPT]
        return cls(params, lr=lr, betas=(b1, 0.999), **kw)
    if OPT == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if OPT == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=float(E("R7_MOM", "0.9")))
    if OPT == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(E("R7_MOM", "0.9")),
                               nesterov=E("R7_NEST") == "1")
    if OPT == "lbfgs":
        return torch.optim.LBFGS(params, lr=lr * 10, history_size=3, max_iter=2)
    if OPT == "sparse":  # the embedding's sparse gradients: SparseAdam; the rest: Adam
        params = list(params)
        sparse = [p for p in params if p.dim() == 2 and p.shape[0] == 20]
        dense = [p for p in params if all(p is not q for q in sparse)]
        return Pair(torch.optim.SparseAdam(sparse, lr=lr, betas=(b1, 0.999)),
                    torch.optim.Adam(dense, lr=lr))
    if OPT == "custom":
        return Floaty(params, lr=lr)
    named = {"adafactor": "Adafactor", "nadam": "NAdam", "radam": "RAdam", "adamax": "Adamax",
             "asgd": "ASGD", "rprop": "Rprop", "adadelta": "Adadelta"}
    if OPT in named:
        return getattr(torch.optim, named[OPT])(params, lr=lr)
    raise SystemExit(f"unknown R7_OPT {OPT}")


def model_for():
    torch.manual_seed(0)
    if OPT == "sparse":
        return nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Flatten(), nn.Linear(24, 4))
    if CASE == "big":
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(1000)])
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def data():
    g = torch.Generator().manual_seed(1)
    if OPT == "sparse":
        return torch.randint(0, 20, (16, 3), generator=g)
    return torch.randn(16, 8 if CASE != "big" else 4, generator=g)


def step(model, opts, x):
    for o in opts:
        o.zero_grad()

    def closure():
        for o in opts:
            o.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    if OPT == "lbfgs":
        for o in opts:
            o.step(closure)
        return
    closure()
    for o in opts:
        o.step()


def snap(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save(model, opts, steps, extra=None):
    path = E("R7_SAVE")
    if not path:
        return
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        sd[k] = v.clone()
    out = {"model": sd, "opts": [], "steps": steps, "extra": extra or {}}
    for o in opts:
        s = o.state_dict()
        out["opts"].append({"state": {i: {k: (v.full_tensor() if hasattr(v, "full_tensor")
                                              else v) for k, v in st.items()}
                                      for i, st in s["state"].items()},
                            "groups": s["param_groups"]})
    rank = int(E("RANK", "0"))
    torch.save(out, path + (f".{rank}" if E("WORLD_SIZE") else ""))


def main():
    model = model_for()
    x = data()
    steps = []
    extra = {}
    if CASE in ("plain", "big"):
        opt = make_opt(model.parameters())
        for _ in range(STEPS):
            step(model, [opt], x)
            steps.append(snap(model))
        if E("R7_RESET") == "assign":  # the state dropped after the last step
            opt.state = defaultdict(dict)
        elif E("R7_RESET") == "clear":
            opt.state.clear()
        elif E("R7_RESET") == "load":  # a perturbed copy loaded after the last step
            saved = copy.deepcopy(opt.state_dict())
            for st in saved["state"].values():
                st["exp_avg"].mul_(float(E("R7_SCALE", "1")))
            opt.load_state_dict(saved)
        opts = [opt]
    elif CASE == "phases":  # the optimizer re-created for the same parameters, 3 phases
        n = int(E("R7_PHASES", "3"))
        opt = None
        for ph in range(n):
            last = ph == n - 1
            b1 = float(E("R7_LAST_B1", str(B1))) if last else B1
            if E("R7_DEL") == "1":  # the old one freed first: the new one may reuse its id
                opt = None
                gc.collect()
            opt = make_opt(model.parameters(), b1=b1)
            for _ in range(1 if last else STEPS):
                step(model, [opt], x)
                steps.append(snap(model))
        opts = [opt]
    elif CASE == "delopt":  # the optimizer deleted before the end; a last edit after
        opt = make_opt(model.parameters())
        for _ in range(STEPS):
            step(model, [opt], x)
            steps.append(snap(model))
        extra["opt"] = copy.deepcopy(opt.state_dict()["state"])
        del opt
        gc.collect()
        with torch.no_grad():
            model[0].bias.mul_(float(E("R7_SCALE", "1")))
        opts = []
        extra["deleted"] = True
    elif CASE == "two":  # two optimizers over disjoint parameters
        a = make_opt(model[0].parameters())
        b = make_opt(model[2].parameters(), lr=float(E("R7_LR2", str(LR))))
        for _ in range(STEPS):
            step(model, [a, b], x)
            steps.append(snap(model))
        opts = [a, b]
    elif CASE == "shared":  # model[2].weight in both optimizers
        a = make_opt(list(model[0].parameters()) + [model[2].weight])
        both = [model[2].weight] + ([] if E("R7_ONLY") == "1" else [model[2].bias])
        b = make_opt(both, b1=float(E("R7_B1B", str(B1))))
        for _ in range(STEPS):
            step(model, [a, b], x)
            steps.append(snap(model))
        opts = [a, b]
    elif CASE == "addgroup":  # the last layer joins at step 2
        opt = make_opt(model[0].parameters())
        for i in range(STEPS):
            if i == 1:
                opt.add_param_group({"params": list(model[2].parameters()),
                                     "lr": float(E("R7_LR2", str(LR)))})
            step(model, [opt], x)
            steps.append(snap(model))
        opts = [opt]
    elif CASE == "freeze":  # the first layer frozen after step 1: its state stays
        opt = make_opt(model.parameters())
        for i in range(STEPS):
            if i == 1:
                for p in model[0].parameters():
                    p.requires_grad_(False)
                    p.grad = None
            step(model, [opt], x)
            steps.append(snap(model))
        if E("R7_POKE") == "1":  # the frozen layer's state edited (the parameters are not)
            opt.state[model[0].weight]["exp_avg"].mul_(2)
        opts = [opt]
    elif CASE == "reload":  # a checkpoint of the optimizer reloaded after step 1
        opt = make_opt(model.parameters())
        for i in range(STEPS):
            step(model, [opt], x)
            if i == 0:
                saved = copy.deepcopy(opt.state_dict())
                if E("R7_PERTURB") == "1":
                    for st in saved["state"].values():
                        st["exp_avg"].mul_(1.5)
                opt.load_state_dict(saved)
                del saved
            steps.append(snap(model))
        opts = [opt]
    elif CASE == "handstate":  # opt.state replaced by hand after step 1
        opt = make_opt(model.parameters())
        refs = []
        for i in range(STEPS):
            step(model, [opt], x)
            if i == 0:
                refs = [weakref.ref(t) for st in opt.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor)]
                opt.state = defaultdict(dict)
            if i == 1:
                gc.collect()
                extra["alive_after_next_step"] = sum(r() is not None for r in refs)
                print("old state alive after the next step:",
                      extra["alive_after_next_step"], flush=True)
            steps.append(snap(model))
        opts = [opt]
    elif CASE == "compile":
        opt = make_opt(model.parameters())
        fn = opt.step
        if E("R7_COMPILE") == "1":
            fn = torch.compile(opt.step)
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            fn()
            steps.append(snap(model))
        opts = [opt]
        if E("R7_COMPILE") == "1":
            from torch._dynamo.utils import counters

            extra["frames"] = dict(counters["stats"])
            print("compile counters:", extra["frames"], flush=True)
    elif CASE == "dist":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        wrap = E("R7_WRAP", "ddp")
        torch.manual_seed(0)
        if wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in (model[0], model[2]):
                fully_shard(layer)
            fully_shard(model)
            net = model
        elif wrap in ("ddp", "zero"):
            net = nn.parallel.DistributedDataParallel(model)
        else:
            net = model
        if wrap == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                          lr=LR, betas=(B1, 0.999))
        else:
            opt = make_opt(model.parameters())
        xs = x.chunk(2)[dist.get_rank()]
        for _ in range(STEPS):
            opt.zero_grad()
            net(xs).pow(2).mean().backward()
            opt.step()
            steps.append({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                          for k, v in model.state_dict().items()})
        if wrap == "zero":
            opt.consolidate_state_dict(to=0)
            if dist.get_rank() == 0:
                s = opt.state_dict()
                save(model, [], steps, {"zero_state": s["state"]})
            dist.barrier()
            KEEP.append(opt) if E("R7_END") == "keep" else None
            return
        opts = [opt]
    elif CASE == "fxfree":  # the optimizer freed while make_fx traces another function
        from torch.fx.experimental.proxy_tensor import make_fx

        held = [make_opt(model.parameters())]
        for _ in range(STEPS):
            step(model, held, x)
            steps.append(snap(model))

        def fn(t):
            held.pop()
            return t * 2

        g = make_fx(fn)(torch.randn(3))
        extra["graph"] = [f"{n.op}:{n.target}" for n in g.graph.nodes]
        print("traced graph:", extra["graph"], flush=True)
        opts = []
    else:
        raise SystemExit(f"unknown R7_CASE {CASE}")
    save(model, opts, steps, extra)
    if E("R7_END") == "keep":
        KEEP.extend(opts)


if __name__ == "__main__":
    main()
