"""What the diff says of the random generators' state (steps.jsonl ``rng``, capture/rng_state.py).

Why: a pair whose hashes differ from step 1 with identical bucket layouts reads like a
numerical difference in the forward; when dropout (or any random op) is in the model, the
usual cause is that the two runs drew other random numbers: another seed, a seed per rank on
one side, a draw one side made and the other did not, inductor's own seeds, a recomputation
without ``preserve_rng_state`` (docs/reliability.md, "Round 13b"). The first divergence then
says from which step the generators' states differ, or that they were equal (the same number
of draws from the same seed: look at the numerics instead).

The states are digests read after each recorded step's optimizer step: the state before step
1 is not recorded (a seed differs and a draw during step 1 differs read alike, "from step 1"),
and equal states say the runs drew as many numbers from the same state, not which op drew them
nor how a compiled kernel turned them into values. Runs recorded before round 13b have no
``rng``: nothing is said, or that one side did not record it.
"""

from __future__ import annotations

from parity.diff.step_fields import field_by_rank
from parity.text import ranges

__all__ = ["rng_by_rank", "compare_rng", "rng_words"]


def rng_by_rank(lst) -> dict[int, dict[int, dict]]:
    """``{rank: {step: {generator: digest}}}`` of a side's RankData (steps with ``rng``)."""
    return field_by_rank(lst, "rng", dict)


def compare_rng(a: dict[int, dict[int, dict]], b: dict[int, dict[int, dict]],
                ranks: list[int]) -> dict | None:
    """Step by step over the compared ranks: ``{"recorded": "both" | "a" | "b",
    "generators": [...], "steps": [...], "first_differs": step | None, "ranks": [...],
    "equal_before": step | None}`` (the generators both recorded; the steps both recorded
    on every rank compared; the first such step whose digests differ on some rank, and those
    ranks; the last step before it where they were equal). None: neither side recorded any."""
    has_a = any(a.get(r) for r in ranks)
    has_b = any(b.get(r) for r in ranks)
    if not (has_a or has_b):
        return None
    if not (has_a and has_b):
        return {"recorded": "a" if has_a else "b", "generators": [], "steps": [],
                "first_differs": None, "ranks": [], "equal_before": None}
    steps = sorted(set.intersection(*(set(a.get(r, {})) & set(b.get(r, {})) for r in ranks)))
    gens: set[str] = set()
    first, which, before = None, [], None
    for s in steps:
        bad = []
        for r in ranks:
            x, y = a[r][s], b[r][s]
            common = sorted(set(x) & set(y))
            gens.update(common)
            if any(x[g] != y[g] for g in common):
                bad.append(r)
        if bad:
            first, which = s, bad
            break
        before = s
    return {"recorded": "both", "generators": sorted(gens), "steps": steps,
            "first_differs": first, "ranks": which, "equal_before": before}


def rng_words(cmp: dict | None, step: int) -> tuple[str, str]:
    """(what the verdict line's label gets, what the first divergence's explanation gets) for
    a first divergence at ``step``; empty strings when nothing is to be said."""
    if cmp is None:
        return "", ""
    if cmp["recorded"] != "both":
        side = cmp["recorded"].upper()
        return "", (f"; the random generators' state was recorded by {side} only (the other "
                    "side's parity predates it): not compared")
    if not cmp["steps"]:
        return "", ""
    gens = "/".join(g.upper() for g in cmp["generators"]) or "no common generator"
    s = cmp["first_differs"]
    if s is None:
        return "", (f"; the random generators' states ({gens}) are equal after every step both "
                    f"recorded (steps {ranges(cmp['steps'])}) on every rank compared: the runs "
                    "drew as many random numbers from the same state each step: not another seed "
                    "nor a draw one side made and the other did not (the order of the draws "
                    "within a step, which op drew them, and how a compiled kernel turned them "
                    "into values are not recorded)")
    if s > step:
        return "", (f"; the random generators' states ({gens}) are equal through step "
                    f"{cmp['equal_before']} and differ from step {s}, after this divergence")
    since = (f", equal after step {cmp['equal_before']}" if cmp["equal_before"] is not None
             else " (the state before it is not recorded)")
    return (f"RNG state differs from step {s}",
            f"; the random generators' state ({gens}) differs after step {s}'s optimizer step "
            f"on rank(s) {ranges(cmp['ranks'])}{since}: the runs drew other random numbers by "
            "then (another seed, a seed per rank, a draw one side made and the other did not: "
            "a data sampler, a layer built after seeding, a torch.rand for logging, a compiled "
            "kernel's own seeds, a recomputation without preserve_rng_state), so dropout and "
            "every other random op differ, whatever the bucket layouts")
