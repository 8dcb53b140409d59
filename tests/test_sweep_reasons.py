"""What a sweep says when something is wrong: a failed job's reason names its cause, a bad spec
or report is refused in one line before anything runs, a report of a running sweep says it is
running. Mostly synthetic (no jobs); two tiny real torchrun jobs (1 rank, no training) show the
launcher's reasons, which nothing else can.
"""

import json
import sys
import time
from pathlib import Path

import pytest

from parity.errors import EXIT_INCOMPLETE, EXIT_USAGE, ParityError, SpecError
from parity.sweep.launch_local import LocalLauncher
from parity.sweep.launcher import FAILED, Job
from parity.sweep.gate import gate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_sweep_gate import MATCH, cell, diff, sweep  # noqa: E402

NOT_CAPTURED = ("nothing was captured: no process of the command imported torch under capture "
                "(a wrapper that imports torch before starting the trainer keeps its child out "
                "of capture)")


def _job(tmp_path: Path, argv, capture=True) -> Job:
    return Job("c", "candidate", list(argv), 1, 1, {"OMP_NUM_THREADS": "1"}, tmp_path / "run",
               tmp_path / "logs", 120, tmp_path / "console.log", cwd=tmp_path, capture=capture)


def _run(job: Job):
    lnch = LocalLauncher(grace=1)
    h = lnch.start(job)
    while (res := lnch.poll(h)) is None:
        time.sleep(0.2)
    lnch.close()
    return res


# ------------------------------------------------------------------ 2: a failed job's reason


def test_run_json_error_is_the_reason_and_an_exit_code_restated_is_not(tmp_path):
    from parity.sweep.launcher import run_error

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "failed", "error": NOT_CAPTURED}))
    assert run_error(run).startswith("nothing was captured: no process of the command")
    assert len(run_error(run, limit=40)) == 40 and run_error(run, limit=40).endswith("...")
    for restated in ("exited with code 2", "node 1: exited with code 2", "killed by SIGKILL"):
        (run / "run.json").write_text(json.dumps({"error": restated}))
        assert run_error(run) == ""
    (run / "run.json").write_text("{broken")
    assert run_error(run) == "" and run_error(tmp_path / "nothing") == ""


def test_console_hint_is_the_launchers_own_error_line(tmp_path):
    from parity.sweep.launcher import console_hint

    log = tmp_path / "console.log"
    log.write_text("usage: run.py [-h]\n              training_script ...\n"
                   "run.py: error: unrecognized arguments: -c\n[default0]:ValueError: rank's\n"
                   "parity: captured no rank\n")
    assert console_hint(log) == "run.py: error: unrecognized arguments: -c"
    assert console_hint(tmp_path / "none") == ""


def test_failure_detail_prefers_run_json_then_ranks_then_console(tmp_path):
    from parity.sweep.launcher import failure_detail

    job = _job(tmp_path, ["x.py"])
    (tmp_path / "console.log").write_text("run.py: error: bad\n")
    assert failure_detail(job, []) == "run.py: error: bad"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"error": NOT_CAPTURED}))
    assert failure_detail(job, []).startswith("nothing was captured")
    assert failure_detail(job, [], reason=f"exit code 3; {NOT_CAPTURED}") == "run.py: error: bad"
    # capture = false: run.json is the trainer's business, not parity exec's
    assert failure_detail(_job(tmp_path, ["x.py"], capture=False), []) == "run.py: error: bad"


def test_slurm_launcher_uses_the_same_detail(tmp_path):
    from parity.sweep.launch_slurm import SlurmHandle, SlurmLauncher

    job = _job(tmp_path, ["x.py"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"error": NOT_CAPTURED}))
    h = SlurmHandle(job, ["sbatch"], time.time(), job_id="7")
    res = SlurmLauncher()._result(h, FAILED, 3, "exit code 3")
    assert res.reason.startswith("exit code 3; nothing was captured"), res.reason


NOTORCH = 'print("hi")\n'


