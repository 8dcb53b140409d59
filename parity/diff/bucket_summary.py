"""What the bucketing passes did, from one run's bucket manifests (pure: no torch).

The manifests record every collective's byte layout; this module condenses them into the figures
the people tuning bucketing passes compare (AutoParallel's "all-gathers 290 -> 98", topo-span
bounded bucketing's ``max_consec_compute_between_rs``), per graph and collective kind:

* ``count_before`` / ``count_after``: collectives before the trainer's passes (the graph recorded
  with ``"stage": "before_passes"``) and after them. For eager FSDP2 "before" is one collective
  per parameter (what an unbucketed FSDP would issue) and "after" the groups as issued.
* ``bytes``: min / median / max of the buckets' per-rank payload (``total_bytes``).
* ``spans_at_bucketing`` / ``max_span_at_bucketing``: AutoParallel's bucket span, as its
  ``greedy_bucket`` logs it (meta-pytorch/autoparallel ``auto_bucketing.py``, a54c252): per bucket
  a bucketing pass formed, the rank of its latest member minus its earliest's in the graph the
  pass received (capture/sources/graph_bucketing.py); null where no inductor bucketing pass ran.
* ``max_consec_compute_between_rs``: AutoParallel's ``_max_consec_compute_between_rs`` of the
  graph after the passes (recorded by capture, capture/sources/graph_walk.py): the longest run of
  matmul-like nodes with no reduce-scatter in between; null where not recorded.
* parity's own figures, labelled so: ``spans`` / ``max_span``, per bucket after the passes the
  index of its last member minus its first in the *pre-pass* graph order (a member's index is
  the ``position`` of the pre-pass collective that carried that parameter; null without a
  pre-pass graph); ``compute_between_rs`` / ``max_compute_between_rs``, every non-plumbing op
  between consecutive reduce-scatters (differences of ``compute_before``).
* ``payloads`` (compiled graphs): the buckets after the passes by what they carry: ``parameter``
  (any payload is a parameter's), else ``activation`` or ``token`` (integer data), as capture
  classified them (``unknown``: payloads not read).

And module attribution: every entry's issuing module (compiled: the module of that payload's
own pre-pass collective when recorded, else the entry's ``module``, from the nodes'
``module_fqn`` / ``nn_module_stack`` meta; eager FSDP2: the group; eager DTensor: the ``module``
chain) and the entries issued under a module that is not the parameter's owner or one of its
ancestors (lm_head's chunked collectives under the loss); ``homes``, the module whose bucket
carries each parameter, and for a diff the parameters whose home moved to an unrelated module
(``moved_between``).

``summarize(buckets)`` takes one rank's bucket records (``RankData.buckets``); ``summarize_run``
picks the lowest rank present. Ranks record the same layouts, so one rank speaks for the run.
"""

from __future__ import annotations


from collections import OrderedDict, defaultdict
from typing import Any

from parity.records import SOURCE_DTENSOR, SOURCE_FSDP2, SOURCE_GRAPH

__all__ = ["summarize", "summarize_run", "bucket_problem", "valid_buckets", "headline", "issued_elsewhere", "pair_rows", "side_label",
           "cell_headline", "bucket_homes", "moved_between", "summarize_pair"]

BEFORE = "before_passes"

# a bucket record's fields and the type each must have when present (null allowed): a line of
# another type is not of the schema and is skipped, named (docs/reliability.md); every reader of
# bucket records (this summary, the diff's layouts and reductions) sees only valid ones
_INT, _STR = (int,), (str,)
_FIELDS = {"source": _STR, "collective": _STR, "graph": _STR, "graph_id": _INT, "step": _INT,
           "index": _INT, "group": _STR, "node": _STR, "dtype": _STR, "world_size": _INT,
           "total_bytes": _INT, "stage": _STR, "trace": _STR, "module": _STR,
           "placements": _STR, "position": _INT, "compute_before": _INT,
           "max_consec_compute_between_rs": _INT, "around_bucketing": (dict,),
           "spans_at_bucketing": (dict,), "entries": (list,)}
