"""Issue 30, items 5, 6 and 8, on real torchrun jobs (gloo, 4 ranks, trainers in tests/trainers/
that import nothing from parity): every reduction of every step is compared and predicted (a
late gradient, hand-written all-reduces), the emulation is honest (HSDP across nodes emulated, a
sparse gradient named in one line and in the verdict), and what gloo itself does with a
consistent reorder, measured.

Jobs (module-scoped): late_grad.py with the adapter registered last / first, plain and emulated at
2x2:channels=4; side_allreduce.py (a flat buffer, packed in order / reversed) plain and emulated,
and one all-reduce per gradient, and over groups of two ranks ({0, 1} / {0, 2}); hsdp_fsdp2.py emulated at 4x1 (shard groups across nodes) twice,
plain with and without a reordered block; ddp_buckets.py with its layers registered in two
orders, and with a sparse embedding under emulation."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from parity.diff import diff_runs
from tests.real_jobs import capture, exe

REPO = Path(__file__).resolve().parent.parent
TRAINERS = REPO / "tests" / "trainers"
EMU = "2x2:channels=4"
JOBS = {  # name: (trainer, env, exec args)
    "late_a": ("late_grad.py", {}, []),
    "late_b": ("late_grad.py", {"LG_ADAPTER_FIRST": "1"}, []),
    "late_a_emu": ("late_grad.py", {}, ["--emulate-nccl", EMU]),
    "late_b_emu": ("late_grad.py", {"LG_ADAPTER_FIRST": "1"}, ["--emulate-nccl", EMU]),
    "side": ("side_allreduce.py", {}, []),
    "side_rev": ("side_allreduce.py", {"SA_REVERSED": "1"}, []),
    "side_emu": ("side_allreduce.py", {}, ["--emulate-nccl", EMU]),
    "side_rev_emu": ("side_allreduce.py", {"SA_REVERSED": "1"}, ["--emulate-nccl", EMU]),
    "side_each": ("side_allreduce.py", {"SA_MODE": "each"}, []),
    "side_pairs": ("side_allreduce.py", {"SA_GROUPS": "pairs"}, []),
    "side_strided": ("side_allreduce.py", {"SA_GROUPS": "strided"}, []),
    "hsdp_emu": ("hsdp_fsdp2.py", {}, ["--emulate-nccl", "4x1"]),
    "hsdp_emu_again": ("hsdp_fsdp2.py", {}, ["--emulate-nccl", "4x1"]),
    "hsdp": ("hsdp_fsdp2.py", {}, []),
    "hsdp_reorder": ("hsdp_fsdp2.py", {"HS_REORDER": "1"}, []),
    "ddp": ("ddp_buckets.py", {"DB_STEPS": "3"}, []),
    "ddp_reorder": ("ddp_buckets.py", {"DB_STEPS": "3", "DB_REORDER": "1"}, []),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("coverage")
    return {name: capture(root / name, [str(TRAINERS / trainer)], exec_args=args, env=env)
            for name, (trainer, env, args) in JOBS.items()}


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*exe("parity", "parity"), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO)


def _grads_at(a: Path, b: Path, step: int) -> set[str]:
    return {d.fqn for d in diff_runs(a, b).divergent if d.step == step and d.kind == "grad"}


def _buckets(run: Path, source: str) -> list[dict]:
    lines = (run / "rank-00000" / "buckets.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("source") == source]


# ------------------------------------------------------------------------- the late gradient


def test_a_late_gradient_is_compared_and_predicted_at_step_2(runs):
    """Step 1 packs the same two linears on both sides (the adapters have no gradient yet);
    step 2 packs the adapter last on A, first on B. The order comparison and --fail-on reduction
    see it without --at, the prediction at 2x2:channels=4 names step 2, and the emulated runs
    diverge at step 2 only in what was predicted."""
    plain = diff_runs(runs["late_a"], runs["late_b"])
    assert plain.verdict == "match"  # gloo at 4 ranks: a reduce-scatter reorder, no hash moves
    assert plain.order.verdict in ("order_differs", "partition_differs")
    assert any(p.detail.startswith("at step 2: ") for p in plain.order.pairs
               if p.collective == "reduce_scatter")
    assert plain.exit_code("reduction") == 1
    ro = diff_runs(runs["late_a"], runs["late_b"], at=EMU).reduction_order
    assert ro.verdict == "differs" and 2 in ro.steps
    assert ro.at_risk and all(x.step == 2 for x in ro.at_risk)
    emulated = diff_runs(runs["late_a_emu"], runs["late_b_emu"], at=EMU)
    assert emulated.first_divergent_step == 2  # step 1's layouts are the same on both sides
    seen = _grads_at(runs["late_a_emu"], runs["late_b_emu"], 2)
    assert seen and seen <= emulated.reduction_order.fqns()
    obs = emulated.reduction_order.observed
    assert obs["topology"] == EMU and obs["diverged"] == len(seen) and not obs["not_predicted"]


# --------------------------------------------------------------- hand-written all-reduces


def test_hand_written_all_reduces_are_recorded_compared_and_predicted(runs):
    flat = _buckets(runs["side"], "c10d")
    assert len(flat) == 1 and flat[0]["collective"] == "all_reduce"
    names = [e["fqn"] for e in flat[0]["entries"]]
    assert len(names) == 6 and None not in names  # the flat buffer's payloads, by value
    rev = [e["fqn"] for e in _buckets(runs["side_rev"], "c10d")[0]["entries"]]
    assert rev == names[::-1]
    each = _buckets(runs["side_each"], "c10d")
    assert [e["fqn"] for r in each for e in r["entries"]] == names  # one per gradient
    # the order comparison: an all-reduce difference is a reduction difference on its own
    p = _cli("diff", str(runs["side"]), str(runs["side_rev"]), "--fail-on", "reduction")
    assert p.returncode == 1, p.stdout[-2000:]
    assert "all_reduce bucket 0" in p.stdout.splitlines()[0]
    r = diff_runs(runs["side"], runs["side_rev"], at=EMU)
    assert r.reduction_order.verdict != "same"
    assert any(b["collective"] == "all_reduce" for b in r.to_dict()["reduction_order"]["buckets"]
               + r.to_dict()["reduction_order"]["unknown"])
    # emulated (Ring): the side module's gradients diverge at step 1, every one predicted at
    # risk once Ring is pinned; unpinned, NCCL may run the all-reduce as Tree: unknown
    seen = _grads_at(runs["side_emu"], runs["side_rev_emu"], 1)
    assert seen and seen <= set(names)
    ring = diff_runs(runs["side_emu"], runs["side_rev_emu"], at=EMU + ",algo=Ring")
    assert ring.reduction_order.verdict == "differs" and seen <= ring.reduction_order.fqns()
    tree = diff_runs(runs["side_emu"], runs["side_rev_emu"], at=EMU).reduction_order
    assert tree.verdict == "unknown" and any("Tree" in u["reason"] for u in tree.unknown)


def test_the_same_all_reduce_over_other_ranks_is_a_group_difference(runs):
    """Hand-written all-reduces over groups of two ranks, {0, 1} / {2, 3} against {0, 2} /
    {1, 3} (a mesh and its transpose), the side module fed the same input on every rank: the
    values are equal here, but at scale the two groupings sit elsewhere on the network. Each
    line records its group's ranks; the comparison says the group differs (it read "bucket
    layouts identical" and ``same sums`` at 2x8 before), the prediction does not place them."""
    a, b = runs["side_pairs"], runs["side_strided"]
    for run, r0, r3 in ((a, [0, 1], [2, 3]), (b, [0, 2], [1, 3])):
        assert [x["ranks"] for x in _buckets(run, "c10d")] == [r0]
        lines = (run / "rank-00003" / "buckets.jsonl").read_text().splitlines()
        assert [x["ranks"] for x in map(json.loads, lines) if x["source"] == "c10d"] == [r3]
    p = _cli("diff", str(a), str(b), "--fail-on", "any")
    first = p.stdout.splitlines()[0]
    assert p.returncode == 1 and "bucket group differs (all_reduce bucket 0: group ranks [0, 1] " \
        "in A, [0, 2] in B)" in first and "hashes bitwise identical" in first, p.stdout[-2000:]
    assert _cli("diff", str(a), str(b)).returncode == 0  # the values: equal
    r = diff_runs(a, b, at="2x8")
    ro = r.reduction_order
    assert ro.verdict == "unknown" and any("groups of other ranks" in u["reason"]
                                           for u in ro.unknown), ro.unknown
    assert r.exit_code("reduction") == 3


