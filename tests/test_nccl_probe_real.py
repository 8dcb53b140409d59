"""``parity nccl-probe`` as real 4-rank torchrun jobs on gloo (``--emulate-nccl``, no GPU):

* at the emulated topology itself the probe agrees 100% with the model, writes a topology file
  that ``parse_topology`` loads, and ``--report`` gives the verdict;
* checked at a deliberately different topology (other rings; another channel count) it finds the
  disagreement and names the first case, the element, the model's order and the cluster ring that
  does reproduce NCCL's (here: the emulation's) bits;
* the topology file drives ``parity exec --emulate-nccl FILE`` and ``parity diff --at FILE``, both
  of which name the file and its agreement figure;
* ``--spec`` starts the probe with a sweep spec's local launcher as 2 nodes x 2 ranks (two
  torchrun agents meeting by c10d rendezvous).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from parity.nccl import parse_topology, ring_families, reduce_scatter_segments
from tests.real_jobs import capture, exe

REPO = Path(__file__).resolve().parent.parent
REORDER = str(REPO / "tests" / "trainers" / "reorder_fsdp2.py")
CLUSTER = "2x2:channels=4"
SMALL = ["--sizes", "1K-256K"]  # reaches 4 channels at 2x2
QUICK = [*SMALL, "--dtypes", "fp32", "--ops", "sum", "--repeat", "1"]


def probe(out: Path, *args: str, nproc: int = 4, check: bool = True):
    cmd = [*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
           str(nproc), "-m", "parity", "nccl-probe", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=600, env=env)
    if check and r.returncode != 0:
        pytest.fail(f"probe exit {r.returncode}\n{r.stderr[-3000:]}")
    return r


def parity(*args, cwd=None):
    return subprocess.run([*exe("parity", "parity"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("probe") / "ok"
    return out, probe(out, "--emulate-nccl", CLUSTER, *SMALL)


def test_at_the_emulated_topology_the_probe_agrees_100_percent(agreeing):
    out, r = agreeing
    assert "MODEL HOLDS: agreement 100.0%: 72 of 72 modelled cases bit-identical" in r.stdout
    assert "repeats identical in 72 of 72 cases" in r.stdout
    assert re.search(r"^256 KiB\s+ok c4 S\s+ok c4 S\s+ok c4 S\s+ok c4 S$", r.stdout, re.M)
    doc = json.loads((out / "topology.json").read_text())
    assert doc["probe"]["agreement"]["percent"] == 100.0
    assert doc["probe"]["agreement"]["elements_differ"] == 0
    topo = parse_topology(str(out / "topology.json"))
    assert (topo.nodes, topo.gpus, topo.algorithm) == (2, 2, "Ring")
    assert topo.rings == tuple(ring_families(parse_topology(CLUSTER))[0].rings)
    assert (out / "report.txt").read_text().strip().splitlines()[-1].startswith("MODEL HOLDS")
    assert sorted(p.name for p in (out / "ranks").iterdir()) == [
        f"rank-{r:05d}.json" for r in range(4)]
    rep = parity("nccl-probe", "--report", str(out))
    assert rep.returncode == 0 and "MODEL HOLDS" in rep.stdout
    again = probe(out, "--emulate-nccl", "1x1", "--sizes", "1K", nproc=1, check=False)
    assert again.returncode != 0 and "already holds a probe" in again.stderr


def _first(out: Path) -> dict:
    rec = json.loads((out / "probe.json").read_text())
    first = rec["analysis"]["agreement"]["first_disagreement"]
    return next(j for j in rec["analysis"]["cases"] if j["case"] == first)


def _cluster_channel(case: dict, element: int) -> int:
    """The channel the emulated cluster sums a reduce-scatter's per-rank offset on."""
    topo = parse_topology(CLUSTER)
    for seg in reduce_scatter_segments(topo, case["count"], 4):
        if seg.lo <= element < seg.hi:
            return seg.channel
    raise AssertionError(element)


