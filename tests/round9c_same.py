"""Round 9c: does the launcher's recorder change the job? Two runs' saved values (every step's
local shards, sharded gradients and loss, per rank: tests/trainers/round9c_launch.py) compared
with ``torch.equal``, and parity's records of the two runs (buckets.jsonl, the step digests)
compared line by line, minus what differs between any two runs (times, pids, paths).

    python tests/round9c_same.py TRUTH_A TRUTH_B [RUN_A RUN_B]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# fields that differ between any two runs of one job (wall clock, process ids, paths)
VOLATILE = {"t", "time", "wall", "elapsed", "pid", "ts", "duration_s", "timestamp"}


def value_differences(a: str, b: str) -> list[str]:
    out = []
    world = torch.load(a, weights_only=False)["world"]
    for rank in range(world):
        sfx = f".{rank}" if rank else ""
        ta, tb = (torch.load(p + sfx, weights_only=False) for p in (a, b))
        for kind in ("shards", "grads", "losses"):
            if sorted(ta[kind]) != sorted(tb[kind]):
                out.append(f"rank {rank} {kind}: steps {sorted(ta[kind])} vs {sorted(tb[kind])}")
                continue
            for step in ta[kind]:
                va, vb = ta[kind][step], tb[kind][step]
                if isinstance(va, dict):
                    if sorted(va) != sorted(vb):
                        out.append(f"rank {rank} step {step} {kind}: other parameters")
                    out += [f"rank {rank} step {step} {kind} {k} differs" for k in va
                            if k in vb and not torch.equal(va[k], vb[k])]
                elif not torch.equal(va, vb):
                    out.append(f"rank {rank} step {step} loss differs")
    return out


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def record_differences(a: Path, b: Path, names=("buckets.jsonl", "steps.jsonl")) -> list[str]:
    out = []
    for d in sorted(Path(a).glob("rank-*")):
        for name in names:
            pa, pb = d / name, Path(b) / d.name / name
            la = [_strip(json.loads(x)) for x in pa.read_text().splitlines() if x.strip()]
            lb = [_strip(json.loads(x)) for x in pb.read_text().splitlines() if x.strip()] \
                if pb.exists() else []
            if la != lb:
                first = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y),
                             min(len(la), len(lb)))
                out.append(f"{d.name}/{name}: {len(la)} vs {len(lb)} lines, first differing "
                           f"line {first}")
    return out


if __name__ == "__main__":
    found = value_differences(sys.argv[1], sys.argv[2])
    if len(sys.argv) > 4:
        found += record_differences(Path(sys.argv[3]), Path(sys.argv[4]))
    print("\n".join(found) or "same")
    sys.exit(1 if found else 0)
