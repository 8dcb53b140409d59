"""One process per rank folder: the claim a capturing process takes before it writes.

Several processes can believe they are rank N of one run: workers spawned without ``RANK`` and
without a process group (each says rank 0), two trainings started one after the other inside one
``parity exec``, a stray run pointed at a live run's directory. Before this module, the second
process deleted the first one's record and wrote its own: data lost, silently. Now the first
process to write ``rank-NNNNN/`` creates ``claim.json`` there (``O_EXCL``: atomic); a later
process finds it and does not write the rank's files. It leaves ``refused-<pid>.json`` beside
them instead (who it was and why), which ``parity exec``'s summary and ``parity diff`` report:
a run with a refused process is incomplete (exit 3), never a clean verdict.

Taken over rather than refused: a torchelastic restart of the rank (``--max-restarts``: the
previous attempt is dead and its record continues), and, outside ``parity exec`` (the API), a
claim whose process is no longer alive on this host (an earlier run into the same directory).
Inside ``parity exec`` every claim is this command's own (exec clears the directory first).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from parity.errors import ParityError
from parity.rundir import CLAIM_FILE, REFUSED_PREFIX



class ClaimRefused(ParityError):
    """Another process holds this rank's folder: this process records nothing."""


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path) -> dict:
    for _ in range(20):  # the claimant may be between open and write
        try:
            obj = json.loads(path.read_text())
            if isinstance(obj, dict):
                return obj
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    return {}


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "argv": list(sys.argv),
            "time": time.time()}


def claim_rank(d: Path, rank: int, out_dir: str, *, takeover: bool, exec_run: bool,
               elastic: bool = False) -> str | None:
    """Claim rank folder ``d`` for this process; None when it is ours, else why it is refused
    (after writing ``refused-<pid>.json`` there)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    path = d / CLAIM_FILE
    me = _me()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        other = _read(path)
        same_host = other.get("host") == me["host"]
        gone = not (same_host and _alive(other.get("pid")))
        # a torchelastic restart (attempt > 0) whose earlier attempt died before its first
        # step: the dead attempt's claim is taken over, as a restart with steps is
        if (other.get("pid") == me["pid"] and same_host) or takeover or (
                (elastic or not exec_run) and gone):
            _write(path, me)
            return None
        argv = " ".join(str(a) for a in (other.get("argv") or [])[:3])
        reason = (f"rank {rank} of {out_dir} is already recorded by another process (pid "
                  f"{other.get('pid')}{f': {argv}' if argv else ''}); this process "
                  f"(pid {me['pid']}) is not recorded. Several processes claim one rank: "
                  "workers started without RANK and without a process group, or several "
                  "trainings in one parity exec; give each its own RANK, or its own "
                  "parity exec --out")
        try:
            _write(d / f"{REFUSED_PREFIX}{me['pid']}.json", {**me, "rank": rank, "reason": reason})
        except OSError:
            pass
        return reason
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me))
    return None


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
