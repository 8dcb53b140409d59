"""The NCCL model (parity/nccl/): pure logic, each case derived by hand from the NCCL source it
cites (tags v2.20.5-1 ... v2.30.7-1). The randomized comparison with an independent Ring
simulator is tests/test_nccl_reference.py."""

import json

import pytest

from parity.errors import ParityError
from parity.nccl import (LL, LL128, SIMPLE, Topology, Unknown, all_reduce_segments,
                         canonical_order, channel_count, channel_cut, load_topology,
                         orders_differ, parse_topology, predict, primary_scenario,
                         reduce_scatter_segments, ring_index, rings, rules_for, same_sum,
                         save_topology, sum_order)
from parity.nccl.channels import Task, plan_split, thread_count
from parity.nccl.chunking import chunk_bytes


def test_parse_round_trip_and_errors(tmp_path):
    t = parse_topology("32x8:channels=16,nics=4,proto=LL128,nccl=2.27.5,algo=Ring")
    assert (t.nodes, t.gpus, t.world, t.channels, t.nics) == (32, 8, 256, 16, 4)
    assert (t.protocol, t.nccl, t.algorithm) == (LL128, "2.27.5", "Ring")
    assert parse_topology(t.spec()) == t
    assert Topology.from_dict(t.to_dict()) == t
    assert parse_topology("8x8").protocol is None  # every protocol NCCL may choose
    for bad in ("8", "0x8", "2x2:chan=3", "2x2:channels=0", "2x2:channels=65", "2x2:proto=XYZ",
                "axb", "2x2:nccl=two", "2x2:algo=Tree", "2x2:nics=0"):
        with pytest.raises(ParityError) as e:
            parse_topology(bad)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    # a topology file: written atomically, loaded by path, its spec is the path
    path = tmp_path / "topology.json"
    save_topology(parse_topology("2x2:channels=4"), path, {"agreement": 1.0})
    loaded = parse_topology(str(path))
    assert (loaded.nodes, loaded.channels, loaded.source) == (2, 4, str(path))
    assert loaded.spec() == str(path) and parse_topology(loaded.spec()) == loaded
    assert json.loads(path.read_text())["agreement"] == 1.0
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ParityError):
        load_topology(tmp_path / "bad.json")


def test_rules_per_release():
    assert rules_for("2.19.4") is None and rules_for("2.31") is None
    assert rules_for(None).version == "2.30"
    fam = {v: rules_for(v).family for v in ("2.20", "2.21.5", "2.22.3-1", "2.23", "2.28.9",
                                             "2.29.2", "2.30.7+cuda12.9")}
    assert fam == {"2.20": "2.20-2.21", "2.21.5": "2.20-2.21", "2.22.3-1": "2.22",
                   "2.23": "2.23-2.28", "2.28.9": "2.23-2.28", "2.29.2": "2.29-2.30",
                   "2.30.7+cuda12.9": "2.29-2.30"}
    assert [rules_for(v).ll_traffic_x4 for v in ("2.25", "2.26")] == [False, True]
    assert [rules_for(v).max_channels for v in ("2.24", "2.25")] == [32, 64]
    assert [rules_for(v).odd_swap for v in ("2.20", "2.21", "2.26", "2.28")] == [
        "even-nodes", "crossnic", "crossnic2", "per-rank"]
    u = predict("2x2:nccl=2.19", "reduce_scatter", 4096, 4)
    assert isinstance(u, Unknown) and u.cause == "version"


def test_sum_order_follows_the_ring_from_the_owners_successor():
    assert sum_order((0, 1, 2, 3), 0) == (1, 2, 3, 0)
    assert sum_order((1, 0, 3, 2), 0) == (3, 2, 1, 0)
    assert same_sum((1, 2, 3, 0), (2, 1, 3, 0))  # the first addition commutes
    assert not same_sum((1, 2, 3, 0), (1, 3, 2, 0))
    assert canonical_order((5,)) == (5,)


