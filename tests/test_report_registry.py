"""Extension points of issue 24: report formats and launchers by name (one home each), and the
diff JSON typed again (diff.result.from_dict) for the HTML pages."""

import json
import sys
from pathlib import Path

import click
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.cli import cli  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from parity.diff.result import from_dict  # noqa: E402
from parity.errors import ParityError  # noqa: E402
from parity.report.html import render_diff_html  # noqa: E402
from parity.report.registry import FORMATS, ReportFormat, get_format  # noqa: E402
from parity.sweep import launchers, spec  # noqa: E402
from tests.synth import make_run  # noqa: E402


def _choices(command: str, option: str) -> tuple:
    [param] = [p for p in cli.commands[command].params if p.name == option]
    assert isinstance(param.type, click.Choice)
    return tuple(param.type.choices)


def test_the_cli_reads_the_format_registry():
    assert tuple(FORMATS) == ("console", "json", "markdown", "junit", "html")
    assert _choices("report", "fmt") == tuple(FORMATS)
    assert all(isinstance(f, ReportFormat) and f.name == n for n, f in FORMATS.items())
    with pytest.raises(ParityError, match="unknown format 'pdf'"):
        get_format("pdf")


def test_launcher_names_live_in_the_registry():
    assert launchers.NAMES == ("local", "slurm")
    assert _choices("sweep", "launcher") == launchers.NAMES == spec.LAUNCHERS
    local = launchers.make_launcher("local")
    assert type(local).__name__ == "MultiNodeLauncher" and local.name == "local"
    assert local.unmet("launcher:local", 1) is None
    assert "requires the slurm launcher" in local.unmet("launcher:slurm", 1)
    with pytest.raises(ParityError, match="unknown launcher 'ssh'"):
        launchers.make_launcher("ssh")


@pytest.fixture(scope="module")
def diverging(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fromdict")
    fqns = ["layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
            "layers.0.ffn_norm.weight"]
    a = make_run(tmp / "a", world_size=2, steps=3, fqns=fqns, params_per_layer=3)
    b = make_run(tmp / "b", world_size=2, steps=3, fqns=fqns, params_per_layer=3,
                 bucket_layout="graph", bucket_order="reversed-rs", diverge_at=2, diverge_rank=1,
                 diverge_param=fqns[0])
    return diff_runs(a, b)


def test_from_dict_is_to_dicts_inverse(diverging):
    d = json.loads(json.dumps(diverging.to_dict()))  # as a file holds it
    typed = from_dict(d)
    assert typed.to_dict() == d
    assert typed.exit_code("any") == diverging.exit_code("any")
    assert typed.divergent[0].fqn == diverging.divergent[0].fqn
    # the page is the same whether it is given the result or its JSON (bar the time written)
    strip = lambda page: page.rsplit("written by parity", 1)[0]  # noqa: E731
    assert strip(render_diff_html(diverging)) == strip(render_diff_html(d))


def test_from_dict_reads_a_partial_record_as_the_reports_did():
    typed = from_dict({"steps_compared": [0, 1], "divergent": [{"step": 1}, "junk"]})
    assert typed.first_divergence is None and typed.order.first_bucket is None
    assert [x.step for x in typed.divergent] == [1] and typed.divergent[0].ranks == []
