"""The count behind ``parity diff --at`` (parity/diff/reduction.py): how many elements of every
parameter two layouts sum in another rank order, for every parameter at once.

Why a module of its own: it is the one numeric kernel of the prediction, the part that must stay
fast at 256 ranks x 1,500 parameters (benchmarks/bench_reduction.py), and it knows nothing of
NCCL's rules: it is handed, per collective, where each range of elements starts and the ring
(reduce-scatter) or the sum order (all-reduce chunk) that sums it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.nccl import canonical_order, same_sum, sum_order

if TYPE_CHECKING:  # numpy is imported by the functions that count (a diff of equal runs: never)
    import numpy as np

# Every ring (reduce-scatter) and chunk order (all-reduce) a prediction of this process has met,
# numbered once: a channel map holds ring numbers, so comparing two maps, or finding the pair
# of rings that sum an element, compares integers. Rings are few (a topology's channels).
_RINGS: dict[tuple, int] = {}  # ring -> its number
_RING_LIST: list[tuple] = []  # number -> ring
_BY_ID: dict[int, tuple] = {}  # id(ring) -> (ring, number): the ring kept, so the id stays its
_MASKS: dict[tuple, object] = {}  # (Orders class, owners, (ring, ring)) -> owner d differs, d <= n


def ring_id(ring: tuple[int, ...]) -> int:
    """The number of ``ring`` (by value)."""
    got = _BY_ID.get(id(ring))
    if got is not None and got[0] is ring:
        return got[1]
    i = _RINGS.get(ring)
    if i is None:
        i = _RINGS[ring] = len(_RING_LIST)
        _RING_LIST.append(ring)
    _BY_ID[id(ring)] = (ring, i)
    return i


def channel_map(starts: tuple[int, ...], orders: tuple, count: int) -> tuple:
    """(range starts, ring number per range, a key equal for equal maps) of one scenario of a
    collective of ``count`` elements (``Plan.starts``, ``Plan.orders``); empty ranges dropped
    (the range holding an offset is the last one starting at or before it)."""
    import numpy as np

    s = np.array(starts, dtype=np.int64)
    rids = np.array([ring_id(r) for r in orders], dtype=np.int64)
    keep = s < count
    keep[:-1] &= s[1:] != s[:-1]
    s, rids = s[keep], rids[keep]
    return s, rids, (s.tobytes(), rids.tobytes())


class Orders:
    """Per pair of rings, which owners' sum orders differ (``same_sum`` of ``sum_order``).
    Cached: a topology has few distinct rings.

    Exact in O(n) per pair, not O(n^2): owner d adds ``next(d), next(next(d)), ..., d``, so
    its order is the whole ring read from d. Two rings that are the same cycle give every
    owner the same order; two different cycles give owner d the same order only where they
    differ by the first addition alone (a -> x -> y -> rest and a -> y -> x -> rest with d = a),
    so their successors differ at no more than d, x and y. Where the successors differ at more
    than 3 ranks every owner differs; otherwise the (at most 3) candidate owners are compared
    with ``same_sum`` itself."""

    def __init__(self, world: int):
        self.world = world
        self._succ: dict[tuple, object] = {}

    def succ(self, ring: tuple[int, ...]):
        """The ring's successor of each rank (None if it is not a ring of every rank)."""
        s = self._succ.get(ring, False)  # few distinct rings: hashing them is cheap enough
        if s is False:
            import numpy as np

            r = np.asarray(ring, dtype=np.int64)
            s = None
            if r.size == self.world and np.array_equal(np.sort(r), np.arange(self.world)):
                s = np.empty(r.size, dtype=np.int64)
                s[r] = np.roll(r, -1)
            self._succ[ring] = s
        return s

    def mask(self, ra: tuple[int, ...], rb: tuple[int, ...]):
        """Whether owner d sums in another order on ring ``rb`` than on ``ra``, d = 0..n-1."""
        import numpy as np

        n = self.world
        if ra == rb:
            return np.zeros(n, dtype=bool)
        sa, sb = self.succ(ra), self.succ(rb)
        if sa is None or sb is None:  # not rings of every rank (the model gives none): at risk
            return np.ones(n, dtype=bool)
        where = np.flatnonzero(sa != sb)
        if not where.size:  # one cycle, written from another rank
            return np.zeros(n, dtype=bool)
        out = np.ones(n, dtype=bool)
        if where.size <= 3:
            for d in where.tolist():
                out[d] = not same_sum(sum_order(ra, d), sum_order(rb, d))
        return out


