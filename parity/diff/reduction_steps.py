"""Every step's reduction layouts (``parity diff``, issue 30): which bucket records are in force at
each step, and the all-reduce buckets capture/sources/c10d_allreduce.py records.

Why: manifests are written when they change, not every step, and the diff's layout selection
(parity/diff/buckets.py) keeps each bucket's first record. A parameter with no gradient at step 1
(a late-activated adapter or expert) joins its bucket at step 2; a recompiled graph replaces its
predecessor. parity/diff/reduction.py compares and predicts the layouts of every step where some
manifest changed, read through the functions here.
"""

from __future__ import annotations

import copy

from parity.diff.buckets import Bucket, Entry, Layout, ranks_of, select_layout
from parity.records import (NORM_SUFFIX, SOURCE_C10D, SOURCE_DTENSOR, SOURCE_FSDP2, SOURCE_GRAPH, BucketRecord,
                            as_int)

RS, AR = "reduce_scatter", "all_reduce"


def op_of(b: Bucket) -> str:
    """A reduction bucket's op (``infer_ops``, the c10d record's ``op``); SUM when not known."""
    return getattr(b, "op", None) or "sum"


def group_size_of(b: Bucket) -> int | None:
    """The group size a bucket's collective ran on, as recorded (None: not known)."""
    return getattr(b, "group_size", None)


def step_of(r: dict) -> int:
    s = r.get("step")
    if type(s) is int:  # the usual case, checked first: every record of every rank is read
        return s
    s = as_int(s)
    return s if s is not None else 0


def _sequence(r: dict) -> str:
    source = r.get("source") or "?"
    if source == SOURCE_C10D and r.get("group") == "ddp":
        return "c10d ddp"  # DDP's buckets: a sequence of their own
    if source == SOURCE_C10D and r.get("funcol") is True:
        return "c10d funcol"  # functional all-reduces (capture/sources/eager_funcol.py): too
    return source


def records_at(records: list[dict], step: int, ends: list[dict] = ()) -> list[dict]:
    """The bucket records in force at ``step``: eager FSDP2 writes a bucket again only when it
    changes (the latest at or before ``step`` per position: ``collective`` and ``index``, as
    capture/sources/fsdp2.py counts them), a compiled graph is replaced by a recompile carrying
    the same parameters (the latest one compiled by ``step``), DTensor and c10d sequences are
    written whole when they change (the latest one). ``ends`` (``RankData.bucket_ends``,
    parity.records.ENDS): from its step on, an FSDP2 position at or past its ``index`` is not in
    force until written again, and a DTensor or c10d sequence is empty until written again."""
    by_source: dict[str, list[dict]] = {}
    for r in records:
        if step_of(r) <= step:
            by_source.setdefault(_sequence(r), []).append(r)
    cut: dict[tuple, list[tuple[int, int]]] = {}  # (sequence, collective) -> [(step, index)]
    for e in ends:
        if step_of(e) <= step and as_int(e.get("index")) is not None:
            cut.setdefault((_sequence(e), e.get("collective")), []).append(
                (step_of(e), e["index"]))
    keep: list[dict] = []
    for source, recs in by_source.items():
        if source in (SOURCE_DTENSOR, SOURCE_C10D, "c10d ddp", "c10d funcol"):
            last = max(step_of(r) for r in recs)
            emptied = max((s for (q, _), cs in cut.items() if q == source for s, _ in cs),
                          default=-1)
            if emptied < last:
                keep += [r for r in recs if step_of(r) == last]
        elif source == SOURCE_GRAPH:
            keep += _latest_graphs(recs)
        else:
            last: dict = {}
            for r in recs:
                last[(r.get("collective"), r.get("index"))] = r
            for (q, coll), cs in cut.items():
                if q != source:
                    continue
                for s, n in cs:  # positions n and after ended at step s
                    for k in [k for k, r in last.items() if k[0] == coll
                              and isinstance(k[1], int) and k[1] >= n and step_of(r) <= s]:
                        del last[k]
            chosen = set(map(id, last.values()))
            keep += [r for r in recs if id(r) in chosen]
    ids = set(map(id, keep))
    return [r for r in records if id(r) in ids]