# ----------------------------------------------------------------------------------- HSDP


def test_hsdp_whose_shard_groups_span_two_nodes_is_emulated(runs):
    meta = json.loads((runs["hsdp_emu"] / "rank-00000" / "meta.json").read_text())
    emu = meta["nccl_emulation"]
    assert emu["groups"] == {"4x1": 1, "2x1": 2}  # the world, a shard and a replicate group
    assert emu["not_emulated"] == {} and emu["emulated"]["reduce_scatter"] >= 3
    assert emu["emulated"]["all_reduce"] >= 3
    r = diff_runs(runs["hsdp_emu"], runs["hsdp_emu_again"])
    assert r.verdict == "match" and not r.incomplete and r.exit_code("reduction") == 0


def test_hsdp_replicate_all_reduces_are_predicted_at_the_target(runs):
    ar = _buckets(runs["hsdp"], "c10d")
    assert ar and all(r["group"] == "fsdp2 replicate" and r["world_size"] == 2 for r in ar)
    # each line's group: rank 0's shard group {0, 1} (FSDP2's lines), replicate group {0, 2}
    assert all(r["ranks"] == [0, 2] for r in ar)
    rs = _buckets(runs["hsdp"], "fsdp2")
    assert rs and all(r["ranks"] == [0, 1] for r in rs)
    r = diff_runs(runs["hsdp"], runs["hsdp_reorder"], at="8x8")
    ro = r.reduction_order
    assert ro.verdict != "same"
    assert any("HSDP at 8x8" in a for a in ro.assumptions)
    groups = {(b["collective"], b["group"]) for b in r.to_dict()["reduction_order"]["buckets"]}
    kinds = {u["collective"] for u in ro.unknown} | {c for c, _ in groups}
    assert "all_reduce" in kinds
    assert all(g.startswith("1x8") for c, g in groups if c == "reduce_scatter")
    assert all(g.startswith("8x1") for c, g in groups if c == "all_reduce")


