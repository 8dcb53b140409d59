"""The CI verdict over a sweep report: ``parity gate`` and the last line of ``parity sweep``.

The rule and its words live in :mod:`parity.policy` (the same ``--fail-on`` policies
``parity diff`` applies to one pair). Exit codes: 0 every compared cell holds under the policy;
1 a compared cell fails it (this wins over 3: parity demonstrably fails); 3 no failure but a cell
failed, the sweep did not finish, nothing was compared, or (under ``any``/``order-only``) a cell's
bucket layouts could not be compared; 2 the directory is not a readable sweep (raised). Skipped
cells never fail the gate; tolerated findings (an order mismatch under ``hash``) are listed.
"""

from __future__ import annotations

from parity import policy
from parity.sweep import state as st
from parity.sweep.model import SweepReport, as_report

POLICIES = tuple(policy.POLICIES)


def sweep_policy(report: SweepReport, fail_on: str | None = None) -> str:
    """``fail_on`` if given, else the policy the sweep ran under (else the default)."""
    return policy.check(fail_on or report.fail_on or policy.DEFAULT)


def evaluate(sweep: SweepReport | dict, fail_on: str | None = None) -> tuple[int, list[str]]:
    """(exit code, report lines ending with the verdict line) for a loaded sweep report (typed,
    or sweep.json as ``load_sweep`` returns it: typed here, once)."""
    report = as_report(sweep)
    verdict, lines = policy.judge_sweep(report, sweep_policy(report, fail_on))
    return verdict.code, lines + [verdict.line()]


def gate(sweep_dir, fail_on: str | None = None) -> tuple[int, list[str]]:
    """(exit code, lines ending with the verdict line) for the sweep in ``sweep_dir``; raises
    ParityError (exit 2) when it is not a readable sweep. ``parity gate`` prints the lines."""
    return evaluate(st.load_report(sweep_dir), fail_on)