def _latest_graphs(recs: list[dict]) -> list[dict]:
    """Graph records minus graphs replaced by a later one carrying the same parameters."""
    by_gid: dict = {}
    for r in recs:
        by_gid.setdefault(r.get("graph_id"), []).append(r)
    order = sorted(by_gid, key=lambda g: (max(step_of(r) for r in by_gid[g]),
                                         g if isinstance(g, int) else -1), reverse=True)
    taken: dict[tuple, set] = {}
    keep: list[dict] = []
    for g in order:
        rs = by_gid[g]
        params: dict[tuple, set] = {}
        for r in rs:
            k = (r.get("collective"), r.get("stage"))
            params.setdefault(k, set()).update(
                e.get("fqn") for e in r.get("entries") or [] if isinstance(e, dict))
        if any(params[k] & taken.get(k, set()) for k in params):
            continue  # a later graph recompiled these parameters
        for k, ps in params.items():
            taken.setdefault(k, set()).update(ps)
        keep += rs
    return keep


def change_steps(*record_lists: list[dict]) -> list[int]:
    """The steps at which some manifest of either side was (re)written, in order."""
    steps: set[int] = set()
    for recs in record_lists:
        steps.update(map(step_of, recs))
    return sorted(steps)


def all_reduce_buckets(records: list[dict]) -> list[Bucket]:
    """A rank's all-reduce buckets of the records given, in record order, as Buckets (``op``,
    ``group_size``, ``module``, ``coalesced`` set): the c10d source's
    (capture/sources/c10d_allreduce.py) and compiled graphs' (capture/sources/graph_walk.py,
    the layout that runs: not a graph recorded before its passes), and eager DTensor's
    (capture/sources/eager_collectives.py: a Partial gradient all-reduced by DTensor, named after
    its parameter, round 10c). All record offsets in bytes over the whole buffer and one entry
    per gradient, so one side's eager all-reduces and the other's compiled ones are aligned as
    any two sides' are."""
    out = []
    for r in records:
        source = r.get("source")
        if r.get("collective") != AR or source not in (SOURCE_C10D, SOURCE_GRAPH,
                                                       SOURCE_DTENSOR) or (
                source == SOURCE_GRAPH and r.get("stage") == "before_passes"):
            continue
        rec = BucketRecord.from_dict(r)
        b = Bucket(AR, len(out), rec.group, rec.dtype, rec.total_bytes,
                   [Entry(e.fqn, e.offset, e.size, e.numel, e.dtype) for e in rec.entries],
                   rec.step if isinstance(rec.step, int) else None,
                   world_size=rec.world_size, ranks=ranks_of(rec.extra.get("ranks")))
        if source == SOURCE_C10D:
            b.module = rec.group if isinstance(rec.group, str) else None  # the call site
        else:  # the module it was issued under
            b.module = rec.module if isinstance(rec.module, str) else None
        b.coalesced = bool(rec.extra.get("coalesced"))
        b.op = str(rec.extra.get("op") or "sum")
        scale = rec.extra.get("op_scale")
        b.op_scale = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) \
            else None
        b.group_size = rec.world_size
        b.sparse = bool(rec.extra.get("sparse"))
        b.after = as_int(rec.extra.get("after")) if rec.extra.get("funcol") is True else None
        b.plain_c10d = source == SOURCE_C10D and rec.group != "ddp" and b.after is None \
            and rec.extra.get("funcol") is not True
        out.append(b)
    return _issue_order(out)


