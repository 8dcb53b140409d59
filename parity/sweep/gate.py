"""The CI verdict over a sweep report.

Exit codes: 0 every compared cell holds under the policy; 1 a compared cell does not (this wins
over 3: parity demonstrably fails); 3 no mismatch but a cell failed, the sweep did not finish,
or nothing at all was compared; 2 the directory is not a readable sweep (raised). Skipped cells
never fail the gate; they are listed.

Policies (``--fail-on``): ``hash`` a cell whose hashes differ; ``order`` a cell whose bucket
order/partition/layout differs from the reference (whatever its hashes); ``any`` either.
"""

from __future__ import annotations

import sys

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, ParityError
from parity.sweep import state as st

POLICIES = ("hash", "order", "any")


def cell_fails(cell: dict, fail_on: str) -> bool:
    """Does this compared cell break parity under ``fail_on``?"""
    status = cell.get("status")
    diff = cell.get("diff") if isinstance(cell.get("diff"), dict) else {}
    order = diff.get("order") if isinstance(diff.get("order"), dict) else {}
    hash_bad = status == st.HASH_MISMATCH
    order_bad = status == st.ORDER_MISMATCH or order.get("verdict") not in (None, "identical")
    if fail_on == "hash":
        return hash_bad
    if fail_on == "order":
        return order_bad
    return hash_bad or order_bad


def evaluate(sweep: dict, fail_on: str = "hash") -> tuple[int, list[str]]:
    """(exit code, report lines) for a loaded sweep report."""
    if fail_on not in POLICIES:
        raise ParityError(f"--fail-on {fail_on!r}: one of {', '.join(POLICIES)}")
    cells = sweep.get("cells") or []
    compared = [c for c in cells if c["status"] in st.COMPARED]
    failing = [c for c in compared if cell_fails(c, fail_on)]
    failed = [c for c in cells if c["status"] == st.FAILED]
    skipped = [c for c in cells if c["status"] == st.SKIPPED]
    lines = []
    for c in failing:
        lines.append(f"MISMATCH {c['id']}: {c['status']}: {c.get('reason') or ''}".rstrip(": "))
    for c in failed:
        lines.append(f"FAILED   {c['id']}: {c.get('reason') or 'failed'}")
    for c in skipped:
        lines.append(f"skipped  {c['id']}: {c.get('reason') or ''}".rstrip(": "))
    problems = []
    if not sweep.get("complete", True):
        problems.append("the sweep did not finish")
    if not compared:
        problems.append("no cell was compared")
    if failing:
        code = EXIT_MISMATCH
    elif failed or problems:
        code = EXIT_INCOMPLETE
    else:
        code = EXIT_OK
    held = len(compared) - len(failing)
    verdict = {EXIT_OK: "PASS", EXIT_MISMATCH: "FAIL", EXIT_INCOMPLETE: "INCOMPLETE"}[code]
    summary = (f"gate {verdict} (exit {code}, --fail-on {fail_on}): {held}/{len(compared)} "
               f"compared cells hold, {len(failing)} mismatch, {len(failed)} failed, "
               f"{len(skipped)} skipped")
    if problems:
        summary += "; " + "; ".join(problems)
    return code, lines + [summary]


def gate(sweep_dir, fail_on: str = "hash", out=None) -> int:
    sweep = st.load_sweep(sweep_dir)
    code, lines = evaluate(sweep, fail_on)
    out = out or sys.stdout
    for line in lines:
        out.write(line + "\n")
    return code
