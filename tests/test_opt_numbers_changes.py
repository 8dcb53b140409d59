"""Round 15a: the optimizers' group numbers (steps.jsonl ``opt``) written as the changes since a
rank's last line, and carried forward by the reader (parity/opt_changes.py; written by
artifacts.RankWriter, read by artifacts.read_rank). No job: the real writer and reader on
files, and the pure functions.

Was (docs/reliability.md, "Round 15a"): every line carried every group's numbers, 87 KB a line
for 1,500 per-parameter groups. Now a line carries the groups that changed; every reader after
read_rank (diff/opt_numbers.py, ``--align-steps``) sees the full list on every step, as from a
run of round 14c, which reads as it did.
"""

from __future__ import annotations

import json
import math

import pytest

from parity import artifacts
from parity.artifacts import NO_HASH, RankWriter, read_rank, read_run
from parity.diff import align
from parity.diff.opt_numbers import compare_numbers, numbers_by_rank
from parity.opt_changes import CHANGES_VERSION, apply_changes, carry_forward, encode
from parity.rundir import rank_dir


def _g(lr, **kw):
    """A group's numbers as capture reads them (keys sorted)."""
    return dict(sorted({"dampening": 0, "lr": lr, "momentum": 0.9, "weight_decay": 0,
                        **kw}.items()))


def _write(out, steps: dict, close: bool = True):
    """A rank 0 of ``steps`` {step: opt list or None}, written by the real writer."""
    w = RankWriter(out, 0, {})
    for s, opt in steps.items():
        w.write_step(s, NO_HASH * 2, opt=opt)
    if close:
        w.close()
    return rank_dir(out, 0)


def _lines(d):
    return [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]


def _read_opt(d) -> dict:
    return numbers_by_rank([read_rank(d, 0)])[0]


# A schedule with every case a line meets: numbers constant, one group's lr changed, every
# group's lr changed, a key added (a scheduler's initial_lr), a key removed, a group added
# (add_param_group: another count), a second optimizer stepping every other step (the list
# grows and shrinks), a NaN, a step without numbers (none could be read).
SCHEDULE = {
    0: None,
    1: [_g(0.1), _g(0.2)],
    2: [_g(0.1), _g(0.2)],
    3: [_g(0.1), _g(0.05)],
    4: [_g(0.01, initial_lr=0.1), _g(0.02, initial_lr=0.2)],
    5: [_g(0.01), _g(0.02, initial_lr=0.2)],
    6: [_g(0.01), _g(0.02, initial_lr=0.2), _g(1.0)],
    7: [_g(0.01), _g(0.02, initial_lr=0.2), _g(1.0), {"betas": [0.9, 0.99], "lr": 3.0}],
    8: [_g(0.01), _g(0.02, initial_lr=0.2), _g(1.0)],
    9: None,
    10: [_g(0.01), _g(float("nan"), initial_lr=0.2), _g(1.0)],
    11: [_g(0.01), _g(float("nan"), initial_lr=0.2), _g(1.0)],
    12: [_g(0.01), _g(0.02, initial_lr=0.2), _g(1.0, betas=[0.9, 0.999])],
    13: [_g(0.5), _g(0.5, initial_lr=0.2), _g(0.5, betas=[0.9, 0.999])],
    14: [_g(0.7), _g(0.5, initial_lr=0.2), _g(0.7, betas=[0.8, 0.999])],
}


