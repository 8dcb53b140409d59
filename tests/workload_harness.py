"""Test-only harness around ``parity.workloads.train.main``.

As a script, under torchrun:

    PARITY_TEST_OUT=DIR torchrun --standalone --nproc_per_node 2 tests/workload_harness.py \\
        [--manifests] -- <train args>

it records, from outside the trainer, a digest of every parameter's local
shard after each optimizer step (a global optimizer step post hook) and, with
``--manifests``, the compiled-graph bucket manifests through
``parity.capture.sources.graph.install``. ``DIR/rank{r}.json`` is rewritten after every
step, so results survive a rank that dies at teardown.

As a module, ``run_job(args)`` launches such a job once per pytest session
(results are cached by argument list, so test files share jobs).
"""

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
NPROC = 2
STEPS = 3

# The jobs both test files use (each runs once per session).
EAGER = ["--mode", "eager", "--steps", str(STEPS)]
PERTURB_FQN = "layers.0.attention.wq.weight"
EAGER_PERTURBED = [*EAGER, "--perturb-grad", f"1:2:{PERTURB_FQN}"]
COMPILED = ["--mode", "compiled", "--steps", str(STEPS)]
COMPILED_REGISTRATION = [*COMPILED, "--bucketing", "manual", "--bucket-order", "registration"]
COMPILED_GRAPH = [*COMPILED, "--bucketing", "manual", "--bucket-order", "graph"]
COMPILED_SWAPPED = [*COMPILED, "--bucketing", "auto", "--bucket-order", "swapped"]
_cache: dict[tuple[str, ...], "JobResult"] = {}
_root: Path | None = None


class JobResult:
    def __init__(self, returncode: int, out_dir: Path, log: str) -> None:
        self.returncode = returncode
        self.out_dir = out_dir
        self.log = log
        self.ranks = []
        for rank in range(NPROC):
            path = out_dir / f"rank{rank}.json"
            self.ranks.append(json.loads(path.read_text()) if path.exists() else None)

    def check_ok(self) -> None:
        """Every rank finished main() with 0; a dirty torchrun exit after that only warns."""
        for rank, data in enumerate(self.ranks):
            assert data is not None, f"rank {rank} wrote no results:\n{self.log[-4000:]}"
            assert data["exit"] == 0, f"rank {rank} exit {data['exit']}:\n{self.log[-4000:]}"
        if self.returncode != 0:
            warnings.warn(f"torchrun exited {self.returncode} after all ranks finished (dirty teardown)")

    def digests(self, rank: int) -> list[list[str]]:
        return self.ranks[rank]["steps"]

    def graphs(self, rank: int) -> list[dict]:
        return self.ranks[rank]["graphs"]


def run_job(train_args: list[str], *, manifests: bool = False, timeout: float = 300) -> JobResult:
    global _root
    key = (str(manifests), *train_args)
    if key in _cache:
        return _cache[key]
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="parity-workload-"))
        # gone with the session (each CI run left one such folder in /tmp)
        atexit.register(shutil.rmtree, _root, True)
    out_dir = _root / f"job{len(_cache)}"
    out_dir.mkdir()
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PARITY_TEST_OUT=str(out_dir),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [
        str(TORCHRUN),
        "--standalone",
        f"--nproc_per_node={NPROC}",
        str(Path(__file__).resolve()),
        *(["--manifests"] if manifests else []),
        "--",
        *train_args,
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    result = JobResult(proc.returncode, out_dir, proc.stdout + proc.stderr)
    _cache[key] = result
    return result


def main() -> int:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

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
        from parity.capture.sources import graph

        def on_graph(record) -> None:  # a GraphRecord
            result["graphs"].append(record.to_dict())
            write()

        graph.install(on_graph)

    from parity.workloads.train import main as train_main

    code = train_main(argv)
    result["exit"] = code
    write()
    return code


if __name__ == "__main__":
    sys.exit(main())
