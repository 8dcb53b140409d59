"""What the diff says of a scaled loss (GradScaler): the scales apart, and the steps skipped.

Capture records a loss that a GradScaler scaled as the trainer means it, unscaled, with the
scale apart (steps.jsonl ``loss_scale``), and a step whose optimizer step the scaler skipped
for inf/NaN gradients as a step marked ``skipped`` (capture/loss.py). The losses are compared
unscaled (engine.py): two runs whose scales differ and whose models are bitwise identical hold.
This module words the rest: a scale that differs is said (a problem, not a failure), a skipped
step is named on every side that skipped it, and in the first divergence's explanation when a
side skipped that step.
"""

from __future__ import annotations

from parity.artifacts import RankData
from parity.diff.result import Problem
from parity.diff.step_fields import step_field
from parity.text import ranges

__all__ = ["scaled_loss_notes", "skipped_note"]


def _skipped(lst: list[RankData]) -> dict[int, list[int]]:
    """{step: ranks} of the steps a scaler skipped on this side."""
    out: dict[int, list[int]] = {}
    for x in lst:
        for s, rec in x.steps.items():
            if "skipped" in rec:
                out.setdefault(s, []).append(x.rank)
    return out


def _scales(x: RankData | None) -> dict[int, float]:
    return step_field(x, "loss_scale", (int, float))


def scaled_loss_notes(ra: list[RankData], rb: list[RankData], ranks: list[int],
                      steps: list[int]) -> list[Problem]:
    """Skipped steps per side, and the first step whose loss scale differs (lowest rank)."""
    out = []
    for side, lst in (("a", ra), ("b", rb)):
        sk = _skipped(lst)
        if sk:
            rks = sorted({r for rs in sk.values() for r in rs})
            out.append(Problem(side, f"the GradScaler skipped step(s) {ranges(sorted(sk))} on "
                                     f"rank(s) {ranges(rks)} (inf/NaN gradients: the optimizer "
                                     "step did not run)"))
    sa, sb = _scales(ra[0] if ra else None), _scales(rb[0] if rb else None)
    if sa != sb:
        if sa and sb:
            s = next((s for s in steps if sa.get(s) != sb.get(s)), None)
            out.append(Problem(None, f"loss scale differs (A {sa.get(s)!r}, B {sb.get(s)!r} at "
                                     f"step {s}, rank {ranks[0]}): the unscaled losses were "
                                     "compared"))
        else:
            side, scales = ("A", sa) if sa else ("B", sb)
            s0 = min(scales)
            out.append(Problem(None, f"only {side}'s loss was scaled (GradScaler, "
                                     f"{scales[s0]!r} at step {s0}): the unscaled losses were "
                                     "compared"))
    return out


def skipped_note(ra: list[RankData], rb: list[RankData], step: int) -> str:
    """'; B's GradScaler skipped step 3 (...)' when a side skipped ``step`` and the other did
    not, else ''."""
    a = [x.rank for x in ra if "skipped" in (x.steps.get(step) or {})]
    b = [x.rank for x in rb if "skipped" in (x.steps.get(step) or {})]
    if set(a) == set(b):
        return ""
    parts = [f"{side}'s GradScaler skipped step {step} on rank(s) {ranges(rs)}"
             for side, rs in (("A", a), ("B", b)) if rs]
    return ("; " + " and ".join(parts) + " (inf/NaN gradients: its optimizer step did not run, "
            "the other side's did)")
