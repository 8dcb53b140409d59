"""The CI verdict over a sweep report.

Exit codes: 0 every compared cell holds under the policy; 1 a compared cell does not (this wins
over 3: parity demonstrably fails); 3 no mismatch but a cell failed, the sweep did not finish,
or nothing at all was compared; 2 the directory is not a readable sweep (raised). Skipped cells
never fail the gate; they are listed.

Policies (``--fail-on``), as ``parity diff`` applies them to one pair: ``hash`` a cell whose
hashes differ; ``order`` a cell whose bucket order/partition/layout differs from the reference
(whatever its hashes); ``any`` either. Under ``order``/``any`` a cell whose bucket order could
not be compared (a side recorded no layouts) is unproven: exit 3 unless something mismatches.
"""

from __future__ import annotations

import sys

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, ParityError
from parity.sweep import state as st

POLICIES = ("hash", "order", "any")


ORDER_FAILURES = ("order_differs", "partition_differs", "layout_differs")  # as parity.diff


def cell_verdict(cell: dict, fail_on: str) -> str | None:
    """'mismatch', 'incomplete' or None for a compared cell, with parity.diff's policy
    (DiffResult.exit_code): under order/any, a bucket order the diff could not compare
    ('unavailable') is incomplete data, not a pass."""
    status = cell.get("status")
    diff = cell.get("diff") if isinstance(cell.get("diff"), dict) else {}
    order = diff.get("order") if isinstance(diff.get("order"), dict) else {}
    oval = order.get("verdict")
    if fail_on in ("hash", "any") and status == st.HASH_MISMATCH:
        return "mismatch"
    if fail_on in ("order", "any") and (status == st.ORDER_MISMATCH or oval in ORDER_FAILURES):
        return "mismatch"
    if fail_on in ("order", "any") and oval not in ("identical", *ORDER_FAILURES):
        return "incomplete"
    return None


def cell_fails(cell: dict, fail_on: str) -> bool:
    """Does this compared cell break parity under ``fail_on``?"""
    return cell_verdict(cell, fail_on) == "mismatch"


def evaluate(sweep: dict, fail_on: str = "hash") -> tuple[int, list[str]]:
    """(exit code, report lines) for a loaded sweep report."""
    if fail_on not in POLICIES:
        raise ParityError(f"--fail-on {fail_on!r}: one of {', '.join(POLICIES)}")
    cells = sweep.get("cells") or []
    compared = [c for c in cells if c["status"] in st.COMPARED]
    failing = [c for c in compared if cell_verdict(c, fail_on) == "mismatch"]
    unproven = [c for c in compared if cell_verdict(c, fail_on) == "incomplete"]
    failed = [c for c in cells if c["status"] == st.FAILED]
    skipped = [c for c in cells if c["status"] == st.SKIPPED]
    lines = []
    for c in failing:
        lines.append(f"MISMATCH {c['id']}: {c['status']}: {c.get('reason') or ''}".rstrip(": "))
    for c in failed:
        lines.append(f"FAILED   {c['id']}: {c.get('reason') or 'failed'}")
    for c in unproven:
        order = (c.get("diff") or {}).get("order") or {}
        lines.append(f"UNPROVEN {c['id']}: bucket order {order.get('verdict') or 'not recorded'} "
                     f"(--fail-on {fail_on} needs both sides' bucket layouts)")
    for c in skipped:
        lines.append(f"skipped  {c['id']}: {c.get('reason') or ''}".rstrip(": "))
    for c in compared:  # capture warnings of cells that hold: said, not failing
        warns = (c.get("diff") or {}).get("warnings") if isinstance(c.get("diff"), dict) else None
        if warns and c not in failing:
            w = warns[0] if isinstance(warns[0], dict) else {}
            lines.append(f"warning  {c['id']}: {len(warns)} capture warning(s) "
                         f"({str(w.get('side', '?')).upper()}: {w.get('message')})")
    problems = []
    if not sweep.get("complete", True):
        problems.append("the sweep did not finish")
    if not compared:
        problems.append("no cell was compared")
    if failing:
        code = EXIT_MISMATCH
    elif failed or unproven or problems:
        code = EXIT_INCOMPLETE
    else:
        code = EXIT_OK
    held = len(compared) - len(failing) - len(unproven)
    verdict = {EXIT_OK: "PASS", EXIT_MISMATCH: "FAIL", EXIT_INCOMPLETE: "INCOMPLETE"}[code]
    summary = (f"gate {verdict} (exit {code}, --fail-on {fail_on}): {held}/{len(compared)} "
               f"compared cells hold, {len(failing)} mismatch, {len(unproven)} unproven, "
               f"{len(failed)} failed, "
               f"{len(skipped)} skipped")
    if problems:
        summary += "; " + "; ".join(problems)
    return code, lines + [summary]


def gate(sweep_dir, fail_on: str = "hash", out=None) -> int:
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
