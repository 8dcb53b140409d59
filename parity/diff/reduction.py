"""Predict, from the manifests alone, which gradient elements a multi-node NCCL job would sum in
a different rank order on the two sides (``parity diff A B --at 8x8`` or ``--at 1x8,8x8,32x8``).

Why: on gloo, or on one node, a bucket whose payload order changed gives the same hashes; on a
cluster it can change the sums (torchtitan#3611). Whether it does depends on the channel (and,
for an all-reduce, the chunk) each element lands in, and on the ring that sums it. This module
answers the question a 256-GPU weight-hash run answers, without a rerun:

1. **Every reduction of every step.** Per side, the layouts in force at each step where a
   manifest changed (a parameter with no gradient at step 1 joins its bucket at step 2: the
   "late gradient"), for three kinds of reduction: reduce-scatter buckets (eager FSDP2, compiled
   graphs), all-reduce buckets recorded by capture/sources/c10d_allreduce.py (HSDP's replicate
   all-reduce, a trainer's own all-reduces, one per gradient or one flat buffer) and by compiled
   graphs (capture/sources/graph_walk.py: the same layout, one side's eager all-reduces aligned
   with the other's compiled ones), and eager
   DTensor reduce-scatters (counted: a gradient reduced by more collectives on one side is summed
   differently as a whole).
2. **Layouts at the target.** Each bucket is re-derived at the target topology from the captured
   payload order and the parameters' global shapes: FSDP2 / SimpleFSDP shard every gradient on
   dim 0 into ``ceil(dim0 / n)`` rows for a group of n ranks (``chunk_cat`` in FSDP2,
   ``reduce_scatter_merge_fn_to_trace`` in the bucketing pass); an all-reduce carries whole
   gradients (or, for HSDP, the reduce-scatter's shard row). The derivation is first checked
   against what was recorded at the capture's own group size; a bucket it does not reproduce is
   *not predicted* (said, never guessed). HSDP at the target: shard groups of one node (G ranks,
   reduce-scatter at 1xG), replicate groups of one rank per node (all-reduce at Nx1): an
   assumption, printed.
3. **The model** (``parity.nccl.predict`` through :func:`plans`, the one adapter): every scenario
   NCCL may run for a collective of that size (protocol, ring family, channel count), or
   ``unknown`` with the reason where Ring is not certain (PAT, NVLS, CollNet/SHARP, a tuner, an
   ``NCCL_ALGO``, a grouped call the model does not cover). NCCL settings recorded in the
   fingerprint (meta.json ``numerics.nccl_env``) are applied.
4. **At risk.** Rank d's element is summed in ``sum_order(ring of its channel, d)`` (an
   all-reduce element: its chunk's order). It is *at risk* when that order differs between A and
   B in some scenario (``same_sum``: the first addition commutes): an upper bound on the elements
   whose sum can change, since a different order changes bits only where rounding differs. The
   verdict is ``differs`` if any scenario of any bucket differs, ``unknown`` if none does but
   some bucket could not be predicted, ``same`` only if every differing bucket was predicted and
   none is at risk - for the captured model's bucket sizes.

Cost: per step and topology one pass of numpy over every parameter at once per scenario
combination (``reduction_count.count_at_risk``: each side's buckets laid end to end, the pieces a payload makes
with both sides' channel boundaries found by ``searchsorted``), plus one W x W comparison per
distinct pair of rings; layouts that repeat across steps are predicted once.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from parity.diff.buckets import (A_PREFERS, B_PREFERS, SEVERITY, Bucket, BucketPair, Layout,
                                 align_buckets, compare_layouts, eager_for, side_by_side)
from parity.diff.reduction_count import ChunkOrders, Orders, count_at_risk
from parity.diff.reduction_steps import (annotate_buckets, change_steps, group_size_of,
                                         infer_ops, layouts_at, one_sided_all_reduces, op_of,
                                         paired_all_reduces,
                                         signature, step_of)
from parity.errors import ParityError
from parity.nccl import MODEL, MODEL_LIMITS, Topology, Unknown, parse_topology
from parity.nccl import predict as nccl_predict
from parity.nccl.probe_file import describe_file

if TYPE_CHECKING:  # numpy is imported by the functions that count (a diff of equal runs: never)
    import numpy as np

SAME, DIFFERS, UNKNOWN = "same", "differs", "unknown"
RS, AR = "reduce_scatter", "all_reduce"
ONE_SIDED_AR = ("only {side} recorded all-reduce buckets{what} (the other side's, if any, ran where "
                "no manifest source sees them: a functional collective run eagerly, a C++ hook): "
                "not compared")
HSDP_REPLICATE = "fsdp2 replicate"  # c10d_allreduce.py: FSDP2's all-reduce of a shard row
MAX_STEPS = 32  # steps whose layouts are compared and predicted (those where a manifest changed)
BOUND = ("an upper bound: elements whose rank order of summation differs between A and B in "
         "some scenario NCCL may run; a different order changes bits only where rounding "
         "differs")
UPCAST = ("bf16 gradients reduced in fp32 rarely change: the sum of a few values with 8 "
          "significant bits is exact in fp32's 24, in any order, until many ranks or wide "
          "exponent spreads make it round")
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
             "complex64": 8}


# ------------------------------------------------------------ the NCCL model, in one adapter


@dataclass(frozen=True)
class Plan:
    """One scenario NCCL may run for one collective (a ``parity.nccl.Scenario``, flattened): the
    ranges its elements fall in and, per range, the ring (reduce-scatter: rank d's order is
    ``sum_order(ring, d)``) or the sum order itself (all-reduce chunk). The cluster-wide
    assumptions (the communicator's channel count, the ring family and its rings) must be the
    same for every collective of one run (:meth:`fits`)."""

    protocol: str
    family: str
    comm_channels: int
    nchannels: int
    starts: tuple[int, ...]
    orders: tuple[tuple[int, ...], ...]
    model: str = MODEL
    assumptions: tuple[str, ...] = ()
    rings: tuple[tuple[int, ...], ...] = ()  # the family's ring per channel, up to the last used

    def fits(self, cluster: list) -> bool:
        """Whether this scenario can run on ``cluster`` ([communicator channels, family names,
        rings]): the same channel count, a family in common, rings that agree channel by
        channel as far as both go (a larger collective uses more of the same rings)."""
        comm, names, rings = cluster
        k = min(len(rings), len(self.rings))
        return (self.comm_channels == comm and bool(names & set(self.family.split("+")))
                and rings[:k] == self.rings[:k])


# ops whose result does not depend on the order of the additions: nothing to predict
_ORDER_FREE_OPS = ("max", "min", "band", "bor", "bxor")
_MODEL_OPS = ("sum", "avg", "premul_sum", "prod")


def plans(topo: Topology, kind: str, count: int, esize: int, op: str = "sum",
          env: tuple = (), group: tuple = (), version: str | None = None
          ) -> tuple[Plan, ...] | str:
    """Every scenario NCCL may run for a ``kind`` collective of ``count`` elements (per rank for
    a reduce-scatter, the whole buffer for an all-reduce) at ``topo`` (``parity.nccl.predict``),
    or the reason Ring is not certain (an ``unknown``: PAT, NVLS, Tree, CollNet, a tuner, NCCL
    settings). ``env``: the fingerprint's NCCL settings as sorted (key, value) pairs; ``group``:
    the counts of the other collectives of the same NCCL group (a coalesced call). Memoised:
    buckets of one size ask once. An order-free op (MIN/MAX) has no scenario to compare."""
    if op in _ORDER_FREE_OPS:
        return ()
    return _plans(topo, kind, count, esize, op if op in _MODEL_OPS else "sum", tuple(env),
                  tuple(group), version)


@functools.lru_cache(maxsize=4096)
def _plans(topo: Topology, kind: str, count: int, esize: int, op: str, env: tuple,
           group: tuple, version: str | None) -> tuple[Plan, ...] | str:
    got = nccl_predict(topo, kind, count, esize, op=op, env=dict(env), group=group,
                       version=version)
    if isinstance(got, Unknown):
        return got.reason
    release, _, where = got.version.partition(" ")
    model = f"{MODEL}, NCCL {release} rules"
    said = (f"NCCL {release} {where.strip('()')}",) if where else ()
    return tuple(Plan(s.protocol, s.family, s.comm_channels, s.nchannels,
                      tuple(seg.lo for seg in s.segments), tuple(seg.order for seg in s.segments),
                      model, said + tuple(s.assumptions) + tuple(got.notes), tuple(s.rings))
                 for s in got.scenarios)


# ------------------------------------------------------------------------------ the result


@dataclass
class AtRisk:
    """One parameter whose gradient would be summed differently at the target topology."""

    fqn: str
    elements: int  # elements of the full gradient summed in another rank order (worst scenario)
    numel: int  # elements of the full gradient
    bucket: dict  # {"collective", "a": A's bucket index | None, "b": B's}
    why: str  # "order" (channel -> ring differs) | "structure" | "dtype"
    step: int | None = None  # the first step at which it is at risk

    @property
    def fraction(self) -> float:
        return min(1.0, self.elements / self.numel) if self.numel else 0.0

    def to_dict(self) -> dict:
        return {"fqn": self.fqn, "elements": self.elements, "fraction": round(self.fraction, 6),
                "numel": self.numel, "bucket": dict(self.bucket), "why": self.why,
                "step": self.step}


@dataclass
class ReductionPrediction:
    """``reduction_order`` of the diff result at one topology (docs/reduction-order.md).

    ``verdict``: ``differs`` when any element is at risk in any scenario, ``unknown`` when none
    is but some bucket could not be predicted (``unpredicted``, ``unknown`` say why), ``same``
    when every differing bucket was predicted and none is at risk."""

    topology: Topology
    verdict: str
    at_risk: list[AtRisk] = field(default_factory=list)
    unpredicted: list[dict] = field(default_factory=list)  # {collective, a, b, reason}
    unknown: list[dict] = field(default_factory=list)  # {collective, a, b, step, reason}
    buckets: list[dict] = field(default_factory=list)  # per differing bucket: the reasoning
    params_checked: int = 0  # parameters whose reduction layout differs
    rank: int | None = None  # the captured rank whose layouts were used
    source: str | None = None  # "model" | the NCCL log's path
    model: str = MODEL
    notes: list[str] = field(default_factory=list)  # what of an NCCL log could not be used
    assumptions: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps whose layouts were predicted
    emulated: str | None = None  # the topology both runs were emulated at (exec --emulate-nccl)
    observed: dict | None = None  # predicted vs observed, when emulated at this topology

    def fqns(self) -> set[str]:
        """The parameters at risk (what an emulated run may show diverging)."""
        return {x.fqn for x in self.at_risk}

    def to_dict(self) -> dict:
        return {"topology": _topology_dict(self.topology, self.buckets), "model": self.model,
                "topology_file": describe_file(self.topology),  # nccl-probe's agreement
                "limits": MODEL_LIMITS, "verdict": self.verdict, "bound": BOUND,
                "upcast": UPCAST, "at_risk": [x.to_dict() for x in self.at_risk],
                "elements_at_risk": sum(x.elements for x in self.at_risk),
                "params_checked": self.params_checked,
                "unpredicted": [dict(x) for x in self.unpredicted],
                "unknown": [dict(x) for x in self.unknown],
                "buckets": [dict(x) for x in self.buckets],
                "assumptions": list(self.assumptions), "steps": list(self.steps),
                "rank": self.rank, "source": self.source or "model", "notes": list(self.notes),
                "emulated": self.emulated, "observed": self.observed}


class Predictions(list):
    """Predictions at several topologies (``--at 1x8,8x8``): ``reduction_order`` is then a list
    in the JSON, one object per topology, in the order given."""

    def to_dict(self) -> list[dict]:
        return [p.to_dict() for p in self]

    def fqns(self) -> set[str]:
        return set().union(*(p.fqns() for p in self)) if self else set()

    @property
    def verdict(self) -> str:
        vs = {p.verdict for p in self}
        return DIFFERS if DIFFERS in vs else UNKNOWN if UNKNOWN in vs else SAME


def _topology_dict(topo: Topology, buckets: list[dict]) -> dict:
    """The topology as JSON, with what the model assumed where the user set nothing: never a
    ``"channels": null``; the communicator channel counts assumed are listed instead."""
    d = {k: v for k, v in topo.to_dict().items() if v is not None}
    if d.get("channels") is None:
        d.pop("channels", None)
        comm = sorted({s["comm_channels"] for b in buckets for s in b.get("scenarios") or []
                       if isinstance(s.get("comm_channels"), int)})
        if comm:
            d["comm_channels_assumed"] = comm
    return d


# ---------------------------------------------------------------- layouts at the target


class Slot(NamedTuple):
    """One payload of a collective's per-rank buffer at the target (elements). A named tuple:
    a prediction makes one per payload and side."""

    fqn: str
    offset: int  # element offset in the per-rank buffer
    rows: int  # dim-0 rows per rank (ceil(dim0 / n)); an all-reduce of a whole tensor: dim0
    row: int  # elements per dim-0 row
    dim0: int


def _dims(shape) -> tuple[int, int] | None:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
        return None
    if not shape:
        return 1, 1  # a 0-d gradient: one element, padded to one per rank
    return shape[0], math.prod(shape[1:])


def _bucket_dtype(bucket: Bucket) -> tuple[str, int] | str:
    dtypes = {e.dtype for e in bucket.entries if e.dtype} | ({bucket.dtype} if bucket.dtype else set())
    if len(dtypes) != 1:
        return (f"payload dtypes {sorted(dtypes)} (mixed or unrecorded)" if dtypes
                else "no dtype recorded")
    dtype = dtypes.pop()
    esize = _ITEMSIZE.get(dtype)
    if esize is None:
        return f"dtype {dtype} not modelled"
    return dtype, esize


def derive_layout(bucket: Bucket, shapes: dict[str, list[int]], world: int,
                  capture_world: int | None = None,
                  _dims_of: dict | None = None) -> tuple[list[Slot], int, int] | str:
    """A bucket's per-rank buffer when every payload is a dim-0 shard over ``world`` ranks:
    (slots, per-rank count, element size), or the reason it cannot be derived. With
    ``capture_world`` the model is first checked against the recorded offsets and sizes at that
    group size."""
    got = _bucket_dtype(bucket)
    if isinstance(got, str):
        return got
    _, esize = got
    dims = []
    for e in bucket.entries:
        if e.fqn is None:
            return "a payload without a name (a flat buffer no gradient was matched to)"
        if _dims_of is None:
            d = _dims(shapes.get(e.fqn))
        else:  # predict's memo: each shape checked once, not once per bucket and side
            d = _dims_of.get(e.fqn, False)
            if d is False:
                d = _dims_of[e.fqn] = _dims(shapes.get(e.fqn))
        if d is None:
            return f"no global shape for {e.fqn}"
        dims.append(d)
    if capture_world:
        off = 0
        for e, (dim0, row) in zip(bucket.entries, dims):
            numel = -(-dim0 // capture_world) * row
            if (e.numel is not None and e.numel != numel) or (
                    e.offset is not None and e.offset != off * esize):
                return (f"{e.fqn}: recorded {e.numel} elements at byte {e.offset}, but dim-0 "
                        f"shards of {dim0}x{row} at {capture_world} ranks give {numel} at byte "
                        f"{off * esize} (not FSDP2 dim-0 shards with padding)")
            off += numel
    slots, off = [], 0
    for e, (dim0, row) in zip(bucket.entries, dims):
        rows = -(-dim0 // world)
        slots.append(Slot(e.fqn, off, rows, row, dim0))
        off += rows * row
    return slots, off, esize


@dataclass
class _Coll:
    """One collective of one side at the target: its group's topology, its buffer, and the
    ranks among which its payloads are sharded (``owners``: the group size for a
    reduce-scatter, the shard group's for an HSDP all-reduce, 1 for a whole-tensor one)."""

    kind: str
    key: tuple  # (kind, bucket index[, payload]) on this side
    bucket: Bucket
    topo: Topology
    owners: int
    slots: list[Slot]
    count: int
    esize: int
    op: str = "sum"
    group: tuple = ()


@dataclass
class _Context:
    """What every step and topology of one prediction shares."""

    shapes: dict
    capture_world: int | None
    env: tuple = ()
    version: str | None = None
    dims_of: dict = field(default_factory=dict)
    ar_only: str | None = None  # "A" / "B": only that side recorded all-reduce buckets
    ar_what: str = ""  # " of gradients": only that side's carry gradients (one_sided_all_reduces)


def _hsdp(buckets: list[Bucket], capture_world: int | None) -> bool:
    """Whether a side's reduce-scatters ran on a sub-group (HSDP or 2-D parallelism)."""
    return bool(capture_world) and any(
        isinstance(group_size_of(b), int) and 1 < group_size_of(b) < capture_world for b in buckets)


def _group_topo(topo: Topology, nodes: int, gpus: int) -> Topology:
    """A sub-communicator of ``topo``'s cluster: a log's rings and tuning rows are the world's."""
    if (nodes, gpus) == (topo.nodes, topo.gpus):
        return topo
    return replace(topo, nodes=nodes, gpus=gpus, rings=None, tuning=None, ring_prefixes=None,
                   nics=None, source=None)


def _colls(kind: str, buckets: list[Bucket], topo: Topology, ctx: _Context, sub: bool
           ) -> tuple[list[_Coll], dict[int, str]]:
    """A side's collectives of ``kind`` at ``topo``, and per bucket index the reason one could
    not be derived. ``sub``: the side's reduce-scatters ran on shard groups (HSDP). A coalesced
    bucket is one collective per payload, in one NCCL group (``group``: the others' counts)."""
    out, bad = [], {}
    for b in buckets:
        gw = group_size_of(b)
        if getattr(b, "sparse", False):
            bad[b.index] = ("a sparse gradient (DDP all-reduces it sparse): the model covers "
                            "dense buffers")
            continue
        if kind == RS and sub:  # HSDP: shard groups of one node at the target (said)
            gt, owners, n, check = _group_topo(topo, 1, topo.gpus), topo.gpus, topo.gpus, gw
        elif kind == RS:
            gt, owners, n, check = topo, topo.world, topo.world, ctx.capture_world
        elif getattr(b, "module", None) == HSDP_REPLICATE:  # a shard row, over one rank a node
            gt, owners, n = _group_topo(topo, topo.nodes, 1), topo.gpus, topo.gpus
            check = (ctx.capture_world // gw) if ctx.capture_world and gw else None
        elif gw in (None, ctx.capture_world) or not ctx.capture_world:
            gt, owners, n, check = topo, 1, 1, 1  # whole tensors, over every rank
        else:
            bad[b.index] = (f"an all-reduce over {gw} of {ctx.capture_world} ranks (not HSDP's "
                            "replicate group): which ranks it spans at the target is not known")
            continue
        got = derive_layout(b, ctx.shapes, n, check, ctx.dims_of)
        if isinstance(got, str):
            bad[b.index] = got
            continue
        slots, count, esize = got
        if getattr(b, "coalesced", False) and len(slots) > 1:
            sizes = [x.rows * x.row for x in slots]
            for k, x in enumerate(slots):
                others = tuple(c for j, c in enumerate(sizes) if j != k)
                out.append(_Coll(kind, (kind, b.index, k), b, gt, owners, [x._replace(offset=0)],
                                 sizes[k], esize, op_of(b), others))
            continue
        out.append(_Coll(kind, (kind, b.index), b, gt, owners, slots, count, esize, op_of(b)))
    return out, bad


# -------------------------------------------------------------------------- one step's answer


def _reduce_counts(kind: str, layout: Layout, ar: list[Bucket], eager: list[dict],
                   shapes: dict) -> dict[str, int]:
    """fqn -> how many collectives of ``kind`` reduce its gradient on this side (buckets, plus
    eager DTensor collectives of it)."""
    out: dict[str, int] = {}
    if kind == RS:
        for b in layout.buckets.get(RS, []):
            for f in dict.fromkeys(b.fqns):  # in payload order: the JSON order is deterministic
                out[f] = layout.repeats.get((RS, f), 1)
    else:
        for b in ar:
            for f in dict.fromkeys(x for x in b.fqns if x):
                out[f] = out.get(f, 0) + 1
    runs = [r for r in eager or [] if r.get("collective") == kind]
    if runs:
        for f, shape in shapes.items():
            got = eager_for(f, "x".join(str(s) for s in shape or []), runs)
            if got:
                out[f] = out.get(f, 0) + sum(int(r.get("count") or 1) for r in got)
    return out


@dataclass
class _StepAnswer:
    at_risk: dict = field(default_factory=dict)  # (kind, fqn) -> AtRisk
    unpredicted: list = field(default_factory=list)
    unknown: list = field(default_factory=list)
    buckets: list = field(default_factory=list)
    checked: set = field(default_factory=set)
    kinds: set = field(default_factory=set)  # kinds of reduction either side recorded
    models: dict = field(default_factory=dict)  # the model's name per release used, in order
    assumptions: dict = field(default_factory=dict)  # every scenario's assumptions, in order


def _env_items(env) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in (env or {}).items() if v is not None))


def _predict_kind(kind: str, la: Layout, lb: Layout, ara: list[Bucket], arb: list[Bucket],
                  topo: Topology, ctx: _Context, counts: tuple[dict, dict], step: int | None,
                  ans: _StepAnswer, assumptions: list[str]) -> None:
    """One kind of reduction at one step and topology, into ``ans``."""
    ba = la.buckets.get(RS, []) if kind == RS else ara
    bb = lb.buckets.get(RS, []) if kind == RS else arb
    na, nb = counts
    if not ba and not bb and not na and not nb:
        return
    ans.kinds.add(kind)
    if kind == AR and ctx.ar_only:
        ans.unpredicted.append({"collective": AR, "a": None, "b": None, "step": step,
                                "reason": ONE_SIDED_AR.format(side=ctx.ar_only,
                                                                   what=ctx.ar_what)})
        return
    names = {id(b): tuple(b.fqns) for b in (*ba, *bb)}
    # the op is left out: a compiled graph's is not recorded (reduction_order's assumptions)
    by_b = {(names[id(b)], b.dtype, group_size_of(b)): b.index for b in bb}
    same_bucket = {b.index: by_b.get((names[id(b)], b.dtype, group_size_of(b))) for b in ba}
    first: dict[str, dict[str, int]] = {"a": {}, "b": {}}
    for side, bs in (("a", ba), ("b", bb)):
        for b in bs:
            for f in names[id(b)]:
                if f:
                    first[side].setdefault(f, b.index)
    # buckets the same on both sides (same payloads, order, dtype, op) whose payloads are first
    # there on both sides cannot differ: their layouts are not derived
    skip: dict[str, set] = {"a": set(), "b": set()}
    for b in ba:
        j = same_bucket.get(b.index)
        if j is not None and all(f and first["a"][f] == b.index and first["b"].get(f) == j
                                 for f in names[id(b)]):
            skip["a"].add(b.index)
            skip["b"].add(j)
    sub = {"a": kind == RS and _hsdp(ba, ctx.capture_world),
           "b": kind == RS and _hsdp(bb, ctx.capture_world)}
    if sub["a"] or sub["b"] or any(getattr(b, "module", None) == HSDP_REPLICATE
                                   for b in (*ara, *arb)):
        text = (f"HSDP at {topo.spec()}: shard groups of one node ({topo.gpus} ranks, "
                f"reduce-scatter at 1x{topo.gpus}), replicate groups of one rank per node "
                f"(all-reduce at {topo.nodes}x1)")
        if text not in assumptions:
            assumptions.append(text)
    colls: dict[str, dict] = {}
    slots: dict[str, dict] = {}
    bad: dict[tuple, str] = {}
    for side, bs in (("a", ba), ("b", bb)):
        made, why = _colls(kind, [b for b in bs if b.index not in skip[side]], topo, ctx,
                           sub[side])
        colls[side] = {c.key: c for c in made}
        bad.update({(side, i): r for i, r in why.items()})
        sl: dict[str, tuple] = {}
        for b in bs:
            if b.index in skip[side]:
                for f in names[id(b)]:
                    sl.setdefault(f, (None, None, b))
        for c in made:
            for x in c.slots:
                sl.setdefault(x.fqn, (x, c, c.bucket))
        for b in bs:  # a bucket not derived: its payloads are known, their slots are not
            for f in names[id(b)]:
                if f:
                    sl.setdefault(f, (None, None, b))
        slots[side] = sl
    said: set = set()
    pending: dict[int, list] = {}  # owners -> entries
    for f in dict.fromkeys([*na, *nb]):
        sa, sb = slots["a"].get(f), slots["b"].get(f)
        ia = sa[2].index if sa else None
        ib = sb[2].index if sb else None
        if ia is not None and ib is not None and same_bucket.get(ia) == ib \
                and na.get(f) == nb.get(f):
            continue
        where = {"collective": kind, "a": ia, "b": ib}
        ans.checked.add((kind, f))
        dims = ctx.dims_of[f] if f in ctx.dims_of else _dims(ctx.shapes.get(f))
        numel = dims[0] * dims[1] if dims else 0
        if na.get(f, 0) != nb.get(f, 0):
            _keep_worst(ans, kind, AtRisk(f, numel, numel, where, "structure", step))
            continue
        if sa is None or sb is None:
            continue  # reduced by eager collectives alike on both sides: not modelled here
        if sa[2].dtype != sb[2].dtype:
            _keep_worst(ans, kind, AtRisk(f, numel, numel, where, "dtype", step))
            continue
        why = bad.get(("a", ia)) or bad.get(("b", ib))
        if why is not None or sa[0] is None or sb[0] is None:
            if (ia, ib) not in said:
                said.add((ia, ib))
                ans.unpredicted.append({**where, "step": step,
                                        "reason": why or "layout not derived"})
            continue
        slot_a, slot_b, ca, cb = sa[0], sb[0], sa[1], sb[1]
        if (slot_a.rows, slot_a.row) != (slot_b.rows, slot_b.row) or ca.owners != cb.owners:
            _keep_worst(ans, kind, AtRisk(f, numel, numel, where, "structure", step))
            continue
        n = ca.owners
        length = slot_a.rows * slot_a.row
        # owners 0..full-1 hold whole shards (length elements), owner ``full`` holds ``part``
        # real elements, the rest only padding
        full = min(n, slot_a.dim0 // slot_a.rows) if slot_a.rows else 0
        part = (slot_a.dim0 - full * slot_a.rows) * slot_a.row if full < n else 0
        pending.setdefault(n, []).append((ca.key, cb.key, slot_a.offset, slot_b.offset, length,
                                          full, part, (f, numel, where)))
    for n, entries in pending.items():
        _count_entries(kind, n, entries, colls, ctx, step, ans)


def _keep_worst(ans: _StepAnswer, kind: str, x: AtRisk) -> None:
    old = ans.at_risk.get((kind, x.fqn))
    if old is None or x.elements > old.elements:
        ans.at_risk[(kind, x.fqn)] = x


def _count_entries(kind: str, n: int, entries: list, colls: dict, ctx: _Context,
                   step: int | None, ans: _StepAnswer) -> None:
    """Elements at risk of ``entries`` (one group size) over every scenario combination."""
    import numpy as np

    involved = {"a": {}, "b": {}}
    for e in entries:
        involved["a"][e[0]] = colls["a"][e[0]]
        involved["b"][e[1]] = colls["b"][e[1]]
    got: dict[str, dict] = {"a": {}, "b": {}}
    said: set[int] = set()
    for side in ("a", "b"):
        for key, c in involved[side].items():
            got[side][key] = ps = plans(c.topo, kind, c.count, c.esize, c.op, ctx.env, c.group,
                                        ctx.version)
            if isinstance(ps, str) or id(ps) in said:
                continue
            said.add(id(ps))  # collectives of one size share one tuple of plans
            spec = c.topo.spec()
            for p in ps:
                ans.models.setdefault(p.model)
                ans.assumptions.update(dict.fromkeys(f"{spec}: {a}" for a in p.assumptions))
    # a collective the model cannot know: its payloads are unknown, said per bucket pair
    unknown_pairs: dict[tuple, str] = {}
    live = []
    for e in entries:
        pa, pb = got["a"][e[0]], got["b"][e[1]]
        if isinstance(pa, str) or isinstance(pb, str):
            why = pa if isinstance(pa, str) else pb
            guessed = colls["a" if isinstance(pa, str) else "b"][e[0] if isinstance(pa, str)
                                                                 else e[1]].bucket
            if getattr(guessed, "op_guessed", False):
                why += " (a compiled graph's reduce op is not recorded: counted as a SUM)"
            unknown_pairs.setdefault((e[7][2]["a"], e[7][2]["b"]), why)
            continue
        live.append(e)
    for (ia, ib), why in unknown_pairs.items():
        ans.unknown.append({"collective": kind, "a": ia, "b": ib, "step": step, "reason": why})
    best = np.zeros(len(live), dtype=np.int64)
    if live:
        orders = Orders(n) if kind == RS else ChunkOrders(n)
        same_size = np.array([
            (colls["a"][e[0]].count, colls["a"][e[0]].esize, colls["a"][e[0]].group)
            == (colls["b"][e[1]].count, colls["b"][e[1]].esize, colls["b"][e[1]].group)
            for e in live], dtype=bool)
        entries = [e[:7] for e in live]
        keys = {s: list(got[s]) for s in ("a", "b")}  # each entry's collective, by position
        pos = {s: {k: i for i, k in enumerate(keys[s])} for s in ("a", "b")}
        where = {"a": np.array([pos["a"][e[0]] for e in live], dtype=np.int64),
                 "b": np.array([pos["b"][e[1]] for e in live], dtype=np.int64)}
        done: set = set()
        for ci, cluster in enumerate(_clusters(got)):
            # per collective: its scenarios on this cluster, by protocol (collectives of one
            # size share one tuple of plans: each tuple is sorted out once)
            memo: dict[int, dict] = {}
            pick: dict[str, dict] = {"a": {}, "b": {}}
            for side in ("a", "b"):
                for k, ps in got[side].items():
                    by = memo.get(id(ps))
                    if by is None:
                        fit = [p for p in ps if p.fits(cluster)]
                        by = memo[id(ps)] = {"": (fit or list(ps))[0],
                                             **{p.protocol: p for p in reversed(fit)}}
                    pick[side][k] = by
            protos = {s: sorted({q for by in pick[s].values() for q in by if q}, key=str)
                      for s in ("a", "b")}
            # per entry, whether its collective may run protocol q on this cluster
            has = {s: {q: np.array([q in pick[s][k] for k in keys[s]], dtype=bool)[where[s]]
                       for q in protos[s]} for s in ("a", "b")}
            for pa in protos["a"]:
                for pb in protos["b"]:
                    if pa != pb and same_size.all():
                        continue  # one size, one protocol choice: nothing to count
                    chan_a = {k: _chan(by.get(pa, by[""]), colls["a"][k])
                              for k, by in pick["a"].items()}
                    chan_b = {k: _chan(by.get(pb, by[""]), colls["b"][k])
                              for k, by in pick["b"].items()}
                    sig = (tuple(id(v[1]) for v in chan_a.values()),
                           tuple(id(v[1]) for v in chan_b.values()), pa == pb)
                    if sig in done:
                        continue
                    done.add(sig)
                    ok = has["a"][pa] & has["b"][pb]
                    if pa != pb:
                        ok &= ~same_size  # one size, one protocol choice
                    if not ok.any():
                        continue
                    c = count_at_risk(entries, chan_a, chan_b, orders)
                    best = np.maximum(best, np.where(ok, c, 0))
    for e, nrisk in zip(live, best.tolist()):
        if nrisk:
            f, numel, where = e[7]
            _keep_worst(ans, kind, AtRisk(f, nrisk, numel, where, "order", step))
    _describe_buckets(kind, live, best.tolist(), colls, got, step, ans)


def _clusters(got: dict) -> list[list]:
    """The clusters the scenarios of every collective of both sides describe: [communicator
    channels, family names, rings], each scenario joined to the first one it fits (the longest
    rings kept)."""
    out: list[list] = []
    seen: set[int] = set()
    for side in ("a", "b"):
        for ps in got[side].values():
            if isinstance(ps, str) or id(ps) in seen:
                continue
            seen.add(id(ps))  # collectives of one size share one tuple of plans
            for p in ps:
                cl = next((c for c in out if p.fits(c)), None)
                if cl is None:
                    out.append([p.comm_channels, set(p.family.split("+")), p.rings])
                elif len(p.rings) > len(cl[2]):
                    cl[2] = p.rings
    return out


def _chan(plan: Plan, coll: _Coll) -> tuple:
    return plan.starts, plan.orders, coll.count


def _describe_buckets(kind: str, live: list, risk: list, colls: dict, got: dict,
                      step: int | None, ans: _StepAnswer) -> None:
    """Per differing bucket pair: bytes per rank at the target, the scenarios (protocol, ring
    family, the communicator's and this collective's channels) and the elements at risk."""
    pairs: dict[tuple, dict] = {}
    scenarios: dict[tuple, list] = {}  # per pair of plan tuples: collectives of one size share
    for e, nrisk in zip(live, risk):
        ca, cb = colls["a"][e[0]], colls["b"][e[1]]
        k = (e[0], e[1])
        d = pairs.get(k)
        if d is None:
            key = (id(got["a"][e[0]]), id(got["b"][e[1]]))
            scen = scenarios.get(key)
        if d is None and scen is None:
            scen = scenarios[key] = []
            for pa in got["a"][e[0]]:
                pb = next((p for p in got["b"][e[1]] if p.protocol == pa.protocol and p.fits(
                    [pa.comm_channels, set(pa.family.split("+")), pa.rings])), None)
                scen.append({"protocol": pa.protocol, "family": pa.family,
                             "comm_channels": pa.comm_channels,
                             "channels": {"a": pa.nchannels,
                                          "b": pb.nchannels if pb is not None else None}})
            for pb in got["b"][e[1]]:
                if not any(s["protocol"] == pb.protocol and s["family"] == pb.family
                           and s["comm_channels"] == pb.comm_channels for s in scen):
                    scen.append({"protocol": pb.protocol, "family": pb.family,
                                 "comm_channels": pb.comm_channels,
                                 "channels": {"a": None, "b": pb.nchannels}})
        if d is None:
            d = pairs[k] = {
                "collective": kind, "step": step, "a": ca.bucket.index, "b": cb.bucket.index,
                "group": ca.topo.spec(), "bytes_per_rank": {"a": ca.count * ca.esize,
                                                            "b": cb.count * cb.esize},
                "scenarios": scen,  # shared by buckets of one size: never edited
                "elements": 0, "params": 0}
        d["elements"] += nrisk
        d["params"] += 1 if nrisk else 0
    for d in pairs.values():
        d["verdict"] = DIFFERS if d["elements"] else SAME
        ans.buckets.append(d)


def predict(layouts: dict[str, Layout], shapes: dict[str, list[int]], topology: Topology | str,
            capture_world: int | None = None, eager: dict[str, list[dict]] | None = None,
            source: str | None = None, _counts: tuple[dict, dict] | None = None,
            all_reduce: dict[str, list[Bucket]] | None = None, env: dict | None = None,
            version: str | None = None) -> ReductionPrediction:
    """The prediction for one step's layouts of both sides (``{"a": Layout, "b": Layout}``, as
    ``parity.diff.buckets.compare_buckets`` returns them; ``all_reduce``: each side's all-reduce
    buckets), the parameters' global shapes (params.json ``global_shape``), at ``topology`` (a
    Topology or ``NODESxGPUS[:...]``). ``capture_world``: the captured world size, to check the
    derivation against the recorded layouts; ``eager``: ``order.eager`` (eager DTensor
    collectives count as collectives); ``env``: the fingerprint's NCCL settings."""
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    ctx = _Context(shapes, capture_world, _env_items(env), version)
    ar = all_reduce or {}
    for lay in layouts.values():
        infer_ops(lay)
    steps = [b.step for lay in layouts.values() for b in lay.buckets.get(RS, [])
             if isinstance(b.step, int)]
    step = min(steps) if steps else None  # the layouts' own step, as recorded
    got = _answer(layouts["a"], layouts["b"], ar.get("a") or [], ar.get("b") or [],
                  eager or {}, topo, ctx, step, _counts)
    return _finish(topo, [got], layouts["a"].rank, source, [step] if step is not None else [])


def _answer(la: Layout, lb: Layout, ara: list[Bucket], arb: list[Bucket], eager: dict,
            topo: Topology, ctx: _Context, step: int | None,
            counts: tuple[dict, dict] | None = None) -> tuple[_StepAnswer, list[str]]:
    ans, assumptions = _StepAnswer(), []
    for kind in (RS, AR):
        if kind == RS and counts is not None:
            c = counts
        else:
            c = (_reduce_counts(kind, la, ara, eager.get("a") or [], ctx.shapes),
                 _reduce_counts(kind, lb, arb, eager.get("b") or [], ctx.shapes))
        _predict_kind(kind, la, lb, ara, arb, topo, ctx, c, step, ans, assumptions)
    return ans, assumptions


def _finish(topo: Topology, answers: list, rank: int | None, source: str | None,
            steps: list[int]) -> ReductionPrediction:
    """One topology's answers of every step merged: per parameter the worst step, every
    bucket and reason said once."""
    pred = ReductionPrediction(topo, SAME, rank=rank, source=source, steps=list(steps))
    worst: dict[tuple, AtRisk] = {}
    checked: set = set()
    seen_u, seen_k, seen_b = set(), set(), set()
    for ans, assumptions in answers:
        checked |= ans.checked
        for key, x in ans.at_risk.items():
            old = worst.get(key)
            if old is None or x.elements > old.elements:
                worst[key] = x if old is None else replace(x, step=old.step)
        for u in ans.unpredicted:
            k = (u["collective"], u["a"], u["b"], u["reason"])
            if k not in seen_u:
                seen_u.add(k)
                pred.unpredicted.append(u)
        for u in ans.unknown:
            k = (u["collective"], u["a"], u["b"], u["reason"])
            if k not in seen_k:
                seen_k.add(k)
                pred.unknown.append(u)
        for b in ans.buckets:
            k = (b["collective"], b["a"], b["b"], b["bytes_per_rank"]["a"],
                 b["bytes_per_rank"]["b"])
            if k not in seen_b:
                seen_b.add(k)
                pred.buckets.append(b)
        for a in [*assumptions, *ans.assumptions]:
            if a not in pred.assumptions:
                pred.assumptions.append(a)
        if ans.models and pred.model == MODEL:
            pred.model = next(iter(ans.models))
    pred.at_risk = list(worst.values())
    pred.params_checked = len({f for _, f in checked})
    if not any(ans.kinds for ans, _ in answers):
        pred.unpredicted.append({"collective": RS, "a": None, "b": None,
                                 "reason": "no reduction layouts recorded"})
    if pred.at_risk:
        pred.verdict = DIFFERS
    elif pred.unpredicted or pred.unknown:
        pred.verdict = UNKNOWN
    return pred


# ------------------------------------------------------------------- the diff engine's entry


def topology_of(at, nccl_log: str | None) -> tuple[Topology | list[Topology] | None, list[str]]:
    """``--at`` / ``--nccl-log`` -> the topology (or topologies: ``--at 1x8,8x8``) to predict
    at (None: neither) and notes on what of the log could not be used. Bad input raises a
    one-line ParityError (exit 2)."""
    specs = split_topologies(at)
    topos = [parse_topology(s) for s in specs]
    notes: list[str] = []
    if nccl_log:
        from parity.nccl import parse_nccl_log

        if len(topos) > 1:
            raise ParityError("--nccl-log describes one cluster: give one --at topology with it")
        topo, notes = parse_nccl_log(nccl_log, topos[0] if topos else None)
        return topo, notes
    if not topos:
        return None, notes
    return (topos[0] if len(topos) == 1 else topos), notes


_NEXT_TOPOLOGY = re.compile(r",(?=\s*\d+\s*x\s*\d+)")


def split_topologies(at) -> list[str]:
    """``"1x8,8x8:channels=16,proto=LL,32x8"`` -> one spec per topology (a comma starts a new
    topology only before ``NODESxGPUS``; options keep theirs). Lists are flattened."""
    if at is None:
        return []
    items = [at] if isinstance(at, str) else list(at)
    out: list[str] = []
    for item in items:
        if isinstance(item, Topology):
            out.append(item.spec())
            continue
        out += [s.strip() for s in _NEXT_TOPOLOGY.split(str(item)) if s.strip()]
    if not out and items:
        raise ParityError("--at: no topology given (e.g. 8x8 or 1x8,8x8,32x8)")
    return out


def shapes_of(params: list[dict]) -> dict[str, list[int]]:
    """fqn -> global shape from a rank's params.json table (``global_shape``, else ``shape``)."""
    out = {}
    for p in params or []:
        f = p.get("fqn")
        shape = p.get("global_shape") or p.get("shape")
        if isinstance(f, str) and isinstance(shape, list):
            out.setdefault(f.split("#", 1)[0], shape)
    return out


def predict_runs(a_dir: str | Path, b_dir: str | Path, topology
                 ) -> ReductionPrediction | Predictions:
    """The prediction for two run directories from their manifests and parameter tables alone
    (no hash comparison; ``parity diff --at`` gives the same ``reduction_order``)."""
    from parity.artifacts import read_run
    from parity.diff.buckets import compare_buckets

    run_a, run_b = read_run(a_dir), read_run(b_dir)
    usable = {side: sorted(r for r, rd in run.ranks.items() if rd.params)
              for side, run in (("a", run_a), ("b", run_b))}
    ranks = sorted(set(usable["a"]) & set(usable["b"]))
    layouts, order = compare_buckets(run_a, run_b, usable, ranks)
    world = run_a.world_size or (max(run_a.ranks) + 1 if run_a.ranks else None)
    return assess(run_a, run_b, ranks, layouts, order, world, topology)


def annotate(order, layouts: dict[str, Layout], shapes: dict[str, list[int]],
             _counts: tuple[dict, dict] | None = None,
             all_reduce: dict[str, list[Bucket]] | None = None) -> None:
    """Consequence classes on the order comparison (parity.consequences): a reduce-scatter or
    all-reduce group carrying a gradient that the two sides reduce with a different number of
    collectives becomes ``reduction_structure``; ``order.structure`` lists such gradients and
    ``order.consequences`` counts the differing groups per class."""
    from parity import consequences as cq

    ar = all_reduce or {}
    odd: set = set()
    order.structure = []
    for kind in (RS, AR):
        if kind == RS and _counts is not None:
            na, nb = _counts
        else:
            na = _reduce_counts(kind, layouts["a"], ar.get("a") or [], order.eager.get("a") or [],
                                shapes)
            nb = _reduce_counts(kind, layouts["b"], ar.get("b") or [], order.eager.get("b") or [],
                                shapes)
        for f in dict.fromkeys([*na, *nb]):
            if na.get(f, 0) != nb.get(f, 0):
                order.structure.append({"fqn": f, "a": na.get(f, 0), "b": nb.get(f, 0),
                                        **({"collective": AR} if kind == AR else {})})
                odd.add(f)
    counts: dict[str, int] = {}
    for p in order.pairs:
        if p.verdict == "identical":
            continue
        fqns = {m["fqn"] for m in p.moved} | {e["fqn"] for e in (p.a_entry, p.b_entry) if e}
        structure = bool(odd) and p.collective in cq.REDUCING and bool(fqns & odd)
        p.consequence = cq.classify(p.collective, p.verdict, structure)
        counts[p.consequence] = counts.get(p.consequence, 0) + 1
    if odd and not any(p.consequence == cq.REDUCTION_STRUCTURE for p in order.pairs):
        counts[cq.REDUCTION_STRUCTURE] = counts.get(cq.REDUCTION_STRUCTURE, 0) + 1
    order.consequences = counts
    fb = order.first_bucket
    if isinstance(fb, dict) and fb.get("collective"):
        lead = next((p for p in order.pairs if p.verdict != "identical"
                     and p.collective == fb["collective"] and fb.get("index") in p.a
                     and p.verdict == fb.get("verdict")), None)
        if lead is not None:
            fb["consequence"] = lead.consequence


def _add_pairs(order, pairs: list[BucketPair], la: Layout, lb: Layout,
               ara: list[Bucket], arb: list[Bucket], step: int | None, have: set,
               count_identical: bool = False) -> None:
    """Differing bucket groups found beyond the layouts ``compare_buckets`` compared (a later
    step's, all-reduces) join ``order``: its verdict becomes the worst, the headline a reduction
    when it had none. ``count_identical`` (all-reduces, which ``compare_buckets`` never sees):
    equal groups count as compared too, so that a side whose only manifests are all-reduces
    reads ``identical``, not ``unavailable``."""
    from parity import consequences as cq

    for p in pairs:
        if p.verdict == "identical":
            key = (p.collective, tuple(p.a), tuple(p.b), p.verdict, p.detail)
            if not count_identical or not (p.a and p.b) or key in have:
                continue
            have.add(key)
            order.counts.setdefault(p.collective, {}).setdefault(p.verdict, 0)
            order.counts[p.collective][p.verdict] += 1
            if p.collective not in order.compared:
                order.compared.append(p.collective)
            if order.verdict not in SEVERITY:
                order.verdict = p.verdict
            continue
        key = (p.collective, tuple(p.a), tuple(p.b), p.verdict, p.detail)
        if key in have:
            continue
        have.add(key)
        if step is not None:
            p.detail = f"at step {step}: {p.detail}"
        src = {RS: (la.buckets.get(RS, []), lb.buckets.get(RS, [])), AR: (ara, arb)}.get(
            p.collective, (la.buckets.get(p.collective, []), lb.buckets.get(p.collective, [])))
        ia, ib = p.partner
        a = next((x for x in src[0] if x.index == ia), None)
        b = next((x for x in src[1] if x.index == ib), None)
        p.rows = side_by_side(a, b)
        p.consequence = cq.classify(p.collective, p.verdict)
        order.pairs.append(p)
        order.counts.setdefault(p.collective, {}).setdefault(p.verdict, 0)
        order.counts[p.collective][p.verdict] += 1
        if p.collective not in order.compared:
            order.compared.append(p.collective)
        if order.verdict in SEVERITY and SEVERITY[p.verdict] > SEVERITY[order.verdict] or \
                order.verdict not in SEVERITY:
            order.verdict = p.verdict
        fb = order.first_bucket
        if fb is None or (fb.get("consequence") not in cq.REDUCTIONS
                          and p.consequence in cq.REDUCTIONS):
            order.first_bucket = {
                "collective": p.collective, "verdict": p.verdict, "consequence": p.consequence,
                "index": ia, "b_index": ib, "group": a.group if a else None,
                "b_group": b.group if b else None, "position": p.position, "a": p.a_entry,
                "b": p.b_entry, "detail": p.detail, "rows": p.rows, "step": step}


def _nccl_settings(run) -> tuple[dict, str | None]:
    """The NCCL settings and version a run's fingerprint recorded (meta.json ``numerics``)."""
    for _, rd in sorted(run.ranks.items()):
        num = (rd.meta or {}).get("numerics")
        if isinstance(num, dict):
            env = num.get("nccl_env") if isinstance(num.get("nccl_env"), dict) else {}
            v = num.get("nccl_version")
            return ({k: v for k, v in env.items() if isinstance(v, str)},
                    v if isinstance(v, str) else None)
    return {}, None


def _emulated_at(run) -> str | None:
    for _, rd in sorted(run.ranks.items()):
        emu = (rd.meta or {}).get("nccl_emulation")
        if isinstance(emu, dict) and isinstance(emu.get("topology"), str):
            return emu["topology"]
    return None


def assess(run_a, run_b, ranks: list[int], layouts: dict[str, Layout], order, world: int | None,
           at, source: str | None = None):
    """Called by the diff engine: every step's reduction layouts compared (later steps and
    all-reduces join ``order``), consequence classes always, and with ``at`` (a topology or
    several) the prediction: a :class:`ReductionPrediction`, or :class:`Predictions` for
    several topologies."""
    shapes: dict[str, list[int]] = {}
    ra, rb = layouts["a"].rank, layouts["b"].rank
    recs_a = run_a.ranks[ra].buckets if ra in run_a.ranks else []
    recs_b = run_b.ranks[rb].buckets if rb in run_b.ranks else []
    # steps at which both sides have begun recording (a side's first records set its start)
    start = max([min(map(step_of, recs)) for recs in (recs_a, recs_b) if recs] or [0])
    steps = [s for s in change_steps(recs_a, recs_b) if s >= start]
    has_ar, ar_only, of_grads = one_sided_all_reduces(recs_a, recs_b)
    ar_what = " of gradients" if of_grads else ""
    notes: list[str] = []
    if len(steps) > MAX_STEPS:
        notes.append(f"manifests change at {len(steps)} steps; the layouts of the first "
                     f"{MAX_STEPS} are compared and predicted")
        steps = steps[:MAX_STEPS]
    per_step: list[tuple] = []  # (step, la, lb, ara, arb)
    if len(steps) > 1 or has_ar:
        seen: set = set()
        for s in steps:
            la, ara = layouts_at(run_a, ra, A_PREFERS, s) if ra is not None else (layouts["a"], [])
            lb, arb = layouts_at(run_b, rb, B_PREFERS, s) if rb is not None else (layouts["b"], [])
            sig = (signature(la, ara), signature(lb, arb))
            if sig in seen:
                continue
            seen.add(sig)
            per_step.append((s, la, lb, ara, arb))
    else:
        for side, recs in (("a", recs_a), ("b", recs_b)):
            annotate_buckets(layouts[side], recs)
        per_step.append((steps[0] if steps else None, layouts["a"], layouts["b"], [], []))
    # the order comparison: later steps' reduce-scatters and every step's all-reduces
    have = {(p.collective, tuple(p.a), tuple(p.b), p.verdict, p.detail) for p in order.pairs}
    for k, (s, la, lb, ara, arb) in enumerate(per_step):
        if k:
            later = compare_layouts(la, lb)
            _add_pairs(order, [p for p in later.pairs if p.collective == RS], la, lb, ara, arb,
                       s, have)
        if (ara or arb) and not ar_only:
            cmp_a, cmp_b, note = paired_all_reduces(ara, arb)
            if note and note not in order.notes:
                order.notes.append(note)
            pairs, _ = align_buckets(AR, cmp_a, cmp_b)
            _add_pairs(order, pairs, la, lb, ara, arb, s if k else None, have, True)
    if ar_only:
        order.notes.append(ONE_SIDED_AR.format(side=ar_only, what=ar_what))
    # the table is decoded only where shapes are needed (a prediction, or eager DTensor
    # reduce-scatters to attribute): a diff of equal runs parses no more than it must (issue 23)
    if at is not None or order.eager.get("a") or order.eager.get("b") or has_ar:
        ref = ra if ra in run_a.ranks else (ranks[0] if ranks else None)
        shapes = shapes_of(run_a.ranks[ref].params) if ref in run_a.ranks else {}
        refb = rb if rb in run_b.ranks else ref
        rda = run_a.ranks.get(ref)
        # B's table adds shapes only where it is not A's: the same bytes (digest) that decoded
        # on A are not decoded twice
        digest = rda.table_digest if rda is not None and len(rda.params) == rda.n_params else None
        if refb in run_b.ranks and (digest is None or run_b.ranks[refb].table_digest != digest):
            for f, s in shapes_of(run_b.ranks[refb].params).items():
                shapes.setdefault(f, s)
    counts = (_reduce_counts(RS, layouts["a"], [], order.eager.get("a") or [], shapes),
              _reduce_counts(RS, layouts["b"], [], order.eager.get("b") or [], shapes))
    last = per_step[-1]
    annotate(order, layouts, shapes, counts,
             None if ar_only else {"a": last[3], "b": last[4]})
    if at is None:
        return None
    if isinstance(at, str):  # "8x8" or "1x8,8x8" (a sweep spec's at)
        specs = split_topologies(at)
        at = specs[0] if len(specs) == 1 else specs
    topos = at if isinstance(at, list) else [at]
    topos = [parse_topology(t) if isinstance(t, str) else t for t in topos]
    env, version = _nccl_settings(run_a)
    env_b, _ = _nccl_settings(run_b)
    if env != env_b:
        notes.append("A and B recorded different NCCL settings; A's are applied to both")
    emulated = _emulated_at(run_a)
    out = []
    for topo in topos:
        ctx = _Context(shapes, world, _env_items(env), version, ar_only=ar_only,
                       ar_what=ar_what)
        answers = []
        for k, (s, la, lb, ara, arb) in enumerate(per_step):
            c = counts if k == 0 else None
            answers.append(_answer(la, lb, ara, arb, order.eager, topo, ctx, s, c))
        pred = _finish(topo, answers, ra, source, [x[0] for x in per_step if x[0] is not None])
        pred.notes += notes
        pred.emulated = emulated
        out.append(pred)
    return out[0] if len(out) == 1 and not isinstance(at, list) else Predictions(out)


def observe(prediction, divergent: list, first_step: int | None) -> None:
    """Predicted against observed: where both runs were emulated at the predicted topology
    (``parity exec --emulate-nccl``), the gradients that diverged at the first divergent step
    are what the cluster would show; every one should be predicted at risk (the prediction is a
    superset). Sets ``observed`` on each such prediction."""
    preds = prediction if isinstance(prediction, list) else [prediction]
    for p in preds:
        if p is None or not p.emulated:
            continue
        if _canon_spec(p.emulated) != _canon_spec(p.topology.spec()):
            continue
        seen = sorted({d.fqn for d in divergent if d.kind == "grad" and d.step == first_step})
        risk = p.fqns()
        p.observed = {"topology": p.emulated, "step": first_step, "diverged": len(seen),
                      "predicted": len(risk), "both": len(set(seen) & risk),
                      "not_predicted": [f for f in seen if f not in risk][:20]}


def _canon_spec(spec: str) -> str:
    try:
        return parse_topology(spec).spec()
    except ParityError:
        return spec
