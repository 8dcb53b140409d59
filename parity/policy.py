"""The fail-on policy, a compared pair's status and the verdict line: one place, everyone asks it.

``parity diff``, ``parity sweep``, ``parity gate`` and every report (console, markdown, JUnit,
HTML) say the same thing about the same data because they all call this module: it decides the
exit code under a policy and words the one verdict line that states the policy, what was
compared, what failed it, what it tolerated and what was not compared. A verdict never says
HOLDS with a non-zero exit code.

Policies (``--fail-on``). Each fails on at least what its name says:

- ``hash`` (default): a hash mismatch (parameter, gradient or loss) fails; a bucket layout
  difference is reported and tolerated.
- ``any``: a hash mismatch or a bucket layout difference (order, partition, sizes) fails; a side
  without bucket layouts leaves the layouts unproven (exit 3 unless something failed).
- ``order-only``: only a bucket layout difference fails; a hash mismatch is reported and
  tolerated (for jobs whose numerics are expected to differ, e.g. another reduction order).

Statuses of a compared pair (a sweep cell's ``status`` and diff.json's ``status`` alike):
``match``, ``hash_mismatch`` (wins over an order difference), ``order_mismatch`` (hashes equal,
layouts differ), ``incomplete`` (no difference in what was compared, but data is missing; a sweep
shows such a cell as ``failed``). A sweep cell's status is decided here too (:func:`cell_status`
from its diff, :func:`settled_cell` when the sweep stopped). This module imports nothing from the
rest of parity but errors, consequences (the classes of a bucket difference) and text (ranges),
all base layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parity import consequences
from parity.text import ranges
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, ParityError

POLICIES = {
    "hash": "a hash mismatch fails; bucket layout differences are reported, tolerated",
    "any": "a hash mismatch or a bucket layout difference fails",
    "order-only": "only a bucket layout difference fails; hash mismatches are reported, tolerated",
    "reduction": "a hash mismatch or a reduction-order difference fails (with --at, only one "
                 "predicted at risk); copy-only (all-gather) differences are tolerated",
}
DEFAULT = "hash"
ORDER_FAILURES = ("order_differs", "partition_differs", "layout_differs")
UNAVAILABLE = "unavailable"

MATCH, HASH_MISMATCH, ORDER_MISMATCH, INCOMPLETE = (
    "match", "hash_mismatch", "order_mismatch", "incomplete")
# a sweep cell's further statuses: its jobs or its diff failed (or its data is incomplete), its
# requirements are not met here, or it has not finished (never in a finished sweep.json)
FAILED, SKIPPED, PENDING, RUNNING = "failed", "skipped", "pending", "running"
# the determinism control (spec ``control = true``) found the reference differing from its own
# repeat: the candidate is not blamed for noise, and the gate does not pass the cell
NONDETERMINISTIC = "nondeterministic"
COMPARED = (MATCH, HASH_MISMATCH, ORDER_MISMATCH, NONDETERMINISTIC)  # complete: --resume keeps it
CELL_STATUSES = (MATCH, HASH_MISMATCH, ORDER_MISMATCH, NONDETERMINISTIC, FAILED, SKIPPED)

WORDS = {EXIT_OK: "HOLDS", EXIT_MISMATCH: "FAILS", EXIT_INCOMPLETE: "INCOMPLETE"}


def check(policy: str) -> str:
    """``policy`` if it is one, else a usage error naming the choices."""
    if policy not in POLICIES:
        hint = " (renamed order-only: it tolerates hash mismatches)" if policy == "order" else ""
        raise ParityError(f"--fail-on {policy!r}: one of {', '.join(POLICIES)}{hint}",
                          exit_code=EXIT_USAGE)
    return policy


def fails_on_hash(policy: str) -> bool:
    return check(policy) in ("hash", "any", "reduction")


def fails_on_order(policy: str) -> bool:
    return check(policy) in ("any", "order-only")


def status(hash_verdict: str | None, order_verdict: str | None) -> str:
    """The status of a compared pair from the diff's hash verdict and bucket-order verdict."""
    if hash_verdict == "hash_mismatch":
        return HASH_MISMATCH
    if hash_verdict == "match":
        return ORDER_MISMATCH if order_verdict in ORDER_FAILURES else MATCH
    return INCOMPLETE


