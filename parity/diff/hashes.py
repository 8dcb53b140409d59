"""Hash comparison for ``parity diff``: per (step, rank, parameter, param|grad).

Cost model (docs/diff.md has the numbers):

1. Parameters are aligned per rank by normalized FQN (``ParamAlignment``); ranks whose tables list the
   same keys in the same order share one cached alignment, and for them the per-step roll-up
   digests of steps.jsonl are comparable as they are.
2. Roll-ups are compared for every (rank, step) as the strings steps.jsonl holds (pure Python:
   two identical runs, the common case, never import numpy); only cells whose roll-ups differ
   (or whose two sides store parameters in different orders) are "drilled": their per-parameter
   hash lines are read (by offset) and compared, vectorized over parameters (numpy).
3. The first divergent step is drilled completely (every rank, both kinds) for the detailed
   report. Later steps are drilled only for per-step counts, and only until every parameter is
   known to differ ("saturated": after a real divergence, usually on the first rank drilled);
   the other ranks' roll-ups then say which ranks differ. At most ``count_budget`` cells are
   drilled after the first divergent step; past it a count is unknown (``None``) unless
   saturated, and the step is marked ``exact: false``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from typing import TYPE_CHECKING

from parity.artifacts import RankData, rollup_digest

if TYPE_CHECKING:  # numpy is imported where something differs (see the module docstring)
    import numpy as np

# entry: the parameters as step k's optimizer step found them (artifacts.RankData.entry_hashes):
# recorded only where they changed after step k-1's record, so an absent entry digest on both
# sides is "equal" (step k-1's parameters, compared at k-1), and one present on one side only
# is a change that side made between step() calls
KINDS = ("param", "grad", "entry")
_DIGEST_FIELD = {"param": "param_digest", "grad": "grad_digest", "entry": "entry_digest"}
DEFAULT_COUNT_BUDGET = 20_000
_FQN = operator.itemgetter("fqn")  # drilled (rank, step, kind) cells after the first divergent step


def param_keys(params: list[dict]) -> list[str]:
    """ParamAlignment keys of a rank's table: the FQN, made unique by occurrence if a rank holds
    several entries with one name (``fqn#1``, ``fqn#2``...)."""
    keys = list(map(_FQN, params))
    if len(set(keys)) != len(keys):
        seen: dict[str, int] = {}
        out = []
        for k in keys:
            n = seen.get(k, 0)
            seen[k] = n + 1
            out.append(k if n == 0 else f"{k}#{n}")
        keys = out
    return keys


@dataclass
class ParamAlignment:
    """Rows of one rank's two tables that hold the same parameter.

    Kept as Python lists (``rows_a``, ``rows_b``, ``gids``; ``None`` rows for an identity
    alignment): the numpy views ``ia``, ``ib``, ``gid`` are built on first use, which only
    happens when some hash differs or the tables differ."""

    rows_a: list[int] | None  # row in A's table (None: 0..n_a-1)
    rows_b: list[int] | None  # row in B's table (None: 0..n_b-1)
    gids: list[int]  # global parameter id (ParamIndex) of each aligned row
    identity: bool  # both tables list the same keys in the same order: roll-ups comparable
    n_a: int
    n_b: int
    only_a: list[str]
    only_b: list[str]
    permutation: bool = False  # same keys in another order: B's roll-up in A's order computable

    def __post_init__(self):
        self.permutation = (not self.identity and len(self.gids) == self.n_a == self.n_b
                            and self.rows_a == list(range(self.n_a)))

    @cached_property
    def ia(self) -> np.ndarray:
        import numpy as np

        return np.arange(self.n_a, dtype=np.int64) if self.rows_a is None else \
            np.asarray(self.rows_a, dtype=np.int64)

    @cached_property
    def ib(self) -> np.ndarray:
        import numpy as np

        return np.arange(self.n_b, dtype=np.int64) if self.rows_b is None else \
            np.asarray(self.rows_b, dtype=np.int64)

    @cached_property
    def gid(self) -> np.ndarray:
        import numpy as np

        return np.asarray(self.gids, dtype=np.int64)


class ParamIndex:
    """Global parameter ids, in first-seen order (A's registration order, lowest rank first)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}

    def ids_of(self, keys: list[str]) -> list[int]:
        ids = self.ids
        out = []
        for k in keys:
            j = ids.get(k)
            if j is None:
                j = ids[k] = len(self.names)
                self.names.append(k)
            out.append(j)
        return out


class Aligner:
    """Per-rank alignments, cached by the pair of key sequences (usually one for all ranks)."""

    def __init__(self, index: ParamIndex):
        self.index = index
        self._cache: dict[tuple, ParamAlignment] = {}
        # by identity first: ranks share one keys tuple per distinct table (hashing a tuple of
        # 1,500 names per rank costs more than the lookup saves); the tuples are kept alive here
        self._by_id: dict[tuple[int, int], tuple] = {}

    def align(self, keys_a: tuple[str, ...], keys_b: tuple[str, ...]) -> ParamAlignment:
        ik = (id(keys_a), id(keys_b))
        got = self._by_id.get(ik)
        if got is not None and got[0] is keys_a and got[1] is keys_b:
            return got[2]
        al = self._align(keys_a, keys_b)
        self._by_id[ik] = (keys_a, keys_b, al)
        return al

    def _align(self, keys_a: tuple[str, ...], keys_b: tuple[str, ...]) -> ParamAlignment:
        ck = (keys_a, keys_b)
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        if keys_a == keys_b:
            al = ParamAlignment(None, None, self.index.ids_of(list(keys_a)), True, len(keys_a),
                           len(keys_b), [], [])
        else:
            pos_b = {k: j for j, k in enumerate(keys_b)}
            ia_l, ib_l = [], []
            for i, k in enumerate(keys_a):
                j = pos_b.get(k)
                if j is not None:
                    ia_l.append(i)
                    ib_l.append(j)
            set_a = set(keys_a)
            al = ParamAlignment(
                ia_l, ib_l,
                self.index.ids_of([keys_a[i] for i in ia_l]), False, len(keys_a), len(keys_b),
                [k for k in keys_a if k not in pos_b], [k for k in keys_b if k not in set_a],
            )
        self._cache[ck] = al
        return al


def digest_table(ranks: list[RankData], steps: list[int], kind: str) -> np.ndarray:
    """(len(ranks), len(steps)) array of roll-up digests (bytes); b"" where absent."""
    import numpy as np

    fld = _DIGEST_FIELD[kind]
    out = np.zeros((len(ranks), len(steps)), dtype="S32")
    for i, rd in enumerate(ranks):
        recs = rd.steps
        row = [recs.get(s) for s in steps]
        out[i] = [(r.get(fld) or "").encode() if r is not None and isinstance(r.get(fld), str)
                  else b"" for r in row]
    return out


def presence_table(ranks: list[RankData], steps: list[int]) -> np.ndarray:
    import numpy as np

    out = np.zeros((len(ranks), len(steps)), dtype=bool)
    for i, rd in enumerate(ranks):
        out[i] = [s in rd.steps for s in steps]
    return out


@dataclass
class StepDetail:
    """What differs at one step: per kind, global ids and the ranks they differ on."""

    step: int
    pairs: dict[str, list[tuple[np.ndarray, int]]] = field(default_factory=lambda: {k: [] for k in KINDS})

    def grouped(self, kind: str) -> list[tuple[int, list[int]]]:
        """[(gid, sorted ranks)] in gid order."""
        chunks = self.pairs[kind]
        if not chunks:
            return []
        import numpy as np

        gids = np.concatenate([g for g, _ in chunks])
        ranks = np.concatenate([np.full(len(g), r, dtype=np.int64) for g, r in chunks])
        order = np.lexsort((ranks, gids))
        gids, ranks = gids[order], ranks[order]
        cut = np.flatnonzero(np.diff(gids)) + 1
        return [(int(g[0]), r.tolist()) for g, r in zip(np.split(gids, cut), np.split(ranks, cut))]

    def any(self, kind: str) -> bool:
        return any(len(g) for g, _ in self.pairs[kind])


@dataclass
class StepCount:
    step: int
    params: int | None  # parameters (FQNs) whose param hash differs on at least one rank
    grads: int | None  # parameters whose gradient hash differs on at least one rank
    ranks: int | None  # ranks with any difference at this step
    exact: bool


@dataclass
class HashComparison:
    steps: list[int]
    compared_rows: list[list[bool]]  # [rank row][step column]: both sides present
    first_step: int | None
    detail: StepDetail | None
    counts: list[StepCount]
    cells_drilled: int
    unreadable: list[tuple[str, int, int, str]]  # (side, rank, step, kind)
    grads_compared: bool
    steps_compared: list[int] = field(default_factory=list)  # steps some rank has on both sides

    @property
    def compared(self) -> np.ndarray:
        """``compared_rows`` as an (R, S) bool array."""
        import numpy as np

        return np.array(self.compared_rows, dtype=bool).reshape(len(self.compared_rows),
                                                                len(self.steps))


def _load(rd: RankData, step: int, kind: str, n: int) -> np.ndarray | None:
    h = rd.entry_hashes(step) if kind == "entry" else rd.hashes(step, kind)
    if h is None or h.shape[0] != n:
        if h is not None:
            rd.problems.append(f"{rd.path / 'hashes.jsonl'}: step {step} {kind} line has "
                               f"{h.shape[0]} hashes, the table {n}")
        return None
    import numpy as np

    return h.view(np.uint64)  # (n, 2)


def _rollup_pass(ra: list[RankData], rb: list[RankData], aligns: list[ParamAlignment],
                 steps: list[int]):
    """Every (rank, step) cell's roll-ups, compared as the strings steps.jsonl holds: which cells
    both sides recorded, which need drilling per kind (roll-ups differ, or the two tables
    order their rows differently), and whether any gradient roll-up was comparable."""
    both_rows: list[list[bool]] = []
    cand_rows: dict[str, list[list[bool]]] = {k: [] for k in KINDS}
    grads_compared = False
    n_cand = 0
    n = len(steps)
    for x, y, al in zip(ra, rb, aligns):
        xs, ys, ident = x.steps, y.steps, al.identity
        if ident and len(xs) == n and len(ys) == n:  # ``steps`` holds both ranks' steps
            # the usual rank: both sides recorded every step; its roll-ups as lists (C loops)
            fast = step_fields(xs, ys, steps, "param_digest", "grad_digest", "entry_digest")
            if fast is not None:
                grads = fast[1]
                both_rows.append([True] * n)
                for k in KINDS:
                    cand_rows[k].append([False] * n)
                grads_compared = grads_compared or any(
                    isinstance(u, str) and u != "" for u in grads)
                continue
        brow: list[bool] = []
        prow: list[bool] = []
        grow: list[bool] = []
        erow: list[bool] = []
        for s in steps:
            p, q = xs.get(s), ys.get(s)
            if p is None or q is None:
                brow.append(False)
                prow.append(False)
                grow.append(False)
                erow.append(False)
                continue
            u, v = p.get("entry_digest"), q.get("entry_digest")
            e = (u is not None or v is not None) and (u != v or not ident)
            erow.append(e)
            n_cand += e
            brow.append(True)
            u, v = p.get("param_digest"), q.get("param_digest")
            c = isinstance(u, str) and u != "" and isinstance(v, str) and v != "" and (
                u != v or not ident)
            prow.append(c)
            u, v = p.get("grad_digest"), q.get("grad_digest")
            ok = isinstance(u, str) and u != "" and isinstance(v, str) and v != ""
            grads_compared = grads_compared or ok
            d = ok and (u != v or not ident)
            grow.append(d)
            n_cand += c or d
        both_rows.append(brow)
        cand_rows["param"].append(prow)
        cand_rows["grad"].append(grow)
        cand_rows["entry"].append(erow)
    return both_rows, cand_rows, grads_compared, n_cand


def step_fields(xs: dict, ys: dict, steps: list[int], *names: str):
    """When both sides' records of ``steps`` (every one present) hold equal values of each
    field in ``names`` (the same types too: ``True == 1``), those values of A's side as one list
    per field, else None. For a rank whose two sides agree, in C loops rather than per cell."""
    recs_a, recs_b = list(map(xs.get, steps)), list(map(ys.get, steps))
    if None in recs_a or None in recs_b:
        return None
    out = []
    for name in names:
        va = list(map(dict.get, recs_a, repeat(name)))
        vb = list(map(dict.get, recs_b, repeat(name)))
        if va != vb or list(map(type, va)) != list(map(type, vb)):
            return None
        out.append(va)
    return out


def compare_hashes(ranks: list[int], ra: list[RankData], rb: list[RankData],
                   aligns: list[ParamAlignment], steps: list[int],
                   count_budget: int = DEFAULT_COUNT_BUDGET) -> HashComparison:
    """Compare the hashes of ``ranks`` (parallel lists ``ra``, ``rb``, ``aligns``) over ``steps``.

    The phases of the module docstring: roll-ups of every (rank, step) as strings
    (:func:`_rollup_pass`; two identical runs end here, without numpy), then each step with a
    candidate cell drilled (:func:`_drill_step`), then the steps after the first divergent one
    that differ nowhere (:func:`_zero_counts`)."""
    both, cand, grads_compared, n_cand = _rollup_pass(ra, rb, aligns, steps)
    col_both = [any(col) for col in zip(*both)] if both else [False] * len(steps)
    steps_compared = [s for s, c in zip(steps, col_both) if c]
    unreadable: list[tuple[str, int, int, str]] = []
    if not n_cand:  # every roll-up both sides recorded is equal: nothing to drill
        return HashComparison(steps, both, None, None, [], 0, unreadable, grads_compared,
                              steps_compared)

    budget = _Budget(count_budget)
    n_glob = 1 + max((max(al.gids) for al in {id(al): al for al in aligns}.values()
                      if al.gids), default=-1)
    first_step: int | None = None
    detail: StepDetail | None = None
    counts: list[StepCount] = []
    cand_p, cand_g = cand["param"], cand["grad"]
    for j, step in enumerate(steps):
        cand_e = cand["entry"]
        rows = [i for i in range(len(aligns)) if cand_p[i][j] or cand_g[i][j] or cand_e[i][j]]
        if not rows:
            continue
        det, count = _drill_step(ranks, ra, rb, aligns, cand, step, j, rows, n_glob,
                                 first_step is not None, grads_compared, budget, unreadable)
        if count is None:
            continue  # roll-ups differed only by storage order
        if first_step is None:
            first_step, detail = step, det
        counts.append(count)
    if first_step is not None:
        _zero_counts(counts, steps, col_both, first_step, grads_compared)
    return HashComparison(steps, both, first_step, detail, counts, budget.drilled, unreadable,
                          grads_compared, steps_compared)


class _Budget:
    """Cells drilled so far, and how many more may be drilled after the first divergent step
    (``count_budget``): shared by every step of one comparison."""

    def __init__(self, count_budget: int):
        self.left = count_budget
        self.drilled = 0


def _drill_step(ranks: list[int], ra: list[RankData], rb: list[RankData],
                aligns: list[ParamAlignment], cand: dict[str, list[list[bool]]], step: int,
                j: int, rows: list[int], n_glob: int, after_first: bool, grads_compared: bool,
                budget: _Budget, unreadable: list[tuple[str, int, int, str]]
                ) -> tuple[StepDetail, StepCount | None]:
    """Read and compare the per-parameter hashes of step ``step``'s candidate cells (rank
    positions ``rows``, step column ``j``): (what differs, the step's counts; None when nothing
    differs after all). Before the first divergent step every cell is drilled for the detail;
    after it, only until saturated or out of budget."""
    import numpy as np

    det = StepDetail(step)
    masks = {k: np.zeros(n_glob, dtype=bool) for k in KINDS}
    saturated = {k: False for k in KINDS}
    diff_ranks: set[int] = set()
    exact = known_ranks = True
    for i in rows:
        al = aligns[i]
        for kind in KINDS:
            if not cand[kind][i][j]:
                continue
            if after_first and al.identity and saturated[kind]:
                # every parameter already differs somewhere; the roll-up says this rank does
                diff_ranks.add(ranks[i])
                continue
            if after_first and budget.left <= 0:
                exact = False
                if al.identity:
                    diff_ranks.add(ranks[i])
                else:
                    known_ranks = False
                continue
            budget.drilled += 1
            if after_first:
                budget.left -= 1
            hb = _load(rb[i], step, kind, al.n_b)
            want = ra[i].steps[step].get(_DIGEST_FIELD[kind])
            if hb is not None and al.permutation and isinstance(want, str):
                # B's hashes in A's order have A's roll-up iff nothing differs: A unread
                if rollup_digest(hb[al.ib].tobytes()) == want:
                    continue
            ha = _load(ra[i], step, kind, al.n_a)
            if ha is None or hb is None:
                if ha is None:
                    unreadable.append(("a", ranks[i], step, kind))
                if hb is None:
                    unreadable.append(("b", ranks[i], step, kind))
                continue
            bad = (ha[al.ia] != hb[al.ib]).any(axis=1)
            if bad.any():
                g = al.gid[bad]
                if not after_first:
                    det.pairs[kind].append((g, ranks[i]))
                masks[kind][g] = True
                diff_ranks.add(ranks[i])
                if after_first and masks[kind].all():
                    saturated[kind] = True
    if not diff_ranks and exact:
        return det, None
    n_p = int(masks["param"].sum())
    n_g = int(masks["grad"].sum()) if grads_compared else None
    if not exact:  # past the budget: counts are unknown unless saturated
        n_p = n_p if saturated["param"] else None
        n_g = n_g if saturated["grad"] else None
    return det, StepCount(step, n_p, n_g, len(diff_ranks) if known_ranks else None,
                          exact or (saturated["param"] and (saturated["grad"]
                                                            or not grads_compared)))


def _zero_counts(counts: list[StepCount], steps: list[int], col_both: list[bool],
                 first_step: int, grads_compared: bool) -> None:
    """Steps after the first with nothing different count as zeros (compared, equal); ``counts``
    ends sorted by step."""
    have = {c.step for c in counts}
    for j, step in enumerate(steps):
        if step > first_step and step not in have and col_both[j]:
            counts.append(StepCount(step, 0, 0 if grads_compared else None, 0, True))
    counts.sort(key=lambda c: c.step)


__all__ = ["Aligner", "ParamAlignment", "ParamIndex", "param_keys", "compare_hashes", "HashComparison",
           "StepCount", "StepDetail", "KINDS", "DEFAULT_COUNT_BUDGET"]
