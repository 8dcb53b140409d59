"""Issue 20's figure: what the reduction-order prediction (``parity diff --at``) adds to a diff.

A 256-rank x 25-step x 1,500-parameter pair (tests/synth.py): A eager FSDP2 manifests, B graph
manifests whose every reduce-scatter bucket is in reversed payload order (the worst case: every
parameter's layout differs and must be predicted). In one process, best of ``reps``:
the diff without a prediction, the diff with ``--at 32x8:channels=16`` (every bucket cut into
up to 16 channels whose rings differ), and the prediction alone on the same layouts.
Figures: ``reduction_predict_seconds`` (alone), ``reduction_overhead`` = 1 + predict / diff
(target < 1.10) and ``reduction_overhead_measured`` (the two diffs' ratio; noisier).
"""

from __future__ import annotations

import time
from pathlib import Path

TOPOLOGY = "32x8:channels=16"


def _best(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_reduction(quick: bool, tmp: Path) -> dict:
    from tests.synth import make_run

    from parity.artifacts import read_run
    from parity.diff import diff_runs
    from parity.diff.buckets import compare_buckets
    from parity.diff.reduction import predict, shapes_of

    ranks, steps, params = (64, 25, 1500) if quick else (256, 25, 1500)
    reps = 2 if quick else 3
    a = make_run(tmp / "a", world_size=ranks, steps=steps, n_params=params)
    b = make_run(tmp / "b", world_size=ranks, steps=steps, n_params=params,
                 bucket_layout="graph", bucket_order="reversed-rs")
    t_plain, _ = _best(lambda: diff_runs(a, b), reps)
    t_at, res = _best(lambda: diff_runs(a, b, at=TOPOLOGY), reps)
    ro = res.reduction_order
    run_a, run_b = read_run(a), read_run(b)
    usable = {"a": sorted(run_a.ranks), "b": sorted(run_b.ranks)}
    layouts, order = compare_buckets(run_a, run_b, usable, usable["a"])
    shapes = shapes_of(run_a.ranks[0].params)
    t_pred, pred = _best(lambda: predict(layouts, shapes, TOPOLOGY, ranks, order.eager), reps)
    if pred.verdict != "differs" or pred.params_checked != params:
        raise RuntimeError(f"prediction: {pred.verdict}, {pred.params_checked} parameters checked")
    return {
        "reduction_ranks": ranks, "reduction_params": params,
        "reduction_diff_seconds": t_plain, "reduction_diff_at_seconds": t_at,
        "reduction_predict_seconds": t_pred,
        "reduction_overhead": 1 + t_pred / t_plain,
        "reduction_overhead_measured": t_at / t_plain,
        "reduction_params_at_risk": len(ro.at_risk),
    }