def pair_code(hash_verdict: str | None, order_verdict: str | None, incomplete: bool,
              policy: str, reduction: str | None = None, structure: bool = False) -> int:
    """Exit code of one pair: 1 a failure under the policy in the compared data (even when data
    is incomplete: parity demonstrably fails), else 3 when data is missing or the policy needs
    bucket layouts a side did not record, else 0. ``reduction`` (policy ``reduction``): what
    :func:`parity.consequences.reduction_state` says of the diff. ``structure``: some gradient
    is reduced by a different number of collectives on the two sides (``order.structure``), which
    ``any`` fails on even where every layout compared is identical."""
    if fails_on_hash(policy) and hash_verdict == "hash_mismatch":
        return EXIT_MISMATCH
    if fails_on_order(policy) and order_verdict in ORDER_FAILURES:
        return EXIT_MISMATCH
    if policy == "any" and structure:
        return EXIT_MISMATCH  # the same layouts, but a gradient reduced more times on one side
    if policy == "reduction" and (reduction == "fails" or (
            reduction is None and order_verdict in ORDER_FAILURES)):
        return EXIT_MISMATCH  # None: a diff without consequence classes (older): not tolerated
    if incomplete or hash_verdict not in ("match", "hash_mismatch"):
        return EXIT_INCOMPLETE
    if (fails_on_order(policy) or policy == "reduction") and \
            order_verdict not in ("identical", *ORDER_FAILURES):
        return EXIT_INCOMPLETE
    if policy == "reduction" and reduction == "unknown":
        return EXIT_INCOMPLETE
    return EXIT_OK


def structure_only(order: dict) -> bool:
    """The compared bucket layouts are identical, but some gradient is reduced by a different
    number of collectives on the two sides (``order.structure``; neither side blind)."""
    return (order.get("verdict") == "identical" and consequences.blind_side(order) is None
            and any(isinstance(x, dict) for x in order.get("structure") or []))


@dataclass
class Verdict:
    """One verdict line's parts. Facts are short phrases; a caller may append more (e.g. what a
    side did not record) before rendering, and every format renders the same ``line()``."""

    code: int
    policy: str
    subject: str = "PARITY"
    failed: list[str] = field(default_factory=list)  # what failed it under the policy
    held: list[str] = field(default_factory=list)  # what was compared and is equal
    tolerated: list[str] = field(default_factory=list)  # findings the policy does not fail on
    not_compared: list[str] = field(default_factory=list)  # missing, skipped, unproven
    warnings: list[str] = field(default_factory=list)  # capture warnings: said, never hidden
    aligned: str = ""  # ``--align-steps``: how steps were paired (said first: it frames the rest)

    @property
    def word(self) -> str:
        return WORDS.get(self.code, "ERROR")

    def head(self) -> str:
        return f"{self.subject} {self.word} under --fail-on {self.policy} (exit {self.code})"

    def body(self) -> str:
        parts = [*([self.aligned] if self.aligned else []), *self.failed, *self.held]
        if self.tolerated:
            parts.append("tolerated: " + ", ".join(self.tolerated))
        if self.not_compared:
            parts.append("not compared: " + ", ".join(self.not_compared))
        if self.warnings:
            parts.append(_plural(len(self.warnings), "capture warning") + ": "
                         + ", ".join(self.warnings[:2])
                         + (f" (+{len(self.warnings) - 2} more)" if len(self.warnings) > 2 else ""))
        return "; ".join(parts)

    def line(self) -> str:
        body = self.body()
        return self.head() + (f": {body}" if body else "")


def loss_factor_phrase(k: int) -> str:
    """The verdict line's words for B's loss = A's x 2^k bitwise at every step and rank
    (``loss.factor``, diff/loss_factor.py): compared as scaled, said, never a FAIL."""
    side, f = ("B", 2 ** k) if k > 0 else ("A", 2 ** -k)
    return (f"{side}'s loss is exactly {f} x the other's at every step on every rank, compared "
            "as scaled (a loss divided per micro-batch before backward on one side, the "
            "gradients divided after it on the other?)")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _is_cell(c) -> bool:
    """A cell record (a CellResult), not a stray value a hand-edited sweep.json left in cells."""
    return hasattr(c, "status") and hasattr(c, "diff")


