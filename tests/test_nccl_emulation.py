"""NCCL Ring emulation (parity exec --emulate-nccl, parity/capture/nccl_emulation.py): the
launcher-side checks, and one real 4-rank gloo job whose every kind of reduction (eager
reduce-scatter and all-reduce with SUM/AVG in fp32/bf16, a compiled graph's functional
reduce-scatter, DTensor redistributions) must equal, bitwise, a pure-torch sum in the order the
model (parity/nccl) gives, computed here without any collective."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity.capture.emulation_launch import check_emulation, torchrun_world
from parity.errors import ParityError
from parity.nccl import (MODEL, all_reduce_segments, parse_topology, reduce_scatter_segments,
                         sum_order)

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "tests" / "trainers" / "emulated_collectives.py"
TOPO = "2x2:channels=4"
COUNT = 5000


def _exe(name: str, module: str) -> list[str]:
    exe = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    return [exe] if exe else [sys.executable, "-m", module]


def _parity(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*_exe("parity", "parity"), *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


# ------------------------------------------------------------------------- launcher side
def test_torchrun_world_is_read_from_the_command_line():
    assert torchrun_world(["torchrun", "--standalone", "--nproc_per_node", "4", "t.py"]) == 4
    assert torchrun_world(["torchrun", "--nnodes=2", "--nproc-per-node=2", "-m", "x"]) == 4
    assert torchrun_world([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--nnodes", "1", "t.py", "--nproc_per_node", "9"]) == 2
    assert torchrun_world(["torchrun", "--nnodes", "1:4", "--nproc_per_node", "2", "t"]) is None
    assert torchrun_world(["python", "train.py"]) is None
    assert check_emulation("2x2", ["torchrun", "--nproc_per_node", "4", "t.py"]) == "2x2"
    with pytest.raises(ParityError, match="needs 4 ranks"):
        check_emulation("2x2", ["torchrun", "--nproc_per_node", "2", "t.py"])


@pytest.mark.parametrize("topo,nproc,msg", [
    ("2x2", "2", "needs 4 ranks (NODES x GPUS); the command starts 2"),
    ("2by2", "4", "expected NODESxGPUS")])
def test_exec_refuses_before_starting_anything(tmp_path, topo, nproc, msg):
    p = _parity("exec", "--emulate-nccl", topo, "--out", str(tmp_path / "run"), "--",
                "torchrun", "--standalone", "--nproc_per_node", nproc, str(TRAINER), "x")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


def test_ring_sums_match_a_per_element_numpy_reference():
    """The arithmetic alone (no collectives): element by element, float32 numpy scalars added in
    sum_order of the element's channel ring give the same bits."""
    np = pytest.importorskip("numpy")
    import torch

    from parity.capture.nccl_emulation import all_reduce_rows, avg_scale, reduce_scatter_rows

    topo = parse_topology(TOPO)
    count = 40000  # 640 KB at 4 ranks: 4 channels
    rows = torch.randn(4, count, generator=torch.Generator().manual_seed(3))
    segs = reduce_scatter_segments(topo, count, 4)
    assert len({s.order for s in segs}) > 1
    for owner in range(4):
        got = reduce_scatter_rows(rows, owner, topo).numpy()
        for seg in segs:
            order = sum_order(seg.order, owner)
            for i in range(seg.lo, seg.hi, 97):
                acc = np.float32(rows[order[0], i].item())
                for s in order[1:]:
                    acc = np.float32(acc + np.float32(rows[s, i].item()))
                assert got[i].tobytes() == acc.tobytes(), (owner, i)
    got = all_reduce_rows(rows, topo).numpy()
    for seg in all_reduce_segments(topo, count, 4):
        i = seg.lo
        acc = np.float32(rows[seg.order[0], i].item())
        for s in seg.order[1:]:
            acc = np.float32(acc + np.float32(rows[s, i].item()))
        assert got[i].tobytes() == acc.tobytes()
    assert avg_scale(torch.float32, 3).item() == np.float32(1.0 / 3)
    assert avg_scale(torch.bfloat16, 3).dtype == torch.bfloat16


