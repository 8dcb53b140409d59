"""A recorded sweep renders byte-identical in every format, release after release.

tests/data/sweep-v2 is the sweep.json of a real run of the default CPU spec with the
determinism control, early stop (`stop_after_divergence = 1`), shared reference jobs, skipped
CUDA-graph cells and reduction-order prediction (`at`), recorded 2026-11-24 (the runs themselves
are not kept: `parity report` and `parity gate` read sweep.json only). tests/data/sweep-v2-expected
holds what each command printed then. A refactor of the report, policy or gate code must leave
every byte as it is; a change meant to alter output regenerates the files on purpose:

    PARITY_REGEN_GOLDEN=1 pytest tests/test_report_golden.py

and the diff of tests/data/sweep-v2-expected is then reviewed like code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SWEEP = DATA / "sweep-v2"
EXPECTED = DATA / "sweep-v2-expected"
REGEN = os.environ.get("PARITY_REGEN_GOLDEN") == "1"

# name -> (parity arguments after the sweep dir is substituted for {s}, output file or None);
# the HTML is kept as .txt: it is expected output, not a page of this repository
CASES = {
    "report-console.txt": (["report", "{s}"], None),
    "report-console-reduction.txt": (["report", "{s}", "--fail-on", "reduction"], None),
    "report-markdown.md": (["report", "{s}", "--format", "markdown"], None),
    "report-markdown-any.md": (["report", "{s}", "--format", "markdown", "--fail-on", "any"], None),
    "report-junit.xml": (["report", "{s}", "--format", "junit"], None),
    "report-junit-order-only.xml": (["report", "{s}", "--format", "junit", "--fail-on", "order-only"], None),
    "report-html.txt": (["report", "{s}", "--format", "html", "--output", "report.html"], "report.html"),
    "gate.txt": (["gate", "{s}"], None),
    "gate-any.txt": (["gate", "{s}", "--fail-on", "any"], None),
}

_STAMP = re.compile(r"written by parity \d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, str]:
    """Every case rendered from a copy of the recorded sweep (the html default would write into
    the sweep directory), in a directory of its own so relative paths come out the same."""
    work = tmp_path_factory.mktemp("golden")
    shutil.copytree(SWEEP, work / "sweep-v2")
    env = {**os.environ, "COLUMNS": "120", "TERM": "dumb", "PARITY_DEBUG": ""}
    env.pop("NO_COLOR", None)
    out = {}
    for name, (args, written) in CASES.items():
        argv = [a.replace("{s}", "sweep-v2") for a in args]
        proc = subprocess.run([sys.executable, "-m", "parity", *argv], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
        text = (work / written).read_text(encoding="utf-8") if written else proc.stdout
        text = _STAMP.sub("written by parity DATE", text)
        out[name] = f"exit {proc.returncode}\nstderr: {proc.stderr}\n---\n{text}"
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_recorded_sweep_renders_byte_identical(rendered, name):
    got = rendered[name]
    path = EXPECTED / name
    if REGEN:
        EXPECTED.mkdir(exist_ok=True)
        path.write_text(got, encoding="utf-8")
        pytest.skip(f"regenerated {path.name}")
    want = path.read_text(encoding="utf-8")
    assert got == want, (f"{name} changed; if on purpose: PARITY_REGEN_GOLDEN=1 pytest "
                         f"tests/test_report_golden.py, and review the diff of {EXPECTED.name}")
