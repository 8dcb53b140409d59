"""Round 9b: compiled-graph bucket manifests against what the graph actually sends, with real
processes. tests/trainers/round9b.py (which imports nothing from parity) compiles a
SimpleFSDP-style model with its own ``aot_autograd`` backend applying torch's bucketing passes
and runs the final graph with an ``fx.Interpreter`` that saves the concrete input of every
``_c10d_functional`` collective it executes (inductor: a ``TorchDispatchMode`` entered inside
inductor's compiled forward/backward); tests/round9b_truth.py checks every ``"source":
"graph"`` manifest entry against those bytes, the parameters' local shards and their sharded
gradients, and that every executed collective is in the manifest.

Found and fixed:

- an all-gather in bfloat16 of float32 parameters (the cast before the collective), torch
  2.13's default bucket mode, aot backend and inductor alike: the pass folds the cast into the
  bucket (``copy_(slice(bf16 buffer), cat(fp32 shards))``) and parity read the entries in the
  shards' dtype: every offset and size doubled, "entries cover 1448 bytes of a 724-byte
  payload" (graph_walk.py: the copy's destination dtype);
- a tied weight (one parameter read by two modules): its two reduce-scatters meet in an ``add``
  before the gradient output, and both were recorded as ``payload: activation`` with no name,
  so the parameter's gradient was in no named entry (graph.py: every path forward searched,
  as graph_makefx.py does for make_fx graphs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, exe, knob_env, run_ok, run_table, values_equal
from tests.round9b_truth import problems

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round9b.py")
PARITY = [sys.executable, "-m", "parity"]
TIMEOUT = 900

CAP = {"R9_CAP": "0.0005"}  # 524 bytes: the model splits into several buckets per graph
JOBS = {  # name: trainer knobs; "plain": run without parity exec as well
    "graph": {**CAP, "plain": True},
    "graph_again": {**CAP},
    "registration": {**CAP, "R9_ORDER": "registration"},
    "mixed": {**CAP, "R9_PDTYPE": "bf16", "R9_RDTYPE": "bf16", "R9_PAD": "1",
              "R9_REPLICATE": "1"},  # biases replicated: their gradients all-reduced, bucketed
    "shapes": {"R9_TIED": "1", "R9_UNUSED": "1", "R9_FROZEN": "1", "R9_REDUCE": "sum",
               "R9_PASS": "plain", "R9_ACT": "1"},  # + an activation gathered, one all-reduced
    "four": {"R9_PAD": "1", "R9_PASS": "manual", "R9_ORDER": "registration",
             "R9_REPLICATE": "1", "nproc": 4},
    "inductor": {**CAP, "R9_BACKEND": "inductor", "R9_TDM": "inner", "R9_PDTYPE": "bf16",
                 "plain": True},
    # parity's own compiled workload, bf16 all-gathers bucketed by bucket_fsdp_* (default mode)
    "workload": {"entry": [str(HERE / "round9b_workload.py"), "--mode", "compiled",
                           "--bucketing", "auto", "--param-dtype", "bfloat16", "--steps", "2",
                           "--layers", "2", "--dim", "32", "--vocab-size", "64", "--seq-len", "8"]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, exit code, stderr)}; ``name.plain``: the same job without parity."""
    root = tmp_path_factory.mktemp("round9b")
    table = {}
    for name, knobs in JOBS.items():
        knobs = dict(knobs)
        if knobs.pop("plain", False):
            table[name + ".plain"] = knobs
        table[name] = knobs

    def start(name, knobs):
        out = root / name
        knobs["R9_SAVE"] = str(out) + ".truth"
        cmd = [*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
               str(knobs.pop("nproc", 2)), *knobs.pop("entry", [TRAINER])]
        if not name.endswith(".plain"):
            cmd = [*PARITY, "exec", "--out", str(out), "--", *cmd]
        return out, subprocess.Popen(cmd, env=knob_env("R9_", **knobs), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=HERE.parent)

    return run_table(table, start, at_once=2, timeout=TIMEOUT)



def _load(d: Path, rank: int = 0) -> dict:
    return torch.load(f"{d}.truth" + (f".{rank}" if rank else ""), weights_only=False)


