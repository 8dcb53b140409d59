"""The bucketing summary (parity/diff/bucket_summary.py) on synthetic records, and `parity inspect`.

The real-workload checks (``--bucketing manual`` and ``auto`` on the built-in trainer) are in
tests/test_bucket_summary_real.py."""

import json

import pytest

from click.testing import CliRunner

from parity.diff.bucket_summary import headline, issued_elsewhere, summarize
from parity.cli import cli
from synth import make_run


def _entry(fqn, size=64, module=None):
    return {"fqn": fqn, "offset": 0, "size": size, "numel": size // 4, "dtype": "float32",
            "shape": [size // 4], "module": module}


def _graph_bucket(collective, index, fqns, position, compute_before, *, stage=None, graph="forward",
                  module=None, modules=None):
    b = {"source": "graph", "collective": collective, "graph": graph, "graph_id": 0, "step": 1,
         "index": index, "node": f"n{position}", "group": "", "dtype": "float32", "world_size": 2,
         "total_bytes": 64 * len(fqns), "position": position, "compute_before": compute_before,
         "module": module,
         "entries": [_entry(f, module=(modules or {}).get(f)) for f in fqns]}
    if stage:
        b["stage"] = stage
    return b


def test_counts_spans_and_compute_between_reduce_scatters():
    names = [f"layers.{i}.w" for i in range(4)]
    before = [_graph_bucket("all_gather", i, [n], 10 * i, 3 * i, stage="before_passes")
              for i, n in enumerate(names)]
    before += [_graph_bucket("reduce_scatter", i, [n], 100 + 10 * i, 50 + 3 * i,
                             stage="before_passes", graph="backward")
               for i, n in enumerate(reversed(names))]
    after = [_graph_bucket("all_gather", 0, names[:3], 1, 0),          # members at 0, 10, 20
             _graph_bucket("all_gather", 1, names[3:], 5, 2)]
    after += [_graph_bucket("reduce_scatter", 0, names[2:], 40, 10, graph="backward"),
              _graph_bucket("reduce_scatter", 1, names[:2], 90, 17, graph="backward")]
    for b in after[2:]:  # AutoParallel's figures, as capture records them (issue 31)
        b["max_consec_compute_between_rs"] = 5
        b["spans_at_bucketing"] = {"passes": "bucket_fsdp_reduce_scatter", "spans": [12, 4]}
    activation = _graph_bucket("reduce_scatter", 2, [], 95, 18, graph="backward")
    activation["entries"] = [dict(_entry("x"), fqn=None, payload="activation")]
    s = summarize(before + after + [activation])
    rows = {(r["graph"], r["collective"]): r for r in s["graphs"]}
    ag = rows[("forward", "all_gather")]
    assert (ag["count_before"], ag["count_after"], ag["buckets"]) == (4, 2, 2)
    assert ag["spans"] == [20, 0] and ag["max_span"] == 20
    assert ag["bytes"] == {"min": 64, "median": 128.0, "max": 192}
    assert ag["max_consec_compute_between_rs"] is None and ag["spans_at_bucketing"] is None
    assert ag["payloads"] == {"parameter": 2}
    rs = rows[("backward", "reduce_scatter")]
    # parity's own: pre-pass order layers.3 at 100, layers.2 at 110, layers.1 at 120, layers.0
    # at 130; compute ops between reduce-scatters
    assert rs["spans"][:2] == [10, 10]
    assert rs["compute_between_rs"] == [7, 1] and rs["max_compute_between_rs"] == 7
    # AutoParallel's, as recorded
    assert rs["max_consec_compute_between_rs"] == 5
    assert rs["spans_at_bucketing"] == [12, 4] and rs["max_span_at_bucketing"] == 12
    assert rs["payloads"] == {"parameter": 2, "activation": 1}
    assert headline(s) == "AG 4->2 RS 4->3"


def test_without_a_pre_pass_graph_the_spans_are_unknown():
    s = summarize([_graph_bucket("all_gather", 0, ["a.w", "b.w"], 3, 0)])
    (row,) = s["graphs"]
    assert row["count_before"] is None and row["spans"] is None and row["max_span"] is None
    assert headline(s) == "AG 1"


def test_eager_fsdp2_counts_the_groups_as_issued():
    fsdp2 = [{"source": "fsdp2", "collective": "all_gather", "graph": None, "graph_id": None,
              "step": 1, "index": i, "group": f"layers.{i}", "dtype": "float32", "world_size": 2,
              "total_bytes": 128, "entries": [_entry(f"layers.{i}.a"), _entry(f"layers.{i}.b")]}
             for i in range(3)]
    changed = dict(fsdp2[0], step=2, entries=fsdp2[0]["entries"][:1], total_bytes=64)
    s = summarize(fsdp2 + [changed])
    (row,) = s["graphs"]
    assert (row["count_before"], row["count_after"]) == (5, 3)  # the later layout of index 0
    assert row["bytes"]["min"] == 64 and row["spans"] is None
    assert s["attribution"] == []  # every parameter issued under its own group
    # a group of several modules (fully_shard([norm, lm_head])) holds each of them
    root = dict(fsdp2[0], group="norm, lm_head", entries=[_entry("norm.weight"),
                                                          _entry("lm_head.weight")])
    assert issued_elsewhere([root]) == []
    assert [a["fqn"] for a in issued_elsewhere([dict(root, group="norm")])] == ["lm_head.weight"]


def test_attribution_names_payloads_issued_outside_their_owner():
    after = [_graph_bucket("all_gather", 0, ["layers.0.wq.weight", "lm_head.weight"], 1, 0,
                           modules={"layers.0.wq.weight": "layers.0.wq", "lm_head.weight": "loss"})]
    dtensor = [{"source": "dtensor", "collective": "all_gather", "graph": None, "graph_id": None,
                "step": 1, "index": 0, "group": "", "dtype": "bfloat16", "world_size": 2,
                "total_bytes": 64, "module": "loss_fn(ChunkedLossWrapper) > lm_head",
                "entries": [_entry("lm_head.weight")]},
               {"source": "dtensor", "collective": "all_gather", "graph": None, "graph_id": None,
                "step": 1, "index": 1, "group": "", "dtype": "bfloat16", "world_size": 2,
                "total_bytes": 64, "module": "Transformer > layers.0 > layers.0.wq",
                "entries": [_entry("layers.0.wq.weight")]}]
    found = issued_elsewhere(after + dtensor)
    assert [(a["fqn"], a["module"], a["source"]) for a in found] == [
        ("lm_head.weight", "loss", "graph"),
        ("lm_head.weight", "loss_fn(ChunkedLossWrapper) > lm_head", "dtensor")]
    assert found[0]["owner"] == "lm_head"


def test_inspect_prints_the_summary_and_writes_json(tmp_path):
    run = make_run(tmp_path / "run", world_size=2, steps=2, n_params=8, bucket_layout="fsdp2")
    out = tmp_path / "s.json"
    res = CliRunner().invoke(cli, ["inspect", str(run), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "Bucketing (rank 0): AG 8->2 RS 8->2" in res.output and "eager FSDP2" in res.output
    data = json.loads(out.read_text())
    assert {r["collective"] for r in data["graphs"]} == {"all_gather", "reduce_scatter"}


def test_inspect_of_a_foreign_directory_is_exit_2(tmp_path, capsys):
    from parity import cli as cli_module

    with pytest.raises(SystemExit) as e:
        cli_module.main(["inspect", str(tmp_path)])
    assert e.value.code == 2
    assert "not a parity run directory" in capsys.readouterr().err


def test_diff_shows_both_sides_side_by_side(tmp_path):
    import io

    from parity.diff import diff_runs
    from parity.report.console import make_console, print_diff

    a = make_run(tmp_path / "a", world_size=2, steps=2, n_params=8, bucket_layout="fsdp2")
    b = make_run(tmp_path / "b", world_size=2, steps=2, n_params=8, bucket_layout="graph")
    r = diff_runs(a, b)
    d = r.to_dict()
    assert d["bucketing"]["a"]["headline"] == "AG 8->2 RS 8->2"
    assert d["bucketing"]["b"]["headline"] == "AG 2 RS 2"
    buf = io.StringIO()
    print_diff(r, make_console(file=buf))
    text = buf.getvalue()
    assert "Bucketing: A AG 8->2 RS 8->2 | B AG 2 RS 2" in text
    # eager FSDP2's all-gathers face the compiled forward graph's, on one line per figure
    line = next(x for x in text.splitlines() if "AG (forward)" in x)
    assert "eager FSDP2" in line and "forward #0" in line
    assert all(len(x) <= 100 for x in text.splitlines()[1:])


def _sweep_with_bucketing(tmp_path):
    def summary(ag, rs, before=None):
        rows = [{"source": "graph", "graph": g, "graph_id": 0, "collective": c, "count_before": before,
                 "count_after": n, "buckets": n, "bytes": None, "spans": None, "max_span": None,
                 "compute_between_rs": None, "max_consec_compute_between_rs": None}
                for g, c, n in (("forward", "all_gather", ag), ("backward", "reduce_scatter", rs))]
        return {"graphs": rows, "attribution": []}

    cell = {"id": "c0", "axes": {"bucketing": "auto"}, "status": "match", "reason": "bitwise identical",
            "diff": {"verdict": "match", "bucketing": {"a": summary(3, 3, 21), "b": summary(1, 1, 21)}},
            "sides": {}, "started": 1.0, "ended": 2.0}
    sweep = {"v": 1, "kind": "parity-sweep", "name": "b", "complete": True,
             "axes": [{"name": "bucketing", "values": ["auto"]}], "sides": {},
             "counts": {"match": 1}, "cells": [cell]}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    return sweep


def test_sweep_reports_show_the_bucketing_headline_per_cell(tmp_path):
    import io

    from parity.diff.bucket_summary import cell_headline
    from parity.report.formats import print_sweep_console, sweep_markdown
    from parity.report.html import render_sweep_html

    sweep = _sweep_with_bucketing(tmp_path)
    want = "AG 21->3 RS 21->3 vs AG 21->1 RS 21->1"
    assert cell_headline(sweep["cells"][0]["diff"]) == want
    assert cell_headline({"verdict": "match"}) == ""  # a diff written before issue 14
    buf = io.StringIO()
    print_sweep_console(sweep, file=buf, color=False)
    assert "AG 21->3 RS 21->3 vs" in buf.getvalue()
    assert f"`{want}`" in sweep_markdown(sweep)
    assert want.replace(">", "&gt;") in render_sweep_html(sweep)


def test_attribution_takes_a_merged_payloads_module_from_the_pre_pass_graph():
    """A merged bucket's nodes carry one member's annotation (torchtitan's make_fx graphs): the
    pre-pass collective of each payload says where it was issued."""
    before = [_graph_bucket("all_gather", i, [f], i, 0, stage="before_passes",
                            modules={f: f.rsplit(".", 1)[0]})
              for i, f in enumerate(["layers.0.wq.weight", "layers.0.wo.weight"])]
    after = [_graph_bucket("all_gather", 0, ["layers.0.wq.weight", "layers.0.wo.weight"], 5, 0,
                           modules={"layers.0.wq.weight": "layers.0.wq",
                                    "layers.0.wo.weight": "layers.0.wq"})]
    assert issued_elsewhere(after) != []  # the copied annotation alone would blame wo
    assert issued_elsewhere(before + after) == []


def test_moved_names_payloads_carried_by_an_unrelated_modules_bucket():
    from parity.diff.bucket_summary import moved_between

    def fsdp2(index, group, fqns):
        return {"source": "fsdp2", "collective": "all_gather", "graph": None, "graph_id": None,
                "step": 1, "index": index, "group": group, "dtype": "float32", "world_size": 2,
                "total_bytes": 64 * len(fqns), "entries": [_entry(f) for f in fqns]}

    eager = summarize([fsdp2(0, "norm, lm_head", ["norm.weight", "lm_head.weight"]),
                       fsdp2(1, "layers.0", ["layers.0.wq.weight", "layers.0.wo.weight"])])
    # B: the blocks merged into the root's bucket (not a move), lm_head gathered under the loss
    merged = _graph_bucket("all_gather", 0, ["norm.weight", "layers.0.wq.weight",
                                             "layers.0.wo.weight"], 1, 0,
                           modules={"norm.weight": "norm", "layers.0.wq.weight": "layers.0.wq",
                                    "layers.0.wo.weight": "layers.0.wo"})
    chunked = {"source": "dtensor", "collective": "all_gather", "graph": None, "graph_id": None,
               "step": 1, "index": 0, "group": "", "dtype": "bfloat16", "world_size": 2,
               "total_bytes": 64, "module": "loss_fn(ChunkedLossWrapper) > lm_head",
               "entries": [_entry("lm_head.weight")]}
    compiled = summarize([merged, chunked])
    assert compiled["homes"]["all_gather"]["layers.0.wq.weight"] == ""
    assert moved_between(eager, compiled) == [
        {"collective": "all_gather", "a_module": "", "b_module": "loss_fn(ChunkedLossWrapper) > lm_head",
         "fqns": ["lm_head.weight"]}]
    # a block's payload in a sibling block's bucket is a move
    sibling = summarize([_graph_bucket("all_gather", 0, ["layers.0.wq.weight"], 1, 0,
                                       modules={"layers.0.wq.weight": "layers.1.wq"})])
    assert [(m["a_module"], m["b_module"]) for m in moved_between(eager, sibling)] == [
        ("layers.0", "layers.1.wq")]


def test_inspect_labels_autoparallels_figures_and_parity_own():
    """The console shows what the buckets carry, then AutoParallel's figures beside parity's
    own, each labelled, within 100 columns; the side-by-side table the same."""
    import io

    from parity.report.bucket_summary import print_summary, print_summary_pair
    from parity.report.console import make_console

    names = [f"layers.{i}.w" for i in range(2)]
    rs = [_graph_bucket("reduce_scatter", i, [n], 10 * i, 3 * i, graph="backward")
          for i, n in enumerate(names)]
    for b in rs:
        b["max_consec_compute_between_rs"] = 2
        b["spans_at_bucketing"] = {"passes": "bucket_fsdp_reduce_scatter", "spans": [441]}
    token = _graph_bucket("all_gather", 0, [], 0, 0)
    token["entries"] = [dict(_entry("t"), fqn=None, dtype="int64", payload="token")]
    s = summarize(rs + [token])
    buf = io.StringIO()
    print_summary(s, make_console(file=buf))
    text = buf.getvalue()
    assert "1 token" in text and "2 param" in text
    for label in ("(AutoParallel)", "(parity)", "max span at", "max compute", "max ops btw RS"):
        assert label in text, label
    row = next(x for x in text.splitlines() if x.strip().startswith("backward") and "RS" in x
               and "441" in x)
    assert row.split()[-4:] == ["441", "-", "2", "3"]  # AP span, pre-pass span, AP, parity ops
    assert all(len(x) <= 100 for x in text.splitlines())
    buf = io.StringIO()
    print_summary_pair(s, s, make_console(file=buf))
    text = buf.getvalue()
    assert "max span at bucketing (AutoParallel)" in text and "max ops btw RS (parity)" in text
    assert all(len(x) <= 100 for x in text.splitlines())


def test_console_marks_fsdp2_backward_regathers_as_harmless():
    """Issue 34: the console's side-by-side table marks eager FSDP2's backward all-gather counts
    "~" (copies, values unchanged), never "*" (a difference)."""
    import io

    from parity.report.bucket_summary import print_summary_pair
    from parity.report.console import make_console

    def row(coll, graph, source, before, after):
        return {"source": source, "graph": graph, "graph_id": None if source == "fsdp2" else 0,
                "collective": coll, "count_before": before, "count_after": after, "buckets": after,
                "bytes": {"min": 100, "median": 100, "max": 100}, "sizes": [100] * after,
                "spans": None, "max_span": None, "max_consec_compute_between_rs": None,
                "around_bucketing": None}

    a = {"graphs": [row("all_gather", "backward", "fsdp2", 18, 2),
                    row("reduce_scatter", "backward", "fsdp2", 21, 3)], "attribution": []}
    b = {"graphs": [row("reduce_scatter", "backward", "graph", 21, 1)], "attribution": []}
    buf = io.StringIO()
    print_summary_pair(a, b, make_console(file=buf, width=120))
    lines = buf.getvalue().splitlines()
    ag = next(i for i, x in enumerate(lines) if "AG (backward)" in x)
    count = next(x for x in lines[ag:] if "count before" in x)
    assert count.rstrip().endswith("~") and "*" not in count
    rs = next(i for i, x in enumerate(lines) if "RS (backward)" in x)
    assert next(x for x in lines[rs:] if "count before" in x).rstrip().endswith("*")
    assert "values unchanged" in buf.getvalue()
