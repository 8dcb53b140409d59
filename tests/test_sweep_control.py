"""Issue 23 items 1, 2 and 4 with real torchrun jobs: the determinism control, shared reference
jobs, and the numerics fingerprint in meta.json.

One sweep (module fixture) of tests/trainers/noisy.py under ``parity exec``: the reference runs
``--noise 1:2`` (rank 1 adds noise seeded from the clock and its pid from step 2 on: a
nondeterministic reference); axis ``cand`` gives the candidate ``--perturb 1:1`` (a systematic
divergence at step 1) or nothing, and the reference nothing, so both cells share one reference
job: 1 reference + 1 control + 2 candidates. The deterministic control is checked by
benchmarks/sweep_features.py (a real sweep) and here on the pure logic.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.diff.env import numerics_differences
from parity.errors import EXIT_MISMATCH

TRAINER = str(Path(__file__).resolve().parent / "trainers" / "noisy.py")
PARITY = [sys.executable, "-m", "parity"]

SPEC = f'''
name = "control"
steps = 3
nproc_per_node = 2
timeout = 600
control = true

[env]
OMP_NUM_THREADS = "1"

[axes.cand]
values = ["same", "perturb"]

[reference]
argv = ["{TRAINER}", "--steps", "{{steps}}", "--noise", "1:2"]
[reference.flags.cand]

[candidate]
argv = ["{TRAINER}", "--steps", "{{steps}}"]
[candidate.flags.cand]
perturb = ["--perturb", "1:1"]
'''


def parity(*args, cwd, timeout=900):
    return subprocess.run(PARITY + [str(a) for a in args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("control")
    spec = d / "control.toml"
    spec.write_text(SPEC)
    out = d / "sweep"
    dry = parity("sweep", spec, "--out", out, "--dry-run", cwd=d)
    r = parity("sweep", spec, "--out", out, cwd=d)
    sweep = json.loads((out / "sweep.json").read_text())
    return d, spec, out, r, sweep, dry


def cells(sweep):
    return {c["id"]: c for c in sweep["cells"]}


def test_control_statuses_and_gate(swept):
    _, _, out, r, sweep, _ = swept
    c = cells(sweep)
    same, pert = c["cand=same"], c["cand=perturb"]
    # the noisy reference differs from its own repeat from step 2: not the candidate's fault
    assert same["status"] == "nondeterministic", same["reason"]
    assert same["control"]["verdict"] == "nondeterministic"
    assert same["control"]["first_step"] == 2
    assert "reference nondeterministic: its repeat differs from step 2" in same["reason"]
    assert "rank 1" in same["control"]["what"]
    assert "identical to it through step 1" in same["reason"]
    assert same["control"]["deterministic_through"] == 1
    # the candidate that diverged at step 1, while the reference was still deterministic
    assert pert["status"] == "nondeterministic", pert["reason"]
    assert pert["control"]["candidate_diverged_before"] is True
    assert "diverged at step 1, while the reference was still deterministic" in pert["reason"]
    assert sweep["counts"]["nondeterministic"] == 2
    assert r.returncode == EXIT_MISMATCH, r.stdout[-2000:] + r.stderr[-2000:]
    verdict = r.stdout.strip().splitlines()[-1]
    assert verdict.startswith("PARITY FAILS") and "1 nondeterministic (cand=perturb)" in verdict
    assert "not compared: 1 nondeterministic (cand=same)" in verdict, verdict
    g = parity("gate", out, cwd=out)
    assert g.returncode == EXIT_MISMATCH
    assert any(line.startswith("NONDET") and "cand=same" in line
               for line in g.stdout.splitlines()), g.stdout
    # order-only tolerates hash mismatches: a nondeterministic cell still does not pass
    g = parity("gate", out, "--fail-on", "order-only", cwd=out)
    assert g.returncode == 3 and "2 nondeterministic" in g.stdout.splitlines()[-1], g.stdout


def test_reports_say_nondeterministic(swept):
    _, _, out, _, _, _ = swept
    reason = "reference nondeterministic: its repeat differs from step 2"
    for fmt, word in (("console", "NONDETERMINISTIC"), ("markdown", "NONDETERMINISTIC"),
                      ("junit", 'type="nondeterministic"'), ("html", "nondeterministic")):
        args = ["report", out, "--format", fmt]
        if fmt == "html":
            args += ["--output", out / "r.html"]
        r = parity(*args, cwd=out)
        assert r.returncode == 0, r.stderr
        text = (out / "r.html").read_text() if fmt == "html" else r.stdout
        assert word in text and reason in text, fmt


def test_reference_jobs_shared(swept):
    _, _, out, _, sweep, dry = swept
    c = cells(sweep)
    owner, sharer = c["cand=same"], c["cand=perturb"]
    assert owner["shares_reference_with"] == [sharer["id"]]
    assert sharer["sides"]["reference"]["shared_from"] == owner["id"]
    assert sharer["sides"]["reference"]["run_dir"] == owner["sides"]["reference"]["run_dir"]
    assert f"reference job shared with {owner['id']}" in sharer["reason"]
    assert f"reference job shared with {sharer['id']}" in owner["reason"]
    assert not (out / "cells" / sharer["id"] / "reference").exists()
    assert sharer["diff"]["a"]["path"] == owner["sides"]["reference"]["run_dir"]
    # 1 reference job, 1 control (one per distinct reference job), 2 candidates
    assert sweep["timing"]["jobs_run"] == 4
    assert len(list((out / "controls").iterdir())) == 1
    assert dry.returncode == 0 and dry.stdout.count("reference: shared with cand=same") == 1
    assert dry.stdout.count("control: the reference job again") == 1, dry.stdout


def test_resume_keeps_shared_and_controlled_cells(swept):
    d, spec, out, _, sweep, _ = swept
    r = parity("sweep", spec, "--out", out, "--resume", cwd=d)
    again = json.loads((out / "sweep.json").read_text())
    assert again["timing"]["jobs_run"] == 0, r.stderr[-2000:]
    assert {k: v["status"] for k, v in cells(again).items()} == {
        k: v["status"] for k, v in cells(sweep).items()}
    assert r.returncode == EXIT_MISMATCH


def test_meta_records_numerics_fingerprint(swept):
    _, _, out, _, _, _ = swept
    meta = json.loads((out / "cells" / "cand=same" / "reference" / "rank-00000" /
                       "meta.json").read_text())
    n = meta["numerics"]
    assert set(n["nccl_env"]) >= {"NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS",
                                  "NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS", "NCCL_NVLS_ENABLE"}
    assert n["deterministic_algorithms"] is True  # the trainer asks for it
    assert n["backend"] == "gloo"
    assert n["inductor"] is None  # an eager job never imported inductor; parity did not either
    assert n["nccl_version"] is None  # no CUDA here: nothing was initialized to ask


def test_diff_names_numerics_differences(tmp_path):
    """`parity diff` names every fingerprint fact that differs as a possible cause."""
    base = {"nccl_env": {"NCCL_ALGO": None, "NCCL_PROTO": "Simple"}, "nccl_version": "2.27.5",
            "backend": "nccl", "deterministic_algorithms": True, "cuda_graphs": False,
            "inductor": {"emulate_precision_casts": False, "max_autotune": False}}
    other = json.loads(json.dumps(base))
    other["nccl_env"]["NCCL_ALGO"] = "Ring"
    other["deterministic_algorithms"] = False
    other["cuda_graphs"] = True
    other["inductor"]["emulate_precision_casts"] = True
    lines = numerics_differences(base, other)
    assert len(lines) == 4, lines
    assert all("possible cause" in x for x in lines)
    assert any(x.startswith("NCCL_ALGO differs (A None, B 'Ring')") for x in lines)
    assert any("inductor config emulate_precision_casts" in x for x in lines)
    # an eager side (no inductor) is no difference in inductor settings
    eager = {**base, "inductor": None}
    assert numerics_differences(eager, base) == []


def test_control_verdicts_pure():
    """control.summarize / apply on diff dicts: deterministic keeps the cell's status."""
    from parity.sweep import control

    same = {"verdict": "match", "steps_compared": [0, 1, 2], "first_divergent_step": None,
            "order": {"verdict": "identical"}}
    summary = control.summarize(same)
    assert summary == {"verdict": "deterministic", "steps_compared": 3, "through_step": 2}
    status, reason, rec = control.apply("hash_mismatch", "first divergent step 1: w", {}, summary)
    assert status == "hash_mismatch" and reason.endswith(
        "reference deterministic (its repeat identical over 3 steps)")
    failed = control.summarize(None, "diff: B failed before recording a step")
    status, reason, _ = control.apply("match", "bitwise identical", {}, failed)
    assert status == "failed" and reason.startswith("control run of the reference failed")