@pytest.mark.parametrize("name", [n for n in JOBS])
def test_every_graph_manifest_entry_is_what_the_graph_sends(runs, name):
    """Each entry's bytes are its parameter's shard (all-gather, exact) or its slice reduces to
    the parameter's gradient and no other slice does (reduce-scatter); every executed collective
    is in the manifest. mixed (bf16 all-gather and reduce, padded shards) failed before the
    dtype fix: entries in float32 at doubled offsets; shapes (a tied weight, an unused and a
    frozen layer, ``sum``) before the naming fix: the tied weight's reduce-scatters marked
    ``activation``; workload (parity's own, ``--bucketing auto --param-dtype bfloat16``) before
    the dtype fix, as mixed."""
    d = run_ok(runs, name)
    found = problems(d, f"{d}.truth")
    assert not found, "\n".join(found[:10])
    graph = [b for b in (d / "rank-00000" / "buckets.jsonl").read_text().splitlines()
             if '"source":"graph"' in b and "before_passes" not in b]
    assert graph, "no graph manifest"


def test_the_check_finds_a_wrong_manifest(runs, tmp_path):
    """The ground-truth check is not vacuous: two parameters' names exchanged in one
    reduce-scatter bucket line and an all-gather offset moved, in a copy of a right run, are
    each reported."""
    import json
    import shutil

    d = run_ok(runs, "graph")
    for what in ("swap", "shift"):
        copy = tmp_path / what
        shutil.copytree(d, copy)
        path = copy / "rank-00000" / "buckets.jsonl"
        lines, done = [], False
        for line in path.read_text().splitlines():
            b = json.loads(line)
            if (not done and b.get("source") == "graph" and b.get("stage") != "before_passes"
                    and len(b["entries"]) >= 2):
                e = b["entries"]
                if what == "swap" and b["collective"] == "reduce_scatter":
                    e[0]["fqn"], e[1]["fqn"] = e[1]["fqn"], e[0]["fqn"]
                    done = True
                elif what == "shift" and b["collective"] == "all_gather":
                    e[1]["offset"] += 4
                    done = True
            lines.append(json.dumps(b))
        path.write_text("\n".join(lines) + "\n")
        assert done
        found = problems(copy, f"{d}.truth")
        assert found and all(x.startswith("rank 0 ") for x in found), found


def _first_differing(a: Path, b: Path, kind: str) -> int | None:
    """Ground truth of "the first bucket whose payload order differs": the index, among the
    executed collectives of ``kind`` in step 0 on rank 0, of the first whose input differs
    between A and B (their values are equal: only the packing can differ)."""
    ra = [r for r in _load(a)["records"] if r["step"] == 0 and kind in r["op"]]
    rb = [r for r in _load(b)["records"] if r["step"] == 0 and kind in r["op"]]
    for i, (x, y) in enumerate(zip(ra, rb)):
        if not values_equal(x["input"], y["input"]):
            return i
    return None


def test_payload_order_pair_fails_on_the_first_reordered_bucket(runs):
    """Graph order against FSDP2 registration order, equal values: ``--fail-on any`` fails and
    names the reduce-scatter bucket whose executed input first differs."""
    a, b = run_ok(runs, "graph"), run_ok(runs, "registration")
    assert values_equal(_load(a)["grads"], _load(b)["grads"])
    index = _first_differing(a, b, "reduce_scatter")
    assert index is not None and _first_differing(a, b, "all_gather") is None
    rc, line, d = diff_cli(a, b, "--fail-on", "any")
    assert rc == EXIT_MISMATCH and "bucket order differs (reduce_scatter bucket" in line, line
    first = d["order"]["first_bucket"]
    assert (first["collective"], first["index"]) == ("reduce_scatter", index), first


def test_identical_pair_holds(runs):
    a, b = run_ok(runs, "graph"), run_ok(runs, "graph_again")
    rc, line, _ = diff_cli(a, b, "--fail-on", "any")
    assert rc == EXIT_OK and "bucket layouts identical" in line, line


def _compiled(d: Path) -> dict:
    """Dynamo's counters and the graphs compiled, less the compile caches' counters (off under
    ``parity exec`` by design: a cache hit would give no manifest; docs/capture.md)."""
    extra = _load(d)["extra"]
    counters = {k: {c: n for c, n in v.items() if "cache" not in c}
                for k, v in extra["counters"].items()}
    return {"counters": counters, "graphs": extra["graphs"]}


@pytest.mark.parametrize("name", ["graph", "inductor"])
def test_capture_changes_nothing(runs, name):
    """Values (every step's shards, gradients, losses, the final model, every collective's
    input), dynamo's counters and the graphs compiled are those of the run without parity."""
    d, alone = run_ok(runs, name), run_ok(runs, name + ".plain")
    for rank in (0, 1):
        x, y = _load(d, rank), _load(alone, rank)
        for key in ("shards", "grads", "losses", "model"):
            assert values_equal(x[key], y[key]), key
        assert values_equal([r["input"] for r in x["records"]], [r["input"] for r in y["records"]])
    assert _compiled(d) == _compiled(alone)
