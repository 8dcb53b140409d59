"""The bucket record of the artifact schema (one line of buckets.jsonl, docs/artifacts.md), typed.

Every manifest source builds a :class:`BucketRecord` (eager FSDP2: capture/sources/fsdp2.py, compiled
graphs: capture/sources/graph.py and graph_makefx.py, eager DTensor collectives:
capture/sources/eager_collectives.py); the session stamps its step and hands ``to_dict()`` to the writer;
the diff reads a line back with :meth:`BucketRecord.from_dict` (tolerant: a field of the wrong
type reads as None, unknown keys are kept in ``extra``). Also how a dtype and a bucket's group are
spelled, so that every source writes them alike. Standard library only: capture imports it in
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

class _Absent:
    """An optional key the record does not have (``None`` is written as ``null``; ABSENT is
    not written at all), so a line reads back and writes out unchanged."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


# The ``source`` of a bucket line: which kind of hook point recorded it. One spelling for capture
# (capture/sources/registry.py: each manifest source writes one of these), diff and report.
SOURCE_FSDP2 = "fsdp2"  # eager FSDP2's collectives (capture/sources/fsdp2.py)
SOURCE_GRAPH = "graph"  # a compiled graph (capture/sources/graph.py, capture/sources/graph_makefx.py)
SOURCE_DTENSOR = "dtensor"  # DTensor redistributions outside graphs (capture/sources/eager_collectives.py)
# an entry holding the norm of that parameter's gradient (``<fqn>:grad_norm``): one value of a
# gradient-norm clip's stacked per-parameter norms, all-reduced by DTensor (round 13, lead)
NORM_SUFFIX = ":grad_norm"
SOURCE_C10D = "c10d"  # plain c10d all-reduces outside graphs: HSDP, hand-written (capture/sources/c10d_allreduce.py)

# params.json ``kind`` of a row that holds an optimizer's per-parameter state (Adam's
# ``exp_avg``...), hashed in the final state only (capture/opt_state.py, diff/opt_state.py)
KIND_OPTIMIZER_STATE = "optimizer_state"

ABSENT: Any = _Absent()
# optional record keys, written after the required ones when present (docs/artifacts.md)
_OPTIONAL = {"stage": str, "trace": str, "module": str, "placements": str, "position": int,
             "compute_before": int}


# A buckets.jsonl line with ``"ends": true`` is no bucket: from its ``step`` on, its ``source``
# issued only ``index`` buckets of its ``collective`` per step (eager FSDP2: positions ``index``
# and after did not run, e.g. a ``fully_shard`` group unused at that step), or for the sources
# written as whole sequences (dtensor, c10d) none at all. Why: those sources write a bucket when
# it changes, so without it a position that vanished stays in force (diff/reduction_steps.py,
# ``records_at``). The reader keeps these lines apart (``RankData.bucket_ends``): no reader of
# layouts ever sees them as buckets.
ENDS = "ends"


def ends_record(source: str, collective: str, index: int, step: int,
                world_size: int = 1) -> "BucketRecord":
    """The ``ends`` line of ``source``'s ``collective`` sequence at ``step``: ``index`` buckets
    (``world_size``: the group size of the buckets it ends, so that every line has one)."""
    return BucketRecord(source, collective, index, [], step=step, dtype="",
                        world_size=world_size, total_bytes=0, extra={ENDS: True})


def is_ends(r: Any) -> bool:
    """A buckets.jsonl line that marks where a sequence ends (``ENDS``), not a bucket."""
    return type(r) is dict and r.get(ENDS) is True


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"`` (the artifact's dtype spelling)."""
    return str(dtype).removeprefix("torch.")


def reduce_op_name(op: Any) -> str:
    """``ReduceOp.SUM`` -> ``"sum"``, ``RedOpType.AVG`` -> ``"avg"``, a ``PREMUL_SUM(f)`` object
    -> ``"premul_sum"`` (it carries its RedOpType in ``.op``; its str() is an object address),
    anything else -> ``"other"``: the record's ``op`` as every source spells it (the graph
    source writes the node's own string, which is the same spelling)."""
    op = getattr(op, "op", op)
    text = str(op)
    return text.rsplit(".", 1)[-1].lower() if "." in text and " " not in text else "other"


def common_prefix(names) -> str | None:
    """The longest dotted prefix of every name (``a.b``, ``a.b.c`` -> ``a.b``; ``""`` is the
    root); None when no name is given (None entries are skipped)."""
    known = [n.split(".") if n else [] for n in names if n is not None]
    if not known:
        return None
    prefix: list[str] = []
    for parts in zip(*known):
        if all(p == parts[0] for p in parts):
            prefix.append(parts[0])
        else:
            break
    return ".".join(prefix)


def common_module(fqns) -> str:
    """The module holding every parameter (``a.b.w``, ``a.b.c.w`` -> ``a.b``): a bucket's group
    when its owner is not known. Empty names are ignored."""
    return common_prefix([f.rsplit(".", 1)[0] if "." in f else "" for f in fqns if f]) or ""


