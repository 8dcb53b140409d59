"""The cells a sweep report must hold: every combination of its axes.

``sweep.json`` lists every cell of the matrix (a cell ``--only`` left out is ``skipped``). The
gate and the reports must not trust that list: a cell deleted from it (by hand, or a truncated
copy with ``complete: true``) would vanish from the verdict and leave ``1/1 compared cells
hold``. :func:`fill_absent` adds each combination of the axes that no cell has, as a ``failed``
cell saying so, so that every reader counts it (exit 3 at the gate).
"""

from __future__ import annotations

import itertools

from parity.sweep.model import CellResult, SweepReport
from parity.sweep.spec import cell_id, value_key

ABSENT = ("absent from sweep.json: the sweep's axes have this cell, its report does not "
          "(edited or truncated report?)")


def absent_cells(report: SweepReport) -> list[dict]:
    """Axis combinations (name -> value) that no cell of ``report`` has."""
    axes = [a for a in report.axes or [] if isinstance(a, dict) and isinstance(a.get("name"), str)
            and isinstance(a.get("values"), list)]
    names = [a["name"] for a in axes]
    have = set()
    for c in report.cells or []:
        ax = getattr(c, "axes", None)
        if isinstance(ax, dict):
            have.add(tuple(value_key(ax.get(n)) for n in names))
    out = []
    for combo in itertools.product(*[a["values"] for a in axes]):
        if tuple(value_key(v) for v in combo) not in have:
            out.append(dict(zip(names, combo)))
    return out


def fill_absent(report: SweepReport) -> SweepReport:
    """``report`` with a failed cell for each combination of its axes that it lacks."""
    missing = absent_cells(report)
    if not missing:
        return report
    used = {c.id for c in report.cells or [] if isinstance(getattr(c, "id", None), str)}
    cells = list(report.cells or [])
    for axes in missing:
        cid = cell_id(axes, used)
        used.add(cid)
        cells.append(CellResult(id=cid, axes=axes, status="failed", reason=ABSENT))
    report.cells = cells
    return report