def test_a_candidate_that_never_imports_torch_says_nothing_was_captured(tmp_path):
    script = tmp_path / "notorch.py"
    script.write_text(NOTORCH)
    res = _run(_job(tmp_path, [str(script)]))
    assert res.status == FAILED and res.exit_code == EXIT_INCOMPLETE
    assert res.reason.startswith("exit code 3; nothing was captured: no process of the command "
                                 "imported torch"), res.reason
    assert "\n" not in res.reason


def test_a_torchrun_usage_error_names_it(tmp_path):
    res = _run(_job(tmp_path, ["-c", "import sys; sys.exit(3)"]))
    assert res.status == FAILED
    assert "unrecognized arguments: -c" in res.reason, res.reason


# ------------------------------------------------------------------ 3: a sweep still running


def _running_sweep(d: Path) -> None:
    from parity.sweep.state import write_cell

    interrupted = "did not finish (sweep interrupted; rerun with --resume)"
    done = cell("a", "match", diff())
    rep = sweep(done, *(cell(x, "failed", None, interrupted) for x in "bcd"), complete=False)
    (d / "cells").mkdir(parents=True)
    (d / "sweep.json").write_text(json.dumps(rep))
    for cid, status in (("b", "running"), ("c", "pending")):
        (d / "cells" / cid).mkdir()
        write_cell(d, {"v": 1, "id": cid, "axes": {"k": cid}, "status": status, "reason": "",
                       "sides": {}})


def test_a_running_sweep_is_reported_running_not_interrupted(tmp_path):
    from parity.sweep.state import SweepLock, load_report, running_holder

    d = tmp_path / "sw"
    _running_sweep(d)
    code, lines = gate(d)  # nobody holds the lock: the sweep stopped
    assert code == EXIT_INCOMPLETE and "interrupted" in "\n".join(lines)
    lock = SweepLock(d).acquire()  # a live process holds it (flock: per open file)
    try:
        assert running_holder(d) is not None
        rep = load_report(d)
        got = {c.id: (c.status, c.reason) for c in rep.cells}
        assert got["b"][0] == "running" and "still running" in got["b"][1]
        assert got["c"][0] == "pending" and "still running" in got["c"][1]
        assert got["d"][0] == "pending"  # no cell.json yet: not started
        assert got["a"][0] == "match"
        assert rep.counts["running"] == 1 and rep.counts["pending"] == 2
        code, lines = gate(d)
        text = "\n".join(lines)
        assert code == EXIT_INCOMPLETE and "interrupted" not in text, text
        assert "3 pending" in lines[-1]
        # JUnit: a cell not compared yet is an error, never a passed testcase
        from parity.report.formats import sweep_junit

        xml = sweep_junit(rep)
        import xml.etree.ElementTree as ET

        cases = {c.get("name"): c for c in ET.fromstring(xml).iter("testcase")}
        for cid in ("b", "c", "d"):
            assert cases[cid].find("error") is not None, xml
        assert cases["a"].find("error") is None and cases["a"].find("failure") is None
    finally:
        lock.release()
    assert running_holder(d) is None
    assert "interrupted" in "\n".join(gate(d)[1])


# ------------------------------------------------------------------ 4: workdir


@pytest.mark.parametrize("kind", ["file", "missing"])
def test_a_bad_workdir_is_a_spec_error_before_anything_runs(tmp_path, kind):
    from parity.sweep.runner import run_sweep

    wd = tmp_path / "wd"
    if kind == "file":
        wd.write_text("")
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "s"\nworkdir = "wd"\ncapture = false\n[axes]\nk = [1]\n'
                    '[reference]\nargv = ["x.py"]\n[candidate]\nargv = ["x.py"]\n')
    out = tmp_path / "out"
    with pytest.raises(SpecError) as e:
        run_sweep(spec, out_dir=out)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_USAGE and "\n" not in msg
    assert "workdir" in msg and str(wd) in msg
    assert ("not a directory" if kind == "file" else "no such directory") in msg
    assert not out.exists()  # nothing created, nothing launched


