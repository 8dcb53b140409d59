"""The HTML report of a real small sweep, rendered in headless Chromium (skipped without one)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                 "(.ci/browser-up installs Debian's chromium)")]


def _parity(*args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "parity", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, **kw)


def test_real_sweep_report_renders_in_chromium(tmp_path):
    sweep = tmp_path / "sweep"
    run = _parity("sweep", "sweeps/cpu-default.toml", "--out", str(sweep), "--steps", "2",
                  "--only", "flash=false,bucket_order=graph", timeout=600)
    assert run.returncode == 1, run.stderr[-2000:]  # graph order diverges under NCCL emulation
    page = tmp_path / "report.html"
    rep = _parity("report", str(sweep), "--format", "html", "--output", str(page))
    assert rep.returncode == 0, rep.stderr
    profile = tmp_path / "profile"
    url = page.as_uri()
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "PARITY FAILS under --fail-on hash (exit 1)" in dom.stdout
    assert 'class="strip"' in dom.stdout  # the heatmap
    assert 'aria-label="bucket layout"' in dom.stdout  # the layout picture of the order finding
    assert "Uncaught" not in dom.stderr
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
                    "--window-size=1280,1400", "--hide-scrollbars", url],
                   capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 20_000
    if os.environ.get("PARITY_SAVE_SCREENSHOT"):
        shutil.copy(shot, os.environ["PARITY_SAVE_SCREENSHOT"])


def _bucket(sizes_a: list[tuple[str, int]], order_b: list[int]) -> dict:
    """A first_bucket dict (as parity.diff.buckets writes it): B holds A's entries in ``order_b``."""
    def entries(items):
        out, off = [], 0
        for fqn, size in items:
            out.append({"fqn": fqn, "offset": off, "size": size, "numel": size // 4,
                        "dtype": "float32"})
            off += size
        return out
    a = entries(sizes_a)
    b = entries([sizes_a[i] for i in order_b])
    rows = [{"position": i, "a": x, "b": y, "same": x == y} for i, (x, y) in enumerate(zip(a, b))]
    first = next(r["position"] for r in rows if not r["same"])
    return {"collective": "all_gather", "verdict": "order_differs", "index": 1, "b_index": 1,
            "group": "layers.0", "b_group": "layers.0", "position": first, "a": rows[first]["a"],
            "b": rows[first]["b"], "detail": "same 9 parameters, 2 at other positions",
            "rows": rows}


MEASURE = """<pre id="measure"></pre><script>
const r = e => e.getBoundingClientRect();
document.getElementById("measure").textContent = JSON.stringify({
  window: window.innerWidth,
  svgs: [...document.querySelectorAll("svg.bars")].map(s => r(s).right),
  moved: [...document.querySelectorAll("rect.moved")].map(e => ({pos: e.dataset.position,
                                                                width: r(e).width})),
  markers: document.querySelectorAll("path.marker").length});
</script></body>"""


def test_swap_of_two_small_parameters_is_visible_and_marked(tmp_path):
    """Two 128 B norms swapped inside a 106,752 B bucket: at byte scale each is ~1 px; the page
    must show both positions on both bars, outlined and marked, in a 900 px window."""
    import json

    from parity.report.html import render_sweep_html

    names = [("attention.wq.weight", 8192), ("attention.wk.weight", 8192),
             ("attention.wv.weight", 8192), ("attention.wo.weight", 8192),
             ("attention_norm.weight", 128), ("ffn_norm.weight", 128),
             ("feed_forward.w1.weight", 24576), ("feed_forward.w2.weight", 24576),
             ("feed_forward.w3.weight", 24576)]
    names = [(f"layers.0.{n}", s) for n, s in names]
    assert sum(s for _, s in names) == 106_752
    fb = _bucket(names, [0, 1, 2, 3, 5, 4, 6, 7, 8])
    diff = {"verdict": "match", "steps_compared": [0, 1], "order": {"verdict": "order_differs",
                                                                   "first_bucket": fb}}
    sweep = {"name": "swap", "steps": 1, "fail_on": "any",
             "axes": [{"name": "flash", "values": [True]}],
             "cells": [{"id": "flash=true", "axes": {"flash": True}, "status": "order_mismatch",
                        "reason": "hashes identical", "diff": diff}]}
    page = render_sweep_html(sweep)
    assert "PARITY FAILS under --fail-on any (exit 1)" in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", MEASURE))
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--window-size=900,1200", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout.split('<pre id="measure">', 1)[1].split("</pre>", 1)[0]
    m = json.loads(text.replace("&quot;", '"'))
    assert m["svgs"] and all(right <= m["window"] for right in m["svgs"])  # responsive: not cut
    assert sorted(x["pos"] for x in m["moved"]) == ["4", "4", "5", "5"]  # both positions, both bars
    assert all(x["width"] >= 10 for x in m["moved"]), m["moved"]  # visible, not 1 px
    assert m["markers"] == 4
    shot = tmp_path / "swap.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                    f"--screenshot={shot}", "--window-size=900,900", "--hide-scrollbars",
                    (tmp_path / "probe.html").as_uri()], capture_output=True, text=True,
                   timeout=120)
    assert shot.is_file()
    if os.environ.get("PARITY_SAVE_SWAP_SCREENSHOT"):
        shutil.copy(shot, os.environ["PARITY_SAVE_SWAP_SCREENSHOT"])


CHART_MEASURE = """<pre id="measure"></pre><script>
const r = e => e.getBoundingClientRect();
document.getElementById("measure").textContent = JSON.stringify({
  window: window.innerWidth,
  charts: [...document.querySelectorAll("svg.chart")].map(s => [s.getAttribute("aria-label"),
                                                               r(s).width, r(s).right]),
  loss: [...document.querySelectorAll("polyline.loss-line")].map(e => r(e).width),
  segments: document.querySelectorAll("rect.bucket-seg").length});
</script></body>"""


def test_diff_page_charts_render_in_chromium(tmp_path):
    """The diff page's charts (issue 14) lay out inside a 1000 px window: every chart drawn,
    none cut off, the loss lines span the steps."""
    import json

    from parity.diff import diff_runs
    from parity.report.html import render_diff_html

    sys.path.insert(0, str(Path(__file__).parent))
    from synth import make_run

    a = make_run(tmp_path / "a", world_size=2, steps=4, n_params=8)
    b = make_run(tmp_path / "b", world_size=2, steps=4, n_params=8, bucket_layout="graph",
                 diverge_at=2, diverge_rank=1, diverge_param=3)
    page = render_diff_html(diff_runs(a, b).to_dict())
    probe = tmp_path / "charts.html"
    probe.write_text(page.replace("</body>", CHART_MEASURE))
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--window-size=1000,1400", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout.split('<pre id="measure">', 1)[1].split("</pre>", 1)[0]
    m = json.loads(text.replace("&quot;", '"'))
    labels = [c[0] for c in m["charts"]]
    assert labels == ["loss per step", "divergent parameters per step", "bucketing summary"]
    assert all(width > 300 and right <= m["window"] for _, width, right in m["charts"]), m
    assert len(m["loss"]) == 2 and all(w > 200 for w in m["loss"]), m
    assert m["segments"] == 8  # A: 2 + 2 FSDP2 groups; B: 2 + 2 graph buckets