_ENTRY_FIELDS = {"fqn": _STR, "offset": _INT, "size": _INT, "numel": _INT, "dtype": _STR,
                 "shape": (list,), "module": _STR, "payload": _STR}


def bucket_problem(rec, _entries_ok: dict | None = None) -> str | None:
    """Why a bucket record is not of the schema (a field of the wrong type: ``"index": "x"``,
    ``"total_bytes": "big"``, an entry that is not an object), or None when it is. ``_entries_ok``
    (id of an entries list -> that list): lists already checked (every step repeats them)."""
    if not isinstance(rec, dict):
        return f"not an object ({type(rec).__name__})"
    wrong = _first_wrong(rec, _FIELDS)
    if wrong is not None:
        return wrong
    entries = rec.get("entries")
    if not entries or (_entries_ok is not None and _entries_ok.get(id(entries)) is entries):
        return None
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            return f"entry {i} is {type(e).__name__}, not an object"
        wrong = _first_wrong(e, _ENTRY_FIELDS)
        if wrong is not None:
            return f"entry {i} {wrong}"
        shape = e.get("shape")
        if shape is not None and any(not isinstance(d, int) or isinstance(d, bool)
                                     for d in shape):
            return f"entry {i} shape {_show(shape)} is not a list of integers"
    if _entries_ok is not None:
        _entries_ok[id(entries)] = entries
    return None


def _first_wrong(obj: dict, fields: dict) -> str | None:
    """'index is str 'x', not int' for the first field of ``obj`` of a type ``fields`` does not
    allow, or None."""
    # over the keys the object has (a dozen of the schema's thirty; every rank's every line
    # comes here: 24,000 lines for a 256-rank run whose ranks record their own groups), inline;
    # JSON true/false: no field of a bucket record is one
    for k, v in obj.items():
        if v is None:
            continue
        types = fields.get(k)
        if types is not None and (v is True or v is False or not isinstance(v, types)):
            return f"{k} is {type(v).__name__} {_show(v)}, not {types[0].__name__}"
    return None


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# record lists found valid whole (id -> (the list, its length then)): the diff checks each
# rank's list, then its summaries and the prediction read the same lists again; a few dozen
# distinct lists at most (byte-identical manifests share one list), so the bound is small
_FOUND_VALID: OrderedDict = OrderedDict()


def valid_buckets(records: list, _memo: dict | None = None) -> tuple[list, list[str]]:
    """(the records of the schema, why each other one is not: "record N (all_gather index
    'x'): index is str 'x', not int; skipped"). The very list comes back when every record is
    valid (the reader shares byte-identical manifests between ranks and sides); ``_memo`` (id of
    a records list -> (list, result)) checks a shared list once."""
    if _memo is not None:
        got = _memo.get(id(records))
        if got is not None and got[0] is records:
            return got[1]
    seen = _FOUND_VALID.get(id(records))
    if seen is not None and seen[0] is records and seen[1] == len(records):
        return records, []  # checked whole before (the diff, then its summaries)
    ok_entries: dict = {} if _memo is None else _memo.setdefault("entries", {})
    bad = []
    for i, r in enumerate(records or ()):
        why = bucket_problem(r, ok_entries)
        if why is not None:
            what = (f" ({r.get('collective')} index {_show(r.get('index'))})"
                    if isinstance(r, dict) else "")
            bad.append((i, f"record {i + 1}{what}: {why}; not of the schema, skipped"))
    if not bad:
        out = (records, [])
        if isinstance(records, list):
            _FOUND_VALID[id(records)] = (records, len(records))
            if len(_FOUND_VALID) > 64:
                _FOUND_VALID.popitem(last=False)
    else:
        skip = {i for i, _ in bad}
        out = ([r for i, r in enumerate(records) if i not in skip], [m for _, m in bad])
    if _memo is not None:
        _memo[id(records)] = (records, out)
    return out