def test_channel_cut_thresholds_and_threads():
    """topoGetAlgoInfo: while (nBytes < nc*nt*threadThreshold) nc--; Simple 512 x 64, LL128
    640 x 8, LL 512 x 8 x nRanks (only Ring LL scales with nRanks)."""
    kb = 1 << 10
    assert channel_cut(100 * kb, 16, SIMPLE, 64) == 3  # 102400 // 32768
    assert channel_cut(256 * kb, 16, SIMPLE, 64) == 8
    assert channel_cut(1 << 20, 16, SIMPLE, 64) == 16
    assert channel_cut(20 * kb, 16, LL128, 64) == 4  # 20480 // 5120
    assert channel_cut(100 * kb, 16, LL128, 64) == 16
    assert channel_cut(1 << 20, 16, LL, 64) == 4  # 8 x 64 x 512 = 256 KiB per channel
    assert channel_cut(10, 16, SIMPLE, 64) == 1
    assert channel_cut(1 << 20, 16, SIMPLE, 64, nthreads=256) == 16
    # the thread count (2.20-2.21 alignment): halve while small, +1 warp for Ring Simple
    assert thread_count(1 << 30, 16, SIMPLE, 8) == 544
    assert thread_count(1 << 30, 16, LL128, 8) == 640
    assert thread_count(1, 1, LL128, 8) == 320
    assert thread_count(1, 1, LL, 8) == 96
    assert channel_count(parse_topology("8x8:channels=16"), 100 * kb) == 3


def test_split_families_on_one_case():
    """One reduce-scatter of 100,000 fp32 per rank at 8 ranks, 4 channels: each family's split
    (scheduleCollTasksToPlan / addCBDCollToPlan), checked by hand."""
    def split(v, proto=SIMPLE, comm=4, nc=4, count=100_000, kind="reduce_scatter", es=4, n=8):
        task = Task(kind, count, es, proto, nc, thread_count(count * es * n, nc, proto, n))
        return [(c, lo, hi) for c, lo, hi in plan_split([task], comm, n, rules_for(v))[0]]

    # 2.23-2.28: cell = 16K/8 = 2048 B = 512 elements; 196 cells; 49 per channel (800,000 B)
    got = split("2.27")
    assert [hi - lo for _, lo, hi in got] == [25088, 25088, 25088, 24736]
    # 2.29-2.30: 32K traffic -> cell 4096 B = 1024 elements; 98 cells; 25 per channel
    assert [hi - lo for _, lo, hi in split("2.29")] == [25600, 25600, 25600, 23200]
    # 2.22: 16 B cells (4 elements), 25000 cells, 6250 per channel
    assert [hi - lo for _, lo, hi in split("2.22")] == [25000] * 4
    # 2.20-2.21: 400,000 B / 4 channels = 100,000 B, rounded to 4096 B: 25,600 elements
    assert [hi - lo for _, lo, hi in split("2.21")] == [25600, 25600, 25600, 23200]
    # LL counts 4x the traffic from 2.26 (cells of 512 B instead of 2048 B)
    assert split("2.25", LL, count=3000) == split("2.25", SIMPLE, count=3000)
    assert [hi - lo for _, lo, hi in split("2.26", SIMPLE, count=3000)] == [1024, 1024, 952]
    assert [hi - lo for _, lo, hi in split("2.26", LL, count=3000)] == [768, 768, 768, 696]


def test_a_plan_fills_channels_in_turn_and_the_last_takes_the_rest():
    """scheduleCollTasksToPlan over three 100,000-fp32 reduce-scatters at 8 ranks on a
    2-channel communicator: traffic per channel 4.8 MB; the first task fits channel 0 (its
    padded 196 cells count, 3,211,264 B), the second takes 97 cells of what is left there and
    spills onto channel 1, the third lands whole on channel 1: the last channel takes
    everything (``channelId+1 == nMaxChannels``, the communicator's count)."""
    tasks = [Task("reduce_scatter", 100_000, 4, SIMPLE, 2) for _ in range(3)]
    assert plan_split(tasks, 2, 8, rules_for("2.27")) == [
        ((0, 0, 100_000),), ((0, 0, 97 * 512), (1, 97 * 512, 100_000)), ((1, 0, 100_000),)]


