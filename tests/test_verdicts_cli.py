"""Issue 13: sweeps and the command line never lose a result or lie about it.

One real sweep (tests/trainers/crash.py under torchrun, capture = false, 1 rank: ~4 jobs of a
few seconds); the rest are `parity` processes on synthetic runs or specs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import make_run  # noqa: E402

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_USAGE  # noqa: E402
from parity.report.text import safe_text  # noqa: E402
from parity.sweep.spec import parse_only, parse_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CRASH = str(ROOT / "tests" / "trainers" / "crash.py")
PARITY = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                                "import cli; cli.main()"]


def parity(*args, cwd, stdout=subprocess.PIPE, timeout=600):
    env = {**os.environ, "COLUMNS": "200"}  # no table wrapping inside the names looked for
    return subprocess.run(PARITY + [str(a) for a in args], cwd=cwd, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, env=env)


def side(extra: str = "") -> str:
    return (f'argv = ["{CRASH}", "--run-dir", "{{run_dir}}", "--steps", "{{steps}}"{extra}]\n')


# ---------------------------------------------------------------------------- one real sweep


def test_exit_code_is_the_side_status_and_resume_without_spec_keeps_finished_cells(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "work").mkdir()
    spec = specs / "exitcode.toml"
    spec.write_text('name = "exitcode"\nsteps = 2\nnproc_per_node = 1\ncapture = false\n'
                    'workdir = "work"\n[axes]\ncode = ["0", "3"]\n'
                    f"[reference]\n{side()}[candidate]\n"
                    + side(', "--exit-code", "{code}"'))
    out = tmp_path / "out"
    r = parity("sweep", spec, "--out", out, cwd=specs)
    assert r.returncode == EXIT_INCOMPLETE, r.stderr
    cells = {c["id"]: c for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert cells["code=0"]["status"] == "match"
    # the trainer exited 3 after recording every step: failed, not "ok (tolerated)"
    assert cells["code=3"]["status"] == "failed"
    assert cells["code=3"]["sides"]["candidate"]["exit_code"] not in (0, None)  # torchrun: 1
    assert "tolerate" not in cells["code=3"]["reason"]
    marker = json.loads((out / ".parity-sweep").read_text())
    assert marker["spec_dir"] == str(specs) and marker["cwd"] == str(specs)

    # --resume without SPEC from elsewhere: "workdir" resolves as in the original run, so the
    # finished cell keeps its fingerprint and is neither rerun nor deleted
    before = (out / "cells" / "code=0" / "diff.json").stat().st_mtime_ns
    r = parity("sweep", "--resume", "--out", out, "--only", "code=0", cwd=tmp_path)
    assert r.returncode == EXIT_INCOMPLETE, r.stderr  # code=3 stays failed
    assert "0 cell(s) to run of 2" in r.stderr
    cells = {c["id"]: c for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert cells["code=0"]["status"] == "match"
    assert (out / "cells" / "code=0" / "diff.json").stat().st_mtime_ns == before

    # a changed spec on --resume: refused, nothing deleted
    spec.write_text(spec.read_text().replace('"--steps", "{steps}"]\n[candidate]',
                                             '"--steps", "{steps}", "--seed", "1"]\n'
                                             '[candidate]'))
    r = parity("sweep", spec, "--resume", "--out", out, "--only", "code=0", cwd=specs)
    assert r.returncode == EXIT_USAGE and "refusing to replace" in r.stderr
    assert r.stderr.count("\n") == 1
    assert (out / "cells" / "code=0" / "diff.json").stat().st_mtime_ns == before


# ----------------------------------------------------------------------- sweep directories


def test_out_with_an_unrelated_spec_toml_is_refused(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "s"\ncapture = false\n[reference]\n{side()}[candidate]\n{side()}')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "spec.toml").write_text("# my own notes\n")
    r = parity("sweep", spec, "--out", mine, cwd=tmp_path)
    assert r.returncode == EXIT_USAGE and "not a parity sweep directory" in r.stderr
    assert (mine / "spec.toml").read_text() == "# my own notes\n"


@pytest.mark.parametrize("where", ["axis", "env"])
def test_nul_in_values_is_refused_at_validation(tmp_path, where):
    body = ('[axes]\nx = ["a\\u0000b"]\n' if where == "axis" else '[env]\nFOO = "a\\u0000b"\n')
    spec = tmp_path / "nul.toml"
    spec.write_text(f'name = "nul"\n{body}[reference]\n{side()}[candidate]\n{side()}')
    r = parity("sweep", spec, "--out", tmp_path / "o", cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    assert r.stderr.count("\n") == 1 and "NUL" in r.stderr
    assert not (tmp_path / "o").exists()


def test_only_values_with_commas_and_bars_can_be_selected():
    sp = parse_spec('name = "t"\n[axes]\ndims = ["2,4", "8|9", \'a\\b\', "x"]\n'
                    '[reference]\nargv = ["a.py"]\n[candidate]\nargv = ["a.py"]\n')
    assert parse_only(r"dims=2\,4|8\|9", sp) == {"dims": {"2,4", "8|9"}}
    assert parse_only(r"dims=a\\b,dims=x", sp) == {"dims": {"a\\b", "x"}}


def test_malformed_sweep_json_fields_are_usage_errors(tmp_path):
    d = tmp_path / "sw"
    d.mkdir()
    base = {"v": 1, "kind": "parity-sweep", "name": "x", "cells": [
        {"id": "a", "status": "match", "axes": {"k": 1}, "sides": {}, "reason": "r"}]}
    for field, bad in (("axes", "nope"), ("sides", 5), ("counts", []), ("cells.sides", [1]),
                       ("cells.axes", [1]), ("cells.diff", 3), ("timing", "x")):
        obj = json.loads(json.dumps(base))
        if field.startswith("cells."):
            obj["cells"][0][field.split(".", 1)[1]] = bad
        else:
            obj[field] = bad
        (d / "sweep.json").write_text(json.dumps(obj))
        for fmt in ("console", "markdown", "junit", "html", "json"):
            r = parity("report", d, "--format", fmt, "--output", tmp_path / "o", cwd=tmp_path)
            assert r.returncode in (0, EXIT_USAGE), (field, fmt, r.stderr)
            if r.returncode:
                assert r.stderr.count("\n") == 1 and "sweep.json" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ diff output


def test_closed_or_full_stdout_keeps_files_and_exit_code(tmp_path):
    a = make_run(tmp_path / "a", world_size=2, steps=3)
    b = make_run(tmp_path / "b", world_size=2, steps=3, diverge_at=2)
    with open("/dev/full", "w") as full:
        r = parity("diff", a, b, "--json", tmp_path / "d1.json", stdout=full, cwd=tmp_path)
    assert r.returncode == EXIT_MISMATCH, r.stderr
    assert json.loads((tmp_path / "d1.json").read_text())["verdict"] == "hash_mismatch"
    rd, wr = os.pipe()
    os.close(rd)  # `| head` that has already exited
    with os.fdopen(wr, "w") as closed:
        r = parity("diff", a, b, "--json", tmp_path / "d2.json", stdout=closed, cwd=tmp_path)
    assert r.returncode == EXIT_MISMATCH, r.stderr
    assert (tmp_path / "d2.json").exists()
    assert "Traceback" not in r.stderr


def test_click_usage_errors_are_one_line(tmp_path):
    for args in (["diff"], ["sweep", "--bogus"], ["diff", "a", "b", "--fail-on", "x"], ["nope"]):
        r = parity(*args, cwd=tmp_path)
        assert r.returncode == EXIT_USAGE
        assert r.stderr.startswith("parity: error: ") and r.stderr.count("\n") == 1, r.stderr


def test_hostile_parameter_names_are_escaped_in_every_format(tmp_path):
    name = "layers.0.\x1b[31mred\u202eevil\udcff"
    fqns = [name, "layers.0.ok"]
    a = make_run(tmp_path / "a", world_size=1, steps=2, n_params=2, fqns=fqns)
    b = make_run(tmp_path / "b", world_size=1, steps=2, n_params=2, fqns=fqns, diverge_at=1,
                 diverge_param=name)
    r = parity("diff", a, b, "--html", tmp_path / "d.html", "--json", tmp_path / "d.json",
               cwd=tmp_path)
    assert r.returncode == EXIT_MISMATCH, r.stderr
    assert "\x1b" not in r.stdout and "\u202e" not in r.stdout
    assert "\\x1b[31mred" in r.stdout and "\\u202e" in r.stdout and "\\udcff" in r.stdout
    html = (tmp_path / "d.html").read_text()
    assert "\\u202e" in html and "\u202e" not in html
    json.loads((tmp_path / "d.json").read_text())
    assert safe_text("a\x9bb\u2066") == "a\\x9bb\\u2066"