def _issue_order(out: list[Bucket]) -> list[Bucket]:
    """The functional all-reduces (capture/sources/eager_funcol.py, a sequence written after
    the c10d source's) put back among the hand-written ones where they were issued: each
    carries ``after``, the number of the c10d source's all-reduces issued before it in its
    step. The merged run takes the place of the first of them; indices renumbered. Lines
    without ``after`` (runs recorded before) stay in record order."""
    funcol = [b for b in out if getattr(b, "after", None) is not None]
    if not funcol:
        return out
    plain = [b for b in out if getattr(b, "plain_c10d", False)]
    merged, i = [], 0
    for b in funcol:  # in issue order among themselves
        while i < len(plain) and i < b.after:
            merged.append(plain[i])
            i += 1
        merged.append(b)
    merged += plain[i:]
    moved = {id(b) for b in merged}
    first = next(k for k, b in enumerate(out) if id(b) in moved)
    rest = [b for b in out if id(b) not in moved]
    ordered = rest[:sum(1 for b in out[:first] if id(b) not in moved)] + merged + \
        rest[sum(1 for b in out[:first] if id(b) not in moved):]
    for k, b in enumerate(ordered):
        b.index = k
    return ordered


def one_sided_all_reduces(records_a: list[dict], records_b: list[dict]) -> tuple[bool, str | None,
                                                                                  bool]:
    """(either side recorded all-reduces, the side ("A"/"B") whose all-reduces the other side
    lacks or None, whether that is about gradients). One side's all-reduces carrying parameters'
    gradients against none on the other (its reduction ran where no source sees it: a
    functional collective run eagerly, a C++ hook) are one-sided too, even when the other side
    recorded a loss or metric all-reduce: aligned, they would read as gradients moved out of
    every bucket, a difference nobody made."""
    bka, bkb = all_reduce_buckets(records_a), all_reduce_buckets(records_b)
    if bool(bka) != bool(bkb):
        return True, "A" if bka else "B", False
    named_a = any(carries_gradients(b) for b in bka)
    named_b = any(carries_gradients(b) for b in bkb)
    if named_a != named_b:
        return True, "A" if named_a else "B", True
    return bool(bka), None, False


def paired_all_reduces(ara: list[Bucket], arb: list[Bucket]
                       ) -> tuple[list[Bucket], list[Bucket], str | None]:
    """The all-reduce buckets of each side to align, and a note on those left out. All-reduces
    that carry no parameter at all (a loss or metric: a graph classifies them ``activation`` or
    ``token``; the c10d source leaves them unnamed) are aligned only when both sides recorded
    some: one side's loss all-reduce run inside its graph against the other's run where no
    source sees it would otherwise read as a bucket moved, a difference nobody made."""
    bare_a = [b for b in ara if not carries_gradients(b)]
    bare_b = [b for b in arb if not carries_gradients(b)]
    if bool(bare_a) == bool(bare_b):
        return ara, arb, None
    side, bare = ("A", bare_a) if bare_a else ("B", bare_b)
    note = (f"all_reduce: {len(bare)} all-reduce(s) of {side} carrying no parameter (a loss or "
            "metric) have no such all-reduce on the other side to compare with: not compared")
    return ([b for b in ara if carries_gradients(b)], [b for b in arb if carries_gradients(b)],
            note)


def norms_named_on_one_side(ara: list[Bucket], arb: list[Bucket]
                            ) -> tuple[list[Bucket], list[Bucket], str | None]:
    """A clip's norm vector named value by value (``<fqn>:grad_norm``) on one side only: the
    other side ran its clip where the values' names are not recorded (inside a compiled graph,
    a hand-written all-reduce) or was recorded before names were written. The named side's
    vectors are compared unnamed, as the other side's are (the order of the values is then
    not compared, and ``--at`` says so), instead of reading as a partition difference whose
    names the other side merely did not record (round 13, lead). Returns both sides' buckets
    and the note saying it (None when nothing changed)."""
    def named(bs: list[Bucket]) -> bool:
        return any(f and f.endswith(NORM_SUFFIX) for b in bs for f in b.fqns)

    if named(ara) == named(arb):
        return ara, arb, None
    side = "A" if named(ara) else "B"

    def bare(b: Bucket) -> Bucket:
        if not any(f and f.endswith(NORM_SUFFIX) for f in b.fqns):
            return b
        n = sum(e.numel or 0 for e in b.entries)
        out = copy.copy(b)
        out.entries = [Entry(None, 0, b.total_bytes, n, b.dtype)]
        return out

    note = (f"all_reduce: the clip's gradient norms are named value by value in {side} only "
            "(the other side's clip ran where their names are not recorded: a compiled clip, a "
            "hand-written all-reduce, or an older parity); compared without names, the order "
            "of the values not compared")
    return ([bare(b) for b in ara], [bare(b) for b in arb], note)


