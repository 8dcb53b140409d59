"""One steps.jsonl field per step, per rank: what the per-step comparisons of the diff read.

Why one reader: the generators' digests (``rng``, diff/rng.py), the optimizers' group numbers
(``opt``, diff/opt_numbers.py) and the loss scale (``loss_scale``, diff/scaled_loss.py) are each
a key of a step's line that runs of another round lack or that a step may not carry; each
comparison wants ``{step: value}`` of the steps that carry it with the right type, and nothing
else (the final-state line, a malformed value: not compared). The lines are as
artifacts.read_rank left them: ``opt`` is the full list on every step whatever the line held
(opt_changes.carry_forward), and steps are already renumbered where ``--align-steps`` asked.
"""

from __future__ import annotations

__all__ = ["step_field", "field_by_rank"]


def step_field(x, key: str, kind) -> dict[int, object]:
    """``{step: value}`` of the steps of RankData ``x`` (None: none) whose line's ``key`` is an
    instance of ``kind``, in step order."""
    if x is None:
        return {}
    return {s: rec[key] for s, rec in sorted((s, r) for s, r in x.steps.items()
                                             if isinstance(s, int))
            if isinstance(rec, dict) and isinstance(rec.get(key), kind)}


def field_by_rank(lst, key: str, kind) -> dict[int, dict[int, object]]:
    """``{rank: step_field(x, key, kind)}`` of a side's RankData."""
    return {x.rank: step_field(x, key, kind) for x in lst}
