"""Reading NCCL_DEBUG=INFO logs (parity/nccl/logs.py): real excerpts from public issues
(tests/data/nccl-logs/, sources in its README) rebuild the rings and channel counts they hold;
logs built here from NCCL's format strings cover what no public excerpt holds whole."""

from pathlib import Path

import pytest

from parity.errors import ParityError
from parity.nccl import (LL, SIMPLE, Unknown, parse_topology, predict, read_log,
                         topology_from_log)

DATA = Path(__file__).parent / "data" / "nccl-logs"


# ------------------------------------------------------------------------ real excerpts
def test_issue_1412_rings_rebuilt_from_rank0_lines_and_the_duplication():
    log = read_log(DATA / "nccl-1412-2x8.log")
    (c,) = log.communicators
    assert (c.nranks, c.nnodes, c.local_ranks, c.channels) == (16, 2, 8, 8)
    assert c.rings[0] == (0, 5, 4, 7, 6, 3, 2, 1, 8, 13, 12, 15, 14, 11, 10, 9)
    assert c.rings[3] == (0, 5, 12, 15, 14, 11, 10, 9, 8, 13, 4, 7, 6, 3, 2, 1)
    assert c.rings[4] == c.rings[0] and c.rings[7] == c.rings[3]  # ncclTopoPostset copies
    topo, notes = topology_from_log(DATA / "nccl-1412-2x8.log")
    assert (topo.nodes, topo.gpus, topo.channels, len(topo.rings)) == (2, 8, 8, 8)
    assert any("copies" in n for n in notes)
    p = predict(topo, "reduce_scatter", 100_000, 2, op="avg")
    assert {s.family for s in p.scenarios} == {"log"} and {s.comm_channels for s in p.scenarios} == {8}


def test_issue_1453_cut_lines_keep_the_count_and_pick_the_nvswitch_family():
    topo, notes = topology_from_log(DATA / "nccl-1453-h100-3x8.log")
    assert (topo.nodes, topo.gpus, topo.channels, topo.rings) == (3, 8, 16, None)
    assert topo.ring_prefixes[1][:10] == (0, 7, 6, 5, 4, 3, 2, 9, 8, 15)
    assert any("NCCL_CROSS_NIC=2" in n for n in notes)
    p = predict(topo, "reduce_scatter", 100_000, 2, op="avg")
    # the cut lines agree with channel c entering each node at GPU c and descending, and
    # rule out the odd-node swap and PCIe families
    assert {s.family for s in p.scenarios} == {"nvswitch-descending"}
    assert {s.comm_channels for s in p.scenarios} == {16}
    # its (2.20-2.22 format) TUNING rows ran Tree for those all-reduce sizes: unknown
    rows = topo.tuning
    assert [(r.nbytes, r.algorithm, r.protocol, r.fmt) for r in rows] == [
        (4, "TREE", LL, "2.20"), (65536, "TREE", LL, "2.20"), (131072, "TREE", "LL128", "2.20")]
    u = predict(topo, "all_reduce", 16384, 4)
    assert isinstance(u, Unknown) and u.cause == "log" and "TREE" in u.reason


def test_issue_514_p4d_rings_follow_no_modelled_family_but_the_log():
    """AWS p4d: GPU order differs from the NICs' order; channel 1 is 0 3 10 15 ... The cut
    lines show node 1 whole in every channel: every node is taken to run that chain, and
    channel 7 (cut away by the excerpt) copies channel 3."""
    log = read_log(DATA / "nccl-514-p4d-4x8.log")
    (c,) = log.communicators
    assert (c.channels, c.cut, sorted(c.prefixes)) == (8, True, list(range(7)))
    assert all(len(p) == 20 for p in c.prefixes.values())
    with pytest.raises(ParityError):  # the excerpt has no nNodes/localRanks: --at is needed
        topology_from_log(DATA / "nccl-514-p4d-4x8.log")
    topo, _ = topology_from_log(DATA / "nccl-514-p4d-4x8.log", parse_topology("4x8"))
    p = predict(topo, "reduce_scatter", 1_000_000, 2, op="avg")
    assert {s.family for s in p.scenarios} == {"log-extrapolated"}
    ring1 = p.scenarios[0].rings[1]
    assert ring1[ring1.index(8):ring1.index(8) + 4] == (8, 11, 18, 23)


