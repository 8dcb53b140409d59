"""Sweep reports: console, JSON, markdown, JUnit (parity/report/formats.py)."""

import io
import json
import sys
import types
import xml.etree.ElementTree as ET

import pytest

from parity.errors import ParityError
from parity.report.formats import (md_escape, print_sweep_console, render_sweep, sweep_junit,
                                   sweep_markdown)

NASTY = "a|b <script>alert(1)</script> [bold]x[/bold] `c` *d* & \x01 \n e"


def sweep_dict():
    def c(cid, status, reason, **kw):
        return {"id": cid, "axes": {"flash": cid.startswith("t"), "tag": NASTY}, "status": status,
                "reason": reason, "diff": kw.get("diff"), "sides": kw.get("sides", {}),
                "started": 1.0, "ended": 3.5, "wall": 2.5}

    failed_sides = {"reference": {"status": "failed", "wall": 1.25, "reason": "exit code 1; rank 1: boom",
                                  "console_log": "cells/f/logs/reference.console.log",
                                  "run_dir": "cells/f/reference", "log_dir": "cells/f/logs/reference",
                                  "rank_logs": [{"rank": 0, "stderr": "cells/f/r0.err"},
                                                {"rank": 1, "stderr": "cells/f/r1.err"}]},
                    "candidate": {"status": "not_run"}}
    return {
        "v": 1, "kind": "parity-sweep", "name": "fmt", "description": NASTY, "complete": True,
        "axes": [{"name": "flash", "values": [True, False]}, {"name": "tag", "values": [NASTY]}],
        "sides": {"reference": {"label": "eager"}, "candidate": {"label": "compiled <b>"}},
        "counts": {"match": 1, "hash_mismatch": 1, "order_mismatch": 1, "failed": 1, "skipped": 1},
        "cells": [
            c("tm", "match", "bitwise identical"),
            c("th", "hash_mismatch", "first divergent step 2: " + NASTY,
              diff={"verdict": "hash_mismatch", "first_divergent_step": 2}),
            c("to", "order_mismatch", "hashes identical; bucket order: order_differs",
              diff={"verdict": "match", "order": {"verdict": "order_differs"}}),
            c("ff", "failed", "reference: exit code 1; rank 1: boom " + NASTY, sides=failed_sides),
            c("fs", "skipped", "requires cuda " + NASTY),
        ],
    }


@pytest.fixture
def sweep_dir(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_dict()))
    return tmp_path


def test_junit_one_testcase_per_cell(sweep_dir):
    out = sweep_dir / "junit.xml"
    render_sweep(sweep_dir, "junit", str(out))
    root = ET.parse(out).getroot()  # parses: everything is escaped, control chars removed
    suite = root.find("testsuite")
    # under the sweep's policy (default hash), as the gate: the order mismatch is tolerated
    assert suite.get("tests") == "5" and suite.get("failures") == "1"
    assert suite.get("errors") == "1" and suite.get("skipped") == "1"
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["parity.fail_on"] == "hash" and props["parity.exit_code"] == "1"
    assert props["parity.verdict"].startswith("PARITY FAILS under --fail-on hash (exit 1)")
    cases = {tc.get("name"): tc for tc in suite.findall("testcase")}
    assert set(cases) == {"tm", "th", "to", "ff", "fs"}
    assert list(cases["tm"]) == []
    fail = cases["th"].find("failure")
    assert fail.get("type") == "hash_mismatch"
    assert "<script>" in fail.get("message")  # round-trips as text
    # the body is the cell's console text, not the diff JSON
    assert fail.text.startswith("PARITY FAILS under --fail-on hash (exit 1): hash mismatch")
    assert "{" not in fail.text.splitlines()[0]
    assert cases["to"].find("failure") is None
    assert "tolerated under --fail-on hash: order_mismatch" in cases["to"].find("system-out").text
    render_sweep(sweep_dir, "junit", str(out), fail_on="any")
    suite = ET.parse(out).getroot().find("testsuite")
    assert suite.get("failures") == "2"
    cases = {tc.get("name"): tc for tc in suite.findall("testcase")}
    assert cases["to"].find("failure").get("type") == "order_mismatch"
    err = cases["ff"].find("error")
    assert "rank 1: boom" in err.get("message") and "cells/f/r1.err" in err.text
    assert err.text.index("r1.err") < err.text.index("r0.err")  # the blamed rank's log first
    assert cases["fs"].find("skipped").get("message").startswith("requires cuda")
    assert float(cases["ff"].get("time")) == pytest.approx(1.25)


