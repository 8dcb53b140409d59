"""The bucketing summary (parity/diff/bucket_summary.py) on the built-in workload's real compiled graphs.

Reuses the session-cached compiled jobs of tests/workload_harness.py (the same jobs
tests/test_graph_manifest.py and tests/test_workload.py run), so it adds no job of its own when
the suite runs together: ``--bucketing manual`` (one bucket per transformer block plus the
root's) and ``--bucketing auto`` (everything in one bucket on this small model).
"""

import pytest

from parity.diff.bucket_summary import headline, summarize
from workload_harness import COMPILED_REGISTRATION, COMPILED_SWAPPED, run_job

pytest.importorskip("torch")

N_PARAMS = 21  # 2 blocks x 9 + tok_embeddings, norm, output


def _summary(args):
    result = run_job(args, manifests=True)
    result.check_ok()
    buckets = [b for g in result.graphs(0) for b in g["buckets"]]
    return summarize(buckets), buckets


def _rows(summary):
    return {(r["graph"], r["collective"]): r for r in summary["graphs"]}


def test_manual_bucketing_one_bucket_per_block_and_the_root():
    s, buckets = _summary(COMPILED_REGISTRATION)
    rows = _rows(s)
    assert set(rows) == {("forward", "all_gather"), ("backward", "reduce_scatter")}
    for row in rows.values():
        assert (row["count_before"], row["count_after"], row["buckets"]) == (N_PARAMS, 3, 3)
        assert row["bytes"]["min"] < row["bytes"]["max"]  # the root's bucket is the small one
        assert len(row["spans"]) == 3 and all(isinstance(x, int) and x > 0 for x in row["spans"])
    rs = rows[("backward", "reduce_scatter")]
    # two gaps between three reduce-scatters, each holding the backward of a block's compute
    assert len(rs["compute_between_rs"]) == 2 and rs["max_consec_compute_between_rs"] > 0
    assert headline(s) == f"AG {N_PARAMS}->3 RS {N_PARAMS}->3"
    # module attribution: every payload issued under its own module; a block's bucket under
    # the block (the innermost module holding all its payloads), the root's under the root
    after = [b for b in buckets if b.get("stage") != "before_passes"]
    for b in after:
        for e in b["entries"]:
            assert e["module"] == e["fqn"].rsplit(".", 1)[0], (b["node"], e)
    assert sorted(b["module"] for b in after if b["collective"] == "all_gather") == [
        "", "layers.0", "layers.1"]
    assert s["attribution"] == []


def test_auto_bucketing_one_bucket_spanning_the_graph():
    s, _ = _summary(COMPILED_SWAPPED)
    rows = _rows(s)
    manual = _rows(_summary(COMPILED_REGISTRATION)[0])
    for key, row in rows.items():
        assert (row["count_before"], row["count_after"]) == (N_PARAMS, 1)
        # one bucket holds every payload: it spans at least as far as any manual bucket
        assert row["max_span"] >= manual[key]["max_span"]
    rs = rows[("backward", "reduce_scatter")]
    assert rs["compute_between_rs"] == [] and rs["max_compute_between_rs"] is None
    # AutoParallel's figure is defined with one reduce-scatter (the longest compute run)
    assert isinstance(rs["max_consec_compute_between_rs"], int)
    assert headline(s) == f"AG {N_PARAMS}->1 RS {N_PARAMS}->1"
