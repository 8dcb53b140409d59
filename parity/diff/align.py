"""Step alignment (``parity diff --align-steps``): compare a run resumed from a checkpoint with the
run it was resumed from, step against the step it continues (round 14b).

Capture numbers a job's steps from its own start: a run resumed from a checkpoint of step k
records the loaded state as its step 0 and the uninterrupted run's step k+i as its step i. By
number, the pair FAILS at step 0 whatever follows. ``B+K`` says "B's step i is A's step K+i"
(``A+K`` the other way, ``none`` by number, ``auto`` the offset the parameter digests prove).

The whole of it is here, done once to the runs as read: every reader of the diff (hashes,
losses, gradients, RNG digests, optimizer state in the final state, bucket manifests' steps,
the first-divergence search, the reports and ``--fail-on``) then reads the aligned runs and
knows nothing of offsets. The resumed side's records are renumbered (step i becomes K+i: the
reports speak the other side's numbers); the other side keeps its steps from K on, and its
step K is cut to what a step 0 records (the parameters: its gradients, loss and RNG digest
belong to the training of step K, which the resumed run did not do). Its steps before K have
no counterpart by construction: they are said on the verdict line (``before``), not compared,
and not a reason for ``incomplete``; steps only one side has after K are incomplete as ever.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from parity.artifacts import HASH_BYTES, HASH_MAGIC, RankData, Run, Table
from parity.errors import EXIT_USAGE, ParityError
from parity.text import ranges

NONE, AUTO = "none", "auto"
SPELLING = "none | auto | B+K | A+K"
_FORM = re.compile(r"^([ABab])\s*([+-])\s*(\d+)$")

# what a step record keeps when it is the other side's step 0 (the anchor): the parameters, and
# the figures as written (their digest covers the gradients' figures too; the magnitude reader
# checks it, and reads gradient figures only where gradients were compared)
_ANCHOR_KEEP = ("v", "step", "param_digest", "param_offset", "param_figures_offset",
                "grad_figures_offset", "figures_digest")
_ANCHOR_NONE = ("grad_digest", "grad_offset", "loss", "loss_hash")


@dataclass(frozen=True)
class Alignment:
    """``side`` ("a" or "b", upper-cased in words) resumed from the other side's step
    ``offset``: its step i is compared with the other's step offset+i. ``side`` None: steps
    compared by number (``none``, or ``auto`` that found step 0 equal on every rank)."""

    asked: str = NONE  # as the user spelled it (normalised): none, auto, B+2
    side: str | None = None
    offset: int = 0
    before: list[int] = field(default_factory=list)  # the other side's steps before the anchor

    @property
    def start(self) -> int:
        """The first aligned step (the anchor), in the numbers the reports use."""
        return self.offset if self.side else 0

    def words(self) -> str:
        """The verdict line's phrase ('' when nothing was asked)."""
        if self.asked == NONE:
            return ""
        if not self.side:
            return (f"steps aligned by number (--align-steps {self.asked}"
                    + (": step 0 equal on every rank)" if self.asked == AUTO else ")"))
        me, other = self.side.upper(), _other(self.side).upper()
        how = f"{self.asked}: proven by the digests" if self.asked == AUTO else self.asked
        return (f"steps aligned (--align-steps {how}): {me}'s step i against {other}'s step "
                f"{self.offset}+i, numbered as {other}'s")

    def before_note(self) -> str | None:
        """The other side's steps before the anchor, said under "not compared"."""
        if not self.side or not self.before:
            return None
        me, other = self.side.upper(), _other(self.side).upper()
        return (f"{other}'s step(s) {ranges(self.before)} (before {me}'s step 0, which is "
                f"{other}'s step {self.offset}: {me} did not run them)")

    def to_dict(self) -> dict | None:
        if self.asked == NONE:
            return None
        return {"asked": self.asked, "side": self.side, "offset": self.offset,
                "before": list(self.before), "words": self.words()}


def _other(side: str) -> str:
    return "b" if side == "a" else "a"


def parse(spec: str | None) -> tuple[str, str | None, int]:
    """(normalised spelling, side, offset) of an ``--align-steps`` value; ParityError (exit 2)
    for anything else. ``auto`` has side None until resolved."""
    s = (spec or NONE).strip()
    if s.lower() in (NONE, AUTO):
        return s.lower(), None, 0
    m = _FORM.match(s)
    if not m:
        raise ParityError(f"--align-steps {spec!r}: expected {SPELLING} (B+2: B's step i is "
                          "compared with A's step 2+i)", exit_code=EXIT_USAGE)
    side, sign, k = m.group(1).lower(), m.group(2), int(m.group(3))
    if sign == "-" and k:
        other = _other(side).upper()
        raise ParityError(f"--align-steps {spec}: a negative offset; say the other side "
                          f"({other}+{k}: {other}'s step i against {side.upper()}'s step {k}+i)",
                          exit_code=EXIT_USAGE)
    return f"{side.upper()}+{k}", (side if k else None), k


def resumed_offset(ra: list[RankData], rb: list[RankData]) -> tuple[str, int] | None:
    """(side, j) when that side's step 0 has, on every rank, the parameter hashes of the other
    side's step j > 0 and of no other step (the same j everywhere): a run resumed from a
    checkpoint of the other's step j. ``ra`` / ``rb``: the same ranks, in order."""
    found = []
    for x, y, side in ((ra, rb, "b"), (rb, ra, "a")):
        at: set[int] = set()
        for rx, ry in zip(x, y):
            zero = (ry.steps.get(0) or {}).get("param_digest")
            js = [s for s, rec in rx.steps.items() if isinstance(s, int) and s > 0
                  and zero is not None and rec.get("param_digest") == zero]
            if len(js) != 1:
                at = set()
                break
            at.add(js[0])
        if len(at) == 1 and x and len(x) == len(y):
            found.append((side, at.pop()))
    return found[0] if len(found) == 1 else None