def test_one_node_logs():
    topo, _ = topology_from_log(DATA / "easydistill-4-1x8.log", parse_topology("1x8"))
    assert topo.channels == 24 and topo.ring_prefixes[23] == tuple(range(8))
    p = predict(topo, "reduce_scatter", 1_000_000, 2, op="avg")
    assert {s.family for s in p.scenarios} == {"one-node"}
    log = read_log(DATA / "easydistill-4-1x8.log")
    assert log.communicators[0]._next[3] == {7: 0, 0: 1}  # rank 0's Ring 03 line
    c = read_log(DATA / "nccl-892-h800-1x8.log").communicators[0]
    assert c.channels == 16 and c.env["NCCL_ALGO"].startswith("Tree,Ring")
    c = read_log(DATA / "nccl-tests-213-1x8.log").select()
    assert (c.nranks, c.nnodes, c.local_ranks) == (8, 1, 8)
    assert c._conn[5] == {2: 1, 1: 0}  # descending ring connections on one node


def test_issue_1189_commid_and_the_shape_from_hosts():
    c = read_log(DATA / "nccl-1189-h20-2x2.log").select()
    assert c.key == "0xf021d9037f9243d8" and len(c.pointers) == 4
    assert (c.nranks, c.nnodes, c.local_ranks, c.channels) == (4, 2, 2, 8)


