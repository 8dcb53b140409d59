"""The size of a difference: how far apart the values behind two differing hashes are.

A hash says equal or not. Next to each hash capture records three figures of the tensor
(artifacts.FIGURE_FIELDS: the fp64 sum, the fp64 sum of squares, max |x|). From the figures of
the two sides this module derives, per divergent parameter and step:

* ``lower``: a lower bound on the L2 distance ||b - a|| that the figures prove, the largest of
  | ||b|| - ||a|| | (triangle inequality), |sum b - sum a| / sqrt(n) (Cauchy-Schwarz) and
  |max|b| - max|a|| (at most the largest element difference, at most the L2 distance);
* ``rel``: ``lower / ||a||``, the relative difference the figures show (at least);
* ``ulps``: ``lower`` in units of the ulp of a typical element of ``a`` (its RMS, in the
  parameter's dtype): ~1 is a last-bit difference, thousands is drift.

These are summaries, not proofs: equal figures do not mean equal values (a swap of two elements
leaves all three unchanged), and a bitwise verdict comes from the hashes only; nothing here
changes a verdict or an exit code. Runs recorded before the figures existed have none
(``recorded: false``): the diff then says so and nothing else changes.

Cost: only after a divergence, and only figures records: the first divergent step's record on
each divergent parameter's first rank, and one record per side, kind and step on the first
divergent rank for the per-step maximum (at most ``MAX_STEPS`` steps).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parity.artifacts import RankData
    from parity.diff.hashes import ParamAlignment, ParamIndex
    from parity.diff.result import Divergence

MAX_PARAMS = 24  # divergent parameters followed over the steps
MAX_STEPS = 200  # steps shown per series (evenly spaced, the first and last always)
NOTE = ("summaries of each tensor (fp64 sum, sum of squares, max |x|), not proofs: a lower "
        "bound on the difference; equal figures do not mean equal values, and the verdict "
        "comes from the hashes alone")
# bits of precision after the leading one (ulp = 2**(exponent - MANTISSA))
MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7,
            "float8_e4m3fn": 3, "float8_e4m3fnuz": 3, "float8_e5m2": 2, "float8_e5m2fnuz": 2,
            "complex64": 23, "complex128": 52}


def ulp(x: float, dtype: str | None) -> float:
    """The spacing of ``dtype``'s numbers at magnitude ``x`` (1 for integer dtypes)."""
    bits = MANTISSA.get(str(dtype or "").removeprefix("torch."))
    if bits is None:
        return 1.0
    if not x or not math.isfinite(x):
        return 0.0
    return 2.0 ** (math.frexp(abs(x))[1] - 1 - bits)


def compare(fa, fb, numel: int | None, dtype: str | None) -> dict | None:
    """The size of one difference from the two sides' figures ((sum, sumsq, max|x|) each);
    None when either side has none (not recorded, or ``NO_FIGURES``: no tensor, e.g. no
    gradient at that step). A side with NaN or infinite values: ``nonfinite``, no size."""
    if fa is None or fb is None:
        return None
    sa, qa, ma = (float(x) for x in fa)
    sb, qb, mb = (float(x) for x in fb)
    if qa < 0 or qb < 0:  # NO_FIGURES
        return None
    out = {"a": [sa, qa, ma], "b": [sb, qb, mb]}
    if not all(math.isfinite(x) for x in (sa, qa, ma, sb, qb, mb)):
        out.update(rel=None, ulps=None, lower=None, nonfinite=True)
        return out
    na, nb = math.sqrt(max(qa, 0.0)), math.sqrt(max(qb, 0.0))
    n = max(int(numel or 1), 1)
    lower = max(abs(nb - na), abs(sb - sa) / math.sqrt(n), abs(mb - ma))
    scale = na if na else nb
    out["lower"] = lower
    out["rel"] = lower / scale if scale else 0.0
    u = ulp(na / math.sqrt(n), dtype) if na else 0.0
    out["ulps"] = lower / u if u else None
    return out


def _numel(row: dict | None) -> int | None:
    shape = (row or {}).get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)


def _spaced(steps: list[int], most: int) -> list[int]:
    """At most ``most`` of ``steps``, evenly spaced, the first and the last kept."""
    if len(steps) <= most:
        return list(steps)
    k = (len(steps) - 1) / (most - 1)
    return sorted({steps[round(i * k)] for i in range(most)})


