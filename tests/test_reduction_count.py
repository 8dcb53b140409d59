"""The count behind ``parity diff --at`` (parity/diff/reduction.py, reduction_count.py) against a
straightforward one: every scenario combination, every parameter, every owner, element by
element, no shortcuts. The optimized count orders combinations, skips payloads already
saturated, stops when every payload is, shares channel maps and compares rings in O(n); the
answer (elements at risk per parameter, the worst scenario) must be the same, on random
layouts, sizes and topologies, saturated or not."""

import random

import numpy as np
import pytest

from parity.diff.buckets import Bucket, Entry, Layout
from parity.diff.reduction import derive_layout, plans, predict
from parity.diff.reduction_count import ChunkOrders, Orders
from parity.nccl import parse_topology, same_sum, sum_order

CAPTURE = 4


def test_ring_comparison_in_linear_time_equals_comparing_every_owners_order():
    rng = random.Random(7)
    for n in range(1, 10):
        orders = Orders(n)
        for _ in range(300):
            a = list(range(n))
            rng.shuffle(a)
            b = list(a)
            how = rng.randrange(4)
            if how == 0 and n > 1:  # one adjacent swap: some owners keep their sum
                i = rng.randrange(n)
                b[i], b[(i + 1) % n] = b[(i + 1) % n], b[i]
            elif how == 1:  # the same cycle, written from another rank
                k = rng.randrange(n)
                b = b[k:] + b[:k]
            elif how == 2 and n > 1:
                i = rng.randrange(n)
                b[i], b[(i + 1) % n] = b[(i + 1) % n], b[i]
                k = rng.randrange(n)
                b = b[k:] + b[:k]
            else:
                rng.shuffle(b)
            a, b = tuple(a), tuple(b)
            want = [not same_sum(sum_order(a, d), sum_order(b, d)) for d in range(n)]
            assert orders.mask(a, b).tolist() == want, (a, b)
    chunks = ChunkOrders(4)
    assert chunks.mask((1, 2, 3, 0), (2, 1, 3, 0)).tolist() == [False] * 4
    assert chunks.mask((1, 2, 3, 0), (1, 3, 2, 0)).tolist() == [True] * 4


# ------------------------------------------------------------------- the straightforward count


def _clusters(tuples):
    """Every scenario joined to the first cluster it fits (communicator channels, a family in
    common, rings that agree as far as both go; the longest rings kept)."""
    out = []
    for ps in tuples:
        for p in ps:
            for c in out:
                if p.fits(c):
                    if len(p.rings) > len(c[2]):
                        c[2] = p.rings
                    break
            else:
                out.append([p.comm_channels, set(p.family.split("+")), p.rings])
    return out


