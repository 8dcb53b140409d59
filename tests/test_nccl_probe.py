"""``parity nccl-probe``: its pure parts (sizes, cases, inputs, order search, TUNING matching,
case verdicts, NIC lines, the topology file's agreement figure). The probe run as real torchrun
jobs is in test_nccl_probe_real.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.errors import ParityError
from parity.nccl import Topology, TuningRow, parse_topology, save_topology, sum_order
from parity.nccl.probe_file import describe_file, file_line, topology_label
from parity.probe import cases as pc
from parity.probe.analysis import (AGREE, DIFFERS, NOT_MODELLED, analyse, judge_case,
                                   match_calls, verdict_code)
from parity.probe.cluster import nics_of
from parity.probe.files import LOGS_DIR, log_name
from parity.probe.orders import find_orders, ring_candidates, sequential_sums

DATA = Path(__file__).parent / "data" / "nccl-probe"


# ----------------------------------------------------------------------------- sizes, cases


def test_size_ladder_and_lists():
    assert pc.parse_sizes("1K-8K") == [1024, 2048, 4096, 8192]
    assert pc.parse_sizes("1K-4K,3M") == [1024, 2048, 4096, 3 << 20]
    assert pc.parse_sizes("3K-9K") == [3072, 4096, 8192, 9216]  # ends kept, powers between
    assert pc.parse_sizes("256M")[0] == 256 << 20
    for bad in ("", "1Q", "8K-1K", "0", "99G"):
        with pytest.raises(ParityError):
            pc.parse_sizes(bad)


def test_cases_are_ordered_by_input_size_and_deduplicated():
    cs = pc.build_cases([1024, 4096], 4)
    assert len(cs) == 2 * 2 * 2 * 2
    assert [c.index for c in cs] == list(range(len(cs)))
    sizes = [c.input_bytes(4) for c in cs]
    assert sizes == sorted(sizes)
    first = cs[0]
    assert (first.collective, first.dtype, first.op) == ("reduce_scatter", "float32", "sum")
    assert first.count == 1024 // 4 // 4  # per-rank output of a 1 KiB input on 4 ranks
    # a recorded bucket equal to a ladder case is not run twice
    again = pc.build_cases([1024], 4, recorded=[("reduce_scatter", "float32", 64, "run: x")])
    assert len(again) == len(pc.build_cases([1024], 4))


def test_inputs_are_seeded_prefixes_with_wide_spread():
    a = pc.values(0, 1, 0, pc.BLOCK + 100, "float32")
    b = pc.values(0, 1, pc.BLOCK - 5, pc.BLOCK + 7, "float32")
    assert torch.equal(a[pc.BLOCK - 5:pc.BLOCK + 7], b)  # any slice, across a block edge
    assert not torch.equal(pc.values(0, 2, 0, 64, "float32"), a[:64])  # ranks differ
    assert not torch.equal(pc.values(1, 1, 0, 64, "float32"), a[:64])  # seeds differ
    mags = a.abs()
    assert mags.min() >= 2 ** -4 and mags.max() < 2 ** 5 and (a < 0).any()
    bf = pc.values(0, 1, 0, 64, "bfloat16")
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, a[:64].to(torch.bfloat16))
    a[0] = 123.0  # a copy, never the cached block
    assert pc.values(0, 1, 0, 1, "float32")[0] != 123.0


# ----------------------------------------------------------------------------- order search


def test_find_orders_names_the_ring_that_reproduces_a_sum():
    ring_a, ring_b = (0, 1, 2, 3), (1, 0, 3, 2)
    vals = pc.values(0, 0, 0, 64, "float32").reshape(16, 4).t().contiguous()  # 4 ranks x 16
    for i in range(16):
        v = vals[:, i]
        observed = sequential_sums(v, [list(sum_order(ring_b, 2))])[0]
        cands = ring_candidates([ring_a], "channel", 2) + ring_candidates([ring_b], "cluster", 2)
        found = find_orders(v, observed, cands)
        assert found["exhaustive"] and found["tried"] == 12  # 4! / 2
        assert found["matches"] >= 1
        assert "cluster 0's ring, owner 2" in found["named"]
        if found["matches"] == 1:
            assert found["orders"] == [list(sum_order(ring_b, 2))]


def test_find_orders_says_when_no_order_reproduces_a_sum():
    v = torch.tensor([1.0, 2.0 ** -30, -1.0], dtype=torch.float32)
    found = find_orders(v, torch.tensor(12.5), ring_candidates([(0, 1, 2)]))
    assert found["named"] == [] and found["orders"] == [] and found["matches"] == 0


# ------------------------------------------------------------------------- NIC lines (real)


def test_nics_read_from_real_init_lines():
    network, devs = nics_of((DATA / "nics-1357-2x8-4nic-sharp.log").read_text())
    assert network == "IBext" and devs == ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"]
    network, devs = nics_of((DATA / "nics-302-5nic.log").read_text())
    assert network is None and devs == ["mlx5_1", "mlx5_3", "mlx5_0", "mlx5_2", "mlx5_4"]
    network, devs = nics_of((DATA / "nics-56-socket-then-ib.log").read_text())
    assert devs == ["mlx5_0"]  # the IB transport, not the bootstrap's socket
    assert nics_of("nothing here") == (None, [])


# ------------------------------------------------------ TUNING rows -> the probe's calls


def _row(coll, nbytes, algo="RING", proto="Simple", lo=0, hi=0, line=1):
    return TuningRow(coll, nbytes, coll == "reduce_scatter", algo, proto, lo, hi, "2.24", line)


def test_tuning_rows_are_matched_to_calls_in_issue_order():
    calls = [{"kind": "all_reduce", "count": 1, "elem_size": 4, "what": "warm-up"},
             {"kind": "reduce_scatter", "count": 64, "elem_size": 4, "what": "case 0 repeat 0"},
             {"kind": "reduce_scatter", "count": 64, "elem_size": 4, "what": "case 1 repeat 0"},
             {"kind": "all_reduce", "count": 256, "elem_size": 4, "what": "case 2 repeat 0"}]
    rows = [_row("all_reduce", 4, line=1), _row("all_gather", 64, line=2),
            _row("reduce_scatter", 256, line=3), _row("reduce_scatter", 256, "NVLS", line=4),
            _row("all_reduce", 1024, proto="LL", line=5)]
    got = match_calls(calls, rows, 4)
    assert [r.line if r else None for r in got] == [1, 3, 4, 5]
    assert match_calls(calls[1:2], [_row("reduce_scatter", 999)], 4) == [None]


def _per_rank(world, count, channels, bad=0, digests=("a", "a")):
    out = []
    for r in range(world):
        v = {"protocols": ["Simple"], "mismatches": bad if r == 1 else 0, "channels": channels,
             "first": 3 if (bad and r == 1) else None,
             "diagnosis": {"rank": 1, "element": 3} if (bad and r == 1) else None}
        out.append({"case": 0, "digests": list(digests), "share": [0, count],
                    "variants": {"Simple": v, "LL": dict(v, protocols=["LL"]),
                                 "LL128": dict(v, protocols=["LL128"])}})
    return out


def test_a_case_is_judged_by_what_nccl_ran():
    case = pc.Case(0, "reduce_scatter", "sum", "float32", 64)
    record = {"world": 4, "emulate": None}
    topo = parse_topology("2x2:algo=Ring")
    ok = judge_case(case, _per_rank(4, 64, [0, 1]), [_row("reduce_scatter", 256, lo=0, hi=1)],
                    record, topo)
    assert ok["status"] == AGREE and ok["protocol"] == "Simple" and ok["channels_agree"]
    assert ok["nccl_channels"] == [0, 1] and ok["elements"] == 256
    nvls = judge_case(case, _per_rank(4, 64, [0]), [_row("reduce_scatter", 256, "NVLS")],
                      record, topo)
    assert nvls["status"] == NOT_MODELLED and "NVLS" in nvls["reason"]  # never agreement
    bad = judge_case(case, _per_rank(4, 64, [0], bad=5), [_row("reduce_scatter", 256, hi=3)],
                     record, topo)
    assert bad["status"] == DIFFERS and bad["mismatches"] == 5 and bad["first"]["rank"] == 1
    assert bad["channels_agree"] is False
    flaky = judge_case(case, _per_rank(4, 64, [0], digests=("a", "b")),
                       [_row("reduce_scatter", 256)], record, topo)
    assert not flaky["repeatable"] and any("repeats" in n for n in flaky["notes"])
    # no TUNING line (an old NCCL): bits that match a Ring protocol are agreement, said so
    quiet = judge_case(case, _per_rank(4, 64, [0]), [None], record, topo)
    assert quiet["status"] == AGREE and quiet["protocol_source"] == "not logged"
    # ... bits that match none, where Tree may run an all-reduce: not modelled
    ar = pc.Case(0, "all_reduce", "sum", "float32", 256)
    tree = judge_case(ar, _per_rank(4, 64, [0], bad=2), [None], record, parse_topology("2x2"))
    assert tree["status"] == NOT_MODELLED and "Tree" in tree["reason"]


def _nccl_probe_dir(tmp_path: Path, tuning_lines: list[str]) -> tuple[Path, dict]:
    """A probe directory as an NCCL run leaves it (rank 0's log built from NCCL 2.27's format
    strings, src/enqueue.cc and src/init.cc), with the ranks' results given."""
    out = tmp_path / "probe"
    (out / LOGS_DIR).mkdir(parents=True)
    pre = "host0:100:101 [0] NCCL INFO "
    text = [pre + "NCCL version 2.27.5+cuda12.9",
            pre + "comm 0x5555 rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0",
            pre + "Using network IB",
            pre + "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.0.0.1<0>",
            pre + "AllReduce: 4 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}"]
    text += [pre + t for t in tuning_lines]
    (out / LOGS_DIR / log_name(0)).write_text("\n".join(text) + "\n")
    cases = [pc.Case(0, "reduce_scatter", "sum", "float32", 64),
             pc.Case(1, "all_reduce", "sum", "float32", 256)]
    calls = [{"kind": "all_reduce", "count": 1, "elem_size": 4, "what": "warm-up"}]
    for c in cases:
        calls.append({"kind": c.collective, "count": c.count, "elem_size": 4,
                      "what": f"case {c.index} repeat 0"})
    topo = Topology(2, 2, channels=2, rings=((0, 1, 2, 3), (1, 0, 3, 2)))
    ranks = [{"rank": r, "host": f"host{r // 2}", "local_rank": r % 2, "gpu": "H100",
              "nccl_version": "2.27.5", "torch": "2.13", "env": {}} for r in range(4)]
    record = {"format": "parity-nccl-probe/1", "world": 4, "emulate": None, "repeat": 1,
              "seed": 0, "backend": "nccl", "model": None, "ended": 1.8e9,
              "cases": [c.to_dict() for c in cases], "calls": calls, "ranks": ranks,
              "plan": {"cluster": topo.to_dict(), "checked": topo.to_dict(), "notes": []},
              "results": [_per_rank(4, 64, [0, 1]), _per_rank(4, 64, [0], bad=7)]}
    return out, record