def _key(b: dict) -> tuple:
    return (b.get("source"), b.get("graph"), b.get("graph_id"), b.get("collective"))


def _bytes(buckets: list[dict]) -> dict | None:
    sizes = [int(b.get("total_bytes") or 0) for b in buckets]
    if not sizes:
        return None
    s, n = sorted(sizes), len(sizes)  # statistics.median's rule (its import costs 10 ms)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return {"min": s[0], "median": median, "max": s[-1]}


def _fqns(b: dict) -> list[str]:
    return [e["fqn"] for e in b.get("entries") or [] if e.get("fqn")]


def _spans(after: list[dict], before: list[dict]) -> list[int | None] | None:
    """Per bucket after the passes: last member's pre-pass position minus the first's."""
    if not before or any(not isinstance(b.get("position"), int) for b in before):
        return None
    where: dict[str, int] = {}
    for b in before:
        for f in _fqns(b):
            where.setdefault(f, b["position"])
    out: list[int | None] = []
    for b in after:
        pos = [where.get(f) for f in _fqns(b)]
        out.append(max(pos) - min(pos) if pos and None not in pos else None)
    return out


def _compute_between(buckets: list[dict]) -> list[int] | None:
    marks = [b.get("compute_before") for b in sorted(buckets, key=lambda b: b.get("position") or 0)]
    if any(not isinstance(m, int) for m in marks):
        return None
    return [b - a for a, b in zip(marks, marks[1:])]


def _payloads(buckets: list[dict]) -> dict[str, int]:
    """Buckets by what they carry: ``parameter`` when any payload is a parameter's, else the
    class capture gave the first payload (``activation``, ``token``)."""
    out: dict[str, int] = {}
    for b in buckets:
        entries = b.get("entries") or []
        if any(e.get("fqn") for e in entries):
            kind = "parameter"
        elif not entries:
            kind = "unknown"  # its payloads could not be read (a capture warning says why)
        else:
            kind = entries[0].get("payload") or "activation"
        out[kind] = out.get(kind, 0) + 1
    return out


def _latest_fsdp2(buckets: list[dict]) -> list[dict]:
    """FSDP2 layouts are written when first issued and again when they change: the last one per
    (collective, index) is the layout in force. Each gets the phase it was issued in as its
    ``graph``: a group's first all-gather of the step is the forward's, a second one the
    backward's (a group resharded after forward is gathered again for its backward);
    reduce-scatters are the backward's."""
    last: dict[tuple, dict] = {}
    for b in buckets:
        last[(b.get("collective"), b.get("index"))] = b
    out, gathered = [], set()
    for b in sorted(last.values(), key=lambda b: (b.get("collective") or "", b.get("index") or 0)):
        phase = "backward"
        if b.get("collective") == "all_gather":
            phase = "backward" if b.get("group") in gathered else "forward"
            gathered.add(b.get("group"))
        out.append({**b, "graph": b.get("graph") or phase})
    return out


def _latest_dtensor(buckets: list[dict]) -> list[dict]:
    """DTensor sequences are written per step when they change: the latest step's is in force."""
    if not buckets:
        return []
    last = max(int(b.get("step") or 0) for b in buckets)
    return [b for b in buckets if int(b.get("step") or 0) == last]


