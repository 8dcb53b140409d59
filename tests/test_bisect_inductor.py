"""`parity bisect` through a real inductor job (issue 22 item 2): an FSDP2 trainer whose blocks
are compiled with inductor (tests/trainers/compiled_region.py) against the same trainer run
eagerly. Inductor's fused bfloat16 norm rounds differently from eager's ops; bisect must name
the inductor graph as where the difference enters, detected by what torch produced (an inductor
``OutputCode``), never the reduce-scatter (the bucket layouts are identical). The same blocks
compiled with aot_eager are recorded op by op: a planted formula change is found inside the
graph."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.bisect import analyse_rank
from parity.rundir import read_ops

TIMEOUT = 900
TRAINER = Path(__file__).resolve().parent / "trainers" / "compiled_region.py"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_", "PARITY_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(args, cwd, **extra):
    p = subprocess.run([sys.executable, "-m", "parity", *map(str, args)], env=_env(**extra),
                       cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    return p


def _job(*flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(TRAINER), *flags]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bisect_inductor")
    for side, flags in (("a", []), ("b", ["--backend", "inductor"])):
        p = _run(["exec", "--out", d / side, "--", *_job(*flags)], d)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    bis = _run(["bisect", d / "a", d / "b", "--out", d / "bis"], d)
    # aot_eager with a planted formula change, recorded at step 1 as a bisect rerun records it
    aot = _run(["exec", "--out", d / "c", "--", *_job("--backend", "aot_eager", "--alt-norm")],
               d, PARITY_OPS_STEP="1", PARITY_OPS_EXIT="1")
    return d, bis, aot


def test_inductor_graph_is_named_where_the_difference_enters(runs):
    d, p, _ = runs
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    rep = json.loads((d / "bis" / "bisect.json").read_text())
    # the blocks are compiled, the model around them is not: its ops are recorded op by op
    assert rep["a"]["process"] == "eager" and rep["b"]["process"] == "mixed"
    assert rep["bucket_layouts"] == "identical"
    # the headline (second line) names the inductor graph, by what torch produced
    head = p.stdout.splitlines()
    line = head[1]
    assert line.startswith("first difference: inside inductor graph forward#"), p.stdout
    assert "not recorded op by op (B" in line
    assert rep["headline"]["kind"] == "region"
    assert rep["enters"]["side"] == "B" and "inductor graph forward#" in rep["enters"]["region"]
    detail = rep["inputs"]["detail"]
    assert "inside inductor graph" in detail
    assert "reduce-scatter" not in detail and "bucketing" not in detail
    assert "reduce-scatter" not in line
    # the embedding, the output layer and the loss ran eagerly around the blocks: compared
    assert rep["too_few_ops"] is None
    # the backend torch.compile was asked for, and the fact that inductor ran
    meta, _ = read_ops(d / "bis" / "b", rep["rank"])
    assert meta["compile_backends"] == ["inductor"]
    assert any("(CompiledFxGraph, inductor)" in w for w in rep["warnings"])


def test_aot_eager_graph_is_recorded_op_by_op(runs):
    d, p, aot = runs
    assert aot.returncode == 0, aot.stdout + aot.stderr[-3000:]
    rank = json.loads((d / "bis" / "bisect.json").read_text())["rank"]
    meta, recs = read_ops(d / "c", rank)
    assert meta["process"] == "mixed" and meta["compile_backends"] == ["aot_eager"]
    assert meta["graphs_run"] >= 2 and not any(r["kind"] == "opaque" for r in recs)
    nodes = [r for r in recs if str(r.get("node", "")).startswith("forward#")]
    assert any(r["module"] == "layers.0.norm" and r["op"] == "aten.sqrt.default" for r in nodes)
    # against the eager rerun's ops: the planted formula is found inside the compiled graph
    _, a_recs = read_ops(d / "bis" / "a", rank)
    res = analyse_rank(a_recs, recs, "identical")
    first = res["first"]
    assert res["verdict"] == "differs" and first["a"]["module"] == "layers.0.norm"
    assert first["a"]["phase"] == "forward" and first["b"]["node"].startswith("forward#")
    assert res["enters"] is None  # nothing opaque: the op itself is named
