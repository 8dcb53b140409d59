"""A sweep directory on disk: its layout, the lock, per-cell state and the sweep report JSON.

    SWEEP_DIR/
      .parity-sweep.lock      held (flock) by the sweep running here; holds its pid
      spec.toml               the spec text as run
      sweep.json              the sweep report (docs/sweep.md), rewritten atomically
      cells/CELL_ID/
        cell.json             this cell's state, rewritten atomically after every change
        diff.json             the diff of candidate against reference
        reference/ candidate/ run directories (`parity exec --out`)
        logs/SIDE/            torchrun --log-dir: every rank's stdout.log / stderr.log
        logs/SIDE.console.log the job's console (torchrun's tee of every rank)

Paths inside cell.json and sweep.json are relative to SWEEP_DIR, so the folder can be moved or
uploaded as a CI artifact and still be read.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path

from parity.artifacts import write_json_atomic
from parity.errors import EXIT_INTERNAL, EXIT_USAGE, ParityError
from parity.pidlock import PidLock
# cell statuses: decided in parity.policy, named here for the sweep's own modules
from parity.policy import CELL_STATUSES as STATUSES
from parity.policy import POLICIES
from parity.policy import (COMPARED, FAILED, HASH_MISMATCH, MATCH, ORDER_MISMATCH,  # noqa: F401
                           PENDING, RUNNING, SKIPPED, settled_cell)
from parity.rundir import looks_like_run
from parity.sweep.model import CellResult, SweepReport, as_report
from parity.sweep.spec import CELLS_DIR

SWEEP_SCHEMA_VERSION = 1
LOCK_NAME = ".parity-sweep.lock"
MARKER = ".parity-sweep"  # JSON: {"v": 1, "spec_dir": ...}; what makes a folder a sweep dir
SPEC_COPY = "spec.toml"
SWEEP_JSON = "sweep.json"



def cell_dir(sweep_dir: Path, cid: str) -> Path:
    d = (sweep_dir / CELLS_DIR / cid)
    # cell ids are sanitized; this is the last line of defence against escaping the sweep dir
    if d.resolve().parent != (sweep_dir / CELLS_DIR).resolve():
        raise ParityError(f"cell id {cid!r} would escape {sweep_dir}", exit_code=EXIT_INTERNAL)
    return d


def rel(path, sweep_dir: Path) -> str | None:
    if path is None:
        return None
    try:
        return os.path.relpath(path, sweep_dir)
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ the lock


class SweepLock(PidLock):
    """An exclusive flock on SWEEP_DIR/.parity-sweep.lock; released when the process dies."""

    def __init__(self, sweep_dir: Path):
        super().__init__(sweep_dir / LOCK_NAME)

    def busy(self, holder: str) -> ParityError:
        return ParityError(f"{self.path.parent}: another sweep (pid {holder}) is running in this "
                           "directory; wait for it or use another --out", EXIT_USAGE)


def running_holder(sweep_dir: Path) -> str | None:
    """The pid (text; "?" when the file does not say) of the sweep still running in
    ``sweep_dir``, i.e. holding its lock; None when no live process holds it. Probed with a
    non-blocking shared flock, released at once (it never waits, and a crashed sweep's lock is
    gone with its process)."""
    import errno
    import fcntl

    try:
        fd = os.open(sweep_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None  # a file system without flock: nothing known
            try:
                return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            except OSError:
                return "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _still_running(obj: dict, sweep_dir: Path) -> None:
    """A report read while its sweep is running (its lock held by a live process): the cells
    sweep.json shows unfinished are not "interrupted" but pending or running, and a cell that
    has finished since sweep.json was written (at the sweep's start) shows its result from its
    cell.json. Marks the report ``running: {"pid": ...}``."""
    if obj.get("complete") is True:
        return
    holder = running_holder(sweep_dir)
    if holder is None:
        return
    obj["running"] = {"pid": holder}
    for i, c in enumerate(obj["cells"]):
        if c.get("status") != FAILED:
            continue
        try:
            state = read_cell(sweep_dir, c["id"])
        except ParityError:
            state = None
        now = state.get("status") if state else PENDING  # no cell.json yet: not started
        if now == RUNNING:
            c.update(status=RUNNING, reason=f"still running (the sweep, pid {holder}, has not "
                     "finished)", sides=state.get("sides") or c.get("sides") or {})
        elif now == PENDING:
            c.update(status=PENDING, reason=f"pending (the sweep, pid {holder}, is still "
                     "running)")
        elif (state and now in STATUSES and state.get("ended")
              and state.get("ended") != c.get("ended")):
            obj["cells"][i] = _public_cell(state).to_dict()
    counts: dict[str, int] = {}
    for c in obj["cells"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    obj["counts"] = {**{k: 0 for k in STATUSES}, **counts}


# ------------------------------------------------------------------------------ directory checks


def prepare_sweep_dir(sweep_dir: Path) -> None:
    """Create the directory, or check that an existing one is a sweep dir (or empty)."""
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise ParityError(f"{sweep_dir}: exists and is not a directory")
    if sweep_dir.is_dir():
        entries = [e for e in os.listdir(sweep_dir) if e != LOCK_NAME]
        # A spec.toml alone proves nothing (it may be the user's own file, which the sweep would
        # overwrite): the marker, or an older sweep's sweep.json with its cells/, does.
        legacy = (sweep_dir / SWEEP_JSON).is_file() and (sweep_dir / CELLS_DIR).is_dir()
        if entries and not ((sweep_dir / MARKER).is_file() or legacy):
            raise ParityError(f"{sweep_dir}: not empty and not a parity sweep directory (no "
                              f"{MARKER} marker); choose another --out")
    try:
        (sweep_dir / CELLS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParityError(f"cannot create {sweep_dir}: {e.strerror or e}") from None


def write_marker(sweep_dir: Path, spec_dir: Path | None) -> None:
    """Mark ``sweep_dir`` as a sweep directory and remember where the spec's relative paths
    (``workdir``) were resolved from, so that ``--resume`` without SPEC resolves them the same."""
    cwd = read_marker(sweep_dir).get("cwd") or os.getcwd()  # the first run's, kept
    write_json_atomic(sweep_dir / MARKER, {"v": 1, "spec_dir": str(spec_dir) if spec_dir else None,
                                           "cwd": cwd})


def read_marker(sweep_dir: Path) -> dict:
    try:
        obj = json.loads((sweep_dir / MARKER).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def reset_cell(sweep_dir: Path, cid: str, keep_sides: tuple[str, ...] = ()) -> Path:
    """Empty a cell's folder before it runs, keeping the run and logs of ``keep_sides``."""
    d = cell_dir(sweep_dir, cid)
    if d.is_dir():
        keep = {d / s for s in keep_sides}
        keep |= {d / "logs" / s for s in keep_sides}
        keep |= {d / "logs" / f"{s}.console.log" for s in keep_sides}
        for child in d.iterdir():
            if child.name == "logs" and child.is_dir() and not child.is_symlink():
                for sub in child.iterdir():
                    if sub not in keep:
                        _remove(sub)
            elif child not in keep:
                _remove(child)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except OSError:
            pass


# ------------------------------------------------------------------------------ cell state


def read_cell(sweep_dir: Path, cid: str) -> dict | None:
    try:
        obj = json.loads((cell_dir(sweep_dir, cid) / "cell.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict) or obj.get("v") != SWEEP_SCHEMA_VERSION or obj.get("id") != cid:
        return None
    return obj


def write_cell(sweep_dir: Path, state: dict) -> None:
    state["updated"] = time.time()
    write_json_atomic(cell_dir(sweep_dir, state["id"]) / "cell.json", state)


def new_cell_state(cell, fingerprints: dict[str, str]) -> dict:
    """cell.json of a cell not run yet (the runner updates it in place, writes it each change)."""
    return CellResult(v=SWEEP_SCHEMA_VERSION, id=cell.id, axes=dict(cell.axes), status=PENDING,
                      reason="", fingerprint=fingerprints, requires=list(cell.requires),
                      sides={}, diff=None, diff_json=None, started=None, ended=None).to_dict()


def is_complete(state: dict | None, fingerprints: dict[str, str]) -> bool:
    """A compared cell whose jobs are the ones the spec asks for now."""
    return bool(state) and state.get("status") in COMPARED and state.get("fingerprint") == fingerprints


def reusable_side(state: dict | None, side: str, fingerprint: str, sweep_dir: Path) -> dict | None:
    """A side that finished successfully for the same job (kept by --resume)."""
    if not state:
        return None
    s = (state.get("sides") or {}).get(side)
    if not s or s.get("status") != "ok" or (state.get("fingerprint") or {}).get(side) != fingerprint:
        return None
    run_dir = s.get("run_dir")
    if run_dir and not (sweep_dir / run_dir).is_dir():
        return None
    return s


# ------------------------------------------------------------------------------ sweep report


def build_sweep(spec, sweep_dir: Path, states: list[dict], *, started: float, ended: float | None,
                complete: bool, launcher: str, steps: int, only: str | None,
                fail_on: str, jobs: int = 1, jobs_run: int = 0, jobs_wall: float = 0.0) -> dict:
    cells = [_public_cell(st) for st in states]
    counts = {s: 0 for s in STATUSES}
    for c in cells:
        counts[c.status] += 1
    return SweepReport(
        v=SWEEP_SCHEMA_VERSION, kind="parity-sweep", name=spec.name,
        description=spec.description, spec=SPEC_COPY, spec_source=spec.source,
        launcher=launcher, steps=steps, seed=spec.seed, nnodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node, only=only, fail_on=fail_on,
        axes=[{"name": a.name, "values": list(a.values)} for a in spec.axes],
        sides={name: {"label": s.label} for name, s in spec.sides.items()},
        started=started, ended=ended, wall=round(ended - started, 3) if ended else None,
        # this invocation: wall of the sweep vs. the summed wall of the jobs it ran (the launcher's
        # start-to-exit time of each); with jobs = 1 the difference is the sweep's own overhead
        timing={"jobs": jobs, "jobs_run": jobs_run, "jobs_wall": round(jobs_wall, 3),
                "overhead": (round((ended - started) - jobs_wall, 3)
                             if ended and jobs == 1 else None)},
        complete=complete, counts=counts, cells=cells,
    ).to_dict()


def _public_cell(st: dict) -> CellResult:
    """A cell as sweep.json shows it: no fingerprint, its status settled, its wall time."""
    status, reason = settled_cell(st.get("status"), st.get("reason"))
    return CellResult(
        id=st.get("id"), axes=st.get("axes"), status=status, reason=reason,
        requires=st.get("requires"), started=st.get("started"), ended=st.get("ended"),
        sides=st.get("sides"), diff=st.get("diff"), diff_json=st.get("diff_json"),
        wall=(round(st["ended"] - st["started"], 3)
              if st.get("started") and st.get("ended") else None),
        **{k: st[k] for k in ("control", "shares_reference_with", "early_stop") if k in st})


def axis_names(report: SweepReport) -> list[str]:
    """Axis names in the spec's order: sweep.json's ``axes`` is a list of {name, values} (then
    any axis only a cell names, in the order first seen). Every report's matrix uses this."""
    names = [a["name"] for a in report.axes or [] if isinstance(a, dict) and "name" in a]
    for c in report.cells or []:
        for k in (c.axes if isinstance(c, CellResult) and isinstance(c.axes, dict) else {}):
            if k not in names:
                names.append(k)
    return names


def write_sweep(sweep_dir: Path, sweep: dict) -> Path:
    path = sweep_dir / SWEEP_JSON
    write_json_atomic(path, sweep)
    return path


def _what_else(p: Path) -> str:
    """A hint that fits the directory given instead of a sweep directory."""
    q = shlex.quote
    if (p / "cell.json").is_file():
        return (f"it is one cell of a sweep (its sweep directory is {q(str(p.parent.parent))}); "
                f"compare its sides with `parity diff {q(str(p / 'reference'))} "
                f"{q(str(p / 'candidate'))}`")
    if looks_like_run(p):
        return ("it is a run directory (`parity exec --out`); compare two runs with "
                f"`parity diff REFERENCE_RUN {q(str(p))}`")
    if (p / SPEC_COPY).is_file() or (p / CELLS_DIR).is_dir():
        return (f"the sweep there never wrote its report; complete it with "
                f"`parity sweep {q(str(p / SPEC_COPY))} --resume --out {q(str(p))}`")
    return "not a sweep directory (`parity sweep --out DIR` writes one)"


def load_sweep(where) -> dict:
    """Read a sweep report: SWEEP_DIR or SWEEP_DIR/sweep.json. Bad input raises (exit 2)."""
    p = Path(where)
    path = p / SWEEP_JSON if p.is_dir() else p
    if not p.exists():
        raise ParityError(f"{p}: no such sweep directory")
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ParityError(f"{p}: no {SWEEP_JSON}: {_what_else(p)}") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ParityError(f"{path}: unreadable sweep report ({e.__class__.__name__})") from None
    if not isinstance(obj, dict) or obj.get("kind") != "parity-sweep":
        raise ParityError(f"{path}: not a parity sweep report")
    if obj.get("v") != SWEEP_SCHEMA_VERSION:
        raise ParityError(f"{path}: sweep report version {obj.get('v')!r}; this parity reads "
                          f"version {SWEEP_SCHEMA_VERSION}")
    if not isinstance(obj.get("cells"), list) or not all(
            isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("status") in STATUSES
            for c in obj["cells"]):
        raise ParityError(f"{path}: malformed sweep report (cells)")
    bad = _malformed(obj)
    if bad:
        raise ParityError(f"{path}: malformed sweep report: {bad}")
    fail_on = obj.get("fail_on")
    if fail_on is not None and fail_on not in POLICIES:
        raise ParityError(f"{path}: fail_on {fail_on!r} is not a policy (one of "
                          f"{', '.join(POLICIES)}); fix the file")
    twice = _listed_twice(obj)
    if twice:
        raise ParityError(f"{path}: malformed sweep report: {twice}")
    _still_running(obj, path.parent)
    obj["_dir"] = str(path.parent)
    return obj


def load_report(where) -> SweepReport:
    """``load_sweep`` typed: the reports and the gate read this (``dir`` is where it was read).
    A combination of the axes that no cell holds is added as a failed cell (coverage.py)."""
    from parity.sweep.coverage import fill_absent

    return fill_absent(as_report(load_sweep(where)))


def _listed_twice(obj: dict) -> str | None:
    """A cell id listed twice: the gate would count it twice ("3/3 compared cells hold" for a
    2-cell matrix), and which of the two holds its result is unknowable. Named; None if every
    id is listed once."""
    ids: set[str] = set()
    for c in obj["cells"]:
        if c["id"] in ids:
            return f"cell {c['id']} is listed twice"
        ids.add(c["id"])
    return None


_NUM = (int, float)
_TOP_TYPES = {"name": str, "description": (str, type(None)), "spec": (str, type(None)),
              "spec_source": (str, type(None)), "launcher": (str, type(None)),
              "steps": (int, type(None)), "only": (str, type(None)), "fail_on": (str, type(None)),
              "axes": list, "sides": dict, "started": (*_NUM, type(None)),
              "ended": (*_NUM, type(None)), "wall": (*_NUM, type(None)),
              "timing": (dict, type(None)), "complete": (bool, type(None)), "counts": dict}
_CELL_TYPES = {"axes": dict, "reason": (str, type(None)), "requires": (list, type(None)),
               "started": (*_NUM, type(None)), "ended": (*_NUM, type(None)),
               "wall": (*_NUM, type(None)), "sides": dict, "diff": (dict, type(None)),
               "diff_json": (str, type(None)), "resumed": (bool, type(None))}
_SIDE_TYPES = {"status": (str, type(None)), "label": (str, type(None)),
               "exit_code": (int, type(None)), "reason": (str, type(None)),
               "command": (list, str, type(None)), "run_dir": (str, type(None)),
               "log_dir": (str, type(None)), "console_log": (str, type(None)),
               "rank_logs": (list, type(None)), "wall": (*_NUM, type(None)),
               "started": (*_NUM, type(None)), "ended": (*_NUM, type(None))}


def _malformed(obj: dict) -> str | None:
    """The first field of a sweep report the renderers cannot read, named; None if fine.
    (Fields are optional; a present one must have its documented type.)"""
    def wrong(where: str, value, types) -> str | None:
        return None if isinstance(value, types) and not (
            isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                     else (types,))) else (
            f"{where} is {type(value).__name__}")

    for k, t in _TOP_TYPES.items():
        if k in obj and (w := wrong(k, obj[k], t)):
            return w
    for i, a in enumerate(obj.get("axes") or []):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not isinstance(
                a.get("values", []), list):
            return f"axes[{i}] is not {{name, values}}"
    for k, v in (obj.get("sides") or {}).items():
        if not isinstance(v, dict):
            return f"sides.{k} is {type(v).__name__}"
    for k, v in (obj.get("counts") or {}).items():
        if not isinstance(v, int):
            return f"counts.{k} is {type(v).__name__}"
    for c in obj["cells"]:
        cid = c["id"]
        for k, t in _CELL_TYPES.items():
            if k in c and (w := wrong(f"cells[{cid}].{k}", c[k], t)):
                return w
        for sname, sd in (c.get("sides") or {}).items():
            if not isinstance(sd, dict):
                return f"cells[{cid}].sides.{sname} is {type(sd).__name__}"
            for k, t in _SIDE_TYPES.items():
                if k in sd and (w := wrong(f"cells[{cid}].sides.{sname}.{k}", sd[k], t)):
                    return w
            for j, rl in enumerate(sd.get("rank_logs") or []):
                if not isinstance(rl, dict):
                    return f"cells[{cid}].sides.{sname}.rank_logs[{j}] is {type(rl).__name__}"
        d = c.get("diff")
        if isinstance(d, dict):
            for k, t in (("order", (dict, type(None))), ("divergent", (list, type(None))),
                         ("incomplete", (list, type(None))), ("problems", (list, type(None))),
                         ("steps_compared", (list, type(None)))):
                if k in d and (w := wrong(f"cells[{cid}].diff.{k}", d[k], t)):
                    return w
            if "first_divergent_step" in d and (w := wrong(
                    f"cells[{cid}].diff.first_divergent_step", d["first_divergent_step"],
                    (int, type(None)))):
                return w
            for k, t in (("steps_compared", int), ("divergent", dict), ("per_step", dict)):
                if k in d and not isinstance(d[k], list):
                    return f"cells[{cid}].diff.{k} is {type(d[k]).__name__}"
                for j, x in enumerate(d.get(k) or []):
                    if (w := wrong(f"cells[{cid}].diff.{k}[{j}]", x, t)):
                        return w
            fb = (d.get("order") or {}).get("first_bucket")
            if fb is not None and not isinstance(fb, dict):
                return f"cells[{cid}].diff.order.first_bucket is {type(fb).__name__}"
    return None