def carries_gradients(b: Bucket) -> bool:
    """Whether an all-reduce bucket carries a parameter's gradient: a named entry that is not
    a clip's gradient norm (``<fqn>:grad_norm``, a value computed from the gradient, no part of
    it: round 13). A clip's norm vector is thus of the class of a loss or a token count, and a
    clip named value by value against a hand-written one of one scalar is compared, not read as
    gradients one side reduced where no source sees them."""
    return any(f and not f.endswith(NORM_SUFFIX) for f in b.fqns)


def annotate_buckets(layout: Layout, records: list[dict]) -> None:
    """Reduce-scatter buckets get their group size (the recorded ``world_size``), whether they
    were one coalesced call, and their op: eager FSDP2 reduce-scatters fp32 and bf16 gradients
    with the op FSDP2's rule gives for the call (``op``: ``_get_gradient_divide_factors`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, torch 2.6-2.13: AVG, i.e. NCCL's
    PreMulSum, for fp32 and bf16 on more than one rank; PREMUL_SUM under a divide factor, as
    torchtitan sets 1.0); a compiled graph's op is the one its node names (``op``,
    graph_walk.py). Runs recorded before parity wrote the op: eager FSDP2's by the default
    rule (``infer_ops``), a graph's counts as a sum (the answer that leaves PAT and NVLS
    possible: unknown rather than a guess)."""
    by_key: dict = {}
    sources = (SOURCE_FSDP2, SOURCE_GRAPH)
    for r in reversed(records):  # the first record of a key is written last
        if r.get("collective") == RS and r.get("source") in sources:
            by_key[(r.get("graph_id"), r.get("index"))] = r
    for b in layout.buckets.get(RS, []):
        r = by_key.get((b.graph_id, b.record_index))
        b.group_size = as_int(r.get("world_size")) if r is not None else None
        b.coalesced = bool(b.node) and "coalesced" in b.node
        op = r.get("op") if r is not None else None
        if isinstance(op, str) and op:
            b.op = op
            scale = r.get("op_scale")
            b.op_scale = scale if isinstance(scale, (int, float)) and \
                not isinstance(scale, bool) else None
    infer_ops(layout)


def infer_ops(layout: Layout) -> None:
    """A reduce-scatter bucket's op where it has none: AVG for eager FSDP2's fp32 and bf16
    gradients on more than one rank (``_get_gradient_divide_factors``), else SUM."""
    fsdp2 = layout.source == SOURCE_FSDP2
    for b in layout.buckets.get(RS, []):
        if getattr(b, "op", None) is None:
            b.op = "avg" if fsdp2 and b.dtype in ("float32", "bfloat16") and \
                (group_size_of(b) or 2) > 1 else "sum"
            b.op_guessed = not fsdp2  # a compiled graph's op: not recorded


def layouts_at(run, rank: int, prefer: tuple, step: int) -> tuple[Layout, list[Bucket]]:
    rd = run.ranks.get(rank)
    recs = rd.buckets if rd is not None else []
    now = records_at(recs, step, getattr(rd, "bucket_ends", ()))
    lay = select_layout(now, prefer, rank)
    annotate_buckets(lay, now)
    return lay, all_reduce_buckets(now)


def signature(lay: Layout, ar: list[Bucket]) -> tuple:
    return (lay.source, tuple(b.signature() for b in lay.buckets.get(RS, [])),
            tuple(sorted(lay.repeats.items())),
            tuple((b.signature(), op_of(b), group_size_of(b), getattr(b, "module", None)) for b in ar))