def as_int(x) -> int | None:
    """``x`` if it is an int (a JSON bool is not), else None: how a record field of the wrong
    type reads (tolerant reading; diff/buckets.py reads its fields alike)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def as_str(x) -> str | None:
    """``x`` if it is a str, else None (see :func:`as_int`)."""
    return x if isinstance(x, str) else None


@dataclass
class BucketEntry:
    """One payload of a bucket: whose it is and where it lies in the flat buffer (bytes)."""

    fqn: str | None  # None: not a parameter (an eager DTensor collective of an activation)
    offset: int | None
    size: int | None
    numel: int | None
    dtype: str | None
    shape: list[int] | None = None
    module: str | None = ABSENT  # compiled graphs: the module the payload was issued under
    # compiled graphs, a payload that is no parameter: "activation" (computed in the graph, an
    # input or its gradient) or "token" (integer / bool data: token ids, sizes, flags)
    payload: str | None = ABSENT

    def to_dict(self) -> dict:
        d = {"fqn": self.fqn, "offset": self.offset, "size": self.size, "numel": self.numel,
             "dtype": self.dtype, "shape": self.shape}
        if self.module is not ABSENT:
            d["module"] = self.module
        if self.payload is not ABSENT:
            d["payload"] = self.payload
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BucketEntry":
        shape = d.get("shape")
        return cls(as_str(d.get("fqn")), as_int(d.get("offset")), as_int(d.get("size")),
                   as_int(d.get("numel")), as_str(d.get("dtype")),
                   list(shape) if isinstance(shape, list) else None,
                   as_str(d["module"]) if "module" in d else ABSENT,
                   as_str(d["payload"]) if "payload" in d else ABSENT)


@dataclass
class BucketRecord:
    """One collective bucket's layout, as one line of buckets.jsonl (without ``v``)."""

    source: str | None  # SOURCE_FSDP2 | SOURCE_GRAPH | SOURCE_DTENSOR
    collective: str | None  # "all_gather" | "reduce_scatter" (dtensor: also all_reduce, ...)
    index: int | None  # issue order among this collective's buckets (per step / per graph)
    entries: list[BucketEntry]
    graph: str | None = None  # "forward" | "backward" for compiled graphs
    graph_id: int | None = None
    step: int | None = ABSENT  # stamped by the session: the step during which it was issued
    group: str | None = None  # the module that owns the bucket
    node: str | None = None  # the FX node (compiled graphs)
    dtype: str | None = ""
    world_size: int | None = 1
    total_bytes: int | None = 0
    # optional (ABSENT: not written)
    stage: str | None = ABSENT  # "before_passes" | "after_passes" (compiled graphs)
    trace: str | None = ABSENT  # "make_fx" for GraphTrainer's joint graphs
    module: str | None = ABSENT  # the module it was issued under (dtensor: the object chain)
    placements: str | None = ABSENT  # dtensor: "Shard(dim=0) -> Replicate()"
    position: int | None = ABSENT  # compiled graphs: the collective's position in the graph
    compute_before: int | None = ABSENT  # compiled graphs: compute ops issued before it
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept

    def to_dict(self) -> dict:
        d = {"source": self.source, "collective": self.collective, "graph": self.graph,
             "graph_id": self.graph_id}
        if self.step is not ABSENT:  # a compiled graph's record has none until the session's
            d["step"] = self.step
        d.update(index=self.index, group=self.group, node=self.node, dtype=self.dtype,
                 world_size=self.world_size, total_bytes=self.total_bytes)
        for k in _OPTIONAL:
            v = getattr(self, k)
            if v is not ABSENT:
                d[k] = v
        for k, v in self.extra.items():
            d.setdefault(k, v)
        d["entries"] = [e.to_dict() for e in self.entries]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BucketRecord":
        known = {"v", "source", "collective", "graph", "graph_id", "step", "index", "group",
                 "node", "dtype", "world_size", "total_bytes", "entries", *_OPTIONAL}
        entries = d.get("entries")
        return cls(
            as_str(d.get("source")), as_str(d.get("collective")), as_int(d.get("index")),
            [BucketEntry.from_dict(e) for e in entries if isinstance(e, dict)]
            if isinstance(entries, list) else [],
            graph=as_str(d.get("graph")), graph_id=as_int(d.get("graph_id")),
            step=as_int(d["step"]) if "step" in d else ABSENT,
            group=as_str(d.get("group")), node=as_str(d.get("node")), dtype=as_str(d.get("dtype")),
            world_size=as_int(d.get("world_size")), total_bytes=as_int(d.get("total_bytes")),
            **{k: (as_str(d[k]) if t is str else as_int(d[k]))
               for k, t in _OPTIONAL.items() if k in d},
            extra={k: v for k, v in d.items() if k not in known})