def _ids(cells: list, show: int = 3) -> str:
    ids = [str(c.id) for c in cells]
    return ", ".join(ids[:show]) + (f" +{len(ids) - show} more" if len(ids) > show else "")


def bucket_ref(fb: dict) -> str:
    """'bucket 3' (A's index), or 'bucket 1 of B' where A has no such bucket (it was written
    'bucket None')."""
    if fb.get("index") is None and fb.get("b_index") is not None:
        return f"bucket {fb['b_index']} of B"
    return f"bucket {fb.get('index')}"


def order_phrase(order_verdict: str | None, first_bucket: dict | None = None) -> str:
    """'bucket order differs (all_gather bucket 0)' and the like."""
    what = {"order_differs": "bucket order differs", "partition_differs":
            "bucket partition differs", "layout_differs": "bucket layout (sizes) differs"
            }.get(order_verdict or "", f"bucket layouts {order_verdict or 'not recorded'}")
    fb = first_bucket if isinstance(first_bucket, dict) else {}
    detail = fb.get("detail") if isinstance(fb.get("detail"), str) else ""
    if order_verdict == "layout_differs" and detail.startswith(consequences.OPS_ONLY):
        # the same bytes in the same places, reduced by ops that scale differently or over
        # other ranks (diff/buckets.py op_difference, group_difference)
        what = ("bucket group differs" if detail[len(consequences.OPS_ONLY):].startswith("group")
                else "bucket reduce op differs")
    if fb.get("collective"):
        where = f"{fb['collective']} {bucket_ref(fb)}"
        if detail.startswith(consequences.OPS_ONLY):
            where += ": " + detail[len(consequences.OPS_ONLY):].split(" (each payload")[0]
        if fb.get("position") is not None:
            where += f" position {fb['position']}"
        if fb.get("index") is None or fb.get("b_index") is None:
            # a bucket one side lacks (a gradient reduced another way there): say whose
            e = fb.get("a") or fb.get("b")
            if isinstance(e, dict) and isinstance(e.get("fqn"), str):
                where += f", {e['fqn']}"
        rank = fb.get("rank")  # a rank other than the reference one (diff: round 14a)
        if isinstance(rank, int) and not isinstance(rank, bool) and "on rank" not in where:
            where += f" on rank {rank}"
        own = fb.get("verdict")  # the named bucket's own class, when it is not the verdict's
        if own and own != order_verdict and own in ORDER_FAILURES:
            where += f": its {own.replace('_differs', '')} differs"
        what += f" ({where})"
    return what


def _one_sided(order: dict) -> str:
    """'only A recorded reduce_scatter buckets, B issued none' when layouts were not compared
    because one side's job issued no bucketed collective of a kind (a one-rank compiled job);
    '' otherwise."""
    notes = [n for n in order.get("notes") or [] if isinstance(n, str) and ": only " in n
             and "recorded buckets" in n]
    if not notes or order.get("compared"):
        return ""
    blind = consequences.blind_side(order)
    if blind:  # no manifests at all on that side (--no-manifests): it did not say it issued none
        return f"{blind} recorded no bucket manifests"
    said = "; ".join(f"only {side[0]} recorded {coll} buckets, {'B' if side[0] == 'A' else 'A'} "
                     "issued none" for coll, side in (n.split(": only ", 1) for n in notes))
    return said


def custom_comm(order: dict) -> str:
    """Why layouts that compared equal were not called identical: a side's payloads were handed
    to a user's comm object (parity.diff.buckets._custom_comms), '' otherwise."""
    if not order.get("compared"):
        return ""
    sides = [n.split("'", 1)[0] for n in order.get("notes") or [] if isinstance(n, str)
             and "handed to a custom comm" in n]
    if not sides:
        return ""
    who = list(dict.fromkeys(sides))
    verb = "hand" if len(who) > 1 else "hands"
    return (f"{' and '.join(who)} {verb} the payloads to a custom comm: what it "
            "sends is not known")


