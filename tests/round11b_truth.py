"""Round 11b's judge: a MoE job's FSDP2 manifests (two groups of one ``fully_shard`` module on
different meshes: the experts over efsdp, the rest over all ranks) against the bytes each
collective was given, as round 9a's recorder kept them (tests/trainers/round11b.py).

Round 9a's ``Judge`` (tests/wire_truth.py) checks every FSDP2 entry (all-gather bytes exact,
reduce-scatter slices summed over the call's group are the sharded gradient, at that offset and
no other) and that the wire's collectives and the lines in force agree in number and order per
step. Two of its rules assume one mesh and are set aside here, each replaced:

- a line of a smaller group than the largest is taken for a ``reshard_after_forward=int``
  backward all-gather (post-forward shard): here a smaller group is the experts' efsdp group,
  whose all-gather sends the experts' own shard (``shard_world`` = 0: never taken so);
- one wire/gradient factor for the whole run: FSDP2 divides by the group's size, so the
  factor is per group size (kept per ``kind@world``).

Added: each line's ``world_size`` is its wire call's group size; the token exchange (c10d
``alltoall_base_`` or functional ``all_to_all_single``, the count exchange too) is on the wire
and in no manifest line, and no c10d / dtensor line exists (a token exchange written as a
reduction would be one).

    python tests/round11b_truth.py RUN   (the trainer saved RUN.truth.<rank>)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.wire_truth import AG, RS, Judge, _in_force  # noqa: E402

A2A = ("alltoall_base_", "all_to_all_single")


class MoEJudge(Judge):
    def __init__(self, run: Path, rtol: float = 1e-5):
        super().__init__(run, rtol)
        self.shard_world = 0  # no reshard_after_forward=int here (see the module docstring)
        self.a2a = 0

    def check_line(self, rank, step, call, line, kind, summed=None, grads=None):
        if line["world_size"] != len(call["ranks"] or ()):
            self.problems.append(f"rank {rank} step {step} {kind} fsdp2#{line['index']}: "
                                 f"world_size {line['world_size']}, the wire's group "
                                 f"{call['ranks']}")
        saved, self.factors = self.factors, {}
        try:
            super().check_line(rank, step, call, line, kind, summed, grads)
        finally:
            for k, v in self.factors.items():
                saved.setdefault(f"{k}@{line['world_size']}", []).extend(v)
            self.factors = saved

    def _replicas_row(self, rank, step, ops, i, ranks):
        """The i-th reduce-scatter of this group (``ranks``), summed over it; this rank's row.
        Round 9a's version indexes the rank's calls of every group together (one group there;
        HSDP's replicas found through all-reduces, none here)."""
        return self._sum_row(rank, step, ops, i, ranks, True)

    def check_other(self, rank, step):
        calls = [c for c in self.truths[rank]["wire"] if c["step"] == step]
        a2a = [c for c in calls if c["op"] in A2A]
        self.a2a += len(a2a)
        if not a2a:
            self.problems.append(f"rank {rank} step {step}: no token exchange on the wire")
        known = set(AG) | set(RS) | set(A2A) | {"wait_tensor"}
        odd = sorted({c["op"] for c in calls if c["op"] not in known})
        if odd:
            self.problems.append(f"rank {rank} step {step}: unexpected wire ops {odd}")
        other = [ln for ln in self.manifests[rank] if ln["source"] != "fsdp2"]
        if other:
            self.problems.append(f"rank {rank}: {len(other)} non-FSDP2 line(s), e.g. "
                                 f"{other[0]['source']} {other[0]['collective']}")
        for ln in self.manifests[rank]:
            if ln.get("collective") not in ("all_gather", "reduce_scatter"):
                self.problems.append(f"rank {rank}: a {ln.get('collective')} line")

    def run(self, **kw) -> list[str]:
        steps = len(self.truths[0]["steps"])
        for rank in range(self.world):
            for step in range(1, steps + 1):
                self.check_fsdp2(rank, step)
                self.check_other(rank, step)
        for kind, cs in self.factors.items():
            if cs and max(cs) - min(cs) > max(1e-3, 2 * self.rtol) * max(abs(c) for c in cs):
                self.problems.append(f"{kind}: the factor between wire and gradient varies "
                                     f"({min(cs)}..{max(cs)})")
        return self.problems


def check(run: Path, rtol: float = 1e-5) -> tuple[list[str], int, "MoEJudge"]:
    j = MoEJudge(run, rtol)
    return j.run(), j.checked, j


def groups(run: Path, rank: int = 0) -> list[tuple]:
    """(collective, index, world_size, group ranks on the wire) per line in force at step 1."""
    j = MoEJudge(run)
    out = []
    for kind, ops in (("all_gather", AG), ("reduce_scatter", RS)):
        lines = _in_force(j.lines(rank, "fsdp2", kind), 1, True)
        for ln, c in zip(lines, j.wire(rank, 1, ops)):
            out.append((kind, ln["index"], ln["world_size"], tuple(c["ranks"])))
    return out


if __name__ == "__main__":
    probs, n, j = check(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1e-5)
    print(f"{n} entries checked, {j.a2a} token exchanges on the wire, factors "
          f"{ {k: round(sum(v) / len(v), 4) for k, v in j.factors.items()} }, "
          f"{len(probs)} problem(s)")
    for p in probs[:40]:
        print(" ", p)