def _reference(layouts, shapes, topo, all_reduce=None, env=()):
    """(collective, fqn) -> elements at risk, the worst over every scenario combination, counted element by
    element for every owner. Only parameters both sides hold in derived buckets with slots of
    one shape (what the optimized count counts; structure and dtype are decided elsewhere)."""
    side = {}
    order_of = {}
    for s in ("a", "b"):
        colls = []
        for kind, bs in (("reduce_scatter", layouts[s].buckets["reduce_scatter"]),
                         ("all_reduce", (all_reduce or {}).get(s, []))):
            for b in bs:
                n, owners = (topo.world, topo.world) if kind == "reduce_scatter" else (1, 1)
                got = derive_layout(b, shapes, n, CAPTURE if kind == "reduce_scatter" else 1)
                if isinstance(got, str):
                    continue
                slots, count, esize = got
                ps = plans(topo, kind, count, esize, getattr(b, "op", None) or "sum", env)
                colls.append((kind, slots, ps, count, esize, owners))
        side[s] = colls
    tuples, seen = [], set()
    for s in ("a", "b"):
        for c in side[s]:
            if isinstance(c[2], tuple) and id(c[2]) not in seen:
                seen.add(id(c[2]))
                tuples.append(c[2])
    clusters = _clusters(tuples)
    out = {}
    for kind in ("reduce_scatter", "all_reduce"):
        where = {}
        for s in ("a", "b"):
            for c in side[s]:
                if c[0] == kind:
                    for x in c[1]:
                        where.setdefault((s, x.fqn), (x, c))
        for (s, f), (xa, ca) in where.items():
            if s != "a" or ("b", f) not in where:
                continue
            xb, cb = where[("b", f)]
            if isinstance(ca[2], str) or isinstance(cb[2], str):
                continue
            if (xa.rows, xa.row) != (xb.rows, xb.row) or ca[5] != cb[5]:
                continue
            n = ca[5]
            same_size = (ca[3], ca[4]) == (cb[3], cb[4])
            worst = 0
            for cl in clusters:
                for pa in ca[2]:
                    if not pa.fits(cl) or pa is not next(p for p in ca[2] if p.fits(cl)
                                                         and p.protocol == pa.protocol):
                        continue
                    for pb in cb[2]:
                        if not pb.fits(cl) or pb is not next(p for p in cb[2] if p.fits(cl)
                                                             and p.protocol == pb.protocol):
                            continue
                        if same_size and pa.protocol != pb.protocol:
                            continue
                        # per element of the shard: the range (so the order) each side
                        # sums it in; per owner, its real elements whose orders differ
                        at = np.arange(xa.rows * xa.row)
                        ia = np.searchsorted(pa.starts, xa.offset + at, "right") - 1
                        ib = np.searchsorted(pb.starts, xb.offset + at, "right") - 1
                        total = 0
                        for d in range(n):
                            real = max(0, min(xa.rows, xa.dim0 - d * xa.rows)) * xa.row
                            both, times = np.unique(ia[:real] * len(pb.orders) + ib[:real],
                                                    return_counts=True)
                            for key, k in zip(both.tolist(), times.tolist()):
                                oa = pa.orders[key // len(pb.orders)]
                                ob = pb.orders[key % len(pb.orders)]
                                memo = (kind, oa, ob, d)
                                if memo not in order_of:
                                    order_of[memo] = (
                                        not same_sum(sum_order(oa, d), sum_order(ob, d))
                                        if kind == "reduce_scatter" else not same_sum(oa, ob))
                                total += k * order_of[memo]
                        worst = max(worst, total)
            if worst:
                out[(kind, f)] = worst
    return out


def _counted(pred):
    return {(x.bucket["collective"], x.fqn): x.elements for x in pred.at_risk if x.why == "order"}


# ------------------------------------------------------------------------------ random cases


TOPOLOGIES = ["2x2", "2x2:channels=4", "4x2:channels=3", "2x4", "3x2:channels=2", "2x4:nics=2",
              "2x2:nccl=2.21,channels=4", "2x2:nccl=2.22,channels=8", "2x4:proto=LL128",
              "4x2:nccl=2.29,channels=5", "2x3:proto=LL,channels=6", "2x2:algo=Ring,channels=4"]


def _bucket(index, fqns, shapes, world, kind="reduce_scatter"):
    entries, off = [], 0
    for f in fqns:
        dim0, row = shapes[f][0], (shapes[f][1] if len(shapes[f]) > 1 else 1)
        n = (-(-dim0 // world) if kind == "reduce_scatter" else dim0) * row
        entries.append(Entry(f, off * 4, n * 4, n, "float32"))
        off += n
    return Bucket(kind, index, "g", "float32", off * 4, entries)


def _random_case(rng):
    nparams = rng.randint(2, 7)
    shapes = {}
    for i in range(nparams):
        big = rng.random() < 0.5
        dim0 = rng.randint(200, 3000) if big else rng.randint(1, 60)
        shapes[f"p{i}"] = [dim0, rng.randint(1, 6)] if rng.random() < 0.8 else [dim0]
    names = list(shapes)

    def partition(order):
        cuts = sorted(rng.sample(range(1, len(order)), rng.randint(0, min(2, len(order) - 1))))
        return [order[i:j] for i, j in zip([0, *cuts], [*cuts, len(order)])]

    a = partition(names)
    how = rng.randrange(4)
    if how == 0:  # reversed payloads in every bucket (saturates where channels differ)
        b = [list(reversed(x)) for x in a]
    elif how == 1:  # one pair of payloads swapped (often inside one channel: not saturated)
        b = [list(x) for x in a]
        x = rng.choice(b)
        if len(x) > 1:
            i = rng.randrange(len(x) - 1)
            x[i], x[i + 1] = x[i + 1], x[i]
    elif how == 2:  # the same buckets, one kept equal (skipped)
        b = [list(reversed(x)) if k else list(x) for k, x in enumerate(a)]
    else:  # another partition of another order
        order = list(names)
        rng.shuffle(order)
        b = partition(order)
    lay = {"a": Layout("fsdp2", 0, {"all_gather": [], "reduce_scatter": [
        _bucket(i, x, shapes, CAPTURE) for i, x in enumerate(a)]}),
           "b": Layout("graph", 0, {"all_gather": [], "reduce_scatter": [
               _bucket(i, x, shapes, CAPTURE) for i, x in enumerate(b)]})}
    for s in ("a", "b"):
        for bk in lay[s].buckets["reduce_scatter"]:
            bk.op = "avg"  # eager FSDP2's, and SimpleFSDP's Partial("avg")
    ar = None
    if rng.random() < 0.3:  # a flat all-reduce of whole gradients in two orders
        order = list(names)
        rng.shuffle(order)
        ar = {"a": [_bucket(0, names, shapes, 1, "all_reduce")],
              "b": [_bucket(0, order, shapes, 1, "all_reduce")]}
        for s in ("a", "b"):
            ar[s][0].op, ar[s][0].group_size = "sum", CAPTURE
    return shapes, lay, ar


@pytest.mark.parametrize("seed", range(6))
def test_the_optimized_count_equals_the_straightforward_count(seed):
    rng = random.Random(seed)
    kinds = {"saturated": 0, "partial": 0, "none": 0}
    for case in range(25):
        shapes, lay, ar = _random_case(rng)
        topo = parse_topology(rng.choice(TOPOLOGIES))
        got = predict(lay, shapes, topo, capture_world=CAPTURE, all_reduce=ar)
        assert _counted(got) == _reference(lay, shapes, topo, all_reduce=ar), (
            seed, case, topo.spec(), lay, ar)
        counted = {f for _, f in _counted(got)}
        for x in got.at_risk:
            if x.why == "order":
                kinds["saturated" if x.elements == x.numel else "partial"] += 1
        kinds["none"] += sum(1 for f in shapes if f not in counted)
    # the cases cover both sides of the saturation shortcut
    assert kinds["saturated"] and kinds["partial"] and kinds["none"], kinds


def test_counting_stops_at_saturation_and_skips_saturated_payloads(monkeypatch):
    """Every payload saturated after the first combination: one pass, not one per scenario;
    a payload saturated early is not counted again."""
    from parity.diff import reduction_count

    shapes = {f"p{i}": [4096 + 37 * i, 3] for i in range(8)}
    names = list(shapes)
    lay = {"a": Layout("fsdp2", 0, {"all_gather": [], "reduce_scatter": [
        _bucket(0, names, shapes, CAPTURE)]}),
           "b": Layout("graph", 0, {"all_gather": [], "reduce_scatter": [
               _bucket(0, list(reversed(names)), shapes, CAPTURE)]})}
    lay["b"].buckets["reduce_scatter"][0].op = "avg"
    calls = []
    real = reduction_count.RiskCount.count

    def spy(self, idx, maps_a, maps_b):
        calls.append(idx.size)
        return real(self, idx, maps_a, maps_b)

    monkeypatch.setattr(reduction_count.RiskCount, "count", spy)
    topo = parse_topology("32x8:channels=16")
    got = predict(lay, shapes, topo, capture_world=CAPTURE)
    assert got.verdict == "differs"
    assert _counted(got) == _reference(lay, shapes, topo)
    scenarios = len(plans(topo, "reduce_scatter", sum(-(-s[0] // 256) * s[1]
                                                      for s in shapes.values()), 4, "avg"))
    assert scenarios > 1 and len(calls) < scenarios
    assert all(x.elements == x.numel for x in got.at_risk)  # saturated
    assert calls and all(b <= a for a, b in zip(calls, calls[1:]))


def test_one_pass_counts_only_what_its_scenarios_cover():
    """A payload whose collective has no scenario of a protocol on a cluster is not counted
    in that combination (it is not what the cluster runs), and an empty payload counts 0."""
    shapes = {"w": [5000, 4], "e": [0, 4], "v": [3000, 2]}
    lay = {"a": Layout("fsdp2", 0, {"all_gather": [], "reduce_scatter": [
        _bucket(0, ["w", "e", "v"], shapes, CAPTURE)]}),
           "b": Layout("graph", 0, {"all_gather": [], "reduce_scatter": [
               _bucket(0, ["v"], shapes, CAPTURE), _bucket(1, ["e", "w"], shapes, CAPTURE)]})}
    for bk in lay["b"].buckets["reduce_scatter"]:
        bk.op = "avg"
    for spec in TOPOLOGIES:
        topo = parse_topology(spec)
        got = predict(lay, shapes, topo, capture_world=CAPTURE)
        counted = _counted(got)
        assert counted == _reference(lay, shapes, topo), spec
        assert ("reduce_scatter", "e") not in counted
        assert np.all([x.elements <= x.numel for x in got.at_risk])