@pytest.mark.parametrize("model, why", [
    ("2x2:channels=4,nics=1", "other rings: every channel enters each node at GPU 0"),
    ("2x2:channels=2", "another channel count"),
])
def test_a_different_topology_disagrees_and_the_first_case_is_named(tmp_path, model, why):
    out = tmp_path / "other"
    r = probe(out, "--emulate-nccl", CLUSTER, "--model", model, *QUICK)
    assert "MODEL DOES NOT HOLD" in r.stdout, why
    assert "first disagreement: reduce_scatter sum fp32" in r.stdout
    rep = parity("nccl-probe", "--report", str(out))
    assert rep.returncode == 1 and "MODEL DOES NOT HOLD" in rep.stdout
    first = _first(out)
    d = first["first"]
    assert first["status"] == "differs" and first["collective"] == "reduce_scatter"
    assert d["expected"] != d["observed"] and len(d["inputs"]) == 4
    # the cluster's own ring for this element and rank reproduces NCCL's bits
    cluster_rings = ring_families(parse_topology(CLUSTER))[0].rings
    true_ring = cluster_rings[_cluster_channel(first, d["element"])]
    named = d["reproduced_by"]["named"]
    hits = [re.match(r"cluster channel (\d+)'s ring, owner (\d+)", n) for n in named]
    assert any(h and cluster_rings[int(h.group(1))] == true_ring and int(h.group(2)) == d["rank"]
               for h in hits), named
    # every smaller case agreed: this is the first
    rec = json.loads((out / "probe.json").read_text())
    assert all(j["status"] == "agree" for j in rec["analysis"]["cases"]
               if j["case"] < first["case"])


def test_the_topology_file_drives_emulation_and_prediction(agreeing, tmp_path):
    out, _ = agreeing
    file = str(out / "topology.json")
    base = capture(tmp_path / "base", [REORDER], exec_args=["--emulate-nccl", file])
    moved = capture(tmp_path / "moved", [REORDER], exec_args=["--emulate-nccl", file],
                    env={"RO_REORDER": "1,3"})
    meta = json.loads((base / "rank-00000" / "meta.json").read_text())
    assert meta["nccl_emulation"]["topology_file"]["agreement"]["percent"] == 100.0
    d = parity("diff", str(base), str(moved), "--at", file, "--json", str(tmp_path / "d.json"))
    head = d.stdout.splitlines()[0]
    assert f"reduction order at {file} [nccl-probe agreement 100.0%]" in head, head
    ro = json.loads((tmp_path / "d.json").read_text())["reduction_order"]
    ro = ro[0] if isinstance(ro, list) else ro
    assert ro["topology_file"]["summary"].startswith("agreement 100.0%: 72 of 72")


def test_exec_says_the_file_and_its_agreement(agreeing, tmp_path):
    out, _ = agreeing
    r = parity("exec", "--emulate-nccl", str(out / "topology.json"), "--out",
               str(tmp_path / "run"), "--", "true")
    assert f"--emulate-nccl: topology file {out / 'topology.json'}: agreement 100.0%" in r.stderr


def two_node_spec(path: Path, launcher: str, emulate: str | None = None) -> Path:
    """A sweep spec of 2 nodes x 2 ranks (its sides are never run by the probe)."""
    path.write_text(textwrap.dedent(f"""\
        name = "probe"
        nproc_per_node = 2
        nnodes = 2
        timeout = 300
        {f'emulate_nccl = "{emulate}"' if emulate else ''}
        [env]
        OMP_NUM_THREADS = "1"
        [launcher]
        type = "{launcher}"
        [reference]
        builtin = true
        args = ["--mode", "eager"]
        [candidate]
        builtin = true
        args = ["--mode", "compiled"]
        """))
    return path


def test_a_sweep_specs_launcher_starts_the_probe_on_two_nodes(tmp_path):
    spec = two_node_spec(tmp_path / "spec.toml", "local", CLUSTER)
    out = tmp_path / "viaspec"
    r = parity("nccl-probe", "--spec", str(spec), "--out", str(out), *QUICK, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 node(s) x 2 rank(s) with the local launcher" in r.stderr
    assert "MODEL HOLDS: agreement 100.0%" in r.stdout
    rec = json.loads((out / "probe.json").read_text())
    assert rec["world"] == 4 and rec["emulate"] == CLUSTER
    assert (out / "job" / "console.log").exists()


def test_one_rank_is_a_copy_and_says_so(tmp_path):
    """What a one-GPU machine runs (here on gloo): every collective a copy, the plumbing checked."""
    out = tmp_path / "one"
    r = probe(out, "--emulate-nccl", "1x1", *QUICK, nproc=1)
    assert "one rank: every reduce-scatter and all-reduce is a copy" in r.stdout
    assert "MODEL HOLDS: agreement 100.0%: 18 of 18 modelled cases" in r.stdout
    assert parse_topology(str(out / "topology.json")).world == 1
