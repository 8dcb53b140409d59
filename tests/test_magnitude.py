"""Issue 34, "the size of a difference": the figures capture keeps next to each hash (fp64 sum,
sum of squares, max |x|), their records in hashes.bin, and what the diff derives from them.

Runs here are written by the real writer from real tensors hashed the way capture hashes them
(``digest_tensors(..., figures=True)``); the processes (a trainer under `parity exec`) are in
tests/test_diff_real.py and tests/test_labels_real.py.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from synth import make_run  # noqa: E402

from parity.artifacts import (FIGURE_BYTES, FIGURES_MAGIC, HASH_RECORD, RankWriter,  # noqa: E402
                              read_run, write_json_atomic)
from parity.capture.hashing import digest_tensors  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from parity.diff.magnitude import compare, ulp  # noqa: E402
from parity.report.console import make_console, print_diff  # noqa: E402

NAMES = ["emb.weight", "layers.0.w", "layers.0.norm", "out.weight"]
SHAPES = [(16, 8), (8, 8), (8,), (8, 16)]


def _model(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def write_run(out: Path, steps: list[list[torch.Tensor]], figures: bool = True,
              world: int = 1) -> Path:
    """A run whose step k holds ``steps[k]`` as parameters and gradients (the same tensors:
    enough for the sizes), on every rank."""
    out.mkdir(parents=True)
    for r in range(world):
        w = RankWriter(out, r, {"world_size": world, "capture": {"hasher": "xxh3",
                                                                  "warnings": []}})
        w.write_params([{"fqn": n, "shape": list(s), "dtype": "float32"}
                        for n, s in zip(NAMES, SHAPES)])
        for k, ts in enumerate(steps):
            d, f = digest_tensors(ts, "xxh3", figures=True)
            grads = None if k == 0 else (d, f)
            w.write_step(k, d, grads and grads[0], loss=None if k == 0 else 1.0,
                         param_figures=f if figures else None,
                         grad_figures=grads[1] if grads and figures else None)
        w.close()
    write_json_atomic(out / "run.json", {"v": 2, "status": "ok", "exit_code": 0, "error": None})
    return out


def _drift(steps: int, at: int, start_ulps: int) -> tuple[list, list]:
    """A reference and a candidate that differ from step ``at`` on in ``layers.0.w``, by
    ``start_ulps`` ulps of one element (of value 1), doubling every step."""
    a, b = [], []
    for k in range(steps + 1):
        ts = _model(0)
        ts[0] += k  # the steps differ from each other, not in the parameter that drifts
        ts[1].reshape(-1)[3] = 1.0
        a.append(ts)
        u = [t.clone() for t in ts]
        if k >= at:
            x = u[1].reshape(-1)
            for _ in range(start_ulps * 2 ** (k - at)):
                x[3] = torch.nextafter(x[3], torch.tensor(float("inf")))
        b.append(u)
    return a, b


# ------------------------------------------------------------------------------ the records


def test_figures_records_are_written_next_to_the_hashes_and_read_back(tmp_path):
    ts = _model()
    run = write_run(tmp_path / "r", [ts, ts])
    rd = read_run(run).ranks[0]
    line = rd.steps[1]
    assert {"param_figures_offset", "grad_figures_offset", "figures_digest"} <= set(line)
    # a figures record: the hash record's header with its own magic, then n x 24 bytes
    data = (run / "rank-00000" / "hashes.bin").read_bytes()
    magic, code, step, n = HASH_RECORD.unpack_from(data, line["grad_figures_offset"])
    assert (magic, code, step, n) == (FIGURES_MAGIC, 1, 1, len(NAMES))
    figs = rd.figures(1, "grad")
    for t, row in zip(ts, figs):
        v = t.double()
        assert np.allclose(row, [v.sum(), (v * v).sum(), v.abs().max()], rtol=1e-12)
    assert rd.figures(0, "grad") is None and rd.figures(0, "param").shape == (4, 3)
    assert FIGURE_BYTES == 24 and not rd.problems


def test_runs_without_figures_read_and_diff_as_before(tmp_path):
    """A run recorded before the figures (no keys, no records): the diff is the same, and says
    the sizes are not shown; a schema-1 run likewise."""
    a, b = _drift(3, 1, 1)
    ra, rb = write_run(tmp_path / "a", a, figures=False), write_run(tmp_path / "b", b, False)
    assert "param_figures_offset" not in read_run(ra).ranks[0].steps[1]
    r = diff_runs(ra, rb)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 1
    assert r.magnitude["recorded"] is False and r.magnitude["per_step"] == []
    buf = io.StringIO()
    print_diff(r, make_console(file=buf))
    assert "Size of the difference: not shown" in buf.getvalue()
    v1 = Path(__file__).parent / "data" / "v1"
    assert diff_runs(v1 / "a", v1 / "b").to_dict()["magnitude"]["recorded"] is False


def test_damaged_figures_are_said_and_never_change_the_verdict(tmp_path):
    a, b = _drift(2, 1, 1)
    ra, rb = write_run(tmp_path / "a", a), write_run(tmp_path / "b", b)
    before = diff_runs(ra, rb)
    path = rb / "rank-00000" / "hashes.bin"
    off = read_run(rb).ranks[0].steps[1]["param_figures_offset"]
    data = bytearray(path.read_bytes())
    data[off + HASH_RECORD.size + 5] ^= 0x40  # a flipped bit in a figure
    path.write_bytes(bytes(data))
    r = diff_runs(ra, rb)
    assert (r.verdict, r.first_divergent_step, r.exit_code()) == (
        before.verdict, before.first_divergent_step, before.exit_code())
    assert any("figures do not have the digest" in p.message for p in r.problems)
    assert r.magnitude["recorded"] is False  # damaged figures are not shown
    # a verdict of equal runs never reads the figures: a damaged record there is not even seen
    same = write_run(tmp_path / "c", a)
    assert diff_runs(ra, same).verdict == "match"


# --------------------------------------------------------------------------- the sizes


def test_a_one_ulp_difference_reads_as_one_ulp_and_drift_grows():
    """One element of a float32 tensor one ulp up reads as about one ulp (of that element's
    magnitude, in units of the typical element's ulp); a thousand-fold larger difference as a
    thousand-fold more. The relative difference is a lower bound on ||b - a|| / ||a||."""
    t = torch.randn(64, generator=torch.Generator().manual_seed(3))
    u = t.clone()
    u[5] = torch.nextafter(u[5], torch.tensor(float("inf")))
    d, f = digest_tensors([t, u], "xxh3", figures=True)
    fa, fb = np.frombuffer(f, "<f8").reshape(2, 3)
    one = compare(fa, fb, 64, "float32")
    true = float((u.double() - t.double()).norm())
    assert 0 < one["lower"] <= true * (1 + 1e-9)
    assert 0.05 < one["ulps"] < 8
    assert one["rel"] == pytest.approx(one["lower"] / math.sqrt(fa[1]))
    w = t.clone()
    w[5] += 1000 * (float(u[5]) - float(t[5]))
    big = compare(fa, np.frombuffer(digest_tensors([w], "xxh3", figures=True)[1], "<f8"),
                  64, "float32")
    assert big["ulps"] > 200 * one["ulps"]
    assert compare(fa, fa, 64, "float32")["rel"] == 0.0  # equal figures: 0, not a proof


def test_ulp_of_each_dtype():
    assert ulp(1.0, "float32") == 2.0 ** -23 and ulp(1.0, "bfloat16") == 2.0 ** -7
    assert ulp(3.0, "float16") == 2.0 ** -9 and ulp(0.5, "torch.float64") == 2.0 ** -53
    assert ulp(7.0, "int64") == 1.0


def test_the_diff_shows_the_size_per_parameter_and_how_it_grows(tmp_path):
    a, b = _drift(4, 2, 1)
    r = diff_runs(write_run(tmp_path / "a", a, world=2), write_run(tmp_path / "b", b, world=2))
    assert r.first_divergent_step == 2
    m = r.magnitude
    assert m["recorded"] and "not proofs" in m["note"]
    sizes = {(p["fqn"], p["kind"]): p for p in m["params"]}
    assert set(sizes) == {("layers.0.w", "grad"), ("layers.0.w", "param")}
    series = [s["ulps"] for s in sizes[("layers.0.w", "param")]["steps"]]
    assert [s["step"] for s in sizes[("layers.0.w", "param")]["steps"]] == [2, 3, 4]
    assert series[0] < series[1] < series[2]  # 1, 2, 4 ulps of one element: it grows
    assert [s["step"] for s in m["per_step"]] == [2, 3, 4]
    assert all(s["param"]["fqn"] == "layers.0.w" and s["param"]["differ"] == 1
               for s in m["per_step"])
    buf = io.StringIO()
    print_diff(r, make_console(file=buf, width=140))
    text = buf.getvalue()
    assert "rel >=" in text and "Size of the difference per step" in text
    assert "not proofs" in text
    d = json.loads(json.dumps(r.to_dict()))
    jsonschema = pytest.importorskip("jsonschema")
    from parity.diff import SCHEMA_PATH

    jsonschema.validate(d, json.loads(Path(SCHEMA_PATH).read_text()))
    from parity.report.html import render_diff_html

    page = render_diff_html(r)
    assert 'aria-label="size of the difference per step"' in page
    assert page.count('class="size-param"') == 2 and 'class="size-max"' in page


# ---------------------------------------------------------------- verdicts and loss rows


def test_runs_of_different_lengths_say_what_matched_then_what_is_missing(tmp_path):
    """A 4-step run against a longer run whose job stopped (rank 1 a step before rank 0)."""
    a = make_run(tmp_path / "a", steps=4)
    b = make_run(tmp_path / "b", steps=8, stop_after={0: 8, 1: 7}, status="running")
    line = diff_runs(a, b).judge().line()
    assert line.startswith("PARITY INCOMPLETE under --fail-on hash (exit 3): hashes bitwise "
                           "identical where both sides recorded: steps 0-4 (5 steps x 2 ranks")
    held, missing = line.split("; not compared: ", 1)
    assert "A lacks" in missing and "5-8" in missing
    assert "missing on both sides" not in line
    assert "step(s) 8 recorded by some ranks only" in missing


def test_a_loss_that_differs_on_another_rank_shows_that_rank(tmp_path):
    from parity.diff.result import LossStep

    s = LossStep(3, 2.5, 2.5, False, 1, a_ranks=[2.5, 1.25], b_ranks=[2.5, 1.2500001])
    assert s.shown([0, 1], 0) == (1, 1.25, 1.2500001)
    assert s.delta([0, 1], 0) == pytest.approx((1.2500001 - 1.25) / 1.25)
    same = LossStep(2, 2.5, 2.5, True, 0, a_ranks=[2.5, 1.0], b_ranks=[2.5, 1.0])
    assert same.shown([0, 1], 0) == (0, 2.5, 2.5) and same.delta([0, 1], 0) == 0