def test_issue_1595_old_tuning_rows_pin_ring_and_simple():
    topo, _ = topology_from_log(DATA / "nccl-1595-tuning-2.20.log", parse_topology("2x8"))
    (row, *_) = topo.tuning
    assert (row.collective, row.nbytes, row.per_rank, row.algorithm, row.protocol) == (
        None, 805306368, False, "RING", SIMPLE)
    p = predict(topo, "all_reduce", 805306368 // 4, 4)  # Ring pinned by the row: no Tree
    assert p.protocols == (SIMPLE,) and p.pinned.startswith("log row")


# -------------------------------------------------- logs built from NCCL's format strings
def _prefix(host, pid, dev):
    return f"{host}:{pid}:{pid + 1} [{dev}] NCCL INFO "


def _comm_lines(world_rings, nodes, gpus, comm_id="0xabc", ptr_base=0x1000, ring_lines=True,
                channel_lines=True, version="2.27.5"):
    """Every rank's lines of one communicator init (src/init.cc, src/graph/rings.cc)."""
    n = nodes * gpus
    out = {}
    for r in range(n):
        host, dev = f"node{r // gpus}", r % gpus
        p = _prefix(host, 100 + r * 10, dev)
        lines = [f"{host}:{100 + r * 10}:{100 + r * 10} [{dev}] NCCL INFO NCCL version {version}+cuda12.4",
                 p + f"ncclCommInitRankConfig comm 0x{ptr_base + r:x} rank {r} nranks {n} cudaDev "
                     f"{dev} nvmlDev {dev} busId 1000 commId {comm_id} - Init START",
                 p + f"comm 0x{ptr_base + r:x} rank {r} nRanks {n} nNodes {nodes} localRanks {gpus} "
                     f"localRank {dev} MNNVL 0"]
        if r == 0 and channel_lines:
            w = len(str(n - 1))
            for c, ring in enumerate(world_rings):
                i = ring.index(0)
                rr = ring[i:] + ring[:i]
                lines.append(p + f"Channel {c:02d}/{len(world_rings):02d} :"
                             + "".join(f" {x:>{w}}" for x in rr))
        if ring_lines:
            for c, ring in enumerate(world_rings):
                i = ring.index(r)
                lines.append(p + f"Ring {c:02d} : {ring[i - 1]} -> {r} -> {ring[(i + 1) % n]}")
        lines.append(p + f"{len(world_rings)} coll channels, {len(world_rings)} collnet channels, "
                         f"0 nvls channels, 2 p2p channels, 2 p2p channels per peer")
        lines.append(p + f"ncclCommInitRankConfig comm 0x{ptr_base + r:x} rank {r} nranks {n} "
                         f"cudaDev {dev} nvmlDev {dev} busId 1000 commId {comm_id} - Init COMPLETE")
        out[r] = lines
    return out


def _write_per_rank(tmp_path, per_rank, name="logs"):
    d = tmp_path / name
    d.mkdir()
    for r, lines in per_rank.items():
        (d / f"rank{r}.log").write_text("\n".join(lines) + "\n")
    return d


def test_rings_of_any_size_from_every_ranks_ring_lines(tmp_path):
    """64 ranks: rank 0's ring lines are cut at 128 characters (2.23+), every rank's Ring
    lines rebuild the whole rings; the stated count is kept."""
    nodes, gpus = 8, 8
    from parity.nccl import rings

    world = rings(parse_topology("8x8"), 16)
    per_rank = _comm_lines(world, nodes, gpus)
    for i, line in enumerate(per_rank[0]):  # cut rank 0's lines as dumpLine does from 2.23
        if " Channel " in line and "/16 :" in line:
            head, _, msg = line.partition(" NCCL INFO ")
            assert len(msg) >= 127
            per_rank[0][i] = head + " NCCL INFO " + msg[:124] + "..."
    d = _write_per_rank(tmp_path, per_rank)
    c = read_log(d).select()
    assert c.cut and c.ring_source == "ring lines" and c.channels == 16
    assert [c.rings[ch] for ch in range(16)] == [r[r.index(0):] + r[:r.index(0)] for r in world]
    topo, notes = topology_from_log(str(d))
    assert topo.rings is not None and topo.nccl == "2.27" and len(topo.rings) == 16
    # rank 0's file alone: the cut lines give prefixes and the count, said in the notes
    topo0, notes0 = topology_from_log(d / "rank0.log")
    assert topo0.rings is None and topo0.channels == 16 and any("incomplete" in n for n in notes0)
    assert {s.family for s in predict(topo0, "reduce_scatter", 50_000, 2, op="avg").scenarios} \
        == {"nvswitch-descending"}


def test_communicators_are_kept_apart_and_selectable(tmp_path):
    """A 2x2 world followed by two 2-rank sub-communicators: the world is the default,
    FILE:COMM picks another (commId, a comm pointer, or #N)."""
    world = [(0, 1, 2, 3), (1, 0, 3, 2)]
    per_rank = _comm_lines(world, 2, 2, comm_id="0xa11d")
    sub_a = _comm_lines([(0, 1)], 1, 2, comm_id="0xaaaa", ptr_base=0x9000)
    sub_b = _comm_lines([(0, 1)], 1, 2, comm_id="0xbbbb", ptr_base=0x9100)
    for r in range(4):
        sub = sub_a if r < 2 else sub_b
        per_rank[r] += [ln.replace(f"{100 + (r % 2) * 10}:", f"{100 + r * 10}:")
                        .replace(f"node0:{100 + r * 10}", f"node{r // 2}:{100 + r * 10}")
                        for ln in sub[r % 2] if "NCCL version" not in ln]
    d = _write_per_rank(tmp_path, per_rank)
    log = read_log(d)
    assert [c.key for c in log.communicators] == ["0xa11d", "0xaaaa", "0xbbbb"]
    topo, notes = topology_from_log(str(d))
    assert (topo.nodes, topo.gpus, topo.world) == (2, 2, 4) and "3 communicators" in notes[0]
    sub, _ = topology_from_log(f"{d}:0xaaaa")
    assert (sub.nodes, sub.gpus) == (1, 2)
    assert topology_from_log(f"{d}:#3")[0].world == 2
    assert topology_from_log(f"{d}:0x9100")[0].world == 2  # a comm pointer of sub b
    with pytest.raises(ParityError):
        topology_from_log(f"{d}:0xdead")


def test_tuning_formats_per_rank_bytes_and_lo_hi(tmp_path):
    per_rank = _comm_lines([(0, 1, 2, 3), (1, 0, 3, 2)] * 2, 2, 2)
    p = _prefix("node0", 100, 0)
    per_rank[0] += [
        p + "ReduceScatter: 65536 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}",
        p + "AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..3}",
        p + "AllGather: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}",
        p + "ReduceScatter: 524288 Bytes -> Algo 1 proto 2 time 12.5",  # 2.23.4
        p + "ReduceScatter: 8192 Bytes -> Algo PAT proto SIMPLE channel{Lo..Hi}={0..0}",
    ]
    d = _write_per_rank(tmp_path, per_rank)
    topo, _ = topology_from_log(str(d))
    rows = {(r.collective, r.nbytes): r for r in topo.tuning}
    rs = rows[("reduce_scatter", 65536)]
    assert rs.per_rank and (rs.channel_lo, rs.channel_hi) == (0, 1) and rs.fmt == "2.24"
    assert not rows[("reduce_scatter", 524288)].per_rank  # 2.23.4: the whole input
    assert topo.channels == 4  # the communicator's, never Lo..Hi
    # a reduce-scatter of 16384 fp32 per rank (65,536 B per rank) is the first row: LL
    p1 = predict(topo, "reduce_scatter", 16384, 4)
    assert p1.protocols == (LL,) and p1.pinned.startswith("log row")
    # the whole input is 262,144 B: not the first row, which prints per-rank bytes
    assert predict(topo, "reduce_scatter", 65536 // 4, 4).protocols == (LL,)
    assert predict(topo, "reduce_scatter", 65536, 2).protocols == (SIMPLE,)  # 2.23.4 row
    u = predict(topo, "reduce_scatter", 2048, 4)
    assert isinstance(u, Unknown) and "PAT" in u.reason


@pytest.mark.parametrize("bad,what", [
    ("ReduceScatter: 1024 Bytes -> Algo RING proto FOO channel{Lo..Hi}={0..0}", "protocol"),
    ("ReduceScatter: 1024 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={3..1}", "range"),
    ("ReduceScatter: 1024 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..64}", "range"),
    ("ReduceScatter: 1024 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={-1..0}", "range"),
    ("ReduceScatter: 1024 Bytes -> Algo WARP proto SIMPLE channel{Lo..Hi}={0..0}", "algorithm"),
    ("ReduceScatter: lots Bytes -> Algo RING proto SIMPLE", "TUNING"),
    ("Ring 00 : 3 -> 0 -> x", "ring line"),
    ("Channel 00/99 :    0   1", "channels"),
    ("comm 0x1 rank 5 nRanks 4 nNodes 2 localRanks 2 localRank 1 MNNVL 0", "communicator"),
])
def test_a_malformed_line_is_refused_with_its_line_number(tmp_path, bad, what):
    path = tmp_path / "bad.log"
    path.write_text("node0:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 4 nNodes 2 localRanks 2 "
                    "localRank 0 MNNVL 0\n" + "node0:1:1 [0] NCCL INFO " + bad + "\n")
    with pytest.raises(ParityError) as e:
        read_log(path)
    assert f"{path}:2:" in str(e.value) and e.value.exit_code == 2
    assert what.lower() in str(e.value).lower() and "\n" not in str(e.value)


def test_ring_lines_that_contradict_each_other_are_refused(tmp_path):
    path = tmp_path / "bad.log"
    path.write_text("a:1:1 [0] NCCL INFO Ring 00 : 3 -> 0 -> 1\n"
                    "a:2:2 [2] NCCL INFO Ring 00 : 1 -> 2 -> 3\n"
                    "a:3:3 [1] NCCL INFO Ring 00 : 2 -> 1 -> 3\n")
    with pytest.raises(ParityError) as e:
        read_log(path)
    assert ":3:" in str(e.value) and "contradicts" in str(e.value)


def test_graph_dump_gives_the_search_chains(tmp_path):
    xml = """<graphs version="1">
  <graph id="0" pattern="4" crossnic="0" nchannels="2" speedintra="40" speedinter="24" latencyinter="0" typeintra="NVL" typeinter="PXB" samechannels="0">
    <channel><net dev="0"/><gpu dev="0"/><gpu dev="3"/><gpu dev="2"/><gpu dev="1"/><net dev="0"/></channel>
    <channel><net dev="1"/><gpu dev="2"/><gpu dev="1"/><gpu dev="0"/><gpu dev="3"/><net dev="1"/></channel>
  </graph>
  <graph id="1" pattern="1" crossnic="0" nchannels="1" speedintra="40" speedinter="24" latencyinter="0" typeintra="NVL" typeinter="PXB" samechannels="0">
    <channel><net dev="0"/><gpu dev="0"/><gpu dev="1"/><gpu dev="2"/><gpu dev="3"/><net dev="0"/></channel>
  </graph>
</graphs>
"""
    path = tmp_path / "graph.xml"
    path.write_text(xml)
    with pytest.raises(ParityError):
        topology_from_log(path)  # the node count is not in a dump
    topo, notes = topology_from_log(path, parse_topology("2x4"))
    assert topo.channels == 4 and topo.rings[0] == (0, 3, 2, 1, 4, 7, 6, 5)
    assert topo.rings[1] == (2, 1, 0, 3, 6, 5, 4, 7) and topo.rings[2] == topo.rings[0]
    assert any("graph dump" in n for n in notes)
    (tmp_path / "bad.xml").write_text("<graphs><graph id='0'><channel><gpu dev='0'/>")
    with pytest.raises(ParityError):
        topology_from_log(tmp_path / "bad.xml", parse_topology("2x4"))


def test_unreadable_or_empty_logs_are_one_line(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    for path in (empty, tmp_path / "missing.log"):
        with pytest.raises(ParityError) as e:
            topology_from_log(path)
        assert "\n" not in str(e.value) and e.value.exit_code == 2
