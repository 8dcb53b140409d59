"""Round 9c's check of GraphTrainer's graph manifests against what its graphs sent, recorded by
tests/trainers/round9c_launch.py. The judge is round 9b's (tests/round9b_truth.py: all-gather
bytes exact, reduce-scatter slices summed over ranks against the sharded gradient with no other
slice as close, coverage, ``payload: activation`` entries no shard and no gradient); this module
only adapts the launcher's records to it:

* the launcher names each record by its graph's collective node (by order, op names checked),
  not by the manifest's phase label: a make_fx joint graph is one graph that parity splits into
  ``forward``/``backward`` buckets; each record takes the label of the manifest line with its
  node's name (a node in no line stays unlabelled and is reported as not in the manifest);
* the launcher's graph ids (one per compiled graph) must map one to one onto the manifest's
  ``graph_id``s, through the node names; a jit job with several graphs is judged one graph at a
  time, each with the records and lines of that graph;
* ``skip``: parameters whose gradient is made outside the graphs judged (jit: lm_head under the
  chunked loss, reduced by eager DTensor collectives, round 9a's ground) are left out of the
  gradient coverage, and said.

    python tests/round9c_truth.py RUN_DIR TRUTH_PREFIX [--skip FQN ...]
    python tests/round9c_truth.py --2d RUN_DIR TRUTH_PREFIX      (TP x FSDP: groups)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round9b_truth  # noqa: E402


def _lines(run: Path, rank: int) -> list[dict]:
    return round9b_truth.graph_buckets(run, rank)


def problems(run: Path, prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    run = Path(run)
    truths = round9b_truth.all_truths(prefix)
    world = len(truths)
    out: list[str] = []
    for rank, t in enumerate(truths):
        if t["mismatch"]:
            out.append(f"rank {rank}: collectives dispatched out of the graph's node order: "
                       f"{t['mismatch'][:3]}")
    # one manifest graph_id per launcher graph id (through the node names), the same on all ranks
    lines0 = _lines(run, 0)
    gid_of: dict[int, int] = {}
    for gid, nodes in truths[0]["nodes"].items():
        names = {n for n, _ in nodes}
        ids = {b["graph_id"] for b in lines0 if b["node"] in names}
        if len(ids) != 1:
            # node names repeat across graphs (each graph numbers its own nodes): pick the graph
            # whose lines are exactly these nodes
            ids = {i for i in {b["graph_id"] for b in lines0}
                   if {b["node"] for b in lines0 if b["graph_id"] == i} == names}
        if len(ids) != 1:
            out.append(f"launcher graph {gid} ({len(names)} collectives): manifest graph ids "
                       f"{sorted(ids)}")
            continue
        gid_of[gid] = ids.pop()
    with tempfile.TemporaryDirectory(prefix="r9c-") as tmp:
        for gid, mid in sorted(gid_of.items()):
            pre = str(Path(tmp) / f"g{gid}.pt")
            sub = Path(tmp) / f"run{gid}"
            for rank, t in enumerate(truths):
                lines = [b for b in _lines(run, rank) if b["graph_id"] == mid]
                label = {b["node"]: b["graph"] for b in lines}
                recs = [dict(r, graph=label.get(r["node"], r["graph"]))
                        if r["graph"] == "joint" else r for r in t["records"] if r["gid"] == gid]
                grads = {s: {f: g for f, g in gs.items() if f not in skip}
                         for s, gs in t["grads"].items()}
                round9b_truth.write_rank(sub, pre, rank, {"world": world, "records": recs,
                                                          "shards": t["shards"],
                                                          "grads": grads}, lines)
            out += [f"graph {gid}: {p}" for p in round9b_truth.problems(sub, pre)]
    return out


def problems_2d(run: Path, prefix: str) -> list[str]:
    """A 2-D mesh (TP x FSDP; one graph, joint): each collective summed over its own group
    (the launcher's ``ranks``), this rank's row at its position in the group. All-gather entries
    exact against the local shard (round 9b's check); reduce-scatter entries against the sharded
    gradient, coverage and ``payload`` entries as round 9b's; all-reduce entries (a TP partial
    sum of a replicated norm's gradient, reduce-scattered over FSDP after: the gradient is made
    by two collectives in a row) by size only: a named entry holds from one FSDP shard of its
    parameter up to the whole; its values are not compared."""
    run = Path(run)
    truths = round9b_truth.all_truths(prefix)
    world = len(truths)
    out: list[str] = []
    for rank, t in enumerate(truths):
        lines = _lines(run, rank)
        by_node = {b["node"]: b for b in lines}
        executed = {r["node"] for r in t["records"]}
        out += [f"rank {rank}: manifest line {n} never executed"
                for n in sorted(set(by_node) - executed)]
        reduced: dict[int, list] = {}
        for i, rec in enumerate(t["records"]):
            where = f"rank {rank} step {rec['step']} {rec['node']}"
            b = by_node.get(rec["node"])
            if b is None:
                out.append(f"{where}: executed collective not in the manifest")
                continue
            group = rec["ranks"]
            if b["world_size"] != len(group):
                out.append(f"{where}: world_size {b['world_size']}, the group has {len(group)}")
            raw = round9b_truth._bytes(rec["input"])
            if "all_gather" in rec["op"]:
                out += round9b_truth._check_all_gather(where, b, raw, t["shards"][rec["step"]])
            elif "all_reduce" in rec["op"]:
                # a TP partial sum of a replicated parameter's gradient, reduce-scattered over
                # FSDP after: not the final gradient; a named entry holds the whole TP-local
                # gradient, from one FSDP shard up to the world's
                for e in b["entries"]:
                    shard = t["shards"][rec["step"]].get(e["fqn"]) if e["fqn"] else None
                    if e["fqn"] and (shard is None or not shard.numel() <= e["numel"]
                                     <= shard.numel() * world):
                        out.append(f"{where}: all-reduce entry {e['fqn']} of {e['numel']} "
                                   f"elements is not its gradient")
            elif "reduce_scatter" in rec["op"]:
                peers = [truths[g]["records"][i] for g in group]
                if any(p["node"] != rec["node"] for p in peers):
                    out.append(f"{where}: the group's records are not the same node")
                    continue
                rows = [round9b_truth._bytes(p["input"]) for p in peers]
                if b["total_bytes"] * len(group) != raw.numel():
                    out.append(f"{where}: total_bytes {b['total_bytes']} x {len(group)}, the "
                               f"input has {raw.numel()}")
                reduced.setdefault(rec["step"], []).extend(
                    (where, e, round9b_truth._row_slice(rows, group.index(rank), len(group), e,
                                                        rec["reduce_op"]))
                    for e in b["entries"])
        for step, slices in sorted(reduced.items()):
            grads = t["grads"][step]
            named = [x for x in slices if not x[1].get("payload")]
            out += round9b_truth._check_gradients(f"rank {rank} step {step}", named, grads)
            # sequence parallel's activation reduce-scatters (bf16): round 9b's "is a gradient"
            # check at bf16's absolute tolerance holds any small slice to the norms' gradients
            # (|g| < 3e-4, all within 2e-2 of anything small); here a gradient counts only if it
            # stands out of that tolerance
            for w, e, v in slices:
                dt = round9b_truth.DTYPES[e["dtype"]]
                tol = round9b_truth.TOL[dt]
                hit = [f for f, g in grads.items() if g.numel() and g.abs().max() > 10 * tol
                       and round9b_truth._close(v, g, dt)]
                if e.get("payload") and hit:
                    out.append(f"{w}: entry at {e['offset']} marked {e['payload']} is {hit[0]}'s "
                               "gradient")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    skip = tuple(args[args.index("--skip") + 1:]) if "--skip" in args else ()
    if "--skip" in args:
        args = args[:args.index("--skip")]
    if "--2d" in args:
        args.remove("--2d")
        found = problems_2d(Path(args[0]), args[1])
    else:
        found = problems(Path(args[0]), args[1], skip)
    print("\n".join(found) or "all manifest entries right")
    sys.exit(1 if found else 0)