def test_channel_split_covers_the_count_contiguously():
    for v in ("2.21", "2.22", "2.25", "2.28", "2.30"):
        for count, es, n, nc, proto in [(1, 4, 4, 4, SIMPLE), (4097, 2, 4, 3, LL),
                                        (10_000_000, 2, 64, 16, LL128), (333, 4, 8, 64, SIMPLE)]:
            task = Task("reduce_scatter", count, es, proto, nc,
                        thread_count(count * es * n, nc, proto, n))
            (split,) = plan_split([task], nc, n, rules_for(v))
            assert split[0][1] == 0 and split[-1][2] == count, (v, count)
            assert all(a[2] == b[1] for a, b in zip(split, split[1:]))
            assert all(lo < hi for _, lo, hi in split) and len(split) <= nc


def test_rings_descend_from_the_nic_gpu_on_nvswitch():
    """ncclTopoSearchNextGpuSort tries the previous GPU first on NVSwitch; channel c enters at
    the GPU of NIC c % nics (NVIDIA/nccl#514, #1453: 0 7 6 5 4 3 2 1 8 15 ...)."""
    r = rings(parse_topology("2x8"), 16)
    assert r[0] == (0, 7, 6, 5, 4, 3, 2, 1, 8, 15, 14, 13, 12, 11, 10, 9)
    assert r[1] == (1, 0, 7, 6, 5, 4, 3, 2, 9, 8, 15, 14, 13, 12, 11, 10)
    assert r[8] is r[0]  # ncclTopoPostset duplicates: channel c+8 is channel c
    four = rings(parse_topology("2x8:nics=4"), 8)
    assert four[1][:8] == (2, 1, 0, 7, 6, 5, 4, 3)  # NIC 1's GPU is 2
    assert set(rings(parse_topology("1x8"), 24)) == {tuple(range(8))}
    assert not orders_differ(parse_topology("1x8"))
    assert not orders_differ(parse_topology("2x1"))  # two ranks: a + b == b + a
    assert orders_differ(parse_topology("2x2"))


def test_every_scenario_and_the_assumptions_are_named():
    p = predict("2x8", "reduce_scatter", 1_000_000, 2)
    assert set(p.protocols) == {LL, LL128, SIMPLE}
    fams = {s.family for s in p.scenarios}
    assert {"nvswitch-descending", "nvswitch-descending-odd-swap", "pci-ascending"} <= fams
    assert {s.comm_channels for s in p.scenarios} == {16}  # 2 x 8 NICs; 16 is not < 16
    assert {s.comm_channels for s in predict("2x8:nics=4", "reduce_scatter", 1_000_000,
                                             2).scenarios} == {8, 16}  # + Hopper duplication
    assert all(s.assumptions for s in p.scenarios)
    pinned = predict("2x8:proto=LL", "reduce_scatter", 1_000_000, 2)
    assert pinned.protocols == (LL,) and pinned.pinned == "proto="
    env = predict("2x8", "reduce_scatter", 1_000_000, 2, env={"NCCL_PROTO": "^LL128"})
    assert set(env.protocols) == {LL, SIMPLE}
    d = p.to_dict()
    assert d["scenarios"][0]["ranges"][0] == [0, 0, p.scenarios[0].segments[0].hi]


