"""The optimizers' per-parameter state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's
``momentum_buffer``) as rows of the final state.

Why: capture hashes parameters, gradients and the loss at every step, not optimizer state. A
difference in the state at step k shows in step k+1's parameters, but nothing shows one made
by the last step: a one-step Adam pair with other betas held (round 5), and so would a last
step whose momentum differs. When capture stops (after the trainer's last edit, with the final
state), each optimizer's state tensors join the table as rows of the final state only
(``"kind": "optimizer_state"``, ``since`` the step after the last one), named by the parameter
they belong to and their key (``layers.0.weight:exp_avg``), so that the diff compares them by
name like any other row. Not per step: that would read the state (twice the parameters' bytes
for Adam) at every step for a difference the next step's parameters show anyway.

A state entry that is a Python number (LBFGS's ``n_iter``, ``t``, ``prev_loss``; a custom
optimizer's float) is hashed as a 0-d tensor (float64, int64), and a list or tuple of tensors
and numbers (LBFGS's ``old_dirs`` history) as one row per element (``key.0``, ``key.1``...):
left out, two runs whose optimizers ended in other such state held (round 7).

Each parameter in an optimizer's groups also gets one ``<fqn>:param_group`` row: its group's
numbers (lr, betas, ...; :func:`_group_numbers`), whether or not it has state. Left out, a
schedule that differs only after the last step held (round 12b); given to parameters with state
only (version 3), the same schedule held for SGD without momentum, which keeps none (round 14).

What is left out, on purpose: any other entry (SGD's ``momentum_buffer`` before momentum is
used is None; strings, dicts), a tensor capture cannot hash (fake,
meta, a subclass: trees.unhashable), the state of a parameter that is not in the table (it was
not hashed either). A second optimizer alive at stop that holds state for a parameter an
earlier one already named gets its own rows, ``#2`` after the name (``2.weight:exp_avg#2``):
left out, two runs whose second optimizer of a shared parameter ended in other state held
(round 7). (A freed optimizer's rows that a live one or a later-freed one already named are
left out in table.py: that is an optimizer re-created for the same parameters.) Nothing here
runs inside a step or a trace: it is called once, at stop.
"""

from __future__ import annotations

import torch

from parity.capture import trees
from parity.records import KIND_OPTIMIZER_STATE

__all__ = ["KIND", "ROWS_VERSION", "SEPARATOR", "state_rows"]

# meta.json ``capture.optimizer_state_rows``: which entries become rows. 4: the group's numbers
# for every parameter of a group, with state or not (round 14); 3: also each
# parameter's group numbers (``<fqn>:param_group``, round 12b); 2: tensors, Python numbers,
# lists, a second optimizer's ``#2`` rows (round 7); absent: tensors only. Two runs
# of one job recorded with other versions hold other state rows for equal state: the diff
# leaves rows one side's version makes out (said), instead of failing on them.
ROWS_VERSION = 4

KIND = KIND_OPTIMIZER_STATE  # params.json ``kind`` of these rows
GROUP = "param_group"  # the row of a parameter's group numbers (after its state keys)
SEPARATOR = ":"  # between the parameter's name and the state key (no module attribute has one)


def state_rows(optimizers: list, row_of: dict[int, int], entries: list[dict],
               taken: set[str]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each state tensor of ``optimizers`` (in their order, each one's
    parameters in group order, keys sorted): ``row_of`` maps ``id(parameter)`` to its table
    row, ``entries`` are the table's entries (the parameter's name), ``taken`` the names already
    in the table (extended here)."""
    out: list[tuple[str, torch.Tensor]] = []
    mine: set[str] = set()  # the names given here: a second optimizer's get "#2"
    numbers: dict[int, torch.Tensor | None] = {}  # id(group) -> _group_numbers (one tensor)
    for opt in optimizers:
        state = getattr(opt, "state", None)
        groups = getattr(opt, "param_groups", None)
        if not isinstance(groups, list):
            continue
        for group in groups:
            for p in group.get("params", ()) if isinstance(group, dict) else ():
                row = row_of.get(id(p), -1)
                if row < 0:
                    continue
                per_param = state.get(p) if state else None
                if not isinstance(per_param, dict):
                    per_param = {}  # no state (SGD without momentum): the group's numbers only
                base = entries[row]["fqn"]
                rows = [(f"{base}{SEPARATOR}{k}", per_param[k])
                        for k in sorted(k for k in per_param if isinstance(k, str))]
                if id(group) not in numbers:
                    numbers[id(group)] = _group_numbers(group)
                if numbers[id(group)] is not None:
                    rows.append((f"{base}{SEPARATOR}{GROUP}", numbers[id(group)]))
                for key_name, value in rows:
                    for name, t in _entries(key_name, value):
                        n, first = 1, name
                        while name in mine:
                            n += 1
                            name = f"{first}#{n}"
                        if name not in taken:
                            taken.add(name)
                            mine.add(name)
                            out.append((name, t))
    return out


def _group_numbers(group: dict) -> torch.Tensor | None:
    """The numbers of a parameter group (lr, betas, eps, weight decay, momentum, a scheduler's
    ``initial_lr``), keys sorted, as one float64 tensor: the ``param_group`` row of each of its
    parameters. Left out, the lr a scheduler set after the last step (a
    checkpoint's StepLR ``last_epoch`` one off) HELD "final state with optimizer state" while
    the optimizers' state dicts differed (round 12b). Booleans and None are left out: foreach,
    fused, capturable and the like choose an implementation (their effect shows in the values,
    and for-loop against foreach holds bitwise on CPU); so are strings."""
    out: list[float] = []
    for key in sorted(k for k in group if isinstance(k, str) and k != "params"):
        v = group[key]
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex() \
                    and trees.unhashable(x) is None:
                x = x.item()
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                out.append(float(x))
    return torch.tensor(out, dtype=torch.float64) if out else None


def _entries(name: str, v) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of one state entry: a hashable tensor as it is, a Python number as a 0-d
    tensor, a list or tuple element by element (``name.i``); nothing for anything else."""
    if isinstance(v, torch.Tensor):
        return [(name, v)] if trees.unhashable(v) is None else []
    if isinstance(v, (bool, int, float)):
        try:
            return [(name, torch.tensor(v, dtype=torch.float64 if isinstance(v, float)
                                        else torch.int64))]
        except (OverflowError, RuntimeError):  # an int beyond int64: left out
            return []
    if isinstance(v, (list, tuple)):
        return [e for i, x in enumerate(v) if not isinstance(x, (list, tuple))
                for e in _entries(f"{name}.{i}", x)]
    return []
