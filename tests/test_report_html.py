"""The HTML report: self-contained, escaped, with the matrix strips and the bucket bars."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.diff import diff_runs  # noqa: E402
from parity.report.html import render_sweep_html, write_diff_html  # noqa: E402
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
    page = render_sweep_html({"name": "t", "axes": {"a": {}}, "steps": 4, "cells": cells,
                              "counts": {"hash_mismatch": 1, "skipped": 1, "failed": 1}})
    _no_external(page)
    assert page.count('class="strip"') == 3
    assert "step 3: not compared (failed)" in page
    assert "skipped (requires cuda)" in page
    assert re.search(r"step 2: \d+ parameters, \d+ gradients differ", page)
