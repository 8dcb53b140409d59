"""Round 8b trainer: compilation and numerics shapes (imports nothing from parity). Ground truth:
R8_SAVE gets torch.save of {"model": final state dict (``_orig_mod.`` and checkpoint-wrapper
prefixes removed), "opts": [optimizer state dicts], "steps": [per-step parameters], "grads":
[per-step gradients], "losses": [per-step losses], "extra": {dynamo's counters, the graphs a
counting backend saw}}. The run prints "compile record: ..." so a run with and without
``parity exec`` can be compared.

Knobs (environment):
  R8_CASE     mlp | ensemble | export                       (default mlp)
  R8_COMPILE  none | wrap (torch.compile(model)) | inplace (model.compile()) | regional (each
              block's .compile()) | regwrap (each block replaced by torch.compile(block))
              | step (the whole train step compiled, backward included)
  R8_BACKEND  count (a counting backend around aot_eager) | inductor | aot_eager | eager
  R8_MODE     torch.compile mode (reduce-overhead ...)
  R8_DYN      1: dynamic=True;  R8_MARK=1: torch._dynamo.mark_dynamic(x, 0) each step
  R8_VARY     1: the batch size varies per step (8, 6, 5, 7, ...)
  R8_CA       1: compiled autograd (torch._dynamo.config.compiled_autograd = True)
              ctx: under torch._dynamo.compiled_autograd._enable(backend) around backward
  R8_AMP      1: forward under torch.autocast("cpu", dtype=torch.bfloat16)
  R8_CKPT     wrapper | reentrant | nonreentrant  activation checkpointing of each block
  R8_DET      1: torch.use_deterministic_algorithms(True)
  R8_DROP     dropout probability (0);  R8_FALLBACK=1: inductor config fallback_random
  R8_OPT      sgd | adam (adam);  R8_LR (0.01);  R8_LR1 lr of ensemble member 1 (R8_LR)
  R8_BWD      autograd: torch.autograd.backward(loss) (else loss.backward())
  R8_TAO      1: torch._dynamo.config.trace_autograd_ops = True (backward traced in the graph)
  R8_DDP      1: DistributedDataParallel (torchrun, gloo), the same batch on every rank
  R8_REGBUF   1: the model registers a buffer in its forward
  R8_STEPS    (3);  R8_HOOK=1: a gradient hook (p.register_hook) doubling each gradient

    python tests/trainers/round8b.py
"""

import os

import torch
import torch.nn as nn

E = os.environ.get
CASE = E("R8_CASE", "mlp")
COMPILE = E("R8_COMPILE", "none")
BACKEND = E("R8_BACKEND", "count")
STEPS = int(E("R8_STEPS", "3"))
LR = float(E("R8_LR", "0.01"))
GRAPHS = []  # (number of FX nodes, code) of each graph the counting backend compiled


def count_backend(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    GRAPHS.append(("dynamo", len(gm.graph.nodes), gm.code))

    def fw(g, _):
        GRAPHS.append(("aot", len(g.graph.nodes), g.code))
        return make_boxed_func(g.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=fw)(gm, example_inputs)


def ca_backend(gm, *example_inputs):
    GRAPHS.append(("compiled_autograd", len(gm.graph.nodes), gm.code))
    return gm


def backend():
    return count_backend if BACKEND == "count" else BACKEND


def compile_kw():
    kw = {"backend": backend()}
    if E("R8_MODE"):
        kw = {"mode": E("R8_MODE")}  # a mode needs inductor
    if E("R8_DYN") == "1":
        kw["dynamic"] = True
    return kw


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(float(E("R8_DROP", "0")))

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x))) + x


class Net(nn.Module):
    def __init__(self, d=8, n=2):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        if E("R8_REGBUF") == "1":  # a buffer registered in forward (traced when compiled)
            self.register_buffer("last", h.detach().sum(0))
        return self.out(h)


def clean(name: str) -> str:
    for junk in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def sd(model) -> dict:
    return {clean(k): v.detach().clone() for k, v in model.state_dict().items()}


def make_opt(params, lr=LR):
    if E("R8_OPT", "adam") == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def batch(i):
    n = [8, 6, 5, 7, 9, 4][i % 6] if E("R8_VARY") == "1" else 8
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def counters() -> dict:
    from torch._dynamo.utils import counters as c

    return {k: dict(v) for k, v in c.items() if v}