# ------------------------------------------------------------------ 5, 6: bad sweep.json


def test_a_bad_fail_on_in_sweep_json_names_the_field_and_the_file(tmp_path):
    rep = sweep(MATCH)
    rep["fail_on"] = "nope"
    (tmp_path / "sweep.json").write_text(json.dumps(rep))
    with pytest.raises(ParityError) as e:
        gate(tmp_path)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_USAGE
    assert "sweep.json" in msg and "fail_on 'nope'" in msg and "--fail-on 'nope'" not in msg


def test_a_cell_listed_twice_is_refused(tmp_path):
    rep = sweep(MATCH, cell("o", "match", diff()))
    rep["cells"].append(cell("m", "match", diff()))  # 3 cells of a 2-cell matrix
    (tmp_path / "sweep.json").write_text(json.dumps(rep))
    with pytest.raises(ParityError, match="malformed sweep report: cell m is listed twice") as e:
        gate(tmp_path)
    assert e.value.exit_code == EXIT_USAGE


# ------------------------------------------------------------------ 8: capture = false


def test_a_side_that_was_not_captured_and_wrote_nothing_says_so(tmp_path):
    from parity.sweep.results import compare_cell

    cdir = tmp_path / "cells" / "k=1"
    (cdir / "candidate").mkdir(parents=True)
    status, reason, d = compare_cell(cdir / "reference", cdir / "candidate", cdir / "diff.json",
                                     tmp_path, captured=False)
    assert status == "failed" and d is None
    assert "reference was not captured (capture = false)" in reason
    assert "cells/k=1/reference" in reason and "no such directory" not in reason
    _, reason, _ = compare_cell(cdir / "reference", cdir / "candidate", cdir / "diff.json",
                                tmp_path)
    assert "reference wrote no parity artifacts" in reason


# ------------------------------------------------------------------ 7: --nccl-log, empty dir


def test_an_empty_nccl_log_directory_is_said(tmp_path):
    from parity.nccl.logs import topology_from_log

    with pytest.raises(ParityError) as e:
        topology_from_log(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "no log file" in msg and "communicator" not in msg


# ------------------------------------------------------------------ 1: nccl-probe --spec


def test_probe_with_spec_refuses_a_dir_holding_a_probe_before_launching(tmp_path, monkeypatch):
    import parity.probe.launch as pl

    spec = tmp_path / "s.toml"
    spec.write_text('name = "s"\nnproc_per_node = 2\n[axes]\nk = [1]\n'
                    '[reference]\nargv = ["x.py"]\n[candidate]\nargv = ["x.py"]\n')
    out = tmp_path / "probe"
    out.mkdir()
    (out / "probe.json").write_text("{}")
    started = []

    def no_launch(*a, **k):
        started.append(a)
        raise AssertionError("the job must not start")

    monkeypatch.setattr(pl, "make_launcher", no_launch)
    with pytest.raises(ParityError) as e:
        pl.launch(str(spec), str(out), ["--sizes", "1K"], None)
    assert e.value.exit_code == EXIT_USAGE and "already holds a probe" in str(e.value)
    assert not started and not (out / "job").exists()
    # --force passes the check (and reaches the launcher)
    with pytest.raises(AssertionError, match="must not start"):
        pl.launch(str(spec), str(out), ["--sizes", "1K", "--force"], None)
    assert started


def test_probe_with_spec_checks_the_workdir_before_launching(tmp_path, monkeypatch):
    import parity.probe.launch as pl

    spec = tmp_path / "s.toml"
    spec.write_text('name = "s"\nworkdir = "gone"\n[axes]\nk = [1]\n'
                    '[reference]\nargv = ["x.py"]\n[candidate]\nargv = ["x.py"]\n')
    monkeypatch.setattr(pl, "make_launcher", lambda *a, **k: 1 / 0)
    with pytest.raises(SpecError, match="workdir: .*gone: no such directory"):
        pl.launch(str(spec), str(tmp_path / "probe"), [], None)
    assert not (tmp_path / "probe").exists()
