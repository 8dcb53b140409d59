"""parity's built-in workload (``parity.workloads.train``) with the ground truth of round 15d:
before each optimizer step, every parameter's local gradient shard (the gradients the step
consumes, after the micro-batches' reduce-scatters), saved to ``R15D_SAVE`` (rank r > 0:
``R15D_SAVE.r``) as ``{"grads": [per step: [local shard per parameter, in the optimizer's
order]]}``. A global optimizer step pre-hook: nothing of parity is imported but the workload.

    torchrun --standalone --nproc_per_node 2 tests/round15d_workload.py --mode compiled ...
"""

import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parity.workloads import train  # noqa: E402

GRADS: list = []


def before_step(opt, _args, _kwargs):
    local = [getattr(p.grad, "to_local", lambda g=p.grad: g)().detach().clone()
             for g in opt.param_groups for p in g["params"]]
    GRADS.append(local)


def main() -> int:
    register_optimizer_step_pre_hook(before_step)
    rc = train.main(sys.argv[1:])
    if os.environ.get("R15D_SAVE"):
        rank = int(os.environ.get("RANK", "0"))
        torch.save({"grads": GRADS}, os.environ["R15D_SAVE"] + (f".{rank}" if rank else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
