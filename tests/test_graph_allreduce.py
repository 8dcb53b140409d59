"""All-reduces inside compiled training graphs as bucket manifests (issue 30 item 5: "all-reduce
buckets ... every reduction of every step", for compiled jobs).

A graph's ``_c10d_functional.all_reduce`` / ``all_reduce_`` / ``all_reduce_coalesced`` becomes a
bucket line with collective ``all_reduce``, in the layout the c10d source records for eager
all-reduces (capture/sources/c10d_allreduce.py): byte offsets over the whole buffer, one entry per
gradient, ``op``, the group's size and sub-group ``ranks``. The walk is checked on FX graphs that
torch's own all-reduce bucketing pass merged (``bucket_all_reduce``, torch 2.13
``torch/_inductor/fx_passes/bucketing.py``), the diff on recorded records and on real 2-rank gloo
jobs (tests/trainers/compiled_allreduce.py, which imports nothing from parity): captured without
changing the job, compared with eager all-reduces packing the same gradients.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parity.capture.sources.graph_walk import extract_buckets, rs_payload_map
from test_graph_subgraphs import group  # noqa: F401 - the fake process group fixture

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "tests" / "trainers" / "compiled_allreduce.py"
AR = torch.ops._c10d_functional.all_reduce
WAIT = torch.ops._c10d_functional.wait_tensor


GRADS = {"l1.weight": (8, 6), "l1.bias": (6,), "l2.weight": (5, 6)}


def _backward_graph(group: str, order: list[str]):
    """A backward graph that all-reduces each weight gradient (one functional all-reduce each,
    issued in ``order``), as aot_autograd traces a replicated model's backward; outputs in
    parameter order."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def bwd(x, dy, dz):
        grads = {"l1.weight": x.t() @ dy, "l1.bias": dy.sum(0), "l2.weight": dz.t() @ dy}
        reduced = {f: WAIT(AR(grads[f], "sum", group)) for f in order}
        return [reduced[f] for f in GRADS]

    return make_fx(bwd, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 6),
                                            torch.randn(4, 5))


@pytest.mark.parametrize("order", [list(GRADS), list(GRADS)[::-1]])
def test_inductor_bucketed_all_reduce_is_one_bucket_in_issue_order(group, order):
    from torch._inductor.fx_passes.bucketing import bucket_all_reduce

    gm = _backward_graph(group, order)
    outputs = list(GRADS)
    pre = rs_payload_map(gm, outputs)  # before the pass: each gradient's input chain
    assert set(pre.values()) == set(GRADS)
    bucket_all_reduce(gm, lambda idx: 1000.0)
    gm.recompile()
    names = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert names.count("all_reduce.default") == 1 and "cat.default" in names
    warnings: list[str] = []
    buckets = extract_buckets(gm, [None] * 3, outputs, "backward", warnings=warnings,
                              rs_payload_fqns=pre)
    assert warnings == []
    (b,) = buckets
    d = b.to_dict()
    assert (d["source"], d["collective"], d["graph"]) == ("graph", "all_reduce", "backward")
    assert d["op"] == "sum" and d["world_size"] == dist.get_world_size() and "ranks" not in d
    assert "coalesced" not in d
    sizes = [4 * torch.Size(GRADS[f]).numel() for f in order]
    offsets = [sum(sizes[:i]) for i in range(len(order))]
    assert [e["fqn"] for e in d["entries"]] == order
    assert [e["offset"] for e in d["entries"]] == offsets
    assert [e["size"] for e in d["entries"]] == sizes
    assert [e["shape"] for e in d["entries"]] == [list(GRADS[f]) for f in order]
    assert d["total_bytes"] == sum(sizes) and d["dtype"] == "float32"
    assert all("payload" not in e for e in d["entries"])
    # a gradient's reduction is its parameter's module's, as for a reduce-scatter
    assert [e["module"] for e in d["entries"]] == [f.rsplit(".", 1)[0] for f in order]


