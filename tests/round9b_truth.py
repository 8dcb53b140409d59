"""Round 9b's ground-truth check of compiled-graph bucket manifests: every ``"source": "graph"``
bucket line parity wrote (after the passes) against the collective inputs the trainer
(tests/trainers/round9b.py) recorded by executing the graph.

* all-gather entry: the bucket's input bytes at ``[offset, offset + size)`` are the parameter's
  local shard in the entry's dtype (exactly; bytes past the shard, its padding, are zero);
* reduce-scatter entry: this rank's row of the sum over ranks of the recorded inputs (divided by
  the world size for ``avg``), at the entry's slice, is the parameter's sharded gradient within a
  tolerance (entries of one parameter summed: a tied weight), and no other entry's slice of the
  same size also matches;
* coverage: every executed collective node is a bucket line of its graph; an entry marked
  ``payload: activation`` is not a parameter's shard (all-gather) nor needed to make up a
  parameter's gradient (reduce-scatter).

``problems(run_dir, truth_prefix)`` returns one line per thing wrong (empty: all right).

    python tests/round9b_truth.py RUN_DIR TRUTH_PREFIX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "complex64": torch.complex64}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-10,
       torch.complex64: 1e-5}


def load_truth(prefix: str, world: int) -> list[dict]:
    return [torch.load(prefix + (f".{r}" if r else ""), weights_only=False) for r in range(world)]


def all_truths(prefix: str) -> list[dict]:
    """Every rank's saved records, as many as rank 0's ``world`` says."""
    return load_truth(prefix, torch.load(prefix, weights_only=False)["world"])


def write_rank(sub: Path, pre: str, rank: int, truth: dict, lines: list[dict]) -> None:
    """One rank of a run directory ``sub`` and truth prefix ``pre`` made for this judge (its
    saved records, its bucket lines): rounds 9c and 10b feed it one graph at a time."""
    torch.save(truth, pre + (f".{rank}" if rank else ""))
    d = Path(sub) / f"rank-{rank:05d}"
    d.mkdir(parents=True)
    (d / "buckets.jsonl").write_text("".join(json.dumps(b) + "\n" for b in lines))


def graph_buckets(run: Path, rank: int) -> list[dict]:
    lines = (run / f"rank-{rank:05d}" / "buckets.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines if x.strip()]
    return [b for b in recs if b.get("source") == "graph" and b.get("stage") != "before_passes"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes as ``dtype``; complex as its real and imaginary parts (AutoParallel's plans
    reduce-scatter rotary activations in complex64: round 10a)."""
    vals = raw.contiguous().view(dtype)
    return torch.view_as_real(vals).reshape(-1) if dtype.is_complex else vals


def problems(run: Path, prefix: str) -> list[str]:
    run = Path(run)
    truths = all_truths(prefix)
    world = len(truths)
    out: list[str] = []
    for rank in range(world):
        buckets = graph_buckets(run, rank)
        by_node = {(b["graph"], b["node"]): b for b in buckets}
        if len({b["graph_id"] for b in buckets}) > 1:
            out.append(f"rank {rank}: more than one compiled graph pair (not handled here)")
        truth = truths[rank]
        reduced: dict[int, list] = {}  # step -> [(where, entry, slice)] of every reduce-scatter
        nodes = _by_order(truth["records"], buckets, out, rank)
        for i, rec in enumerate(truth["records"]):
            node = rec["node"] or nodes[i]
            where = f"rank {rank} step {rec['step']} {rec['graph']} {node}"
            b = by_node.get((rec["graph"], node))
            if b is None:
                out.append(f"{where}: executed collective not in the manifest")
                continue
            if ("all_gather" in rec["op"]) != (b["collective"] == "all_gather"):
                out.append(f"{where}: executed {rec['op']}, the manifest says {b['collective']}")
                continue
            if not isinstance(rec["input"], torch.Tensor):
                out.append(f"{where}: coalesced input not checked")
                continue
            raw = _bytes(rec["input"])
            if "all_gather" in rec["op"]:
                out += _check_all_gather(where, b, raw, truth["shards"][rec["step"]])
            else:
                rows = [_bytes(t["records"][i]["input"]) for t in truths]  # same order
                if "all_reduce" in rec["op"]:  # the whole buffer is every rank's "row"
                    rows = [r.reshape(1, -1).expand(world, -1) for r in rows]
                if b["total_bytes"] * world != rows[rank].numel():
                    out.append(f"{where}: total_bytes {b['total_bytes']} x {world} ranks, the "
                               f"input has {rows[rank].numel()}")
                if any(str(e["fqn"]).endswith(NORM) for e in b["entries"]):
                    out += _check_norms(where, b["entries"], rows, rank, world, rec, truths)
                    continue
                reduced.setdefault(rec["step"], []).extend(
                    (where, e, _row_slice(rows, rank, world, e, rec["reduce_op"]))
                    for e in b["entries"])
        for step, slices in sorted(reduced.items()):
            out += _check_gradients(f"rank {rank} step {step}", slices, truth["grads"][step])
    return out


