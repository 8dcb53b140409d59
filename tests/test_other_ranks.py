"""Unit tests of parity/diff/other_ranks.py (round 14a): groups and all-reduce layouts that
differ only on ranks other than the reference one, found relative to the reference rank,
cheaply at 256 ranks; and the same through ``diff_runs`` on synthetic runs (tests/synth.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from parity.diff import diff_runs
from parity.diff.other_ranks import MAX_RANKS, other_ranks
from parity.policy import judge_pair, order_phrase
from tests.synth import make_run


def _ar(ranks: list[int] | None, size: int, fqns=(None,), step: int = 1) -> dict:
    entries = [{"fqn": f, "offset": 4 * i, "size": 4, "numel": 1, "dtype": "float32"}
               for i, f in enumerate(fqns)]
    line = {"source": "c10d", "collective": "all_reduce", "graph": None, "graph_id": None,
            "step": step, "index": 0, "group": "t.py:_tok", "dtype": "float32",
            "world_size": size, "total_bytes": 4 * len(entries), "op": "sum", "entries": entries}
    if ranks is not None:
        line["ranks"] = ranks
    return line


def _run(per_rank: dict[int, list[dict]]):
    return SimpleNamespace(ranks={r: SimpleNamespace(buckets=b) for r, b in per_rank.items()})


def _pairs(rows: list[list[int]], world: int = 6) -> dict[int, list[dict]]:
    return {r: [_ar(next(g for g in rows if r in g), 2)] for r in range(world)}


def test_groups_that_agree_on_the_reference_rank_and_differ_elsewhere():
    """{0,1},{2,3},{4,5} against {0,1},{2,4},{3,5}: rank 0 agrees, ranks 2-5 differ."""
    a = _run(_pairs([[0, 1], [2, 3], [4, 5]]))
    b = _run(_pairs([[0, 1], [2, 4], [3, 5]]))
    got = other_ranks(a, b, list(range(6)), 0)
    assert sorted(got.groups) == [2, 3, 4, 5] and not got.layouts
    assert got.compare == [2, 3, 4, 5][:MAX_RANKS]
    assert got.describe() == ("all_reduce on rank 2: group ranks [2, 3] in A, group ranks [2, 4] "
                              "in B (the reference rank's groups agree; also rank(s) 3-5)")


def test_the_same_groups_find_nothing():
    a = _run(_pairs([[0, 1], [2, 3], [4, 5]]))
    b = _run(_pairs([[0, 1], [2, 3], [4, 5]]))
    got = other_ranks(a, b, list(range(6)), 0)
    assert not got.groups and not got.layouts and not got.compare and not got.notes


def test_groups_that_differ_on_the_reference_rank_are_left_to_it():
    """A kind whose groups already differ on the reference rank is the reference comparison's
    to report (relative check: eager against compiled sources may write groups otherwise on
    every rank alike)."""
    a = _run(_pairs([[0, 1], [2, 3], [4, 5]]))
    b = _run(_pairs([[0, 2], [1, 3], [4, 5]]))
    assert not other_ranks(a, b, list(range(6)), 0).groups


def test_an_all_reduce_layout_that_differs_on_some_ranks_only():
    """Ranks 3-5 pack the gradients in another order in B; the groups agree everywhere."""
    def lines(rev: bool, r: int) -> list[dict]:
        fqns = ("w", "b")[::-1] if rev else ("w", "b")
        return [_ar([0, 1, 2] if r < 3 else [3, 4, 5], 3, fqns)]

    a = _run({r: lines(False, r) for r in range(6)})
    b = _run({r: lines(r >= 3, r) for r in range(6)})
    got = other_ranks(a, b, list(range(6)), 0)
    assert not got.groups and got.layouts == [3, 4, 5] and got.compare == [3, 4, 5]


def test_more_ranks_than_compared_are_said():
    rows_a = [[2 * i, 2 * i + 1] for i in range(8)]
    rows_b = [[0, 1], [2, 5], [3, 4], [6, 9], [7, 8], [10, 13], [11, 12], [14, 15]]
    a, b = _run(_pairs(rows_a, 16)), _run(_pairs(rows_b, 16))
    got = other_ranks(a, b, list(range(16)), 0)
    assert len(got.compare) == MAX_RANKS and len(got.groups) == 12 and len(got.left) == 8
    assert got.notes and "(compared on rank(s) 2-5); not compared" in got.notes[0], got.notes


def test_256_ranks_are_summarised_quickly():
    """256 ranks, each its own list (HSDP: every rank's group is its own), 200 lines each, both
    sides alike, not shared (the reader shares byte-identical lists, which are skipped): about
    0.4 s of CPU on the 2-core dev machine under load (the diff of such runs must stay fast)."""
    def rank_lines(r: int) -> list[dict]:
        g = list(range(r // 8 * 8, r // 8 * 8 + 8))
        return [_ar(g, 8, ("p%d" % i,), step=1) | {"index": i} for i in range(200)]

    a = _run({r: rank_lines(r) for r in range(256)})
    b = _run({r: rank_lines(r) for r in range(256)})
    t = time.process_time()
    got = other_ranks(a, b, list(range(256)), 0)
    took = time.process_time() - t
    assert not got.groups and not got.layouts
    assert took < 1.5, took


def test_the_verdict_line_names_the_rank():
    fb = {"collective": "reduce_scatter", "verdict": "order_differs", "index": 0, "b_index": 0,
          "position": 0, "detail": "same 6 parameters", "rank": 3}
    assert order_phrase("order_differs", fb) == ("bucket order differs (reduce_scatter bucket 0 "
                                                 "position 0 on rank 3)")
    fb.pop("rank")
    assert "on rank" not in order_phrase("order_differs", fb)


def _hook(rows: list[list[int]]):
    def hook(rec: dict, rank: int) -> dict:
        rec["ranks"] = next(g for g in rows if rank in g)
        rec["world_size"] = len(rec["ranks"])
        return rec
    return hook


def test_diff_of_sub_groups_that_differ_beyond_rank_0(tmp_path):
    """Synthetic 6-rank runs whose reduce-scatter and all-gather groups are {0,1},{2,3},{4,5}
    in A and {0,1},{2,4},{3,5} in B, hashes equal: was HOLDS "bucket layouts identical" under
    ``--fail-on any`` and "same sums" under ``--at``; now the group difference on rank 2 FAILS
    ``any`` and the prediction is unknown."""
    a = make_run(tmp_path / "a", world_size=6, steps=1, n_params=4,
                 bucket_hook=_hook([[0, 1], [2, 3], [4, 5]]))
    b = make_run(tmp_path / "b", world_size=6, steps=1, n_params=4,
                 bucket_hook=_hook([[0, 1], [2, 4], [3, 5]]))
    r = diff_runs(a, b, at="3x2")
    d = r.to_dict()
    assert d["order"]["verdict"] == "layout_differs" and d["order"]["rank"] == 2, d["order"]
    v = judge_pair(d, "any")
    assert v.code == 1 and "bucket group differs" in v.line() and "on rank 2" in v.line(), v.line()
    assert d["reduction_order"]["verdict"] == "unknown", d["reduction_order"]
    same = diff_runs(a, make_run(tmp_path / "c", world_size=6, steps=1, n_params=4,
                                 bucket_hook=_hook([[0, 1], [2, 3], [4, 5]])), at="3x2")
    assert same.order.verdict == "identical" and same.reduction_order.verdict == "same"


def test_ranks_beyond_those_compared_are_not_predicted_same(tmp_path):
    """12 ranks, 8 of them in other pairs: 4 are compared and predicted, the other 4 named in
    the prediction's unknown reasons (never folded into "same")."""
    rows_a = [[2 * i, 2 * i + 1] for i in range(6)]
    rows_b = [[0, 1], [2, 5], [3, 4], [6, 9], [7, 8], [10, 11]]
    a = make_run(tmp_path / "a", world_size=12, steps=1, n_params=4, bucket_hook=_hook(rows_a))
    b = make_run(tmp_path / "b", world_size=12, steps=1, n_params=4, bucket_hook=_hook(rows_b))
    d = diff_runs(a, b, at="3x4").to_dict()
    reasons = [u["reason"] for u in d["reduction_order"]["unknown"]]
    assert any(r.startswith("rank(s) 6-9 differ from the reference rank") for r in reasons), \
        reasons
    assert d["reduction_order"]["verdict"] == "unknown"


def test_a_group_difference_no_layout_shows_is_said_on_the_verdict_line(tmp_path):
    """A DTensor all-gather (not the side's layout source) over other pairs beyond rank 0: no
    bucket pair can show it, so the verdict line says it was not compared (never a silent
    "identical")."""
    line = {"source": "dtensor", "collective": "all_gather", "graph": None, "graph_id": None,
            "step": 1, "index": 0, "group": None, "dtype": "float32", "world_size": 2,
            "total_bytes": 8, "entries": [{"fqn": None, "offset": 0, "size": 8, "numel": 2,
                                           "dtype": "float32", "shape": [2]}]}

    def hook(rows):
        def edit(rec: dict, rank: int) -> dict:
            if rec.get("source") == "dtensor":
                rec["ranks"] = next(g for g in rows if rank in g)
            return rec
        return edit

    a = make_run(tmp_path / "a", world_size=6, steps=1, n_params=4, extra_buckets=[line],
                 bucket_hook=hook([[0, 1], [2, 3], [4, 5]]))
    b = make_run(tmp_path / "b", world_size=6, steps=1, n_params=4, extra_buckets=[line],
                 bucket_hook=hook([[0, 1], [2, 4], [3, 5]]))
    v = judge_pair(diff_runs(a, b).to_dict(), "any")
    assert "not compared: bucket layouts of rank(s) 2-5, whose groups differ (all_gather on rank 2" \
        in v.line(), v.line()