def test_analysis_of_an_nccl_probe_reads_rank0s_tuning_lines(tmp_path):
    out, record = _nccl_probe_dir(tmp_path, [
        "ReduceScatter: 256 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..1}",
        "AllReduce: 1024 Bytes -> Algo NVLS proto SIMPLE channel{Lo..Hi}={0..3}"])
    result = analyse(out, record)
    rs, ar = result["cases"]
    assert rs["status"] == AGREE and rs["nccl_channels"] == [0, 1] and rs["channels_agree"]
    assert ar["status"] == NOT_MODELLED and "NVLS" in ar["reason"]  # its 7 bad elements unused
    fig = result["agreement"]
    assert (fig["agree"], fig["differ"], fig["not_modelled"], fig["percent"]) == (1, 0, 1, 100.0)
    assert verdict_code(fig) == 0
    assert result["machines"]["nics_per_host"] == 2 and result["topology"]["nics"] == 2
    rows = result["topology"]["tuning"]
    assert [(r["collective"], r["nbytes"], r["algorithm"]) for r in rows] == [
        ("all_reduce", 1024, "NVLS"), ("reduce_scatter", 256, "RING")]
    # the same all-reduce run as Ring: its 7 differing elements are a disagreement
    out2, record2 = _nccl_probe_dir(tmp_path / "b", [
        "ReduceScatter: 256 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..1}",
        "AllReduce: 1024 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..0}"])
    fig2 = analyse(out2, record2)["agreement"]
    assert (fig2["agree"], fig2["differ"], fig2["percent"]) == (1, 1, 50.0)
    assert fig2["first_disagreement"] == 1 and verdict_code(fig2) == 1