def _by_order(records: list[dict], buckets: list[dict], out: list[str], rank: int) -> list:
    """Inductor's code has no FX node names: its i-th collective of a graph in a step is the
    manifest's i-th bucket of that graph in node order (``position``); a count that differs is
    said."""
    ordered = {g: [b["node"] for b in sorted((b for b in buckets if b["graph"] == g),
                                             key=lambda b: b["position"])]
               for g in {b["graph"] for b in buckets}}
    seen: dict = {}
    nodes = []
    for rec in records:
        key = (rec["graph"], rec["step"])
        j = seen[key] = seen.get(key, -1) + 1
        names = ordered.get(rec["graph"], [])
        nodes.append(names[j] if j < len(names) else None)
    for (graph, step), j in seen.items():
        if any(r["node"] is None for r in records) and j + 1 != len(ordered.get(graph, [])):
            out.append(f"rank {rank} step {step} {graph}: {j + 1} collectives executed, the "
                       f"manifest has {len(ordered.get(graph, []))}")
    return nodes


def _check_all_gather(where: str, b: dict, raw: torch.Tensor, shards: dict) -> list[str]:
    out = []
    if b["total_bytes"] != raw.numel():
        out.append(f"{where}: total_bytes {b['total_bytes']}, the input has {raw.numel()}")
    for e in b["entries"]:
        piece = raw[e["offset"]:e["offset"] + e["size"]]
        if e.get("payload"):
            for fqn, shard in shards.items():
                exp = _bytes(shard.to(DTYPES[e["dtype"]]))
                if exp.numel() and piece[:exp.numel()].numel() == exp.numel() \
                        and torch.equal(piece[:exp.numel()], exp):
                    out.append(f"{where}: entry at {e['offset']} marked {e['payload']} is {fqn}'s shard")
            continue
        if e["fqn"] not in shards:
            out.append(f"{where}: entry {e['fqn']} is no parameter")
            continue
        exp = _bytes(shards[e["fqn"]].to(DTYPES[e["dtype"]]))
        if exp.numel() > e["size"] or not torch.equal(piece[:exp.numel()], exp):
            out.append(f"{where}: all-gather bytes at [{e['offset']}, +{e['size']}) are not "
                       f"{e['fqn']}'s shard in {e['dtype']}")
        elif piece[exp.numel():].any():
            out.append(f"{where}: padding after {e['fqn']} is not zero")
    return out


def _row_slice(rows, rank, world, e, op):
    """This rank's row of the summed inputs at the entry's slice, in float64."""
    dt = DTYPES[e["dtype"]]
    total = None
    for raw in rows:
        row = raw.reshape(world, -1)[rank]
        vals = _as(row[e["offset"]:e["offset"] + e["size"]], dt).double()
        total = vals if total is None else total + vals
    return total / world if op == "avg" else total


NORM = ":grad_norm"  # a clip's stacked gradient norms, one entry each (round 13, lead)


