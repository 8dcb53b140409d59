"""`parity diff` on real captures of the built-in workload (eager FSDP2 vs compiled SimpleFSDP).

Four 2-rank CPU jobs of 3 steps, captured once per module with `parity exec` (about a minute each
on a busy 2-core machine): eager; compiled with buckets in FSDP2 registration order; compiled with
buckets in graph order; compiled with a gradient perturbed on rank 1 at step 2.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity.diff import diff_runs
from parity.report.console import make_console, print_diff

REPO = Path(__file__).resolve().parent.parent
PERTURBED = "layers.0.attention.wk.weight"
JOBS = {
    "eager": ["--mode", "eager"],
    "registration": ["--mode", "compiled", "--bucket-order", "registration"],
    "graph": ["--mode", "compiled", "--bucket-order", "graph"],
    "perturbed": ["--mode", "compiled", "--bucket-order", "registration",
                  "--perturb-grad", f"1:2:{PERTURBED}"],
}

pytestmark = pytest.mark.skipif(
    not (REPO / "parity/capture/launch.py").exists() or not (REPO / "parity/workloads/train.py").exists(),
    reason="needs parity exec (parity/capture/launch.py) and the built-in workload",
)


def _parity() -> list[str]:
    exe = shutil.which("parity", path=os.path.dirname(sys.executable)) or shutil.which("parity")
    return [exe] if exe else [sys.executable, "-m", "parity"]


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("real")
    out = {}
    for name, args in JOBS.items():
        run = root / name
        cmd = [*_parity(), "exec", "--out", str(run), "--", *_torchrun(), "--standalone",
               "--nproc_per_node", "2", "-m", "parity.workloads.train", "--steps", "3", *args]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        out[name] = run
    return out


def _render(result) -> str:
    buf = io.StringIO()
    print_diff(result, make_console(file=buf))
    return buf.getvalue()


def test_registration_order_matches_with_identical_layouts(runs):
    r = diff_runs(runs["eager"], runs["registration"])
    assert r.verdict == "match", _render(r)
    assert r.steps_compared == [0, 1, 2, 3] and r.ranks_compared == [0, 1]
    assert r.kinds_compared == ["param", "grad"] and r.loss.captured
    assert (r.order.a_source, r.order.b_source) == ("fsdp2", "graph")
    assert r.order.verdict == "identical", _render(r)
    assert r.order.compared == ["all_gather", "reduce_scatter"]
    assert {p: r.exit_code(p) for p in ("hash", "order-only", "any")} == {
        "hash": 0, "order-only": 0, "any": 0}


def test_graph_order_matches_hashes_but_names_the_reduce_scatter_reorder(runs):
    r = diff_runs(runs["eager"], runs["graph"])
    assert r.verdict == "match", _render(r)  # a consistent reorder changes no hash on CPU/gloo
    assert r.order.verdict == "order_differs"
    fb = r.order.first_bucket
    assert fb is not None and fb["verdict"] == "order_differs"
    assert fb["a"]["fqn"] != fb["b"]["fqn"] and fb["a"]["offset"] is not None
    rs = [p for p in r.order.pairs if p.collective == "reduce_scatter" and p.verdict == "order_differs"]
    assert rs, _render(r)
    first_rs = rs[0]
    assert first_rs.position is not None
    assert first_rs.a_entry["fqn"] != first_rs.b_entry["fqn"]
    assert isinstance(first_rs.a_entry["offset"], int) and isinstance(first_rs.b_entry["offset"], int)
    assert r.exit_code("hash") == 0 and r.exit_code("order-only") == 1
    text = _render(r)
    assert "PAYLOAD ORDER DIFFERS" in text and fb["a"]["fqn"] in text


def test_perturbed_gradient_is_reported_at_its_step_rank_and_bucket(runs):
    r = diff_runs(runs["eager"], runs["perturbed"])
    assert r.verdict == "hash_mismatch"
    assert r.first_divergent_step == 2
    fd = r.first_divergence
    assert fd.grad_before_param and fd.origin == "backward" and fd.ranks == [1]
    grads = [d for d in r.divergent if d.kind == "grad"]
    assert [(d.fqn, d.ranks, d.step) for d in grads] == [(PERTURBED, [1], 2)]
    rs = grads[0].buckets["reduce_scatter"]
    assert rs["a"] is not None and rs["b"] is not None
    assert rs["a"]["group"] == "layers.0" and rs["a"]["offset"] == rs["b"]["offset"]
    assert r.exit_code("hash") == 1
    text = _render(r)
    assert PERTURBED in text and "step 2" in text


def test_perturbed_gradient_is_labelled_by_what_was_compared_and_sized(runs):
    """Issue 34: the label names what was compared ("loss equal, gradients differ"), never a
    pass; the size of each difference comes from the figures capture keeps next to each hash,
    and grows over the steps that follow."""
    r = diff_runs(runs["eager"], runs["perturbed"])
    fd = r.first_divergence
    assert fd.label == "loss equal, gradients differ"
    assert "look at the backward" not in fd.explanation and "do not tell which pass" in \
        fd.explanation
    text = _render(r)
    assert "Diverged first in" not in text and "[backward]" not in text
    assert text.splitlines()[0].startswith("PARITY FAILS under --fail-on hash (exit 1): hash "
                                           "mismatch from step 2 on rank 1 (loss equal, "
                                           "gradients differ)")
    m = r.magnitude
    assert m["recorded"] and m["params"][0]["fqn"] == PERTURBED
    first = m["params"][0]["steps"][0]
    assert first["step"] == 2 and first["rel"] > 0 and first["ulps"] > 1
    steps = [s["step"] for s in m["per_step"]]
    assert steps == [2, 3] and m["per_step"][0]["rank"] == 1
    # after the optimizer step every parameter of rank 1 differs: the difference spreads
    assert m["per_step"][1]["param"]["differ"] > m["per_step"][0]["param"]["differ"]
    assert "rel >=" in text and "not proofs" in text
    same = diff_runs(runs["eager"], runs["registration"])
    assert same.verdict == "match" and same.magnitude == {}