def test_control_flag_and_spec_keys(tmp_path):
    """--control turns the control on for a spec without it (dry run: nothing runs); the new
    keys are validated like every other (one line, exit 2)."""
    spec = tmp_path / "plain.toml"
    spec.write_text(SPEC.replace("control = true\n", ""))
    r = parity("sweep", spec, "--out", tmp_path / "o", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0 and "control: the reference job" not in r.stdout
    r = parity("sweep", spec, "--out", tmp_path / "o", "--dry-run", "--control", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count("control: the reference job again") == 1
    for bad, msg in (("control = 1", "control: must be true or false"),
                     ("stop_after_divergence = -1", "stop_after_divergence: must be >= 0"),
                     ("stop_after_divergence = true", "stop_after_divergence: must be an integer")):
        spec.write_text(SPEC.replace("control = true", bad))
        r = parity("sweep", spec, "--dry-run", cwd=tmp_path)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
            r.stderr)


def test_default_spec_reference_does_not_depend_on_cudagraphs(tmp_path):
    """The default CPU spec's eager reference is the same job with and without CUDA graphs: the
    plan shares it (those cells are skipped on CPU, and say whose job they would share)."""
    r = parity("sweep", "--dry-run", "--out", tmp_path / "d", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "reference: shared with" in x]
    # 8 cells, 2 distinct eager references (flash on/off): the 6 others share one, and a
    # reference is never shared from a cell with CUDA graphs
    assert len(lines) == 6 and all("cudagraphs=false" in x for x in lines), r.stdout
