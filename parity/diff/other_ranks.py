"""Ranks other than the reference one, where the two runs' collectives may differ although the
reference rank's agree (round 14a).

Why: the order comparison and the ``--at`` prediction read the reference rank (the lowest rank
compared). ``buckets._compare_odd_ranks`` adds the ranks whose all-gather / reduce-scatter
layouts differ from their side's reference, but two things stayed unseen at six ranks or more:

- the group a collective ran on. Each rank's group differs from the others' by design (rank 2's
  pair is ``[2, 3]``, rank 0's ``[0, 1]``), so only the reference rank's groups were compared:
  a token count all-reduced over ``{0,1},{2,3},{4,5}`` against ``{0,1},{2,4},{3,5}`` read
  "bucket layouts identical" and "same sums predicted";
- all-reduces (DDP's buckets, a hand-written all-reduce of the gradients) whose layout differs
  on some ranks only: they were compared on the reference rank alone.

Here every rank both sides recorded is summarised cheaply (``_Summary``: C-level tuples of the
fields compared; ranks with byte-identical manifests share one parsed list, so one summary) and
compared A against B relative to the reference rank: a kind of collective whose groups agree on
the reference rank and differ on rank r is a group difference on rank r; a rank whose
all-reduce lines relate A to B otherwise than the reference rank's is compared on its own. The
diff then compares those ranks (``reduction.assess``), and ``--at`` predicts them too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from parity.text import ranges

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MAX_RANKS = 4  # ranks compared and predicted beyond the reference rank (the rest are said)
_ENTRY_KEY = operator.itemgetter("fqn", "offset", "size", "numel", "dtype")
# an all-reduce line's fields compared, but for its group (``world_size``, ``ranks``)
_LINE_FIELDS = ("source", "collective", "graph", "graph_id", "index", "step", "dtype",
                "total_bytes", "group", "op", "op_scale", "funcol", "after", "coalesced")


@dataclass
class OtherRanks:
    """What the other ranks add. ``groups``: rank -> {kind: (A's groups, B's groups)} where a
    kind's groups agree on the reference rank and differ there; ``layouts``: ranks whose
    all-reduce lines relate A to B otherwise than the reference rank's; ``compare``: the ranks
    to compare and predict (at most MAX_RANKS); ``notes``: what was not examined."""

    groups: dict[int, dict[str, tuple]] = field(default_factory=dict)
    layouts: list[int] = field(default_factory=list)
    compare: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # found, beyond MAX_RANKS: not compared
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str | None:
        """'all_reduce on rank 2: group ranks [2, 3] in A, group ranks [2, 4] in B (the reference
        rank's groups agree; also rank(s) 3-5)'."""
        if not self.groups:
            return None
        r = min(self.groups)
        kind, (ga, gb) = next(iter(self.groups[r].items()))
        a = next((g for g in ga if g not in gb), ga[0] if ga else None)
        b = next((g for g in gb if g not in ga), gb[0] if gb else None)
        more = sorted(self.groups)[1:]
        tail = f"; also rank(s) {ranges(more)}" if more else ""
        return (f"{kind} on rank {r}: {_group_text(a)} in A, {_group_text(b)} in B "
                f"(the reference rank's groups agree{tail})")


def _group_text(g) -> str:
    if g is None:
        return "none"
    size, ranks = g
    if ranks:
        shown = ", ".join(map(str, ranks[:8]))
        return "group ranks [" + shown + (f", ... {len(ranks)} ranks" if len(ranks) > 8
                                          else "") + "]"
    return f"a group of {size} ranks" if size else "a group of unrecorded size"


def _summary(recs: list[dict], memo: dict) -> tuple:
    """(all-reduce lines as compared but for their group, {kind: the groups in order of first
    use}) of one rank's records; memoised by the list's identity (ranks and sides with
    byte-identical manifests share one list) and each entries list's."""
    got = memo.get(id(recs))
    if got is not None and got[0] is recs:
        return got[1]
    lines, groups = [], {k: {} for k in KINDS}
    entry_keys = memo.setdefault("entries", {})
    for r in recs:
        kind = r.get("collective") if isinstance(r, dict) else None
        if kind not in groups:
            continue
        ranks = r.get("ranks")
        groups[kind].setdefault((r.get("world_size"), tuple(ranks) if isinstance(ranks, list)
                                 else None), None)
        if kind == "all_reduce":
            entries = r.get("entries")
            ek = entry_keys.get(id(entries))
            if ek is None or ek[0] is not entries:
                try:
                    keys = tuple(map(_ENTRY_KEY, entries))
                except (KeyError, TypeError):
                    keys = None
                ek = entry_keys[id(entries)] = (entries, keys)
            lines.append((tuple(map(r.get, _LINE_FIELDS)), ek[1]))
    out = (tuple(lines), {k: tuple(v) for k, v in groups.items()})
    memo[id(recs)] = (recs, out)
    return out


def other_ranks(run_a, run_b, ranks: list[int], ref: int | None) -> OtherRanks:
    """The ranks of ``ranks`` (both sides recorded them) beyond ``ref`` that the diff must
    compare (see the module docstring)."""
    out = OtherRanks()
    if ref is None or ref not in run_a.ranks or ref not in run_b.ranks:
        return out
    memo: dict = {}
    lines_a, groups_a = _summary(run_a.ranks[ref].buckets, memo)
    lines_b, groups_b = _summary(run_b.ranks[ref].buckets, memo)
    agree = [k for k in KINDS if groups_a[k] == groups_b[k]]
    ref_pair = (lines_a, lines_b)
    seen_pairs: set = set()
    for r in ranks:
        if r == ref or r not in run_a.ranks or r not in run_b.ranks:
            continue
        ra, rb = run_a.ranks[r].buckets, run_b.ranks[r].buckets
        if ra is rb:
            continue  # byte-identical manifests on both sides (the reader shares them)
        key = (id(ra), id(rb))
        if key in seen_pairs:
            continue  # the same two lists as a rank already examined: the same findings
        la, ga = _summary(ra, memo)
        lb, gb = _summary(rb, memo)
        differs = {k: (ga[k], gb[k]) for k in agree if ga[k] != gb[k]}
        if differs:
            out.groups[r] = differs
        elif la != lb and (la, lb) != ref_pair:
            out.layouts.append(r)
        else:
            seen_pairs.add(key)  # nothing to find on these lists (a group is its rank's own)
    wanted = list(dict.fromkeys([*sorted(out.groups), *out.layouts]))
    out.compare = wanted[:MAX_RANKS]
    left = out.left = wanted[MAX_RANKS:]
    if left:
        out.notes.append(f"of rank(s) {ranges(left)}, which also differ from the reference "
                         "rank in their groups or all-reduce layouts (compared on rank(s) "
                         f"{ranges(out.compare)}); not compared")
    return out
