"""Round 10b's check of a GraphTrainer jit job's manifests (graph lines of every compiled graph,
and the ``dtensor`` lines of what runs eagerly: lm_head under the chunked loss) against what was
sent, recorded by tests/trainers/round10b_launch.py. The judge is round 9b's
(tests/round9b_truth.py): all-gather bytes exact, reduce-scatter slices summed over ranks against
the sharded gradient with no other slice as close, and gradient coverage; this module feeds it
one step's whole picture, so that a parameter whose gradient is made outside the graphs (lm_head:
its 8 chunk reduce-scatters a step, summed) is judged too, not skipped as round 9c had to:

* graph records keep their node names and ``forward`` / ``backward`` labels; every line of a
  label must come from one compiled graph (a recompile is said, not guessed at);
* the eager records issued under DTensor's ``redistribute_local_tensor`` (``"dtensor": True``;
  torchtitan's own metric all-reduces are not placement changes and are in no manifest) are the
  step's ``dtensor`` lines in order (the dtensor source writes a step's sequence when it changes:
  the one in force is the last written at or before the step); a count that differs is said;
* all lines get one graph id and ``dtensor`` lines a node name ``dtensor.STEP.INDEX``, so round
  9b's judge sees one graph.

    python tests/round10b_truth.py RUN_DIR TRUTH_PREFIX [--name lm_head.weight]
    python tests/round10b_truth.py --2d RUN_DIR TRUTH_PREFIX   (TP x FSDP all-reduces by value,
        records of tests/trainers/round9c_launch.py)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round9b_truth  # noqa: E402


def _all_lines(run: Path, rank: int) -> list[dict]:
    text = (Path(run) / f"rank-{rank:05d}" / "buckets.jsonl").read_text().splitlines()
    return [json.loads(x) for x in text if x.strip()]


def dtensor_in_force(lines: list[dict], step: int) -> list[dict]:
    mine = [b for b in lines if b["source"] == "dtensor" and b["step"] <= step]
    if not mine:
        return []
    last = max(b["step"] for b in mine)
    return sorted((b for b in mine if b["step"] == last), key=lambda b: b["index"])


def _name_unnamed(force: list[dict], fqns: tuple[str, ...]) -> list[dict]:
    """``--name FQN``: an unnamed dtensor reduce-scatter entry of the global shape of FQN's
    all-gather entry in the same sequence gets FQN (what parity would write if it named a
    gradient's reduce-scatter after the parameter it is the backward of); for judging whether
    the unnamed bytes are that gradient."""
    shapes = {e["fqn"]: e["shape"] for b in force if b["collective"] == "all_gather"
              for e in b["entries"] if e["fqn"] in fqns}
    out = []
    for b in force:
        if b["collective"] == "reduce_scatter":
            b = dict(b, entries=[dict(e, fqn=next((f for f, sh in shapes.items()
                                                   if sh == e["shape"]), None))
                                 if e["fqn"] is None else e for e in b["entries"]])
        out.append(b)
    return out


def combined(run: Path, prefix: str, out: list[str], tmp: Path,
             name: tuple[str, ...] = ()) -> tuple[Path, str]:
    """A run directory and truth prefix holding graph + dtensor lines and records as one graph."""
    truths = round9b_truth.all_truths(prefix)
    world = len(truths)
    sub = tmp / "run"
    pre = str(tmp / "truth.pt")
    for rank, t in enumerate(truths):
        lines = _all_lines(run, rank)
        graph = [b for b in lines if b["source"] == "graph" and b.get("stage") != "before_passes"]
        for label in sorted({b["graph"] for b in graph}):
            ids = {b["graph_id"] for b in graph if b["graph"] == label}
            if len(ids) != 1:
                out.append(f"rank {rank}: {label} lines from graphs {sorted(ids)} (a recompile?)")
        if t["mismatch"]:
            out.append(f"rank {rank}: collectives dispatched out of node order {t['mismatch'][:3]}")
        synth = [dict(b, graph_id=0) for b in graph]
        eager = [r for r in t["eager"] if r["dtensor"]]
        recs = list(t["records"])
        for step in sorted({r["step"] for r in eager} | set(t["grads"])):
            calls = [r for r in eager if r["step"] == step]
            force = _name_unnamed(dtensor_in_force(lines, step), name)
            if len(calls) != len(force):
                out.append(f"rank {rank} step {step}: {len(calls)} DTensor collectives ran, "
                           f"{len(force)} dtensor line(s) in force")
                continue
            for r, b in zip(calls, force):
                node = f"dtensor.{step}.{b['index']}"
                synth.append(dict(b, source="graph", graph="eager", graph_id=0, node=node,
                                  position=b["index"]))
                recs.append(dict(r, node=node, op=f"_c10d_functional::{r['op']}"))
        round9b_truth.write_rank(sub, pre, rank, {"world": world, "records": recs,
                                                  "shards": t["shards"], "grads": t["grads"]},
                                 synth)
    return sub, pre


def problems(run: Path, prefix: str, name: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="r10b-") as tmp:
        sub, pre = combined(Path(run), prefix, out, Path(tmp), name)
        out += round9b_truth.problems(sub, pre)
    return out


# ------------------------------------------------------------------ TP x FSDP: all-reduce values
def all_reduce_problems_2d(run: Path, prefix: str) -> tuple[list[str], int]:
    """Round 9c judged the norms' TP all-reduce entries (TP 2 x FSDP 2, aot_fx_trace; records of
    tests/trainers/round9c_launch.py) by size only. By value: the all-reduce sums the TP
    partial gradients, and the FSDP reduce-scatter after it sums the FSDP ranks' results and
    keeps this rank's shard; so the entry's slice summed over every rank of the world (divided
    as the two reduce ops say), at this rank's FSDP shard, is the parameter's sharded gradient,
    and nearer to it than to any other parameter's gradient of that size (bf16 tolerates any
    small slice against the norms' small gradients: the nearest must be its own). The FSDP
    group of a rank: the ranks at its position in their own TP group. Returns (problems,
    entries checked)."""
    run = Path(run)
    truths = round9b_truth.all_truths(prefix)
    world = len(truths)
    out: list[str] = []
    checked = 0
    for rank, t in enumerate(truths):
        by_node = {b["node"]: b for b in round9b_truth.graph_buckets(run, rank)}
        rs_ops = {r["reduce_op"] for r in t["records"] if "reduce_scatter" in r["op"]}
        for i, rec in enumerate(t["records"]):
            if "all_reduce" not in rec["op"] or rec["node"] not in by_node:
                continue
            b = by_node[rec["node"]]
            where = f"rank {rank} step {rec['step']} {rec['node']}"
            peers = [truths[g]["records"][i] for g in range(world)]
            if any(p["node"] != rec["node"] for p in peers):
                out.append(f"{where}: the world's records are not the same node")
                continue
            tp = rec["ranks"]
            fsdp = [g for g in range(world) if peers[g]["ranks"].index(g) == tp.index(rank)]
            grads = t["grads"][rec["step"]]
            for e in b["entries"]:
                if not e["fqn"] or e.get("payload"):
                    continue
                checked += 1
                dt = round9b_truth.DTYPES[e["dtype"]]
                total = sum(round9b_truth._as(round9b_truth._bytes(p["input"])[
                    e["offset"]:e["offset"] + e["size"]], dt).double() for p in peers)
                total = total / (len(tp) if rec["reduce_op"] == "avg" else 1)
                total = total / (len(fsdp) if rs_ops == {"avg"} else 1)
                g = grads.get(e["fqn"])
                if g is None:
                    out.append(f"{where}: {e['fqn']} has an entry but no gradient")
                    continue
                n = g.numel()
                mine = total[fsdp.index(rank) * n:(fsdp.index(rank) + 1) * n]
                err = round9b_truth._err(mine, g)
                if not round9b_truth._close(mine, g, dt):
                    out.append(f"{where}: all-reduce entry {e['fqn']} summed over the world is "
                               f"not its gradient (max error {err:.3g})")
                nearer = [f for f, o in grads.items() if f != e["fqn"] and o.numel() == n
                          and round9b_truth._err(mine, o) <= err]
                if nearer:
                    out.append(f"{where}: all-reduce entry {e['fqn']} is as near to "
                               f"{nearer[0]}'s gradient")
    return out, checked


if __name__ == "__main__":
    args = sys.argv[1:]
    name = tuple(args[args.index("--name") + 1:]) if "--name" in args else ()
    if "--2d" in args:
        args.remove("--2d")
        found, n = all_reduce_problems_2d(Path(args[0]), args[1])
        print(f"{n} all-reduce entries checked")
    else:
        found = problems(Path(args[0]), args[1], name)
    print("\n".join(found) or "all manifest entries right")
    sys.exit(1 if found else 0)
