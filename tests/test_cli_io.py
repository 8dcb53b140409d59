"""Where the CLI writes and how it ends: atomic writes that never replace a symlink, a pipe or a
device; report files written whole or not at all; outputs that would overwrite recorded results
refused; a full stdout that never changes the exit code; PARITY_DEBUG; one-line errors; what
``parity exec`` leaves of a run it cannot replace. No torch job runs here (synthetic runs).

Nothing here writes to a real device node: a FIFO stands for a pipe or device, ``RLIMIT_FSIZE``
(``ulimit -f``, in a child process) for a full disk.
"""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from parity.artifacts import write_bytes_atomic
from parity.errors import ArtifactError, ParityError
from tests.synth import make_run
from tests.test_report_formats import sweep_dict

ROOT = Path(__file__).resolve().parents[1]
SPEC = """name = "tiny"
steps = 2
nproc_per_node = 2
timeout = 120

[axes]
seed2 = [0, 1]

[reference]
label = "eager"
builtin = true
args = ["--mode", "eager", "--steps", "{steps}", "--seed", "{seed2}"]

[candidate]
label = "eager again"
builtin = true
args = ["--mode", "eager", "--steps", "{steps}", "--seed", "{seed2}"]
"""


def run_main(args, capsys):
    from parity import cli

    with pytest.raises(SystemExit) as e:
        cli.main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def run_child(args, cwd, limit=None, stdout=None, env=None):
    """``python -m parity ARGS`` in a child, its file size limited to ``limit`` bytes."""
    def pre():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PARITY_DEBUG": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "parity", *args], cwd=cwd, env=env, text=True,
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, preexec_fn=pre, timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("io")
    a = make_run(tmp / "a", world_size=2, steps=2, n_params=4)
    b = make_run(tmp / "b", world_size=2, steps=2, n_params=4, diverge_at=2)
    return a, b


@pytest.fixture
def sweep(tmp_path):
    d = tmp_path / "sw"
    (d / "cells" / "tm").mkdir(parents=True)
    (d / "sweep.json").write_text(json.dumps(sweep_dict()))
    (d / ".parity-sweep").write_text(json.dumps({"v": 1, "spec_dir": None}))
    return d


def _read_fifo(path: Path, got: list) -> threading.Thread:
    t = threading.Thread(target=lambda: got.append(open(path, "rb").read()), daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------- 1. atomic writes: what is there


def test_an_atomic_write_follows_a_symlink_to_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_bytes_atomic(link, b"new")
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link stays a link
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")
    write_bytes_atomic(dangling, b"made")
    assert dangling.is_symlink() and (tmp_path / "made.json").read_bytes() == b"made"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json",
                                                          "made.json", "real.json"]