def test_coalesced_sub_group_in_place_and_metric_all_reduces(group):
    """``all_reduce_coalesced`` of two gradients (one entry each, ``coalesced``), an integer
    count on a sub-group (``token``, its ranks), a loss reduced in place (``all_reduce_``, what
    inductor's reinplacing makes of the functional form): ``activation``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ranks = list(range(dist.get_world_size() - 1))
    sub = dist.new_group(ranks)

    def f(a, b, tok):
        outs = torch.ops._c10d_functional.all_reduce_coalesced([a * 2, b * 2], "avg", group)
        outs = [WAIT(o) for o in outs]
        t = WAIT(AR(tok, "sum", sub.group_name))
        loss = a.sum() * 1.0
        torch.ops._c10d_functional.all_reduce_(loss, "sum", group)
        return [*outs, t, WAIT(loss)]

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 2), torch.randn(5),
                                         torch.ones(2, dtype=torch.int64))
    warnings: list[str] = []
    got = [b.to_dict() for b in extract_buckets(gm, [None] * 3, ["p.a", "p.b", None, None],
                                                "backward", warnings=warnings)]
    assert warnings == []
    # a reduce-scatter and an all-gather on the sub-group carry its ranks too (2026-11-28:
    # the diff compares them), those on the whole world none
    n = len(ranks)

    def g(x):
        rs = WAIT(torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", n, sub.group_name))
        ag = WAIT(torch.ops._c10d_functional.all_gather_into_tensor(rs, n, sub.group_name))
        world = dist.get_world_size()
        return ag, WAIT(torch.ops._c10d_functional.all_gather_into_tensor(rs, world, group))

    gm2 = make_fx(g, tracing_mode="fake")(torch.randn(4 * n, 2))
    rs, ag, ag_world = [b.to_dict() for b in extract_buckets(gm2, [], [None], "backward",
                                                            warnings=warnings)]
    assert (rs["collective"], rs["ranks"], ag["collective"], ag["ranks"]) == (
        "reduce_scatter", ranks, "all_gather", ranks)
    assert "ranks" not in ag_world
    co, tok, loss = got
    assert [(e["fqn"], e["offset"], e["size"]) for e in co["entries"]] == [
        ("p.a", 0, 24), ("p.b", 24, 20)]
    assert co["op"] == "avg" and co["coalesced"] is True and co["total_bytes"] == 44
    assert [e["payload"] for e in tok["entries"]] == ["token"] and tok["dtype"] == "int64"
    assert tok["world_size"] == len(ranks) and tok["ranks"] == ranks
    assert [(e["fqn"], e["payload"]) for e in loss["entries"]] == [(None, "activation")]
    assert loss["node"] == "all_reduce_" and [b["index"] for b in got] == [0, 1, 2]


def test_a_statistic_reduced_on_the_way_to_one_gradient_is_not_that_gradient(group):
    """Round 9c: loss parallel under tensor parallelism (torchtitan GraphTrainer, TP 2 x FSDP 2)
    all-reduces each chunk's per-token logit max and sum of exponentials (32 floats); in the
    joint graph they reach lm_head's gradient output only, and parity named those all-reduces
    ``lm_head.weight`` (24 entries of 128 bytes said to carry a [1024, 256] gradient). A
    payload smaller than the gradient it reaches is no gradient: ``activation``; the
    gradient's own all-reduce keeps its name."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from parity.capture.sources.graph_grads import reduce_scatter_targets

    def step(x, w, target):
        logits = x @ w.t()  # [tokens, vocab shard]
        top = WAIT(AR(logits.detach().amax(-1), "max", group))  # loss parallel's statistics
        ex = (logits - top[:, None]).exp()
        total = WAIT(AR(ex.sum(-1), "sum", group))
        loss = (total.log() + top - logits.gather(1, target[:, None])[:, 0]).sum()
        dlogits = ex / total[:, None]  # d loss / d logits, less the one-hot
        grad = WAIT(AR(dlogits.t() @ x, "sum", group))  # the gradient's own reduction
        return [loss, grad]

    gm = make_fx(step, tracing_mode="fake")(torch.randn(32, 8), torch.randn(16, 8),
                                            torch.zeros(32, dtype=torch.int64))
    outputs = [None, "lm_head.weight"]
    names = reduce_scatter_targets(gm, outputs)
    got = [b.to_dict() for b in extract_buckets(gm, [None, "lm_head.weight", None], outputs,
                                                "joint", rs_payload_fqns=names)]
    assert [(b["op"], b["total_bytes"], [(e["fqn"], e.get("payload")) for e in b["entries"]])
            for b in got] == [("max", 128, [(None, "activation")]),
                              ("sum", 128, [(None, "activation")]),
                              ("sum", 512, [("lm_head.weight", None)])]


