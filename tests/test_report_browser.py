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
                  "--only", "flash=false,batch_size=1", timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    page = tmp_path / "report.html"
    rep = _parity("report", str(sweep), "--format", "html", "--output", str(page))
    assert rep.returncode == 0, rep.stderr
    profile = tmp_path / "profile"
    url = page.as_uri()
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Sweep matrix" in dom.stdout
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
