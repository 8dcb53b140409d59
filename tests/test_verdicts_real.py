"""Issue 13 with real processes: `parity exec` of small trainers (tests/trainers/verdict_cases.py,
wrapper.py; they import nothing from parity), then `parity diff`. One process per job except
the torchelastic restart (torchrun, 1 rank). About 3 s per job on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.artifacts import read_run
from parity.diff import diff_runs
from parity.errors import ParityError

HERE = Path(__file__).resolve().parent
CASES = str(HERE / "trainers" / "verdict_cases.py")
WRAPPER = str(HERE / "trainers" / "wrapper.py")
TIMEOUT = 600


def _env(**extra):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    for k in list(env):
        if k.startswith(("VC_", "PT_", "PARITY_CAPTURE")):
            del env[k]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def parity_exec(out, command, *opts, **knobs):
    argv = [sys.executable, "-m", "parity", "exec", "--out", str(out), *opts, "--", *command]
    return subprocess.run(argv, env=_env(**knobs), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=HERE.parent)


def case(tmp_path, name, *opts, **knobs):
    out = tmp_path / name
    p = parity_exec(out, [sys.executable, CASES], *opts, **knobs)
    assert p.returncode == 0, p.stderr
    return out, p


def test_parameter_joining_after_step_1_is_hashed_from_then_on(tmp_path):
    a, pa = case(tmp_path, "a", VC_CASE="late")
    b, _ = case(tmp_path, "b", VC_CASE="late", VC_PERTURB=1)
    run = read_run(a)
    # the extra Linear is a module tree of the process: hashed from step 0 on (issue 32), its
    # ``optimizer: false`` dropped when it joins the optimizer
    late = [p for p in run.ranks[0].params if p["fqn"] in ("weight", "bias")]
    assert len(late) == 2 and all(p.get("since") is None and "optimizer" not in p for p in late)
    assert "joined the optimizers at step 3" in pa.stderr
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 3
    assert any("joined the optimizers at step 3" in w.message for w in r.warnings)
    same = diff_runs(a, a)  # a run against itself: said, never a clean verdict (issue 21)
    assert same.verdict == "incomplete" and same.params_compared == 6
    assert "the same directory" in same.incomplete[0]


def test_buffers_are_hashed_and_compared(tmp_path):
    a, _ = case(tmp_path, "a", VC_CASE="bn")
    b, _ = case(tmp_path, "b", VC_CASE="bn", VC_PERTURB=1)
    kinds = {p["fqn"]: p.get("kind") for p in read_run(a).ranks[0].params}
    assert kinds["1.running_mean"] == kinds["1.num_batches_tracked"] == "buffer"
    r = diff_runs(a, b)
    # "step 0" is hashed at the first optimizer step, after its forward updated the statistics
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 0
    assert {d.fqn for d in r.divergent} == {"1.running_mean", "1.running_var"}
    assert diff_runs(a, a).verdict == "incomplete"  # the same directory: said


def test_closure_optimizer_records_each_steps_own_loss_and_gradients(tmp_path):
    a, _ = case(tmp_path, "a", VC_CASE="lbfgs")
    b, _ = case(tmp_path, "b", VC_CASE="lbfgs", VC_PERTURB=1)
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 2
    fd = r.first_divergence
    assert fd.origin in ("forward", "backward") and fd.grads and fd.loss_differs
    # the loss of step k is the first closure evaluation of step k (not the one before)
    run = read_run(a)
    assert run.ranks[0].steps[1]["loss"] is not None


def test_trainer_exit_code_is_the_sides_status(tmp_path):
    a, _ = case(tmp_path, "a", VC_STEPS=2)
    b = tmp_path / "b"
    p = parity_exec(b, [sys.executable, CASES], VC_STEPS=2, VC_EXIT=3)
    assert p.returncode == 3
    assert json.loads((b / "run.json").read_text())["status"] == "failed"
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert r.incomplete[0] == "B failed: exited with code 3"
    # a trainer that refuses its arguments (exit 2) after importing torch: named, not "hashers"
    c = tmp_path / "c"
    p = parity_exec(c, [sys.executable, "-c", "import sys, torch; sys.exit(2)"], RANK=0,
                    WORLD_SIZE=1)
    assert p.returncode == 2
    with pytest.raises(ParityError) as e:
        diff_runs(a, c)
    assert e.value.exit_code == 3
    assert str(e.value) == "B failed before recording a step: exited with code 2"


def test_wrapper_child_is_captured_and_exec_summarizes(tmp_path):
    out = tmp_path / "w"
    p = parity_exec(out, [sys.executable, WRAPPER, CASES], VC_STEPS=2, RANK=0, WORLD_SIZE=1,
                    LOCAL_RANK=0)
    assert p.returncode == 0, p.stderr
    run = read_run(out)
    assert run.step_numbers() == [0, 1, 2]
    assert "parity: captured 1 rank(s) x 2 step(s) (2 recorded), manifests: " in p.stderr
    assert "0 warning(s)" in p.stderr


def test_nothing_captured_is_exit_3_with_a_warning(tmp_path):
    out = tmp_path / "n"
    p = parity_exec(out, [sys.executable, "-c", "print('no torch here')"])
    assert p.returncode == 3
    assert "parity: warning: nothing was captured" in p.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "failed" and meta["error"].startswith("nothing was captured")


def test_torchelastic_restart_keeps_attempts_and_continues_steps(tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "--max-restarts", "1", CASES]
    p = parity_exec(out, cmd, VC_STEPS=3, VC_CRASH_FIRST=2)
    assert p.returncode == 0, p.stderr
    run = read_run(out)
    rd = run.ranks[0]
    # attempt 0 recorded steps 0-2 (then crashed), attempt 1's steps 1-3 are steps 3-5
    assert sorted(rd.steps) == [0, 1, 2, 3, 4, 5]
    assert [r["after_step"] for r in rd.meta["restarts"]] == [2]
    assert any("torchelastic restart 1" in w for w in rd.meta["capture"]["warnings"])
    import shutil

    shutil.copytree(out, tmp_path / "copy")  # the same directory twice is never a clean match
    for m in (tmp_path / "copy").glob("rank-*/meta.json"):  # nor is a copy: as if another
        meta = json.loads(m.read_text())  # process had recorded the same numbers
        meta["pid"] = meta["pid"] + 100000
        m.write_text(json.dumps(meta))
    r = diff_runs(out, tmp_path / "copy")
    assert r.verdict == "match"
    assert any("torchelastic restart 1" in w.message for w in r.warnings)


def test_every_n_last_step_without_gradients_is_not_said_to_match(tmp_path):
    a, _ = case(tmp_path, "a", "--every", "3", VC_STEPS=4)
    b, _ = case(tmp_path, "b", "--every", "3", VC_STEPS=4, VC_NUDGE_STEP=4)
    assert read_run(a).ranks[0].steps[4]["grad_digest"] is None  # flushed without gradients
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 4
    fd = r.first_divergence
    assert fd.origin == "param" and "not recorded" in fd.explanation
    assert "gradients match" not in fd.explanation
