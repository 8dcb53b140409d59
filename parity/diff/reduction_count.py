"""The count behind ``parity diff --at`` (parity/diff/reduction.py): how many elements of every
parameter two layouts sum in another rank order, for every parameter at once.

Why a module of its own: it is the one numeric kernel of the prediction, the part that must stay
fast at 256 ranks x 1,500 parameters (benchmarks/bench_reduction.py), and it knows nothing of
NCCL's rules: it is handed, per collective, where each range of elements starts and the ring
(reduce-scatter) or the sum order (all-reduce chunk) that sums it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.nccl import canonical_order

if TYPE_CHECKING:  # numpy is imported by the functions that count (a diff of equal runs: never)
    import numpy as np

class Orders:
    """Per ring, every owner's canonical sum order (n x n); per pair of rings, which owners'
    orders differ. Cached: a topology has few distinct rings."""

    def __init__(self, world: int):
        self.world = world
        self._canon: dict[tuple, np.ndarray] = {}
        self._differ: dict[tuple, tuple[list, list]] = {}
        self._keep: list = []

    def canon(self, ring: tuple[int, ...]) -> np.ndarray:
        m = self._canon.get(ring)  # few distinct rings: hashing them is cheap enough
        if m is None:
            import numpy as np

            r = np.asarray(ring, dtype=np.int32)
            n = r.size
            pos = np.empty(n, dtype=np.int64)
            pos[r] = np.arange(n)
            m = r[(pos[:, None] + 1 + np.arange(n)[None, :]) % n]  # m[d] = sum_order(ring, d)
            if n >= 2:
                m[:, :2] = np.sort(m[:, :2], axis=1)  # the first addition commutes
            self._canon[ring] = m
        return m

    def _mask(self, ra: tuple[int, ...], rb: tuple[int, ...]):
        import numpy as np

        return np.zeros(self.world, dtype=bool) if ra == rb else \
            ~(self.canon(ra) == self.canon(rb)).all(axis=1)

    def differ(self, ra: tuple[int, ...], rb: tuple[int, ...]) -> tuple[list, list]:
        """(whether owner d's orders differ, per d; how many owners below d differ, d = 0..n)."""
        key = (id(ra), id(rb))  # rings are shared tuple objects (the model caches them)
        v = self._differ.get(key)
        if v is None:
            import numpy as np

            m = self._mask(ra, rb)
            v = (m.tolist(), [0, *np.cumsum(m).tolist()])
            self._differ[key] = self._differ[(id(rb), id(ra))] = v
            self._keep.append((ra, rb))  # the ids stay valid while this object lives
        return v


class ChunkOrders(Orders):
    """All-reduce: an element's order is its chunk's sum order, the same for every owner (the
    shard ranks of an HSDP all-reduce each all-reduce their row alike)."""

    def _mask(self, ra: tuple[int, ...], rb: tuple[int, ...]):
        import numpy as np

        same = canonical_order(ra) == canonical_order(rb)
        return np.full(self.world, not same, dtype=bool)


def count_at_risk(pending: list, chan_a: dict, chan_b: dict, orders: Orders) -> np.ndarray:
    """Elements at risk for every entry of ``pending`` at once (numpy, no per-parameter Python
    loop): entry k is (collective A, collective B, offset A, offset B, length, full, part), a
    payload of ``length`` elements per owner at per-rank offsets A and B, owners below ``full``
    holding whole shards and owner ``full`` holding ``part`` real elements. ``chan_*``:
    collective -> (range starts, rings or orders, per-rank count).

    Each side's collectives are laid end to end on one axis (``base``), so one ``searchsorted``
    finds every range boundary inside every payload; the payload is cut at both sides'
    boundaries into pieces within which each side's order is constant, and a piece adds
    ``length x (owners below full whose sum order differs)`` plus its overlap with owner
    ``full``'s ``part`` when that owner's order differs."""
    import numpy as np

    k = len(pending)
    if not k:
        return np.zeros(0, dtype=np.int64)
    cols = np.array([p[2:] for p in pending], dtype=np.int64).reshape(k, 5)
    oa, ob, length, full, part = cols.T
    ring_ids: dict[int, int] = {}
    ring_objs: list = []
    memo: dict[int, list[int]] = {}

    def axis(chan: dict, colls: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        base, offs, lens, starts_all, rids, off = {}, [], [], [], [], 0
        for c in dict.fromkeys(colls):
            starts, rings, count = chan[c]
            base[c] = off
            offs.append(off)
            lens.append(len(starts))
            starts_all.extend(starts)
            got = memo.get(id(rings))  # collectives of one size share one list
            if got is None:
                got = []
                for r in rings:
                    i = ring_ids.get(id(r))
                    if i is None:
                        i = ring_ids[id(r)] = len(ring_objs)
                        ring_objs.append(r)
                    got.append(i)
                memo[id(rings)] = got
            rids.extend(got)
            off += count
        los = np.array(starts_all, dtype=np.int64) + np.repeat(np.array(offs, dtype=np.int64),
                                                               lens)
        return (np.array([base[c] for c in colls], dtype=np.int64), los,
                np.array(rids, dtype=np.int64))

    base_a, los_a, rid_a = axis(chan_a, [p[0] for p in pending])
    base_b, los_b, rid_b = axis(chan_b, [p[1] for p in pending])
    if not los_a.size or not los_b.size:  # only empty buffers: nothing to sum
        return np.zeros(k, dtype=np.int64)
    start_a, start_b = base_a + oa, base_b + ob
    # the cuts of each payload: 0, and each side's range starts strictly inside it
    cut_param, cut_pos = [np.arange(k)], [np.zeros(k, dtype=np.int64)]
    for los, start in ((los_a, start_a), (los_b, start_b)):
        i0 = np.searchsorted(los, start, "right")
        i1 = np.searchsorted(los, start + length, "left")
        inside = np.maximum(i1 - i0, 0)
        if inside.any():
            owner = np.repeat(np.arange(k), inside)
            first = np.repeat(i0 - np.cumsum(inside) + inside, inside)
            idx = first + np.arange(owner.size)
            cut_param.append(owner)
            cut_pos.append(los[idx] - start[owner])
    cp, pos = np.concatenate(cut_param), np.concatenate(cut_pos)
    order = np.lexsort((pos, cp))
    cp, pos = cp[order], pos[order]
    keep = np.ones(cp.size, dtype=bool)  # a boundary of both sides at one place: one cut
    keep[1:] = (cp[1:] != cp[:-1]) | (pos[1:] != pos[:-1])
    cp, s = cp[keep], pos[keep]
    last = np.ones(cp.size, dtype=bool)
    last[:-1] = cp[1:] != cp[:-1]
    e = np.where(last, length[cp], np.roll(s, -1))
    ra = rid_a[np.searchsorted(los_a, start_a[cp] + s, "right") - 1]
    rb = rid_b[np.searchsorted(los_b, start_b[cp] + s, "right") - 1]
    pair, inverse = np.unique(ra * len(ring_objs) + rb, return_inverse=True)
    world = orders.world
    before = np.zeros((pair.size, world + 1), dtype=np.int64)
    differs = np.zeros((pair.size, world + 1), dtype=bool)  # column ``world``: no such owner
    for j, key in enumerate(pair.tolist()):
        x, y = ring_objs[key // len(ring_objs)], ring_objs[key % len(ring_objs)]
        if x is y or x == y:
            continue
        d, cum = orders.differ(x, y)
        before[j] = cum
        differs[j, :world] = d
    inverse = inverse.reshape(-1)
    f = full[cp]
    n = (e - s) * before[inverse, f]
    n += np.where(differs[inverse, f], np.clip(np.minimum(part[cp], e) - s, 0, None), 0)
    out = np.zeros(k, dtype=np.int64)
    np.add.at(out, cp, n)
    return out
