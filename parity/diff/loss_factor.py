"""A loss that differs from the other side's by one exact power of two at every step.

Why (docs/reliability.md, "Round 15b"): capture records the loss a step backpropagated (the sum
over its backward calls). With gradient accumulation over M micro-batches, a trainer that
divides each micro-batch's loss before ``backward()`` records the mean, one that backpropagates
the whole loss and divides the gradients after records M times it; with M a power of two the
two trainings are bitwise identical (dividing by 2^k is exact), yet the pair FAILED "loss
differs, gradients equal: the loss computation or its reduction", a wrong cause on identical
runs. As with a GradScaler's scale (scaled_loss.py), the losses are then compared as scaled:
B's = A's x 2^k bitwise (``math.ldexp``, exact) at every compared step on every compared rank,
one k for all, said on the verdict line (policy.py ``loss_factor_phrase``), never silently.
Any other relation (M = 3, a loss of 0, a step or rank without a loss on a side) is not a
factor: the losses differ.

With M not a power of two the division is not exact: the gradients differ too and the pair
FAILS (right), but the first divergence read "loss differs: the forward computation of step 1
(or its input) differs", the wrong cause. :func:`near_factor` finds one ratio B/A shared by
every compared step and rank within rounding (a whole number or its inverse), which the
explanation then names as a loss scaled otherwise.
"""

from __future__ import annotations

import math

__all__ = ["exact_factor", "near_factor", "near_factor_words"]


def _loss_pairs(steps) -> list[tuple[float, float]] | None:
    """Every compared rank's (A loss, B loss) at every compared step (LossStep rows with
    ``a_ranks`` / ``b_ranks``); None where a pair is not two finite non-zero floats or the
    rank counts differ."""
    pairs = []
    for s in steps:
        if s.equal is None:
            continue
        xs, ys = s.a_ranks or [], s.b_ranks or []
        if not xs or len(xs) != len(ys):
            return None
        for x, y in zip(xs, ys):
            if not (isinstance(x, float) and isinstance(y, float)) or x == 0 or y == 0 \
                    or not (math.isfinite(x) and math.isfinite(y)):
                return None
            pairs.append((x, y))
    return pairs


def exact_factor(steps) -> int | None:
    """k (non-zero) such that every compared rank's B loss is its A loss x 2^k at every step
    whose losses differ and at every other step (LossStep rows with ``a_ranks`` / ``b_ranks``);
    None when no such k exists or nothing differs."""
    k = None
    for x, y in _loss_pairs(steps) or ():
        e = math.frexp(y)[1] - math.frexp(x)[1]
        if math.ldexp(x, e) != y or (k is not None and e != k):
            return None
        k = e
    return k or None


REL = 1e-5  # float32 losses divided by M and summed: a few ulps from the exact ratio


def near_factor(steps) -> float | None:
    """The whole number r (or 1/r), r >= 2, with B's loss = A's x r within rounding at every
    step on every compared rank; None otherwise."""
    pairs = _loss_pairs(steps)
    ratios = [y / x for x, y in pairs or ()]
    if not ratios:
        return None
    r = ratios[0]
    if r <= 0:  # a negated loss (maximize on -loss) is no micro-batch scale
        return None
    n = round(r) if r >= 1 else round(1 / r)
    whole = n if r >= 1 else 1 / n
    if n < 2 or not all(abs(q / whole - 1) <= REL for q in ratios):
        return None
    return float(whole)


def near_factor_words(r: float) -> str:
    """The first divergence's explanation for :func:`near_factor`'s r."""
    side, f = ("B", round(r)) if r >= 1 else ("A", round(1 / r))
    return (f"; {side}'s loss is {f} x the other's within rounding at every step on every "
            f"rank: a loss scaled otherwise (divided by {f} per micro-batch before backward on "
            f"one side, the gradients divided after it on the other?); dividing by {f} is not "
            "exact, so the gradients differ too")