class ChunkOrders(Orders):
    """All-reduce: an element's order is its chunk's sum order, the same for every owner (the
    shard ranks of an HSDP all-reduce each all-reduce their row alike)."""

    def mask(self, ra: tuple[int, ...], rb: tuple[int, ...]):
        """Whether the two chunk orders differ, the same for every owner."""
        import numpy as np

        same = canonical_order(ra) == canonical_order(rb)
        return np.full(self.world, not same, dtype=bool)


class RiskCount:
    """Elements at risk of a fixed list of payloads under many scenario combinations: what
    depends only on the payloads (where each one starts on its side's axis, how many elements
    its owners hold) is laid out once; a pass (:meth:`count`) takes, per size class of each
    side, the channel map of one scenario.

    ``cols`` = (collective index A, collective index B, offset A, offset B, length, full,
    part), one array each, one element per payload: a payload of ``length`` elements per owner
    at per-rank offsets A and B, owners below ``full`` holding whole shards and owner ``full``
    holding ``part`` real elements. ``classes_*[c]``: the size class of collective c
    (collectives of one class share their scenarios); ``counts_*[c]``: its per-rank element
    count. Each side's collectives are laid end to end on one axis, so one ``searchsorted``
    finds every range boundary inside every payload."""

    def __init__(self, cols: tuple, classes_a: list[int], counts_a: list[int],
                 classes_b: list[int], counts_b: list[int], orders: Orders):
        import numpy as np

        ia, ib, oa, ob, self.length, self.full, self.part = (
            np.asarray(c, dtype=np.int64) for c in cols)
        self.orders = orders
        self.sides = []
        for classes, counts, idx, off in ((classes_a, counts_a, ia, oa),
                                          (classes_b, counts_b, ib, ob)):
            cls = np.asarray(classes, dtype=np.int64).reshape(-1)
            base = np.zeros(cls.size + 1, dtype=np.int64)
            np.cumsum(np.asarray(counts, dtype=np.int64), out=base[1:])
            members = [np.flatnonzero(cls == g) for g in range(int(cls.max(initial=-1)) + 1)]
            self.sides.append({"start": base[idx] + off, "class": cls[idx],
                               "bases": [base[m] for m in members]})
        # the most a pass can count: every real element of every owner
        self.cap = self.length * self.full + np.minimum(self.part, self.length)
        self._pair_at: dict = {}  # (ring id, ring id) -> its row in the tables
        self._masks: list = []  # per row: whether owner d sums in another order (d = 0..n)
        self._tables = None  # (owners below d that do, per row; the masks), once stacked

    def _axis(self, side: dict, maps: list) -> tuple:
        import numpy as np

        los, rid = [], []
        for bases, m in zip(side["bases"], maps):
            if m is None or not bases.size:
                continue
            los.append((bases[:, None] + m[0][None, :]).reshape(-1))
            rid.append(np.tile(m[1], bases.size))
        if not los:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if len(los) == 1:
            return los[0], rid[0]
        los, rid = np.concatenate(los), np.concatenate(rid)
        o = np.argsort(los, kind="stable")
        return los[o], rid[o]

    def _pair_rows(self, pairs: list) -> tuple:
        """For each (ring id, ring id): how many owners below d sum in another order (d = 0..n)
        and whether owner d does (d = n: no such owner), as rows of two tables."""
        import numpy as np

        rows = []
        kind, world = type(self.orders), self.orders.world
        for p in pairs:
            i = self._pair_at.get(p)
            if i is None:
                m = _MASKS.get((kind, world, p))
                if m is None:
                    if len(_MASKS) > 100_000:  # a long-lived process: start over
                        _MASKS.clear()
                    x, y = p
                    m = _MASKS[(kind, world, p)] = np.zeros(world + 1, dtype=bool)
                    if x != y:
                        m[:-1] = self.orders.mask(_RING_LIST[x], _RING_LIST[y])
                i = self._pair_at[p] = len(self._masks)
                self._masks.append(m)
                self._tables = None
            rows.append(i)
        if self._tables is None:
            masks = np.stack(self._masks)
            cum = np.zeros(masks.shape, dtype=np.int64)
            np.cumsum(masks[:, :-1], axis=1, out=cum[:, 1:])
            self._tables = (cum, masks)
        rows = np.array(rows, dtype=np.int64)
        return self._tables[0][rows], self._tables[1][rows]

    def count(self, idx, maps_a: list, maps_b: list):
        """Elements at risk of the entries ``idx`` when side A's size class g runs the channel
        map ``maps_a[g]`` (:func:`channel_map`; None: not in this combination) and B's likewise.

        The payload is cut at both sides' range starts into pieces within which each side's
        order is constant; a piece adds ``length x (owners below full whose sum order
        differs)`` plus its overlap with owner ``full``'s ``part`` when that owner's order
        differs (pieces of length 0, where both sides cut at one place, add nothing)."""
        import numpy as np

        k = idx.size
        if not k:
            return np.zeros(0, dtype=np.int64)
        axes = [self._axis(side, maps) for side, maps in zip(self.sides, (maps_a, maps_b))]
        if not axes[0][0].size or not axes[1][0].size:  # only empty buffers: nothing to sum
            return np.zeros(k, dtype=np.int64)
        starts = [side["start"][idx] for side in self.sides]
        length = self.length[idx]
        # the cuts of each payload: 0, and each side's range starts strictly inside it
        cut_entry, cut_pos = [np.arange(k)], [np.zeros(k, dtype=np.int64)]
        for (los, _), start in zip(axes, starts):
            i0 = np.searchsorted(los, start, "right")
            inside = np.maximum(np.searchsorted(los, start + length, "left") - i0, 0)
            n = int(inside.sum())
            if n:
                owner = np.repeat(np.arange(k), inside)
                first = np.repeat(i0 - np.cumsum(inside) + inside, inside)
                cut_entry.append(owner)
                cut_pos.append(los[first + np.arange(n)] - start[owner])
        cp, s = np.concatenate(cut_entry), np.concatenate(cut_pos)
        if cp.size > k:
            order = np.lexsort((s, cp))
            cp, s = cp[order], s[order]
        last = np.ones(cp.size, dtype=bool)
        last[:-1] = cp[1:] != cp[:-1]
        e = np.where(last, length[cp], np.roll(s, -1))
        (los_a, rid_a), (los_b, rid_b) = axes
        ra = rid_a[np.searchsorted(los_a, starts[0][cp] + s, "right") - 1]
        rb = rid_b[np.searchsorted(los_b, starts[1][cp] + s, "right") - 1]
        # the pairs of rings met, numbered densely (rings are few: no sort needed)
        local = np.zeros(len(_RING_LIST), dtype=np.int64)
        local[rid_a] = 1
        local[rid_b] = 1
        rings = np.flatnonzero(local)
        local[rings] = np.arange(rings.size)
        key = local[ra] * rings.size + local[rb]
        seen = np.zeros(rings.size * rings.size, dtype=np.int64)
        seen[key] = 1
        pair = np.flatnonzero(seen)
        seen[pair] = np.arange(pair.size)
        inverse = seen[key]
        ring = rings.tolist()
        before, differs = self._pair_rows([(ring[x // rings.size], ring[x % rings.size])
                                           for x in pair.tolist()])
        f = self.full[idx][cp]
        n = (e - s) * before[inverse, f]
        n += np.where(differs[inverse, f],
                      np.clip(np.minimum(self.part[idx][cp], e) - s, 0, None), 0)
        return np.bincount(cp, weights=n, minlength=k).astype(np.int64)