def test_a_groups_topology_is_the_cluster_its_ranks_make():
    from parity.capture.nccl_emulation import group_topology

    t = parse_topology("4x2:channels=4")
    assert group_topology(t, []) is t and group_topology(t, range(8)) is t
    assert (group_topology(t, [0, 2, 4, 6]).nodes, group_topology(t, [0, 2, 4, 6]).gpus) == (4, 1)
    assert (group_topology(t, [2, 3]).nodes, group_topology(t, [2, 3]).gpus) == (1, 2)
    assert (group_topology(t, [0, 1, 2, 3]).nodes, group_topology(t, [0, 1, 2, 3]).gpus) == (2, 2)
    assert "unequal" in group_topology(t, [0, 1, 2])
    assert "not ranks" in group_topology(t, [0, 9])


def _ring_arithmetic(device):
    """reduce_scatter_rows / all_reduce_rows on ``device`` equal the CPU computation bit for bit
    (bf16: one rounding per hop, in the dtype, on the device)."""
    import torch

    from parity.capture.nccl_emulation import all_reduce_rows, reduce_scatter_rows

    topo = parse_topology(TOPO)
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(4, 40000, generator=torch.Generator().manual_seed(5)).to(dtype)
        dev = rows.to(device)
        for owner in range(4):
            got = reduce_scatter_rows(dev, owner, topo)
            assert got.device.type == torch.device(device).type and got.dtype == dtype
            assert torch.equal(got.cpu(), reduce_scatter_rows(rows, owner, topo))
        got = all_reduce_rows(dev, topo)
        assert got.device.type == torch.device(device).type
        assert torch.equal(got.cpu(), all_reduce_rows(rows, topo))


def test_ring_arithmetic_on_cpu_tensors():
    pytest.importorskip("torch")
    _ring_arithmetic("cpu")


def test_ring_arithmetic_on_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _ring_arithmetic("cuda")


# ------------------------------------------------------------------------ a real job
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("emulation")
    p = _parity("exec", "--emulate-nccl", TOPO, "--out", str(root / "run"), "--",
                *_exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
                "4", str(TRAINER), str(root / "out"), cwd=root)
    if p.returncode != 0:
        pytest.fail(f"exit {p.returncode}\n{p.stderr[-3000:]}")
    import torch

    outs = [torch.load(root / "out" / f"rank{r}.pt") for r in range(4)]
    return root, outs


def _inputs(case, dtype):
    import torch

    n = 4 * COUNT
    out = []
    for r in range(4):
        g = torch.Generator().manual_seed(1000 + r + 17 * case)
        out.append(torch.randn(n, generator=g).to(dtype))
    return out


def _case(case, rank, numel):
    import torch

    g = torch.Generator().manual_seed(1000 + rank + 17 * case)
    return torch.randn(numel, generator=g)


def _scale(xs, avg):
    import torch

    if not avg:
        return xs
    s = torch.tensor(1.0 / 4, dtype=torch.float32).to(xs[0].dtype)  # NCCL: float(1.0/nRanks)
    return [x * s for x in xs]


def _ordered(parts, order):
    acc = parts[order[0]].clone()
    for s in order[1:]:
        acc = acc + parts[s]
    return acc


def _expected_rs(xs, owner, topo):
    import torch

    rows = [x[owner * COUNT:(owner + 1) * COUNT] for x in xs]
    out = torch.empty(COUNT, dtype=xs[0].dtype)
    for seg in reduce_scatter_segments(topo, COUNT, xs[0].element_size()):
        out[seg.lo:seg.hi] = _ordered([r[seg.lo:seg.hi] for r in rows],
                                      sum_order(seg.order, owner))
    return out


