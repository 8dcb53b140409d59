"""The CI verdict over a sweep report: ``parity gate`` and the last line of ``parity sweep``.

The rule and its words live in :mod:`parity.policy` (the same ``--fail-on`` policies
``parity diff`` applies to one pair). Exit codes: 0 every compared cell holds under the policy;
1 a compared cell fails it (this wins over 3: parity demonstrably fails); 3 no failure but a cell
failed, the sweep did not finish, nothing was compared, or (under ``any``/``order-only``) a cell's
bucket layouts could not be compared; 2 the directory is not a readable sweep (raised). Skipped
cells never fail the gate; tolerated findings (an order mismatch under ``hash``) are listed.
"""

from __future__ import annotations

import sys

from parity import policy
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH
from parity.sweep import state as st

POLICIES = tuple(policy.POLICIES)


def cell_verdict(cell: dict, fail_on: str) -> str | None:
    """'mismatch', 'incomplete' or None (holds, or not compared) for one cell under ``fail_on``."""
    code = policy.cell_code(cell, fail_on)
    return {EXIT_MISMATCH: "mismatch", EXIT_INCOMPLETE: "incomplete"}.get(code)


def cell_fails(cell: dict, fail_on: str) -> bool:
    """Does this compared cell break parity under ``fail_on``?"""
    return policy.cell_code(cell, fail_on) == EXIT_MISMATCH


def sweep_policy(sweep: dict, fail_on: str | None = None) -> str:
    """``fail_on`` if given, else the policy the sweep ran under (else the default)."""
    return policy.check(fail_on or sweep.get("fail_on") or policy.DEFAULT)


def evaluate(sweep: dict, fail_on: str | None = None) -> tuple[int, list[str]]:
    """(exit code, report lines ending with the verdict line) for a loaded sweep report."""
    verdict, lines = policy.judge_sweep(sweep, sweep_policy(sweep, fail_on))
    return verdict.code, lines + [verdict.line()]


def gate(sweep_dir, fail_on: str | None = None, out=None) -> int:
    sweep = st.load_sweep(sweep_dir)
    code, lines = evaluate(sweep, fail_on)
    out = out or sys.stdout

    def write():
        for line in lines:
            out.write(line + "\n")

    if out is sys.stdout:
        from parity.report.stdout import print_safely

        print_safely(write)
    else:
        write()
    return code