def _left_out(order: dict) -> str:
    """'bucket layouts of ...' for the collectives an otherwise identical layout comparison left
    out (``order.notes`` ending "not compared": a kind only one side recorded, a loss all-reduce
    only one side's graph holds), so that "identical" never covers what was not compared."""
    notes = [n for n in order.get("notes") or [] if isinstance(n, str)
             and n.rstrip(". ").endswith("not compared")]
    if not notes:
        return ""
    first = notes[0].rsplit(": not compared", 1)[0].rsplit("; not compared", 1)[0]
    more = f" (+{len(notes) - 1} more in the layout notes)" if len(notes) > 1 else ""
    return f"bucket layouts {first}{more}"


def judge_pair(d: dict, policy: str) -> Verdict:
    """The verdict on one pair from its diff result (``DiffResult.to_dict()`` or a cell's
    diff.json): what the console, the JSON and the HTML page of ``parity diff`` say."""
    check(policy)
    hv = d.get("verdict")
    order = d.get("order") if isinstance(d.get("order"), dict) else {}
    ov = order.get("verdict")
    incomplete = [str(x) for x in d.get("incomplete") or []]
    state = consequences.reduction_state(d)
    structure = [x for x in order.get("structure") or [] if isinstance(x, dict)]
    blind = consequences.blind_side(order)
    v = Verdict(pair_code(hv, ov, bool(incomplete), policy, state, structure_only(order)),
                policy)
    kinds = list(d.get("kinds_compared") or [])
    if (d.get("loss") or {}).get("captured"):
        kinds.append("loss")
    final = d.get("final_state") if isinstance(d.get("final_state"), dict) else {}
    if final.get("compared"):
        kinds.append("final state with optimizer state" if final.get("optimizer_state")
                     else "final state")
    scope = (f"{_plural(len(d.get('steps_compared') or []), 'step')} x "
             f"{_plural(len(d.get('ranks_compared') or []), 'rank')} x "
             f"{_plural(int(d.get('params_compared') or 0), 'parameter')}")
    if hv == "hash_mismatch":
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else {}
        if fd.get("origin") == "final":  # every step matched: the state the runs ended with
            what = f"hash mismatch in the final state ({fd.get('phase') or 'when the run ended'})"
        elif _numbers_only(fd):  # every hash matched; a step's lr (diff/opt_numbers.py)
            what = (f"hashes equal, but the optimizer's group numbers differ from step "
                    f"{d.get('first_divergent_step')}")
        else:
            what = f"hash mismatch from step {d.get('first_divergent_step')}"
        ranks = fd.get("ranks") or []
        if ranks:
            what += f" on rank {', '.join(str(r) for r in ranks[:8])}"
        if fd.get("origin") == "between" and fd.get("phase"):
            what += f" (between steps: {fd['phase']})"
        elif _numbers_only(fd):
            what += f" ({fd.get('label')})"
        elif fd.get("origin") != "final" and (fd.get("label") or fd.get("origin")):
            what += f" ({fd.get('label') or fd['origin']})"  # what was compared and found
        (v.failed if fails_on_hash(policy) else v.tolerated).append(what)
    elif hv == "match":
        v.held.append(f"hashes bitwise identical over {scope} ({', '.join(kinds)})")
    elif d.get("steps_compared") and d.get("params_compared"):
        # incomplete, nothing differs in what both sides recorded: what matched comes first
        # (a 4-step run against a longer interrupted one: steps 0-4 matched), then what is
        # missing (not compared, below)
        v.held.append(f"hashes bitwise identical where both sides recorded: steps "
                      f"{ranges(d['steps_compared'])} ({scope}; {', '.join(kinds)})")
    factor = (d.get("loss") or {}).get("factor")
    if isinstance(factor, int) and not isinstance(factor, bool) and factor:
        v.tolerated.append(loss_factor_phrase(factor))
    impl = d.get("opt_impl") if isinstance(d.get("opt_impl"), dict) else {}
    if hv != "hash_mismatch" and isinstance(impl.get("words"), str) and impl["words"]:
        v.tolerated.append(impl["words"])  # optimizers implemented otherwise (diff/opt_impl.py)
    reduction_fails = policy == "reduction" and state in (None, "fails")
    if ov in ORDER_FAILURES:
        phrase = order_phrase(ov, order.get("first_bucket")) + consequences.order_suffix(order)
        (v.failed if fails_on_order(policy) or reduction_fails else v.tolerated).append(phrase)
    elif ov == "identical":
        v.held.append("bucket layouts identical")
        if structure and not blind and policy != "reduction":  # reduction: said below
            # the layouts match, but one side reduces a gradient more often (FSDP2 syncing at
            # every micro-batch against once per step): never hidden behind "identical"
            x = structure[0]
            phrase = (f"a gradient reduced by a different number of collectives "
                      f"({x.get('fqn')}: {x.get('a')} in A, {x.get('b')} in B per step"
                      + (f"; {len(structure)} gradients" if len(structure) > 1 else "") + ")")
            (v.failed if policy == "any" else v.tolerated).append(phrase)
        left = _left_out(order)
        if left:  # compared ones are identical; what one side alone recorded is said
            v.not_compared.append(left)
    else:
        one = _one_sided(order) or custom_comm(order)
        v.not_compared.append(order_phrase(ov) + (f" ({one})" if one else ""))
    predicted = consequences.reduction_phrase(d.get("reduction_order"))
    if predicted:  # --at: the prediction's own finding, under the policy
        ro_verdict = consequences.prediction_verdict(d["reduction_order"])
        if ro_verdict == "same":
            v.held.append(predicted)
        elif ro_verdict == "differs":
            (v.failed if policy == "reduction" and state == "fails" else v.tolerated
             ).append(predicted)
        else:
            v.not_compared.append(predicted)
    elif policy == "reduction" and state == "fails" and ov not in ORDER_FAILURES:
        v.failed.append("a gradient reduced by a different number of collectives")
    elif policy == "reduction" and state == "unknown" and consequences.blind_side(order):
        v.not_compared.append(f"gradient reductions ({consequences.blind_side(order)} recorded "
                              "none)")
    v.not_compared += [str(x) for x in d.get("not_recorded") or []]  # neither side has it
    v.not_compared += [f"incomplete data: {m}" for m in incomplete[:4]]
    if len(incomplete) > 4:
        v.not_compared.append(f"{len(incomplete) - 4} more (see the incomplete list)")
    only_a, only_b = d.get("params_only_in_a") or [], d.get("params_only_in_b") or []
    if only_a or only_b:
        v.not_compared.append(f"{len(only_a)} parameters only in A, {len(only_b)} only in B")
    for w in d.get("warnings") or []:
        if isinstance(w, dict):
            v.warnings.append(f"{str(w.get('side', '?')).upper()}: {w.get('message')}")
    align = d.get("align")
    if isinstance(align, dict) and align.get("words"):
        v.aligned = str(align["words"])
    return v


