"""The console report and the JSON serialization of `parity diff` (synthetic runs)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from synth import default_fqns, make_run  # noqa: E402

from parity.diff import SCHEMA_PATH, diff_runs  # noqa: E402
from parity.report.console import make_console, print_diff  # noqa: E402

F = default_fqns(8)
WEIRD = ["a[b]", "[bold]x[/bold]", "emb[red].weight", "layers.0.w\\[x]", "norm:[i]", "p5", "p6",
         "p7"]


def render(result, **kw) -> str:
    buf = io.StringIO()
    print_diff(result, make_console(file=buf, **kw))
    return buf.getvalue()


def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


SCENARIOS = {
    "match": ({}, {}),
    "grad": ({}, {"diverge_at": 2, "diverge_rank": 1, "diverge_param": 2}),
    "param": ({}, {"diverge_at": 1, "kind": "param", "diverge_param": [0, 3]}),
    "loss": ({}, {"diverge_at": 1, "kind": "loss"}),
    "init": ({}, {"diverge_at": 0, "kind": "param", "diverge_rank": "all"}),
    "order": ({}, {"bucket_layout": "graph", "bucket_order": "reversed-rs"}),
    "partition": ({}, {"bucket_layout": "graph", "bucket_groups": 8}),
    "layout": ({}, {"bucket_hook": lambda b, r: {**b, "dtype": "bfloat16"}}),
    "unavailable": ({}, {"bucket_layout": None}),
    "incomplete": ({}, {"stop_after": 1, "missing_ranks": [1]}),
    "torn": ({}, {"torn_tail": [0]}),
    "shuffled": ({}, {"param_order": "shuffled", "diverge_at": 3}),
    "no_grads_no_loss": ({"grads": False, "loss": False}, {"grads": False, "loss": False}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_json_validates_and_console_renders(tmp_path, name):
    a_kw, b_kw = SCENARIOS[name]
    a = make_run(tmp_path / "a", world_size=2, steps=3, n_params=8, **a_kw)
    b = make_run(tmp_path / "b", world_size=2, steps=3, n_params=8, **b_kw)
    r = diff_runs(a, b)
    d = r.to_dict()
    validator().validate(d)
    out = tmp_path / "diff.json"
    r.write_json(out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(d))
    text = render(r)
    assert "\x1b[" not in text
    assert all(len(line) <= 100 for line in text.splitlines()[1:]), text  # [0]: the verdict
    first = text.splitlines()[0]
    word = {0: "HOLDS", 1: "FAILS", 3: "INCOMPLETE"}[r.exit_code("hash")]
    assert first.startswith(f"PARITY {word} under --fail-on hash (exit {r.exit_code('hash')})")


def test_json_fields(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", bucket_layout="graph", bucket_order="reversed-rs", diverge_at=2,
                 diverge_rank=1, diverge_param=F[1])
    d = diff_runs(a, b).to_dict()
    assert d["schema_version"] == 1 and d["verdict"] == "hash_mismatch"
    assert d["first_divergent_step"] == 2
    assert d["divergent"][0] == {
        "step": 2, "fqn": F[1], "kind": "grad", "ranks": [1],
        "buckets": {
            "all_gather": {"a": {"index": 0, "group": "layers.0", "position": 1, "offset": 128,
                                 "size": 192},
                           "b": {"index": 0, "group": "layers.0", "position": 1, "offset": 128,
                                 "size": 192}},
            "reduce_scatter": {"a": {"index": 1, "group": "layers.0", "position": 1,
                                     "offset": 128, "size": 192},
                               "b": {"index": 1, "group": "layers.0", "position": 2,
                                     "offset": 320, "size": 192}}}}
    o = d["order"]
    assert o["verdict"] == "order_differs"
    fb = o["first_bucket"]
    assert {k: fb[k] for k in ("collective", "index", "group", "position", "a", "b")} == {
        "collective": "reduce_scatter", "index": 0, "group": "layers.1", "position": 0,
        "a": {"fqn": F[4], "offset": 0}, "b": {"fqn": F[7], "offset": 0}}
    assert d["a"]["bucket_source"] == "fsdp2" and d["b"]["bucket_source"] == "graph"
    assert d["a"]["path"] == str(a) and d["b"]["path"] == str(b)
    assert d["loss"]["first_divergent_step"] == 3
    assert d["per_step"][0] == {"step": 2, "params": 1, "grads": 1, "ranks": 1, "exact": True}


def test_markup_in_names_prints_literally(tmp_path):
    a = make_run(tmp_path / "a", fqns=WEIRD)
    b = make_run(tmp_path / "b", fqns=WEIRD, bucket_layout="graph", bucket_order="reversed",
                 diverge_at=1, diverge_rank=0, diverge_param=[0, 1, 2, 3, 4])
    r = diff_runs(a, b)
    text = render(r)
    for name in WEIRD[:5]:
        assert name in text, name
    # also in colour, where markup would be interpreted
    coloured = render(r, force_terminal=True, width=100)
    assert "\x1b[" in coloured
    for name in ("a[b]", "[bold]x[/bold]", "emb[red].weight"):
        assert name in coloured


def test_warnings_and_incomplete_are_printed(tmp_path):
    a = make_run(tmp_path / "a", world_size=4)
    b = make_run(tmp_path / "b", world_size=4, missing_ranks=[2], torn_tail=[0, 1, 3])
    # words only: the console wraps the lines, and a long temporary path moves the breaks
    text = " ".join(render(diff_runs(a, b)).split())
    assert "INCOMPLETE" in text
    assert "incomplete: B is missing rank(s) 2" in text
    assert "last line truncated" in text


def test_long_lists_are_cut_in_the_console_not_in_json(tmp_path):
    a = make_run(tmp_path / "a", n_params=60)
    b = make_run(tmp_path / "b", n_params=60, diverge_at=1, diverge_rank="all",
                 diverge_param=list(range(60)), kind="param", bucket_layout="graph",
                 bucket_order="reversed")
    r = diff_runs(a, b)
    assert len(r.divergent) == 60
    text = render(r)
    assert "... and 40 more (--json has all)" in text
    assert "Buckets that differ (" in text


def test_long_bucket_side_by_side_is_windowed(tmp_path):
    a = make_run(tmp_path / "a", n_params=60, bucket_groups=60)
    b = make_run(tmp_path / "b", n_params=60, bucket_groups=60, bucket_layout="graph",
                 bucket_order=lambda c, i, n: n[:30] + n[30:][::-1])
    r = diff_runs(a, b)
    assert r.order.first_bucket["position"] == 30
    text = render(r)
    assert ">    30" in text and "...  " in text
    assert all(len(line) <= 100 for line in text.splitlines()[1:])  # [0]: the verdict line


def test_make_console_plain_width():
    c = make_console(file=io.StringIO())
    assert not c.is_terminal and c.width == 100
    assert make_console(file=io.StringIO(), width=120).width == 120


# --------------------------------------------------------------------- a property of the diff


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 5), n=st.integers(1, 12), steps=st.integers(1, 5), data=st.data())
def test_diff_finds_exactly_the_planted_divergence(tmp_path_factory, world, n, steps, data):
    at = data.draw(st.integers(0 if steps else 1, steps))
    kind = data.draw(st.sampled_from(["grad", "param"])) if at > 0 else "param"
    rank = data.draw(st.integers(0, world - 1))
    params = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    order = data.draw(st.sampled_from([None, "reversed", "shuffled"]))
    tmp = tmp_path_factory.mktemp("prop")
    a = make_run(tmp / "a", world, steps, n, seed=7)
    b = make_run(tmp / "b", world, steps, n, seed=7, param_order=order, diverge_at=at,
                 diverge_rank=rank, diverge_param=params, kind=kind, propagate=False)
    r = diff_runs(a, b)
    names = default_fqns(n)
    assert r.first_divergent_step == at
    assert sorted((d.fqn, d.kind, tuple(d.ranks)) for d in r.divergent) == sorted(
        (names[i], kind, (rank,)) for i in params)
    assert [c.step for c in r.per_step] == list(range(at, steps + 1))
    assert all((c.params, c.grads) == (0, 0) for c in r.per_step[1:])
    validator().validate(r.to_dict())