# ------------------------------------------------------------ the topology file's figure


def test_reports_name_a_topology_file_and_its_agreement(tmp_path):
    path = tmp_path / "topology.json"
    topo = Topology(2, 2, channels=2, rings=((0, 1, 2, 3), (1, 0, 3, 2)))
    save_topology(topo, path, extra={"probe": {
        "agreement": {"cases": 8, "modelled": 6, "agree": 6, "differ": 0, "not_modelled": 2,
                      "percent": 100.0},
        "summary": "agreement 100.0%: 6 of 6 modelled cases bit-identical, 2 not modelled"}})
    loaded = parse_topology(str(path))
    info = describe_file(loaded)
    assert info["path"] == str(path) and info["agreement"]["percent"] == 100.0
    assert topology_label(loaded.spec(), info) == f"{path} [nccl-probe agreement 100.0%]"
    assert "6 of 6 modelled cases" in file_line(loaded)
    bare = tmp_path / "bare.json"
    save_topology(topo, bare)
    assert "not measured" in topology_label(str(bare), describe_file(parse_topology(str(bare))))
    assert describe_file(parse_topology("2x2")) is None
    assert topology_label("2x2", None) == "2x2"
    assert topology_label(str(path), None) == f"{path} [nccl-probe agreement 100.0%]"


