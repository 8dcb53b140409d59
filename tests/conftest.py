"""Make ``tests.*`` helpers (synth, slurm_cluster, trainers) importable from any test file,
whatever order pytest collects them in."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


# --- where CI's time goes -------------------------------------------------------------------
# CI must finish within 90 minutes on 2 cores (aim: 20); most of its time is real torchrun jobs,
# started by module-scoped fixtures and so charged to a module's first test. pytest's own
# ``--durations`` lists tests; this lists modules (setup, call and teardown of every test),
# so the next engineer sees which modules to make cheaper. Printed at the end of every run.
_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[path] = _MODULE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_MODULE_SECONDS) < 2:
        return
    total = sum(_MODULE_SECONDS.values())
    slow = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.section("slowest test modules")
    for path, secs in slow:
        terminalreporter.write_line(f"{secs:8.1f} s  {100 * secs / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  in {len(_MODULE_SECONDS)} modules")
