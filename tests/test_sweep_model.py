"""Typed sweep records (parity/sweep/model.py): the JSON they write is sweep.json / cell.json of
schema version 1, read and written back unchanged (key order and unknown keys included)."""

import json
import textwrap

from parity.sweep.model import UNSET, CellResult, SideResult, SweepReport
from parity.sweep.spec import parse_spec
from parity.sweep.state import build_sweep, load_sweep, new_cell_state, write_sweep

SPEC = """
name = "m"
[axes]
zeta = [true, false]
[reference]
argv = ["-m", "mod"]
[candidate]
argv = ["-m", "mod", "--c"]
"""


def _sweep(tmp_path) -> dict:
    sp = parse_spec(textwrap.dedent(SPEC), source="s.toml")
    cells = sp.cells()
    done = new_cell_state(cells[0], {"reference": "f1", "candidate": "f2"})
    done.update(status="match", reason="bitwise identical", started=1.0, ended=4.0,
                diff={"verdict": "match"}, diff_json="cells/x/diff.json")
    done["sides"]["reference"] = SideResult(
        status="ok", label="reference", exit_code=0, reason="", started=1.0, ended=2.0,
        wall=1.0, command=["torchrun"], run_dir="cells/x/reference", log_dir="cells/x/logs",
        console_log="cells/x/c.log", rank_logs=[{"rank": 0, "stdout": "o", "stderr": "e"}],
        steps_recorded=4, leftovers_killed=0).to_dict()
    done["sides"]["candidate"] = {**done["sides"]["reference"], "reused": True,
                                  "from_the_future": [1, 2]}
    pending = new_cell_state(cells[1], {"reference": "f3", "candidate": "f4"})
    sweep = build_sweep(sp, tmp_path, [done, pending], started=0.0, ended=5.0, complete=False,
                        launcher="local", steps=3, only=None, fail_on="hash")
    write_sweep(tmp_path, sweep)
    return sweep


def test_sweep_json_round_trips_typed(tmp_path):
    written = _sweep(tmp_path)
    loaded = load_sweep(tmp_path)
    rep = SweepReport.from_dict(loaded)
    assert isinstance(rep.cells[0], CellResult)
    side = rep.cells[0].sides["candidate"]
    assert isinstance(side, SideResult) and side.reused is True and side.exit_code == 0
    assert side.extra == {"from_the_future": [1, 2]}  # a newer writer's key survives
    assert rep.cells[1].status == "failed" and "did not finish" in rep.cells[1].reason
    again = rep.to_dict()
    assert again == loaded and list(again) == list(loaded)
    assert json.dumps(again) == json.dumps(loaded)  # key order too, nested ones included
    assert {k: v for k, v in again.items() if k != "_dir"} == json.loads(
        (tmp_path / "sweep.json").read_text()) == json.loads(json.dumps(written))


def test_cell_json_round_trips_and_unset_fields_stay_out():
    state = {"v": 1, "id": "a", "axes": {"x": 1}, "status": "pending", "reason": "",
             "fingerprint": {"reference": "f"}, "requires": [], "sides": {
                 "reference": {"status": "running", "label": "eager", "started": 2.0}},
             "diff": None, "diff_json": None, "started": None, "ended": None, "updated": 3.0}
    cell = CellResult.from_dict(state)
    assert cell.sides["reference"].exit_code is UNSET and cell.wall is UNSET
    assert cell.to_dict() == state
    assert "exit_code" not in cell.sides["reference"].to_dict()
    assert SideResult(status="not_run", reason="r").to_dict() == {"status": "not_run",
                                                                 "reason": "r"}


def test_load_report_is_typed_and_the_readers_agree_with_the_dict(tmp_path):
    """load_report gives the reports a SweepReport (``dir`` set, no ``_dir`` key); the gate and
    the JSON/markdown renderers say the same of it as of the dict load_sweep returns."""
    from parity.report.formats import sweep_json, sweep_markdown
    from parity.sweep.gate import evaluate
    from parity.sweep.model import as_report
    from parity.sweep.state import load_report

    _sweep(tmp_path)
    rep = load_report(tmp_path)
    assert isinstance(rep, SweepReport) and rep.dir == str(tmp_path) and "_dir" not in rep.extra
    assert isinstance(rep.cells[0].sides["reference"], SideResult)
    assert rep.cells[0].sides["reference"].exit_code == 0 and not rep.is_complete()
    loaded = load_sweep(tmp_path)
    assert evaluate(rep) == evaluate(loaded) and evaluate(rep)[0] == 3  # did not finish
    assert sweep_markdown(rep) == sweep_markdown(loaded)
    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert json.dumps(json.loads(sweep_json(rep))) == json.dumps(on_disk)  # key order included
    built = SweepReport.from_dict(rep.to_dict())  # not read from a file: JSON via to_dict
    assert built.source is None and json.loads(sweep_json(built)) == rep.to_dict()
    assert as_report(rep) is rep
