"""Test-only harness around ``parity.workloads.train.main`` (run under torchrun).

    PARITY_TEST_OUT=DIR torchrun ... tests/workload_harness.py [--manifests] -- <train args>

Records, from outside the trainer, a sha256 per parameter local shard after
every optimizer step (a global optimizer step post hook) and, with
``--manifests``, the compiled-graph bucket manifests through
``parity.capture.graph.install``. Writes ``DIR/rank{r}.json`` after every step
so the results survive a dirty exit at teardown.
"""

import hashlib
import json
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> int:
    argv = sys.argv[1:]
    manifests = False
    if argv and argv[0] == "--manifests":
        manifests = True
        argv = argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    out_dir = os.environ["PARITY_TEST_OUT"]
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(out_dir, f"rank{rank}.json")
    result = {"rank": rank, "argv": argv, "steps": [], "graphs": [], "exit": None}

    def write() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)

    def on_step(optimizer, args, kwargs) -> None:
        digests = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    data = local.detach().contiguous().view(torch.uint8).numpy().tobytes()
                    digests.append(hashlib.sha256(data).hexdigest()[:16])
        result["steps"].append(digests)
        write()

    register_optimizer_step_post_hook(on_step)

    if manifests:
        from parity.capture import graph

        def on_graph(record: dict) -> None:
            result["graphs"].append(record)
            write()

        graph.install(on_graph)

    from parity.workloads.train import main as train_main

    code = train_main(argv)
    result["exit"] = code
    write()
    return code


if __name__ == "__main__":
    sys.exit(main())
