"""parity's built-in compiled workload (``parity.workloads.train --mode compiled``) run with
round 9b's ground truth: its backend's ``boxed_nop`` replaced by the trainer's
``fx.Interpreter`` recorder (tests/trainers/round9b.py), each parameter's local shard and
sharded gradient saved at every optimizer step (a global step pre-hook: the parameters then are
those the step's forward used). Saves what round9b_truth.py reads to ``R9_SAVE``.

    torchrun --standalone --nproc_per_node 2 tests/round9b_workload.py --mode compiled ...
"""

import os
import sys
from pathlib import Path

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch.optim.optimizer import register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.trainers.round9b as r9  # noqa: E402
from parity.workloads import bucketing, simple_fsdp, train  # noqa: E402

KIND: dict[int, str] = {}  # id(graph module) -> forward / backward
MODEL: dict[str, torch.nn.Module] = {}
TRUTH = {"records": r9.RECORDS, "shards": [], "grads": []}
_run_passes, _data_parallel = bucketing.run_passes, simple_fsdp.data_parallel


def run_passes(gm, graph_kind, **kw):
    KIND[id(gm)] = graph_kind
    return _run_passes(gm, graph_kind, **kw)


def data_parallel(model, *args, **kwargs):
    MODEL["model"] = model
    return _data_parallel(model, *args, **kwargs)


def before_step(_opt, _args, _kwargs):
    params = list(MODEL["model"].named_parameters())
    TRUTH["shards"].append({n: r9.local(p) for n, p in params})
    TRUTH["grads"].append({n: r9.local(p.grad) for n, p in params if p.grad is not None})
    r9.STATE["step"] += 1


def main() -> int:
    bucketing.run_passes = run_passes
    bucketing._boxed_nop = lambda gm, _inputs: make_boxed_func(
        lambda *a: r9.Recorder(gm, KIND[id(gm)], 0).run(*a))
    simple_fsdp.data_parallel = data_parallel
    register_optimizer_step_pre_hook(before_step)
    r9.STATE["step"] = 0
    rc = train.main(sys.argv[1:])
    TRUTH["world"] = int(os.environ["WORLD_SIZE"])
    rank = os.environ["RANK"]
    torch.save(TRUTH, os.environ["R9_SAVE"] + (f".{rank}" if rank != "0" else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
