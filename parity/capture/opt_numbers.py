"""The numbers of the optimizers' param groups at each recorded step (steps.jsonl ``opt``).

Why: capture hashes parameters, gradients, the loss and the generators' state at every step,
and the groups' numbers (lr, momentum, betas, eps, weight decay, a scheduler's ``initial_lr``)
only in the final state (``<fqn>:param_group`` rows, opt_state.py). Two runs whose learning-rate
schedules differ (a warmup of another length, a scheduler stepped before ``optimizer.step()``
on one side, a resumed run whose LambdaLR was not restored) first diverge as "gradients equal,
parameters differ", which a hyperparameter and a numerical difference of the update both read
as; a schedule that differs only in the middle of the run, or for a group whose parameters got
no gradient, reached no hash at all (docs/reliability.md, "Round 14c"). The diff compares these
numbers step by step (parity/diff/opt_numbers.py).

What is read: for each optimizer that stepped in the step, in the order they stepped (not one
stepped inside another's ``step()``, as ZeroRedundancyOptimizer steps its local one: the outer
one's groups are the job's), each param
group's entries other than ``params`` whose values are numbers: a Python int or float, a list or
tuple of them (betas), a 1-element real tensor on the CPU (an lr given as a tensor: ``item()``,
no device involved). Read in the optimizer's post-hook, so they are the numbers the step used
(a scheduler stepped after ``step()`` changes them after this read). A tensor on an accelerator
is not read (``item()`` would wait for the device): it is written as None and the diff says it
was not compared. Booleans, None and strings (foreach, fused, capturable, differentiable) are
left out, as in the final state's rows. No tensor kernel is launched; any failure: nothing
recorded for that optimizer.

The rank's writer (artifacts.RankWriter) writes a line's groups as the changes since its last
line (parity/opt_changes.py, round 15a): a trainer with a group per parameter wrote every group
on every line.
"""

from __future__ import annotations

import torch

__all__ = ["group_entries", "group_numbers"]


def _number(x):
    """A Python float (or int) of ``x``; None for a device tensor; ``...`` for a non-number."""
    if isinstance(x, bool) or x is None:
        return ...
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex() or x.is_sparse or x.device.type not in ("cpu",):
            return None if x.numel() == 1 and x.device.type not in ("cpu", "meta") else ...
        try:
            return x.item()  # a CPU tensor: no kernel, no sync
        except Exception:  # noqa: BLE001 - fake, functional wrappers: not a number here
            return ...
    return ...


def group_numbers(opt) -> list[dict] | None:
    """``[{key: number | [numbers] | None}]``, one dict per param group of ``opt`` (keys
    sorted), or None where its groups cannot be read."""
    both = group_entries(opt)
    return None if both is None else both[0]


# sorted keys per group key tuple: groups built by one code path share it, and sorting each
# group's dozen keys at every step was most of the read (1,500 groups: 4.3 -> 1.9 ms a step)
_SORTED: dict[tuple, list] = {}
_FLAG_TYPES = (bool, str, type(None))


def group_entries(opt) -> tuple[list[dict], list[dict]] | None:
    """``(numbers, flags)``, one dict each per param group of ``opt`` (keys sorted), read in
    one pass: the numbers as :func:`group_numbers` says, the flags (booleans, None, strings:
    ``foreach``, ``fused``, ``maximize``...) for capture/opt_impl.py. None where the groups
    cannot be read."""
    try:
        numbers, flags = [], []
        for g in opt.param_groups:
            keys = tuple(g)
            order = _SORTED.get(keys)
            if order is None:
                order = _SORTED[keys] = sorted(k for k in keys if isinstance(k, str)
                                               and k != "params")
                if len(_SORTED) > 256:  # groups of many shapes: keep the cache bounded
                    _SORTED.clear()
            d, f = {}, {}
            for k in order:
                v = g[k]
                t = type(v)
                if t is float or (t is int):
                    d[k] = v
                elif isinstance(v, _FLAG_TYPES):
                    f[k] = v
                elif isinstance(v, (list, tuple)):
                    xs = [_number(x) for x in v]
                    if xs and all(x is not ... for x in xs):
                        d[k] = xs
                else:
                    x = _number(v)
                    if x is not ...:
                        d[k] = x
            numbers.append(d)
            flags.append(f)
        return numbers, flags
    except Exception:  # noqa: BLE001
        return None
