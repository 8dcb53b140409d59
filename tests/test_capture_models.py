"""Capture finds the models of a process without changing the job (issues 31 and 32).

Real trainers (tests/trainers/traced_model.py, held_state.py: they import nothing from parity),
run with plain python, with and without `parity exec`:

* tracing under capture: torch.export, dynamo's export capture (what AutoParallel traces its
  model with) and a compiled model see the same graphs and compile as often as without parity;
  no global module hook is left for a tracer to see;
* everything the model holds is compared: an EMA copy no optimizer holds, the BatchNorm buffers
  of a frozen backbone (its own module tree or the model's child);
* the model that trains, not a copy: a FakeTensorMode copy and a meta copy kept alive are
  skipped with their reason, and capture records every step;
* a tensor capture cannot hash is named on the verdict line (exit 3), capture stays on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from real_jobs import exe

TRAINERS = Path(__file__).parent / "trainers"


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full.pop("PARITY_CAPTURE_DIR", None)
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=600)


def _exec(run: Path, trainer: str, env: dict) -> subprocess.CompletedProcess:
    proc = _run([*exe("parity", "parity"), "exec", "--out", str(run), "--", sys.executable,
                 str(TRAINERS / trainer)], run.parent, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _diff(a: Path, b: Path) -> tuple[int, str]:
    proc = _run([*exe("parity", "parity"), "diff", str(a), str(b)], a.parent)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PARITY")), "")
    return proc.returncode, line


def _meta(run: Path) -> dict:
    return json.loads((run / "rank-00000" / "meta.json").read_text())


def _fqns(run: Path) -> list[str]:
    """The model's rows, without the optimizers' state (``<fqn>:<key>``, final state only;
    SGD's group numbers among them: test_optimizer_state.py)."""
    fqns = json.loads((run / "rank-00000" / "params.json").read_text())["columns"]["fqn"]
    return [f for f in fqns if ":" not in f]


def test_tracing_under_capture_sees_the_same_graphs(tmp_path):
    """torch.export and _dynamo_graph_capture_for_export before any module call and after
    training, and a torch.compile'd model: graph code, compile counts and losses are the same
    with capture as without (with a global forward pre-hook, the dynamo export failed with
    "Attempted to inline function marked as skipped")."""
    plain = _run([sys.executable, str(TRAINERS / "traced_model.py")], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    captured = _exec(tmp_path / "run", "traced_model.py", {})
    assert captured.stdout == plain.stdout
    assert "compiles 1 " in plain.stdout and "global forward pre-hooks 0" in plain.stdout
    meta = _meta(tmp_path / "run")
    assert meta["capture"]["disabled"] is None and meta["capture"]["steps"] == 4


def test_ema_copy_is_compared(tmp_path):
    """An EMA copy inside the model tree, updated by hand after step() (no optimizer holds it):
    different decays are found; identical runs match."""
    for name, decay in (("a", "0.9"), ("b", "0.5"), ("c", "0.9")):
        _exec(tmp_path / name, "held_state.py", {"HS_CASE": "ema", "HS_DECAY": decay})
    fqns = _fqns(tmp_path / "a")
    assert {"ema.l1.weight", "ema.l2.bias"} <= set(fqns)
    code, line = _diff(tmp_path / "a", tmp_path / "b")
    assert code == 1 and "PARITY FAILS" in line, line
    code, line = _diff(tmp_path / "a", tmp_path / "c")
    assert code == 0 and "PARITY HOLDS" in line, line


def test_a_model_copied_mid_run_is_found_at_the_next_step(tmp_path):
    """A deepcopy made after step 5 of 7 (no registration hook fires for a copy) joins the
    table at step 6, found through the copy watch (nn.Module.__setstate__), not at step 8 as a
    periodic scan alone would; different decays of it are found."""
    for name, decay in (("a", "0.9"), ("b", "0.5")):
        _exec(tmp_path / name, "held_state.py",
              {"HS_CASE": "late_copy", "HS_STEPS": "7", "HS_DECAY": decay})
    from parity.params_codec import decode

    rows = decode((tmp_path / "a" / "rank-00000" / "params.json").read_bytes())
    late = [r for r in rows if r.get("since") is not None and r.get("kind") != "optimizer_state"]
    assert late and {r["since"] for r in late} == {6}, late
    code, line = _diff(tmp_path / "a", tmp_path / "b")
    assert code == 1 and "PARITY FAILS" in line, line


@pytest.mark.parametrize("tree", ["own", "inside"])
def test_frozen_backbone_buffers_are_compared(tmp_path, tree):
    """Linear probe: only the head is in the optimizer; the frozen backbone's BatchNorm runs in
    train mode. Its running statistics (momentum 0.1 vs 0.5) are found whether the backbone is
    its own module tree or the model's child; identical runs match."""
    runs = (("a", "0.1"), ("b", "0.5")) + ((("c", "0.1"),) if tree == "own" else ())
    for name, momentum in runs:
        _exec(tmp_path / name, "held_state.py",
              {"HS_CASE": "probe", "HS_TREE": tree, "HS_MOMENTUM": momentum})
    fqns = _fqns(tmp_path / "a")
    assert any(f.endswith("1.running_mean") for f in fqns), fqns
    code, line = _diff(tmp_path / "a", tmp_path / "b")
    assert code == 1 and "PARITY FAILS" in line, line
    if tree == "own":
        code, line = _diff(tmp_path / "a", tmp_path / "c")
        assert code == 0 and "PARITY HOLDS" in line, line


def test_fake_copy_of_the_model_is_skipped(tmp_path):
    """A FakeTensorMode copy, a meta copy, and a copy sharing the model's parameters beside a
    fake buffer (AutoParallel's traced copy after apply_placement) stay alive while the model
    trains: capture hashes the model that trains, names the three copies as skipped, and records
    every step."""
    procs = [_exec(tmp_path / name, "held_state.py", {"HS_CASE": "fake_copy"})
             for name in ("a", "b")]
    assert "3 module tree(s) of fake/meta tensors skipped" in procs[0].stderr, procs[0].stderr
    meta = _meta(tmp_path / "a")["capture"]
    assert meta["disabled"] is None and meta["recorded_steps"] == 3
    reasons = sorted(s["reason"] for s in meta["skipped"])
    assert reasons == ["fake tensors (1), real tensors (4)", "fake tensors (4)",
                       "meta tensors (4)"], meta["skipped"]
    assert meta["unhashed"] == []
    assert _fqns(tmp_path / "a") == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    code, line = _diff(tmp_path / "a", tmp_path / "b")
    assert code == 0 and "PARITY HOLDS" in line, line


def test_unhashable_tensor_is_named_on_the_verdict_line(tmp_path):
    """A buffer that is a tensor subclass (not a DTensor) is not hashed: capture stays on, and
    the verdict is incomplete and names it."""
    procs = [_exec(tmp_path / name, "held_state.py", {"HS_CASE": "odd_tensor"})
             for name in ("a", "b")]
    # the exec summary says it too, before any diff
    assert "1 tensor(s) of the model NOT hashed" in procs[0].stderr, procs[0].stderr
    meta = _meta(tmp_path / "a")["capture"]
    assert meta["disabled"] is None and meta["recorded_steps"] == 3
    assert meta["unhashed"] == [{"fqn": "tag", "reason": "tensor subclass Tagged"}]
    code, line = _diff(tmp_path / "a", tmp_path / "b")
    assert code == 3, line
    assert "1 tensor(s) of the model not hashed on rank(s) 0: tag (tensor subclass Tagged)" in line
