"""Round 10a's ground-truth check of AutoParallel's graph manifests: round 9b's judge
(tests/round9b_truth.py, unchanged rules) on the records of tests/trainers/round10a.py, with one
difference that AutoParallel's plans need and that is checked, not assumed:

AutoParallel's solver may compute a weight's sharded gradient with no gradient reduction at all
(the backward all-gathers the activations over the batch and each rank computes its own rows of
the gradient: wq, wk, wv, w1-w3 and the norms on a 2-rank CPU mesh). Round 9b's "every parameter
with a gradient is in a named reduce-scatter entry" then does not apply to such a parameter, and
is replaced by a wire check: no executed reduce-scatter or all-reduce of that step, summed over
the ranks (this rank's row), holds the gradient at any element offset. Every other rule of round
9b stands (all-gather bytes exact, named slices make up their gradient, ``activation`` entries
no shard and no gradient, every executed collective a manifest line, in order).

    python tests/round10a_truth.py RUN_DIR TRUTH_PREFIX
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from tests import round9b_truth as r9b

UNNAMED = re.compile(r"^rank (\d+) step (\d+): the gradient of (\S+) is in no named "
                     r"reduce-scatter entry$")


def _summed_rows(truths: list[dict], rank: int, step: int) -> list[torch.Tensor]:
    """This rank's row of every reduction executed at ``step``, summed over the ranks, as float64
    (complex as real and imaginary parts)."""
    world = len(truths)
    rows = []
    for i, rec in enumerate(truths[rank]["records"]):
        if rec["step"] != step or "all_gather" in rec["op"]:
            continue
        parts = [t["records"][i]["input"] for t in truths]
        if isinstance(parts[0], list):
            continue
        total = None
        for p in parts:
            flat = p.detach().reshape(-1)
            flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
            row = flat if "all_reduce" in rec["op"] else flat.reshape(world, -1)[rank]
            total = row.double() if total is None else total + row.double()
        rows.append(total / world if rec["reduce_op"] == "avg" else total)
    return rows


def carried_by_a_reduction(grad: torch.Tensor, rows: list[torch.Tensor]) -> bool:
    """Whether some reduction's summed row holds ``grad`` (flattened) at any element offset."""
    g = grad.detach().double().reshape(-1)
    n = g.numel()
    for row in rows:
        if row.numel() < n or n == 0:
            continue
        windows = row.unfold(0, n, 1)  # every offset
        if torch.isclose(windows, g, rtol=1e-5, atol=1e-5).all(dim=1).any():
            return True
    return False


def problems(run: Path, prefix: str) -> list[str]:
    truths = r9b.all_truths(prefix)
    out = []
    for line in r9b.problems(Path(run), prefix):
        m = UNNAMED.match(line)
        if m:
            rank, step, fqn = int(m[1]), int(m[2]), m[3]
            grad = truths[rank]["grads"][step][fqn]
            if not carried_by_a_reduction(grad, _summed_rows(truths, rank, step)):
                continue  # computed without a gradient reduction: nothing to describe
            line += " (an executed reduction carries it)"
        out.append(line)
    return out


def local_gradients(prefix: str) -> list[str]:
    """The parameters whose gradient no reduction carries (rank 0, step 0): said, not judged."""
    truths = r9b.all_truths(prefix)
    rows = _summed_rows(truths, 0, 0)
    return sorted(f for f, g in truths[0]["grads"][0].items()
                  if not carried_by_a_reduction(g, rows))


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]), sys.argv[2])
    print("\n".join(found) or "all manifest entries right")
    print("gradients made without a reduction:", ", ".join(local_gradients(sys.argv[2])))
    sys.exit(1 if found else 0)