def _common(run_a: Run, run_b: Run) -> tuple[list[RankData], list[RankData]]:
    ranks = sorted(set(run_a.ranks) & set(run_b.ranks))
    return [run_a.ranks[r] for r in ranks], [run_b.ranks[r] for r in ranks]


def resolve(spec: str | None, run_a: Run, run_b: Run) -> Alignment:
    """The alignment asked for, checked against the runs: ``auto`` only where the digests prove
    an offset (or step 0 is equal on every rank both have), an offset only within the other
    side's steps. ParityError (exit 2) otherwise: one line that says what the runs hold."""
    asked, side, k = parse(spec)
    if asked == NONE:
        return Alignment()
    ra, rb = _common(run_a, run_b)
    if asked == AUTO:
        got = resumed_offset(ra, rb)
        if got is None:
            zero = [((x.steps.get(0) or {}).get("param_digest"),
                     (y.steps.get(0) or {}).get("param_digest")) for x, y in zip(ra, rb)]
            if zero and all(p is not None and p == q for p, q in zero):
                return Alignment(asked)
            raise ParityError("--align-steps auto: no offset is proven (no side's step 0 has "
                              "the parameters of exactly one step of the other side on every "
                              "rank, nor is step 0 equal on every rank); give it: B+K compares "
                              "B's step i with A's step K+i", exit_code=EXIT_USAGE)
        side, k = got
    if not side:
        return Alignment(asked)
    other = run_a if side == "b" else run_b
    for r, rd in {**run_a.ranks, **run_b.ranks}.items():
        if any(rec.get("v") == 1 for rec in rd.steps.values()):
            raise ParityError(f"--align-steps {asked}: rank {r} was recorded by a parity of "
                              "artifact schema 1; aligning needs schema 2 (record it again)",
                              exit_code=EXIT_USAGE)
    last = max((s for rd in other.ranks.values() for s in rd.steps), default=None)
    if last is None or k > last:
        raise ParityError(f"--align-steps {asked}: beyond the steps of {_other(side).upper()} "
                          f"(its last step is {last}): no step would be compared",
                          exit_code=EXIT_USAGE)
    before = sorted({s for rd in other.ranks.values() for s in rd.steps if s < k})
    return Alignment(asked, side, k, before)


def apply(al: Alignment, run_a: Run, run_b: Run) -> tuple[Run, Run]:
    """The runs as every reader of the diff sees them under ``al`` (unchanged without a side):
    the resumed side renumbered, the other cut to its steps from the anchor on."""
    if not al.side:
        return run_a, run_b
    k = al.offset
    resumed, other = (run_b, run_a) if al.side == "b" else (run_a, run_b)
    resumed = dataclasses.replace(resumed, ranks={r: _shifted(rd, k)
                                                  for r, rd in resumed.ranks.items()})
    other = dataclasses.replace(other, ranks={r: _from_anchor(rd, k)
                                              for r, rd in other.ranks.items()})
    return (other, resumed) if al.side == "b" else (resumed, other)


def _copy(rd: RankData, cls=RankData, **changes) -> RankData:
    """A view of ``rd``: its fields, with ``changes``; a cache of its own for the figures."""
    vals = {f.name: getattr(rd, f.name) for f in dataclasses.fields(rd) if f.init}
    vals.update(_figures={}, **changes)
    return cls(**vals)


def _from_anchor(rd: RankData, k: int) -> RankData:
    """The other side's rank: its steps from ``k`` on, step ``k`` cut to what a step 0 holds."""
    steps = {s: rec for s, rec in rd.steps.items() if s > k}
    if k in rd.steps:
        rec = rd.steps[k]
        steps[k] = {**{n: rec[n] for n in _ANCHOR_KEEP if n in rec},
                    **dict.fromkeys(_ANCHOR_NONE)}
    return _copy(rd, steps=dict(sorted(steps.items())))


def _step_plus(rec: dict, k: int) -> dict:
    s = rec.get("step")
    return {**rec, "step": s + k} if type(s) is int else rec


def _shifted(rd: RankData, k: int) -> RankData:
    """The resumed side's rank with every step number plus ``k``: steps, the final state's
    ``after_step``, bucket records and their ends, the table's ``since`` / ``replaced``, and
    the step each hash record carries (checked against the step asked: ``_Shifted``)."""
    table = rd.table
    if table is not None and any(isinstance(p.get(f), int) for p in rd.params
                                 for f in ("since", "replaced")):
        rows = [{**p, **{f: p[f] + k for f in ("since", "replaced")
                         if isinstance(p.get(f), int)}} for p in rd.params]
        table = Table(f"aligned+{k}:{table.digest}", table.keys, table.n, table.version, rows)
    final = rd.final
    if final is not None and isinstance(final.get("after_step"), int):
        final = {**final, "after_step": final["after_step"] + k}
    return _copy(rd, _Shifted, offset=k, table=table, final=final,
                 steps={s + k: _step_plus(rec, k) for s, rec in rd.steps.items()},
                 buckets=[_step_plus(b, k) for b in rd.buckets],
                 bucket_ends=[_step_plus(b, k) for b in rd.bucket_ends])


@dataclass
class _Shifted(RankData):
    """A rank whose step numbers are its recorded ones plus ``offset``: the hash and figures
    records name their step, which ``RankData`` checks against the step asked for."""

    offset: int = 0

    def _read_record(self, offset: int, want: bytes = HASH_MAGIC,
                     row_bytes: int = HASH_BYTES) -> tuple[int, str, bytes]:
        step, kind, raw = super()._read_record(offset, want, row_bytes)
        return step + self.offset, kind, raw
