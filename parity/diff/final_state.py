"""The state each run ended with (steps.jsonl's final line), compared rank by rank.

Why: capture hashes the model once more when the process ends, after the trainer's last edit
(artifacts.md, steps.jsonl ``"step": "final"``). An edit after the last ``step()`` (a clamp,
a last EMA update, weights reloaded) changes what the trainer saves without changing any step's
record; without this comparison two runs that end in different models could hold.

Cheap on the identical-run path: each rank's final roll-ups are compared as strings; the
per-parameter records are read only where they differ. A final state one side recorded and
the other did not, or final states after different steps, are not compared (said, incomplete);
two runs that both lack it (recorded before it existed, or killed) say nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.artifacts import RankData
from parity.diff.hashes import ParamAlignment, ParamIndex
from parity.text import ranges

__all__ = ["FinalComparison", "compare_final"]


@dataclass
class FinalComparison:
    compared: bool = False  # some rank's final state was compared on both sides
    after_step: int | None = None  # the step after which both sides' final states were taken
    differs: list[tuple[int, list[int]]] = field(default_factory=list)  # (gid, ranks)
    ranks: list[int] = field(default_factory=list)  # ranks whose final state differs
    incomplete: list[str] = field(default_factory=list)
    state_rows: int = 0  # optimizer-state rows (opt_state.py) both sides hold
    state_only_a: list[int] = field(default_factory=list)  # gids of state rows A alone holds
    state_only_b: list[int] = field(default_factory=list)

    @property
    def equal(self) -> bool | None:
        return None if not self.compared else not self.ranks

    def to_dict(self, index: ParamIndex) -> dict:
        return {"compared": self.compared, "after_step": self.after_step, "equal": self.equal,
                "ranks": list(self.ranks),
                "params": [index.names[g] for g, _ in self.differs][:50],
                "params_differing": len(self.differs),
                "optimizer_state": self.state_rows if self.compared else 0}


def compare_final(ranks: list[int], ra: list[RankData], rb: list[RankData],
                  aligns: list[ParamAlignment], index: ParamIndex,
                  one_state: set[str] = frozenset(), state_rows: int = 0) -> FinalComparison:
    """Compare the final states of ``ranks`` (parallel lists ``ra``, ``rb``, ``aligns``).
    ``one_state``: optimizer-state rows one side holds and the other does not, where both
    sides hashed their state (diff/opt_state.py): each is a difference on the ranks that hold
    it. ``state_rows``: how many state rows both sides hold (said as compared)."""
    out = FinalComparison(state_rows=state_rows)
    only: dict[str, set[int]] = {"A": set(), "B": set()}
    one_sided: dict[str, list[int]] = {"A": [], "B": []}
    other_step: list[tuple[int, int, int]] = []
    unreadable: list[int] = []
    per_gid: dict[int, list[int]] = {}
    afters = set()
    for r, x, y, al in zip(ranks, ra, rb, aligns):
        fa, fb = x.final, y.final
        if fa is None and fb is None:
            continue
        if fa is None or fb is None:
            one_sided["A" if fb is None else "B"].append(r)
            continue
        sa, sb = fa.get("after_step"), fb.get("after_step")
        if sa != sb:
            other_step.append((r, sa, sb))
            continue
        out.compared = True
        afters.add(sa)
        lone = ([("A", k) for k in al.only_a if k in one_state]
                + [("B", k) for k in al.only_b if k in one_state]) if one_state else []
        for side, k in lone:  # state one side's optimizer keeps and the other's does not
            g = index.ids_of([k])[0]
            only[side].add(g)
            per_gid.setdefault(g, []).append(r)
        if lone:
            out.ranks.append(r)
        if al.identity and fa.get("param_digest") == fb.get("param_digest"):
            continue
        ha, hb = x.hashes(sa, "final"), y.hashes(sb, "final")
        if ha is None or hb is None or ha.shape[0] != al.n_a or hb.shape[0] != al.n_b:
            unreadable.append(r)
            continue
        bad = (ha[al.ia] != hb[al.ib]).any(axis=1)
        if bad.any():
            if not lone:
                out.ranks.append(r)
            for g in al.gid[bad].tolist():
                per_gid.setdefault(g, []).append(r)
    out.after_step = max(afters) if afters else None
    out.differs = sorted(per_gid.items())
    out.state_only_a, out.state_only_b = sorted(only["A"]), sorted(only["B"])
    for side, rs in one_sided.items():
        if rs:
            out.incomplete.append(f"the final state (after the last step) was recorded by "
                                  f"{side} only on rank(s) {ranges(rs)}; not compared")
    if other_step:
        r, sa, sb = other_step[0]
        out.incomplete.append(f"final states taken after different steps on {len(other_step)} "
                              f"rank(s) (first: rank {r}, A after step {sa}, B after step {sb}); "
                              "not compared")
    if unreadable:
        out.incomplete.append(f"the final state of rank(s) {ranges(unreadable)} could not be "
                              "read; not compared")
    return out