def _check_norms(where: str, entries: list, rows, rank: int, world: int, rec: dict,
                 truths: list) -> list[str]:
    """A clip's norm all-reduce (``_NormPartial(2.0)``: each rank sends its local shards'
    ``norm ** 2``): the summed value at each ``<fqn>:grad_norm`` entry is that parameter's
    squared global gradient norm (its shards' over every rank), up to one factor common to all
    (the truth's gradients are saved after the clip scaled them). Names in another order break
    the proportion."""
    out, ratios = [], []
    for e in entries:
        base = str(e["fqn"])[:-len(NORM)] if str(e["fqn"]).endswith(NORM) else None
        if base is None or base not in truths[rank]["grads"][rec["step"]]:
            out.append(f"{where}: norm entry {e['fqn']} names no parameter with a gradient")
            continue
        want = sum(float(t["grads"][rec["step"]][base].double().pow(2).sum()) for t in truths)
        got = float(_row_slice(rows, rank, world, e, rec["reduce_op"])[0])
        ratios.append((got / want if want else float("nan"), e["fqn"]))
    vals = [r for r, _ in ratios]
    if vals and not (max(vals) - min(vals) <= 1e-4 * max(abs(max(vals)), 1e-30)):
        out.append(f"{where}: the norm entries are not their parameters' squared gradient "
                   f"norms (ratios {[(round(r, 6), f) for r, f in ratios]})")
    return out


def _err(v: torch.Tensor, g: torch.Tensor) -> float:
    g = g.double().reshape(-1)
    if v.numel() < g.numel():
        return float("inf")
    return (v[:g.numel()] - g).abs().max().item() if g.numel() else 0.0


def _close(v: torch.Tensor, g: torch.Tensor, dt: torch.dtype) -> bool:
    g = g.double().reshape(-1)
    return v.numel() >= g.numel() and torch.allclose(v[:g.numel()], g, rtol=TOL[dt], atol=TOL[dt])


def _check_gradients(where: str, slices: list, grads: dict) -> list[str]:
    """Every reduce-scatter entry of one step: each named parameter's slices (summed: a tied
    weight's two reduce-scatters) make up its gradient, no other slice of that size is as close
    to it, every parameter with a gradient is named somewhere, and an unnamed (activation) slice
    is no gradient, nor the missing part of one."""
    out = []
    named = {e["fqn"] for _, e, _ in slices if e["fqn"]}
    for fqn in sorted(named):
        mine = [(w, e, v) for w, e, v in slices if e["fqn"] == fqn]
        if fqn not in grads:
            out.append(f"{where}: {fqn} has an entry but no gradient")
            continue
        dt = DTYPES[mine[0][1]["dtype"]]
        summed = sum(v for _, _, v in mine)
        if not _close(summed, grads[fqn], dt):
            out.append(f"{mine[0][0]}: reduce-scatter slice(s) of {fqn} "
                       f"{[(w.split()[-1], e['offset']) for w, e, _ in mine]} do not make up its gradient")
        for w, e, v in slices:
            # another slice as close to this gradient as the named one (a bf16 tolerance can
            # hold two small biases' gradients at once: only an equal or closer one counts)
            if (e["fqn"] != fqn and len(mine) == 1 and e["size"] == mine[0][1]["size"]
                    and grads[fqn].numel()  # an empty shard (4 ranks, 3 rows) matches anything
                    and _close(v, grads[fqn], dt) and _err(v, grads[fqn]) <= _err(summed, grads[fqn])):
                out.append(f"{w}: the slice at {e['offset']} ({e['fqn']}) also matches {fqn}'s gradient")
    for fqn in sorted(set(grads) - named):
        out.append(f"{where}: the gradient of {fqn} is in no named reduce-scatter entry")
        others = [(w, e, v) for w, e, v in slices if e.get("payload")
                  and e["size"] >= grads[fqn].numel() * grads[fqn].element_size() // 2]
        others = [x for x in others if x[2].numel() == others[0][2].numel()]  # summable
        if others and _close(sum(v for _, _, v in others), grads[fqn], DTYPES[others[0][1]["dtype"]]):
            out.append(f"{where}: entries marked {others[0][1]['payload']} "
                       f"{[w.split()[-1] for w, _, _ in others]} are {fqn}'s gradient")
    for w, e, v in slices:
        if e.get("payload") and any(_close(v, g, DTYPES[e["dtype"]]) for g in grads.values()
                                    if g.numel()):
            out.append(f"{w}: entry at {e['offset']} marked {e['payload']} is a gradient")
    return out


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]), sys.argv[2])
    print("\n".join(found) or "all manifest entries right")
    sys.exit(1 if found else 0)