class _Figures:
    """Figure records of both sides, read once per (rank position, step, kind)."""

    def __init__(self, ra: list[RankData], rb: list[RankData]):
        self.ra, self.rb = ra, rb
        self._cache: dict[tuple, tuple] = {}

    def get(self, i: int, step: int, kind: str):
        key = (i, step, kind)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = (self.ra[i].figures(step, kind),
                                      self.rb[i].figures(step, kind))
        return got


def size_of_difference(ra: list[RankData], rb: list[RankData], ranks: list[int],
                       aligns: list[ParamAlignment], index: ParamIndex,
                       divergent: list[Divergence], first: int | None,
                       steps: list[int]) -> dict:
    """``DiffResult.magnitude``: per divergent parameter of the first divergent step, the size
    of its difference there and at every later compared step (on its first divergent rank), and
    per step the largest relative difference over all parameters on the first divergent rank.
    ``{}`` when nothing diverged."""
    if first is None or not divergent or not ranks:
        return {}
    pos = {r: i for i, r in enumerate(ranks)}
    figs = _Figures(ra, rb)
    later = _spaced([s for s in steps if s >= first], MAX_STEPS)
    rows: dict[int, dict] = {}  # rank position -> {key: (row in A, row in B, A's table row)}

    def locate(i: int) -> dict:
        got = rows.get(i)
        if got is None:
            al, params = aligns[i], ra[i].params
            names = index.names
            ia = range(al.n_a) if al.rows_a is None else al.rows_a
            ib = range(al.n_b) if al.rows_b is None else al.rows_b
            got = rows[i] = {names[g]: (x, y, params[x] if x < len(params) else None)
                             for g, x, y in zip(al.gids, ia, ib)}
        return got

    def size(i: int, step: int, kind: str, key: str) -> dict | None:
        fa, fb = figs.get(i, step, kind)
        hit = locate(i).get(key)
        if fa is None or fb is None or hit is None:
            return None
        x, y, row = hit
        if x >= len(fa) or y >= len(fb):
            return None
        return compare(fa[x], fb[y], _numel(row), (row or {}).get("dtype"))

    params = []
    for d in [d for d in divergent if d.step == first][:MAX_PARAMS]:
        kind = "grad" if d.kind == "grad" else "param"
        i = pos.get(d.ranks[0]) if d.ranks else None
        if i is None:
            continue
        hit = locate(i).get(d.fqn)
        series = []
        for s in later:
            got = size(i, s, kind, d.fqn)
            if got is not None:
                series.append({"step": s, **got})
        params.append({"fqn": d.fqn, "kind": d.kind, "rank": d.ranks[0],
                       "dtype": (hit[2] or {}).get("dtype") if hit else None,
                       "numel": _numel(hit[2]) if hit else None, "steps": series})
    recorded = any(p["steps"] and p["steps"][0]["step"] == first for p in params)
    out = {"recorded": recorded, "note": NOTE, "params": params, "per_step": []}
    if not recorded:
        out["absent"] = _absent(figs, locate, pos, divergent, first)
        return out
    i0 = pos.get(divergent[0].ranks[0]) if divergent[0].ranks else None
    if i0 is not None:
        table = _Table(locate(i0))
        out["per_step"] = [_step_max(figs, table, i0, s, ranks[i0]) for s in later]
    return out


def _absent(figs, locate, pos: dict, divergent: list[Divergence], first: int) -> list[dict]:
    """The divergent tensors of the first divergent step that one side did not have (its
    figures are ``NO_FIGURES``: a gradient that was None, hashed as absent) while the other
    did: ``[{fqn, kind, side}]``, side the one without. Their size cannot be given, and the
    reports say why instead of "the runs carry no figures" (a trainer zeroing gradients with
    ``set_to_none=False`` against one that sets them to None, round 5)."""
    out = []
    for d in [d for d in divergent if d.step == first][:MAX_PARAMS]:
        i = pos.get(d.ranks[0]) if d.ranks else None
        if i is None:
            continue
        fa, fb = figs.get(i, first, "grad" if d.kind == "grad" else "param")
        hit = locate(i).get(d.fqn)
        if fa is None or fb is None or hit is None or hit[0] >= len(fa) or hit[1] >= len(fb):
            continue
        qa, qb = float(fa[hit[0]][1]), float(fb[hit[1]][1])
        if (qa < 0) != (qb < 0):
            out.append({"fqn": d.fqn, "kind": d.kind, "side": "a" if qa < 0 else "b"})
    return out


