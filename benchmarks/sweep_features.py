"""Benchmarks of the sweep's cluster-scale features (issue 23), run by benchmarks/run.py:

  control_cost                 wall time of a 1-cell sweep with the determinism control / the same
                               sweep without it (one more job: ~1.5 with --jobs 1)
  early_stop_saving            1 - wall time of a 1-cell sweep whose candidate diverges at step 2
                               with stop_after_divergence = 2 / the same sweep run to the end
                               (both sides at once, --jobs 2; slow steps stand for GPU steps)

Both sweeps run tests/trainers/noisy.py (FSDP2 on 2 CPU ranks under parity exec); each figure is
a ratio of two sweeps measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "trainers" / "noisy.py"


def _spec(steps: int, sleep: float, extra: str = "", perturb: str = "") -> str:
    pert = f', "--perturb", "{perturb}"' if perturb else ""
    return f'''
name = "bench"
steps = {steps}
nproc_per_node = 2
timeout = 600
{extra}
[env]
OMP_NUM_THREADS = "1"

[reference]
argv = ["{TRAINER}", "--steps", "{{steps}}", "--sleep", "{sleep}"]

[candidate]
argv = ["{TRAINER}", "--steps", "{{steps}}", "--sleep", "{sleep}"{pert}]
'''


def _sweep(tmp: Path, name: str, text: str, *args: str) -> tuple[float, dict]:
    spec = tmp / f"{name}.toml"
    spec.write_text(text)
    out = tmp / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "parity", "sweep", str(spec), "--out", str(out),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    wall = time.perf_counter() - t0
    try:
        sweep = json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError):
        raise RuntimeError(f"{name}: no sweep.json (exit {proc.returncode}): "
                           f"{proc.stderr[-500:]}") from None
    return wall, sweep


def bench_control(quick: bool, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    steps = 2 if quick else 10
    base, _ = _sweep(tmp, "no-control", _spec(steps, 0.0))
    ctl, sweep = _sweep(tmp, "control", _spec(steps, 0.0, "control = true"))
    (cell,) = sweep["cells"]
    if (cell.get("control") or {}).get("verdict") != "deterministic":
        raise RuntimeError(f"control sweep: {cell.get('status')}: {cell.get('reason')}")
    return {"control_wall_seconds": ctl, "no_control_wall_seconds": base,
            "control_cost": ctl / base}


def bench_early_stop(quick: bool, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    steps, sleep = (12, 0.3) if quick else (60, 1.0)  # seconds per step, as on a GPU
    full, _ = _sweep(tmp, "full", _spec(steps, sleep, perturb="0:2"), "--jobs", "2")
    stop, sweep = _sweep(tmp, "stop", _spec(steps, sleep, "stop_after_divergence = 2",
                                            perturb="0:2"), "--jobs", "2")
    (cell,) = sweep["cells"]
    if cell.get("status") != "hash_mismatch" or not cell.get("early_stop"):
        raise RuntimeError(f"early stop sweep: {cell.get('status')}: {cell.get('reason')}")
    return {"early_stop_wall_seconds": stop, "no_early_stop_wall_seconds": full,
            "early_stop_saving": 1 - stop / full,
            "early_stop_steps_recorded": cell["sides"]["candidate"].get("steps_recorded"),
            "early_stop_steps_of": steps}