def _same(x, y) -> bool:
    """Equal, NaN equal to NaN (as the diff compares them)."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, dict) and isinstance(y, dict):
        return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def test_the_reader_gives_every_step_what_was_written(tmp_path):
    d = _write(tmp_path, SCHEDULE)
    got = _read_opt(d)
    want = {s: o for s, o in SCHEDULE.items() if o is not None}
    assert sorted(got) == sorted(want)
    assert all(_same(got[s], want[s]) for s in want), got
    assert not read_rank(d, 0).damage


def test_lines_carry_only_what_changed(tmp_path):
    lines = {r["step"]: r for r in _lines(_write(tmp_path, SCHEDULE))}
    full = {s for s, r in lines.items() if isinstance(r.get("opt"), list)}
    assert full == {1, 6, 7, 8}  # the first, and each other count (a group added, an optimizer)
    assert all(lines[s]["v"] == 2 for s in full | {0, 9})  # lines without changes: as before
    ch = {s: r["opt"] for s, r in lines.items() if isinstance(r.get("opt"), dict)}
    assert all(lines[s]["v"] == CHANGES_VERSION for s in ch)
    assert ch[2] == {"since": 1, "groups": 2, "changed": []}
    assert ch[3]["changed"] == [[1, {"lr": 0.05}]]
    assert ch[4]["changed"] == [[0, {"initial_lr": 0.1, "lr": 0.01}],
                                [1, {"initial_lr": 0.2, "lr": 0.02}]]
    assert ch[5]["changed"] == [[0, _g(0.01), 1]]  # a key went away: the whole group
    assert ch[10]["since"] == 8  # step 9 wrote no numbers: the changes are to step 8's
    assert ch[11]["changed"][0][0] == 1  # a NaN is never equal: written again, read as written
    assert ch[12]["changed"] == [[1, {"lr": 0.02}], [2, {"betas": [0.9, 0.999]}]]
    assert ch[13]["changed"] == [[[0, 1, 2], {"lr": 0.5}]]  # one lr set on every group: once
    assert ch[14]["changed"] == [[0, {"lr": 0.7}], [2, {"betas": [0.8, 0.999], "lr": 0.7}]]


def test_every_n_and_a_rank_that_records_fewer_steps(tmp_path):
    """``--every 2``: only recorded steps write lines, changes are to the last one written; a
    rank that stops earlier reads what it wrote."""
    steps = {1: [_g(0.1)], 3: [_g(0.1)], 5: [_g(0.2)], 7: [_g(0.3)]}
    d = _write(tmp_path / "a", steps)
    assert [r["opt"].get("since") for r in _lines(d)[1:]] == [1, 3, 5]
    assert _read_opt(d) == steps
    short = _write(tmp_path / "b", dict(list(steps.items())[:2]))
    assert compare_numbers({0: _read_opt(d)}, {0: _read_opt(short)}, [0])["steps"] == [1, 3]


def test_a_run_of_round_14c_reads_as_it_did(tmp_path):
    """Every line a full list (what round 14c wrote): the records come back untouched."""
    recs = [{"v": 2, "step": s, "param_digest": "0" * 32, "opt": o}
            for s, o in SCHEDULE.items() if o is not None]
    assert carry_forward(recs) is recs
    d = _write(tmp_path, SCHEDULE, close=False)  # unclosed: read and checked line by line
    path = d / "steps.jsonl"
    old = [{**r, "v": 2, "opt": SCHEDULE[r["step"]]} if "opt" in r else r for r in _lines(d)]
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in old))
    got = _read_opt(d)
    assert all(_same(got[s], SCHEDULE[s]) for s in got) and len(got) == 13


def test_a_line_lost_is_not_filled_in(tmp_path):
    """A change line whose base line is gone (damaged, cut): that step and the next change
    lines have no numbers (not compared) until the next full list; nothing is invented."""
    d = _write(tmp_path, SCHEDULE, close=False)
    path = d / "steps.jsonl"
    kept = [x for x in path.read_text().splitlines() if json.loads(x)["step"] != 3]
    path.write_text("\n".join(kept) + "\n")
    got = _read_opt(d)
    assert sorted(got) == [1, 2, 6, 7, 8, 10, 11, 12, 13, 14]  # 4, 5: changes to a line not read
    assert all(_same(got[s], SCHEDULE[s]) for s in got)


@pytest.mark.parametrize("opt", [
    {"since": 2, "groups": 2, "changed": []},           # another base step
    {"since": 1, "groups": 3, "changed": []},           # another count
    {"since": 1, "groups": 2, "changed": [[2, {}]]},    # a group that is not there
    {"since": 1, "groups": 2, "changed": [["0", {}]]},  # malformed
    {"since": 1, "groups": 2},
    {"since": 1, "groups": 2, "changed": [[[0, 2], {}]]},     # one of them is not there
    {"since": 1, "groups": 2, "changed": [[[0, 1], {}, 1]]},  # whole groups one at a time
    {"since": 1, "groups": 2, "changed": [[[], {}]]},
])
def test_apply_changes_refuses_what_does_not_fit(opt):
    assert apply_changes([_g(0.1), _g(0.2)], 1, opt) is None
    assert apply_changes(None, None, {"since": None, "groups": 0, "changed": []}) is None


def test_encode_and_apply_are_inverse():
    last, since = None, None
    prev_full = None
    for s, groups in SCHEDULE.items():
        if groups is None:
            continue
        enc = encode(groups, last, since)
        full = enc if isinstance(enc, list) else apply_changes(prev_full, since, enc)
        assert _same(full, groups), s
        last, since, prev_full = groups, s, full


def test_an_older_reader_says_damage_not_a_verdict(tmp_path, monkeypatch):
    """What a parity before round 15a does with a new run: it reads schema versions 1 and 2
    only, so the change lines are skipped as damage (incomplete, exit 3), said, never taken
    as steps without numbers (which would compare step 1 only)."""
    d = _write(tmp_path, SCHEDULE)
    monkeypatch.setattr(artifacts, "READABLE_VERSIONS", (1, 2))
    rd = read_rank(d, 0)
    assert rd.damage and "not a schema-2 record, skipped" in rd.damage[0]
    assert sorted(rd.steps) == [0, 1, 6, 7, 8, 9]


def test_aligned_steps_carry_full_numbers(tmp_path):
    """``--align-steps B+2`` renumbers after reading: the resumed side's first step (a full
    list) and its later ones (changes) read full, and the other side's step after the anchor
    (a change line whose base, the anchor, is cut to what a step 0 holds) too."""
    full = {0: None, **{s: [_g(0.1 * s), _g(1.0)] for s in range(1, 5)}}
    resumed = {0: None, 1: full[3], 2: full[4]}
    _write(tmp_path / "a", full)
    _write(tmp_path / "b", resumed)
    ra, rb = read_run(tmp_path / "a"), read_run(tmp_path / "b")
    va, vb = align.apply(align.resolve("B+2", ra, rb), ra, rb)
    na, nb = numbers_by_rank([va.ranks[0]])[0], numbers_by_rank([vb.ranks[0]])[0]
    assert na == {3: full[3], 4: full[4]} and nb == {3: full[3], 4: full[4]}
    c = compare_numbers({0: na}, {0: nb}, [0])
    assert c["steps"] == [3, 4] and c["first_differs"] is None


def test_implementation_written_when_it_changes_and_carried(tmp_path):
    """``opt_impl`` (round 15b) rides with the numbers: on a line of changes only when it
    changed; the reader gives every step the one in force; a broken chain drops it too."""
    impl = [{"class": "torch.optim.sgd.SGD", "flags": [{"foreach": None}] * 2}]
    other = [{"class": "torch.optim.sgd.SGD", "flags": [{"foreach": True}] * 2}]
    w = RankWriter(tmp_path, 0, {})
    for s, im in ((1, impl), (2, impl), (3, other), (4, other)):
        w.write_step(s, NO_HASH * 2, opt=[_g(0.1), _g(0.2)], opt_impl=im)
    w.close()
    d = rank_dir(tmp_path, 0)
    written = {x["step"]: "opt_impl" in x for x in _lines(d) if "step" in x}
    assert written == {1: True, 2: False, 3: True, 4: False}
    steps = read_rank(d, 0).steps
    assert [steps[s]["opt_impl"] for s in (1, 2, 3, 4)] == [impl, impl, other, other]
    lines = _lines(d)
    broken = [x for x in lines if x.get("step") != 3]  # the line that changed it, lost
    assert "opt_impl" not in carry_forward(broken)[[x.get("step") for x in broken].index(4)]


def test_most_groups_changed_each_its_own_way_is_written_whole():
    """Each group its own new lr: the full list (cheaper to make than 1,500 changes); one lr
    set on every group stays one change."""
    last = [_g(0.1 + i) for i in range(100)]
    own = [_g(0.2 + i) for i in range(100)]
    assert encode(own, last, 1) is own
    one = [_g(0.5) for _ in range(100)]
    assert isinstance(encode(one, [_g(0.1) for _ in range(100)], 1), dict)
