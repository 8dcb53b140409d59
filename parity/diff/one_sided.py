"""What one side recorded and the other did not, and runs that are not two runs.

A verdict of ``match`` means everything either side recorded was compared and equal. So a kind
of record that only one side has (gradients captured by A and not by B under ``--no-grads``, a
loss on one side only, per (rank, step)), a process that claimed a rank and was not recorded
(capture/claims.py), damaged records (artifacts.py ``RankData.damage``) and a recording compared
with itself (the same directory, or a copy of it) each make the diff incomplete (exit 3), named
in the verdict's ``not compared``; so does a tensor of a model that capture found and could not
hash (:func:`unhashed`). The engine (engine.py) appends these lines to ``DiffResult.incomplete``.
"""

from __future__ import annotations

import os

from parity.artifacts import RankData, Run
from parity.diff.hashes import step_fields
from parity.text import ranges


def capture_of(meta) -> dict:
    """A rank's meta.json ``capture`` object; {} where it (or meta itself) is missing or not an
    object (damage the engine says: ``_capture_disabled``)."""
    cap = meta.get("capture") if isinstance(meta, dict) else None
    return cap if isinstance(cap, dict) else {}


def one_sided(ra: list[RankData], rb: list[RankData], ranks: list[int], steps: list[int],
              loss_bits) -> list[str]:
    """Gradients or losses present on one side only at a (rank, step) both sides recorded."""
    if not ranks or not steps:
        return []
    # pure Python over (rank, step) cells: two identical runs never import numpy
    cells = {"gradients": ([], []), "loss": ([], [])}  # per side: (row, col) only that side has
    for i, (x, y) in enumerate(zip(ra, rb)):
        xs, ys = x.steps, y.steps
        if step_fields(xs, ys, steps, "grad_digest", "loss_hash", "loss") is not None:
            continue  # equal values (and types) on both sides: nothing recorded on one only
        for j, s in enumerate(steps):
            p, q = xs.get(s), ys.get(s)
            if p is None or q is None:
                continue
            u, v = p.get("grad_digest"), q.get("grad_digest")
            ga, gb = isinstance(u, str) and u != "", isinstance(v, str) and v != ""
            if ga != gb:
                cells["gradients"][0 if ga else 1].append((i, j))
            la, lb = loss_bits(p) is not None, loss_bits(q) is not None
            if la != lb:
                cells["loss"][0 if la else 1].append((i, j))
    out = []
    for what in ("gradients", "loss"):
        for side, only in zip(("A", "B"), cells[what]):
            if only:
                st = [steps[j] for j in sorted({j for _, j in only})]
                rk = [ranks[i] for i in sorted({i for i, _ in only})]
                out.append(f"{what} recorded by {side} only at step(s) {ranges(st)} on rank(s) "
                           f"{ranges(rk)} ({len(only)} record(s)){_hint(what, ra, rb)}")
    return out


def _hint(what: str, ra: list[RankData], rb: list[RankData]) -> str:
    """Why gradients are on one side only, from the options each side recorded."""
    if what != "gradients":
        return ""
    opts = [{(capture_of(x.meta).get("grads"), capture_of(x.meta).get("every")) for x in side}
            for side in (ra, rb)]
    no_grads = [n for n, o in zip("AB", opts) if any(g is False for g, _ in o)]
    if no_grads:
        return f"; {' and '.join(no_grads)} captured with --no-grads"
    every = [sorted({e for _, e in o if isinstance(e, int)}) for o in opts]
    if every[0] != every[1] and all(every):
        return (f"; A sampled every {'/'.join(map(str, every[0]))} step(s), B every "
                f"{'/'.join(map(str, every[1]))} (a step a side skipped is written at its exit "
                "without gradients)")
    return ""


