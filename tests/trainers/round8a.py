"""Round 8a trainer: distributed shapes no earlier round tried (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round8a.py   (R8_CASE=pipe|fsdp1|
                                                                         offload|prefetch|hook)
    torchrun --standalone --nproc_per_node 4 tests/trainers/round8a.py   (R8_CASE=twod|ppdp|hsdp)

Ground truth: with R8_SAVE=PATH each rank saves ``PATH.<rank>`` (torch.save of a dict):
``steps``, one entry per iteration with the parameters this rank holds (full tensors where
the wrapper can gather them), their gradients (None kept) and the loss (None where this
rank computes none: a pipeline's first stage), ``final`` (the state dict at the end) and
``opt`` (the optimizer's state dict at the end, local). Compared with ``torch.equal``.

Knobs (environment):
  R8_CASE   pipe | ppdp | accum | hsdp | fsdp1 | fsdp2 | twod | offload | prefetch | hook
  R8_STEPS  iterations (default 3);  R8_LR  learning rate (default 0.05)
  R8_SCHED  pipe: gpipe | 1f1b | interleaved | looped | zb (InterleavedZeroBubble) | zbv |
            dualpipev (the last five: 2 stages per rank; zbv, dualpipev in a V);  R8_MB (4)
  R8_ORIG   fsdp1: 1 use_orig_params=True (default), 0 False
  R8_STRAT  fsdp1: full | grad_op | no_shard (default full)
  R8_HOOK   hook: none | fp16 | bf16 (refused on CPU) | bf16own (the same, own name) |
            allreduce | powersgd (DDP communication hook; default none)
  R8_PREF   prefetch, hsdp: 1 explicit forward/backward prefetching (default 0: none); twod:
            1 the first layer unsharded before each forward
  R8_MODE   offload: none (no offload policy);  accum: nosync (no sync but at the last
            micro-batch)
  R8_OPT    sgd | adam (default sgd with momentum 0.9)
  R8_NARROW=1  layer 1 outputs one feature (pipe with R8_MB=16: one element per micro-batch)
  R8_WRAP   accum: fsdp2 | ddp;  fsdp1/fsdp2: one (the root only: one flat parameter / one
            group; default: each Linear its own unit)
  R8_LOG=1  fsdp1/fsdp2: the loss all-reduced for logging after each step
  R8_GATHER=0  fsdp1: no summon_full_params per step (its ground truth: the losses and the
            final full parameters only)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

E = os.environ.get
CASE = E("R8_CASE", "pipe")
STEPS = int(E("R8_STEPS", "3"))
LR = float(E("R8_LR", "0.05"))
KEEP = []
TRUTH = {"steps": [], "final": None, "opt": None}


def _model(n=4, width=16):
    """n Linear layers 8 -> width -> ... -> 4; R8_NARROW=1: layer 1 outputs one feature (a
    pipeline's first stage then sends one element per sample)."""
    torch.manual_seed(1)
    narrow = E("R8_NARROW") == "1"
    widths = [8] + [width] * (n - 1) + [4]
    if narrow:
        widths[2] = 1
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _opt(params):
    if E("R8_OPT", "sgd") == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _data(k, n=16):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _clone(x):
    if isinstance(x, torch.Tensor):
        return _full(x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clone(v) for v in x]
    return x


def note(named, loss):
    """One iteration: (name, parameter) pairs, their gradients, the loss."""
    TRUTH["steps"].append({
        "params": {n: _full(p) for n, p in named},
        "grads": {n: None if p.grad is None else _full(p.grad) for n, p in named},
        "loss": None if loss is None else loss.detach().clone()})


def finish(state, opt):
    TRUTH["final"] = _clone(state)
    TRUTH["opt"] = _clone(opt.state_dict()["state"]) if opt is not None else None
    if E("R8_SAVE"):
        torch.save(TRUTH, f"{E('R8_SAVE')}.{dist.get_rank()}")
    KEEP.append(opt)


# ------------------------------------------------------------------ pipelining
def pipe():
    """A 4-layer MLP (6 with R8_SCHED=interleaved) split into stages: 2 ranks, one stage each
    (interleaved: 2 stages each, rank r holds stages r and r + 2). The loss exists only on the
    last stage; every rank steps its own optimizer over its stages' parameters."""
    import torch.distributed.pipelining as PP
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    sched = E("R8_SCHED", "gpipe")
    n_mb = int(E("R8_MB", "4"))
    multi = {"interleaved": PP.ScheduleInterleaved1F1B, "looped": PP.ScheduleLoopedBFS,
             "zb": PP.ScheduleInterleavedZeroBubble, "zbv": PP.ScheduleZBVZeroBubble,
             "dualpipev": PP.ScheduleDualPipeV}
    per_rank = 2 if sched in multi else 1
    n_stages = world * per_rank
    full = _model(n=n_stages * 2)
    ids = [rank + i * world for i in range(per_rank)]
    if sched in ("zbv", "dualpipev"):  # V: rank r holds stages r and 2 * world - 1 - r
        ids = [rank, 2 * world - 1 - rank]
    stages, mods = [], []
    for s in ids:
        mod = nn.Sequential(*[full[2 * s], nn.Tanh(), full[2 * s + 1]])
        mods.append((s, mod))
        stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu")))
    params = [p for _, m in mods for p in m.parameters()]
    opt = _opt(params)

    def loss_fn(out, y):
        return _mse(out, y)

    if sched in multi:
        schedule = multi[sched](stages, n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        cls = PP.Schedule1F1B if sched == "1f1b" else PP.ScheduleGPipe
        schedule = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    named = [(f"{s}.{n}", p) for s, m in mods for n, p in m.named_parameters()]
    for k in range(1, STEPS + 1):
        x, y = _data(k)
        opt.zero_grad()
        losses = []
        if rank == 0:
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        opt.step()
        loss = torch.stack(losses).sum() if losses else None
        note(named, loss)
    finish({n: p for n, p in named}, opt)
    dist.destroy_process_group()


def ppdp():
    """Pipelining x FSDP2 on a (2, 2) mesh ("pp", "dp"), 4 ranks: each pp rank builds only its
    own stage (2 Linear layers, fully_shard of each and of the stage over "dp"), R8_SCHED
    gpipe | 1f1b; the dp ranks take different batches."""
    import torch.distributed.pipelining as PP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    full = _model(n=4)
    stage_mod = nn.Sequential(full[2 * pp], nn.Tanh(), full[2 * pp + 1])
    del full
    for m in stage_mod:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["dp"])
    fully_shard(stage_mod, mesh=mesh["dp"])
    stage = PipelineStage(stage_mod, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    cls = PP.Schedule1F1B if E("R8_SCHED", "gpipe") == "1f1b" else PP.ScheduleGPipe
    schedule = cls(stage, n_microbatches=int(E("R8_MB", "4")), loss_fn=_mse)
    opt = _opt(stage_mod.parameters())
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + dp)
        opt.zero_grad()
        losses = []
        if pp == 0:
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        opt.step()
        note(list(stage_mod.named_parameters()),
             torch.stack(losses).sum() if losses else None)
    finish(dict(stage_mod.named_parameters()), opt)
    dist.destroy_process_group()


# ------------------------------------------------------------------ FSDP1 / FSDP2
def fsdp1():
    """FSDP1 (FullyShardedDataParallel) over 2 ranks, each Linear its own unit; R8_ORIG=0:
    flat parameters; R8_STRAT: sharding strategy. Ground truth: the full parameters (and with
    use_orig_params, full gradients) gathered by summon_full_params after each step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    orig = E("R8_ORIG", "1") == "1"
    strat = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP,
             "no_shard": ShardingStrategy.NO_SHARD}[E("R8_STRAT", "full")]
    inner = _model()
    wrap = None if E("R8_WRAP") == "one" else ModuleWrapPolicy({nn.Linear})
    model = FSDP(inner, auto_wrap_policy=wrap, use_orig_params=orig,
                 sharding_strategy=strat, device_id=torch.device("cpu"))
    opt = _opt(model.parameters())
    gather = E("R8_GATHER", "1") == "1"
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + rank)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        _log(loss)
        if not gather:
            note([], loss)
            continue
        with FSDP.summon_full_params(model, with_grads=orig):
            named = [(n.replace("_fsdp_wrapped_module.", ""), p)
                     for n, p in model.named_parameters()]
            note(named, loss)
    with FSDP.summon_full_params(model):
        state = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                 for n, p in model.named_parameters()}
    finish(state, None)
    KEEP.append((model, opt))
    dist.destroy_process_group()


def _log(loss):
    """R8_LOG=1: the loss averaged over ranks for logging (a detached all-reduce)."""
    if E("R8_LOG") == "1":
        t = loss.detach().clone()
        dist.all_reduce(t)


def _fsdp2_loop(model, opt, rank, leaf=lambda m: m):
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + rank)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        _log(loss)
        note(list(leaf(model).named_parameters()), loss)
    finish(dict(leaf(model).named_parameters()), opt)


def fsdp2():
    """FSDP2 (fully_shard) of the same model as fsdp1, each Linear then the root."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if E("R8_WRAP") != "one":
        for m in model:
            fully_shard(m)
    fully_shard(model)
    _fsdp2_loop(model, _opt(model.parameters()), dist.get_rank())
    dist.destroy_process_group()


def offload():
    """FSDP2 with CPUOffloadPolicy (R8_MODE=none: without it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    off = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    kw = {} if E("R8_MODE") == "none" else {"offload_policy": off}
    model = _model()
    for m in model:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    _fsdp2_loop(model, _opt(model.parameters()), dist.get_rank())
    dist.destroy_process_group()


def prefetch():
    """FSDP2, each Linear its own group; R8_PREF=1: set_modules_to_forward_prefetch /
    set_modules_to_backward_prefetch of the next (previous) layer, and unshard() of the
    first layer before each forward."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    layers = list(model)
    for m in layers:
        fully_shard(m, reshard_after_forward=True)
    fully_shard(model)
    pref = E("R8_PREF", "0") == "1"
    if pref:
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    opt = _opt(model.parameters())
    rank = dist.get_rank()
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + rank)
        opt.zero_grad()
        if pref:
            layers[0].unshard()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(list(model.named_parameters()), loss)
    finish(dict(model.named_parameters()), opt)
    dist.destroy_process_group()