# ----------------------------------------------------------------------------- the command


def _parity(*args, env=None, cwd=None):
    import os

    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID",
                                                          "SLURM_NTASKS")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True,
                          text=True, env=e, cwd=cwd, timeout=120)


def test_bad_input_is_one_line_exit_2(tmp_path):
    r = _parity("nccl-probe", "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and "runs in every rank of a job" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    for args, what in ((["--sizes", "8K-1K"], "low-high"), (["--dtypes", "fp8"], "fp8"),
                       (["--emulate-nccl", "2y2"], "NODESxGPUS"),
                       (["--collectives", "all_gather"], "all_gather")):
        r = _parity("nccl-probe", "--out", str(tmp_path / "p"), *args)
        assert r.returncode == 2 and what in r.stderr, r.stderr
    r = _parity("nccl-probe", "--report", str(tmp_path))
    assert r.returncode == 2 and "probe.json" in r.stderr
    (tmp_path / "probe.json").write_text(json.dumps({"format": "x"}))
    r = _parity("nccl-probe", "--report", str(tmp_path))
    assert r.returncode == 2 and "did not finish" in r.stderr


# ------------------------------------------------------------------------- --sizes-from RUN


def test_sizes_from_a_recorded_run_are_its_reduce_scatter_buckets(tmp_path):
    from parity.artifacts import read_run
    from tests.synth import make_run

    run = make_run(tmp_path / "run", world_size=4, steps=1, n_params=8)
    rs = [b for b in read_run(run).ranks[0].buckets if b["collective"] == "reduce_scatter"]
    got, notes = pc.sizes_from_run(str(run), 4)
    assert notes == []
    assert sorted(c for _, _, c, _ in got) == sorted(
        {b["total_bytes"] // 4 for b in rs})  # per-rank output counts, exactly as recorded
    assert all(coll == "reduce_scatter" and dt == "float32" for coll, dt, _, _ in got)
    assert all(o.startswith("run: reduce_scatter bucket #") for *_, o in got)
    # at 8 ranks: re-derived as FSDP2 shards them (dim-0 rows rounded up per rank)
    at8, notes8 = pc.sizes_from_run(str(run), 8)
    assert notes8 == [] and len(at8) == len(got)
    assert all(c8 < c4 for (_, _, c8, _), (_, _, c4, _) in zip(
        sorted(at8, key=lambda x: x[3]), sorted(got, key=lambda x: x[3])))
    cases = pc.build_cases([1024], 4, ops=["sum"], recorded=got)
    assert {c.origin for c in cases} >= {o for *_, o in got}
    with pytest.raises(ParityError, match="--sizes-from .*not a parity run"):
        pc.sizes_from_run(str(tmp_path), 4)


# ------------------------------------------------ the cluster's topology, rebuilt from logs


def test_every_ranks_ring_lines_rebuild_the_rings(tmp_path):
    """Per-rank logs as NCCL 2.27 prints them at init (``initTransportsRank`` in src/init.cc:
    the communicator line, ``N coll channels``, and ``Ring %02d : prev -> rank -> next``)."""
    from parity.probe.rank import _plan

    rings = ((0, 1, 3, 2), (1, 0, 2, 3), (0, 1, 3, 2), (1, 0, 2, 3))
    texts = []
    for r in range(4):
        pre = f"host{r // 2}:{100 + r}:{200 + r} [{r % 2}] NCCL INFO "
        lines = [pre + "NCCL version 2.27.5+cuda12.9",
                 pre + f"comm 0x{r + 1:x}000 rank {r} nRanks 4 nNodes 2 localRanks 2 "
                       f"localRank {r % 2} MNNVL 0"]
        for c, ring in enumerate(rings):
            i = ring.index(r)
            lines.append(pre + f"Ring {c:02d} : {ring[i - 1]} -> {r} -> {ring[(i + 1) % 4]}")
        lines.append(pre + "4 coll channels, 4 collnet channels, 0 nvls channels, 4 p2p "
                           "channels, 2 p2p channels per peer")
        texts.append("\n".join(lines) + "\n")
    out = tmp_path / "probe"
    (out / LOGS_DIR).mkdir(parents=True)
    plan = _plan(out, None, None, texts, 4)
    cluster = Topology.from_dict(plan["cluster"])
    from_zero = tuple(r[r.index(0):] + r[:r.index(0)] for r in rings)  # a ring read from rank 0
    assert cluster.rings == from_zero and (cluster.nodes, cluster.gpus) == (2, 2)
    assert cluster.nccl == "2.27" and plan["checked"] == plan["cluster"]
    assert sorted(plan["log_files"]) == [f"{LOGS_DIR}/{log_name(r)}" for r in range(4)]
    assert (out / LOGS_DIR / log_name(3)).read_text() == texts[3]  # kept when DIR is not shared


def test_real_logs_give_the_probe_their_rings_and_channel_counts(tmp_path):
    """Excerpts of real clusters' logs (tests/data/nccl-logs, sources in its README) as rank 0's
    log: the probe checks at the rings and channel count they hold, and says where it assumed."""
    from parity.probe.rank import _plan

    logs = Path(__file__).parent / "data" / "nccl-logs"
    out = tmp_path / "a"
    (out / LOGS_DIR).mkdir(parents=True)
    plan = _plan(out, None, None, [(logs / "nccl-1412-2x8.log").read_text()], 16)
    checked = Topology.from_dict(plan["checked"])
    assert (checked.nodes, checked.gpus, checked.channels, len(checked.rings)) == (2, 8, 8, 8)
    assert checked.rings[0] == (0, 5, 4, 7, 6, 3, 2, 1, 8, 13, 12, 15, 14, 11, 10, 9)
    out = tmp_path / "b"
    (out / LOGS_DIR).mkdir(parents=True)
    plan = _plan(out, None, None, [(logs / "nccl-1453-h100-3x8.log").read_text()], 24)
    checked = Topology.from_dict(plan["checked"])
    assert (checked.nodes, checked.gpus, checked.channels, len(checked.rings)) == (3, 8, 16, 16)
    ring = checked.rings[1]
    assert (ring[ring.index(0):] + ring[:ring.index(0)])[:10] == (
        0, 7, 6, 5, 4, 3, 2, 9, 8, 15)  # read from rank 0, the cut line's prefix
    assert any("an assumption" in n for n in plan["notes"])


# ------------------------------------------------------- a rank's identity and NCCL settings


def test_identity_from_torchrun_or_srun():
    from parity.probe.rank import identity

    assert identity({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}).how == "torchrun"
    i = identity({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"})
    assert (i.rank, i.world, i.local_rank, i.how) == (5, 16, 5, "srun")
    with pytest.raises(ParityError, match="every rank of a job"):
        identity({})


def test_nccl_logging_is_set_per_rank_and_keeps_the_users_subsystems(tmp_path):
    from parity.probe.rank import nccl_environment

    env, notes = nccl_environment(tmp_path, 7, (2, 27, 5),
                                  {"NCCL_DEBUG_SUBSYS": "NET", "NCCL_DEBUG_FILE": "/x/%h.log"})
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_DEBUG_SUBSYS"] == "NET,INIT,GRAPH,TUNING,ENV"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / LOGS_DIR / "nccl.rank-00007.log")
    assert env["NCCL_GRAPH_DUMP_FILE"] == str(tmp_path / LOGS_DIR / "nccl-graph.xml")
    assert any("NCCL_DEBUG_FILE=/x/%h.log replaced" in n for n in notes)
    old, _ = nccl_environment(tmp_path, 0, (2, 5, 6), {"NCCL_DEBUG_SUBSYS": "^COLL"})
    assert "NCCL_GRAPH_DUMP_FILE" not in old  # NCCL 2.6 added it
    assert old["NCCL_DEBUG_SUBSYS"] == "INIT,GRAPH,TUNING,ENV"
