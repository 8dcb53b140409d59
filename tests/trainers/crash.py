"""A plain trainer for sweep tests (no torch): run under torchrun, optionally crash one rank.

It writes parity artifacts itself with parity.artifacts.RankWriter (the spec runs it with
``capture = false`` and passes ``--run-dir {run_dir}``), so a sweep of it can be diffed without
`parity exec`. Hashes are a pure function of (seed, step, parameter, rank), so two sides with the
same arguments match bitwise; ``--perturb-step K`` makes every hash from step K on differ.

  --crash-rank R --crash-step S   rank R raises RuntimeError at step S (default: never)
  --sleep-if-exists PATH          sleep --sleep seconds first if PATH exists (to interrupt a sweep)
  --record PATH                   append one JSON line {rank, argv, env} per process (tests read it)
  --exit-code N                   exit with N after finishing (every step recorded)
"""

import argparse
import json
import os
import sys
import time

import xxhash

PARAMS = ["tok.weight", "layers.0.w", "layers.1.w", "norm.weight"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=1)
    p.add_argument("--perturb-step", type=int, default=-1)
    p.add_argument("--sleep-if-exists")
    p.add_argument("--sleep", type=float, default=60.0)
    p.add_argument("--record")
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--value", action="append", default=[], help="echoed into --record")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.record:
        with open(args.record, "a") as f:
            f.write(json.dumps({"rank": rank, "argv": sys.argv[1:], "value": args.value,
                                "cwd": os.getcwd(), "pid": os.getpid(),
                                "env": {k: v for k, v in os.environ.items()
                                        if k.startswith("SWEEPTEST_")}}) + "\n")
    print(f"crash.py rank {rank}/{world} starting", flush=True)
    if args.sleep_if_exists and os.path.exists(args.sleep_if_exists):
        time.sleep(args.sleep)
    writer = None
    if args.run_dir:
        from parity.artifacts import RankWriter

        writer = RankWriter(args.run_dir, rank, {"world_size": world, "local_rank": rank,
                                                 "device": "cpu", "argv": sys.argv})
        writer.write_params([{"fqn": n, "raw_fqn": n, "shape": [4], "global_shape": [4 * world],
                              "dtype": "float32", "placement": "Shard(0)", "mesh_coord": [rank]}
                             for n in PARAMS])
    for step in range(args.steps + 1):
        if rank == args.crash_rank and step == args.crash_step:
            print(f"rank {rank} about to fail at step {step}", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
        if writer:
            tag = "perturbed" if 0 <= args.perturb_step <= step else ""
            raw = b"".join(xxhash.xxh3_128_digest(f"{args.seed}:{step}:{n}:{rank}:{tag}".encode())
                           for n in PARAMS)
            grads = None if step == 0 else b"".join(
                xxhash.xxh3_128_digest(f"g{args.seed}:{step}:{n}:{rank}:{tag}".encode()) for n in PARAMS)
            writer.write_step(step, raw, grads, loss=1.0 / (step + 1))
    if writer:
        writer.close("ok")
    print(f"crash.py rank {rank} done", flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
