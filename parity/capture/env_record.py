"""The environment a captured command ran with, recorded in run.json so that ``parity bisect``
can rerun it the same way.

A rerun under another environment (a knob variable unset, another thread count) may not
reproduce the recorded hashes, and bisect would then blame non-determinism. So ``parity exec``
records its environment (``run.json`` ``env``): values as they are, except variables whose names
look secret (tokens, passwords, keys), which are recorded as a digest only; a rerun takes those
from the current shell when their digest matches, and says which ones it could not restore.
"""

from __future__ import annotations

import hashlib
import re

from parity.capture.env import ALL_ENV

_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE|AUTH|COOKIE|SESSION", re.I)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _ours(name: str) -> bool:
    return name in ALL_ENV or name.startswith("PARITY_")


def record(environ) -> dict:
    """{"values": {name: value}, "digests": {name: digest}} of ``environ`` (secret-looking names
    as digests; parity's own variables left out)."""
    values, digests = {}, {}
    for k, v in environ.items():
        if _ours(k):
            continue
        if _SECRET.search(k):
            digests[k] = _digest(v)
        else:
            values[k] = v
    return {"values": values, "digests": digests}


def restore(recorded, current) -> tuple[dict[str, str] | None, list[str]]:
    """(the environment to rerun with, notes) from a ``record`` and the current environment;
    (None, [why]) when nothing was recorded (the rerun then uses the current environment)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("values"), dict):
        return None, ["no environment recorded (run.json from an older parity): rerunning with "
                      "this shell's, which may differ"]
    env = {str(k): str(v) for k, v in recorded["values"].items()}
    notes = []
    lost = []
    for k, d in (recorded.get("digests") or {}).items():
        if k in current and _digest(current[k]) == d:
            env[k] = current[k]
        else:
            lost.append(k)
    for k, v in current.items():  # parity's own variables (PARITY_OPS_*, PARITY_DEBUG) stay
        if _ours(k) and k not in env:
            env[k] = v
    differs = sorted(k for k in set(env) | set(current)
                     if not _ours(k) and env.get(k) != current.get(k) and k not in lost)
    if differs:
        notes.append("rerunning with the recorded environment (this shell differs in "
                     + ", ".join(differs[:6]) + (f" and {len(differs) - 6} more" if
                                                 len(differs) > 6 else "") + ")")
    if lost:
        notes.append("could not restore " + ", ".join(sorted(lost)[:6]) + " (recorded as a "
                     "digest only, differs here): the rerun may not reproduce the run")
    return env, notes
