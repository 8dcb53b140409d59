"""`parity bisect`: alignment logic (unit), rerun refusals (no job), and planted single-op
differences found by real 2-rank CPU reruns (eager vs eager, eager FSDP2 vs compiled)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity.bisect import analyse_rank, base_op, plan_rerun
from parity.errors import ParityError

TIMEOUT = 900
PLANT = "layers.1.ffn_norm"


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    for k in list(env):
        if k.startswith("PT_") or k.startswith("PARITY_"):
            del env[k]
    return env


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "parity", *map(str, args)], env=_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT)


def _train_argv(*train_args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "parity.workloads.train", "--steps", "2", *train_args]


def _recorded(d: Path, argv, cwd) -> Path:
    """A run directory holding only what `parity exec` records about the command (run.json)."""
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"argv": argv, "cwd": str(cwd)}))
    return d


# ---------------------------------------------------------------------------- unit: alignment
def _op(i, op, module, value, phase="forward", ins=None, shape=(4, 8), kind="compute", **kw):
    return {"i": i, "op": op, "kind": kind, "phase": phase, "module": module,
            "in": ins if ins is not None else [], "out": [{"shape": list(shape),
                                                          "dtype": "float32", "hash": value}], **kw}


def test_first_difference_in_reference_order_with_moved_and_extra_ops():
    a = [_op(0, "aten.mm.default", "l0.wq", "h1", ins=["x", "w"]),
         _op(1, "aten.mm.default", "l0.wk", "h2", ins=["x", "w2"]),
         _op(2, "aten.mul.Tensor", "l1.norm", "h3", ins=["h1", "r"]),
         _op(3, "aten.mul.Tensor", "l1.norm", "h4", ins=["h3", "w3"]),
         _op(4, "aten.view.default", "l1.norm", None, kind="view")]
    # B runs wk before wq (moved), recomputes a silu (extra), and multiplies in another order.
    b = [_op(0, "aten.mm.default", "l0.wk", "h2", ins=["x", "w2"]),
         _op(1, "aten.mm.default", "l0.wq", "h1", ins=["x", "w"]),
         _op(2, "aten.silu.default", "l0.ffn", "s"),
         _op(3, "aten.mul.Tensor", "l1.norm", "rw", ins=["r", "w3"]),
         _op(4, "aten.mul_.Tensor", "l1.norm", "h4b", ins=["h1", "rw"])]
    res = analyse_rank(a, b)
    assert res["verdict"] == "differs"
    first = res["first"]
    assert (first["a"]["op"], first["a"]["module"], first["a"]["index"]) == (
        "aten.mul.Tensor", "l1.norm", 2)
    assert res["last_match"]["a"]["index"] == 1 and res["last_match"]["b"]["index"] == 0
    assert res["not_aligned"] == {"a": 0, "b": 1}
    assert res["unaligned_groups"] == [{"phase": "forward", "module": "l0.ffn", "op": "silu",
                                        "a": 0, "b": 1}]
    assert res["not_compared"] == {"a": 1, "b": 0}


def test_inputs_verdicts():
    base = [_op(0, "aten.rsqrt.default", "n", "r", ins=["x"])]
    same = analyse_rank(base + [_op(1, "aten.mul.Tensor", "n", "A", ins=["x", "r"])],
                        base + [_op(1, "aten.mul.Tensor", "n", "B", ins=["x", "r"])])
    assert same["inputs"]["differed"] is False
    earlier = analyse_rank(base + [_op(1, "aten.mul.Tensor", "n", "A", ins=["x", "r"])],
                           base + [_op(1, "aten.mul.Tensor", "n", "B", ins=["x", "zz"])])
    assert earlier["inputs"]["differed"] is True and "never had" in earlier["inputs"]["detail"]


def test_count_mismatch_is_not_guessed():
    a = [_op(0, "aten.add.Tensor", "blk", "a1"), _op(1, "aten.add.Tensor", "blk", "a2")]
    b = [_op(0, "aten.add.Tensor", "blk", "b1"), _op(1, "aten.add.Tensor", "blk", "b2"),
         _op(2, "aten.add.Tensor", "blk", "b3")]
    res = analyse_rank(a, b)
    assert res["verdict"] == "no_aligned_difference" and res["first"] is None
    assert res["not_aligned"] == {"a": 2, "b": 3}
    assert analyse_rank(a, a)["verdict"] == "match"


def test_only_graphs_run_as_is_are_interpreted():
    import torch
    import torch.fx as fx
    from torch._dynamo.backends.debugging import boxed_nop

    from parity.capture.ops import runs_graph_as_is

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert runs_graph_as_is(gm, boxed_nop(gm, [])) and runs_graph_as_is(gm, gm)
    other = boxed_nop(fx.symbolic_trace(torch.nn.Linear(2, 2)), [])

    def wrapper(args):  # holds the graph AND another runner (like a CUDA-graph wrapper)
        return other(args) if gm else None

    assert not runs_graph_as_is(gm, wrapper) and not runs_graph_as_is(gm, other)


def test_base_op():
    assert base_op("aten.mul_.Tensor") == "mul"
    assert base_op("aten._to_copy.default") == "_to_copy"
    assert base_op("aten.__and__.Tensor") == "__and__"
    assert base_op("parity.grad") == "grad"


# ------------------------------------------------------------------------- unit: refusals
def test_refusals_name_what_is_missing(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ParityError, match="no command recorded") as e:
        plan_rerun("a", tmp_path / "empty", out)
    assert e.value.exit_code == 2
    (tmp_path / "multi" / "nodes" / "node-0").mkdir(parents=True)
    with pytest.raises(ParityError, match="multi-node"):
        plan_rerun("a", tmp_path / "multi", out)
    _recorded(tmp_path / "slurm", ["srun", "python", "train.py"], tmp_path)
    with pytest.raises(ParityError, match="srun"):
        plan_rerun("b", tmp_path / "slurm", out)
    _recorded(tmp_path / "remote", ["torchrun", "--rdzv-endpoint", "node7:29500", "train.py"],
              tmp_path)
    with pytest.raises(ParityError, match="rendezvous on node7"):
        plan_rerun("b", tmp_path / "remote", out)
    (tmp_path / "noargv").mkdir()
    (tmp_path / "noargv" / "run.json").write_text(json.dumps({"cwd": str(tmp_path)}))
    with pytest.raises(ParityError, match="records no command"):
        plan_rerun("a", tmp_path / "noargv", out)


def test_torchrun_options_that_would_collide_are_rewritten(tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-endpoint",
            "127.0.0.1:1234", "--log-dir", "/old/logs", "--standalone", "-m", "train",
            "--log-dir", "mine"]
    plan = plan_rerun("a", _recorded(tmp_path / "r", argv, tmp_path), tmp_path / "out")
    assert plan.argv[plan.argv.index("--log-dir") + 1] == str(tmp_path / "out" / "logs" / "a")
    assert plan.argv[plan.argv.index("--rdzv-endpoint") + 1] != "127.0.0.1:1234"
    assert plan.argv[-2:] == ["--log-dir", "mine"]  # the trainer's own options stay


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    (tmp_path / "a").mkdir()
    _recorded(tmp_path / "b", ["python", "x.py"], tmp_path)
    p = _cli("bisect", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "o")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "no command recorded" in p.stderr
    (tmp_path / "sweep" / "cells").mkdir(parents=True)
    p = _cli("bisect", tmp_path / "sweep", "--cell", "nope")
    assert p.returncode == 2 and "no cell 'nope'" in p.stderr
    (tmp_path / "sweep" / "cells" / "c1" / "reference").mkdir(parents=True)
    p = _cli("bisect", tmp_path / "sweep", "--cell", "c1")
    assert p.returncode == 2 and "reference" in p.stderr and "no command recorded" in p.stderr


# ------------------------------------------------------------------ integration: real reruns
def _report(out: Path) -> dict:
    import jsonschema

    rep = json.loads((out / "bisect.json").read_text())
    schema = json.loads((Path(__file__).resolve().parents[1] / "parity" / "schemas" /
                         "bisect.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(rep)
    return rep


def test_eager_vs_eager_planted_reorder_found_from_recorded_runs(tmp_path):
    """The full path: two `parity exec` runs, the diff picks the step, bisect names the op."""
    for side, extra in (("a", []), ("b", ["--reorder-op", PLANT])):
        p = _cli("exec", "--out", tmp_path / side, "--", *_train_argv("--mode", "eager", *extra),
                 cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
    p = _cli("bisect", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "bis", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    rep = _report(tmp_path / "bis")
    assert rep["step"] == 1 and rep["step_source"] == "first divergent step"
    first = rep["first"]["a"]
    assert first["module"] == PLANT and first["op"] == "aten.mul.Tensor"
    assert first["phase"] == "forward"
    assert rep["inputs"]["reordered"] is True
    assert rep["last_match"]["a"]["module"] == PLANT
    assert rep["not_aligned"] == {"a": 0, "b": 0}  # same program on both sides
    assert all(v["op"] == "aten.mul.Tensor" for v in rep["ranks"].values())
    assert f"first differing op: aten.mul.Tensor in {PLANT} (forward)" in p.stdout
    assert rep["warnings"] == []


def test_eager_fsdp2_vs_compiled_planted_reorder(tmp_path):
    a = _recorded(tmp_path / "a", _train_argv("--mode", "eager"), tmp_path)
    b = _recorded(tmp_path / "b", _train_argv("--mode", "compiled", "--bucket-order",
                                              "registration", "--reorder-op", PLANT), tmp_path)
    p = _cli("bisect", a, b, "--step", "1", "--rank", "1", "--out", tmp_path / "bis")
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    rep = _report(tmp_path / "bis")
    assert rep["rank"] == 1 and rep["a"]["process"] == "eager" and rep["b"]["process"] == "compiled"
    first = rep["first"]
    assert first["a"]["module"] == PLANT and first["a"]["op"] == "aten.mul.Tensor"
    assert first["b"]["module"] == PLANT and first["b"]["node"].startswith("forward#")
    assert rep["inputs"]["reordered"] is True
    assert rep["aligned"] > 400  # the compiled graphs' ops were matched to eager's
    assert rep["opaque_graph_runs"] == {"a": 0, "b": 0} and rep["warnings"] == []


def test_swapped_bucket_order_is_found_at_the_gradient(tmp_path):
    a = _recorded(tmp_path / "a", _train_argv("--mode", "eager"), tmp_path)
    b = _recorded(tmp_path / "b", _train_argv("--mode", "compiled", "--bucket-order", "swapped"),
                  tmp_path)
    p = _cli("bisect", a, b, "--step", "1", "--out", tmp_path / "bis")
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    rep = _report(tmp_path / "bis")
    first = rep["first"]["a"]
    # The first reduce-scatter bucket (layers.1) exchanges its two same-shape payloads: the
    # RMSNorm weights' gradients. Every compute op before it matched.
    assert first["op"] == "parity.grad" and first["param"] in (
        "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight")
    assert "reduce-scatter" in rep["inputs"]["detail"]
    assert rep["equal"] == rep["aligned"] - rep["differing_pairs"]


def test_op_capture_is_not_loaded_unless_bisect_asks(tmp_path):
    """Zero cost in normal runs: a rank's activation imports ops.py only with PARITY_OPS_STEP."""
    code = ("import os, sys, torch; from parity.capture import inject; inject._activate(torch); "
            "print('parity.capture.ops' in sys.modules); os.environ['PARITY_OPS_STEP'] = '2'; "
            "inject._activate(torch); print('parity.capture.ops' in sys.modules)")
    env = _env()
    env["PARITY_CAPTURE_DIR"] = str(tmp_path / "run")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.stdout.split() == ["False", "True"], p.stderr


