"""Issue 13, "trustworthy verdicts": never a silent match, never a misleading cause.

Synthetic runs (tests/synth.py and a small RankWriter helper below) for what the diff decides;
the cases that involve processes are in tests/test_verdicts_real.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import make_run  # noqa: E402

from parity.artifacts import HASH_BYTES, RankWriter, write_json_atomic  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from parity.errors import ParityError  # noqa: E402


def _h(*key) -> bytes:
    return np.random.default_rng([abs(hash(k)) % (1 << 31) if isinstance(k, str) else k
                                  for k in key]).bytes(HASH_BYTES)


def write_run(out: Path, tables: dict[int, list[str]], steps: int = 2, *, loss=1.5,
              meta_extra: dict | None = None, no_grad_at: set[int] = frozenset(),
              run_status: str = "ok") -> Path:
    """A run whose rank r holds ``tables[r]``; a parameter's hash depends on (name, step) only,
    so the same name has the same hash whichever rank records it."""
    out.mkdir(parents=True)
    for r, names in tables.items():
        meta = {"world_size": len(tables), "capture": {"hasher": "xxh3", "warnings": []}}
        meta.update(meta_extra or {})
        w = RankWriter(out, r, meta)
        w.write_params([{"fqn": n, "shape": [4], "dtype": "float32"} for n in names])
        for s in range(steps + 1):
            ph = b"".join(_h(n, s, 0) for n in names)
            gh = None if s == 0 or s in no_grad_at else b"".join(_h(n, s, 1) for n in names)
            w.write_step(s, ph, gh, loss=None if s == 0 else loss, loss_hash=None)
        w.close()
    write_json_atomic(out / "run.json", {"v": 1, "status": run_status, "exit_code": 0,
                                         "error": None})
    return out


# --------------------------------------------------------------- tables that do not line up


def test_parameters_on_other_ranks_are_not_a_match(tmp_path):
    # pipeline stages split differently: every name exists on both sides, never on the same rank
    a = write_run(tmp_path / "a", {0: ["l0.w", "l1.w"], 1: ["l2.w", "l3.w"]})
    b = write_run(tmp_path / "b", {0: ["l2.w", "l3.w"], 1: ["l0.w", "l1.w"]})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert r.params_compared == 0
    assert any("no counterpart on the other side's same rank" in m for m in r.incomplete)


def test_one_moved_expert_is_said(tmp_path):
    a = write_run(tmp_path / "a", {0: ["shared", "e0"], 1: ["shared", "e1"]})
    b = write_run(tmp_path / "b", {0: ["shared", "e1"], 1: ["shared", "e0"]})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.params_compared == 1
    assert "4 table entries on rank(s) 0-1" in r.incomplete[0]


def test_swapped_rank_directories_are_named(tmp_path):
    a = make_run(tmp_path / "a", world_size=2, steps=2)
    b = make_run(tmp_path / "b", world_size=2, steps=2)
    (b / "rank-00000").rename(b / "tmp")
    (b / "rank-00001").rename(b / "rank-00000")
    (b / "tmp").rename(b / "rank-00001")
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert r.first_divergence is None  # not blamed on the loss
    assert any("meta.json says rank 1, the directory rank 0" in p.message for p in r.problems)


# ----------------------------------------------------------------- what was not recorded


def test_unrecorded_gradients_are_not_said_to_match(tmp_path):
    # --every N: the last step is flushed without gradients; a parameter change there must not
    # be explained as "its gradients match"
    a = write_run(tmp_path / "a", {0: ["w", "v"]}, steps=3, no_grad_at={3})
    b = write_run(tmp_path / "b", {0: ["w", "v"]}, steps=3, no_grad_at={3})
    p = b / "rank-00000"
    lines = (p / "steps.jsonl").read_text().splitlines()
    # rewrite B's step 3 params: write a fresh run with a different step-3 param hash
    shutil.rmtree(b)
    b.mkdir()
    w = RankWriter(b, 0, {"world_size": 1, "capture": {"hasher": "xxh3"}})
    w.write_params([{"fqn": n, "shape": [4], "dtype": "float32"} for n in ("w", "v")])
    for s in range(4):
        ph = b"".join(_h(n, s, 0) for n in ("w", "v"))
        if s == 3:
            ph = b"\x01" * HASH_BYTES + ph[HASH_BYTES:]
        gh = None if s in (0, 3) else b"".join(_h(n, s, 1) for n in ("w", "v"))
        w.write_step(s, ph, gh, loss=None if s == 0 else 1.5)
    w.close()
    assert len(lines) == 4
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 3
    fd = r.first_divergence
    assert fd.origin == "param" and "not recorded" in fd.explanation
    assert "gradients match" not in fd.explanation


def test_capture_warnings_reach_the_result_and_json(tmp_path):
    warn = {"capture": {"hasher": "xxh3", "warnings": ["compiled manifests unavailable: x"]}}
    a = write_run(tmp_path / "a", {0: ["w"], 1: ["w"]})
    b = write_run(tmp_path / "b", {0: ["w"], 1: ["w"]}, meta_extra=warn)
    r = diff_runs(a, b)
    assert r.verdict == "match"
    assert [(w.side, w.ranks, w.message) for w in r.warnings] == [
        ("b", [0, 1], "compiled manifests unavailable: x")]
    r.write_json(tmp_path / "d.json")
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["warnings"] == [{"side": "b", "ranks": [0, 1],
                              "message": "compiled manifests unavailable: x"}]
    from parity.report.html import write_diff_html

    write_diff_html(r, tmp_path / "d.html")
    assert "compiled manifests unavailable: x" in (tmp_path / "d.html").read_text()
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(d, json.loads(Path("parity/schemas/diff.schema.json").read_text()))


def test_disabled_capture_is_incomplete(tmp_path):
    off = {"capture": {"hasher": "xxh3", "disabled": "RuntimeError: boom"}}
    a = write_run(tmp_path / "a", {0: ["w"]})
    b = write_run(tmp_path / "b", {0: ["w"]}, meta_extra=off)
    r = diff_runs(a, b)
    assert r.verdict == "incomplete"
    assert "capture was disabled on rank(s) 0 (RuntimeError: boom)" in r.incomplete[0]


# ------------------------------------------------------------------------ failed sides


def test_side_that_failed_before_any_step_is_named_not_the_hasher(tmp_path):
    a = write_run(tmp_path / "a", {0: ["w"]})
    b = tmp_path / "b"
    w = RankWriter(b, 0, {"world_size": 1, "capture": {"hasher": "auto"}})
    w.close(status="error", error="ValueError: bad argument")
    write_json_atomic(b / "run.json", {"v": 1, "status": "failed", "exit_code": 2,
                                       "error": "exited with code 2"})
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert e.value.exit_code == 3
    assert str(e.value) == "B failed before recording a step: exited with code 2"


def test_nan_loss_is_valid_json(tmp_path):
    a = write_run(tmp_path / "a", {0: ["w"]}, loss=float("nan"))
    b = write_run(tmp_path / "b", {0: ["w"]}, loss=float("nan"))
    r = diff_runs(a, b)
    r.write_json(tmp_path / "d.json")
    text = (tmp_path / "d.json").read_text()
    assert "NaN" not in text
    d = json.loads(text)
    assert all(s["a"] is None for s in d["loss"]["steps"])


def test_loss_on_one_side_only_is_said(tmp_path):
    a = write_run(tmp_path / "a", {0: ["w"]})
    b = write_run(tmp_path / "b", {0: ["w"]}, loss=None)
    r = diff_runs(a, b)
    # issue 21: not compared, so not a clean verdict
    assert any(m.startswith("loss recorded by A only") for m in r.incomplete)
    assert r.exit_code() == 3


def test_capture_warnings_reach_the_sweep_reason_and_the_gate():
    from parity.sweep.gate import evaluate
    from parity.policy import cell_status as classify

    d = {"verdict": "match", "order": {"verdict": "identical"},
         "warnings": [{"side": "b", "ranks": [0], "message": "2 parameter(s) joined ..."}]}
    status, reason = classify(d)
    assert status == "match" and "1 capture warning(s) (B: 2 parameter(s) joined ...)" in reason
    sweep = {"complete": True, "cells": [{"id": "c", "status": "match", "reason": reason,
                                          "diff": d}]}
    code, lines = evaluate(sweep)
    assert code == 0 and any(line.startswith("warning   c: 1 capture warning (B: 2 parameter")
                             for line in lines)
    assert "1 capture warning: c (B: 2 parameter(s) joined ...)" in lines[-1]


def test_diff_verdict_line_says_capture_warnings_like_the_json_one():
    """`parity diff`'s console verdict (DiffResult.judge) and the one reports build from the JSON
    (policy.judge_pair) say the same words, capture warnings included."""
    from parity.diff.result import from_dict
    from parity.policy import judge_pair

    d = {"verdict": "match", "order": {"verdict": "identical"}, "steps_compared": [1],
         "ranks_compared": [0], "params_compared": 1, "kinds_compared": ["params"],
         "warnings": [{"side": "b", "ranks": [0], "message": "2 parameter(s) joined ..."}]}
    r = from_dict(d)
    assert r.judge("hash").line() == judge_pair(d, "hash").line()
    assert "1 capture warning: B: 2 parameter(s) joined ..." in r.judge().line()