# ------------------------------------------------------------------------------------ the diff
SHAPES = {"fc1.weight": [16, 8], "fc1.bias": [16], "fc2.weight": [4, 16], "fc2.bias": [4]}


def _ar(source, fqns, **kw):
    """An all-reduce bucket line of whole gradients, as either source writes it."""
    entries, off = [], 0
    for f in fqns:
        n = int(torch.Size(SHAPES[f]).numel()) if f else 1
        entries.append({"fqn": f, "offset": off, "size": 4 * n, "numel": n, "dtype": "float32",
                        "shape": SHAPES.get(f, [])} | ({} if f else {"payload": "activation"}))
        off += 4 * n
    rec = {"source": source, "collective": "all_reduce", "step": 1, "index": kw.pop("index", 0),
           "group": "g", "dtype": "float32", "world_size": 2, "total_bytes": off,
           "entries": entries, "op": "sum"}
    if source == "graph":
        rec |= {"graph": "backward", "graph_id": 0, "node": "all_reduce"}
    return rec | kw


def _diff(tmp_path, a_recs, b_recs):
    from tests.synth import make_run

    from parity.diff import diff_runs

    names = list(SHAPES)
    a = make_run(tmp_path / "a", world_size=2, steps=1, fqns=names, bucket_layout=None,
                 extra_buckets=a_recs)
    b = make_run(tmp_path / "b", world_size=2, steps=1, fqns=names, bucket_layout=None,
                 extra_buckets=b_recs)
    return diff_runs(a, b)


def test_eager_and_compiled_all_reduces_are_compared(tmp_path):
    order = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
    same = _diff(tmp_path / "same", [_ar("c10d", order)], [_ar("graph", order)])
    assert same.order.verdict == "identical" and "all_reduce" in same.order.compared
    assert not same.order.structure
    other = _diff(tmp_path / "other", [_ar("c10d", order[::-1])], [_ar("graph", order)])
    assert other.order.verdict == "order_differs"
    fb = other.order.first_bucket
    assert fb["collective"] == "all_reduce" and fb["position"] == 0
    # a graph recorded before its passes is context, not the layout that runs
    before = _diff(tmp_path / "before", [_ar("c10d", order)],
                   [_ar("graph", order[::-1], stage="before_passes"), _ar("graph", order)])
    assert before.order.verdict == "identical"


def test_all_reduces_one_side_lacks_are_said_not_compared(tmp_path):
    """The eager side's all-reduces ran where no source sees them (a functional collective run
    eagerly, a C++ hook): no bucket-order difference, no `identical`, a note."""
    order = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
    r = _diff(tmp_path / "none", [], [_ar("graph", order)])
    assert r.order.verdict == "unavailable" and "all_reduce" not in r.order.compared
    assert any("only B recorded all-reduce buckets" in n for n in r.order.notes)
    # the eager side recorded its loss all-reduce only: the gradients' are still one-sided
    r = _diff(tmp_path / "loss", [_ar("c10d", [None])],
              [_ar("graph", [None], graph="forward"), _ar("graph", order, index=1)])
    assert r.order.verdict == "unavailable" and not r.order.pairs
    assert any("only B recorded all-reduce buckets of gradients" in n for n in r.order.notes)
    # both sides' gradients, a metric all-reduce on one side only: said, not a moved bucket
    r = _diff(tmp_path / "metric", [_ar("c10d", order)],
              [_ar("graph", [None], graph="forward"), _ar("graph", order, index=1)])
    assert r.order.verdict == "identical"
    assert any("1 all-reduce(s) of B carrying no parameter" in n for n in r.order.notes)


# ----------------------------------------------------------------------------- real jobs (gloo)
def _job(tmp_path: Path, name: str, args: list[str], capture: bool) -> tuple[dict, Path]:
    from real_jobs import exe

    out, result = tmp_path / name, tmp_path / f"{name}-result"
    cmd = [*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node", "2",
           str(TRAINER), *args, "--result", str(result)]
    if capture:
        cmd = [*exe("parity", "parity"), "exec", "--out", str(out), "--", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and not capture and _teardown_abort(proc.stderr, result):
        # torch's own exit, not parity (this job runs without it): once in CI, 2026-11-26,
        # rank 1 of the plain job aborted ("terminate called without an active exception",
        # SIGABRT) after both ranks had written their results; 0 in 42 runs since. Run it again
        shutil.rmtree(result)
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
    if proc.returncode != 0 and not capture and _broken_pass(proc.stderr):
        pytest.skip(f"torch {torch.__version__}'s bucket_all_reduce leaves a graph that fails "
                    f"without parity ({_broken_pass(proc.stderr)}): the trainer's --bucket mode "
                    f"needs torch >= 2.13")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((result / f"rank-{r}.json").read_text()) for r in (0, 1)], out