def test_unknown_where_ring_is_not_certain():
    cases = [
        ("4x1", "reduce_scatter", "sum", None, "pat"),
        ("1x8", "reduce_scatter", "sum", None, "nvls"),
        ("2x8", "all_reduce", "sum", None, "tree"),
        ("2x8", "reduce_scatter", "sum", {"NCCL_TUNER_PLUGIN": "libnccl-tuner.so"}, "tuner"),
        ("2x8", "reduce_scatter", "sum", {"NCCL_ALGO": "PAT"}, "algorithm"),
        ("2x8", "reduce_scatter", "sum", {"NCCL_COLLNET_ENABLE": "1"}, "collnet"),
        ("2x8", "reduce_scatter", "sum", {"NCCL_ALGO": "Bogus"}, "env"),
    ]
    for topo, kind, op, env, cause in cases:
        u = predict(topo, kind, 1 << 20, 2, op=op, env=env)
        assert isinstance(u, Unknown) and u.cause == cause, (topo, kind, env, u)
    # what pins Ring
    assert not isinstance(predict("4x1", "reduce_scatter", 1 << 20, 2, op="avg"), Unknown)
    assert not isinstance(predict("4x1:nccl=2.22", "reduce_scatter", 1 << 20, 2), Unknown)
    assert not isinstance(predict("1x8", "reduce_scatter", 1 << 20, 2,
                                  env={"NCCL_NVLS_ENABLE": "0"}), Unknown)
    assert not isinstance(predict("2x8:algo=Ring", "all_reduce", 1 << 20, 2), Unknown)
    assert not isinstance(predict("2x8", "all_reduce", 1 << 20, 2,
                                  env={"NCCL_ALGO": "allreduce:ring;reducescatter:ring"}),
                          Unknown)


def test_all_reduce_owner_is_the_ring_index():
    """setupChannel: ring->index = distance from rank 0; all_reduce.h runRing: chunk k of a loop
    is finished by the rank of index k. On 2x2 channel 1 (ring 1 0 3 2) the owners of chunks
    0..3 are 0, 3, 2, 1 (not 1, 0, 3, 2)."""
    ring = rings(parse_topology("2x2"), 2)[1]
    assert ring == (1, 0, 3, 2)
    assert ring_index(ring) == {0: 0, 3: 1, 2: 2, 1: 3}
    s = primary_scenario("2x2:algo=Ring", "all_reduce", 40_000, 4)
    ch1 = [seg for seg in s.segments if seg.channel == 1]
    assert [seg.owner for seg in ch1] == [0, 3, 2, 1]
    for seg in s.segments:
        assert seg.order[-1] == seg.owner and sorted(seg.order) == [0, 1, 2, 3]
    covered = sorted((seg.lo, seg.hi) for seg in all_reduce_segments("2x2:algo=Ring", 40_000, 4))
    assert covered[0][0] == 0 and covered[-1][1] == 40_000
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_all_reduce_chunk_sizes():
    """calcCollChunking: LL 32 KiB, LL128 576,000 B, Simple 2 MiB (ALLREDUCE_CHUNKSTEPS)."""
    r = rules_for("2.27")
    assert [chunk_bytes(p, r) for p in (LL, LL128, SIMPLE)] == [32768, 576000, 2 << 20]
    assert chunk_bytes(SIMPLE, r, {"NCCL_BUFFSIZE": str(8 << 20)}) == 4 << 20


def test_small_messages_and_the_built_in_figures():
    t = parse_topology("8x8:channels=16")
    assert len(reduce_scatter_segments(t, 100, 4)) == 1  # 25.6 KB in all: < 1 x 512 x 64
    # 256 KB in all: cut to 7 channels; 2.29+'s 32 KiB cells (8 of 128 fp32) fill 4 of them
    assert len(reduce_scatter_segments(t, 1000, 4)) == 4
    assert len(reduce_scatter_segments(t, 10_000_000, 4)) == 16


def test_grouped_calls_share_the_plan():
    """A group of four equal reduce-scatters: ncclPrepareTasks cuts channels for their sum and
    scheduleCollTasksToPlan lays them out one after another on the channels."""
    alone = predict("2x8:proto=Simple", "reduce_scatter", 100_000, 2)
    grouped = predict("2x8:proto=Simple", "reduce_scatter", 100_000, 2,
                      group=(100_000, 100_000, 100_000))
    assert alone.scenarios[0].ranges()[0][0] == 0
    assert grouped.scenarios[0].ranges()[0][0] > 0  # the last task starts on a later channel
    assert "grouped" in " ".join(grouped.scenarios[0].assumptions)


def test_errors_are_one_line():
    with pytest.raises(ParityError):
        predict("2x2", "all_gather", 10, 4)
    with pytest.raises(ParityError):
        predict("2x2", "reduce_scatter", 10, 4, op="xor")
