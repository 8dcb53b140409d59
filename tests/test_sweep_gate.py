"""`parity gate`: exit codes over sweep reports (synthetic sweep.json files; no jobs run).

The cells' diff results are written by hand for each case, on top of a real diff result's JSON,
and each is checked against parity/schemas/diff.schema.json: a hand-written dict the real diff
engine could never produce would test nothing.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, ParityError  # noqa: E402
from parity.sweep.gate import evaluate, gate  # noqa: E402
from parity.policy import cell_status as classify  # noqa: E402
from parity.policy import status as pair_status  # noqa: E402

PARITY = [sys.executable, "-m", "parity"]
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "parity" / "schemas"
                     / "diff.schema.json").read_text())
_BASE: list[dict] = []


def _base() -> dict:
    """A real diff result's JSON (two identical synthetic runs), made once."""
    if not _BASE:
        import tempfile

        from parity.diff import diff_runs
        from tests.synth import make_run

        with tempfile.TemporaryDirectory() as t:
            a = make_run(Path(t) / "a", world_size=2, steps=3, n_params=2)
            b = make_run(Path(t) / "b", world_size=2, steps=3, n_params=2)
            _BASE.append(diff_runs(a, b).to_dict())
    return copy.deepcopy(_BASE[0])


def diff(verdict="match", order="identical", step=None, divergent=(), incomplete=()):
    d = _base()
    d.update(verdict=verdict, status=pair_status(verdict, order), first_divergent_step=step,
             incomplete=list(incomplete), problems=[],
             divergent=[{"step": step, "fqn": f, "kind": "param", "ranks": [0], "buckets": {
                 c: {"a": None, "b": None} for c in ("all_gather", "reduce_scatter")}}
                 for f in divergent])
    if verdict != "hash_mismatch":
        d["first_divergence"] = None
    d["order"].update(verdict=order, notes=[], first_bucket=None if order in (
        "identical", "unavailable") else {
            "collective": "reduce_scatter", "verdict": order, "index": 0, "b_index": 0,
            "group": "layers.0", "b_group": "layers.0", "position": 1, "a": None, "b": None,
            "detail": "w2 before w1", "rows": []})
    jsonschema.Draft202012Validator(SCHEMA).validate(d)
    return d


def cell(cid, status, d=None, reason=""):
    return {"id": cid, "axes": {"k": cid}, "status": status, "reason": reason, "diff": d,
            "sides": {}, "started": 1.0, "ended": 2.0, "wall": 1.0}


def sweep(*cells_, complete=True):
    return {"v": 1, "kind": "parity-sweep", "name": "g", "complete": complete,
            "axes": [{"name": "k", "values": [c["id"] for c in cells_]}], "cells": list(cells_),
            "counts": {}}


MATCH = cell("m", "match", diff())
ORDER = cell("o", "order_mismatch", diff(order="order_differs"))
HASH = cell("h", "hash_mismatch", diff("hash_mismatch", step=2, divergent=["w"]))
UNAVAIL = cell("u", "match", diff(order="unavailable"))
FAILED = cell("f", "failed", None, "reference: exit code 1")
SKIPPED = cell("s", "skipped", None, "requires cuda: no CUDA device here")


@pytest.mark.parametrize("cells_,policy,code", [
    ([MATCH], "hash", EXIT_OK),
    ([MATCH, SKIPPED], "any", EXIT_OK),  # skipped cells never fail the gate
    ([MATCH, ORDER], "hash", EXIT_OK),  # a consistent reorder is not a hash mismatch
    ([MATCH, ORDER], "order-only", EXIT_MISMATCH),
    ([MATCH, ORDER], "any", EXIT_MISMATCH),
    ([MATCH, HASH], "hash", EXIT_MISMATCH),
    ([MATCH, HASH], "order-only", EXIT_OK),
    ([MATCH, FAILED], "hash", EXIT_INCOMPLETE),
    ([HASH, FAILED], "hash", EXIT_MISMATCH),  # a proven mismatch outranks missing data
    ([SKIPPED], "hash", EXIT_INCOMPLETE),  # nothing compared proves nothing
    ([UNAVAIL], "hash", EXIT_OK),
    ([UNAVAIL], "order-only", EXIT_INCOMPLETE),  # bucket order not comparable: unproven
    ([UNAVAIL, ORDER], "any", EXIT_MISMATCH),
])
def test_exit_codes(cells_, policy, code):
    got, lines = evaluate(sweep(*cells_), policy)
    assert got == code, lines
    word = {EXIT_OK: "HOLDS", EXIT_MISMATCH: "FAILS", EXIT_INCOMPLETE: "INCOMPLETE"}[code]
    assert lines[-1].startswith(f"PARITY {word} under --fail-on {policy} (exit {code})"), lines