def _expected_ar(xs, topo):
    import torch

    out = torch.empty(xs[0].numel(), dtype=xs[0].dtype)
    for seg in all_reduce_segments(topo, xs[0].numel(), xs[0].element_size()):
        out[seg.lo:seg.hi] = _ordered([x[seg.lo:seg.hi] for x in xs], seg.order)
    return out


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def test_every_reduction_is_summed_in_the_models_ring_order(job):
    import torch

    _, outs = job
    topo = parse_topology(TOPO)
    assert len(reduce_scatter_segments(topo, COUNT, 4)) > 1  # the case spans channels
    cases = {0: (False, torch.float32), 1: (True, torch.float32), 2: (False, torch.bfloat16),
             3: (True, torch.bfloat16)}
    for case, (avg, dtype) in cases.items():
        xs = _scale(_inputs(case, dtype), avg)
        ar = _expected_ar(_scale(_inputs(10 + case, dtype), avg), topo)
        for r in range(4):
            assert _bits_equal(outs[r][f"rs{case}"], _expected_rs(xs, r, topo)), (case, r)
            assert _bits_equal(outs[r][f"ar{case}"], ar), (case, r)
    for key, case, kind in (("compiled_rs", 20, "rs"), ("dtensor_rs", 21, "rs"),
                            ("dtensor_ar", 22, "ar")):
        xs = _inputs(case, torch.float32)
        for r in range(4):
            want = _expected_rs(xs, r, topo) if kind == "rs" else _expected_ar(xs, topo)
            assert _bits_equal(outs[r][key], want), (key, r)
    # the sub-groups {0, 2} and {1, 3}: one rank on each node, a 2x1 cluster of their own
    from parity.capture.nccl_emulation import group_topology

    for ranks in ([0, 2], [1, 3]):
        sub = group_topology(topo, ranks)
        assert (sub.nodes, sub.gpus) == (2, 1)
        rs_in = [_case(30, r, 2 * COUNT) for r in ranks]
        ar_in = [_case(31, r, 2 * COUNT) for r in ranks]
        ar = _expected_ar(ar_in, sub)
        for i, r in enumerate(ranks):
            assert _bits_equal(outs[r]["group_rs"], _expected_rs(rs_in, i, sub)), r
            assert _bits_equal(outs[r]["group_ar"], ar), r


def test_the_emulated_order_is_not_gloos(job):
    """The emulation changed the numbers: a plain rank-order sum differs somewhere."""
    import torch

    _, outs = job
    xs = _inputs(0, torch.bfloat16)
    plain = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert not torch.equal(outs[0]["rs2"], plain[:COUNT])


def test_meta_records_the_emulation_and_diff_refuses_a_plain_run(job, tmp_path):
    root, _ = job
    run = root / "run"
    meta = json.loads((run / "rank-00000" / "meta.json").read_text())
    emu = meta["nccl_emulation"]
    assert emu["topology"] == TOPO and emu["model"] == MODEL
    assert emu["emulated"]["reduce_scatter"] >= 7 and emu["emulated"]["all_reduce"] >= 6
    assert emu["groups"].get("2x1:channels=4") == 1 and emu["not_emulated"] == {}
    assert json.loads((run / "run.json").read_text())["capture"]["emulate_nccl"] == TOPO
    same = shutil.copytree(run, tmp_path / "same")  # a directory with itself is incomplete
    assert _parity("diff", str(run), str(same)).returncode == 3  # and so is a copy of it
    for m in same.glob("rank-*/meta.json"):  # as if another process had recorded it
        d = json.loads(m.read_text())
        d["pid"] = d["pid"] + 100000
        m.write_text(json.dumps(d))
    assert _parity("diff", str(run), str(same)).returncode == 0
    plain = tmp_path / "plain"
    shutil.copytree(run, plain)
    for m in plain.glob("rank-*/meta.json"):
        d = json.loads(m.read_text())
        d.pop("nccl_emulation")
        m.write_text(json.dumps(d))
    r = json.loads((plain / "run.json").read_text())
    r["capture"].pop("emulate_nccl")
    (plain / "run.json").write_text(json.dumps(r))
    p = _parity("diff", str(run), str(plain))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "cannot compare an NCCL-emulated run with a plain one" in p.stderr
