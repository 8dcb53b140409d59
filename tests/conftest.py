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
# CPU seconds (this process and every child it reaped: torchrun, its ranks, parity) per module:
# a module whose CPU seconds are well under twice its wall seconds leaves a core idle, and is
# the one to make parallel (run_table's at_once) before making it smaller.
_MODULE_CPU: dict[str, float] = {}


def _cpu_seconds() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


import pytest  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    yield
    path = item.nodeid.split("::", 1)[0]
    _MODULE_CPU[path] = _MODULE_CPU.get(path, 0.0) + _cpu_seconds() - before


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[path] = _MODULE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_MODULE_SECONDS) < 2:
        return
    total = sum(_MODULE_SECONDS.values())
    cpu = sum(_MODULE_CPU.values())
    slow = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.section("slowest test modules")
    terminalreporter.write_line("    wall  share      cpu  cores  module")
    for path, secs in slow:
        used = _MODULE_CPU.get(path, 0.0)
        terminalreporter.write_line(f"{secs:8.1f} s {100 * secs / total:5.1f}% {used:7.1f} s"
                                    f" {used / secs if secs else 0:5.2f}  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  in {len(_MODULE_SECONDS)} modules, {cpu:.1f} s of"
                                f" CPU ({cpu / total if total else 0:.2f} cores busy on average)")
