"""The loss of a training step as the trainer reports it: the sum over the step's backward calls.

Why: with gradient accumulation a step runs several forward/backward passes, each on its share
of the loss (``loss / n`` per micro-batch); the trainer logs their sum. Keeping only the last
backward's scalar recorded one micro-batch's share (2.36 where the trainer logged 4.68), and
the diff then reported a loss difference that was not there. Each outermost ``backward`` (and
each loss a traced GraphTrainer step returns) is noted; when the optimizer step begins the
noted scalars of that step are summed the way torchtitan does (``torch.stack(...).sum()``, in
the loss's dtype). One backward per step: that scalar, untouched.
"""

from __future__ import annotations

import torch

from parity.capture.hashing import local_tensor


def note(s, t: torch.Tensor) -> None:
    """Remember ``t`` (a scalar loss, detached) as part of the step after ``s.done``."""
    d = t.detach()
    if getattr(s, "_loss_parts_after", None) != s.done:
        s._loss_parts = []
        s._loss_parts_after = s.done
    s._loss_parts.append(d)
    s.loss_ref = d


def step_loss(s):
    """The loss of the step now beginning: the sum of its noted parts (None if none)."""
    parts = getattr(s, "_loss_parts", None) or []
    if getattr(s, "_loss_parts_after", None) != s.done or not parts:
        return s.loss_ref
    if len(parts) == 1:
        return parts[0]
    from torch.utils._python_dispatch import _disable_current_modes

    # the sum is capture's own computation: kept out of any dispatch mode (op capture) and
    # out of autograd
    with _disable_current_modes(), torch.no_grad():
        local = [local_tensor(p).reshape(()) for p in parts]
        if len({x.dtype for x in local}) != 1 or len({x.device for x in local}) != 1:
            return s.loss_ref
        local = _fold_totals(local)
        if len(local) == 1:
            return local[0]
        return torch.stack(local).sum()


def _fold_totals(parts: list) -> list:
    """A chunked loss (torchtitan's ChunkedLossWrapper) calls ``backward`` on each chunk's loss
    inside the loss computation and the trainer then calls ``backward`` on their total: the
    total is not another micro-batch. A part equal (to rounding) to the sum of the two or more
    parts since the last such total replaces them; micro-batches (gradient accumulation) stay
    separate parts."""
    out, pending = [], []
    for p in parts:
        if len(pending) >= 2:
            acc = float(torch.stack(pending).sum())
            if abs(float(p) - acc) <= 1e-5 * max(1.0, abs(acc)):
                out.append(p)
                pending = []
                continue
        pending.append(p)
    return out + pending