def summarize(buckets: list[dict]) -> dict:
    """The bucketing summary of one rank's records: ``{"graphs": [...], "attribution": [...]}``."""
    buckets, _ = valid_buckets(buckets)  # a record of the wrong types is skipped
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: {"before": [], "after": []})
    by_source: dict[str, list[dict]] = defaultdict(list)
    for b in buckets:
        by_source[b.get("source") or "?"].append(b)
    for source, recs in by_source.items():
        if source == SOURCE_FSDP2:
            recs = _latest_fsdp2(recs)
        elif source == SOURCE_DTENSOR:
            recs = _latest_dtensor(recs)
        for b in recs:
            groups[_key(b)]["before" if b.get("stage") == BEFORE else "after"].append(b)

    rows = []
    for key in sorted(groups, key=lambda k: tuple("" if x is None else str(x) for x in k)):
        source, graph, graph_id, collective = key
        before, after = groups[key]["before"], groups[key]["after"]
        after.sort(key=lambda b: b.get("index") or 0)
        row: dict[str, Any] = {
            "source": source, "graph": graph, "graph_id": graph_id, "collective": collective,
            "count_before": None, "count_after": len(after), "buckets": len(after),
            "bytes": _bytes(after), "sizes": [int(b.get("total_bytes") or 0) for b in after],
            "spans": None, "max_span": None,
            "compute_between_rs": None, "max_compute_between_rs": None,
            "max_consec_compute_between_rs": None,
            "spans_at_bucketing": None, "max_span_at_bucketing": None,
            "payloads": _payloads(after) if source == SOURCE_GRAPH else None,
        }
        if source == SOURCE_FSDP2:
            row["count_before"] = sum(len(b.get("entries") or []) for b in after)
        elif source == SOURCE_DTENSOR:  # issued one by one, outside any pass: nothing merged them
            row["count_before"] = len(after)
        elif before:
            row["count_before"] = len(before)
            spans = _spans(after, before)
            row["spans"] = spans
            known = [s for s in spans or [] if s is not None]
            row["max_span"] = max(known) if known else None
        around = next((b["around_bucketing"] for b in after
                       if isinstance(b.get("around_bucketing"), dict)), None)
        # counts right before the first bucketing pass and right after the last one
        # (GraphTrainer aot_fx_trace: capture/sources/graph_passes.py); None where not recorded
        row["around_bucketing"] = around
        if source == SOURCE_GRAPH and collective == "reduce_scatter" and after:
            between = _compute_between(after)
            row["compute_between_rs"] = between
            row["max_compute_between_rs"] = max(between) if between else None
            ap = next((b["max_consec_compute_between_rs"] for b in after
                       if isinstance(b.get("max_consec_compute_between_rs"), int)), None)
            row["max_consec_compute_between_rs"] = ap
        at = next((b["spans_at_bucketing"] for b in after
                   if isinstance(b.get("spans_at_bucketing"), dict)), None)
        if at is not None and isinstance(at.get("spans"), list):
            row["spans_at_bucketing"] = list(at["spans"])
            row["max_span_at_bucketing"] = max(at["spans"]) if at["spans"] else None
        if not after and before:
            row["buckets"] = 0
        rows.append(row)
    out = {"graphs": rows, "attribution": issued_elsewhere(buckets), "homes": bucket_homes(buckets)}
    out["headline"] = headline(out)
    return out


def summarize_run(run: Any, _known: tuple[list, dict] | None = None) -> dict | None:
    """``summarize`` of the lowest rank of a ``parity.artifacts.Run``; None if it has no buckets.
    ``_known``: (records, their summary) of the other side; records that are the very same list
    (the reader shares byte-identical manifests) are not summarized twice."""
    ranks = getattr(run, "ranks", {}) or {}
    if not ranks:
        return None
    rd = ranks[min(ranks)]
    if not rd.buckets:
        return None
    if _known is not None and _known[0] is rd.buckets:
        out = dict(_known[1])
    else:
        out = summarize(rd.buckets)
        skipped = valid_buckets(rd.buckets)[1]
        if skipped:  # said: the summary is of the valid records only
            out["skipped"] = [f"rank {rd.rank} buckets.jsonl {m}" for m in skipped]
    out["rank"] = rd.rank
    return out


# ---------------------------------------------------------------------------
# Module attribution
# ---------------------------------------------------------------------------


