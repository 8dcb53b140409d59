"""`--help` that teaches, and hints that fit the directory given (no jobs run)."""

import json
import re

import pytest
from click.testing import CliRunner

from parity.cli import cli
from parity.errors import ParityError
from parity.sweep.state import load_sweep

COMMANDS = ("exec", "diff", "inspect", "bisect", "sweep", "report", "gate")


def help_of(*args) -> str:
    r = CliRunner().invoke(cli, [*args, "--help"], terminal_width=100)
    assert r.exit_code == 0, r.output
    return r.output


def test_top_level_help_has_full_summaries_exit_codes_and_completion():
    out = help_of()
    for name in COMMANDS:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name + " "))
        assert not line.rstrip().endswith("..."), line  # never truncated
    assert "Exit codes:" in out and "_PARITY_COMPLETE=bash_source parity" in out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_described_and_exit_codes_listed(name):
    out = help_of(name)
    assert "Exit codes:" in out
    cmd = cli.commands[name]
    for p in cmd.params:
        if p.param_type_name != "option" or p.name == "help":
            continue
        assert p.help, f"{name} {p.opts} has no help"
        has_default = (p.show_default or "[default:" in p.help or p.is_flag
                       or p.default is None and "default" in p.help)
        assert has_default or p.required, f"{name} {p.opts}: default unsaid"


def test_only_syntax_and_policies_are_shown():
    out = help_of("sweep")
    assert "AXIS=V[|V2],..." in out and "flash=true,batch_size=1|4" in out
    for policy in ("hash", "any", "order-only"):
        assert policy in out
    assert "report.html" in help_of("report")


def test_order_policy_name_is_gone():
    r = CliRunner().invoke(cli, ["gate", "x", "--fail-on", "order"])
    assert r.exit_code == 2 and "order-only" in r.output


def test_report_on_a_run_directory_says_what_it_is(tmp_path):
    run = tmp_path / "run"
    (run / "rank-00000").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    with pytest.raises(ParityError, match=r"it is a run directory .*parity diff REFERENCE_RUN"):
        load_sweep(run)


def test_report_on_a_cell_points_at_its_sides(tmp_path):
    cell = tmp_path / "sw" / "cells" / "a=1"
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text("{}")
    with pytest.raises(ParityError) as e:
        load_sweep(cell)
    msg = str(e.value)
    assert "one cell of a sweep" in msg and "resume" not in msg
    assert f"parity diff {cell / 'reference'} {cell / 'candidate'}" in msg


def test_unfinished_sweep_suggests_resume_with_its_spec(tmp_path):
    sw = tmp_path / "sw"
    (sw / "cells").mkdir(parents=True)
    (sw / "spec.toml").write_text("")
    with pytest.raises(ParityError, match=re.escape(f"--resume --out {sw}")):
        load_sweep(sw)


def test_diff_of_a_cell_directory_points_at_reference_and_candidate(tmp_path):
    from parity.diff import diff_runs

    cell = tmp_path / "cells" / "a=1"
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({}))
    with pytest.raises(ParityError, match=re.escape(f"parity diff {cell / 'reference'}")):
        diff_runs(cell, cell)
