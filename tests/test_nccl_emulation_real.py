"""Prediction and emulation agree (issue 20), on real 4-rank torchrun jobs: every parameter whose
step-1 gradient differs under NCCL emulation is in the predicted at-risk set (parity diff --at,
branch i20a's parity/diff/reduction.py); a difference inside one channel predicts nothing and
emulates to `match`; identical emulated runs match; the compiled workload's registration order
matches eager FSDP2 bitwise under emulation while its backward-graph order diverges.

Jobs (module-scoped, 1 step each, all at 2x2:channels=4 - forced: these tiny models would
otherwise get one channel): tests/trainers/reorder_fsdp2.py (eager FSDP2) twice as is, and once
with block 1 (a bucket spanning channels) and block 3 (a bucket inside one channel's first cell)
registered in another order; the built-in workload (eager, compiled graph order, compiled
registration order). And the op's scaling: reorder_fsdp2.py reduce-scattering with SUM and
dividing after (``RO_FORCE_SUM``) against FSDP2's AVG (NCCL: every payload times 1/g first), at 3
ranks (1x3) and 4 (2x2)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from parity.diff import diff_runs
from parity.diff.reduction import predict_runs
from tests.real_jobs import capture, exe

REPO = Path(__file__).resolve().parent.parent
REORDER = str(REPO / "tests" / "trainers" / "reorder_fsdp2.py")
CH4 = "2x2:channels=4"
JOBS = {  # name: (topology, entry argv, env)
    "base": (CH4, [REORDER], {}),
    "base_again": (CH4, [REORDER], {}),
    "reorder": (CH4, [REORDER], {"RO_REORDER": "1,3"}),
    "eager": (CH4, ["-m", "parity.workloads.train", "--steps", "1", "--mode", "eager"], {}),
    "graph": (CH4, ["-m", "parity.workloads.train", "--steps", "1", "--mode", "compiled",
                    "--bucket-order", "graph"], {}),
    "registration": (CH4, ["-m", "parity.workloads.train", "--steps", "1", "--mode", "compiled",
                           "--bucket-order", "registration"], {}),
}


SCALED = {  # name: (ranks, topology, env)
    "avg3": (3, "1x3:channels=4", {}),
    "sum3": (3, "1x3:channels=4", {"RO_FORCE_SUM": "1"}),
    "sum4": (4, CH4, {"RO_FORCE_SUM": "1"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("emulated")
    return {name: capture(root / name, entry, exec_args=["--emulate-nccl", topo], env=extra)
            for name, (topo, entry, extra) in JOBS.items()}


def _grads_differing_at_step_1(a: Path, b: Path) -> set[str]:
    r = diff_runs(a, b)
    return {d.fqn for d in r.divergent if d.step == 1 and d.kind == "grad"}


def test_identical_emulated_runs_match(runs):
    assert diff_runs(runs["base"], runs["base_again"]).verdict == "match"


def test_a_reorder_across_channels_diverges_only_where_predicted(runs):
    emulated = _grads_differing_at_step_1(runs["base"], runs["reorder"])
    predicted = predict_runs(runs["base"], runs["reorder"], CH4).fqns()
    assert emulated, "the reorder crosses channels: some gradient must change"
    assert emulated <= predicted
    assert all(f.startswith("layers.1.") for f in emulated)  # only the reordered big block
    assert all(f.startswith("layers.1.") for f in predicted)


def test_a_reorder_inside_one_channel_predicts_nothing_and_matches(runs):
    """Block 3's payload order changed too, but its bucket lies in one channel."""
    emulated = _grads_differing_at_step_1(runs["base"], runs["reorder"])
    predicted = predict_runs(runs["base"], runs["reorder"], CH4).fqns()
    assert not any(f.startswith("layers.3.") for f in emulated | predicted)
    # and the order did change there: the manifests say so
    r = diff_runs(runs["base"], runs["reorder"])
    moved = {e["fqn"] for p in r.order.pairs if p.collective == "reduce_scatter"
             for row in p.rows if not row["same"] for e in (row["a"], row["b"]) if e}
    assert {"layers.3.first.weight", "layers.3.second.weight"} <= moved


def test_registration_order_holds_bitwise_and_graph_order_diverges(runs):
    reg = diff_runs(runs["eager"], runs["registration"])
    assert reg.verdict == "match"
    emulated = _grads_differing_at_step_1(runs["eager"], runs["graph"])
    predicted = predict_runs(runs["eager"], runs["graph"], CH4).fqns()
    assert emulated and emulated <= predicted
    assert not predict_runs(runs["eager"], runs["registration"], CH4).fqns()


def test_the_ops_scaling_diverges_where_predicted_and_only_there(runs, tmp_path_factory):
    """AVG against SUM divided after, the same layout and summation order: at 4 ranks (1/4
    exact) the runs match bitwise and the prediction says the same sums; at 3 (1/3 rounds) the
    emulation diverges and every divergent gradient is predicted (``why: scaling``). The
    prediction said "same" at 3 before the op's scaling was modelled."""
    root = tmp_path_factory.mktemp("scaled")
    got = {name: capture(root / name, [REORDER], nproc=n, exec_args=["--emulate-nccl", topo],
                         env=env) for name, (n, topo, env) in SCALED.items()}
    assert diff_runs(runs["base"], got["sum4"]).verdict == "match"
    four = predict_runs(runs["base"], got["sum4"], CH4)
    assert four.verdict == "same" and not four.fqns()
    assert any("powers of two" in x for x in four.to_dict()["assumptions"])
    emulated = _grads_differing_at_step_1(got["avg3"], got["sum3"])
    three = predict_runs(got["avg3"], got["sum3"], "1x3:channels=4")
    assert emulated and emulated <= three.fqns() and three.verdict == "differs"
    assert {x["why"] for x in three.to_dict()["at_risk"]} == {"scaling"}


def test_runs_emulated_under_other_topologies_are_refused(runs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(runs["base"], other)
    for m in other.glob("rank-*/meta.json"):
        m.write_text(m.read_text().replace('"topology": "2x2:channels=4"', '"topology": "2x2"'))
    p = subprocess.run([*exe("parity", "parity"), "diff", str(runs["base"]), str(other)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "different NCCL topologies" in p.stderr
