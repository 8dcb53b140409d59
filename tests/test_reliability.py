"""Issue 21: verdicts that cannot be fooled. Each class of docs/reliability.md with real processes:
`parity exec` of unmodified trainers (tests/trainers/adversary.py; it imports nothing from parity),
then the real CLI. The jobs are started together by one module-scoped fixture and shared by the
asserts (one process each, ~5 s; no torchrun).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.artifacts import read_run
from parity.diff import diff_runs
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from tests.real_jobs import run_ok

HERE = Path(__file__).resolve().parent
ADVERSARY = str(HERE / "trainers" / "adversary.py")
PARITY = [sys.executable, "-m", "parity"]
TIMEOUT = 600


def _env(**knobs):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AD_", "VC_", "PARITY_CAPTURE", "PARITY_OPS"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def _start(out, *opts, **knobs):
    argv = [*PARITY, "exec", "--out", str(out), *opts, "--", sys.executable, ADVERSARY]
    return subprocess.Popen(argv, env=_env(**knobs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE.parent)


JOBS = {  # name: (exec options, trainer knobs)
    "a": ((), {}),
    "bn": ((), {"AD_PERTURB": "bn"}),
    "buffer": ((), {"AD_PERTURB": "buffer"}),
    "hook": ((), {"AD_PERTURB": "hook"}),
    "swap": ((), {"AD_PERTURB": "swap"}),
    "nograds": (("--no-grads",), {}),
    "sparse": ((), {"AD_CASE": "sparse"}),
    "meta": ((), {"AD_CASE": "meta"}),
    "spawn": ((), {"AD_CASE": "spawn", "AD_STEPS": 2}),
    "twice": ((), {"AD_CASE": "twice", "AD_STEPS": 2}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job above, three at a time: {name: (run dir, exit code, stderr)}."""
    root = tmp_path_factory.mktemp("adversary")
    out, pending, running = {}, list(JOBS.items()), []
    while pending or running:
        while pending and len(running) < 3:
            name, (opts, knobs) = pending.pop(0)
            running.append((name, _start(root / name, *opts, **knobs)))
        name, p = running.pop(0)
        _, err = p.communicate(timeout=TIMEOUT)
        out[name] = (root / name, p.returncode, err)
    return out