def test_unfinished_sweep_is_incomplete():
    assert evaluate(sweep(MATCH, complete=False), "hash")[0] == EXIT_INCOMPLETE


def test_skipped_cells_are_listed(tmp_path, capsys):
    (tmp_path / "sweep.json").write_text(json.dumps(sweep(MATCH, SKIPPED)))
    code, lines = gate(tmp_path, "hash")
    assert code == EXIT_OK
    out = "\n".join(lines)
    assert "skipped   s: requires cuda" in out and "PARITY HOLDS" in out


@pytest.mark.parametrize("content,needle", [
    (None, "no such sweep directory"),
    ("", "no sweep.json"),
    ("{not json", "unreadable sweep report"),
    ('{"kind": "other"}', "not a parity sweep report"),
    ('{"kind": "parity-sweep", "v": 99, "cells": []}', "version 99"),
    ('{"kind": "parity-sweep", "v": 1, "cells": [{"id": "x", "status": "weird"}]}', "malformed"),
])
def test_bad_input_is_exit_2(tmp_path, content, needle):
    d = tmp_path / "sw"
    if content is not None:
        d.mkdir()
        if content:
            (d / "sweep.json").write_text(content)
    with pytest.raises(ParityError, match=needle) as e:
        gate(d)
    assert e.value.exit_code == EXIT_USAGE


def test_cli_gate_exit_codes(tmp_path):
    for name, cs, code in [("ok", [MATCH], 0), ("bad", [HASH], 1), ("broken", [FAILED], 3)]:
        d = tmp_path / name
        d.mkdir()
        (d / "sweep.json").write_text(json.dumps(sweep(*cs)))
        r = subprocess.run(PARITY + ["gate", str(d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == code, r.stderr
    r = subprocess.run(PARITY + ["gate", str(tmp_path / "nothing")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == EXIT_USAGE and r.stderr.startswith("parity: error:")


def test_classify_diff_results():
    assert classify(diff()) == ("match", "bitwise identical")
    status, reason = classify(diff("hash_mismatch", step=3, divergent=["a.w", "b.w"]))
    assert status == "hash_mismatch" and reason == "first divergent step 3: a.w, b.w"
    status, reason = classify(diff(order="partition_differs"))
    assert status == "order_mismatch" and "partition_differs in reduce_scatter bucket 0" in reason
    assert "w2 before w1" in reason
    status, reason = classify(diff("incomplete", incomplete=["b: rank 1 missing"]))
    assert status == "failed" and "incomplete data: b: rank 1 missing" in reason
    assert classify(diff(order="unavailable"))[0] == "match"


def test_gate_names_tolerated_order_mismatches():
    code, lines = evaluate(sweep(MATCH, ORDER), "hash")
    assert code == EXIT_OK
    assert any(line.startswith("tolerated o: order_mismatch") for line in lines)
    assert "tolerated: 1 order_mismatch (o)" in lines[-1]


def test_gate_defaults_to_the_sweeps_policy():
    sw = dict(sweep(MATCH, ORDER), fail_on="any")
    assert evaluate(sw)[0] == EXIT_MISMATCH
    assert evaluate(sw, "hash")[0] == EXIT_OK


def test_order_policy_name_is_refused_with_its_new_name():
    with pytest.raises(ParityError, match="order-only") as e:
        evaluate(sweep(MATCH), "order")
    assert e.value.exit_code == EXIT_USAGE