def damaged(run_a: Run, run_b: Run) -> list[str]:
    """Damage the reader found on each side (``RankData.damage``: a file changed after its run
    closed, a record that cannot be read or fails its checksum, a missing meta.json), said
    whether or not the verdict needed those records: a pair with damage is never a clean
    ``match``. One line per side and kind of damage (meta.json apart: it says what is left
    unchecked), the first message as an example, paths relative to the run."""
    out = []
    for side, run in (("A", run_a), ("B", run_b)):
        root = os.path.join(str(run.path), "")
        no_meta = [r for r, rd in sorted(run.ranks.items())
                   if any(os.path.basename(m.split(":", 1)[0]) == "meta.json" for m in rd.damage)]
        if no_meta:
            out.append(f"{side}: rank(s) {ranges(no_meta)} have no readable meta.json: their "
                       "capture status and warnings, hasher, world size and numerics "
                       "fingerprint are not compared, and their files could be checked only "
                       "by their contents")
        hurt = [(r, m) for r, rd in sorted(run.ranks.items()) for m in rd.damage
                if os.path.basename(m.split(":", 1)[0]) != "meta.json"]
        if hurt:
            r0, m0 = hurt[0]
            rks = sorted({r for r, _ in hurt})
            out.append(f"{side}: damaged records on rank(s) {ranges(rks)} ({len(hurt)} finding(s)"
                       f"; they could not be read or failed their checksum and were not compared"
                       f"; first: {m0.replace(root, '')})")
    return out


def refused_processes(run_a: Run, run_b: Run) -> list[str]:
    """Processes that claimed a rank of a side and were not recorded (claims.py)."""
    out = []
    for side, run in (("A", run_a), ("B", run_b)):
        bad = [(r, rec) for r, rd in sorted(run.ranks.items()) for rec in rd.refused]
        if bad:
            r, rec = bad[0]
            out.append(f"{side}: {len(bad)} more process(es) claimed rank(s) "
                       f"{ranges(sorted({x for x, _ in bad}))} and were not recorded (first: "
                       f"pid {rec.get('pid')} on rank {r}); their training is not compared")
    return out


def unhashed(run_a: Run, run_b: Run, show: int = 3) -> list[str]:
    """Tensors of a side's models that capture found and could not hash (a tensor subclass, a
    meta buffer: meta.json ``capture.unhashed``, capture/table.py): never compared, named."""
    out = []
    for side, run in (("A", run_a), ("B", run_b)):
        found: dict[str, str] = {}
        ranks = []
        for r, rd in sorted(run.ranks.items()):
            rows = capture_of(rd.meta).get("unhashed")
            rows = [x for x in rows if isinstance(x, dict) and isinstance(x.get("fqn"), str)
                    ] if isinstance(rows, list) else []
            if rows:
                ranks.append(r)
            for x in rows:
                found.setdefault(x["fqn"], str(x.get("reason") or "?"))
        if found:
            names = [f"{f} ({why})" for f, why in list(found.items())[:show]]
            more = f" (+{len(found) - show} more)" if len(found) > show else ""
            out.append(f"{side}: {len(found)} tensor(s) of the model not hashed on rank(s) "
                       f"{ranges(ranks)}: {', '.join(names)}{more}")
    return out


def same_run(run_a: Run, run_b: Run) -> str | None:
    """A line when A and B are one recording: one directory, or two directories whose ranks
    were written by the very same processes (a copy, a hard-linked copy, a restored backup:
    every rank both have names the same host, pid and start time in its meta.json). Compared
    with itself, nothing is proven."""
    try:
        same = os.path.samefile(run_a.path, run_b.path)
    except OSError:
        same = os.path.abspath(run_a.path) == os.path.abspath(run_b.path)
    if same:
        return (f"A and B are the same directory ({run_a.path}): it was compared with itself, "
                "not with another run")
    if _same_processes(run_a, run_b):
        return (f"A and B are one recording ({run_a.path} and {run_b.path}: every rank was "
                "written by the same process, same host, pid and start time): a copy was "
                "compared with its original, not with another run")
    return None


def _process(meta) -> tuple | None:
    """(host, pid, started) of the process that wrote a rank, None where meta.json lacks one."""
    if not isinstance(meta, dict):
        return None
    key = (meta.get("host"), meta.get("pid"), meta.get("started"))
    ok = (isinstance(key[0], str) and key[0] and isinstance(key[1], int)
          and not isinstance(key[1], bool) and isinstance(key[2], (int, float))
          and not isinstance(key[2], bool))
    return key if ok else None


def _same_processes(run_a: Run, run_b: Run) -> bool:
    """Every rank both sides have (at least one) was written by the same process."""
    common = sorted(set(run_a.ranks) & set(run_b.ranks))
    if not common:
        return False
    for r in common:
        pa = _process(getattr(run_a.ranks[r], "meta", None))
        if pa is None or pa != _process(getattr(run_b.ranks[r], "meta", None)):
            return False
    return True
