"""The HTML report: self-contained, escaped, with the matrix strips and the bucket bars."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.diff import diff_runs  # noqa: E402
from parity.report.html import (bucket_svg, render_sweep_html, segment_widths,  # noqa: E402
                                write_diff_html)
from tests.synth import make_run  # noqa: E402

EVIL = 'layers.0.<script>alert("x")</script>&w'


def _no_external(page: str) -> None:
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page), "external asset in the report"
    assert "<script" not in page.replace("&lt;script", ""), "scripts in the report"


@pytest.fixture(scope="module")
def mismatch_diff(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    fqns = ["layers.0.attention.wq.weight", "layers.0.attention.wk.weight", EVIL,
            "layers.0.ffn_norm.weight"]
    a = make_run(tmp / "a", world_size=2, steps=4, fqns=fqns, params_per_layer=4)
    b = make_run(tmp / "b", world_size=2, steps=4, fqns=fqns, params_per_layer=4,
                 bucket_layout="graph", bucket_order="reversed-rs", diverge_at=2, diverge_rank=1,
                 diverge_param=EVIL)
    return diff_runs(a, b), tmp


def test_diff_html_has_strip_bars_table_and_escapes(mismatch_diff):
    result, tmp = mismatch_diff
    out = tmp / "diff.html"
    write_diff_html(result, out)
    page = out.read_text()
    _no_external(page)
    assert EVIL not in page  # raw markup never reaches the page
    assert "layers.0.&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;w" in page
    assert page.count('class="strip"') == 1
    assert 'aria-label="bucket layout"' in page
    # two bars: every parameter drawn once per side
    assert page.count("<rect") >= 2 * 4 + 5
    assert 'id="bucket-0"' in page and 'href="#bucket-0"' in page
    assert "Divergent parameters" in page and "hash_mismatch" in page


def test_sweep_html_matrix_states(tmp_path, mismatch_diff):
    result, _ = mismatch_diff
    d = result.to_dict()
    cells = [
        {"id": "a=1", "axes": {"a": 1}, "status": "hash_mismatch", "diff": d, "reason": "x"},
        {"id": "a=2", "axes": {"a": 2}, "status": "skipped", "reason": "requires cuda"},
        {"id": "a=3", "axes": {"a": 3}, "status": "failed", "reason": "rank 1: exit 1",
         "diff": {"steps_compared": [0, 1]}},
    ]
    page = render_sweep_html({"name": "t", "axes": [{"name": "a", "values": [1, 2, 3]}],
                              "steps": 4, "cells": cells,
                              "counts": {"hash_mismatch": 1, "skipped": 1, "failed": 1}})
    _no_external(page)
    assert page.count('class="strip"') == 3
    assert "step 3: not compared (failed)" in page
    assert "skipped (requires cuda)" in page
    assert re.search(r"step 2: \d+ parameters, \d+ gradients differ", page)


def _order_cell(cid, axes, d):
    return {"id": cid, "axes": axes, "status": "order_mismatch", "reason": "hashes identical",
            "diff": d}


def test_sweep_page_groups_findings_keeps_spec_order_and_collapses_runs(tmp_path, mismatch_diff):
    result, _ = mismatch_diff
    d = result.to_dict()
    side = {"status": "ok", "run_dir": "cells/x/reference", "console_log": "cells/x/logs/ref.log",
            "rank_logs": [{"rank": 0, "stderr": "cells/x/logs/r0.err"}],
            "command": [sys.executable, "-c", "boot", "/src", "exec", "--out", "cells/x/reference",
                        "--", "torchrun", "-m", "trainer", "--steps", "3"]}
    cells = [dict(_order_cell("zeta=true,alpha=1", {"zeta": True, "alpha": 1}, d),
                  sides={"reference": side}),
             _order_cell("zeta=false,alpha=1", {"zeta": False, "alpha": 1}, d)]
    sweep = {"name": "g", "steps": 4, "fail_on": "hash", "_dir": str(tmp_path / "sw"),
             "axes": [{"name": "zeta", "values": [True, False]}, {"name": "alpha", "values": [1]}],
             "cells": cells}
    page = render_sweep_html(sweep, page_dir=str(tmp_path / "sw"))
    _no_external(page)
    # one picture for the finding both cells share, naming both cells
    assert page.count('aria-label="bucket layout"') == 1
    assert "The same finding in 2 cell(s)" in page
    # axes in the spec's order, values as the spec writes them
    assert page.index("<th>zeta</th>") < page.index("<th>alpha</th>")
    assert "<td>true</td>" in page and "<td>True</td>" not in page
    # the gate's verdict, policy named; runs collapsed, the trainer's command, logs as links
    assert "PARITY" in page and "under --fail-on hash" in page
    assert "<details><summary>" in page and 'href="cells/x/logs/r0.err"' in page
    assert "torchrun -m trainer --steps 3" in page and "boot" not in page
    assert "Sweep matrix" not in page


def test_axis_columns_follow_the_spec_through_a_real_sweep_json(tmp_path):
    """sweep.json as build_sweep writes it (axes: a list in spec order) -> the same column order
    in the HTML matrix, the console and the markdown (an alphabetical order would put alpha
    first)."""
    import io
    import json
    import textwrap

    from parity.report.formats import print_sweep_console, sweep_markdown
    from parity.sweep.spec import parse_spec
    from parity.sweep.state import build_sweep

    sp = parse_spec(textwrap.dedent("""
        name = "order"
        [axes]
        zeta = [true, false]
        alpha = [1]
        [reference]
        argv = ["-m", "mod"]
        [candidate]
        argv = ["-m", "mod", "--c"]
        """), source="s.toml")
    states = [{"id": c.id, "axes": c.axes, "status": "skipped", "reason": "r"} for c in sp.cells()]
    sweep = json.loads(json.dumps(build_sweep(sp, tmp_path, states, started=0.0, ended=1.0,
                                              complete=True, launcher="local", steps=1, only=None,
                                              fail_on="hash")))
    assert isinstance(sweep["axes"], list)
    page = render_sweep_html(sweep)
    heads = re.findall(r"<th>(zeta|alpha)</th>", page)
    assert heads[:2] == ["zeta", "alpha"]
    md = sweep_markdown(sweep)
    assert md.index("zeta") < md.index("alpha")
    con = io.StringIO()
    print_sweep_console(sweep, con)
    assert con.getvalue().index("zeta") < con.getvalue().index("alpha")


def test_every_moved_position_is_marked(mismatch_diff):
    result, _ = mismatch_diff
    fb = result.order.first_bucket
    moved = [r["position"] for r in fb["rows"] if not r["same"]]
    assert len(moved) >= 2
    svg = bucket_svg(fb)
    assert svg.count('class="moved"') == 2 * len(moved)
    assert svg.count('class="marker"') == 2 * len(moved)
    assert 'viewBox="' in svg and "width=" not in svg.split(">", 1)[0].replace("stroke-width", "")


def test_segment_widths_keep_small_payloads_visible():
    w = segment_widths([128, 24576, 24576, 128], width=1000, min_w=34)
    assert abs(sum(w) - 1000) < 1e-6 and min(w) >= 34
    assert w[1] > w[0] * 10


def test_diff_page_has_its_own_wording_and_the_consoles_content(mismatch_diff):
    result, tmp = mismatch_diff
    out = tmp / "own.html"
    write_diff_html(result, out, fail_on="hash")
    page = out.read_text()
    for sweep_word in ("Sweep matrix", "sweep directory", "cell: diff", "<td>diff</td>"):
        assert sweep_word not in page
    assert "<h1>parity diff</h1>" in page
    assert "PARITY FAILS under --fail-on hash (exit 1)" in page
    assert "Loss, side by side" in page and "Divergent per step" in page
    assert "step 0: initial parameters" in page
    # the label names what was compared and found, never a pass (issue 34)
    fd = result.first_divergence
    assert "First divergence" in page and f"<b>{fd.label}</b>" in page
    assert "Diverged first in" not in page and "[backward]" not in page


def test_diff_page_charts_loss_divergence_and_bucketing(mismatch_diff):
    """Issue 14: the loss of both sides (and each rank's), divergent parameters per step and the
    bucketing summary as inline SVG; no scripts."""
    result, tmp = mismatch_diff
    out = tmp / "charts.html"
    write_diff_html(result, out)
    page = out.read_text()
    _no_external(page)
    assert 'aria-label="loss per step"' in page
    assert page.count('class="loss-line"') == 2 and page.count('class="loss-rank"') == 4  # 2 ranks
    assert 'class="loss-differs"' in page  # the loss of step 2 differs on rank 1
    assert 'aria-label="divergent parameters per step"' in page
    assert 'aria-label="bucketing summary"' in page
    assert page.count('class="bucket-seg" data-side="A"') == 2  # FSDP2: one group, AG + RS
    assert "Bucketing, A vs B" in page


def test_bucket_table_shows_both_sizes_where_they_differ():
    from parity.report.html import _size_cell

    assert _size_cell({"size": 64}, {"size": 64}) == "64"
    assert "64 / 128" in _size_cell({"size": 64}, {"size": 128})
    assert _size_cell({}, {"size": 128}) == "128"


def test_fsdp2_backward_regathers_are_grey_not_red_and_the_legend_is_plain():
    """Issue 34: eager FSDP2 gathers parameters again in the backward (copies), a compiled graph
    does not: those counts differ by design and are not drawn as a difference; a reduce-scatter
    count that differs still is. The bucket bars' legend says what the minimum width is."""
    from parity.report.html import bucket_svg
    from parity.report.html_charts import DIFF_COLOUR, bucketing_svg

    def row(coll, graph, source, before, after):
        return {"source": source, "graph": graph, "graph_id": None if source == "fsdp2" else 0,
                "collective": coll, "count_before": before, "count_after": after,
                "sizes": [100] * after, "spans": None, "max_span": None,
                "max_consec_compute_between_rs": None}

    a = {"graphs": [row("all_gather", "forward", "fsdp2", 21, 3),
                    row("all_gather", "backward", "fsdp2", 18, 2),
                    row("reduce_scatter", "backward", "fsdp2", 21, 3)]}
    b = {"graphs": [row("all_gather", "forward", "graph", 21, 3),
                    row("reduce_scatter", "backward", "graph", 21, 1)]}
    svg = bucketing_svg(a, b)
    assert 'class="regather"' in svg and "values unchanged" in svg
    red = [seg for seg in svg.split("<text") if f'fill="{DIFF_COLOUR}"' in seg]
    assert red and all("count 21 -&gt; 1" in seg or "count 21 -&gt; 3" in seg for seg in red)
    assert not any("18 -&gt; 2" in seg for seg in red)
    fb = {"rows": [{"position": 0, "a": {"fqn": "x", "offset": 0, "size": 8}, "b":
                    {"fqn": "x", "offset": 0, "size": 8}, "same": True}], "position": None}
    legend = bucket_svg(fb)
    assert "34/1000" not in legend and "at least 3.4% of the bar wide" in legend