def test_markdown_escapes_and_tabulates(sweep_dir, capsys):
    render_sweep(sweep_dir, "markdown")
    md = capsys.readouterr().out
    assert md.startswith("## parity sweep `fmt`")
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(rows) == 1 + 5  # header + one row per cell
    n_cols = rows[0].count(" | ")
    for row in rows:  # an escaped '|' never adds a column
        assert row.replace("\\|", "").count(" | ") == n_cols
    assert "<script>" not in md and "&lt;script&gt;" in md and "<b>" not in md
    assert "\x01" not in md
    assert "`cells/f/r1.err`" in md and "<details>" in md
    # the gate's verdict first, ranks per cell, where the HTML page is
    assert md.splitlines()[2].startswith("❌ **PARITY FAILS under \\-\\-fail\\-on hash \\(exit 1\\)**")
    assert rows[0].split(" | ")[3] == "ranks"
    assert "HTML report: [" in md and "report.html" in md


def test_markdown_and_junit_agree_with_the_gate(sweep_dir, capsys):
    from parity.sweep.gate import evaluate
    from parity.sweep.state import load_sweep

    for pol in ("hash", "any", "order-only"):
        code, lines = evaluate(load_sweep(sweep_dir), pol)
        render_sweep(sweep_dir, "markdown", fail_on=pol)
        md = capsys.readouterr().out
        assert md_escape(lines[-1].split(":")[0]) in md
        render_sweep(sweep_dir, "junit", fail_on=pol)
        root = ET.fromstring(capsys.readouterr().out)
        props = {p.get("name"): p.get("value") for p in root.iter("property")}
        assert props["parity.verdict"] == lines[-1] and props["parity.exit_code"] == str(code)


def test_first_finding_is_the_most_severe():
    sw = sweep_dict()
    sw["cells"] = [c for c in sw["cells"] if c["status"] != "failed"]
    sw["cells"].sort(key=lambda c: c["status"] != "order_mismatch")  # order mismatch first
    buf = io.StringIO()
    print_sweep_console(dict(sw, _dir="/sw"), buf, color=False)
    text = buf.getvalue()
    assert "First finding (most severe), cell th: hash_mismatch" in text
    assert text.rstrip().splitlines()[-1].startswith("PARITY FAILS under --fail-on hash (exit 1)")


def test_paths_are_relative_to_where_the_sweep_is_now(tmp_path):
    sw = sweep_dict()
    sw["cells"] = [c for c in sw["cells"] if c["status"] != "failed"]
    sw["cells"][1]["diff"].update(a={"path": "cells/th/reference"}, b={"path": "cells/th/candidate"})
    buf = io.StringIO()
    print_sweep_console(dict(sw, _dir="copied/sw"), buf, color=False)
    lines = buf.getvalue().splitlines()
    # one unwrapped, copyable line
    assert "details: parity diff copied/sw/cells/th/reference copied/sw/cells/th/candidate" in lines


def test_md_escape():
    assert md_escape("a|b") == "a\\|b"
    assert md_escape("<x>") == "&lt;x&gt;"
    assert md_escape("x\ny") == "x y"


def test_console_shows_markup_literally():
    buf = io.StringIO()
    print_sweep_console(dict(sweep_dict(), _dir="/sw"), buf, color=False)
    text = buf.getvalue()
    assert "[bold]x[/bold]" in text  # rich markup in data is printed, not interpreted
    assert "\x01" not in text  # nor do control characters reach the terminal
    assert "HASH MISMATCH" in text and "FAILED" in text and "5 cells" in text
    assert "cells/f/r1.err" in text


def test_json_and_console_to_file(sweep_dir, tmp_path):
    render_sweep(sweep_dir, "json", str(tmp_path / "s.json"))
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["name"] == "fmt" and "_dir" not in data
    render_sweep(sweep_dir / "sweep.json", "console", str(tmp_path / "c.txt"))
    assert "parity sweep fmt" in (tmp_path / "c.txt").read_text()


def test_html_dispatches_lazily(sweep_dir, tmp_path, monkeypatch):
    seen = {}
    mod = types.ModuleType("parity.report.html")
    mod.write_sweep_html = lambda sweep, path, **kw: seen.update(sweep=sweep, path=path)
    monkeypatch.setitem(sys.modules, "parity.report.html", mod)
    render_sweep(sweep_dir, "html", str(tmp_path / "r.html"))
    assert seen["path"] == str(tmp_path / "r.html") and seen["sweep"].name == "fmt"


def test_unknown_format_and_bad_dir(tmp_path):
    with pytest.raises(ParityError):
        render_sweep(tmp_path, "pdf")
    with pytest.raises(ParityError, match="no sweep.json"):
        render_sweep(tmp_path, "json")
