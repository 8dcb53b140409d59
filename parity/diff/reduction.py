"""Predict, from the manifests alone, which gradient elements a multi-node NCCL Ring would sum in
a different rank order on the two sides (``parity diff A B --at 8x8``).

Why: on gloo, or on one node, a reduce-scatter bucket whose payload order changed gives the
same hashes; on a cluster it can change the sums (torchtitan#3611). Whether it does depends on
the channel each element lands in, and channels' rings differ only across nodes. This module
answers the question a 256-GPU weight-hash run answers, without a rerun:

1. Each side's reduce-scatter buckets (the layouts the diff selected, parity.diff.buckets) are
   re-derived at the target world size W from the captured payload order and the parameters'
   global shapes: FSDP2 / SimpleFSDP shard every gradient on dim 0 into ``ceil(dim0 / W)`` rows
   (the last ranks padded), and a bucket's per-rank row is its payloads' shards concatenated in
   payload order (``chunk_cat`` in FSDP2, ``reduce_scatter_merge_fn_to_trace`` in the bucketing
   pass). The derivation is first checked against what was recorded at the capture's own world
   size; a bucket it does not reproduce is *not predicted* (said, never guessed).
2. ``parity.nccl`` splits each bucket's per-rank count into channel ranges and gives each
   channel's ring; rank d's element at per-rank offset o is summed in ``sum_order(ring of the
   channel holding o, d)``.
3. An element is *at risk* when that order differs between A and B (``same_sum``: the first
   addition commutes). A gradient reduced by a different number of collectives (or in another
   dtype) is at risk as a whole.

Cost: one pass of numpy over every parameter at once (``_count_at_risk``: each side's buckets
laid end to end, the pieces a payload makes with both sides' channel boundaries found by
``searchsorted``), plus one W x W comparison per distinct pair of rings; what is left in Python
is one short step per parameter (classes, slots) and per bucket (its layout at W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from parity.diff.buckets import Bucket, Layout, eager_for
from parity.nccl.probe_file import describe_file
from parity.nccl import MODEL, MODEL_LIMITS, Topology, parse_topology, reduce_scatter_segments

if TYPE_CHECKING:  # numpy is imported by the functions that count (a diff of equal runs: never)
    import numpy as np

SAME, DIFFERS, UNKNOWN = "same", "differs", "unknown"
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
             "complex64": 8}


@dataclass
class AtRisk:
    """One parameter whose gradient would be summed differently at the target topology."""

    fqn: str
    elements: int  # elements of the full gradient summed in another rank order
    numel: int  # elements of the full gradient
    bucket: dict  # {"collective", "a": A's bucket index | None, "b": B's}
    why: str  # "order" (channel -> ring differs) | "structure" | "dtype"

    @property
    def fraction(self) -> float:
        return self.elements / self.numel if self.numel else 0.0

    def to_dict(self) -> dict:
        return {"fqn": self.fqn, "elements": self.elements, "fraction": round(self.fraction, 6),
                "numel": self.numel, "bucket": dict(self.bucket), "why": self.why}


@dataclass
class ReductionPrediction:
    """``reduction_order`` of the diff result (docs/reduction-order.md).

    ``verdict``: ``differs`` when any element is at risk, ``same`` when every differing
    reduce-scatter bucket was predicted and none is, ``unknown`` when nothing predicted is at
    risk but some bucket could not be predicted (``unpredicted`` says why)."""

    topology: Topology
    verdict: str
    at_risk: list[AtRisk] = field(default_factory=list)
    unpredicted: list[dict] = field(default_factory=list)  # {collective, a, b, reason}
    params_checked: int = 0  # parameters whose reduce-scatter layout differs
    rank: int | None = None  # the captured rank whose layouts were used
    source: str | None = None  # "model" | the NCCL log's path
    model: str = MODEL
    notes: list[str] = field(default_factory=list)  # what of an NCCL log could not be used

    def fqns(self) -> set[str]:
        """The parameters at risk (what an emulated run may show diverging)."""
        return {x.fqn for x in self.at_risk}

    def to_dict(self) -> dict:
        return {"topology": self.topology.to_dict(), "model": self.model,
                "topology_file": describe_file(self.topology),  # nccl-probe's agreement
                "limits": MODEL_LIMITS, "verdict": self.verdict,
                "at_risk": [x.to_dict() for x in self.at_risk],
                "elements_at_risk": sum(x.elements for x in self.at_risk),
                "params_checked": self.params_checked,
                "unpredicted": [dict(x) for x in self.unpredicted],
                "rank": self.rank, "source": self.source or "model", "notes": list(self.notes)}


# ---------------------------------------------------------------- per-rank layout at world W


class Slot(NamedTuple):
    """One payload of a bucket's per-rank row at the target world size (elements). A named
    tuple, not a dataclass: a prediction makes one per payload and side, and tuples are
    cheaper to build."""

    fqn: str
    offset: int  # element offset in the per-rank row
    rows: int  # dim-0 rows per rank (ceil(dim0 / W))
    row: int  # elements per dim-0 row
    dim0: int


def _dims(shape) -> tuple[int, int] | None:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
        return None
    if not shape:
        return 1, 1  # a 0-d gradient: one element, padded to one per rank
    return shape[0], math.prod(shape[1:])


def derive_layout(bucket: Bucket, shapes: dict[str, list[int]], world: int,
                  capture_world: int | None = None,
                  _dims_of: dict | None = None) -> tuple[list[Slot], int, int] | str:
    """A reduce-scatter bucket's per-rank row at ``world`` ranks: (slots, per-rank count,
    element size), or the reason it cannot be derived. With ``capture_world`` the model is first
    checked against the recorded offsets and sizes at that world size."""
    dtypes = {e.dtype for e in bucket.entries if e.dtype} | ({bucket.dtype} if bucket.dtype else set())
    if len(dtypes) != 1:
        return (f"payload dtypes {sorted(dtypes)} (mixed or unrecorded)" if dtypes
                else "no dtype recorded")
    dtype = dtypes.pop()
    esize = _ITEMSIZE.get(dtype)
    if esize is None:
        return f"dtype {dtype} not modelled"
    dims = []
    for e in bucket.entries:
        if _dims_of is None:
            d = _dims(shapes.get(e.fqn))
        else:  # predict's memo: each shape checked once, not once per bucket and side
            d = _dims_of.get(e.fqn, False)
            if d is False:
                d = _dims_of[e.fqn] = _dims(shapes.get(e.fqn))
        if d is None:
            return f"no global shape for {e.fqn}"
        dims.append(d)
    if capture_world:
        off = 0
        for e, (dim0, row) in zip(bucket.entries, dims):
            numel = -(-dim0 // capture_world) * row
            if (e.numel is not None and e.numel != numel) or (
                    e.offset is not None and e.offset != off * esize):
                return (f"{e.fqn}: recorded {e.numel} elements at byte {e.offset}, but dim-0 "
                        f"shards of {dim0}x{row} at {capture_world} ranks give {numel} at byte "
                        f"{off * esize} (not FSDP2 dim-0 shards with padding)")
            off += numel
    slots, off = [], 0
    for e, (dim0, row) in zip(bucket.entries, dims):
        rows = -(-dim0 // world)
        slots.append(Slot(e.fqn, off, rows, row, dim0))
        off += rows * row
    return slots, off, esize


# ------------------------------------------------------------------------------ sum orders


class _Orders:
    """Per ring, every owner's canonical sum order (W x W); per pair of rings, which owners'
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

    def differ(self, ra: tuple[int, ...], rb: tuple[int, ...]) -> tuple[list, list]:
        """(whether owner d's orders differ, per d; how many owners below d differ, d = 0..W)."""
        key = (id(ra), id(rb))  # rings are shared tuple objects (parity.nccl caches them)
        v = self._differ.get(key)
        if v is None:
            import numpy as np

            m = np.zeros(self.world, dtype=bool) if ra == rb else \
                ~(self.canon(ra) == self.canon(rb)).all(axis=1)
            v = (m.tolist(), [0, *np.cumsum(m).tolist()])
            self._differ[key] = self._differ[(id(rb), id(ra))] = v
            self._keep.append((ra, rb))  # the ids stay valid while this object lives
        return v


