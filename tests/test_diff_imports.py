"""`parity diff` of two identical runs imports only what it needs (issue 23, item 5): no numpy,
pandas, torch or jsonschema; numpy arrives only when something differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.synth import make_run

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "pandas", "torch", "jsonschema")
PROBE = """
import sys
from parity.cli import main
try:
    main(["diff", sys.argv[1], sys.argv[2]])
except SystemExit as e:
    code = e.code
print("EXIT", code, "LOADED", ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imports")
    common = {"world_size": 2, "steps": 3, "n_params": 8}
    return (make_run(tmp / "a", **common), make_run(tmp / "a_same", **common),
            make_run(tmp / "b", **common, diverge_at=2, diverge_rank=1, diverge_param=3))


def _loaded(a: Path, b: Path) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), str(a), str(b)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = [x for x in proc.stderr.splitlines() if x.startswith("EXIT")][-1].split()
    return int(line[1]), [m for m in (line[3].split(",") if len(line) > 3 else []) if m]


def test_identical_runs_import_no_numpy(runs):
    a, a_same, _ = runs
    code, loaded = _loaded(a, a_same)
    assert code == 0
    assert loaded == []


def test_divergent_runs_still_drill(runs):
    a, _, b = runs
    code, loaded = _loaded(a, b)
    assert code == 1
    assert "numpy" in loaded  # per-parameter hashes are compared with numpy
    assert "pandas" not in loaded and "torch" not in loaded