def _closed(argv, **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` with a stdout whose reader is gone (``| head -0``): every write fails."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=TIMEOUT, **kw)
    finally:
        os.close(w)


# ---------------------------------------------------------------- 1. every buffer, every name
def test_second_models_buffers_are_hashed_under_distinct_names(runs):
    a, bn = run_ok(runs, "a"), run_ok(runs, "bn")
    params = {p["fqn"]: p for p in read_run(a).ranks[0].params}
    # D's optimizer steps first; G's model shares D's names and gets its class as a prefix
    assert {"l1.weight", "Generator.l1.weight", "bn.running_mean",
            "Generator.bn.running_mean"} <= set(params)
    assert params["Generator.bn.running_var"]["kind"] == "buffer"
    # G is a module tree of the process before its optimizer first steps (at 2): its tensors
    # are hashed from step 0 on (issue 32), its parameters marked until then
    assert "since" not in params["Generator.bn.running_var"]
    assert "optimizer" not in params["Generator.l1.weight"]
    r = diff_runs(a, bn)  # B: G's BatchNorm momentum only (no parameter differs)
    # G's forward in D's step 1 updates its statistics before "step 0" is hashed
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 0
    assert {d.fqn for d in r.divergent} == {"Generator.bn.running_mean",
                                             "Generator.bn.running_var"}
    assert {d.kind for d in r.divergent} == {"buffer"}
    assert r.first_divergence.origin == "buffer"  # not "init"/"optimizer", not kind "param"


def test_buffer_registered_after_step_1_is_hashed(runs):
    a, b = run_ok(runs, "a"), run_ok(runs, "buffer")
    params = {p["fqn"]: p for p in read_run(a).ranks[0].params}
    assert params["temperature"]["kind"] == "buffer" and params["temperature"]["since"] == 4
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 4
    assert [d.fqn for d in r.divergent] == ["temperature"]
    assert "1 buffer(s) joined the table at step 4" in runs["a"][2]


# ---------------------------------------------------------------- 2. swapped in place
def test_parameter_swapped_into_a_group_in_place_is_hashed(runs):
    a, b = run_ok(runs, "a"), run_ok(runs, "swap")
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 6
    assert {d.fqn for d in r.divergent if d.kind == "param"} == {"Generator.l1.weight"}
    entry = {p["fqn"]: p for p in read_run(b).ranks[0].params}["Generator.l1.weight"]
    assert entry["replaced"] == 6
    assert "swapped into an optimizer group at step 6" in runs["swap"][2]


# ---------------------------------------------------------------- 5. gradients as consumed
def test_gradients_are_hashed_after_the_optimizers_own_pre_hooks(runs):
    a, b = run_ok(runs, "a"), run_ok(runs, "hook")
    r = diff_runs(a, b)  # B: D's pre-hook scales its gradients by another factor
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 1
    grads = {d.fqn for d in r.divergent if d.kind == "grad"}
    assert {"l1.weight", "l2.weight"} <= grads  # D's gradients, as its step consumed them
    assert r.first_divergence.origin == "backward"  # never "parameters differ, gradients match"


# ---------------------------------------------------------------- 6. the real reason
def test_sparse_gradients_are_hashed(runs):
    d = run_ok(runs, "sparse")
    rd = read_run(d).ranks[0]
    assert not rd.meta["capture"]["disabled"]
    assert rd.steps[3]["grad_digest"]


def test_a_tensor_capture_cannot_hash_is_named_and_capture_goes_on(runs):
    """A meta parameter in the optimizer once turned capture off (then `parity exec` had to
    say why, issue 21); since issue 31 capture names it and goes on, and the diff says it."""
    d, rc, err = runs["meta"]
    assert rc == 0, err[-2000:]
    meta = json.loads((d / "rank-00000" / "meta.json").read_text())["capture"]
    assert meta["disabled"] is None and meta["unhashed"] == [{"fqn": "<unnamed>",
                                                               "reason": "meta tensor"}]
    copy = d.parent / "meta-copy"
    shutil.copytree(d, copy)
    r = diff_runs(d, copy)
    assert r.exit_code() == EXIT_INCOMPLETE
    assert any("not hashed on rank(s) 0: <unnamed> (meta tensor)" in m for m in r.incomplete)


# ---------------------------------------------------------------- 3. one process per rank
@pytest.mark.parametrize("name", ["spawn", "twice"])
def test_several_processes_claiming_one_rank_are_refused_and_said(runs, name):
    d, rc, err = runs[name]
    assert rc == EXIT_INCOMPLETE, err[-2000:]
    assert "already recorded by another process" in err
    rd = read_run(d).ranks[0]
    assert len(rd.refused) == 1 and rd.steps  # the first process's record is intact
    copy = d.parent / f"{name}-copy"
    shutil.copytree(d, copy)
    r = diff_runs(d, copy)
    assert r.exit_code() == EXIT_INCOMPLETE
    assert any("claimed rank(s) 0 and were not recorded" in m for m in r.incomplete)


def test_exec_refuses_an_existing_run_and_a_concurrent_exec(runs, tmp_path):
    a = run_ok(runs, "a")
    p = subprocess.run([*PARITY, "exec", "--out", str(a), "--", sys.executable, "-c", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == EXIT_USAGE and "already holds a run; give --force" in p.stderr
    assert (a / "rank-00000" / "steps.jsonl").is_file()  # untouched
    out = tmp_path / "busy"
    first = _start(out, AD_CASE="slow", AD_SLEEP=60, AD_STEPS=1)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "run.json").is_file():
            time.sleep(0.2)
        second = subprocess.run([*PARITY, "exec", "--out", str(out), "--force", "--",
                                 sys.executable, "-c", "0"],
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert second.returncode == EXIT_USAGE
        assert "another parity exec" in second.stderr and "is writing to" in second.stderr
    finally:
        first.terminate()  # parity exec forwards it to the trainer's process group
        first.communicate(timeout=TIMEOUT)


# ---------------------------------------------------------------- 7. one side only, 9. A = A
def test_one_sided_gradients_and_the_same_directory_are_not_compared(runs):
    a, ng = run_ok(runs, "a"), run_ok(runs, "nograds")
    p = subprocess.run([*PARITY, "diff", str(a), str(ng)], capture_output=True, text=True,
                       timeout=TIMEOUT)
    verdict = p.stdout.splitlines()[0]
    assert p.returncode == EXIT_INCOMPLETE, verdict
    assert "not compared: " in verdict and "gradients recorded by A only" in verdict
    p = subprocess.run([*PARITY, "diff", str(a), str(a)], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == EXIT_INCOMPLETE and "the same directory" in p.stdout.splitlines()[0]


# ---------------------------------------------------------------- 10. wording
def test_exec_summary_counts_steps(runs):
    err = runs["a"][2]
    assert "captured 1 rank(s) x 6 step(s) (6 recorded; 2 optimizers: each step() after its " \
           "own backward is a step)" in err


# ---------------------------------------------------------------- 4. a closed stdout
def test_closed_stdout_keeps_every_exit_code(runs, tmp_path):
    a, bn = run_ok(runs, "a"), run_ok(runs, "bn")
    same = tmp_path / "a-copy"
    shutil.copytree(a, same)
    for m in same.glob("rank-*/meta.json"):  # as if another process wrote it (a plain copy is
        meta = json.loads(m.read_text())  # one recording with its original: incomplete)
        meta["pid"] = meta["pid"] + 100000
        m.write_text(json.dumps(meta))
    cases = [(["diff", str(a), str(same)], EXIT_OK), (["diff", str(a), str(bn)], EXIT_MISMATCH),
             (["diff", str(a), str(a)], EXIT_INCOMPLETE),
             (["diff", str(a), str(bn), "--json", str(tmp_path / "d.json")], EXIT_MISMATCH),
             (["inspect", str(a)], EXIT_OK), (["--help"], EXIT_OK), (["--version"], EXIT_OK)]
    cases += [([cmd, "--help"], EXIT_OK) for cmd in ("exec", "diff", "inspect", "bisect", "sweep",
                                                     "report", "gate")]
    cases += [(["sweep", "--dry-run", "--out", str(tmp_path / "s")], EXIT_OK)]
    for argv, code in cases:
        p = _closed([*PARITY, *argv])
        assert p.returncode == code, (argv, p.stderr[-1500:])
        assert "Traceback" not in p.stderr, argv
    assert (tmp_path / "d.json").is_file()


def test_bisect_reruns_with_the_recorded_environment_under_a_closed_stdout(runs, tmp_path):
    a, hook = run_ok(runs, "a"), run_ok(runs, "hook")
    # this shell has B's knob: A's rerun must not inherit it (run.json's env is restored)
    p = _closed([*PARITY, "bisect", str(a), str(hook), "--out", str(tmp_path / "bis")],
                env=_env(AD_PERTURB="hook"))
    assert p.returncode == EXIT_MISMATCH, p.stderr[-3000:]
    assert "rerunning with the recorded environment" in p.stderr
    report = json.loads((tmp_path / "bis" / "bisect.json").read_text())
    assert not any("not deterministic" in str(w) for w in report.get("warnings") or []), report