def cell_status(d: dict) -> tuple[str, str]:
    """A sweep cell's status and one-line reason from its diff result's JSON
    (``DiffResult.to_dict()``): match, hash_mismatch, order_mismatch, or failed (incomplete
    data). Capture warnings are appended to the reason, so every report and the gate show them."""
    found, reason = _cell_status(d)
    warns = [w for w in d.get("warnings") or [] if isinstance(w, dict)]
    if warns:
        w = warns[0]
        reason += (f"; {len(warns)} capture warning(s) ({str(w.get('side', '?')).upper()}: "
                   f"{w.get('message')})")
    return found, reason


def _cell_status(d: dict) -> tuple[str, str]:
    verdict = d.get("verdict")
    order = d.get("order") if isinstance(d.get("order"), dict) else {}
    oval = order.get("verdict")
    st = status(verdict, oval)
    order_note = ""
    if oval in ORDER_FAILURES:
        order_note = (f"bucket order: {oval}{_where(order.get('first_bucket'))}"
                      + consequences.order_suffix(order))
        predicted = consequences.reduction_phrase(d.get("reduction_order"))
        if predicted:
            order_note += f"; {predicted}"
    elif oval == "unavailable" and (one := _one_sided(order)):
        # a one-rank compiled job issues no bucketed collective: say that, not "unavailable"
        ranks = "1 rank; " if d.get("world_size") == 1 else ""
        order_note = f"bucket layouts not compared ({ranks}{one})"
    elif oval and oval != "identical":
        notes = [str(n) for n in order.get("notes") or []][:1]
        order_note = f"bucket order {oval}" + (f" ({notes[0]})" if notes else "")
    if st == HASH_MISMATCH:
        step = d.get("first_divergent_step")
        div = [x for x in d.get("divergent") or [] if isinstance(x, dict)]
        first = [x for x in div if x.get("step") == step] or div
        names = list(dict.fromkeys(str(x.get("fqn")) for x in first if x.get("fqn")))
        what = ""
        if names:
            what = ": " + ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3
                                                  else "")
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else {}
        if _numbers_only(fd):
            reason = f"optimizer group numbers differ from step {step} (hashes equal)"
        elif fd.get("origin") == "final":
            reason = f"final state differs ({fd.get('phase') or 'when the run ended'}){what}"
        elif fd.get("origin") == "between" and fd.get("phase"):
            reason = f"first divergent step {step} (between steps: {fd['phase']}){what}"
        else:
            reason = f"first divergent step {step}{what}"
        if order_note and oval in ORDER_FAILURES:
            reason += f"; {order_note}"
        return HASH_MISMATCH, reason
    if st == ORDER_MISMATCH:
        return ORDER_MISMATCH, f"hashes identical; {order_note}"
    if st == MATCH:
        return MATCH, "bitwise identical" + (f"; {order_note}" if order_note else "")
    why = [str(x) for x in d.get("incomplete") or []][:2]
    why += [str(p.get("message")) for p in d.get("problems") or [] if isinstance(p, dict)][:1]
    return FAILED, "incomplete data" + (f": {'; '.join(why)}" if why else
                                        f" (diff verdict {verdict!r})")


