"""Round 9a's judge: eager bucket manifests (buckets.jsonl) against the bytes that went into each
collective, as tests/trainers/round9a.py's dispatch mode recorded them (independent of parity).

``check(run)`` returns a list of problems (empty: every manifest entry is right and every wire
collective that carries parameter or gradient bytes is described by a manifest line of its step):

- all-gather (FSDP2, ``c10d._allgather_base_``): the input's bytes at ``[offset, offset + size)``
  are the parameter's local shard, zero-padded to ``numel``, cast to the entry's dtype (exact);
- reduce-scatter (FSDP2): the group ranks' inputs summed, this rank's row, the slice at the
  entry's offset is the parameter's sharded gradient up to one factor (FSDP2's pre/post divide),
  the same factor for every entry of the run, and no other entry of the line matches it;
- all-reduce (DDP's buckets, HSDP's replicate all-reduce, a trainer's own): the same, over the
  group's ranks (DDP: the sum is the mean gradient itself);
- DTensor's functional collectives (``_c10d_functional``): counted against the ``dtensor`` lines
  of the step; an all-gather of a parameter's local shard checked as above; a reduction of a
  Partial tensor (all-reduce, reduce-scatter) named after a parameter: the ranks' inputs summed
  are that parameter's gradient (the ranks' Partial gradients summed, as the trainer saved
  them after the backward: ``pgrads``), and no other parameter's; one left unnamed must be no
  parameter's gradient (a gradient summed but not named is a problem too).

A manifest layout is written when it changes, so the layout in force at step s is the last line
of its (source, collective, index) at or before s (FSDP2); for the c10d and dtensor sources,
whose whole sequence of a step is rewritten on a change, the last step written at or before s.
A line with ``"ends": true`` at step t and index n (docs/artifacts.md) says that from t on the
source's sequence of that collective has n lines (FSDP2: positions n and after did not run; the
c10d and dtensor sources: n is 0, none ran): lines written before it at those positions are no
longer in force.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

AG = ("_allgather_base_", "allgather_into_tensor_coalesced_")
RS = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")
AR = ("allreduce_",)


def load(run: Path):
    truths = load_truths(run)
    manifests = []
    for r in range(len(truths)):
        p = Path(run) / f"rank-{r:05d}" / "buckets.jsonl"
        manifests.append([json.loads(x) for x in p.read_text().splitlines()] if p.exists()
                         else [])
    return truths, manifests


def _in_force(lines: list[dict], step: int, by_index: bool) -> list[dict]:
    """The lines describing ``step``: per index the last written at or before it (by_index), or
    the whole sequence of the last step written at or before it."""
    if by_index:
        out: dict = {}
        for ln in lines:  # in the order written
            if ln["step"] <= step:
                if ln.get("ends") is True:
                    for i in [i for i in out if i >= ln["index"]]:
                        del out[i]
                else:
                    out[ln["index"]] = ln
        return [out[i] for i in sorted(out)]
    steps = [ln["step"] for ln in lines if ln["step"] <= step]
    if not steps:
        return []
    last = max(steps)
    return [ln for ln in lines if ln["step"] == last and ln.get("ends") is not True]


def _bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _dtype(name):
    import torch

    return getattr(torch, name)


def _padded(t, numel, dtype):
    import torch

    flat = t.reshape(-1).to(dtype)
    if flat.numel() > numel:
        return None
    return torch.cat([flat, torch.zeros(numel - flat.numel(), dtype=dtype)])


class Judge:
    def __init__(self, run: Path, rtol: float = 1e-5):
        self.truths, self.manifests = load(run)
        self.world = len(self.truths)
        self.rtol = rtol
        self.problems: list[str] = []
        self.factors: dict[str, list[float]] = {}
        self.checked = 0  # entries checked
        self.named_reductions: list = []  # (rank, step, fqn, collective) of right named ones
        self.unnamed_reductions = 0
        self.shard_world = max([ln["world_size"] for m in self.manifests for ln in m
                                if ln["source"] == "fsdp2"] or [1])

    def wire(self, rank, step, ops, ns="c10d"):
        return [c for c in self.truths[rank]["wire"]
                if c["step"] == step and c["op"] in ops and c.get("ns", "c10d") == ns]

    def lines(self, rank, source, collective, pred=lambda ln: True):
        return [ln for ln in self.manifests[rank] if ln["source"] == source
                and ln["collective"] == collective and pred(ln)]

    # -------------------------------------------------------------------- one collective
    def _sum_row(self, rank, step, ops, i, ranks, rows):
        """The group ranks' i-th inputs (of this kind, this step) summed; this rank's row."""
        import torch

        tot = None
        for r in ranks:
            calls = [c for c in self.wire(r, step, ops) if c["ranks"] == ranks
                     and all(t.is_floating_point() for t in c["inputs"])]
            x = calls[i]["inputs"][0].double()
            tot = x if tot is None else tot + x
        if rows:
            tot = tot.reshape(len(ranks), -1)[ranks.index(rank)]
        return tot.to(torch.float64)

    def _post_forward_shard(self, step, fqn, n, pos):
        """reshard_after_forward=int (1-D FSDP2): the parameter's rows padded for the full
        world, cut into ``n`` chunks; chunk ``pos`` (what a backward all-gather sends)."""
        import torch

        shards = [self.truths[r]["steps"][step - 1]["shards"][fqn] for r in range(self.world)]
        full = torch.cat(shards)
        rows = -(-full.shape[0] // self.world) * self.world
        pad = torch.zeros((rows - full.shape[0], *full.shape[1:]), dtype=full.dtype)
        return torch.cat([full, pad]).chunk(n)[pos]

    def _replicas_row(self, rank, step, ops, i, ranks):
        """This rank's row of the i-th reduce-scatter, summed over its group and, under HSDP,
        over every other replica's group (the gradient FSDP2 ends with is reduced over both)."""
        pos, groups = ranks.index(rank), []
        # replicas: the ranks of HSDP's replicate all-reduce (a c10d all-reduce of this step
        # whose group meets this group in this rank only); TP's other groups hold other shards
        partners = {rank}
        for c in self.wire(rank, step, AR):
            rs = c["ranks"] or []
            if rank in rs and len(set(rs) & set(ranks)) == 1:
                partners |= set(rs)
        for q in sorted(partners):
            calls = self.wire(q, step, ops)
            if len(calls) <= i:
                continue
            g = list(calls[i]["ranks"])
            if len(g) == len(ranks) and g.index(q) == pos and g not in groups:
                groups.append(g)
        tot = None
        for g in groups:
            row = self._sum_row(g[pos], step, ops, i, g, True)
            tot = row if tot is None else tot + row
        return tot

    def _close(self, s, g, c) -> bool:
        import torch

        if s.numel() != g.numel():
            return False
        if g.numel() == 0:  # this rank's share is all padding
            return True
        return bool(torch.allclose(s * c, g, rtol=self.rtol,
                                   atol=self.rtol * max(float(g.abs().max()), 1e-30)))

    def check_line(self, rank, step, call, line, kind, summed=None, grads=None):
        import torch

        where = f"rank {rank} step {step} {kind} {line['source']}#{line['index']}"
        x = call["inputs"][0] if len(call["inputs"]) == 1 else None
        if x is None:
            x = torch.cat([t.reshape(-1).view(torch.uint8) for t in call["inputs"]])
        nbytes = x.numel() * x.element_size()
        if kind == "reduce_scatter":  # the manifest describes one rank's row
            nbytes //= len(call["ranks"])
        if line.get("total_bytes") not in (None, nbytes):
            self.problems.append(f"{where}: {nbytes} bytes on the wire, manifest says "
                                 f"{line.get('total_bytes')}")
        truth = self.truths[rank]["steps"][step - 1]
        entries = [e for e in line["entries"] if e["fqn"] is not None]
        if kind == "all_gather":
            for e in entries:
                self.checked += 1
                fqn, off, size, dt = e["fqn"], e["offset"], e["size"], e["dtype"]
                shard = truth["shards"].get(fqn)
                if shard is not None and line["world_size"] < self.shard_world:
                    shard = self._post_forward_shard(step, fqn, line["world_size"],
                                                     list(call["ranks"]).index(rank))
                want = None if shard is None else _padded(shard, e["numel"], _dtype(dt))
                got = _bytes(x)[off:off + size]
                if want is None or not torch.equal(got, _bytes(want)):
                    self.problems.append(f"{where}: {fqn} at [{off}, {off + size}) is not its "
                                         f"padded local shard as {dt}")
            return
        es = x.element_size()
        pairs = []
        for e in entries:
            self.checked += 1
            grad = (grads if grads is not None else truth["grads"]).get(e["fqn"])
            if grad is None and kind == "all_reduce" and e["numel"]:
                # DDP all-reduces an unused parameter's slot (find_unused_parameters): zeros
                z = summed[e["offset"] // x.element_size():][:e["numel"]]
                if z.numel() == e["numel"] and not z.any():
                    continue
            if grad is None:
                self.problems.append(f"{where}: {e['fqn']} has no gradient at this step but is "
                                     f"an entry")
                continue
            if e["dtype"] and _dtype(e["dtype"]) != x.dtype:
                self.problems.append(f"{where}: {e['fqn']} entry dtype {e['dtype']}, wire "
                                     f"{x.dtype}")
            g = grad.reshape(-1).double()
            pairs.append((e, g, summed[e["offset"] // es: e["offset"] // es + g.numel()]))
        if not pairs:
            return
        # one factor for the whole line (FSDP2's pre/post divide), fitted on the claimed slices
        s_all = torch.cat([s for _, g, s in pairs if s.numel() == g.numel()] or [summed[:0]])
        g_all = torch.cat([g for _, g, s in pairs if s.numel() == g.numel()] or [summed[:0]])
        den = float((s_all * s_all).sum())
        c = float((s_all * g_all).sum()) / den if den else 1.0
        if den:
            self.factors.setdefault(kind, []).append(c)
        for e, g, s in pairs:
            if not self._close(s, g, c):
                self.problems.append(f"{where}: {e['fqn']} at offset {e['offset']} is not its "
                                     f"gradient")
                continue
            for o in entries:
                if o is e or not g.numel() or g.abs().max() == 0:
                    continue
                osl = summed[o["offset"] // es: o["offset"] // es + g.numel()]
                if self._close(osl, g, c) and o["offset"] != e["offset"]:
                    self.problems.append(f"{where}: {e['fqn']}'s gradient also matches at "
                                         f"{o['fqn']}'s offset")

    # ------------------------------------------------------------------------ per source
    def check_fsdp2(self, rank, step):
        for kind, ops in (("all_gather", AG), ("reduce_scatter", RS)):
            calls = self.wire(rank, step, ops)
            lines = _in_force(self.lines(rank, "fsdp2", kind), step, True)
            if len(calls) != len(lines):
                self.problems.append(f"rank {rank} step {step}: {len(calls)} {kind}(s) on the "
                                     f"wire, {len(lines)} FSDP2 manifest line(s) in force")
            seen: dict = {}
            micro = self.truths[rank]["steps"][step - 1].get("micro")
            total: dict = {}
            for line in lines:
                for e in line["entries"]:
                    total[e["fqn"]] = total.get(e["fqn"], 0) + 1
            done: dict = {}
            for call, line in zip(calls, lines):
                key = tuple(call["ranks"] or ())
                i = seen[key] = seen.get(key, -1) + 1
                summed, grads = None, None
                if kind == "reduce_scatter":
                    summed = self._replicas_row(rank, step, ops, i, list(call["ranks"]))
                    if micro:  # FSDP2 reduces each pass's new gradient: pass j of P is the
                        grads = {}  # growth of the sharded gradient at micro-batch M - P + j
                        for e in line["entries"]:
                            j = done[e["fqn"]] = done.get(e["fqn"], -1) + 1
                            k = len(micro) - total[e["fqn"]] + j
                            now = micro[k].get(e["fqn"])
                            before = micro[k - 1].get(e["fqn"]) if k else None
                            grads[e["fqn"]] = now if before is None or now is None else \
                                now - before
                self.check_line(rank, step, call, line, kind, summed, grads)

    def check_allreduce(self, rank, step):
        """Every wire all-reduce of the step against the c10d lines in force, in order (DDP's
        bucket lines and the call-site lines are written separately: each in its own order)."""
        ddp = _in_force(self.lines(rank, "c10d", "all_reduce", lambda ln: ln["group"] == "ddp"),
                        step, False)
        other = _in_force(self.lines(rank, "c10d", "all_reduce",
                                     lambda ln: ln["group"] != "ddp"), step, False)
        # integer all-reduces carry no parameter bytes (DDP's used-parameter map under
        # find_unused_parameters / static_graph's first iteration): counted, not matched
        calls = [c for c in self.wire(rank, step, AR)
                 if all(t.is_floating_point() for t in c["inputs"])]
        if len(calls) != len(ddp) + len(other):
            self.problems.append(f"rank {rank} step {step}: {len(calls)} all-reduce(s) on the "
                                 f"wire, {len(ddp)} DDP + {len(other)} other c10d line(s)")
            return
        # the two sequences interleave on the wire; match by size in order within each
        queue = {"ddp": list(ddp), "other": list(other)}
        seen: dict = {}
        passes: list = []
        for call in calls:
            nbytes = sum(t.numel() * t.element_size() for t in call["inputs"])
            line = None
            for name in ("other", "ddp"):
                if queue[name] and queue[name][0].get("total_bytes") == nbytes:
                    line = queue[name].pop(0)
                    break
            key = tuple(call["ranks"] or ())
            i = seen[key] = seen.get(key, -1) + 1
            if line is None:
                self.problems.append(f"rank {rank} step {step}: wire all-reduce #{i} of "
                                     f"{nbytes} bytes described by no c10d line in order")
                continue
            summed = self._sum_row(rank, step, AR, i, list(call["ranks"]), False)
            passes.append((call, line, summed))
        # with micro-batches a gradient is all-reduced once per syncing pass: its pass j of P
        # sums to the gradient after micro-batch M - P + j (DDP all-reduces the accumulated one)
        micro = self.truths[rank]["steps"][step - 1].get("micro")
        total: dict = {}
        for _, line, _ in passes:
            for e in line["entries"]:
                total[e["fqn"]] = total.get(e["fqn"], 0) + 1
        done: dict = {}
        for call, line, summed in passes:
            grads = None
            if micro:
                grads = {}
                for e in line["entries"]:
                    j = done[e["fqn"]] = done.get(e["fqn"], -1) + 1
                    grads[e["fqn"]] = micro[len(micro) - total[e["fqn"]] + j].get(e["fqn"])
            self.check_line(rank, step, call, line, "all_reduce", summed, grads)

    def check_dtensor(self, rank, step):
        calls = self._dtensor_calls(rank, step)
        lines = _in_force([ln for ln in self.manifests[rank] if ln["source"] == "dtensor"],
                          step, False)
        if len(calls) != len(lines):
            self.problems.append(f"rank {rank} step {step}: {len(calls)} DTensor functional "
                                 f"collective(s) on the wire, {len(lines)} dtensor line(s)")
            return
        for i, (call, line) in enumerate(zip(calls, lines)):
            if line["collective"] == "all_gather" and call["op"].startswith("all_gather"):
                self.check_line(rank, step, call, line, "all_gather")
            elif line["collective"] in ("all_reduce", "reduce_scatter"):
                self.check_dtensor_reduction(rank, step, i, call, line)

    def _dtensor_calls(self, rank, step):
        return [c for c in self.truths[rank]["wire"] if c["step"] == step
                and c.get("ns") in ("_c10d_functional", "funcol") and not c["op"].startswith("_")]

    def check_dtensor_reduction(self, rank, step, i, call, line):
        """The i-th DTensor collective of the step, a reduction: its inputs over the ranks
        summed against the ranks' Partial gradients summed (``pgrads``)."""
        import torch

        where = f"rank {rank} step {step} dtensor#{line['index']} {line['collective']}"
        want = "all_reduce" if line["collective"] == "all_reduce" else "reduce_scatter"
        if not call["op"].startswith(want):
            self.problems.append(f"{where}: the wire's collective is {call['op']}")
            return
        x = call["inputs"][0]
        nbytes = x.numel() * x.element_size()
        if want == "reduce_scatter":
            nbytes = -(-x.numel() // line["world_size"]) * x.element_size()
        if line.get("total_bytes") != nbytes:
            self.problems.append(f"{where}: {nbytes} bytes on the wire, manifest says "
                                 f"{line.get('total_bytes')}")
        summed = None
        for r in range(self.world):
            rc = self._dtensor_calls(r, step)
            y = rc[i]["inputs"][0].double() if len(rc) > i else None
            if y is None or y.numel() != x.numel():
                self.problems.append(f"{where}: rank {r} has no such call")
                return
            summed = y if summed is None else summed + y
        sums = {}
        for fqn in self.truths[rank]["steps"][step - 1].get("pgrads") or {}:
            gs = [self.truths[r]["steps"][step - 1]["pgrads"].get(fqn) for r in range(self.world)]
            if any(g is None for g in gs):
                continue
            if gs[0][1]:  # Partial: the ranks' gradients summed
                sums[fqn] = sum(g.reshape(-1).double() for g, _ in gs)
            else:  # Shard(0), reduce-scattered in the backward: the shards, padded as sent
                full = torch.cat([g.reshape(-1).double() for g, _ in gs])
                if full.numel() <= summed.numel():
                    sums[fqn] = torch.cat([full, full.new_zeros(summed.numel() - full.numel())])
        hits = [f for f, g in sums.items() if self._close(summed, g, 1.0)]
        fqn = line["entries"][0]["fqn"]
        self.checked += 1
        if fqn is None:
            if hits:
                self.problems.append(f"{where}: unnamed, but it sums {hits[0]}'s gradient")
            self.unnamed_reductions += 1
            return
        if fqn not in sums:
            self.problems.append(f"{where}: named {fqn}, which has no Partial gradient")
        elif hits != [fqn]:
            self.problems.append(f"{where}: named {fqn}, the ranks' inputs summed are "
                                 f"{hits or 'no'} parameter's gradient")
        else:
            self.named_reductions.append((rank, step, fqn, line["collective"]))

    def run(self, fsdp2=True, allreduce=True, dtensor=True) -> list[str]:
        steps = len(self.truths[0]["steps"])
        for rank in range(self.world):
            for step in range(1, steps + 1):
                if fsdp2:
                    self.check_fsdp2(rank, step)
                if allreduce:
                    self.check_allreduce(rank, step)
                if dtensor:
                    self.check_dtensor(rank, step)
        for kind, cs in self.factors.items():
            if kind != "other" and cs and max(cs) - min(cs) > max(1e-3, 2 * self.rtol) * max(
                    abs(c) for c in cs):
                self.problems.append(f"{kind}: the factor between wire and gradient varies "
                                     f"({min(cs)}..{max(cs)})")
        return self.problems


def check(run: Path, rtol: float = 1e-5, **kw) -> tuple[list[str], int]:
    j = Judge(run, rtol)
    return j.run(**kw), j.checked


if __name__ == "__main__":
    import sys

    probs, n = check(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1e-5)
    print(f"{n} entries checked, {len(probs)} problem(s)")
    for p in probs[:40]:
        print(" ", p)


def values(run: Path) -> list:
    """Every rank's saved values (steps and final), without the wire record."""
    return [{"steps": t["steps"], "final": t["final"]} for t in load_truths(run)]


def load_truths(run: Path) -> list:
    import torch

    files = sorted(glob.glob(str(run) + ".truth.[0-9]*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    return [torch.load(f, weights_only=False) for f in files]


def records(run: Path) -> list:
    """What parity recorded per rank that the dispatch mode could change: the buckets.jsonl
    lines and the steps.jsonl roll-ups (digests, losses)."""
    out = []
    for d in sorted(Path(run).glob("rank-*")):
        steps = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]
        keep = ("step", "param_digest", "grad_digest", "loss", "loss_hash")
        out.append(((d / "buckets.jsonl").read_text() if (d / "buckets.jsonl").exists()
                    else "", [{k: s.get(k) for k in keep} for s in steps]))
    return out
