"""The cost of NCCL Ring emulation (``parity exec --emulate-nccl``) per training step, against
the same captured job on plain gloo, measured in the same run (interleaved rounds, median).

The built-in workload's eager FSDP2 job: every step reduce-scatters each block's gradients, so
the figure is what the emulation (one all-to-all and a per-channel ordered sum per
reduce-scatter, in Python) adds to a real step. Quick mode: 2 ranks (topology 2x1, 2 channels
forced), fewer steps, one round; full: 4 ranks at 2x2:channels=4, three rounds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def bench_emulation(quick: bool, tmp: Path) -> dict:
    from benchmarks.run import ROOT, _mean_step_ms

    nproc, topo = (2, "2x1:channels=2") if quick else (4, "2x2:channels=4")
    steps, rounds = (20, 1) if quick else (60, 3)
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(nproc), "-m", "parity.workloads.train", "--mode", "eager", "--steps", str(steps)]
    plain, emulated = [], []
    for i in range(rounds):  # interleaved, so drift in machine load hits both sides alike
        plain.append(_mean_step_ms([sys.executable, "-m", "parity", "exec", "--out",
                                    str(tmp / f"plain-{i}"), "--", *train], ROOT))
        emulated.append(_mean_step_ms([sys.executable, "-m", "parity", "exec", "--emulate-nccl",
                                       topo, "--out", str(tmp / f"emulated-{i}"), "--", *train],
                                      ROOT))
    p, e = statistics.median(plain), statistics.median(emulated)
    return {"emulation_step_ms_gloo": p, "emulation_step_ms": e, "emulation_overhead": e / p,
            "emulation_topology": topo, "emulation_steps": steps}
