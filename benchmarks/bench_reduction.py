"""Issue 20's figure: what the reduction-order prediction (``parity diff --at``) adds to a diff.

A 256-rank x 25-step x 1,500-parameter pair (tests/synth.py): A eager FSDP2 manifests, B graph
manifests whose every reduce-scatter bucket is in reversed payload order (the worst case: every
parameter's layout differs and must be predicted). In one process, best of ``reps``, wall and
CPU (process) time: the diff without a prediction, the diff with ``--at 32x8:channels=16``
(every bucket cut into up to 16 channels whose rings differ), and what ``--at`` adds on its own:
``reduction.assess`` with the topology on freshly read runs, i.e. decoding the parameter tables
for the shapes, the consequence classes (also done without ``--at``: counted anyway, so the
figure errs high) and the prediction.
Figures: ``reduction_predict_seconds`` / ``reduction_predict_cpu_seconds`` (alone),
``reduction_overhead`` = 1 + predict CPU / diff CPU (target < 1.10; CPU time because the machine
is shared), ``reduction_overhead_wall`` the same with wall times, and
``reduction_overhead_measured`` (the two diffs' wall ratio; noisiest).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

TOPOLOGY = "32x8:channels=16"


def _best(fn, reps: int, setup=None) -> tuple[float, float, object]:
    """(best wall, best CPU, last result) of ``reps`` calls of ``fn(*setup())`` (setup untimed).
    Every call starts from a collected heap (``gc.collect()``, untimed): the synthetic runs
    leave a large heap, and a full collection landing inside one timed call or another is noise
    of the size of the prediction itself."""
    wall = cpu = float("inf")
    out = None
    for _ in range(reps):
        args = setup() if setup is not None else ()
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        cpu = min(cpu, time.process_time() - c0)
        wall = min(wall, time.perf_counter() - t0)
    return wall, cpu, out


def bench_reduction(quick: bool, tmp: Path) -> dict:
    from tests.synth import make_run

    from parity.artifacts import read_run
    from parity.diff import diff_runs
    from parity.diff.buckets import compare_buckets
    from parity.diff.reduction import assess

    ranks, steps, params = (64, 25, 1500) if quick else (256, 25, 1500)
    reps = 2 if quick else 3
    a = make_run(tmp / "a", world_size=ranks, steps=steps, n_params=params)
    b = make_run(tmp / "b", world_size=ranks, steps=steps, n_params=params,
                 bucket_layout="graph", bucket_order="reversed-rs")
    t_plain, c_plain, _ = _best(lambda: diff_runs(a, b), reps)
    t_at, c_at, res = _best(lambda: diff_runs(a, b, at=TOPOLOGY), reps)
    ro = res.reduction_order

    def fresh():  # runs as the diff has them when it predicts: tables not decoded yet
        run_a, run_b = read_run(a), read_run(b)
        usable = {"a": sorted(run_a.ranks), "b": sorted(run_b.ranks)}
        layouts, order = compare_buckets(run_a, run_b, usable, usable["a"])
        return run_a, run_b, usable["a"], layouts, order

    t_pred, c_pred, pred = _best(
        lambda ra, rb, rk, lay, order: assess(ra, rb, rk, lay, order, ranks, TOPOLOGY),
        reps, fresh)
    if pred.verdict != "differs" or pred.params_checked != params:
        raise RuntimeError(f"prediction: {pred.verdict}, {pred.params_checked} parameters checked")
    return {
        "reduction_ranks": ranks, "reduction_params": params,
        "reduction_diff_seconds": t_plain, "reduction_diff_cpu_seconds": c_plain,
        "reduction_diff_at_seconds": t_at, "reduction_diff_at_cpu_seconds": c_at,
        "reduction_predict_seconds": t_pred, "reduction_predict_cpu_seconds": c_pred,
        "reduction_overhead": 1 + c_pred / c_plain,
        "reduction_overhead_wall": 1 + t_pred / t_plain,
        "reduction_overhead_measured": t_at / t_plain,
        "reduction_params_at_risk": len(ro.at_risk),
    }
