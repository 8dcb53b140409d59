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

What is left out, on purpose: a state entry that is not a tensor (SGD's ``momentum_buffer``
before momentum is used is None; a LBFGS's Python scalars), a tensor capture cannot hash (fake,
meta, a subclass: trees.unhashable), the state of a parameter that is not in the table (it was
not hashed either), and a second optimizer's state for a parameter another optimizer already
named (the first one wins; two optimizers stepping one tensor is itself a difference the
parameters show). Nothing here runs inside a step or a trace: it is called once, at stop.
"""

from __future__ import annotations

import torch

from parity.capture import trees
from parity.records import KIND_OPTIMIZER_STATE

__all__ = ["KIND", "SEPARATOR", "state_rows"]

KIND = KIND_OPTIMIZER_STATE  # params.json ``kind`` of these rows
SEPARATOR = ":"  # between the parameter's name and the state key (no module attribute has one)


def state_rows(optimizers: list, row_of: dict[int, int], entries: list[dict],
               taken: set[str]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each state tensor of ``optimizers`` (in their order, each one's
    parameters in group order, keys sorted): ``row_of`` maps ``id(parameter)`` to its table
    row, ``entries`` are the table's entries (the parameter's name), ``taken`` the names already
    in the table (extended here)."""
    out: list[tuple[str, torch.Tensor]] = []
    for opt in optimizers:
        state = getattr(opt, "state", None)
        groups = getattr(opt, "param_groups", None)
        if not state or not isinstance(groups, list):
            continue
        for group in groups:
            for p in group.get("params", ()) if isinstance(group, dict) else ():
                row = row_of.get(id(p), -1)
                per_param = state.get(p) if row >= 0 else None
                if not isinstance(per_param, dict):
                    continue
                base = entries[row]["fqn"]
                for key in sorted(k for k in per_param if isinstance(k, str)):
                    t = per_param[key]
                    if not isinstance(t, torch.Tensor) or trees.unhashable(t) is not None:
                        continue
                    name = f"{base}{SEPARATOR}{key}"
                    if name not in taken:
                        taken.add(name)
                        out.append((name, t))
    return out