def mlp(truth):
    torch.manual_seed(0)
    model = Net()
    if E("R8_CKPT"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        import functools

        impl = {"wrapper": CheckpointImpl.NO_REENTRANT, "nonreentrant": CheckpointImpl.NO_REENTRANT,
                "reentrant": CheckpointImpl.REENTRANT}[E("R8_CKPT")]
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, Block))
    if E("R8_FALLBACK") == "1":
        import torch._inductor.config as ic

        ic.fallback_random = True
    if E("R8_DET") == "1":
        torch.use_deterministic_algorithms(True)
    if E("R8_CA") == "1":
        torch._dynamo.config.compiled_autograd = True
    if E("R8_TAO") == "1":  # dynamo traces backward() into the graph
        torch._dynamo.config.trace_autograd_ops = True
    net = model
    if E("R8_DDP") == "1":  # torchrun, gloo: DDP around the model, then compiled (or not)
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if E("R8_CA") == "1":  # compiled autograd needs DDP's Python reducer
            torch._dynamo.config.optimize_ddp = "python_reducer"
        model = net = nn.parallel.DistributedDataParallel(model)
    if COMPILE == "wrap":
        net = torch.compile(model, **compile_kw())
    elif COMPILE == "inplace":
        model.compile(**compile_kw())
    elif COMPILE == "regional":
        for b in model.blocks:
            b.compile(**compile_kw())
    elif COMPILE == "regwrap":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b, **compile_kw())
    if COMPILE in ("wrap", "regwrap"):
        opt_model = net if COMPILE == "wrap" else model
    else:
        opt_model = model
    opt = make_opt(opt_model.parameters())
    if E("R8_HOOK") == "1":
        for p in opt_model.parameters():
            p.register_hook(lambda g: g * 2)

    def fwd_bwd(x, y):
        if E("R8_AMP") == "1":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(x)
        else:
            out = net(x)
        loss = (out.float() - y).pow(2).mean()
        if E("R8_CA") == "ctx":
            from torch._dynamo import compiled_autograd

            with compiled_autograd._enable(ca_backend):
                loss.backward()
        elif E("R8_BWD") == "autograd":
            torch.autograd.backward(loss)
        else:
            loss.backward()
        return loss

    step_fn = fwd_bwd
    if COMPILE == "step":
        step_fn = torch.compile(fwd_bwd, **compile_kw())
    for i in range(STEPS):
        x, y = batch(i)
        if E("R8_MARK") == "1":
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        opt.zero_grad()
        loss = step_fn(x, y)
        truth["grads"].append({clean(n): p.grad.clone() for n, p in opt_model.named_parameters()
                               if p.grad is not None})
        opt.step()
        truth["losses"].append(loss.detach().clone())
        truth["steps"].append(sd(model))
    truth["model"] = sd(model)
    truth["opts"] = [opt.state_dict()]
    return [opt]


def ensemble(truth):
    """Three members' parameters stacked (torch.func.stack_module_state), trained through
    vmap(functional_call) by one optimizer over the stacked tensors; member 1 may have its
    own lr (a param group of its own would need unstacking: the gradient is scaled instead)."""
    from torch.func import functional_call, stack_module_state, vmap

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(3)]
    params, buffers = stack_module_state(members)
    base = members[0].to("meta")
    lr1 = float(E("R8_LR1", str(LR)))

    def call(p, b, x):
        return functional_call(base, (p, b), (x,))

    opt = torch.optim.SGD(list(params.values()), lr=LR)
    for i in range(STEPS):
        x, y = batch(i)
        opt.zero_grad()
        out = vmap(call, in_dims=(0, 0, None))(params, buffers, x)
        loss = (out - y).pow(2).mean()
        loss.backward()
        if lr1 != LR:
            with torch.no_grad():
                for p in params.values():
                    p.grad[1].mul_(lr1 / LR)
        truth["grads"].append({k: v.grad.clone() for k, v in params.items()})
        opt.step()
        truth["losses"].append(loss.detach().clone())
        truth["steps"].append({k: v.detach().clone() for k, v in params.items()})
    truth["model"] = {k: v.detach().clone() for k, v in params.items()}
    truth["opts"] = [opt.state_dict()]
    truth["keep"] = (params, members)
    return [opt]


def export(truth):
    """The model exported (torch.export.export; R8_STRICT=1: strict, dynamo's trace) and its
    .module() trained, or the eager model (R8_EXPORT=0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net = model
    if E("R8_EXPORT", "1") == "1":
        ep = torch.export.export(model, (torch.randn(8, 4),), strict=E("R8_STRICT") == "1")
        GRAPHS.append(("export", len(ep.graph.nodes), str(ep.graph)))
        net = ep.module()
    opt = make_opt(net.parameters())
    for i in range(STEPS):
        x, y = batch(i)
        opt.zero_grad()
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        truth["grads"].append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
        truth["losses"].append(loss.detach().clone())
        truth["steps"].append(sd(net))
    truth["model"] = sd(net)
    truth["opts"] = [opt.state_dict()]
    truth["names"] = [n for n, _ in net.named_parameters()]
    return [opt]


def main():
    truth = {"steps": [], "grads": [], "losses": [], "extra": {}}
    opts = {"mlp": mlp, "ensemble": ensemble, "export": export}[CASE](truth)
    graphs = [(kind, n) for kind, n, _ in GRAPHS]
    rec = {"counters": counters(), "graphs": graphs}
    truth["extra"] = {**rec, "codes": [c for _, _, c in GRAPHS]}
    print("compile record:", rec, flush=True)
    if E("R8_DEBUG") == "1":  # the code objects dynamo was asked to convert
        from torch._dynamo.convert_frame import input_codes

        print("input codes:", sorted(f"{c().co_filename}:{c().co_name}"
                                     for c in input_codes.seen if c() is not None), flush=True)
    keep = truth.pop("keep", None)
    if E("R8_SAVE"):
        torch.save(truth, E("R8_SAVE") + (f".{E('RANK')}" if E("RANK", "0") != "0" else ""))
    return opts, keep


if __name__ == "__main__":
    main()