def _broken_pass(stderr: str) -> str | None:
    """torch 2.11's ``bucket_all_reduce`` on this trainer's backward graph (checked
    2026-11-27, the plain job: no parity in it) leaves a node used before the line that
    defines it: every rank fails in the graph module with an UnboundLocalError. The error
    line on such a torch, else None (2.13+: the job must pass)."""
    if torch.__version__ >= "2.13":
        return None
    for line in stderr.splitlines():
        if "UnboundLocalError: cannot access local variable" in line:
            return line.split("]:", 1)[-1].strip()
    return None


def _teardown_abort(stderr: str, result: Path) -> bool:
    """A rank aborted by the C++ runtime after every rank had written its result."""
    return ("terminate called without an active exception" in stderr
            and all((result / f"rank-{r}.json").is_file() for r in (0, 1)))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graph_allreduce")
    return {name: _job(tmp, name, args, capture)
            for name, args, capture in (
                ("plain", ["--bucket"], False),
                ("compiled", ["--bucket"], True),
                ("eager_same", ["--mode", "eager", "--eager-sync", "flat-reversed"], True),
                ("eager_other", ["--mode", "eager", "--eager-sync", "flat"], True))}


def _buckets(run: Path, rank: int) -> list[dict]:
    path = run / f"rank-{rank:05d}" / "buckets.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_compiled_job_records_its_all_reduce_buckets_unchanged(jobs):
    plain, _ = jobs["plain"]
    captured, run = jobs["compiled"]
    assert captured == plain  # capture did not change the job: same losses, no recompile
    assert [x["unique_graphs"] for x in captured] == [x["unique_graphs"] for x in plain] == [1, 1]
    meta = json.loads((run / "rank-00000" / "meta.json").read_text())
    assert meta["capture"]["disabled"] is None and not meta.get("warnings")
    for rank in (0, 1):
        after = [b for b in _buckets(run, rank) if b["collective"] == "all_reduce"
                 and b.get("stage") != "before_passes"]
        fwd = [b for b in after if b["graph"] == "forward"]
        bwd = [b for b in after if b["graph"] == "backward"]
        # the loss all-reduced for logging: a metric, no parameter
        assert [[e.get("payload") for e in b["entries"]] for b in fwd] == [["activation"]]
        (b,) = bwd  # inductor's pass merged the four gradient all-reduces into one buffer
        assert b["source"] == "graph" and b["world_size"] == 2 and b["op"] == "sum"
        assert [e["fqn"] for e in b["entries"]] == ["fc2.bias", "fc2.weight", "fc1.bias",
                                                      "fc1.weight"]
        assert [e["offset"] for e in b["entries"]] == [0, 16, 272, 336]
        assert b["total_bytes"] == 848 and b["around_bucketing"]["before"] == 4
        before = [x for x in _buckets(run, rank) if x["collective"] == "all_reduce"
                  and x.get("stage") == "before_passes" and x["graph"] == "backward"]
        assert len(before) == 4 and all(len(x["entries"]) == 1 for x in before)


def test_eager_and_compiled_all_reduce_buckets_are_diffed(jobs):
    from parity.diff import diff_runs

    _, compiled = jobs["compiled"]
    same = diff_runs(jobs["eager_same"][1], compiled)
    assert same.verdict == "match"
    assert same.order.verdict == "identical" and "all_reduce" in same.order.compared
    other = diff_runs(jobs["eager_other"][1], compiled)
    assert other.order.verdict == "order_differs"
    assert other.order.first_bucket["collective"] == "all_reduce"
    # the eager job's loss all-reduce (``funcol.all_reduce`` run eagerly) is recorded since
    # round 13a (capture/sources/eager_funcol.py) and paired with the compiled side's: no
    # longer one-sided ("carrying no parameter ... no such all-reduce on the other side")
    assert not any("carrying no parameter" in n for n in other.order.notes)
    assert not any("carrying no parameter" in n for n in same.order.notes)
