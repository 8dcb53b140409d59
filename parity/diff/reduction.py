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
from itertools import chain, compress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from parity.diff.buckets import (A_PREFERS, B_PREFERS, SEVERITY, Bucket, BucketPair, Layout,
                                 align_buckets, compare_layouts, eager_for, side_by_side)
from parity.diff.other_ranks import OtherRanks, other_ranks
from parity.diff.reduction_count import ChunkOrders, Orders, RiskCount, channel_map
from parity.diff.reduction_steps import (annotate_buckets, group_size_of, infer_ops, layouts_at,
                                         norms_named_on_one_side, one_sided_all_reduces, op_of,
                                         paired_all_reduces, signature, step_of)
from parity.consequences import blind_note as cq_blind
from parity.errors import ParityError
from parity.nccl import MODEL, MODEL_LIMITS, Topology, Unknown, parse_topology
from parity.nccl import predict as nccl_predict
from parity.nccl.probe_file import describe_file
from parity.records import NORM_SUFFIX, SOURCE_DTENSOR
from parity.text import ranges

if TYPE_CHECKING:  # numpy is imported by the functions that count (a diff of equal runs: never)
    import numpy as np

SAME, DIFFERS, UNKNOWN = "same", "differs", "unknown"
RS, AR = "reduce_scatter", "all_reduce"
ONE_SIDED_AR = ("only {side} recorded all-reduce buckets{what} (the other side's, if any, ran "
                "where no manifest source sees them: a functional collective run eagerly, a C++ "
                "hook): not compared")
HSDP_REPLICATE = "fsdp2 replicate"  # c10d_allreduce.py: FSDP2's all-reduce of a shard row
# a side whose manifests hold no reduction of any kind (recorded with --no-manifests, or by a
# rank that wrote none): its gradients' reductions are unseen, not "zero collectives"
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
    families: frozenset = field(default=frozenset(), compare=False)  # ``family``'s names
    cmap: tuple = field(default=(), compare=False, repr=False)  # reduction_count.channel_map

    def __post_init__(self):
        if not self.families:
            object.__setattr__(self, "families", frozenset(self.family.split("+")))

    def fits(self, cluster: list) -> bool:
        """Whether this scenario can run on ``cluster`` ([communicator channels, family names,
        rings]): the same channel count, a family in common, rings that agree channel by
        channel as far as both go (a larger collective uses more of the same rings)."""
        comm, names, rings = cluster
        if self.comm_channels != comm or names.isdisjoint(self.families):
            return False
        k = min(len(rings), len(self.rings))
        return rings[:k] == self.rings[:k]


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
    out = []
    for s in got.scenarios:
        starts = tuple(seg.lo for seg in s.segments)
        orders = tuple(seg.order for seg in s.segments)
        out.append(Plan(s.protocol, s.family, s.comm_channels, s.nchannels, starts, orders,
                        model, said + tuple(s.assumptions) + tuple(got.notes), tuple(s.rings),
                        cmap=channel_map(starts, orders, count)))
    return tuple(out)


# ------------------------------------------------------------------------------ the result


@dataclass(slots=True)
class AtRisk:
    """One parameter whose gradient would be summed differently at the target topology."""

    fqn: str
    elements: int  # elements of the full gradient summed in another rank order (worst scenario)
    numel: int  # elements of the full gradient
    bucket: dict  # {"collective", "a": A's bucket index | None, "b": B's}
    why: str  # "order" (channel -> ring differs) | "structure" | "dtype" | "scaling"
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
    # the parameters whose gradient norms a clip's all-reduce carries (``<fqn>:grad_norm``)
    clipped: set = field(default_factory=set)

    def fqns(self) -> set[str]:
        """The parameters at risk (what an emulated run may show diverging). A gradient norm
        at risk puts every gradient the clip scales at risk: the total norm's one ulp
        multiplies each of them."""
        out = {x.fqn for x in self.at_risk}
        if any(f.endswith(NORM_SUFFIX) for f in out):
            out |= self.clipped
        return out

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
    """(dim 0, elements per dim-0 row) of a global shape, None if it is not a list of ints."""
    if type(shape) is list and len(shape) == 2 and type(shape[0]) is int and \
            type(shape[1]) is int:  # the usual case, first: every parameter asks
        return shape[0], shape[1]
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


@dataclass(slots=True)
class _Coll:
    """One collective of one side at the target: its group's topology, its buffer, and the
    ranks among which its payloads are sharded (``owners``: the group size for a
    reduce-scatter, the shard group's for an HSDP all-reduce, 1 for a whole-tensor one)."""

    kind: str
    key: tuple  # (kind, bucket index[, payload]) on this side
    bucket: Bucket
    topo: Topology
    owners: int
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
    blind: str | None = None  # "A" / "B": that side recorded no reduction at all (no manifests)
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


def _seg_sums(x: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive segments of ``x`` of lengths ``lens``: each element's exclusive prefix
    sum within its segment, and each segment's total (empty segments allowed)."""
    import numpy as np

    before = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=before[1:])
    ends = np.cumsum(lens)
    base = before[ends - lens]
    return before[:-1] - np.repeat(base, lens), before[ends] - base


class _Derived(NamedTuple):
    """:func:`derive_layout` of many buckets at once: per bucket the reason it is not derived
    (None: derived), its per-rank count and element size; per entry of every bucket, in order,
    its slot (offset, dim-0 rows per rank, elements per row, dim 0)."""

    why: list
    count: np.ndarray
    esize: list
    lens: np.ndarray
    starts: np.ndarray
    fqn: list
    offset: np.ndarray
    rows: np.ndarray
    row: np.ndarray
    dim0: np.ndarray