def _where(fb) -> str:
    if not isinstance(fb, dict):
        return ""
    parts = [f" in {fb['collective']} bucket {fb.get('index')}" if fb.get("collective") else ""]
    if fb.get("group"):
        parts.append(f" ({fb['group']})")
    if fb.get("position") is not None:
        parts.append(f" at position {fb['position']}")
    if isinstance(fb.get("detail"), str) and fb["detail"]:
        parts.append(f": {fb['detail']}")
    return "".join(parts)


def settled_cell(found: str | None, reason: str | None) -> tuple[str, str | None]:
    """A cell's status and reason as a sweep report states them: a cell still pending or
    running when the sweep stopped is failed (resume reruns it)."""
    if found not in CELL_STATUSES:
        return FAILED, reason or "did not finish (sweep interrupted; rerun with --resume)"
    return found, reason


def cell_code(cell, policy: str) -> int | None:
    """Exit code of a compared sweep cell (a ``parity.sweep.model.CellResult``: this layer sits
    below the sweep and reads its fields without importing it) under ``policy`` (None for a cell
    not compared)."""
    if cell.status == NONDETERMINISTIC:
        return nondeterministic_code(cell, policy)
    if cell.status not in (MATCH, HASH_MISMATCH, ORDER_MISMATCH):
        return None
    diff = cell.diff if isinstance(cell.diff, dict) else {}
    order = diff.get("order") if isinstance(diff.get("order"), dict) else {}
    hv = HASH_MISMATCH if cell.status == HASH_MISMATCH else MATCH
    ov = order.get("verdict")
    if cell.status == ORDER_MISMATCH and ov not in ORDER_FAILURES:
        ov = "order_differs"
    return pair_code(hv, ov, False, policy, consequences.reduction_state(diff),
                     structure_only(order))


def nondeterministic_code(cell, policy: str) -> int:
    """A cell whose reference differs from its own repeat never passes: exit 1 when the
    candidate diverged at a step where the reference was still deterministic (a real finding
    under a policy that fails on hashes), else 3 (parity cannot be proven on noise)."""
    ctl = getattr(cell, "control", None)
    ctl = ctl if isinstance(ctl, dict) else {}
    if ctl.get("candidate_diverged_before") and fails_on_hash(policy):
        return EXIT_MISMATCH
    return EXIT_INCOMPLETE


