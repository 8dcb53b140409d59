"""What the diff says of the optimizers' group numbers per step (steps.jsonl ``opt``,
capture/opt_numbers.py).

Why: a learning-rate schedule that differs (a warmup of another length, a scheduler stepped
before ``optimizer.step()`` on one side, a LambdaLR a resumed run did not restore) first diverges
as "gradients equal, parameters differ", which an update rule computed otherwise reads as too;
and one that differs only in the middle of the run, or for a group without gradients, reached
no hash at all: the pair read ``match`` (docs/reliability.md, "Round 14c"). The first divergence
now says from which step the numbers differ and what they were ("lr 0.001 against 0.0005 (group
0)"), or that they were equal through it.

A difference in the numbers with every hash equal is a FAIL (engine.py): the runs were
configured otherwise at that step, which is a difference of the job, as the final state's
``param_group`` rows already fail it when it persists to the end; its hashes agree only because
nothing the numbers touched had a gradient yet. The numbers are the ones each step used (read in
the optimizer's post-hook). Runs recorded before round 14c have no ``opt``: nothing is said, or
that one side did not record it; a number held on an accelerator is not read (None): not
compared, said.
"""

from __future__ import annotations

import math

from parity.diff.step_fields import field_by_rank
from parity.text import ranges

__all__ = ["numbers_by_rank", "compare_numbers", "numbers_words"]


def numbers_by_rank(lst) -> dict[int, dict[int, list]]:
    """``{rank: {step: [group dicts]}}`` of a side's RankData (steps with ``opt``; the full
    list on each, whether the line held it or the changes to the last: opt_changes.py)."""
    return field_by_rank(lst, "opt", list)


def _same(x, y) -> bool:
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is not list and type(y) is not list and x == y


def _differences(x: list, y: list) -> tuple[list[dict], int]:
    """The (group, key, a, b) that differ between two steps' groups, and how many numbers were
    not read (None) on either side. A group or key on one side only differs (``None`` there)."""
    out, unread = [], 0
    if len(x) != len(y):
        out.append({"group": None, "key": "groups", "a": len(x), "b": len(y)})
    for i, (gx, gy) in enumerate(zip(x, y)):
        if not (isinstance(gx, dict) and isinstance(gy, dict)):
            continue
        for k in sorted(set(gx) | set(gy)):
            a, b = gx.get(k, "absent"), gy.get(k, "absent")
            if a is None or b is None:
                unread += 1
            elif not _same(a, b):
                out.append({"group": i, "key": k, "a": a, "b": b})
    return out, unread


def compare_numbers(a: dict[int, dict[int, list]], b: dict[int, dict[int, list]],
                    ranks: list[int]) -> dict | None:
    """Step by step over the compared ranks: ``{"recorded": "both" | "a" | "b", "steps": [...],
    "first_differs": step | None, "ranks": [...], "differences": [{group, key, a, b}] (on the
    first such rank), "equal_before": step | None, "unread": n}``. None: neither side recorded
    any."""
    has_a = any(a.get(r) for r in ranks)
    has_b = any(b.get(r) for r in ranks)
    if not (has_a or has_b):
        return None
    out = {"recorded": "both", "steps": [], "first_differs": None, "ranks": [],
           "differences": [], "equal_before": None, "unread": 0}
    if not (has_a and has_b):
        return {**out, "recorded": "a" if has_a else "b"}
    steps = sorted(set.intersection(*(set(a.get(r, {})) & set(b.get(r, {})) for r in ranks)))
    out["steps"] = steps
    for s in steps:
        bad = []
        for r in ranks:
            diffs, unread = _differences(a[r][s], b[r][s])
            out["unread"] = max(out["unread"], unread)
            if diffs:
                if not bad:
                    out["differences"] = diffs
                bad.append(r)
        if bad:
            out["first_differs"], out["ranks"] = s, bad
            break
        out["equal_before"] = s
    return out


def _shown(v) -> str:
    if isinstance(v, list):
        return "(" + ", ".join(_shown(x) for x in v) + ")"
    return "absent" if v == "absent" else repr(v)


def difference_text(cmp: dict, limit: int = 3) -> str:
    """``lr 0.001 against 0.0005 (group 0)``, the first ``limit`` differences."""
    parts = []
    for d in cmp["differences"][:limit]:
        if d["key"] == "groups":
            parts.append(f"{d['a']} param group(s) against {d['b']}")
        else:
            parts.append(f"{d['key']} {_shown(d['a'])} against {_shown(d['b'])} "
                         f"(group {d['group']})")
    more = len(cmp["differences"]) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def numbers_words(cmp: dict | None, step: int) -> tuple[str, str]:
    """(what the verdict line's label gets, what the first divergence's explanation gets) for a
    first divergence at ``step``; empty strings when nothing is to be said."""
    if cmp is None:
        return "", ""
    if cmp["recorded"] != "both":
        return "", (f"; the optimizers' group numbers per step were recorded by "
                    f"{cmp['recorded'].upper()} only (the other side's parity predates them): "
                    "not compared")
    if not cmp["steps"]:
        return "", ""
    unread = (f" ({cmp['unread']} number(s) held on an accelerator were not read, not compared)"
              if cmp["unread"] else "")
    s = cmp["first_differs"]
    if s is None or s > step:
        through = step if s is not None else cmp["steps"][-1]
        later = (f"; they differ from step {s}, after this divergence: "
                 f"{difference_text(cmp)}" if s is not None else "")
        return "", (f"; the optimizers' group numbers (lr, momentum, betas, eps, weight decay) "
                    f"are equal through step {through} on every rank compared{unread}: not "
                    f"another learning rate or schedule{later}")
    first_key = next((f"{d['key']} differs" for d in cmp["differences"]
                      if d["key"] != "groups"), "param group count differs")
    since = (f", equal through step {cmp['equal_before']}" if cmp["equal_before"] is not None
             else "")
    return (f"optimizer {first_key} from step {s}",
            f"; the optimizers' group numbers differ from step {s} on rank(s) "
            f"{ranges(cmp['ranks'])}{since}: {difference_text(cmp)}{unread}: a learning rate "
            "or schedule of another job (a warmup of another length, a scheduler stepped at "
            "another point, a scheduler state not restored, another hyperparameter)")
