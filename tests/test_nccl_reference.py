"""The model (parity.nccl.predict) against an independent simulator of NCCL's Ring loops
(tests/nccl_reference.py), on seeded random cases per release family: sizes 1 KB - 64 MB,
fp32/bf16, 4-256 ranks, Simple/LL/LL128, reduce-scatter and all-reduce, random rings and
communicator channel counts. Channel ranges must agree exactly; element orders are compared at
every channel boundary and at random elements."""

import math
import random

import pytest

from parity.nccl import Topology, predict, sum_order

from tests import nccl_reference as ref

# one release per family, and the releases where a rule inside a family changes
FAMILIES = {20: 150, 21: 1000, 22: 1000, 23: 300, 25: 300, 27: 1000, 28: 300, 29: 1000, 30: 300}


def _case(rng: random.Random, minor: int):
    n = int(round(math.exp(rng.uniform(math.log(4), math.log(256)))))
    es = rng.choice((2, 4))
    proto = rng.choice(("Simple", "LL", "LL128"))
    kind = rng.choice(("reduce_scatter", "all_reduce"))
    total = int(math.exp(rng.uniform(math.log(1 << 10), math.log(64 << 20))))
    count = max(1, total // es // (n if kind == "reduce_scatter" else 1))
    max_ch = 32 if minor <= 24 else 64
    comm = rng.choice((1, 2, 4, 8, 16, 24, 32, rng.randint(1, max_ch)))
    comm = min(comm, max_ch)
    pool = []  # a few distinct random rings, assigned to channels at random
    for _ in range(3):
        base = list(range(n))
        rng.shuffle(base)
        pool.append(tuple(base))
    ring_list = [rng.choice(pool) for _ in range(comm)]
    return n, es, proto, kind, count, comm, ring_list


def _compare(minor, n, es, proto, kind, count, comm, ring_list, rng, orders=True):
    topo = Topology(n, 1, rings=tuple(ring_list), algorithm="Ring", nccl=f"2.{minor}")
    p = predict(topo, kind, count, es, protocol=proto, op="avg")
    (s,) = p.scenarios
    func = "ReduceScatter" if kind == "reduce_scatter" else "AllReduce"
    rcomm, work, task = ref.run(minor, func, count, es, proto, n, comm, [list(r) for r in ring_list])
    parts = ref.channel_parts(rcomm, work, task)
    assert s.ranges() == parts, (minor, n, es, proto, kind, count, comm)
    if not orders:
        return
    edges = rng.sample(parts, min(3, len(parts)))
    probes = {lo for _, lo, _ in edges} | {hi - 1 for _, _, hi in edges}
    probes |= {rng.randrange(count) for _ in range(2)}
    segs = sorted(s.segments, key=lambda g: g.lo)
    starts = [g.lo for g in segs]
    import bisect
    for e in sorted(probes):
        g = segs[bisect.bisect_right(starts, e) - 1]
        assert g.lo <= e < g.hi
        dest = rng.randrange(n)
        c, order = ref.element_order(rcomm, work, task, e, dest)
        model = sum_order(g.order, dest) if kind == "reduce_scatter" else g.order
        assert (g.channel, tuple(model)) == (c, tuple(order)), (minor, kind, proto, n, count, e)


@pytest.mark.parametrize("minor", sorted(FAMILIES))
def test_model_agrees_with_the_reference_simulator(minor):
    rng = random.Random(30_000 + minor)
    for i in range(FAMILIES[minor]):
        _compare(minor, *_case(rng, minor), rng, orders=i % 3 == 0)


def test_the_reference_catches_a_wrong_rule():
    """The comparison has teeth: the 2.23-2.28 rule against the 2.29 reference disagrees on a
    good share of cases (32 KiB cells and rounded traffic per channel: 137 of 400 with this
    generator, docs/reduction-order.md)."""
    rng = random.Random(7)
    bad = 0
    for _ in range(200):
        n, es, proto, kind, count, comm, rings = _case(rng, 29)
        topo = Topology(n, 1, rings=tuple(rings), algorithm="Ring", nccl="2.28")
        (s,) = predict(topo, kind, count, es, protocol=proto, op="avg").scenarios
        rcomm, work, task = ref.run(29, "ReduceScatter" if kind == "reduce_scatter" else
                                    "AllReduce", count, es, proto, n, comm, [list(r) for r in rings])
        bad += s.ranges() != ref.channel_parts(rcomm, work, task)
    assert bad > 40