def judge_sweep(sweep, policy: str) -> tuple[Verdict, list[str]]:
    """The gate's verdict on a loaded sweep report (a ``parity.sweep.model.SweepReport``), and one line per cell worth naming
    (failing, failed, unproven, tolerated, skipped)."""
    check(policy)
    cells = [c for c in sweep.cells or [] if _is_cell(c)]
    codes = [cell_code(c, policy) for c in cells]
    compared = [c for c, k in zip(cells, codes) if k is not None]
    failing = [c for c, k in zip(cells, codes) if k == EXIT_MISMATCH]
    unproven = [c for c, k in zip(cells, codes) if k == EXIT_INCOMPLETE
                and c.status != NONDETERMINISTIC]
    nondet = [c for c, k in zip(cells, codes) if k == EXIT_INCOMPLETE
              and c.status == NONDETERMINISTIC]
    tolerated = [c for c, k in zip(cells, codes) if k == EXIT_OK and c.status != MATCH]
    failed = [c for c in cells if c.status == "failed"]
    skipped = [c for c in cells if c.status == "skipped"]
    other = [c for c in cells if c not in compared and c not in failed and c not in skipped]
    problems = []
    if not sweep.is_complete():
        problems.append("the sweep did not finish")
    if not compared:
        problems.append("no cell was compared")
    if failing:
        code = EXIT_MISMATCH
    elif failed or unproven or nondet or problems or other:
        code = EXIT_INCOMPLETE
    else:
        code = EXIT_OK
    v = Verdict(code, policy, subject="PARITY")
    by_status: dict[str, list[dict]] = {}
    for c in failing:
        by_status.setdefault(c.status, []).append(c)
    for s, cs in by_status.items():
        v.failed.append(f"{len(cs)} {s} ({_ids(cs)})")
    if failed:
        v.failed.append(f"{len(failed)} failed ({_ids(failed)})")
    held = len(compared) - len(failing) - len(unproven) - len(nondet)
    v.held.append(f"{held}/{len(compared)} compared cells hold")
    by_status = {}
    for c in tolerated:
        by_status.setdefault(c.status, []).append(c)
    for s, cs in by_status.items():
        v.tolerated.append(f"{len(cs)} {s} ({_ids(cs)})")
    if nondet:
        v.not_compared.append(f"{len(nondet)} {NONDETERMINISTIC} ({_ids(nondet)})")
    if unproven:
        v.not_compared.append(f"{len(unproven)} without bucket layouts ({_ids(unproven)})")
    if skipped:
        v.not_compared.append(f"{len(skipped)} skipped")
    if other:
        v.not_compared.append(f"{len(other)} pending")
    v.not_compared += problems
    lines = []
    for c in failing:
        lines.append(f"FAILS     {c.id}: {c.status}: {c.reason or ''}".rstrip(": "))
    for c in failed:
        lines.append(f"FAILED    {c.id}: {c.reason or 'failed'}")
    for c in nondet:
        lines.append(f"NONDET    {c.id}: {NONDETERMINISTIC}: {c.reason or ''}".rstrip(": "))
    for c in unproven:
        order = (c.diff or {}).get("order") or {}
        lines.append(f"UNPROVEN  {c.id}: bucket layouts {order.get('verdict') or 'not recorded'}"
                     f" (--fail-on {policy} needs both sides' bucket layouts)")
    for c in tolerated:
        lines.append(f"tolerated {c.id}: {c.status}: {c.reason or ''}".rstrip(": "))
    for c in skipped:
        lines.append(f"skipped   {c.id}: {c.reason or ''}".rstrip(": "))
    for c in compared:  # capture warnings: said for every compared cell, failing or not
        diff = c.diff if isinstance(c.diff, dict) else {}
        warns = [w for w in diff.get("warnings") or [] if isinstance(w, dict)]
        for w in warns:
            v.warnings.append(f"{c.id} ({str(w.get('side', '?')).upper()}: {w.get('message')})")
        if warns:
            w = warns[0]
            lines.append(f"warning   {c.id}: {_plural(len(warns), 'capture warning')} "
                         f"({str(w.get('side', '?')).upper()}: {w.get('message')})")
    return v, lines


def _numbers_only(fd: dict) -> bool:
    """A first divergence of the optimizers' group numbers alone: every hash matched
    (diff/opt_numbers.py, engine.py ``_numbers_divergence``)."""
    return (fd.get("origin") == "optimizer" and not fd.get("params") and not fd.get("grads")
            and isinstance(fd.get("opt_numbers"), dict))