def twod():
    """FSDP2 x tensor parallel on a (2, 2) mesh ("dp", "tp"), 4 ranks: Linear layers 0 and 4
    colwise, 2 and 6 rowwise over "tp" (Tanh between), then fully_shard of each Linear and
    the root over "dp". The batch differs per dp rank and is equal within a tp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel(),
                                                   "4": ColwiseParallel(),
                                                   "6": RowwiseParallel()})
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    opt = _opt(model.parameters())
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + dp)
        opt.zero_grad()
        if E("R8_PREF") == "1":  # the first layer all-gathered ahead of the forward
            model[0].unshard()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(list(model.named_parameters()), loss)
    finish(dict(model.named_parameters()), opt)
    dist.destroy_process_group()


def accum():
    """Gradient accumulation over 2 micro-batches per step, 2 ranks: FSDP2 (R8_WRAP=fsdp2,
    default) or DDP (R8_WRAP=ddp); R8_MODE=nosync: no gradient sync on the first micro-batch
    (``set_requires_gradient_sync(False)`` / ``no_sync()``), else a sync on each."""
    import contextlib

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = _model()
    ddp = E("R8_WRAP") == "ddp"
    if ddp:
        inner, model = model, DDP(model)
    else:
        for m in model:
            fully_shard(m)
        fully_shard(model)
        inner = model
    opt = _opt(model.parameters())
    nosync = E("R8_MODE") == "nosync"
    for k in range(1, STEPS + 1):
        opt.zero_grad()
        total = None
        for mb in range(2):
            x, y = _data(100 * k + 10 * mb + rank)
            last = mb == 1
            ctx = contextlib.nullcontext()
            if nosync and ddp and not last:
                ctx = model.no_sync()
            elif nosync and not ddp:
                model.set_requires_gradient_sync(last)
            with ctx:
                loss = _mse(model(x), y) / 2
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        note(list(inner.named_parameters()), total)
    finish(dict(inner.named_parameters()), opt)
    dist.destroy_process_group()


def hsdp():
    """HSDP: FSDP2 over a (2, 2) mesh ("rep", "shard"), 4 ranks, each Linear its own group;
    R8_PREF=1: explicit prefetching (each layer prefetches the next in forward, the previous
    in backward; the first layer unsharded before each forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    model = _model()
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = list(model)
    if E("R8_PREF") == "1":
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    opt = _opt(model.parameters())
    rank = dist.get_rank()
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + rank)
        opt.zero_grad()
        if E("R8_PREF") == "1":
            layers[0].unshard()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(list(model.named_parameters()), loss)
    finish(dict(model.named_parameters()), opt)
    dist.destroy_process_group()


