"""The host side of capture's device digest path, on CPU: the benchmark's host-time loop
(benchmarks/run.py ``_cuda_host_time``: 1,500 parameters of 1-64 KB and their 1,500 gradients,
the parameters at the step's entry with a row in a hundred left out, gradients and parameters
with figures, the previous step read back) with the device work stubbed out: in place of the
replayed launches, the pinned copy and its event, each call gets a ready result. What is left
is what runs on the host whatever the GPU: the lookups, the check of the cached tables, the
result objects and reading back. Timed with the compiled check (host_native) and with the
Python loop (PARITY_HOST_NATIVE=0) in the same run.

    python benchmarks/host_path_cpu.py [--steps N] [--json]

A proxy, not the GPU figure: on a GPU add the replay, copy and event (~30 us a call on an H100
host, docs/gpu.md) and the host's own speed. Run in a process of its own: it replaces
functions of hashing_triton."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parity.capture import hashing_triton as ht  # noqa: E402
from parity.capture import host_native  # noqa: E402
from host_steps import model_lists, time_steps  # noqa: E402


def _ready(plan, figures=False):
    """A result in place of the device work: a zeroed buffer, no event."""
    buf = torch.zeros(max(plan.n, 1), 5 if figures else 2, dtype=torch.int64)
    return ht._pending(plan, buf, None, (plan,), figures)


def _stub() -> None:
    ht.usable = lambda: True
    ht._GET_DEVICE = lambda t: 0  # CPU tensors stand in for one CUDA device
    ht._launch_plan = _ready

    def run(locs, ptrs, block=ht.BLOCK, iters=ht.ITERS, figures=False, nbytes=None,
            dtypes=None):
        plan = ht._plan(ptrs, nbytes or list(map(ht._NBYTES, locs)),
                        dtypes or list(map(ht._DTYPE, locs)), locs[0].device, block * iters)
        return _ready(plan, figures)

    ht._run = run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args(argv)
    _stub()
    os.environ[host_native.ENV] = "1"
    host_native.build_now()
    params, grads, entry = model_lists(1500)
    out = {"host_path_check": host_native.status()}
    for label, native in (("native", "1"), ("python", "0")):
        os.environ[host_native.ENV] = native
        ht._stable.clear()
        ht._plans.clear()
        ms, parts = time_steps(params, grads, entry, args.steps)
        out[f"host_path_ms_per_step_{label}"] = ms
        for what, us in parts.items():
            out[f"host_path_us_{what}_{label}"] = us
    os.environ.pop(host_native.ENV, None)
    if host_native.status().startswith("native"):
        out["host_path_speedup"] = (out["host_path_ms_per_step_python"]
                                    / out["host_path_ms_per_step_native"])
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