def _derive_many(buckets: list[Bucket], worlds: list[int], checks: list, ctx: _Context
                 ) -> _Derived:
    """:func:`derive_layout` of every bucket (bucket i at ``worlds[i]`` ranks, checked at
    ``checks[i]``), in numpy: the same answers. Why: a side holds hundreds of buckets and
    thousands of payloads, and a prediction derives them all at every topology. A bucket that
    fails any check is handed to :func:`derive_layout` itself, which says why."""
    import numpy as np

    nb = len(buckets)
    ents = [b.entries for b in buckets]
    lens = np.fromiter(map(len, ents), dtype=np.int64, count=nb)
    flat = [e for es in ents for e in es]
    fqn = [e.fqn for e in flat]
    dims_of, shapes = ctx.dims_of, ctx.shapes
    for f in set(fqn).difference(dims_of):
        if f is not None:
            sh = shapes.get(f)
            dims_of[f] = (sh[0], sh[1]) if type(sh) is list and len(sh) == 2 and type(
                sh[0]) is int and type(sh[1]) is int else _dims(sh)  # _dims' usual case inline
    dims = [dims_of.get(f) for f in fqn]
    which = np.repeat(np.arange(nb), lens)
    bad = np.zeros(nb, dtype=bool)
    if None in dims:  # a payload without a name or a global shape
        bad[which[[i for i, x in enumerate(dims) if x is None]]] = True
    d = np.fromiter(chain.from_iterable([x or (1, 1) for x in dims]), dtype=np.int64,
                    count=2 * len(dims)).reshape(-1, 2)
    dim0, row = d[:, 0], d[:, 1]
    # one dtype per bucket: the bucket's, every payload's the same or unrecorded
    bdt = [b.dtype for b in buckets]
    esize = [_ITEMSIZE.get(x) if x else None for x in bdt]
    bad |= np.array([x is None for x in esize], dtype=bool)
    edt = [e.dtype for e in flat]
    rep = [x for x, k in zip(bdt, lens.tolist()) for _ in range(k)]
    if edt != rep:  # usually every payload's dtype is its bucket's
        odd = [bool(x) and x != y for x, y in zip(edt, rep)]
        bad |= np.bincount(which, weights=odd, minlength=nb) > 0
    # the recorded offsets and sizes at the capture's group size
    cw = np.array([c or 0 for c in checks], dtype=np.int64)
    cwe = cw[which]
    numel_cw = -(-dim0 // np.maximum(cwe, 1)) * row
    excl, _ = _seg_sums(numel_cw, lens)
    rn, ro = [e.numel for e in flat], [e.offset for e in flat]
    if None in rn:  # not recorded: not checked
        rn = [-1 if x is None else x for x in rn]
    if None in ro:
        ro = [-1 if x is None else x for x in ro]
    rn, ro = np.array(rn, dtype=np.int64), np.array(ro, dtype=np.int64)
    es = np.array([x or 0 for x in esize], dtype=np.int64)[which]
    wrong = (cwe > 0) & (((rn >= 0) & (rn != numel_cw)) | ((ro >= 0) & (ro != excl * es)))
    bad |= np.bincount(which, weights=wrong, minlength=nb) > 0
    # at the target
    rows = -(-dim0 // np.array(worlds, dtype=np.int64)[which])
    offset, count = _seg_sums(rows * row, lens)
    why: list = [None] * nb
    starts = np.cumsum(lens) - lens
    for i in np.flatnonzero(bad).tolist():
        got = derive_layout(buckets[i], shapes, worlds[i], checks[i], dims_of)
        if isinstance(got, str):
            why[i] = got
            continue
        slots, count[i], esize[i] = got  # the checks above were stricter than needed
        lo = starts[i]
        for j, x in enumerate(slots):
            offset[lo + j], rows[lo + j], row[lo + j], dim0[lo + j] = (x.offset, x.rows, x.row,
                                                                       x.dim0)
    return _Derived(why, count, esize, lens, starts, fqn, offset, rows, row, dim0)


class _Side(NamedTuple):
    """One side's collectives of one kind at the target and where each payload is: ``slot``
    maps a parameter to a row of the per-row arrays (its occurrence in a skipped bucket
    first, else the first derived one, else the first bucket holding it); per row: the
    position of its bucket in ``buckets``, its collective in ``colls`` (-1: not derived), and
    its slot."""

    buckets: list[Bucket]
    colls: list[_Coll]
    bad: dict  # bucket index -> why its layout is not derived
    slot: dict
    bucket: np.ndarray
    coll: np.ndarray
    offset: np.ndarray
    rows: np.ndarray
    row: np.ndarray
    dim0: np.ndarray


def _side(kind: str, buckets: list[Bucket], skip: set, topo: Topology,
          ctx: _Context, sub: str | bool) -> _Side:
    """A side's collectives of ``kind`` at ``topo`` (buckets in ``skip`` are equal on both
    sides and not derived), per bucket index the reason one could not be derived, and where
    each payload is. ``sub``: the side's reduce-scatters ran on sub-groups, "hsdp" (HSDP's shard
    groups: one node at the target) or "group" (no replicate all-reduce: not predicted). A
    coalesced bucket is one collective per payload, in one NCCL group (``group``: the others'
    counts)."""
    import numpy as np

    bad: dict[int, str] = {}
    shard_topo = _group_topo(topo, 1, topo.gpus)
    replicate_topo = _group_topo(topo, topo.nodes, 1)
    cw = ctx.capture_world
    sparse = [p for p, b in enumerate(buckets) if getattr(b, "sparse", False)
              and b.index not in skip]
    for p in sparse:
        bad[buckets[p].index] = ("a sparse gradient (DDP all-reduces it sparse): the model "
                                 "covers dense buffers")
    pos_of = [p for p, b in enumerate(buckets) if b.index not in skip and b.index not in bad]
    todo = [buckets[p] for p in pos_of]
    def place(b: Bucket):
        """(the group's topology, owners, world, check) of ``b`` at the target, or why not."""
        gw = group_size_of(b)
        if kind == RS:
            if not sub or not cw or gw in (None, cw):  # over every rank (beside sub-groups
                return topo, topo.world, topo.world, cw  # too: MoE's dense part), as recorded
            if sub == "hsdp":  # HSDP: shard groups of one node at the target (said)
                return shard_topo, topo.gpus, topo.gpus, gw
            # no replicate all-reduce: expert parallel's efsdp groups, 2-D meshes
            return (f"a reduce-scatter over {gw} of {cw} ranks without HSDP's replicate "
                    "all-reduce (an expert or 2-D mesh group): which ranks it spans at the "
                    "target is not known")
        if getattr(b, "module", None) == HSDP_REPLICATE:  # a shard row, one rank a node
            return replicate_topo, topo.gpus, topo.gpus, (cw // gw) if cw and gw else None
        if gw in (None, cw) or not cw:
            return topo, 1, 1, 1  # whole tensors, over every rank
        return (f"an all-reduce over {gw} of {cw} ranks (not HSDP's replicate group): which "
                "ranks it spans at the target is not known")

    keep, worlds, checks, tops, owners_of = [], [], [], [], []
    for p, b in zip(pos_of, todo):
        got = place(b)
        if isinstance(got, str):
            bad[b.index] = got
            continue
        gt, owners, n, check = got
        keep.append(p)
        worlds.append(n)
        checks.append(check)
        tops.append(gt)
        owners_of.append(owners)
    pos_of = keep
    todo = [buckets[p] for p in pos_of]
    got = _derive_many(todo, worlds, checks, ctx)
    lens, counts = got.lens.tolist(), got.count.tolist()
    for b, why in zip(todo, got.why):
        if why is not None:
            bad[b.index] = why
    colls: list[_Coll] = []
    first = np.full(len(todo), -1, dtype=np.int64)  # per bucket of ``todo``: its collective
    split = [i for i, b in enumerate(todo) if got.why[i] is None and lens[i] > 1
             and getattr(b, "coalesced", False)]  # one collective per payload
    if not split:  # the usual case, in one go
        ok = [i for i, why in enumerate(got.why) if why is None]
        colls = [_Coll(kind, (kind, todo[i].index), todo[i], tops[i], owners_of[i], counts[i],
                       got.esize[i], op_of(todo[i])) for i in ok]
        first[ok] = np.arange(len(ok))
    for i, b in enumerate(todo if split else ()):
        if got.why[i] is not None:
            continue
        first[i] = len(colls)
        if i in split:
            lo = int(got.starts[i])
            sizes = (got.rows[lo:lo + lens[i]] * got.row[lo:lo + lens[i]]).tolist()
            for j in range(lens[i]):
                others = tuple(c for m, c in enumerate(sizes) if m != j)
                colls.append(_Coll(kind, (kind, b.index, j), b, tops[i], owners_of[i],
                                   sizes[j], got.esize[i], op_of(b), others))
            got.offset[lo:lo + lens[i]] = 0
        else:
            colls.append(_Coll(kind, (kind, b.index), b, tops[i], owners_of[i], counts[i],
                               got.esize[i], op_of(b)))
    coll_of = np.repeat(first, got.lens)  # per entry of ``todo``
    for i in split:  # a coalesced bucket's payloads: its collectives in turn
        lo = int(got.starts[i])
        coll_of[lo:lo + lens[i]] += np.arange(lens[i])
    derived = coll_of >= 0
    # rows: skipped buckets' payloads, derived payloads, then the named payloads of buckets
    # not derived (every other bucket's are derived payloads already)
    skipped = [(p, b) for p, b in enumerate(buckets) if b.index in skip]
    s_fqn = [f for _, b in skipped for f in b.fqns]
    s_pos = [p for p, b in skipped for _ in b.entries]
    d_fqn = got.fqn if derived.all() else [f for f, ok in zip(got.fqn, derived.tolist()) if ok]
    d_pos = np.repeat(np.array(pos_of, dtype=np.int64), got.lens)[derived]
    not_derived = [(p, b) for p, b in enumerate(buckets) if b.index in bad]
    o_fqn = [f for _, b in not_derived for f in b.fqns if f]
    o_pos = [p for p, b in not_derived for f in b.fqns if f]
    ns, nd = len(s_fqn), len(d_fqn)
    total = ns + nd + len(o_fqn)
    rows = np.arange(total)
    slot = dict(zip(reversed(o_fqn), reversed(rows[ns + nd:].tolist())))
    slot.update(zip(reversed(d_fqn), reversed(rows[ns:ns + nd].tolist())))
    slot.update(zip(reversed(s_fqn), reversed(rows[:ns].tolist())))
    # one more row, last: where a parameter the side does not hold points (index -1)
    zeros = np.zeros(ns, dtype=np.int64), np.zeros(len(o_fqn) + 1, dtype=np.int64)

    def column(x):
        return np.concatenate([zeros[0], x[derived], zeros[1]])

    return _Side(buckets, colls, bad, slot,
                 np.concatenate([np.array(s_pos, dtype=np.int64), d_pos,
                                 np.array(o_pos + [-1], dtype=np.int64)]),
                 np.concatenate([zeros[0] - 1, coll_of[derived], zeros[1] - 1]),
                 column(got.offset), column(got.rows), column(got.row), column(got.dim0))


# -------------------------------------------------------------------------- one step's answer


def _reduce_counts(kind: str, layout: Layout, ar: list[Bucket], eager: list[dict],
                   shapes: dict) -> dict[str, int]:
    """fqn -> how many collectives of ``kind`` reduce its gradient on this side (buckets, plus
    eager DTensor reduce-scatters of it where the layout is another source's; eager DTensor
    all-reduces are among ``ar`` already: reduction_steps.all_reduce_buckets)."""
    out: dict[str, int] = {}
    if kind == RS:  # in payload order: the JSON order is deterministic
        out = dict.fromkeys((e.fqn for b in layout.buckets.get(RS, []) for e in b.entries), 1)
        for (k, f), n in layout.repeats.items():
            if k == RS and f in out:
                out[f] = n
    else:
        for b in ar:
            for f in dict.fromkeys(x for x in b.fqns if x):
                out[f] = out.get(f, 0) + 1
    # the layout read from the dtensor source holds those reduce-scatters already
    runs = [r for r in eager or [] if r.get("collective") == kind and kind != AR
            and layout.source != SOURCE_DTENSOR]
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
    checked: set = field(default_factory=set)  # parameters whose reduction layout differs
    kinds: set = field(default_factory=set)  # kinds of reduction either side recorded
    models: dict = field(default_factory=dict)  # the model's name per release used, in order
    assumptions: dict = field(default_factory=dict)  # every scenario's assumptions, in order


def _env_items(env) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in (env or {}).items() if v is not None))


def _known_op(b: Bucket) -> str | None:
    """A bucket's reduce op where it is known (recorded, or eager FSDP2's by its rule), else
    None (a compiled graph recorded before parity wrote the op)."""
    return None if getattr(b, "op_guessed", False) else getattr(b, "op", None)


def _alike_but_op(kind: str, ba: list[Bucket], bb: list[Bucket], same_bucket: dict[int, int],
                  topo: Topology) -> list[tuple[int, str]]:
    """A's buckets of ``same_bucket`` whose twin on B has another reduce op, both known, with
    what the prediction then assumes. Why: the op decides which of NCCL's algorithms may run
    (AVG and PREMUL_SUM are PreMulSum, which neither PAT nor NVLS takes; a SUM may run NVLS on
    one NVSwitch node), so such a pair is predicted with each side's op, not skipped as the
    same; where each side applies its scaling (PreMulSum: by its factor before the sum) is not
    modelled, and is said. A twin whose op one side did not record (a graph recorded before
    parity wrote it) is predicted too where a group at ``topo`` is not a power of two: there
    the unknown op's scaling may round otherwise (``_scaling_differs``)."""
    by_a = {b.index: b for b in ba}
    by_b = {b.index: b for b in bb}
    pow2 = all(g > 0 and g & (g - 1) == 0 for g in (topo.world, topo.gpus, topo.nodes))
    out = []
    for ia, ib in same_bucket.items():
        oa, ob = _known_op(by_a[ia]), _known_op(by_b[ib])
        if (oa is None) != (ob is None) and not pow2:
            out.append((ia, f"{kind}: buckets alike but one side's reduce op not recorded: "
                            "predicted, its scaling at the group size not known"))
            continue
        if oa is not None and ob is not None and oa != ob:
            out.append((ia, f"{kind}: buckets alike but for the reduce op ({oa} in A, {ob} in "
                            "B): each side's algorithms predicted with its own op, and the "
                            "factors each op scales by at the group size compared (why: "
                            "scaling where they round differently)"))
    return out


def _pre_scale(b: Bucket, g: int) -> float | None:
    """The factor NCCL multiplies each rank's payload by before the sum, in a group of ``g``
    ranks: a SUM none (1), an AVG on a floating type ``1/g`` (ncclAvg is ncclDevPreMulSum with
    ``1.0/comm->nRanks`` in the payload's type: src/enqueue.cc ``hostToDevRedOp``, v2.21.5-1 to
    v2.30.7-1), a PREMUL_SUM its recorded factor (``op_scale``); None where not known."""
    op = _known_op(b)
    if op == "sum":
        return 1.0
    if op == "avg":
        return 1.0 / g if g > 0 else None
    if op == "premul_sum":
        s = getattr(b, "op_scale", None)
        return float(s) if s else None
    return None


def _exact_scale(s: float) -> bool:
    """A power of two: multiplying by it rounds nothing (inside the exponent's range)."""
    return s > 0 and math.frexp(s)[0] == 0.5


def _scaling_differs(kind: str, ba: list[Bucket], bb: list[Bucket], pos_a, pos_b, groups,
                     rest, step: int | None, ans: _StepAnswer, assumptions: list[str]):
    """(at risk, unpredicted), per parameter of ``rest`` (numpy arrays; ``pos_a``/``pos_b``:
    its bucket's place in ``ba``/``bb``; ``groups``: per side the ranks summing it at the
    topology):
    at risk where the two sides' ops scale the sum by factors that round differently. Why: an AVG multiplies every rank's payload by
    ``1/g`` before the sum; a SUM with the division elsewhere (after the sum, or the loss
    pre-scaled) rounds elsewhere. Where both factors are powers of two the scaling is exact on
    both sides, and the hashes at capture show whether the job compensates; at a group size
    that is not a power of two (3 nodes of 8: 24 ranks) it is not, and two layouts with the
    same summation order still give other bits. The factor of a PREMUL_SUM that did not
    record one is not known: such a parameter is unpredicted (said per bucket pair in
    ``ans.unpredicted``), never "same"."""
    import numpy as np

    out = np.zeros(len(rest), dtype=bool)
    unknown = np.zeros(len(rest), dtype=bool)
    if not ba or not bb:
        return out, unknown
    keys: dict = {}
    ka = np.array([keys.setdefault((_known_op(b), getattr(b, "op_scale", None)), len(keys))
                   for b in ba] + [-1], dtype=np.int64)[pos_a]
    kb = np.array([keys.setdefault((_known_op(b), getattr(b, "op_scale", None)), len(keys))
                   for b in bb] + [-1], dtype=np.int64)[pos_b]
    said: set = set()
    for i in np.flatnonzero(rest & (ka != kb)).tolist():
        x, y = ba[int(pos_a[i])], bb[int(pos_b[i])]
        ga, gb = int(groups[0][i]), int(groups[1][i])
        oa, ob = _known_op(x), _known_op(y)
        key = (x.index, y.index)
        if oa is None or ob is None:  # a graph recorded before parity wrote its op
            if all(g > 0 and g & (g - 1) == 0 for g in (ga, gb)):
                continue  # SUM's and AVG's factors are powers of two here
            why = (f"the reduce op of {'A' if oa is None else 'B'}'s bucket was not recorded: "
                   f"whether it scales the sum as the other side's ({oa or ob}) does at "
                   f"{max(ga, gb)} ranks (not a power of two) is not known")
        elif oa not in _SCALED_OPS or ob not in _SCALED_OPS:
            continue  # not a sum (MAX, MIN): not this rule's
        else:
            sa, sb = _pre_scale(x, ga), _pre_scale(y, gb)
            if sa is not None and sb is not None:
                if sa == sb:
                    continue
                if _exact_scale(sa) and _exact_scale(sb):
                    at = f"{ga} ranks" if ga == gb else f"{ga} and {gb} ranks"
                    text = (f"{kind}: reduce op {oa} against {ob} at {at}: factors "
                            f"{_fraction(sa)} and {_fraction(sb)} are powers of two (exact), "
                            "assumed compensated where the hashes at capture match")
                    if text not in assumptions:
                        assumptions.append(text)
                    continue
                out[i] = True
                continue
            why = (f"reduce op {oa} against {ob}: a premul_sum factor not recorded (how each "
                   "side scales the sum is not known)")
        if key not in said:
            said.add(key)
            ans.unpredicted.append({"collective": kind, "a": x.index, "b": y.index,
                                    "step": step, "reason": why})
        unknown[i] = True
    return out, unknown


_SCALED_OPS = ("sum", "avg", "premul_sum")


def _fraction(s: float) -> str:
    inv = 1.0 / s
    return f"1/{int(inv)}" if inv == int(inv) and inv > 1 else f"{s:g}"


def _twin_key(b: Bucket) -> tuple:
    return len(b.entries), b.entries[0].fqn if b.entries else None, b.dtype, group_size_of(b)


def _groups_differ(ba: list[Bucket], bb: list[Bucket]) -> str | None:
    """Why the two sides' reductions of a kind are not predicted when they ran over groups of
    other ranks (each bucket line's ``ranks``, recorded for sub-groups since 2026-11-28), else
    None. The model places a sub-group at the target by its size alone (HSDP's shard groups:
    one node); groups of the same size made of other ranks (a mesh transposed) cannot both be
    where it puts them. Sides that did not record ranks are not compared here."""
    ga = sorted({b.ranks for b in ba if getattr(b, "ranks", None)})
    gb = sorted({b.ranks for b in bb if getattr(b, "ranks", None)})
    if not ga or not gb or ga == gb:
        return None
    a = next((r for r in ga if r not in gb), ga[0])  # a group only A has, else A's first
    b = next((r for r in gb if r not in ga), gb[0])
    return (f"groups of other ranks (ranks {list(a)} in A, {list(b)} in B): where each sits "
            "at the target is not known")


def _unnamed_all_reduces(ba: list[Bucket], bb: list[Bucket], topo: Topology) -> str | None:
    """Why the all-reduces that carry no parameter's gradient (a clip's total norm, a global
    token count, a logged loss: round 12a) are not predicted, or None. They hold no parameter,
    so the per-parameter count below never sees them, yet a clip's norm or a token count
    scales every gradient after it: one ulp there changes every parameter. A scalar sits in
    one place: the two sides' sequences of scalars (dtype, group, op) alike sum alike. A buffer
    of several values (DTensor's stacked per-parameter norms) is recorded without names, so
    where each value sits, and which ring sums it at the target, is not known."""
    bare = {side: [b for b in bs if not any(b.fqns)] for side, bs in (("A", ba), ("B", bb))}
    if not bare["A"] or not bare["B"]:  # one side's only: not compared, said by the layout's
        return None  # notes (reduction_steps.paired_all_reduces)
    for side, bs in bare.items():
        for b in bs:
            n = sum(e.numel or 0 for e in b.entries)
            if n > 1 and _known_op(b) not in ("max", "min"):  # MAX / MIN: order-free
                return (f"{side}'s all-reduce of {n} values no parameter names "
                        f"({getattr(b, 'module', None) or 'no call site recorded'}): where each value sits "
                        f"in it is not recorded, so the order its sum takes at {topo.spec()} "
                        "is not known (a gradient norm's sum scales every gradient)")

    def key(b: Bucket) -> tuple:
        return (b.dtype, b.total_bytes, group_size_of(b), b.ranks, _known_op(b))

    if [key(b) for b in bare["A"]] != [key(b) for b in bare["B"]]:
        return (f"the all-reduces of scalars no parameter names (a gradient norm, a token "
                f"count: {len(bare['A'])} in A, {len(bare['B'])} in B) differ in number, "
                f"group or op: their sums at {topo.spec()} are not predicted, and each may "
                "scale every gradient")
    return None


def _predict_kind(kind: str, la: Layout, lb: Layout, ara: list[Bucket], arb: list[Bucket],
                  topo: Topology, ctx: _Context, counts: tuple[dict, dict], step: int | None,
                  ans: _StepAnswer, assumptions: list[str]) -> None:
    """One kind of reduction at one step and topology, into ``ans``. Per parameter (in
    numpy, every parameter at once): skipped where its bucket is the same on both sides;
    ``structure`` where the two sides reduce it with a different number of collectives or
    in differently shaped slots; ``dtype``; unpredicted where a layout is not derived; else
    counted (:func:`_count_entries`)."""
    import numpy as np

    ba = la.buckets.get(RS, []) if kind == RS else ara
    bb = lb.buckets.get(RS, []) if kind == RS else arb
    na, nb = counts
    if not ba and not bb and not na and not nb:
        return
    ans.kinds.add(kind)
    if ctx.blind:  # how that side reduced is not known: never a structure difference
        ans.unknown.append({"collective": kind, "a": None, "b": None, "step": step,
                            "reason": cq_blind(ctx.blind)})
        return
    custom = [(side, b.comm) for side, bs in (("A", ba), ("B", bb)) for b in bs
              if getattr(b, "comm", None)]
    if kind == RS and custom:  # a user's comm may send the packed buffer permuted (round 11a)
        side, comm = custom[0]
        ans.unknown.append({"collective": kind, "a": None, "b": None, "step": step,
                            "reason": f"{side}'s reduce-scatters are handed to a custom comm "
                                      f"({comm}): where it puts each element is not known"})
        return
    if kind == AR and ctx.ar_only:
        ans.unpredicted.append({"collective": AR, "a": None, "b": None, "step": step,
                                "reason": ONE_SIDED_AR.format(side=ctx.ar_only,
                                                                   what=ctx.ar_what)})
        return
    unnamed = _unnamed_all_reduces(ba, bb, topo) if kind == AR else None
    if unnamed:  # a norm / token count: no parameter to count, but it may scale every one
        ans.unknown.append({"collective": AR, "a": None, "b": None, "step": step,
                            "reason": unnamed})
    moved = _groups_differ(ba, bb)
    if moved:  # the same sizes over other ranks: where each group sits at the target differs
        ans.unknown.append({"collective": kind, "a": None, "b": None, "step": step,
                            "reason": moved})
        return
    # A's bucket -> B's with the same payloads, dtype and group size (the op is compared
    # below, where both sides know theirs); the last such B bucket, names compared only where
    # the count, first payload, dtype and group size agree
    maybe: dict[tuple, list] = {}
    for b in bb:
        maybe.setdefault(_twin_key(b), []).append(b)
    same_bucket: dict[int, int] = {}
    for b in ba:
        found = maybe.get(_twin_key(b))
        if found:
            names = b.fqns
            for c in found:
                if c.fqns == names:
                    same_bucket[b.index] = c.index
    for ia, text in _alike_but_op(kind, ba, bb, same_bucket, topo):  # each side's op, predicted
        same_bucket.pop(ia)
        if text not in assumptions:
            assumptions.append(text)
    # buckets the same on both sides (same payloads, order, dtype, op) whose payloads are first
    # there on both sides cannot differ: their layouts are not derived
    skip: dict[str, set] = {"a": set(), "b": set()}
    if same_bucket:
        # the first bucket holding each parameter (reversed: the first occurrence is last)
        first = {side: {f: b.index for b in reversed(bs) for f in reversed(b.fqns) if f}
                 for side, bs in (("a", ba), ("b", bb))}
        for b in ba:
            j = same_bucket.get(b.index)
            if j is not None and all(f and first["a"][f] == b.index and first["b"].get(f) == j
                                     for f in b.fqns):
                skip["a"].add(b.index)
                skip["b"].add(j)
    # a side with reduce-scatters on a sub-group: HSDP's shard groups where it also has HSDP's
    # replicate all-reduces, else groups whose place at the target is not known ("group")
    sub = {k: (kind == RS and _hsdp(bs, ctx.capture_world)) and (
        "hsdp" if any(getattr(b, "module", None) == HSDP_REPLICATE for b in ar) else "group")
        for k, bs, ar in (("a", ba, ara), ("b", bb, arb))}
    if "hsdp" in sub.values() or any(getattr(b, "module", None) == HSDP_REPLICATE
                                     for b in (*ara, *arb)):
        text = (f"HSDP at {topo.spec()}: shard groups of one node ({topo.gpus} ranks, "
                f"reduce-scatter at 1x{topo.gpus}), replicate groups of one rank per node "
                f"(all-reduce at {topo.nodes}x1)")
        if text not in assumptions:
            assumptions.append(text)
    A = _side(kind, ba, skip["a"], topo, ctx, sub["a"])
    B = _side(kind, bb, skip["b"], topo, ctx, sub["b"])
    params = list(dict.fromkeys([*na, *nb]))
    if not params:
        return
    # per parameter: its row on each side (-1: the side holds it in no bucket)
    ra = np.array([A.slot.get(f, -1) for f in params], dtype=np.int64)
    rb = np.array([B.slot.get(f, -1) for f in params], dtype=np.int64)
    index_a = np.array([b.index for b in ba] + [-1], dtype=np.int64)[A.bucket[ra]]
    index_b = np.array([b.index for b in bb] + [-1], dtype=np.int64)[B.bucket[rb]]
    twin = np.array([same_bucket.get(b.index, -2) for b in ba] + [-2],
                    dtype=np.int64)[A.bucket[ra]]
    cnt_a = np.array([na.get(f, -1) for f in params], dtype=np.int64)
    cnt_b = np.array([nb.get(f, -1) for f in params], dtype=np.int64)
    has = (ra >= 0) & (rb >= 0)
    checked = ~(has & (twin == index_b) & (cnt_a == cnt_b))
    ans.checked.update(compress(params, checked.tolist()))
    structure = checked & (np.maximum(cnt_a, 0) != np.maximum(cnt_b, 0))
    rest = checked & ~structure & has  # else reduced by eager collectives alike: not modelled
    codes: dict = {}
    dt_a = np.array([codes.setdefault(b.dtype, len(codes)) for b in ba] + [-1], dtype=np.int64)
    dt_b = np.array([codes.setdefault(b.dtype, len(codes)) for b in bb] + [-1], dtype=np.int64)
    dtype = rest & (dt_a[A.bucket[ra]] != dt_b[B.bucket[rb]])
    rest &= ~dtype
    ca, cb = A.coll[ra], B.coll[rb]
    not_derived = rest & ((ca < 0) | (cb < 0))
    rest &= ~not_derived
    own_a = np.array([c.owners for c in A.colls] + [0], dtype=np.int64)[ca]
    own_b = np.array([c.owners for c in B.colls] + [0], dtype=np.int64)[cb]
    rows, row, dim0 = A.rows[ra], A.row[ra], A.dim0[ra]
    shape = rest & ((rows != B.rows[rb]) | (row != B.row[rb]) | (own_a != own_b))
    structure |= shape
    rest &= ~shape
    # the ranks summing each parameter at the target on each side: its collective's group
    ranks_a = np.array([c.topo.world for c in A.colls] + [0], dtype=np.int64)[ca]
    ranks_b = np.array([c.topo.world for c in B.colls] + [0], dtype=np.int64)[cb]
    scaling, unscaled = _scaling_differs(kind, ba, bb, A.bucket[ra], B.bucket[rb],
                                         (ranks_a, ranks_b), rest, step, ans, assumptions)
    rest &= ~(scaling | unscaled)
    said: set = set()
    for i in np.flatnonzero(structure | dtype | not_derived | scaling).tolist():
        f = params[i]
        ia = int(index_a[i]) if index_a[i] >= 0 else None
        ib = int(index_b[i]) if index_b[i] >= 0 else None
        where = {"collective": kind, "a": ia, "b": ib}
        if not_derived[i]:
            if (ia, ib) not in said:
                said.add((ia, ib))
                why = A.bad.get(ia) or B.bad.get(ib)
                ans.unpredicted.append({**where, "step": step,
                                        "reason": why or "layout not derived"})
            continue
        dims = ctx.dims_of[f] if f in ctx.dims_of else _dims(ctx.shapes.get(f))
        numel = dims[0] * dims[1] if dims else 0
        why = "dtype" if dtype[i] else "scaling" if scaling[i] else "structure"
        _keep_worst(ans, kind, AtRisk(f, numel, numel, where, why, step))
    todo = np.flatnonzero(rest)
    if not todo.size:
        return
    # owners 0..full-1 hold whole shards (length elements), owner ``full`` holds ``part`` real
    # elements, the rest only padding
    n = own_a[todo]
    rows, row, dim0 = rows[todo], row[todo], dim0[todo]
    full = np.where(rows > 0, np.minimum(n, dim0 // np.maximum(rows, 1)), 0)
    part = np.where(full < n, (dim0 - full * rows) * row, 0)
    entries = _Entries(ca[todo], cb[todo], A.offset[ra[todo]], B.offset[rb[todo]], rows * row,
                       full, part, todo, index_a[todo], index_b[todo], dim0 * row)
    groups, at = np.unique(n, return_index=True)
    for g in groups[np.argsort(at)].tolist():  # per group size, in order of first use
        sel = np.flatnonzero(n == g)
        _count_entries(kind, g, entries if sel.size == n.size else entries.take(sel), A, B,
                       params, ctx, step, ans)


class _Entries(NamedTuple):
    """Payloads to count, one group size: per payload its collective on each side (an index
    into ``_Side.colls``), per-rank offsets, length per owner, owners holding whole shards
    (``full``) and the real elements of the next one (``part``), the parameter (an index into
    the step's parameter list), its bucket index on each side and its elements."""

    ka: np.ndarray
    kb: np.ndarray
    oa: np.ndarray
    ob: np.ndarray
    length: np.ndarray
    full: np.ndarray
    part: np.ndarray
    param: np.ndarray
    ia: np.ndarray
    ib: np.ndarray
    numel: np.ndarray

    def take(self, sel) -> _Entries:
        return _Entries(*(x[sel] for x in self))


def _keep_worst(ans: _StepAnswer, kind: str, x: AtRisk) -> None:
    old = ans.at_risk.get((kind, x.fqn))
    if old is None or x.elements > old.elements:
        ans.at_risk[(kind, x.fqn)] = x


class _Classes(NamedTuple):
    """One side's size classes: collectives of one size share one tuple of plans (and so every
    channel map). ``of``: per collective its class (-1: not used; one more entry, last);
    per class its plans (or why there are none) and its (count, element size, group)."""

    of: np.ndarray
    plans: list
    size: list


def _size_classes(kind: str, S: _Side, used: list, ctx: _Context, memo: dict, said: set,
                  ans: _StepAnswer) -> _Classes:
    """The size classes of the collectives ``used`` (in order of first use); the model is
    asked once per size (``memo``) and what it assumed is said once (``said``), in order."""
    import numpy as np

    keys = [(id(c.topo), c.count, c.esize, c.op, c.group)
            for c in map(S.colls.__getitem__, used)]
    first: dict[tuple, int] = {}
    for mk, k in zip(keys, used):
        first.setdefault(mk, k)
    index: dict[tuple, int] = {}  # (plans, count, esize, group) -> class
    of_key: dict[tuple, int] = {}
    ps_of, size_of = [], []
    for mk, k in first.items():
        ps = memo.get(mk)
        if ps is None:
            c = S.colls[k]
            ps = memo[mk] = plans(c.topo, kind, c.count, c.esize, c.op, ctx.env, c.group,
                                  ctx.version)
            if not isinstance(ps, str) and id(ps) not in said:
                said.add(id(ps))
                spec = c.topo.spec()
                for p in ps:
                    ans.models.setdefault(p.model)
                    ans.assumptions.update(dict.fromkeys(f"{spec}: {a}" for a in p.assumptions))
        g = index.setdefault((id(ps), mk[1], mk[2], mk[4]), len(ps_of))
        if g == len(ps_of):
            ps_of.append(ps)
            size_of.append((mk[1], mk[2], mk[4]))
        of_key[mk] = g
    of = np.full(len(S.colls) + 1, -1, dtype=np.int64)
    of[used] = [of_key[mk] for mk in keys]
    return _Classes(of, ps_of, size_of)


def _count_entries(kind: str, n: int, entries: _Entries, A: _Side, B: _Side, params: list,
                   ctx: _Context, step: int | None, ans: _StepAnswer) -> None:
    """Elements at risk of ``entries`` (one group size): per parameter the worst over every
    scenario combination (:func:`_worst_over_scenarios`)."""
    import numpy as np

    memo: dict[tuple, tuple | str] = {}
    said: set[int] = set()
    cls = {}
    for side, S, ks in (("a", A, entries.ka), ("b", B, entries.kb)):
        u, at = np.unique(ks, return_index=True)
        cls[side] = _size_classes(kind, S, u[np.argsort(at)].tolist(), ctx, memo, said, ans)
    # a collective the model cannot know: its payloads are unknown, said per bucket pair
    unknown = {s: np.array([isinstance(ps, str) for ps in cls[s].plans] + [False],
                           dtype=bool)[cls[s].of] for s in ("a", "b")}
    out = unknown["a"][entries.ka] | unknown["b"][entries.kb]
    pairs: dict[tuple, str] = {}
    for i in np.flatnonzero(out).tolist():
        ka, kb = int(entries.ka[i]), int(entries.kb[i])
        pa, pb = cls["a"].plans[cls["a"].of[ka]], cls["b"].plans[cls["b"].of[kb]]
        why = pa if isinstance(pa, str) else pb
        guessed = (A.colls[ka] if isinstance(pa, str) else B.colls[kb]).bucket
        if getattr(guessed, "op_guessed", False):
            why += " (a compiled graph's reduce op is not recorded: counted as a SUM)"
        pairs.setdefault((int(entries.ia[i]), int(entries.ib[i])), why)
    for (ia, ib), why in pairs.items():
        ans.unknown.append({"collective": kind, "a": ia, "b": ib, "step": step, "reason": why})
    live = entries.take(np.flatnonzero(~out)) if out.any() else entries
    if not live.ka.size:
        return
    best = _worst_over_scenarios(kind, n, live, cls["a"], cls["b"])
    hit = np.flatnonzero(best)
    risk = ans.at_risk
    where: dict[tuple, dict] = {}  # per bucket pair, one (read-only) dict
    for ia, ib in dict.fromkeys(zip(live.ia[hit].tolist(), live.ib[hit].tolist())):
        where[(ia, ib)] = {"collective": kind, "a": ia, "b": ib}
    got = [AtRisk(params[j], nrisk, numel, where[(ia, ib)], "order", step)
           for j, nrisk, numel, ia, ib in zip(live.param[hit].tolist(), best[hit].tolist(),
                                              live.numel[hit].tolist(), live.ia[hit].tolist(),
                                              live.ib[hit].tolist())]
    for x in got:  # the worst per parameter (one met before: structure, another group)
        key = (kind, x.fqn)
        old = risk.get(key)
        if old is None or x.elements > old.elements:
            risk[key] = x
    _describe_buckets(kind, live, best, A, B, cls["a"], cls["b"], step, ans)


def _worst_over_scenarios(kind: str, n: int, live: _Entries, ca: _Classes, cb: _Classes
                          ) -> np.ndarray:
    """Per entry of ``live``, the most elements at risk over every scenario combination.

    Cost: combinations are counted most channels first (:func:`_combinations`), each only
    over the payloads not saturated yet (every real element of every owner already at risk:
    no later combination can add to them), and counting stops when every payload is
    saturated. The answer is that of counting every combination over every payload
    (tests/test_reduction_count.py checks it against such a count)."""
    import numpy as np

    # each side's collectives on one axis, in collective order
    axis, of, counts = {}, {}, {}
    for side, c, ks in (("a", ca, live.ka), ("b", cb, live.kb)):
        used = np.unique(ks)
        pos = np.full(c.of.size, -1, dtype=np.int64)
        pos[used] = np.arange(used.size)
        axis[side] = pos[ks]
        of[side] = c.of[used]
        counts[side] = [c.size[g][0] for g in of[side].tolist()]
    rc = RiskCount((axis["a"], axis["b"], live.oa, live.ob, live.length, live.full, live.part),
                   of["a"], counts["a"], of["b"], counts["b"],
                   Orders(n) if kind == RS else ChunkOrders(n))
    ecls = {s: of[s][axis[s]] for s in ("a", "b")}
    sizes = {key: i for i, key in enumerate(dict.fromkeys([*ca.size, *cb.size]))}
    same_size = (np.array([sizes[x] for x in ca.size], dtype=np.int64)[ecls["a"]]
                 == np.array([sizes[x] for x in cb.size], dtype=np.int64)[ecls["b"]])
    best = np.zeros(live.ka.size, dtype=np.int64)
    open_ = best < rc.cap  # not saturated yet
    for _, maps_a, maps_b, differ_protocols in _combinations(
            {"a": ca.plans, "b": cb.plans}, bool(same_size.all())):
        ok = np.array([m is not None for m in maps_a], dtype=bool)[ecls["a"]]
        ok &= np.array([m is not None for m in maps_b], dtype=bool)[ecls["b"]]
        if differ_protocols:
            ok &= ~same_size  # one size, one protocol choice
        ok &= open_
        if not ok.any():
            continue
        idx = np.flatnonzero(ok)
        best[idx] = np.maximum(best[idx], rc.count(idx, maps_a, maps_b))
        open_[idx] = best[idx] < rc.cap[idx]
        if not open_.any():
            break  # saturated: no combination can add
    return best


def _combinations(plans_of: dict, one_size: bool) -> list:
    """Every distinct scenario combination: per cluster (:func:`_clusters`) and protocol pair
    (the same protocol where every pair of collectives has one size), each size class's
    channel map (``Plan.cmap``; None where that class has no scenario of that protocol
    on that cluster). Combinations whose channel maps are equal are one. Sorted most channels
    first: more boundaries, usually more at risk, so the count saturates sooner."""
    out: dict[tuple, tuple] = {}
    for cluster in _clusters(plans_of):
        pick: dict[str, list] = {}
        memo: dict[int, dict] = {}  # both sides' collectives of one size share one tuple
        for side in ("a", "b"):
            pick[side] = []
            for ps in plans_of[side]:
                by = memo.get(id(ps))
                if by is None:
                    by = memo[id(ps)] = {}
                    for p in ps if isinstance(ps, tuple) else ():  # a str: unknown
                        if p.protocol not in by and p.fits(cluster):
                            by[p.protocol] = p.cmap
                pick[side].append(by)
        protos = {s: sorted({q for by in pick[s] for q in by}) for s in ("a", "b")}
        for pa in protos["a"]:
            for pb in protos["b"]:
                if pa != pb and one_size:
                    continue  # one size, one protocol choice: nothing to count
                maps_a = [by.get(pa) for by in pick["a"]]
                maps_b = [by.get(pb) for by in pick["b"]]
                sig = (tuple(m[2] if m else None for m in maps_a),
                       tuple(m[2] if m else None for m in maps_b), pa != pb)
                if sig not in out:
                    weight = sum(m[0].size for m in (*maps_a, *maps_b) if m)
                    out[sig] = (weight, maps_a, maps_b, pa != pb)
    return sorted(out.values(), key=lambda c: -c[0])


def _clusters(plans_of: dict) -> list[list]:
    """The clusters the scenarios of every size class of both sides describe (``plans_of``:
    side -> per class its plans): [communicator channels, family names, rings], each scenario
    joined to the first one it fits (the longest rings kept)."""
    out: list[list] = []
    seen: set[int] = set()
    for side in ("a", "b"):
        for ps in plans_of[side]:
            if not isinstance(ps, tuple) or id(ps) in seen:
                continue
            seen.add(id(ps))  # collectives of one size share one tuple of plans
            for p in ps:
                cl = next((c for c in out if p.fits(c)), None)
                if cl is None:
                    out.append([p.comm_channels, set(p.family.split("+")), p.rings])
                elif len(p.rings) > len(cl[2]):
                    cl[2] = p.rings
    return out


def _describe_buckets(kind: str, live: _Entries, risk: np.ndarray, A: _Side, B: _Side,
                      ca: _Classes, cb: _Classes, step: int | None, ans: _StepAnswer) -> None:
    """Per differing pair of collectives: bytes per rank at the target, the scenarios
    (protocol, ring family, the communicator's and this collective's channels) and the
    elements at risk."""
    import numpy as np

    key = live.ka * (len(B.colls) + 1) + live.kb
    pair, at, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    elements = np.bincount(inverse, weights=risk, minlength=pair.size).astype(np.int64).tolist()
    params = np.bincount(inverse, weights=risk > 0, minlength=pair.size).astype(np.int64).tolist()
    order = np.argsort(at, kind="stable")  # in order of first use
    first = at[order]
    scenarios: dict[tuple, list] = {}  # per pair of classes: collectives of one size share
    spec: dict[int, str] = {}
    for j, ka, kb, ga, gb in zip(order.tolist(), live.ka[first].tolist(),
                                 live.kb[first].tolist(), ca.of[live.ka[first]].tolist(),
                                 cb.of[live.kb[first]].tolist()):
        x, y = A.colls[ka], B.colls[kb]
        scen = scenarios.get((ga, gb))
        if scen is None:
            scen = scenarios[(ga, gb)] = _scenario_rows(ca.plans[ga], cb.plans[gb])
        group = spec.get(id(x.topo))
        if group is None:
            group = spec[id(x.topo)] = x.topo.spec()
        ans.buckets.append({
            "collective": kind, "step": step, "a": x.bucket.index, "b": y.bucket.index,
            "group": group, "bytes_per_rank": {"a": x.count * x.esize, "b": y.count * y.esize},
            "scenarios": scen,  # shared by buckets of one size: never edited
            "elements": elements[j], "params": params[j],
            "verdict": DIFFERS if elements[j] else SAME})


def _scenario_rows(ps_a: tuple, ps_b: tuple) -> list[dict]:
    """The scenarios of a pair of collectives, as the JSON's ``buckets[].scenarios`` says them:
    A's, each with B's channels on the same cluster and protocol, then B's others."""
    scen = []
    for pa in ps_a:
        pb = next((p for p in ps_b if p.protocol == pa.protocol and p.fits(
            [pa.comm_channels, pa.families, pa.rings])), None)
        scen.append({"protocol": pa.protocol, "family": pa.family,
                     "comm_channels": pa.comm_channels,
                     "channels": {"a": pa.nchannels,
                                  "b": pb.nchannels if pb is not None else None}})
    for pb in ps_b:
        if not any(s["protocol"] == pb.protocol and s["family"] == pb.family
                   and s["comm_channels"] == pb.comm_channels for s in scen):
            scen.append({"protocol": pb.protocol, "family": pb.family,
                         "comm_channels": pb.comm_channels,
                         "channels": {"a": None, "b": pb.nchannels}})
    return scen


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
    pred.params_checked = len(checked)
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
            if "#" in f:
                f = f.split("#", 1)[0]
            if f not in out:
                out[f] = shape
    return out


def predict_runs(a_dir: str | Path, b_dir: str | Path, topology
                 ) -> ReductionPrediction | Predictions:
    """The prediction for two run directories from their manifests and parameter tables alone
    (no hash comparison; ``parity diff --at`` gives the same ``reduction_order``)."""
    from parity.artifacts import read_run
    from parity.diff.buckets import compare_buckets, drop_invalid_buckets

    run_a, run_b = read_run(a_dir), read_run(b_dir)
    drop_invalid_buckets(run_a, run_b)  # a record of the wrong types: skipped, as in the diff
    usable = {side: sorted(r for r, rd in run.ranks.items() if rd.params)
              for side, run in (("a", run_a), ("b", run_b))}
    ranks = sorted(set(usable["a"]) & set(usable["b"]))
    layouts, order = compare_buckets(run_a, run_b, usable, ranks)
    world = run_a.world_size or (max(run_a.ranks) + 1 if run_a.ranks else None)
    return assess(run_a, run_b, ranks, layouts, order, world, topology)


def annotate(order, layouts: dict[str, Layout], shapes: dict[str, list[int]],
             _counts: tuple[dict, dict] | None = None,
             all_reduce: dict[str, list[Bucket]] | None = None,
             blind: str | None = None) -> None:
    """Consequence classes on the order comparison (parity.consequences): a reduce-scatter or
    all-reduce group carrying a gradient that the two sides reduce with a different number of
    collectives becomes ``reduction_structure``; ``order.structure`` lists such gradients and
    ``order.consequences`` counts the differing groups per class. ``blind`` ("A"/"B"): that
    side recorded no reduction at all, so no gradient's count is known there and none is a
    structure difference (said in ``order.notes``)."""
    from parity import consequences as cq

    ar = all_reduce or {}
    odd: set = set()
    order.structure = []
    if blind:
        note = cq_blind(blind) + "; reduction structure not compared"
        if note not in order.notes:
            order.notes.append(note)
    for kind in (RS, AR) if not blind else ():
        if kind == RS and _counts is not None:
            na, nb = _counts
        else:
            na = _reduce_counts(kind, layouts["a"], ar.get("a") or [], order.eager.get("a") or [],
                                shapes)
            nb = _reduce_counts(kind, layouts["b"], ar.get("b") or [], order.eager.get("b") or [],
                                shapes)
        for f in dict.fromkeys([*na, *nb]) if na != nb else ():
            if na.get(f, 0) != nb.get(f, 0):
                order.structure.append({"fqn": f, "a": na.get(f, 0), "b": nb.get(f, 0),
                                        **({"collective": AR} if kind == AR else {})})
                odd.add(f)
    counts: dict[str, int] = {}
    for p in order.pairs:
        if p.verdict == "identical":
            continue
        structure = bool(odd) and p.collective in cq.REDUCING and bool(
            ({m["fqn"] for m in p.moved} | {e["fqn"] for e in (p.a_entry, p.b_entry) if e})
            & odd)
        p.consequence = cq.classify(p.collective, p.verdict, structure)
        counts[p.consequence] = counts.get(p.consequence, 0) + 1
    if odd and not any(p.consequence == cq.REDUCTION_STRUCTURE for p in order.pairs):
        counts[cq.REDUCTION_STRUCTURE] = counts.get(cq.REDUCTION_STRUCTURE, 0) + 1
    order.consequences = counts
    fb = order.first_bucket
    if isinstance(fb, dict) and fb.get("collective"):
        lead = next((p for p in order.pairs if p.verdict != "identical"
                     and p.collective == fb["collective"] and p.verdict == fb.get("verdict")
                     and (fb.get("index") in p.a if fb.get("index") is not None
                          else not p.a and fb.get("b_index") in p.b)), None)
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
    for r in sorted(run.ranks):
        num = (run.ranks[r].meta or {}).get("numerics")
        if isinstance(num, dict):
            env = num.get("nccl_env") if isinstance(num.get("nccl_env"), dict) else {}
            v = num.get("nccl_version")
            return ({k: v for k, v in env.items() if isinstance(v, str)},
                    v if isinstance(v, str) else None)
    return {}, None


def _emulated_at(run) -> str | None:
    for r in sorted(run.ranks):
        emu = (run.ranks[r].meta or {}).get("nccl_emulation")
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
    # steps at which both sides have begun recording (a side's first records set its start);
    # a sequence that got shorter (``ends`` lines) is a change of layout too
    steps_a, steps_b = set(map(step_of, recs_a)), set(map(step_of, recs_b))
    start = max([min(st) for st in (steps_a, steps_b) if st] or [0])
    for run, r, st in ((run_a, ra, steps_a), (run_b, rb, steps_b)):
        st.update(map(step_of, getattr(run.ranks.get(r), "bucket_ends", ())))
    steps = [s for s in sorted(steps_a | steps_b) if s >= start]
    has_ar, ar_only, of_grads = one_sided_all_reduces(recs_a, recs_b)
    blind = _blind(recs_a, recs_b)
    ar_what = " of gradients" if of_grads else ""
    notes: list[str] = []
    if len(steps) > MAX_STEPS:
        notes.append(f"manifests change at {len(steps)} steps; the layouts of the first "
                     f"{MAX_STEPS} are compared and predicted")
        steps = steps[:MAX_STEPS]
    per_step: list[tuple] = []  # (step, la, lb, ara, arb)
    if len(steps) > 1 or has_ar:
        per_step = _per_step(run_a, run_b, ra, rb, steps, layouts, order)
    else:
        for side, recs in (("a", recs_a), ("b", recs_b)):
            annotate_buckets(layouts[side], recs)
        per_step.append((steps[0] if steps else None, layouts["a"], layouts["b"], [], []))
    # the order comparison: later steps' reduce-scatters and every step's all-reduces
    have = None if len(per_step) == 1 and not per_step[0][3] and not per_step[0][4] else {
        (p.collective, tuple(p.a), tuple(p.b), p.verdict, p.detail) for p in order.pairs}
    for k, (s, la, lb, ara, arb) in enumerate(per_step if have is not None else ()):
        if k:
            later = compare_layouts(la, lb)
            _add_pairs(order, [p for p in later.pairs if p.collective == RS], la, lb, ara, arb,
                       s, have)
        if (ara or arb) and not ar_only:
            cmp_a, cmp_b, note = paired_all_reduces(ara, arb)
            if note and note not in order.notes:
                order.notes.append(note)
            pairs, ar_notes = align_buckets(AR, cmp_a, cmp_b)
            for n in ar_notes:  # e.g. the all-reduces issued in another order: said, no failure
                if n not in order.notes:
                    order.notes.append(n)
            _add_pairs(order, pairs, la, lb, ara, arb, s if k else None, have, True)
    if ar_only:
        order.notes.append(ONE_SIDED_AR.format(side=ar_only, what=ar_what))
    # ranks beyond the reference whose groups or all-reduce layouts differ (round 14a)
    extra = other_ranks(run_a, run_b, ranks, ra) if ra == rb else OtherRanks()
    per_rank = _compare_other_ranks(run_a, run_b, extra, order, ar_only)
    if order.rank not in (None, ra) and order.rank not in per_rank and order.rank in run_a.ranks \
            and order.rank in run_b.ranks:  # buckets._compare_odd_ranks' worst rank
        r = order.rank
        per_rank[r] = _per_step(run_a, run_b, r, r, _steps_of(run_a, run_b, r), layouts, order)
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
    clipped: set = set()  # a clip's stacked norms (round 13): one value each
    for _, _, _, ara, arb in per_step:
        for f in (f for b in (*ara, *arb) for f in b.fqns):
            if f and f.endswith(NORM_SUFFIX):
                shapes.setdefault(f, [1])
                clipped.add(f[:-len(NORM_SUFFIX)])
    counts = (_reduce_counts(RS, layouts["a"], [], order.eager.get("a") or [], shapes),
              _reduce_counts(RS, layouts["b"], [], order.eager.get("b") or [], shapes))
    last = per_step[-1]
    annotate(order, layouts, shapes, counts,
             None if ar_only else {"a": last[3], "b": last[4]}, blind)
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
                       ar_what=ar_what, blind=blind)
        answers = []
        for k, (s, la, lb, ara, arb) in enumerate(per_step):
            c = counts if k == 0 else None
            answers.append(_answer(la, lb, ara, arb, order.eager, topo, ctx, s, c))
        for r, tuples in per_rank.items():  # other ranks' layouts: the worst answer wins
            for s, la, lb, ara, arb in tuples:
                answers.append(_answer(la, lb, ara, arb, order.eager, topo, ctx, s))
        pred = _finish(topo, answers, ra, source, [x[0] for x in per_step if x[0] is not None])
        if extra.left:  # ranks found to differ beyond those predicted: never "same" over them
            pred.unknown.append({"collective": AR if not extra.groups else next(iter(
                extra.groups[min(extra.groups)])), "a": None, "b": None, "step": None,
                "reason": f"rank(s) {ranges(extra.left)} differ from the reference rank in "
                          "their groups or all-reduce layouts and were not predicted (rank(s) "
                          f"{ranges(extra.compare)} were)"})
            if pred.verdict == SAME:
                pred.verdict = UNKNOWN
        pred.notes += notes
        pred.emulated = emulated
        pred.clipped = clipped
        out.append(pred)
    return out[0] if len(out) == 1 and not isinstance(at, list) else Predictions(out)


def _steps_of(run_a, run_b, r: int) -> list[int]:
    """The steps at which rank ``r``'s manifests changed on either side, from the first step
    both sides recorded (as ``assess`` takes the reference rank's)."""
    sts = []
    for run in (run_a, run_b):
        rd = run.ranks.get(r)
        recs = rd.buckets if rd is not None else []
        sts.append(set(map(step_of, recs)) | set(map(step_of, getattr(rd, "bucket_ends", ()))))
    start = max([min(st) for st in sts if st] or [0])
    return [s for s in sorted(sts[0] | sts[1]) if s >= start][:MAX_STEPS]


def _per_step(run_a, run_b, ra, rb, steps: list[int], layouts: dict, order) -> list[tuple]:
    """(step, A's layout, B's layout, A's all-reduces, B's all-reduces) of ranks ``ra`` / ``rb``
    at each step where a manifest changed, steps with the same layouts as an earlier one left
    out."""
    out, seen = [], set()
    for s in steps:
        la, ara = layouts_at(run_a, ra, A_PREFERS, s) if ra is not None else (layouts["a"], [])
        lb, arb = layouts_at(run_b, rb, B_PREFERS, s) if rb is not None else (layouts["b"], [])
        ara, arb, note = norms_named_on_one_side(ara, arb)
        if note and note not in order.notes:
            order.notes.append(note)
        sig = (signature(la, ara), signature(lb, arb))
        if sig in seen:
            continue
        seen.add(sig)
        out.append((s, la, lb, ara, arb))
    return out


def _compare_other_ranks(run_a, run_b, extra: OtherRanks, order, ar_only) -> dict[int, list]:
    """The ranks ``other_ranks`` found compared A against B on their own (round 14a): their
    all-reduces, and the all-gathers / reduce-scatters of a kind whose groups differ there; the
    differing pairs of the first rank that shows any join ``order`` (the rank named in each
    pair's detail). A group difference no pair shows (a kind the layouts do not compare there)
    is said on the verdict line ("not compared"). Returns each compared rank's per-step
    layouts, for the prediction."""
    out: dict[int, list] = {}
    have = {(p.collective, tuple(p.a), tuple(p.b), p.verdict, p.detail) for p in order.pairs}
    before, added, unshown = order.verdict, False, []
    for r in extra.compare:
        tuples = out[r] = _per_step(run_a, run_b, r, r, _steps_of(run_a, run_b, r), {}, order)
        kinds = set(extra.groups.get(r, {}))
        shown = added
        for k, (s, la, lb, ara, arb) in enumerate(tuples):
            pairs = []
            if kinds - {AR}:
                pairs += [p for p in compare_layouts(la, lb).pairs if p.collective in kinds]
            if (ara or arb) and not ar_only:
                cmp_a, cmp_b, _ = paired_all_reduces(ara, arb)
                pairs += align_buckets(AR, cmp_a, cmp_b)[0]
            # the first rank that shows a difference is shown (the others' are said in the
            # notes: the same bucket on each rank of a group would count several times)
            pairs = [p for p in pairs if p.verdict != "identical"] if not added else []
            for p in pairs:
                p.detail += f" on rank {r}"
            shown = shown or bool(pairs)
            _add_pairs(order, pairs, la, lb, ara, arb, s if k else None, have)
            fb = order.first_bucket
            if pairs and isinstance(fb, dict) and str(fb.get("detail")).endswith(f"on rank {r}"):
                fb["rank"] = r  # the verdict line says where (policy.order_phrase)
        added = added or shown
        if kinds and not shown:
            unshown.append(r)
    if unshown:  # said on the verdict line (policy._left_out)
        order.notes.insert(0, f"of rank(s) {ranges(unshown)}, whose groups differ "
                              f"({extra.describe()}) in collectives their layouts do not "
                              "compare; not compared")
    if order.verdict != before and extra.compare:
        order.rank = next((r for r in extra.compare if any(
            f"on rank {r}" in p.detail for p in order.pairs)), order.rank)
    if extra.groups:
        desc = extra.describe()
        if desc and not any(desc in n for n in order.notes):
            order.notes.insert(0, "groups differ beyond the reference rank: " + desc)
    order.notes[:0] = [n for n in extra.notes if n not in order.notes]
    return out


def _blind(recs_a: list, recs_b: list) -> str | None:
    """"A" or "B" when that side's records hold no reduction of any kind (no reduce-scatter or
    all-reduce, bucketed or eager) while the other side's do: the side recorded no manifests
    (``--no-manifests``) or none of its reductions, so how it reduced is not known. None when
    both sides recorded reductions, or neither did (nothing to compare either way)."""
    def reduces(recs) -> bool:
        return any(isinstance(r, dict) and r.get("collective") in (RS, AR) for r in recs or ())

    ra, rb = reduces(recs_a), reduces(recs_b)
    return None if ra == rb else "B" if ra else "A"


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
