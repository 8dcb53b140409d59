"""The optimizers' group numbers in steps.jsonl written as changes (``opt``, round 15a).

Why: round 14c wrote every group's numbers (lr, betas, weight decay, ...) on every recorded
step. A trainer with a param group per parameter (1,500 groups) then wrote every group on every
line, though a schedule changes them at a few steps, or changes one key (lr) of each
(docs/reliability.md, "Round 15a": bytes and microseconds per line, before and after). Now a
rank's writer (artifacts.RankWriter) writes the full list on its first line with numbers, and on
a line whose group count differs from its last one (an optimizer that did not step this step,
``add_param_group``); any other line gets the changes since the last line it wrote with numbers:

    "opt": {"since": 3, "groups": 1500, "changed": [[7, {"lr": 0.05}], [9, {...}, 1]]}

``[i, d]``: group i is the previous line's with the keys of d set (changed or new);
``[[i, j, ...], d]``: so is each of groups i, j, ... (the same changes: a schedule that sets one
lr on every group writes it once); ``[i, d, 1]``: group i is d (a key went away). ``since``
is the step of the line the changes are to, ``groups`` the count: the reader
(``carry_forward``, in artifacts.read_rank, before any step is renumbered by ``--align-steps``
or dropped as damaged) checks both, so a lost or foreign
line never yields numbers that were not written; where the chain is broken the step has no
``opt`` (not compared) until the rank's next full list. Every reader after it sees the full list
on every step, as from a run of round 14c, whose lines (full lists only) read as they did.

Such a line carries ``"v": 3`` (``CHANGES_VERSION``): a reader before round 15a does not know
the form and would take the steps without a full list as steps without numbers, comparing the
first step only ("equal through step 1"); it skips a line of another version instead, as
damage, and says so (incomplete, exit 3), never a verdict on numbers it did not read. Lines
without numbers keep ``"v": 2``.

Unchanged means equal (``==``): a number that turned from int 0 to float 0.0 is not written
again (the diff compares them equal anyway); a NaN never equals itself, so it is written on
every line (read as written).
"""

from __future__ import annotations

__all__ = ["CHANGES_VERSION", "encode", "apply_changes", "carry_forward"]

CHANGES_VERSION = 3  # the "v" of a steps.jsonl line whose "opt" is changes


def encode(groups: list[dict], last: list[dict] | None, since) -> list[dict] | dict:
    """``groups`` as a line's ``opt``: the list itself where ``last`` (the numbers the writer's
    previous line with numbers carried, at step ``since``) is None or has another count, or
    where over an eighth of the groups changed each in its own way; else the changes to it (a
    dict, which a line marks with ``CHANGES_VERSION``)."""
    if last is None or len(last) != len(groups):
        return groups
    changed: list[list] = []
    alike: dict[tuple, list] = {}  # the same changes (a schedule's one lr): one entry
    most = max(8, len(groups) // 8)
    for i, (g, o) in enumerate(zip(groups, last)):
        if g == o:
            continue
        if len(changed) > most:
            # changes of their own for many groups (each group its own lr, every step): the
            # full list is shorter to make than the changes (1,500 groups: 2.1 -> ~1.2 ms)
            return groups
        if not o.keys() <= g.keys():
            changed.append([i, g, 1])
            continue
        d = {k: v for k, v in g.items() if o.get(k, o) != v}
        key = tuple(d.items())
        try:
            e = alike.get(key)
        except TypeError:  # a list among the values (betas): not hashable, an entry of its own
            changed.append([i, d])
            continue
        if e is None:
            alike[key] = e = [i, d]
            changed.append(e)
        elif type(e[0]) is int:
            e[0] = [e[0], i]
        else:
            e[0].append(i)
    return {"since": since, "groups": len(groups), "changed": changed}


def apply_changes(last: list | None, last_step, opt) -> list | None:
    """The full list a change form ``opt`` stands for, after ``last`` (the full list of the
    rank's previous line with numbers, at step ``last_step``); None where it cannot be known:
    no previous list, another ``since`` or count (a line lost), a malformed entry."""
    if (last is None or not isinstance(opt, dict) or opt.get("since") != last_step
            or opt.get("groups") != len(last) or not isinstance(opt.get("changed"), list)):
        return None
    if not opt["changed"]:
        return last  # shared: nothing changed (most lines)
    out, n = list(last), len(last)
    for e in opt["changed"]:
        if not (isinstance(e, list) and len(e) in (2, 3) and isinstance(e[1], dict)):
            return None
        at, d = e[0], e[1]
        at = [at] if type(at) is int else at
        if not (isinstance(at, list) and at and (len(e) == 2 or len(at) == 1)
                and all(type(i) is int and 0 <= i < n and isinstance(out[i], dict)
                        for i in at)):
            return None
        for i in at:
            if len(e) == 3:
                out[i] = d  # written whole, its keys sorted as capture reads them
            else:
                new = {**out[i], **d}  # changed keys keep their place
                out[i] = new if len(new) == len(out[i]) else dict(sorted(new.items()))
    return out


def carry_forward(lines: list[dict]) -> list[dict]:
    """``lines`` (one rank's steps.jsonl records, in file order) with every change form ``opt``
    replaced by the full list it stands for (new dicts: the records may be shared with other
    ranks' reads), or removed where it cannot be known; such a line's ``opt_impl`` (written
    only when it changed) likewise, from the line before it. Lines of round 14c (full lists) and
    lines without ``opt`` come back as they are; the list itself when nothing was replaced."""
    last, last_step, out, replaced = None, None, [], False
    impl = None  # the optimizers' classes and flags of the last line with numbers
    for rec in lines:
        opt = rec.get("opt")
        if isinstance(opt, list):
            last, last_step = opt, rec.get("step")
            impl = rec.get("opt_impl")
        elif isinstance(opt, dict):
            full = apply_changes(last, last_step, opt)
            replaced = True
            if full is None:
                rec = {k: v for k, v in rec.items() if k not in ("opt", "opt_impl")}
                last = last_step = impl = None  # broken until the next full list
            else:
                if "opt_impl" in rec:
                    impl = rec["opt_impl"]
                rec = {**rec, "opt": full}
                if impl is not None:
                    rec["opt_impl"] = impl  # written only when it changed (round 15b)
                last, last_step = full, rec.get("step")
        out.append(rec)
    return out if replaced else lines
