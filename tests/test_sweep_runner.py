"""The sweep runner with real processes: tiny sweeps of plain trainers under torchrun.

The trainers (tests/trainers/crash.py, hang.py) import no torch and write parity artifacts
themselves (``capture = false``), so each job costs only torchrun's own start-up (~2-3 s here).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from parity.sweep.launch_local import LocalLauncher
from parity.sweep.launcher import NOT_FOUND, Job
from parity.sweep.state import SweepLock

TRAINERS = Path(__file__).resolve().parent / "trainers"
CRASH = str(TRAINERS / "crash.py")
HANG = str(TRAINERS / "hang.py")
PARITY = [sys.executable, "-m", "parity"]


def parity(*args, cwd, timeout=600):
    return subprocess.run(PARITY + [str(a) for a in args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def write_spec(path: Path, body: str, *, nproc=2, timeout=120, steps=2) -> Path:
    head = (f'name = "{path.stem}"\nsteps = {steps}\nnproc_per_node = {nproc}\n'
            f"timeout = {timeout}\ncapture = false\n")
    path.write_text(head + body)
    return path


def crash_side(extra: str = "") -> str:
    return (f'argv = ["{CRASH}", "--run-dir", "{{run_dir}}", "--steps", "{{steps}}"{extra}]\n')


def load(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


def cells(sweep: dict) -> dict:
    return {c["id"]: c for c in sweep["cells"]}


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def processes_mentioning(text: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmd and alive(int(name)):
            out.append(int(name))
    return out


# ------------------------------------------------------------------------------------ crash


def test_crashing_cell_fails_with_its_rank_logs_and_the_others_still_run(tmp_path):
    spec = write_spec(tmp_path / "crashy.toml", (
        "[axes.crash]\nvalues = [true, false]\n"
        "[axes.crash.flags]\ntrue = [\"--crash-rank\", \"1\"]\n"
        f"[reference]\n{crash_side()}[candidate]\n{crash_side()}"))
    out = tmp_path / "out"
    r = parity("sweep", spec, "--out", out, cwd=tmp_path)
    assert r.returncode == EXIT_INCOMPLETE, r.stderr
    sweep = load(out)
    c = cells(sweep)
    bad, good = c["crash=true"], c["crash=false"]
    assert good["status"] == "match" and good["diff"]["verdict"] == "match"
    assert bad["status"] == "failed"
    assert "reference: exit code 1" in bad["reason"]
    assert "rank 1: RuntimeError: injected crash on rank 1" in bad["reason"]
    ref = bad["sides"]["reference"]
    assert bad["sides"]["candidate"]["status"] == "not_run"  # a failed cell wastes no more time
    logs = {e["rank"]: e for e in ref["rank_logs"]}
    assert set(logs) == {0, 1}
    assert "injected crash on rank 1" in (out / logs[1]["stderr"]).read_text()
    assert "crash.py rank 0" in (out / logs[0]["stdout"]).read_text()
    assert (out / ref["console_log"]).is_file()
    assert "crash=true" in r.stdout and "FAILED" in r.stdout and "stderr.log" in r.stdout
    # per-cell state and the gate agree
    assert json.loads((out / "cells" / "crash=true" / "cell.json").read_text())["status"] == "failed"
    g = parity("gate", out, cwd=tmp_path)
    assert g.returncode == EXIT_INCOMPLETE and "FAILED    crash=true" in g.stdout
    # timing: the sweep's own overhead is recorded (wall minus the jobs' summed wall)
    t = sweep["timing"]
    assert t["jobs_run"] == 3 and t["jobs_wall"] > 0 and t["overhead"] is not None


# ------------------------------------------------------------------------------------- hang


def test_hanging_job_is_killed_with_its_whole_tree_at_the_timeout(tmp_path):
    pids = tmp_path / "pids"
    spec = write_spec(tmp_path / "hangs.toml", (
        f'[reference]\nargv = ["{HANG}", "--pid-dir", "{pids}", "--ignore-term"]\n'
        f'[candidate]\nargv = ["{HANG}", "--pid-dir", "{pids}"]\n'), timeout=20)
    out = tmp_path / "out"
    t0 = time.time()
    r = parity("sweep", spec, "--out", out, cwd=tmp_path)
    took = time.time() - t0
    assert r.returncode == EXIT_INCOMPLETE, r.stderr
    c = cells(load(out))["base"]
    assert c["status"] == "failed" and "reference: timeout after 20 s" in c["reason"]
    assert c["sides"]["reference"]["status"] == "timeout"
    written = list(pids.glob("*.pid"))
    assert len(written) == 4  # two ranks, each with a grandchild in a session of its own
    assert [p.name for p in written if alive(int(p.stem))] == []  # SIGTERM ignored: SIGKILLed
    assert processes_mentioning(str(tmp_path)) == []  # no torchrun, parity exec or rank left
    assert took < 120
    assert len(c["sides"]["reference"]["rank_logs"]) == 2


def test_local_launcher_reports_a_command_that_cannot_start(tmp_path):
    job = Job("c", "reference", ["x.py"], 1, 1, {}, tmp_path / "run", tmp_path / "logs", 5,
              tmp_path / "console.log", cwd=tmp_path / "missing", capture=False)
    lnch = LocalLauncher(grace=1)
    res = lnch.poll(lnch.start(job))
    assert res.status == NOT_FOUND and "command not found" in res.reason and "missing" in res.reason


def test_missing_script_names_the_rank_error(tmp_path):
    spec = write_spec(tmp_path / "nofile.toml", (
        f'[reference]\nargv = ["{tmp_path}/no_such_trainer.py"]\n'
        f'[candidate]\nargv = ["{tmp_path}/no_such_trainer.py"]\n'), nproc=1)
    out = tmp_path / "out"
    r = parity("sweep", spec, "--out", out, cwd=tmp_path)
    assert r.returncode == EXIT_INCOMPLETE
    reason = cells(load(out))["base"]["reason"]
    assert "reference: exit code" in reason and "no_such_trainer.py" in reason


# --------------------------------------------------------------------------- interrupt + resume


def test_interrupted_sweep_keeps_finished_cells_and_resume_reruns_only_the_rest(tmp_path):
    marker = tmp_path / "slow"
    marker.write_text("")
    rec = tmp_path / "rec.jsonl"
    side = (f'argv = ["{CRASH}", "--run-dir", "{{run_dir}}", "--steps", "{{steps}}", '
            f'"--record", "{rec}", "--value", "{{part}}-{{side}}"]\n')
    spec = write_spec(tmp_path / "resumable.toml", (
        '[axes.part]\nvalues = ["a", "b"]\n'
        f'[axes.part.flags]\nb = ["--sleep-if-exists", "{marker}", "--sleep", "300"]\n'
        f"[reference]\n{side}[candidate]\n{side}"))
    out = tmp_path / "out"
    proc = subprocess.Popen(PARITY + ["sweep", str(spec), "--out", str(out)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b_json = out / "cells" / "part=b" / "cell.json"
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until cell b's first job is running (and asleep)
        if b_json.exists() and len([x for x in records(rec) if x["value"] == ["b-reference"]]) == 2:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("cell b never started")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "--resume" in stderr
    sweep = load(out)
    assert sweep["complete"] is False
    a, b = cells(sweep)["part=a"], cells(sweep)["part=b"]
    assert a["status"] == "match"
    assert b["status"] == "failed" and "interrupted" in b["reason"]
    assert [p for p in (x["pid"] for x in records(rec)) if alive(p)] == []
    assert processes_mentioning(str(tmp_path)) == []
    a_started = a["sides"]["reference"]["started"]
    # the gate refuses an unfinished sweep
    assert parity("gate", out, cwd=tmp_path).returncode == EXIT_INCOMPLETE

    marker.unlink()
    r = parity("sweep", spec, "--out", out, "--resume", cwd=tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    sweep = load(out)
    assert sweep["complete"] is True
    a, b = cells(sweep)["part=a"], cells(sweep)["part=b"]
    assert a["status"] == "match" and b["status"] == "match"
    assert a["sides"]["reference"]["started"] == a_started  # not rerun, not lost
    runs = [x["value"][0] for x in records(rec)]
    assert runs.count("a-reference") == 2 and runs.count("a-candidate") == 2  # 2 ranks, once
    assert runs.count("b-reference") == 4 and runs.count("b-candidate") == 2
    assert sweep["timing"]["jobs_run"] == 2

    # a second --resume has nothing to do; the spec in the sweep dir is reused without SPEC
    r = parity("sweep", "--out", out, "--resume", cwd=tmp_path)
    assert r.returncode == EXIT_OK and load(out)["timing"]["jobs_run"] == 0


# ----------------------------------------------------------------------------- --only, lock


def test_only_runs_the_selected_cells(tmp_path):
    rec = tmp_path / "rec.jsonl"
    side = (f'argv = ["{CRASH}", "--run-dir", "{{run_dir}}", "--steps", "{{steps}}", '
            f'"--record", "{rec}", "--value", "{{x}}"]\n')
    spec = write_spec(tmp_path / "sel.toml", (
        f'[axes]\nx = [1, 2]\ny = ["p", "q"]\n[reference]\n{side}[candidate]\n{side}'), nproc=1)
    out = tmp_path / "out"
    r = parity("sweep", spec, "--out", out, "--only", "x=2,y=q", cwd=tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    assert {x["value"][0] for x in records(rec)} == {"2"} and len(records(rec)) == 2
    c = cells(load(out))
    assert c["x=2,y=q"]["status"] == "match"
    assert all(c[k]["status"] == "skipped" and "not selected" in c[k]["reason"]
               for k in ("x=1,y=p", "x=1,y=q", "x=2,y=p"))
    assert not (out / "cells" / "x=1,y=p").exists()
    for bad in ("x=3", "z=1"):
        r = parity("sweep", spec, "--out", out, "--only", bad, cwd=tmp_path)
        assert r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1
    assert len(records(rec)) == 2


def test_a_second_sweep_on_the_same_directory_is_refused(tmp_path):
    spec = write_spec(tmp_path / "locked.toml", f"[reference]\n{crash_side()}[candidate]\n{crash_side()}")
    out = tmp_path / "out"
    out.mkdir()
    with SweepLock(out):
        r = parity("sweep", spec, "--out", out, cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    assert r.stderr.count("\n") == 1 and "another sweep" in r.stderr and str(os.getpid()) in r.stderr
    assert not (out / "cells" / "base" / "cell.json").exists()


def test_foreign_directory_is_not_used(tmp_path):
    spec = write_spec(tmp_path / "f.toml", f"[reference]\n{crash_side()}[candidate]\n{crash_side()}")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    r = parity("sweep", spec, "--out", tmp_path / "mine", cwd=tmp_path)
    assert r.returncode == EXIT_USAGE and "not a parity sweep directory" in r.stderr


# ------------------------------------------------------------------------------ sanitization


def test_hostile_axis_values_stay_inside_the_sweep_dir_and_reach_argv_literally(tmp_path):
    rec = tmp_path / "rec.jsonl"
    values = ["../../escape/x", "a b;$(touch PWNED)|`touch PWNED2`&<y>*"]
    side = (f'argv = ["{CRASH}", "--run-dir", "{{run_dir}}", "--steps", "1", '
            f'"--record", "{rec}", "--value", "{{v}}"]\nenv = {{ SWEEPTEST_V = "{{v}}" }}\n')
    toml_values = ", ".join(json.dumps(v) for v in values)
    spec = write_spec(tmp_path / "hostile.toml", (
        f"[axes]\nv = [{toml_values}]\n[reference]\n{side}[candidate]\n{side}"), nproc=1)
    out = tmp_path / "deep" / "out"
    r = parity("sweep", spec, "--out", out, cwd=tmp_path)
    assert r.returncode == EXIT_OK, r.stderr + r.stdout
    got = records(rec)
    assert sorted({x["value"][0] for x in got}) == sorted(values)
    assert all(x["env"]["SWEEPTEST_V"] == x["value"][0] for x in got)
    assert not list(tmp_path.rglob("PWNED*")) and not (tmp_path / "escape").exists()
    ids = [c["id"] for c in load(out)["cells"]]
    assert all(c["status"] == "match" for c in load(out)["cells"])
    cells_dir = (out / "cells").resolve()
    for p in out.rglob("*"):
        assert p.resolve().is_relative_to(out.resolve())
    assert sorted(p.name for p in cells_dir.iterdir()) == sorted(ids)
    for cid in ids:
        assert all(ch.isalnum() or ch in "._+-=," for ch in cid)


# ------------------------------------------------------------------------------ mismatch, dry run


def test_hash_mismatch_cell_sets_the_exit_code_and_jobs_run_concurrently(tmp_path):
    spec = write_spec(tmp_path / "mism.toml", (
        "[axes]\nperturb = [false, true]\n"
        f"[reference]\n{crash_side()}[candidate]\n{crash_side()}"
        '[candidate.flags.perturb]\ntrue = ["--perturb-step", "1"]\n'), nproc=1)
    out = tmp_path / "out"
    r = parity("sweep", spec, "--out", out, "--jobs", "2", cwd=tmp_path)
    assert r.returncode == EXIT_MISMATCH, r.stderr
    c = cells(load(out))
    assert c["perturb=false"]["status"] == "match"
    bad = c["perturb=true"]
    assert bad["status"] == "hash_mismatch" and "first divergent step 1" in bad["reason"]
    assert bad["diff"]["first_divergent_step"] == 1 and (out / bad["diff_json"]).is_file()
    ref, cand = bad["sides"]["reference"], bad["sides"]["candidate"]
    assert ref["started"] < cand["ended"] and cand["started"] < ref["ended"]  # overlapped
    assert parity("gate", out, cwd=tmp_path).returncode == EXIT_MISMATCH
    # the order policy cannot prove anything here: these trainers record no bucket layouts
    assert parity("gate", out, "--fail-on", "any", cwd=tmp_path).returncode == EXIT_MISMATCH
    # one verdict language: the sweep ends with the gate's line; diff.json's status is the cell's
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "PARITY FAILS under --fail-on hash (exit 1): 1 hash_mismatch (perturb=true)")
    for cid, cell in c.items():
        d = json.loads((out / cell["diff_json"]).read_text())
        assert d["status"] == cell["status"]
        assert d["a"]["path"] == os.path.join("cells", cid, "reference")  # relative to the sweep
    moved = tmp_path / "downloaded"  # a CI artifact unpacked elsewhere: paths follow the folder
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns(".parity-sweep.lock"))
    shutil.rmtree(out)
    rep = parity("report", moved, cwd=tmp_path)
    cdir = moved / "cells" / "perturb=true"
    assert f"details: parity diff {cdir / 'reference'} {cdir / 'candidate'}" in rep.stdout.splitlines()


def test_dry_run_prints_commands_and_creates_nothing(tmp_path):
    out = tmp_path / "out"
    r = parity("sweep", "--dry-run", "--out", out, "--only", "bucket_order=graph", cwd=tmp_path)
    assert r.returncode == EXIT_OK, r.stderr
    assert not out.exists()
    assert "4 of 8 cells" in r.stdout and "SKIPPED: requires cuda" in r.stdout
    assert "parity exec --out" in r.stdout and "--bucket-order graph" in r.stdout
    assert "--emulate-nccl 2x2:channels=4 --" in r.stdout
    assert "--rdzv-backend c10d" in r.stdout and "--redirects 3" in r.stdout


def test_a_rank_that_refused_before_training_is_not_a_clean_finish(tmp_path):
    """A nonzero exit is tolerated only after every rank recorded a finished run up to the last
    step; a rank that exited 2 on a refused configuration closes its record as "ok" with no step
    (seen on a GPU sweep whose reference was given --cudagraphs)."""
    import json

    from parity.sweep.results import clean_finish as _clean_finish

    def rank(r, steps, status="ok"):
        d = tmp_path / f"rank-{r:05d}"
        d.mkdir(exist_ok=True)
        (d / "meta.json").write_text(json.dumps({"status": status}))
        (d / "steps.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                               for s in range(steps)))

    rank(0, 4)
    rank(1, 4)
    assert _clean_finish(tmp_path, 2, 3)
    rank(1, 0)  # refused before training: no step
    assert not _clean_finish(tmp_path, 2, 3)
    rank(1, 2)  # stopped before the last step
    assert not _clean_finish(tmp_path, 2, 3)
    rank(1, 4, status="failed")
    assert not _clean_finish(tmp_path, 2, 3)
    rank(1, 4)
    assert not _clean_finish(tmp_path, 3, 3)  # a rank directory missing