class _Table:
    """One rank's aligned rows as arrays, built once for every step's maximum."""

    def __init__(self, located: dict):
        import numpy as np

        self.located = located
        self.keys = list(located)
        rows = [located[k] for k in self.keys]
        self.xs = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        self.ys = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
        self.numel = np.array([max(_numel(r[2]) or 1, 1) for r in rows], dtype=np.float64)
        self.bits = np.array([MANTISSA.get(str((r[2] or {}).get("dtype")), -1) for r in rows])


def _step_max(figs: _Figures, table: _Table, i: int, step: int, rank: int) -> dict:
    """The largest relative difference of one step over every parameter of rank position ``i``,
    per kind: ``{"step", "rank", "param": {"fqn", "rel", "ulps", "differ"} | None, "grad": ...}``;
    ``differ`` counts the parameters whose figures differ at all. Vectorized: the same bound
    as :func:`compare`, for a whole table at once."""
    import numpy as np

    located, keys, xs, ys = table.located, table.keys, table.xs, table.ys
    numel, bits = table.numel, table.bits
    out: dict = {"step": step, "rank": rank}
    for kind in ("param", "grad"):
        fa, fb = figs.get(i, step, kind)
        if fa is None or fb is None or not keys or xs.max() >= len(fa) or ys.max() >= len(fb):
            out[kind] = None
            continue
        a, b = fa[xs], fb[ys]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            there = ~(a[:, 1] < 0) & ~(b[:, 1] < 0)  # both sides had the tensor (not NO_FIGURES)
            fin_a, fin_b = np.isfinite(a).all(axis=1), np.isfinite(b).all(axis=1)
            # a side gone non-finite (NaN, inf) where the other is not: differs, no size
            nonfinite = there & (fin_a != fin_b)
            ok = there & fin_a & fin_b
            differ = ok & (a != b).any(axis=1)
            na, nb = np.sqrt(np.maximum(a[:, 1], 0)), np.sqrt(np.maximum(b[:, 1], 0))
            lower = np.maximum.reduce([np.abs(nb - na), np.abs(b[:, 0] - a[:, 0]) / np.sqrt(numel),
                                       np.abs(b[:, 2] - a[:, 2])])
            scale = np.where(na > 0, na, nb)
            rel = np.where(scale > 0, lower / scale, 0.0)
        rel = np.where(differ, rel, -1.0)
        best = None
        if differ.any():
            j = int(np.argmax(rel))
            u = ulp(float(na[j]) / math.sqrt(numel[j]), (located[keys[j]][2] or {}).get("dtype")) \
                if bits[j] >= 0 and na[j] else (1.0 if bits[j] < 0 else 0.0)
            best = {"fqn": keys[j], "rel": float(rel[j]),
                    "ulps": float(lower[j]) / u if u else None}
        out[kind] = {**(best or {}), "differ": int(differ.sum() + nonfinite.sum())}
        if nonfinite.any():
            out[kind]["nonfinite"] = int(nonfinite.sum())
    return out


# ------------------------------------------------------------------------------ the words
def rel_text(rel) -> str:
    """A relative difference as reports print it ("0" when the figures agree)."""
    if not isinstance(rel, (int, float)):
        return "-"
    return "0" if rel == 0 else f"{rel:.2g}"


def ulps_text(ulps) -> str:
    """A difference in ulps of a typical element ("<1" below one ulp)."""
    if not isinstance(ulps, (int, float)):
        return "-"
    if ulps == 0:
        return "0"
    if ulps < 1:
        return "<1"
    return f"{ulps:.3g}" if ulps < 1e4 else f"{ulps:.2g}"


def size_texts(size: dict | None) -> tuple[str, str]:
    """(relative difference, ulps) of one size as reports print them."""
    size = size or {}
    if size.get("nonfinite"):
        return "NaN/inf", "-"
    return rel_text(size.get("rel")), ulps_text(size.get("ulps"))


def first_sizes(magnitude: dict) -> dict[tuple, dict]:
    """{(fqn, kind, rank): the size at the first divergent step} from ``magnitude.params``."""
    out = {}
    for p in (magnitude or {}).get("params") or []:
        if isinstance(p, dict) and p.get("steps"):
            out[(p.get("fqn"), p.get("kind"), p.get("rank"))] = p["steps"][0]
    return out
