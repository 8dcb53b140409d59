"""What a sweep reads back from disk once a job or a cell is done: whether every rank recorded a
finished run (for ``tolerate_teardown_exit``), and the cell's diff (its status decided by
parity.policy). The runner schedules; this module reads."""

from __future__ import annotations

import json
from pathlib import Path

from parity import policy
from parity.errors import ParityError
from parity.rundir import META_FILE, STEPS_FILE, rank_dirs
from parity.sweep import state as st


def clean_finish(run_dir: Path, world_size: int, steps: int) -> bool:
    """Did every rank record a finished run (meta.json status 'ok') up to the last step? Only
    then may ``tolerate_teardown_exit`` blame a nonzero exit code on teardown."""
    try:
        metas = [d / META_FILE for _, d in rank_dirs(run_dir) if (d / META_FILE).is_file()]
    except OSError:
        return False
    if len(metas) != world_size:
        return False
    for m in metas:
        try:
            if json.loads(m.read_text()).get("status") != "ok":
                return False
            steps_seen = (json.loads(line)["step"] for line in
                          (m.parent / STEPS_FILE).read_text().splitlines() if line.strip())
            # the final-state line's step is "final" (docs/artifacts.md)
            last = max((s for s in steps_seen if isinstance(s, int)), default=-1)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if last < steps:
            return False
    return True


def unwritten_side(run_dir: Path, side: str, root: Path, captured: bool = True) -> str | None:
    """Why ``side``'s run directory holds nothing to diff (it is missing or empty), said as what
    happened; None when it holds something (the diff judges what)."""
    try:
        empty = not run_dir.is_dir() or not any(run_dir.iterdir())
    except OSError:
        return None
    if not empty:
        return None
    where = st.rel(run_dir, root)
    if not captured:
        return (f"the {side} was not captured (capture = false) and wrote no parity artifacts "
                f"into {where}: with capture = false the trainer must write them itself into "
                "{run_dir} (or set capture = true)")
    return f"the {side} wrote no parity artifacts into {where}"


def compare_cell(ref: Path, cand: Path, diff_path: Path, root: Path, *, tolerate_exit: bool = False,
                 at: str | None = None, captured: bool = True) -> tuple[str, str, dict | None]:
    """Diff one cell: (status, reason, diff dict). Never raises. The sides' paths are stored
    relative to the sweep directory ``root`` (like every path in cell.json and sweep.json), so a
    copied or downloaded sweep folder prints paths that exist where it now is. ``captured``:
    the jobs ran under ``parity exec`` (the spec's ``capture``), for the words of a side that
    wrote nothing."""
    from parity.diff import diff_runs  # here: a --dry-run need not import pandas

    for side, run_dir in (("reference", ref), ("candidate", cand)):
        why = unwritten_side(run_dir, side, root, captured)
        if why:
            return st.FAILED, f"diff: {why}", None
    try:
        result = diff_runs(ref, cand, tolerate_exit=tolerate_exit, at=at)
        result.a.path, result.b.path = st.rel(ref, root), st.rel(cand, root)
        d = result.to_dict()
        result.write_json(diff_path)
    except ParityError as e:
        return st.FAILED, f"diff: {e}", None
    except Exception as e:  # a bug in the diff engine: report it on the cell, keep sweeping
        return st.FAILED, f"diff: internal error: {e.__class__.__name__}: {e}", None
    return (*policy.cell_status(d), d)
