"""The NCCL Ring model (parity/nccl_model.py): pure logic, checked against hand-derived cases
from the NCCL sources it cites."""

import pytest

from parity.errors import ParityError
from parity.nccl import (
    Topology, all_reduce_segments, canonical_order, channel_count, channel_split,
    orders_differ, parse_topology, reduce_scatter_segments, rings, same_sum, sum_order,
)


def test_parse_round_trip_and_errors():
    t = parse_topology("32x8:channels=16")
    assert (t.nodes, t.gpus, t.world, t.channels) == (32, 8, 256, 16)
    assert parse_topology(t.spec()) == t
    assert Topology.from_dict(t.to_dict()) == t
    assert parse_topology("2x2:channels=4,proto=LL").protocol == "LL"
    for bad in ("8", "0x8", "2x2:chan=3", "2x2:channels=0", "2x2:proto=XYZ", "axb"):
        with pytest.raises(ParityError):
            parse_topology(bad)


def test_sum_order_follows_the_ring_from_the_owners_successor():
    assert sum_order((0, 1, 2, 3), 0) == (1, 2, 3, 0)
    assert sum_order((1, 0, 3, 2), 0) == (3, 2, 1, 0)
    # the first addition commutes
    assert same_sum((1, 2, 3, 0), (2, 1, 3, 0))
    assert not same_sum((1, 2, 3, 0), (1, 3, 2, 0))
    assert canonical_order((5,)) == (5,)


def test_rings_one_node_share_one_order_and_nodes_rotate_per_channel():
    assert set(rings(parse_topology("1x8"), 4)) == {tuple(range(8))}
    assert rings(parse_topology("2x2"), 2) == [(0, 1, 2, 3), (1, 0, 3, 2)]
    assert not orders_differ(parse_topology("1x8"))
    assert not orders_differ(parse_topology("2x1"))  # two ranks: a + b == b + a
    assert orders_differ(parse_topology("2x2"))
    assert orders_differ(parse_topology("8x8"))


@pytest.mark.parametrize("count,elem,nranks,nch", [
    (1, 4, 4, 4), (4096, 4, 4, 4), (4097, 2, 4, 3), (10_000_000, 2, 64, 16), (333, 4, 8, 64)])
def test_channel_split_covers_the_count_contiguously(count, elem, nranks, nch):
    split = channel_split(count, elem, nranks, nch)
    assert split[0][0] == 0 and split[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
    assert all(lo < hi for lo, hi in split)
    assert len(split) <= nch


def test_forced_channels_cut_into_whole_cells():
    # 2x2, 4 channels, fp32: cell = 16 KiB / 4 ranks = 4 KiB = 1024 elements
    segs = reduce_scatter_segments(parse_topology("2x2:channels=4"), 4096, 4)
    assert [(s.lo, s.hi, s.channel) for s in segs] == [
        (0, 1024, 0), (1024, 2048, 1), (2048, 3072, 2), (3072, 4096, 3)]


def test_small_messages_get_fewer_channels():
    t = parse_topology("8x8")
    assert channel_count(t, 4 * 1000 * 64) == 1
    assert channel_count(t, 4 * 10_000_000 * 64) == 16


def test_all_reduce_chunks_cover_the_buffer_once():
    segs = all_reduce_segments(parse_topology("2x2:channels=2"), 10_000, 4)
    covered = sorted((s.lo, s.hi) for s in segs)
    assert covered[0][0] == 0 and covered[-1][1] == 10_000
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for s in segs:
        assert s.order[-1] == s.owner and sorted(s.order) == [0, 1, 2, 3]
