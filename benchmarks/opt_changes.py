"""Bytes per steps.jsonl line and microseconds per recorded step of the optimizers' group
numbers (steps.jsonl ``opt``) for a trainer with a param group per parameter: every group's
numbers on every line (round 14c) against the changes since the rank's last line (round 15a,
parity/opt_changes.py). docs/reliability.md, "Round 15a".

What is timed per recorded step, as capture and the writer do it: reading the numbers
(capture/opt_numbers.group_numbers, the same before and after), turning them into the line's
``opt`` (after: ``encode``) and serialising the line as artifacts._AppendFile does; and, apart,
the reader's ``carry_forward`` per line. Four schedules: numbers constant (plain SGD), one
group's lr changed every step, every group's lr set to one new value every step (a LambdaLR
warmup over all groups), every group's lr set to a value of its own every step (a layer-wise
scale on top). The fastest step of ``--repeat`` runs of ``--steps`` steps (the host is shared: the
fastest is the least disturbed); no file is written.

    python benchmarks/opt_changes.py [--groups 1500] [--steps 50] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from parity.capture.opt_numbers import group_numbers
from parity.opt_changes import carry_forward, encode

HEAD = {"v": 2, "step": 0, "param_digest": "0" * 32, "grad_digest": "0" * 32, "loss": 1.5,
        "loss_hash": "0" * 32, "param_offset": 0, "grad_offset": 0, "rng": {"cpu": "0" * 32}}


def _dump(line: dict) -> bytes:
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


def _run(groups: int, steps: int, schedule: str, changes: bool):
    """(fastest step's read of the numbers, fastest step's line: us; the lines)."""
    ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    opt = torch.optim.SGD([{"params": [p]} for p in ps], lr=0.01, momentum=0.9)
    last = since = None
    lines, read, write = [], [], []
    for k in range(1, steps + 1):
        if schedule == "one":
            opt.param_groups[k % groups]["lr"] = 0.01 * k
        elif schedule == "all":
            for g in opt.param_groups:
                g["lr"] = 0.01 * k / steps
        elif schedule == "each":
            for i, g in enumerate(opt.param_groups):
                g["lr"] = 0.01 * k / steps * (1 + i / groups)
        t0 = time.perf_counter()
        nums = group_numbers(opt)
        t1 = time.perf_counter()
        line = {**HEAD, "step": k}
        if changes:
            line["opt"] = encode(nums, last, since)
            if type(line["opt"]) is dict:
                line["v"] = 3
            last, since = nums, k
        else:
            line["opt"] = nums
        data = _dump(line)
        t2 = time.perf_counter()
        read.append(t1 - t0)
        if k > 1:  # the first line is the full list either way
            write.append(t2 - t1)
        lines.append(data)
    return min(read) * 1e6, min(write) * 1e6, lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print(f"{a.groups} groups; fastest step of {a.repeat} x {a.steps}")
    for schedule in ("constant", "one", "all", "each"):
        row = []
        for changes in (False, True):
            got = [_run(a.groups, a.steps, schedule, changes) for _ in range(a.repeat)]
            read, write = min(x[0] for x in got), min(x[1] for x in got)
            lines = got[0][2]
            later = sum(map(len, lines[1:])) / (len(lines) - 1)
            row.append(f"{'after' if changes else 'before'}: read {read:.0f} us + line "
                       f"{write:.0f} us, first line {len(lines[0])} B, later {later:.0f} B")
            if changes:
                recs = [json.loads(x) for x in lines]
                full = [json.loads(x) for x in _run(a.groups, a.steps, schedule, False)[2]]
                assert [r["opt"] for r in carry_forward(recs)] == [r["opt"] for r in full]
                cf = min(_timed(lambda: carry_forward(recs), 1) for _ in range(a.repeat))
                row.append(f"read back (carry_forward) {cf / len(recs):.1f} us/line")
        print(f"{schedule:9s}  " + "; ".join(row))


def _timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    main()
