"""Round 11a trainer: FSDP2's communication knobs against the wire (imports nothing from parity).

    torchrun --standalone --nproc_per_node 2 tests/trainers/round11a.py   (R11_* knobs below)

Round 9a's trainer (tests/trainers/round9a.py: the model, the data, the dispatch-mode wire
recorder and the saved ground truth ``R9_SAVE.<rank>``, read by tests/wire_truth.py) with the
``FSDPModule`` setters applied to every ``fully_shard`` module after wrapping. Its ``R9_*``
knobs still hold (R9_MESH=hsdp on 4 ranks, R9_MP, R9_UNUSED, R9_ACCUM, ...). The saved dict
also keeps each reduction's op as its Python entry point was given it (``redops``).

Knobs (environment):
  R11_RS     custom reduce-scatter (``set_custom_reduce_scatter``): none (default) | plain (calls
             ``dist.reduce_scatter_tensor`` with FSDP2's arguments: nothing changes) | perm
             (reverses each rank's row before the collective and back after it: the values are
             the same on gloo, which sums elementwise, but every parameter travels at another
             byte offset) | sum (ignores FSDP2's op: reduces with SUM and divides afterwards)
  R11_AG     custom all-gather (``set_custom_all_gather``): none | plain | perm (each rank's
             input reversed on the wire and the output rows reversed back)
  R11_SEPRS=1    ``set_separate_reduce_scatter_group()`` (its own process group, same ranks)
  R11_MAXBUF     ``set_reduce_scatter_max_input_buffers(n)``
  R11_UNUSEDRS=1 ``set_reduce_scatter_unused_params(True)`` (zeros reduce-scattered for a
                 parameter without gradient; with R9_UNUSED=1 ``extra`` has none at step 2)
  R11_HOOK   ``set_all_reduce_hook``: none | noop (keeps a copy of what it was given) | ar (1-D
             FSDP: the hook all-reduces the reduce-scatter output over the world and divides)
  R11_NOAR=1     HSDP: ``set_requires_all_reduce(False)`` on every micro-batch but the last
  R11_FORCESUM=1 ``set_force_sum_reduction_for_comms(True)``
  R11_DIV        ``set_gradient_divide_factor(f)`` (float)
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import round9a  # noqa: E402  (a sibling trainer; imports nothing from parity)

E = os.environ.get


def _op_name(op):
    """``ReduceOp.AVG`` / ``RedOpType.AVG`` -> ``"avg"`` (as parity names ops)."""
    text = str(getattr(op, "op", op) if not isinstance(op, dist.ReduceOp.RedOpType) else op)
    return text.rsplit(".", 1)[-1].lower()


def _record_ops():
    """Wrap the Python entry points of the reductions (FSDP2's default comm and the custom ones
    below call ``reduce_scatter_single`` / ``reduce_scatter_tensor``; HSDP ``all_reduce``) so
    the wire record keeps each call's op, in order: ``redops`` = [{step, fn, op, ranks}]. The
    dispatch mode sees the op only as an opaque ScriptObject."""
    import torch.distributed.distributed_c10d as c10d

    for mod in (dist, c10d):
        for name in ("reduce_scatter_single", "all_reduce"):
            fn = getattr(mod, name)
            if getattr(fn, "_r11_wrapped", False):
                continue

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                op = kwargs.get("op", args[2] if _name == "reduce_scatter_single" and len(args) > 2
                                else args[1] if _name == "all_reduce" and len(args) > 1
                                else dist.ReduceOp.SUM)
                group = kwargs.get("group", args[3] if _name == "reduce_scatter_single"
                                   and len(args) > 3 else None)
                if round9a.Wire.active and not getattr(_record_ops, "inside", False):
                    round9a.TRUTH.setdefault("redops", []).append(
                        {"step": round9a.Wire.step, "fn": _name, "op": _op_name(op),
                         "ranks": dist.get_process_group_ranks(group) if group else None})
                _record_ops.inside, was = True, getattr(_record_ops, "inside", False)
                try:
                    return _fn(*args, **kwargs)
                finally:
                    _record_ops.inside = was

            wrapper._r11_wrapped = True
            setattr(mod, name, wrapper)


def _rev_rows(t, world):
    """Each rank's row of a ``[world * n]`` buffer reversed (an involution)."""
    return t.view(world, -1).flip(1).reshape(-1)


def _custom_rs(kind):
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class RS(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if kind == "perm":
                w = group.size()
                src = _rev_rows(input_tensor, w).contiguous()
                out = torch.empty_like(output_tensor)
                dist.reduce_scatter_tensor(out, src, op=op, group=group)
                output_tensor.copy_(out.flip(0))
                return None
            if kind == "sum":
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM,
                                           group=group)
                output_tensor.div_(group.size())
                return None
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)

    return RS()


def _custom_ag(kind):
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class AG(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if kind == "perm":
                w = group.size()
                src = input_tensor.flip(0).contiguous()
                out = torch.empty_like(output_tensor)
                dist.all_gather_into_tensor(out, src, group=group)
                output_tensor.copy_(_rev_rows(out, w))
                return None
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)

    return AG()


HOOK_SEEN = []


def _hook(kind):
    def hook(reduce_output):
        HOOK_SEEN.append(reduce_output.detach().clone())
        if kind == "ar":
            dist.all_reduce(reduce_output)
            reduce_output.div_(dist.get_world_size())

    return hook


_orig_fsdp = round9a._fsdp


def _fsdp(model):
    from torch.distributed.fsdp import FSDPModule

    wrapped, dp_rank = _orig_fsdp(model)
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        if E("R11_RS", "none") != "none":
            m.set_custom_reduce_scatter(_custom_rs(E("R11_RS")))
        if E("R11_AG", "none") != "none":
            m.set_custom_all_gather(_custom_ag(E("R11_AG")))
        if E("R11_HOOK", "none") != "none":
            m.set_all_reduce_hook(_hook(E("R11_HOOK")))
        if E("R11_FORCESUM") == "1":
            m.set_force_sum_reduction_for_comms(True)
        if E("R11_DIV"):
            m.set_gradient_divide_factor(float(E("R11_DIV")))
    if E("R11_SEPRS") == "1":
        wrapped.set_separate_reduce_scatter_group()
    if E("R11_MAXBUF"):
        wrapped.set_reduce_scatter_max_input_buffers(int(E("R11_MAXBUF")))
    if E("R11_UNUSEDRS") == "1":
        wrapped.set_reduce_scatter_unused_params(True)
    if E("R11_NOAR") == "1":  # round9a's loop toggles gradient sync per micro-batch: follow it
        orig = wrapped.set_requires_gradient_sync

        def sync(flag, *, recurse=True):
            orig(True, recurse=recurse)  # every micro-batch reduce-scatters ...
            wrapped.set_requires_all_reduce(flag, recurse=recurse)  # ... the last all-reduces

        wrapped.set_requires_gradient_sync = sync
    return wrapped, dp_rank


round9a._fsdp = _fsdp

if __name__ == "__main__":
    if E("R9_WIRE", "1") == "1":
        _record_ops()
    round9a.main()