def _owner(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _within(module: str, owner: str) -> bool:
    """``module`` is the owner or one of its ancestors (an FSDP group holding the parameter; a
    group of several modules, ``norm, lm_head``, holds each of them)."""
    if ", " in module:
        return any(_within(m, owner) for m in module.split(", "))
    return module == "" or owner == module or owner.startswith(module + ".")


def _chain_ok(chain: str, owner: str) -> bool:
    """A DTensor ``module`` chain (outermost first, ``a > b``) stays within the owner: every
    element is an ancestor-or-self module of the owner. An element naming an object outside the
    model (``loss_fn(ChunkedLossWrapper)``) is not; a bare class name is the root module."""
    for part in (p.strip() for p in chain.split(">")):
        if "(" in part:
            return False
        if part[:1].isupper() and "." not in part:  # the root, labelled by its class
            continue
        if not _within(part, owner):
            return False
    return True


def _entry_module(b: dict, e: dict) -> str | None:
    if b.get("source") == SOURCE_FSDP2:
        return b.get("group")
    return e.get("module") if e.get("module") is not None else b.get("module")


def _pre_modules(buckets: list[dict]) -> dict[tuple, str]:
    """(graph_id, collective, fqn) -> the module of that payload's own pre-pass collective."""
    pre: dict[tuple, str] = {}
    for b in buckets:
        if b.get("stage") == BEFORE:
            for e in b.get("entries") or []:
                if e.get("fqn") and e.get("module") is not None:
                    pre.setdefault((b.get("graph_id"), b.get("collective"), e["fqn"]), e["module"])
    return pre


def _common_module(modules: list[str]) -> str | None:
    """The innermost module enclosing every module given ("" the root); None for none."""
    if not modules:
        return None
    split = [m.split(".") if m else [] for m in modules]
    prefix: list[str] = []
    for parts in zip(*split):
        if all(p == parts[0] for p in parts):
            prefix.append(parts[0])
        else:
            break
    return ".".join(prefix)


def bucket_homes(buckets: list[dict]) -> dict[str, dict[str, str]]:
    """collective -> fqn -> the module whose bucket carries that parameter's payload (after the
    passes; the first bucket of the step, so the forward's for an all-gather): eager FSDP2 the
    innermost module holding its group (``norm, lm_head`` -> the root), a compiled bucket the
    innermost module holding its payloads' modules, eager DTensor the chain it was issued under."""
    pre = _pre_modules(buckets)
    recs: list[dict] = []
    by_source: dict[str, list[dict]] = defaultdict(list)
    for b in buckets:
        if b.get("stage") != BEFORE:
            by_source[b.get("source") or "?"].append(b)
    for source, rs in by_source.items():
        recs += _latest_fsdp2(rs) if source == SOURCE_FSDP2 else (
            _latest_dtensor(rs) if source == SOURCE_DTENSOR else rs)
    phase = {"forward": 0, "backward": 1}
    recs.sort(key=lambda b: (phase.get(b.get("graph") or "", 2), b.get("graph_id") or 0,
                             b.get("index") or 0))
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for b in recs:
        source, coll = b.get("source"), b.get("collective") or ""
        fqns = _fqns(b)
        if source == SOURCE_FSDP2:
            home = _common_module([g.strip() for g in (b.get("group") or "").split(",")])
        elif source == SOURCE_DTENSOR:
            home = _chain_home(b.get("module") or "")
        else:
            mods = [pre.get((b.get("graph_id"), coll, e.get("fqn")), e.get("module"))
                    for e in b.get("entries") or [] if e.get("fqn")]
            home = _common_module([m for m in mods if m is not None])
            if home is None:
                home = b.get("module")
        if home is None:
            continue
        for f in fqns:
            out[coll].setdefault(f, home)
    return dict(out)


def _chain_home(chain: str) -> str:
    """A DTensor ``module`` chain as a home: kept whole when it passes through an object outside
    the model (``loss_fn(ChunkedLossWrapper) > lm_head``), else its innermost module (a bare
    class name is the root)."""
    parts = [p.strip() for p in chain.split(">") if p.strip()]
    if any("(" in p for p in parts):
        return chain
    mods = [p for p in parts if not (p[:1].isupper() and "." not in p)]
    return mods[-1] if mods else ""


def _related(x: str, y: str) -> bool:
    """One module is the other or one of its ancestors (a bucket of a block vs the root's bucket
    that merged it: not a move); a chain through an object outside the model is related to
    nothing but itself."""
    if x == y:
        return True
    if "(" in x or "(" in y:
        return False
    return x == "" or y == "" or x.startswith(y + ".") or y.startswith(x + ".")


def moved_between(a: dict | None, b: dict | None) -> list[dict]:
    """Parameters whose payload is carried by an unrelated module's bucket in B than in A (neither
    module holds the other: merging blocks into the root's bucket is not a move, a payload
    issued under the loss instead of its model's bucket is), grouped:
    ``[{"collective", "a_module", "b_module", "fqns"}]``. Only parameters both sides place are
    compared."""
    ha, hb = (a or {}).get("homes") or {}, (b or {}).get("homes") or {}
    groups: dict[tuple, list[str]] = defaultdict(list)
    for coll in sorted(set(ha) & set(hb)):
        for fqn, ma in ha[coll].items():
            mb = hb[coll].get(fqn)
            if mb is not None and not _related(ma, mb):
                groups[(coll, ma, mb)].append(fqn)
    return [{"collective": c, "a_module": ma, "b_module": mb, "fqns": fqns}
            for (c, ma, mb), fqns in groups.items()]


def summarize_pair(run_a: Any, run_b: Any) -> dict:
    """The diff's ``bucketing``: both sides' summaries and the parameters whose bucket moved to
    another module's between them."""
    a = summarize_run(run_a)
    ranks_a = getattr(run_a, "ranks", {}) or {}
    known = (ranks_a[min(ranks_a)].buckets, a) if a is not None else None
    b = summarize_run(run_b, known)
    return {"a": a, "b": b, "moved": moved_between(a, b)}


def issued_elsewhere(buckets: list[dict]) -> list[dict]:
    """Entries (after the passes) issued under a module that is not their parameter's owner or
    an ancestor of it: ``{"fqn", "owner", "module", "source", "graph", "collective", "index"}``,
    one per (fqn, module, collective, graph)."""
    out: list[dict] = []
    seen: set[tuple] = set()
    # A payload's module as its own collective had it before the passes merged it: a merged
    # bucket's nodes carry the annotation of one member (the pass copies it), the pre-pass
    # collectives each their own.
    pre = _pre_modules(buckets)
    for b in buckets:
        if b.get("stage") == BEFORE:
            continue
        for e in b.get("entries") or []:
            fqn = e.get("fqn")
            module = pre.get((b.get("graph_id"), b.get("collective"), fqn), _entry_module(b, e))
            if not fqn or module is None:
                continue
            owner = _owner(fqn)
            ok = _chain_ok(module, owner) if b.get("source") == SOURCE_DTENSOR else _within(module, owner)
            if ok:
                continue
            key = (fqn, module, b.get("collective"), b.get("graph"))
            if key in seen:
                continue
            seen.add(key)
            out.append({"fqn": fqn, "owner": owner, "module": module, "source": b.get("source"),
                        "graph": b.get("graph"), "collective": b.get("collective"),
                        "index": b.get("index")})
    return out


def headline(summary: dict | None) -> str:
    """One short line: all-gather and reduce-scatter counts after the passes (before -> after
    where a pre-pass count is known), e.g. ``AG 18->6 RS 18->6``, and a compiled graph's
    all-reduces (``AR 4->1``); "" without a summary."""
    if not summary:
        return ""
    parts = []
    for coll, label in (("all_gather", "AG"), ("reduce_scatter", "RS"), ("all_reduce", "AR")):
        rows = [r for r in summary.get("graphs", []) if r["collective"] == coll
                and (coll != "all_reduce" or r.get("source") == SOURCE_GRAPH)]
        if not rows:
            continue
        after = sum(r["count_after"] for r in rows)
        befores = [r["count_before"] for r in rows]
        if all(isinstance(x, int) for x in befores):
            parts.append(f"{label} {sum(befores)}->{after}")
        else:
            parts.append(f"{label} {after}")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# A and B side by side
# ---------------------------------------------------------------------------

_PHASE = {"all_gather": "forward", "reduce_scatter": "backward"}


def _phase(row: dict) -> str:
    """Where a row's collectives run: the graph kind for compiled graphs, else forward for
    all-gathers and backward for reduce-scatters (eager FSDP2 issues them there)."""
    if row.get("source") == SOURCE_DTENSOR:
        return "DTensor"
    if row.get("graph") in ("forward", "backward"):
        return row["graph"]
    return _PHASE.get(row.get("collective") or "", row.get("graph") or row.get("source") or "")


def side_label(row: dict | None) -> str:
    """What a row summarizes: ``forward #0`` (a compiled graph), ``eager FSDP2``, ``eager DTensor``."""
    if row is None:
        return "-"
    if row.get("source") == SOURCE_GRAPH:
        return f"{row.get('graph')} #{row.get('graph_id')}"
    if row.get("source") == SOURCE_FSDP2 and row.get("graph"):
        return f"eager FSDP2 {row['graph']}"
    return {SOURCE_FSDP2: "eager FSDP2", SOURCE_DTENSOR: "eager DTensor"}.get(row.get("source"), str(row.get("source")))


def pair_rows(a: dict | None, b: dict | None) -> list[dict]:
    """The rows of two summaries aligned for a side-by-side table: eager FSDP2's all-gathers
    face the compiled forward graph's, its reduce-scatters the backward graph's; the k-th graph
    of a phase faces the other side's k-th (by graph_id). ``[{"collective", "phase", "a", "b"}]``
    with None where a side has no such row."""
    def keyed(summary: dict | None) -> dict[tuple, dict]:
        rows = sorted((summary or {}).get("graphs") or [],
                      key=lambda r: (-1 if r.get("graph_id") is None else r["graph_id"]))
        out: dict[tuple, dict] = {}
        seen: dict[tuple, int] = defaultdict(int)
        for r in rows:
            base = (r.get("collective") or "", _phase(r))
            out[(*base, seen[base])] = r
            seen[base] += 1
        return out

    ka, kb = keyed(a), keyed(b)
    order = {"all_gather": 0, "reduce_scatter": 1}
    phases = {"forward": 0, "backward": 1}
    keys = sorted(set(ka) | set(kb), key=lambda k: (order.get(k[0], 2), k[0], phases.get(k[1], 2),
                                                      k[1], k[2]))
    return [{"collective": k[0], "phase": k[1], "a": ka.get(k), "b": kb.get(k)} for k in keys]


def cell_headline(diff: dict | None) -> str:
    """A sweep cell's bucketing in one short string from its diff JSON: ``AG 21->3 RS 21->3 vs
    AG 21->1 RS 21->1`` (reference vs candidate; one string when both are the same); "" when
    neither side recorded manifests or the diff predates the summary."""
    bucketing = (diff or {}).get("bucketing") if isinstance(diff, dict) else None
    if not isinstance(bucketing, dict):
        return ""
    a, b = (headline(bucketing.get(k)) if isinstance(bucketing.get(k), dict) else ""
            for k in ("a", "b"))
    if not a and not b:
        return ""
    return a if a == b else f"{a or '-'} vs {b or '-'}"
