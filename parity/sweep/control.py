"""The determinism control (spec ``control = true``, ``parity sweep --control``): run each distinct
reference job a second time and diff the repeat against the first.

Why: a reference that differs from itself makes every hash mismatch against it meaningless; the
engineers who chased these bugs ran every side twice by hand to tell noise from a systematic
difference. A cell whose reference differs from its repeat gets status ``nondeterministic``
(parity.policy), with the first step and what differed, instead of ``hash_mismatch``; the gate
does not pass it; the candidate comparison is reported up to the last step where the reference
was still deterministic.

Layout: one control per distinct reference job (its fingerprint, spec.SideJob.fingerprint), in
``SWEEP_DIR/controls/<fingerprint>/``: ``run/`` (the repeat's run directory), ``logs/`` and
``logs/console.log``, ``control.json`` (the job's SideResult), ``diff-<cell>.json`` (the repeat
against the reference run of that cell). The repeat is the reference job exactly (same argv,
environment, ranks, launcher, workdir, capture), except that its run directory (and any
``{run_dir}`` the spec put in its argv or environment) is the control's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from parity import policy
from parity.sweep.launcher import Job

CONTROLS_DIR = "controls"
CONTROL = "control"  # the side name of the repeat (progress, SLURM job names)


def control_dir(sweep_dir: Path, fingerprint: str) -> Path:
    return sweep_dir / CONTROLS_DIR / fingerprint


def control_job(ref_job: Job, sweep_dir: Path, fingerprint: str) -> Job:
    """The repeat of ``ref_job``, writing into the control's folder."""
    d = control_dir(sweep_dir, fingerprint)
    old, new = str(ref_job.run_dir), str(d / "run")

    def swap(text: str) -> str:
        return text.replace(old, new)

    return dataclasses.replace(
        ref_job, side=CONTROL, entry_argv=[swap(a) for a in ref_job.entry_argv],
        env={k: swap(v) for k, v in ref_job.env.items()}, run_dir=d / "run", log_dir=d / "logs",
        console_log=d / "logs" / "console.log")


def read_state(sweep_dir: Path, fingerprint: str) -> dict | None:
    try:
        obj = json.loads((control_dir(sweep_dir, fingerprint) / "control.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) and obj.get("fingerprint") == fingerprint else None


def write_state(sweep_dir: Path, fingerprint: str, side: dict) -> None:
    from parity.artifacts import write_json_atomic

    write_json_atomic(control_dir(sweep_dir, fingerprint) / "control.json",
                      {"v": 1, "fingerprint": fingerprint, "side": side})


def _what(diff: dict) -> str:
    """What differed at the repeat's first divergent step, in a few words."""
    fd = diff.get("first_divergence") if isinstance(diff.get("first_divergence"), dict) else {}
    step = diff.get("first_divergent_step")
    div = [x for x in diff.get("divergent") or [] if isinstance(x, dict) and x.get("step") == step]
    parts = []
    for kind in ("param", "grad"):
        names = list(dict.fromkeys(str(x.get("fqn")) for x in div if x.get("kind") == kind))
        if names:
            parts.append(f"{kind} {', '.join(names[:2])}" + (f" (+{len(names) - 2} more)"
                                                              if len(names) > 2 else ""))
    loss = fd.get("loss_differs") if "loss_differs" in fd else None
    if loss or (not parts and (diff.get("loss") or {}).get("first_divergent_step") == step):
        parts.append("loss")
    ranks = fd.get("ranks") or []
    where = f" on rank {', '.join(str(r) for r in ranks[:4])}" if ranks else ""
    return (", ".join(parts) or "hashes") + where


def summarize(diff: dict | None, error: str | None = None) -> dict:
    """The control's verdict from the diff of the reference (A) against its repeat (B):
    ``deterministic`` (nothing compared differs), ``nondeterministic`` (with the first step and
    what differed), or ``failed`` (the repeat could not be compared)."""
    if diff is None:
        return {"verdict": "failed", "reason": error or "the repeat could not be compared"}
    steps = [s for s in diff.get("steps_compared") or [] if isinstance(s, int)]
    first = diff.get("first_divergent_step")
    order = (diff.get("order") or {}).get("verdict")
    if isinstance(first, int):
        return {"verdict": "nondeterministic", "first_step": first, "what": _what(diff),
                "steps_compared": len(steps)}
    if not steps:
        return {"verdict": "failed", "reason": "no step recorded by both runs of the reference"}
    out = {"verdict": "deterministic", "steps_compared": len(steps),
           "through_step": max(steps)}
    if order in policy.ORDER_FAILURES:
        # the same job laid its buckets out differently: nondeterministic too (hashes held)
        return {"verdict": "nondeterministic", "first_step": None,
                "what": policy.order_phrase(order, (diff.get("order") or {}).get("first_bucket"))
                + " between the two runs", "steps_compared": len(steps)}
    return out


def apply(status: str, reason: str, diff: dict | None, summary: dict) -> tuple[str, str, dict]:
    """The cell's status and reason once its reference's control is known, and the ``control``
    record for cell.json. A nondeterministic reference makes the cell ``nondeterministic``; the
    candidate comparison is stated up to the last step where the reference was deterministic."""
    rec = dict(summary)
    verdict = summary.get("verdict")
    if verdict == "failed":
        return (policy.FAILED, f"control run of the reference failed: {summary.get('reason')}; "
                f"candidate: {status}: {reason}", rec)
    if verdict == "deterministic":
        return status, (f"{reason}; reference deterministic (its repeat identical over "
                        f"{summary.get('steps_compared')} steps)"), rec
    n = summary.get("first_step")
    head = (f"reference nondeterministic: its repeat differs from step {n} ({summary['what']})"
            if isinstance(n, int) else f"reference nondeterministic: {summary['what']}")
    if status == policy.FAILED:
        return status, f"{reason}; {head}", rec
    d = diff if isinstance(diff, dict) else {}
    m = d.get("first_divergent_step")
    steps = [s for s in d.get("steps_compared") or [] if isinstance(s, int)]
    if isinstance(n, int):
        before = [s for s in steps if s < n]
        rec["deterministic_through"] = max(before) if before else None
        if isinstance(m, int) and m < n:
            rec["candidate_diverged_before"] = True
            tail = (f"the candidate diverged at step {m}, while the reference was still "
                    f"deterministic ({reason})")
        elif before:
            tail = f"the candidate is identical to it through step {max(before)}"
        else:
            tail = "no step before it to compare the candidate with"
    else:
        tail = f"candidate: {reason}"
    return policy.NONDETERMINISTIC, f"{head}; {tail}", rec