# -------------------------------------------------------------------------------------- DDP


def test_ddp_buckets_are_recorded_compared_and_predicted(runs):
    """DDP's C++ Reducer all-reduces its buckets where no Python hook sees them; capture reads
    their layout from DDP itself: the initial bucket at step 1 (in parameter order: DDP fills it
    from the first parameter on; it was written reversed until round 9a, which checked it
    against the bytes sent), the buckets rebuilt in gradient-ready order from step 2 on."""
    recs = [r for r in _buckets(runs["ddp"], "c10d") if r["group"] == "ddp"]
    by_step: dict[int, list] = {}
    for r in recs:
        by_step.setdefault(r["step"], []).append([e["fqn"] for e in r["entries"]])
    assert sorted(by_step) == [1, 2]
    assert by_step[1] == [["a.weight", "a.bias", "b.weight", "b.bias", "head.weight",
                           "head.bias"]]
    assert [f for b in by_step[2] for f in b] == ["head.bias", "head.weight", "b.bias",
                                                  "b.weight", "a.bias", "a.weight"]
    assert len(by_step[2]) == 2
    r = diff_runs(runs["ddp"], runs["ddp_reorder"], at="2x2:algo=Ring")
    assert r.a.bucket_source == r.b.bucket_source == "c10d"  # the header: not "manifests: none"
    assert any(p.collective == "all_reduce" and p.verdict != "identical" for p in r.order.pairs)
    assert r.exit_code("reduction") == 1
    ro = r.reduction_order
    assert ro.verdict == "differs" and {x.bucket["collective"] for x in ro.at_risk} == {
        "all_reduce"}


# ---------------------------------------------------------------------- sparse gradient


def test_a_sparse_gradient_is_one_line_and_named_in_the_verdict(tmp_path):
    run = tmp_path / "sparse"
    cmd = [*exe("parity", "parity"), "exec", "--emulate-nccl", EMU, "--out", str(run), "--",
           *exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node", "4",
           str(TRAINERS / "ddp_buckets.py")]
    import os

    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DB_SPARSE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    said = [x for x in p.stderr.splitlines() if "NOT emulated" in x]
    assert len(said) == 1 and "sparse" in said[0]
    meta = json.loads((run / "rank-00001" / "meta.json").read_text())["nccl_emulation"]
    assert any("sparse" in k for k in meta["not_emulated"])
    again = shutil.copytree(run, tmp_path / "again")
    r = diff_runs(run, again)
    assert r.verdict == "incomplete" and any("not emulated" in x and "sparse" in x
                                             for x in r.incomplete)
    d = _cli("diff", str(run), str(again))
    assert d.returncode == 3 and "not emulated" in d.stdout.splitlines()[0]


# ----------------------------------------------------------------------- gloo, measured


@pytest.mark.parametrize("world", [2, 4])
def test_what_a_consistent_reorder_does_on_gloo(tmp_path, world):
    """The claim the README and docs make, measured (torch's gloo): at 2 ranks a consistent
    reorder changes no element; at 4 a reduce-scatter changes a few elements per layout (gloo's
    ring segments round up, so a row's last elements are summed in the neighbour row's order)
    and an all-reduce of a flat buffer changes many."""
    import os

    out = tmp_path / "gloo.json"
    p = subprocess.run([*exe("torchrun", "torch.distributed.run"), "--standalone",
                        "--nproc_per_node", str(world), str(TRAINERS / "gloo_reorder.py"),
                        str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    if world == 2:
        assert sum(got["reduce_scatter"]) == 0 and sum(got["all_reduce"]) == 0
    else:
        assert 0 < sum(got["reduce_scatter"]) and max(got["reduce_scatter"]) <= 32
        assert sum(got["all_reduce"]) > got["all_reduce_elements"] // 10