# ------------------------------------------------------------------ DDP comm hooks
def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook, line for line, under a name torch does not refuse on CPU."""
    group = state if state is not None else dist.group.WORLD
    world = group.size()
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def back(fut):
        buf.copy_(fut.value()[0])
        return buf

    return fut.then(back)


def hook():
    """DDP over 2 ranks with R8_HOOK: none | fp16 (fp16_compress_hook) | bf16
    (bf16_compress_hook) | powersgd (PowerSGD, rank 1, start at iteration 2)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    inner = _model()
    model = DDP(inner)
    which = E("R8_HOOK", "none")
    if which == "fp16":
        model.register_comm_hook(None, D.fp16_compress_hook)
    elif which == "bf16":  # torch refuses it without CUDA/NCCL (by its name)
        model.register_comm_hook(None, D.bf16_compress_hook)
    elif which == "bf16own":
        model.register_comm_hook(None, _bf16_hook)
    elif which == "allreduce":  # divides before the all-reduce, DDP's own after
        model.register_comm_hook(None, D.allreduce_hook)
    elif which == "powersgd":
        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=2, min_compression_rate=0.5,
                                use_error_feedback=True, warm_start=True, random_seed=0)
        model.register_comm_hook(state, P.powerSGD_hook)
        KEEP.append(state)
    opt = _opt(model.parameters())
    for k in range(1, STEPS + 1):
        x, y = _data(10 * k + rank)
        opt.zero_grad()
        loss = _mse(model(x), y)
        loss.backward()
        opt.step()
        note(list(inner.named_parameters()), loss)
    finish(dict(inner.named_parameters()), opt)
    dist.destroy_process_group()


CASES = {f.__name__: f for f in (pipe, ppdp, accum, hsdp, fsdp1, fsdp2, offload, prefetch, twod,
                                  hook)}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    CASES[CASE]()