@dataclass
class _SideSlots:
    """One side's reduce-scatter slots, looked up by parameter, and each bucket's channels."""

    slots: dict[str, tuple[Slot, Bucket]]
    # bucket -> (channel starts, rings, per-rank count)
    channels: dict[int, tuple[list[int], list[tuple[int, ...]], int]]


def _channels(topo: Topology, count: int, esize: int
              ) -> tuple[list[int], list[tuple[int, ...]], int]:
    segs = reduce_scatter_segments(topo, count, esize)
    return [s.lo for s in segs], [s.order for s in segs], count


def _count_at_risk(pending: list, chan_a: dict, chan_b: dict, orders: "_Orders") -> np.ndarray:
    """Elements at risk for every parameter of ``pending`` at once (numpy, no per-parameter
    Python loop): entry k is (bucket A, bucket B, offset A, offset B, length, full, part), a
    payload of ``length`` elements per rank at per-rank offsets A and B, owners below ``full``
    holding whole shards and owner ``full`` holding ``part`` real elements. ``chan_*``: bucket
    -> (channel starts, rings, per-rank count).

    Each side's buckets are laid end to end on one axis (bucket ``b`` starts at ``base[b]``),
    so one ``searchsorted`` finds every channel boundary inside every payload; the payload is
    cut at both sides' boundaries into pieces within which each side's ring is constant, and a
    piece adds ``length x (owners below full whose sum order differs)`` plus its overlap with
    owner ``full``'s ``part`` when that owner's order differs."""
    import numpy as np

    k = len(pending)
    if not k:
        return np.zeros(0, dtype=np.int64)
    cols = np.array([p[2:] for p in pending], dtype=np.int64).reshape(k, 5)
    oa, ob, length, full, part = cols.T
    ring_ids: dict[int, int] = {}
    ring_objs: list = []
    memo: dict[int, list[int]] = {}

    def axis(chan: dict, buckets: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        base, los, rids, off = {}, [], [], 0
        for b in dict.fromkeys(buckets):
            starts, rings, count = chan[b]
            base[b] = off
            los.extend(off + x for x in starts)
            got = memo.get(id(rings))  # buckets of one size share one channel list
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
        return (np.array([base[b] for b in buckets], dtype=np.int64),
                np.array(los, dtype=np.int64), np.array(rids, dtype=np.int64))

    base_a, los_a, rid_a = axis(chan_a, [p[0] for p in pending])
    base_b, los_b, rid_b = axis(chan_b, [p[1] for p in pending])
    if not los_a.size or not los_b.size:  # only empty buckets: nothing to sum
        return np.zeros(k, dtype=np.int64)
    start_a, start_b = base_a + oa, base_b + ob
    # the cuts of each payload: 0, and each side's channel starts strictly inside it
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


def _reduce_counts(layout: Layout, eager: list[dict], shapes: dict) -> dict[str, int]:
    """fqn -> how many collectives reduce its gradient on this side (graph/FSDP2 buckets, plus
    eager DTensor reduce-scatters of it)."""
    out: dict[str, int] = {}
    for b in layout.buckets.get("reduce_scatter", []):
        for f in dict.fromkeys(b.fqns):  # in payload order: the JSON order is deterministic
            out[f] = layout.repeats.get(("reduce_scatter", f), 1)
    rs = [r for r in eager or [] if r.get("collective") == "reduce_scatter"]
    if rs:
        for f, shape in shapes.items():
            runs = eager_for(f, "x".join(str(s) for s in shape or []), rs)
            if runs:
                out[f] = out.get(f, 0) + sum(int(r.get("count") or 1) for r in runs)
    return out


def predict(layouts: dict[str, Layout], shapes: dict[str, list[int]], topology: Topology | str,
            capture_world: int | None = None, eager: dict[str, list[dict]] | None = None,
            source: str | None = None, _counts: tuple[dict, dict] | None = None
            ) -> ReductionPrediction:
    """The prediction for two sides' selected layouts (``{"a": Layout, "b": Layout}``, as
    ``parity.diff.buckets.compare_buckets`` returns them), the parameters' global shapes
    (params.json ``global_shape``), at ``topology`` (a Topology or ``NODESxGPUS[:channels=C]``).
    ``capture_world``: the captured world size, to check the derivation against the recorded
    layouts; ``eager``: ``order.eager`` (eager DTensor reduce-scatters count as collectives)."""
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    la, lb = layouts["a"], layouts["b"]
    pred = ReductionPrediction(topo, SAME, rank=la.rank, source=source)
    ba, bb = la.buckets.get("reduce_scatter", []), lb.buckets.get("reduce_scatter", [])
    eager = eager or {}
    if _counts is not None:  # assess computed them for the consequence classes already
        na, nb = _counts
    else:
        na = _reduce_counts(la, eager.get("a") or [], shapes)
        nb = _reduce_counts(lb, eager.get("b") or [], shapes)
    if not ba and not bb and not na and not nb:
        pred.unpredicted.append({"collective": "reduce_scatter", "a": None, "b": None,
                                 "reason": "no reduce-scatter layouts recorded"})
        pred.verdict = UNKNOWN
        return pred
    world = topo.world
    orders = _Orders(world)
    sides: dict[str, _SideSlots] = {}
    bad: dict[tuple[str, int], str] = {}
    split_of: dict[tuple[int, int], tuple] = {}  # (per-rank count, element size) -> channels
    dims_of: dict = {}
    # buckets that are the same on both sides (same payloads, order and dtype) cannot differ:
    # their parameters are skipped below, so their layouts are not derived
    same_bucket = {}
    names = {id(b): tuple(b.fqns) for b in (*ba, *bb)}  # each bucket's payloads, listed once
    by_fqns_b = {(names[id(b)], b.dtype): b.index for b in bb}
    for b in ba:
        j = by_fqns_b.get((names[id(b)], b.dtype))
        if j is not None:
            same_bucket[b.index] = j
    first_a: dict[str, int] = {}
    first_b: dict[str, int] = {}
    for b in ba:
        for f in names[id(b)]:
            first_a.setdefault(f, b.index)
    for b in bb:
        for f in names[id(b)]:
            first_b.setdefault(f, b.index)
    skip: dict[str, set] = {"a": set(), "b": set()}
    for b in ba:  # only where each payload's first bucket on both sides is this pair
        j = same_bucket.get(b.index)
        if j is not None and all(first_a[f] == b.index and first_b.get(f) == j
                                 for f in names[id(b)]):
            skip["a"].add(b.index)
            skip["b"].add(j)
    for key, buckets in (("a", ba), ("b", bb)):
        side = _SideSlots({}, {})
        for b in buckets:
            if b.index in skip[key]:
                for f in names[id(b)]:  # the bucket is known, its slot never asked for
                    side.slots.setdefault(f, (None, b))
                continue
            got = derive_layout(b, shapes, world, capture_world, dims_of)
            if isinstance(got, str):
                bad[(key, b.index)] = got
                for f in names[id(b)]:
                    side.slots.setdefault(f, (None, b))
                continue
            slots, count, esize = got
            if (count, esize) not in split_of:
                split_of[(count, esize)] = _channels(topo, count, esize)
            side.channels[b.index] = split_of[(count, esize)]
            for s in slots:
                side.slots.setdefault(s.fqn, (s, b))
        sides[key] = side
    said_bad: set = set()
    pending: list[tuple[int, int, int, int, int, int, int]] = []
    for f in dict.fromkeys([*na, *nb]):
        sa, sb = sides["a"].slots.get(f), sides["b"].slots.get(f)
        ia = sa[1].index if sa else None
        ib = sb[1].index if sb else None
        if ia is not None and same_bucket.get(ia) == ib and ib is not None \
                and na.get(f) == nb.get(f):
            continue
        where = {"collective": "reduce_scatter", "a": ia, "b": ib}
        pred.params_checked += 1
        dims = dims_of[f] if f in dims_of else _dims(shapes.get(f))
        numel = dims[0] * dims[1] if dims else 0
        if na.get(f, 0) != nb.get(f, 0):
            pred.at_risk.append(AtRisk(f, numel, numel, where, "structure"))
            continue
        if sa is None or sb is None:
            continue  # reduced by eager collectives alike on both sides: not modelled here
        if sa[1].dtype != sb[1].dtype:
            pred.at_risk.append(AtRisk(f, numel, numel, where, "dtype"))
            continue
        why = bad.get(("a", ia)) or bad.get(("b", ib))
        if why is not None or sa[0] is None or sb[0] is None:
            k = (ia, ib)
            if k not in said_bad:
                said_bad.add(k)
                pred.unpredicted.append({**where, "reason": why or "layout not derived"})
            continue
        slot_a, slot_b = sa[0], sb[0]
        if (slot_a.rows, slot_a.row) != (slot_b.rows, slot_b.row):
            pred.at_risk.append(AtRisk(f, numel, numel, where, "structure"))
            continue
        length = slot_a.rows * slot_a.row
        # owners 0..full-1 hold whole shards (length elements), owner ``full`` holds ``part``
        # real elements, the rest only padding
        full = min(world, slot_a.dim0 // slot_a.rows) if slot_a.rows else 0
        part = (slot_a.dim0 - full * slot_a.rows) * slot_a.row if full < world else 0
        pending.append((ia, ib, slot_a.offset, slot_b.offset, length, full, part))
        pred.at_risk.append((f, numel, where))  # counted below, kept if any element is at risk
    if pending:
        counts = iter(_count_at_risk(pending, sides["a"].channels, sides["b"].channels,
                                     orders).tolist())
        kept = []
        for x in pred.at_risk:
            if type(x) is tuple:
                n = next(counts)
                if not n:
                    continue
                x = AtRisk(x[0], n, x[1], x[2], "order")
            kept.append(x)
        pred.at_risk = kept
    if pred.at_risk:
        pred.verdict = DIFFERS
    elif pred.unpredicted:
        pred.verdict = UNKNOWN
    return pred


def topology_of(at: str | None, nccl_log: str | None) -> tuple[Topology | None, list[str]]:
    """``--at`` / ``--nccl-log`` -> the topology to predict at (None: neither) and notes on what
    of the log could not be used. Bad input raises a one-line ParityError (exit 2)."""
    topo = parse_topology(at) if at else None
    if nccl_log:
        from parity.nccl import parse_nccl_log

        return parse_nccl_log(nccl_log, topo)
    return topo, []


def shapes_of(params: list[dict]) -> dict[str, list[int]]:
    """fqn -> global shape from a rank's params.json table (``global_shape``, else ``shape``)."""
    out = {}
    for p in params or []:
        f = p.get("fqn")
        shape = p.get("global_shape") or p.get("shape")
        if isinstance(f, str) and isinstance(shape, list):
            out.setdefault(f.split("#", 1)[0], shape)
    return out


def predict_runs(a_dir: str | Path, b_dir: str | Path, topology: Topology | str
                 ) -> ReductionPrediction:
    """The prediction for two run directories from their manifests and parameter tables alone
    (no hash comparison; ``parity diff --at`` gives the same ``reduction_order``)."""
    from parity.artifacts import read_run
    from parity.diff.buckets import compare_buckets

    run_a, run_b = read_run(a_dir), read_run(b_dir)
    usable = {side: sorted(r for r, rd in run.ranks.items() if rd.params)
              for side, run in (("a", run_a), ("b", run_b))}
    ranks = sorted(set(usable["a"]) & set(usable["b"]))
    layouts, order = compare_buckets(run_a, run_b, usable, ranks)
    world = run_a.world_size or (max(run_a.ranks) + 1 if run_a.ranks else None)
    return assess(run_a, run_b, ranks, layouts, order, world, topology)


# ------------------------------------------------------------------- the diff engine's entry


def annotate(order, layouts: dict[str, Layout], shapes: dict[str, list[int]],
             _counts: tuple[dict, dict] | None = None) -> None:
    """Consequence classes on the order comparison (parity.consequences): a reduce-scatter
    group carrying a gradient that the two sides reduce with a different number of collectives
    becomes ``reduction_structure``; ``order.structure`` lists such gradients and
    ``order.consequences`` counts the differing groups per class."""
    from parity import consequences as cq

    if _counts is not None:  # assess's: computed once for this and the prediction
        na, nb = _counts
    else:
        na = _reduce_counts(layouts["a"], order.eager.get("a") or [], shapes)
        nb = _reduce_counts(layouts["b"], order.eager.get("b") or [], shapes)
    order.structure = [{"fqn": f, "a": na.get(f, 0), "b": nb.get(f, 0)}
                       for f in dict.fromkeys([*na, *nb]) if na.get(f, 0) != nb.get(f, 0)]
    odd = {x["fqn"] for x in order.structure}
    counts: dict[str, int] = {}
    for p in order.pairs:
        if p.verdict == "identical":
            continue
        fqns = {m["fqn"] for m in p.moved} | {e["fqn"] for e in (p.a_entry, p.b_entry) if e}
        structure = bool(odd) and p.collective in cq.REDUCING and bool(fqns & odd)
        p.consequence = cq.classify(p.collective, p.verdict, structure)
        counts[p.consequence] = counts.get(p.consequence, 0) + 1
    if odd and not any(p.consequence == cq.REDUCTION_STRUCTURE for p in order.pairs):
        counts[cq.REDUCTION_STRUCTURE] = counts.get(cq.REDUCTION_STRUCTURE, 0) + 1
    order.consequences = counts
    fb = order.first_bucket
    if isinstance(fb, dict) and fb.get("collective"):
        lead = next((p for p in order.pairs if p.verdict != "identical"
                     and p.collective == fb["collective"] and fb.get("index") in p.a
                     and p.verdict == fb.get("verdict")), None)
        if lead is not None:
            fb["consequence"] = lead.consequence


def assess(run_a, run_b, ranks: list[int], layouts: dict[str, Layout], order, world: int | None,
           at: Topology | str | None, source: str | None = None) -> ReductionPrediction | None:
    """Called by the diff engine: consequence classes always, the prediction when ``at``."""
    shapes: dict[str, list[int]] = {}
    # the table is decoded only where shapes are needed (a prediction, or eager DTensor
    # reduce-scatters to attribute): a diff of equal runs parses no more than it must (issue 23)
    if at is not None or order.eager.get("a") or order.eager.get("b"):
        ref = layouts["a"].rank if layouts["a"].rank in run_a.ranks else (ranks[0] if ranks else None)
        shapes = shapes_of(run_a.ranks[ref].params) if ref in run_a.ranks else {}
        refb = layouts["b"].rank if layouts["b"].rank in run_b.ranks else ref
        rda = run_a.ranks.get(ref)
        # B's table adds shapes only where it is not A's: the same bytes (digest) that decoded
        # on A are not decoded twice
        digest = rda.table_digest if rda is not None and len(rda.params) == rda.n_params else None
        if refb in run_b.ranks and (digest is None or run_b.ranks[refb].table_digest != digest):
            for f, s in shapes_of(run_b.ranks[refb].params).items():
                shapes.setdefault(f, s)
    counts = (_reduce_counts(layouts["a"], order.eager.get("a") or [], shapes),
              _reduce_counts(layouts["b"], order.eager.get("b") or [], shapes))
    annotate(order, layouts, shapes, counts)
    if at is None:
        return None
    return predict(layouts, shapes, at, world, order.eager, source, _counts=counts)