def test_reorder_op_must_name_an_rmsnorm():
    p = subprocess.run([sys.executable, "-m", "parity.workloads.train", "--steps", "1",
                        "--reorder-op", "layers.0.attention"], env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "is not an RMSNorm module; known: layers.0.attention_norm" in p.stderr


# ------------------------------------------------- unit: what the recorded runs say, before reruns
def _no_rerun(monkeypatch):
    import parity.bisect as pb

    def rerun(*a, **k):
        raise AssertionError("rerun called")

    monkeypatch.setattr(pb, "rerun", rerun)
    return pb


def test_an_incomplete_pair_is_not_said_not_to_diverge(tmp_path, monkeypatch):
    """Found by a tester: bisect said "nothing to bisect: the runs do not diverge" (exit 0) on an
    interrupted run, a missing rank, damaged hashes. The pair is incomplete: exit 3, the diff's
    reason, nothing rerun."""
    sys.path.insert(0, str(Path(__file__).parent))
    from synth import make_run

    pb = _no_rerun(monkeypatch)
    a = make_run(tmp_path / "a", world_size=2, steps=4, n_params=8)
    for name, kw in (("short", {"stop_after": 2}), ("rank", {"missing_ranks": [1]}),
                     ("failed", {"status": "failed"})):
        b = make_run(tmp_path / name, world_size=2, steps=4, n_params=8, **kw)
        with pytest.raises(ParityError, match="the pair is incomplete") as e:
            pb.bisect(a, b, out_dir=tmp_path / "out", say=lambda m: None)
        assert e.value.exit_code == 3, name
    b = make_run(tmp_path / "same", world_size=2, steps=4, n_params=8)
    code, rep = pb.bisect(a, b, out_dir=tmp_path / "out", say=lambda m: None)
    assert code == 0 and rep["verdict"] == "nothing_to_bisect"


def test_rank_and_step_are_checked_before_rerunning(tmp_path, monkeypatch):
    """Found by a tester: `--rank 9` reran both jobs and only then exited 2; `--step 99` reran
    both and exited 3 "rerun failed". Both are usage errors found in the records (exit 2)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from synth import make_run

    pb = _no_rerun(monkeypatch)
    a = make_run(tmp_path / "a", world_size=2, steps=4, n_params=8)
    b = make_run(tmp_path / "b", world_size=2, steps=4, n_params=8, diverge_at=2)
    for kw, said in (({"rank": 9}, "--rank 9: the runs recorded rank(s) 0-1"),
                     ({"step": 99}, "--step 99: the runs recorded steps up to 4"),
                     ({"step": 2, "rank": 5}, "--rank 5")):
        with pytest.raises(ParityError, match=re.escape(said)) as e:
            pb.bisect(a, b, out_dir=tmp_path / "out", say=lambda m: None, **kw)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    p = _cli("bisect", a, b, "--rank", "9", "--out", tmp_path / "o")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "o").exists()  # nothing rerun, nothing written
