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
from parity.diff.hashes import ParamAlignment, ParamIndex, param_keys
from parity.diff.opt_state import state_keys
from parity.text import ranges

__all__ = ["FinalComparison", "compare_final"]


@dataclass
class FinalComparison:
    compared: bool = False  # some rank's final state was compared on both sides
    after_step: int | None = None  # the step after which both sides' final states were taken
    differs: list[tuple[int, list[int]]] = field(default_factory=list)  # (gid, ranks)
    ranks: list[int] = field(default_factory=list)  # ranks whose final state differs
    incomplete: list[str] = field(default_factory=list)
    state_rows: int = 0  # optimizer-state rows (opt_state.py) compared, on their ranks or across
    state_only_a: list[int] = field(default_factory=list)  # gids of state rows A alone holds
    state_only_b: list[int] = field(default_factory=list)
    state_versions: list[int] = field(default_factory=list)  # gids left out: other row versions

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
                  aligns: list[ParamAlignment], index: ParamIndex, state_both: bool = False,
                  state_gids: set[int] = frozenset(), same_rows: bool = True
                  ) -> FinalComparison:
    """Compare the final states of ``ranks`` (parallel lists ``ra``, ``rb``, ``aligns``).
    Optimizer-state rows a rank holds on one side only (diff/opt_state.py) are compared across
    ranks (:func:`_lone_state`); ``state_both``: both sides hashed their optimizers' state, so
    a state row the other side holds on no rank is a difference (else not compared, and said
    on the verdict line). ``state_gids``: state rows aligned on their ranks (compared).
    ``same_rows``: both sides' captures make the same entries rows (``optimizer_state_rows``);
    else a state row one side holds on no rank is left out (``state_versions``), not failed."""
    out = FinalComparison()
    compared_states = set(state_gids)
    one_sided: dict[str, list[int]] = {"A": [], "B": []}
    other_step: list[tuple[int, int, int]] = []
    unreadable: list[int] = []
    per_gid: dict[int, list[int]] = {}
    afters = set()
    lone: dict[str, None] = {}  # state rows some rank holds on one side only, table order
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
        if not al.identity and (al.only_a or al.only_b):
            lone.update(dict.fromkeys(state_keys(x, al.only_a) + state_keys(y, al.only_b)))
        if al.identity and fa.get("param_digest") == fb.get("param_digest"):
            continue
        ha, hb = x.hashes(sa, "final"), y.hashes(sb, "final")
        if ha is None or hb is None or ha.shape[0] != al.n_a or hb.shape[0] != al.n_b:
            unreadable.append(r)
            continue
        bad = (ha[al.ia] != hb[al.ib]).any(axis=1)
        if bad.any():
            out.ranks.append(r)
            for g in al.gid[bad].tolist():
                per_gid.setdefault(g, []).append(r)
    if lone:
        _lone_state(lone, ranks, ra, rb, index, state_both, out, per_gid, unreadable,
                    compared_states, same_rows)
        out.ranks = sorted(set(out.ranks))
    out.state_rows = len(compared_states)
    out.after_step = max(afters) if afters else None
    out.differs = sorted((g, sorted(set(rs))) for g, rs in per_gid.items())
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


def _lone_state(names: dict[str, None], ranks, ra, rb, index: ParamIndex, state_both: bool,
                out: FinalComparison, per_gid: dict[int, list[int]], unreadable: list[int],
                compared: set[int], same_rows: bool = True) -> None:
    """Optimizer-state rows a rank holds on one side only, compared across ranks: each such
    name is equal when every rank of both sides that holds it in its final state holds one
    value (a plain optimizer's replicated state against ``ZeroRedundancyOptimizer``'s one
    owner), a difference on those ranks when the values differ, and, when the other side
    holds it on no rank, a difference (``state_both``) or not compared (the other side did
    not hash its state)."""
    values: dict[str, dict[str, list[tuple[int, bytes]]]] = {k: {"A": [], "B": []} for k in names}
    for r, x, y in zip(ranks, ra, rb):
        fa, fb = x.final, y.final
        if fa is None or fb is None or fa.get("after_step") != fb.get("after_step"):
            continue
        for side, rd, f in (("A", x, fa), ("B", y, fb)):
            keys = param_keys(rd.params)
            held = [(i, k) for i, k in enumerate(keys) if k in names]
            if not held:
                continue
            h = rd.hashes(f.get("after_step"), "final")
            if h is None or h.shape[0] != len(keys):
                if r not in unreadable:
                    unreadable.append(r)
                continue
            for i, k in held:
                values[k][side].append((r, h[i].tobytes()))
    for k in names:
        va, vb = values[k]["A"], values[k]["B"]
        g = index.ids_of([k])[0]
        if va and vb:
            compared.add(g)  # compared across ranks
            if len({v for _, v in va + vb}) == 1:
                continue
            rs = [r for r, _ in va + vb]
        elif not state_both:
            continue  # the other side hashed no state: said on the verdict line
        elif not same_rows:  # a parity that makes other entries rows (a number, "#2"): said
            out.state_versions.append(g)
            continue
        else:  # state one side's optimizers keep and the other's do not: compared, differs
            compared.add(g)
            (out.state_only_a if va else out.state_only_b).append(g)
            rs = [r for r, _ in va or vb]
        per_gid.setdefault(g, []).extend(rs)
        out.ranks.extend(rs)