def test_an_atomic_write_to_a_fifo_writes_into_it_and_keeps_it(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list = []
    t = _read_fifo(fifo, got)
    write_bytes_atomic(fifo, b"through the pipe")
    t.join(10)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not replaced by a regular file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_an_open_descriptor_is_written_through_not_replaced(tmp_path):
    """``--json /dev/stderr 2>>log``: the path names a descriptor (here one of this process,
    opened on a file in tmp_path, reached as /proc/self/fd/N and through a symlink to it)."""
    log = tmp_path / "log"
    log.write_bytes(b"earlier\n")
    ino = log.stat().st_ino
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        write_bytes_atomic(f"/proc/self/fd/{fd}", b"one\n")
        (tmp_path / "stream").symlink_to(f"/proc/self/fd/{fd}")
        write_bytes_atomic(tmp_path / "stream", b"two\n")
    finally:
        os.close(fd)
    assert log.read_bytes() == b"earlier\none\ntwo\n" and log.stat().st_ino == ino
    assert (tmp_path / "stream").is_symlink()


def test_an_atomic_write_refuses_a_directory(tmp_path):
    with pytest.raises(ArtifactError, match="is a directory") as e:
        write_bytes_atomic(tmp_path, b"x")
    assert e.value.exit_code == 2


def test_diff_json_into_a_fifo_and_through_a_symlink(runs, tmp_path, capsys):
    a, b = runs
    fifo = tmp_path / "diff.fifo"
    os.mkfifo(fifo)
    got: list = []
    t = _read_fifo(fifo, got)
    target = tmp_path / "page.html"
    (tmp_path / "page-link.html").symlink_to(target)
    code, _, err = run_main(["diff", str(a), str(b), "--json", str(fifo),
                             "--html", str(tmp_path / "page-link.html")], capsys)
    t.join(10)
    assert code == 1, err
    assert json.loads(got[0])["first_divergent_step"] == 2
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert (tmp_path / "page-link.html").is_symlink() and "<html" in target.read_text()


# ------------------------------------------------------------ 2. report files: whole or nothing


@pytest.mark.parametrize("fmt", ["console", "json", "markdown", "junit"])
def test_a_report_that_cannot_be_written_whole_leaves_the_old_file(sweep, tmp_path, fmt):
    out = tmp_path / f"rep.{fmt}"
    old = "the previous report\n" * 1000  # 20 KB, over the 256-byte limit below
    out.write_text(old)
    p = run_child(["report", str(sweep), "--format", fmt, "--output", str(out)], tmp_path,
                  limit=256)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("parity: error: cannot write")
    assert "File too large" in p.stderr
    assert out.read_text() == old  # not cut at 256 bytes
    assert sorted(x.name for x in tmp_path.iterdir()) == ["rep." + fmt, "sw"]  # no temporary
    p = run_child(["report", str(sweep), "--format", fmt, "--output", str(out)], tmp_path)
    assert p.returncode == 0 and out.read_text() != old


# ------------------------------------------------------------ 3. outputs over recorded results


def test_diff_refuses_to_write_over_a_recorded_run(runs, tmp_path, capsys):
    a, b = runs
    meta = a / "rank-00000" / "meta.json"
    before = {p: p.read_bytes() for p in (meta, a / "run.json")}
    for args in (["--json", str(meta)], ["--html", str(a / "run.json")],
                 ["--json", str(b / "rank-00001" / "new.json")]):
        code, _, err = run_main(["diff", str(a), str(b), *args], capsys)
        assert code == 2 and err.count("\n") == 1 and "refusing to write into the run" in err
    assert {p: p.read_bytes() for p in before} == before
    assert not (b / "rank-00001" / "new.json").exists()
    link = tmp_path / "innocent.json"
    link.symlink_to(meta)
    code, _, err = run_main(["inspect", str(a), "--json", str(link)], capsys)
    assert code == 2 and "refusing" in err and meta.read_bytes() == before[meta]
    # beside the run is fine
    code, _, err = run_main(["diff", str(a), str(b), "--json", str(a / "diff.json")], capsys)
    assert code == 1 and (a / "diff.json").is_file()
    (a / "diff.json").unlink()


def test_two_outputs_of_one_command_at_one_path_are_refused(runs, tmp_path, capsys):
    a, b = runs
    x = tmp_path / "x"
    code, _, err = run_main(["diff", str(a), str(b), "--json", str(x), "--html", str(x)], capsys)
    assert code == 2 and "--json and --html name the same file" in err and not x.exists()


def test_report_refuses_the_files_the_sweep_owns(sweep, capsys):
    before = (sweep / "sweep.json").read_bytes()
    for target in ("sweep.json", "cells/tm/diff.json", ".parity-sweep", "spec.toml",
                   ".parity-sweep.lock"):
        code, _, err = run_main(["report", str(sweep), "--format", "markdown", "--output",
                                 str(sweep / target)], capsys)
        assert code == 2 and "refusing to write into the sweep" in err, (target, err)
    assert (sweep / "sweep.json").read_bytes() == before
    assert run_main(["gate", str(sweep)], capsys)[0] == 1  # still a readable sweep
    # a report beside the sweep is what the html default does: allowed, for every format
    code, out, _ = run_main(["report", str(sweep), "--format", "html"], capsys)
    assert code == 0 and out.strip() == str(sweep / "report.html")
    code, _, _ = run_main(["report", str(sweep), "--format", "markdown", "--output",
                           str(sweep / "report.md")], capsys)
    assert code == 0 and (sweep / "report.md").is_file()


def test_a_diff_of_a_sweeps_cells_cannot_write_into_the_sweep(tmp_path, capsys):
    sw = tmp_path / "sw"
    (sw / ".parity-sweep").parent.mkdir()
    (sw / ".parity-sweep").write_text("{}")
    a = make_run(sw / "cells" / "c1" / "reference", world_size=1, steps=1, n_params=2)
    b = make_run(sw / "cells" / "c1" / "candidate", world_size=1, steps=1, n_params=2)
    code, _, err = run_main(["diff", str(a), str(b), "--json",
                             str(sw / "cells" / "c1" / "diff.json")], capsys)
    assert code == 2 and "refusing to write into the sweep" in err


# --------------------------------------------------------------------------- 4. PARITY_DEBUG


@pytest.mark.parametrize("value,traceback", [("0", False), ("", False), ("no", False),
                                             ("1", True), ("true", True), ("YES", True)])
def test_parity_debug_shows_a_traceback_only_when_true_and_keeps_exit_4(
        runs, monkeypatch, capsys, value, traceback):
    import parity.diff

    def boom(*args, **kwargs):
        raise RuntimeError("a bug\nits second line")

    monkeypatch.setattr(parity.diff, "diff_runs", boom)
    monkeypatch.setenv("PARITY_DEBUG", value)
    code, _, err = run_main(["diff", str(runs[0]), str(runs[1])], capsys)
    assert code == 4
    assert ("Traceback (most recent call last)" in err) is traceback
    assert err.splitlines()[-1].startswith("parity: internal error: RuntimeError: a bug (")
    if not traceback:
        assert err.count("\n") == 1


# --------------------------------------------------------------------- 5. a full stdout


class _FullStdout(io.TextIOBase):
    """A stdout on a full disk: every write and flush fails with ENOSPC (no fileno: nothing
    is redirected in this process)."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("args", [["--help"], ["diff", "--help"], ["--version"]])
def test_help_to_a_full_stdout_exits_0_with_one_line(monkeypatch, capsys, args):
    from parity import cli

    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 0
    assert err.count("\n") == 1 and err.startswith("parity: stdout is full")


def test_dry_run_to_a_full_stdout_exits_0(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny.toml").write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    from parity import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["sweep", "tiny.toml", "--dry-run"])
    assert e.value.code == 0
    assert capsys.readouterr().err.startswith("parity: stdout is full")


def test_a_full_disk_elsewhere_is_still_an_internal_error(runs, monkeypatch, capsys):
    import parity.diff

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parity.diff, "diff_runs", full)
    code, _, err = run_main(["diff", str(runs[0]), str(runs[1])], capsys)
    assert code == 4 and "internal error: OSError" in err


@pytest.mark.parametrize("args", [["--help"], ["sweep", "tiny.toml", "--dry-run"]])
def test_a_size_limited_or_closed_stdout_in_a_real_process(tmp_path, args):
    (tmp_path / "tiny.toml").write_text(SPEC)
    full = tmp_path / "stdout.txt"
    full.write_text("x" * 1024)
    with open(full, "a") as f:  # already at the limit: every write to stdout fails (EFBIG)
        p = run_child(args, tmp_path, limit=1024, stdout=f)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("parity: stdout is full")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        p = run_child(args, tmp_path, stdout=w)
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stderr == ""


# -------------------------------------------------------------------- 6. exec --force, 8. --out ''


def test_exec_force_with_a_command_that_cannot_start_keeps_the_old_run(tmp_path, capsys):
    from parity.capture.launch import exec_command

    run = make_run(tmp_path / "run", world_size=2, steps=2, n_params=2)
    (run / "run.json").write_text('{"kept": true}')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\n")
    for argv, why in ((["parity-no-such-command-xyz", "--flag"], "command not found"),
                      ([str(script)], "command not executable"),
                      ([str(tmp_path / "missing" / "trainer")], "command not found")):
        with pytest.raises(ParityError, match=why) as e:
            exec_command(run, argv, force=True)
        assert e.value.exit_code == 2 and "left as it was" in str(e.value)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    code, _, err = run_main(["exec", "--force", "--out", str(run), "--",
                             "parity-no-such-command-xyz"], capsys)
    assert code == 2 and err.count("\n") == 1 and "left as it was" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_exec_out_empty_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["exec", "--out", "", "--", "true"], capsys)
    assert code == 2 and "--out is empty" in err
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory
    # sweep and bisect the same (they used to take '' for their default folder)
    code, _, err = run_main(["sweep", "--out", "", "--dry-run"], capsys)
    assert code == 2 and "sweep: --out is empty" in err and err.count("\n") == 1
    code, _, err = run_main(["bisect", "a", "b", "--out", ""], capsys)
    assert code == 2 and "bisect: --out is empty" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- 7. one-line errors


def test_errors_with_a_newline_stay_one_line(runs, tmp_path, capsys):
    code, _, err = run_main(["diff", "no\nsuch", str(runs[0])], capsys)
    assert code == 2 and err.count("\n") == 1 and "no\\x0asuch" in err
    code, _, err = run_main(["exec", "--out", str(tmp_path / "r"), "--", "no\nsuch"], capsys)
    assert code == 2 and err.count("\n") == 1 and "command not found: no\\x0asuch" in err


def test_bisect_json_may_go_into_its_own_folder_in_a_cell_not_over_the_cell(tmp_path):
    from parity.cli import check_outputs

    sw = tmp_path / "sw"
    cell = sw / "cells" / "c1"
    (cell / "bisect").mkdir(parents=True)
    (sw / ".parity-sweep").write_text("{}")
    runs = (cell / "reference", cell / "candidate")
    check_outputs({"--json": str(cell / "bisect" / "copy.json")}, runs=runs, own=cell / "bisect")
    with pytest.raises(ParityError, match="refusing to write into the sweep"):
        check_outputs({"--json": str(cell / "diff.json")}, runs=runs, own=cell / "bisect")
