"""The span of each bucket as inductor's FX bucketing passes form it: AutoParallel's figure.

AutoParallel bounds FSDP bucketing by a topological span (meta-pytorch/autoparallel #481,
``autoparallel/graph_passes/auto_bucketing.py``, ``_patch_fsdp_bucketing._patched_greedy_bucket``,
a54c252): before bucketing, ``ranks = {n.name: i for i, n in enumerate(g.nodes)}`` over the graph
the pass receives; a bucket's span is ``ranks[last member] - ranks[first member]`` (its greedy
buckets hold their members in graph order; parity takes the latest member's rank minus the
earliest's, the same figure, and never negative for a bucket merged in another order), and
``greedy_bucket`` logs ``max_span``, the largest span of a bucket of two or more collectives,
per call. Those ranks count every node of the graph at that moment, after
inductor's earlier post-grad passes (and, for all-gathers, after reduce-scatter bucketing); a
span read from the graph the compiler received (parity's pre-pass positions) counts other nodes.

So this module wraps the entry points of the bucketing passes, while a compiled graph is
recorded (graph.py), and measures the same thing on the same graph: the node positions right
before the pass runs, and, right after, each merged collective's members as the pass lists
them (``node.meta["from_node"]`` entries of pass ``bucketing_pass``, in bucket order: torch
2.13 ``torch/_inductor/fx_passes/bucketing.py`` ``_populate_node_meta``). Wrapped, when
present: ``torch._inductor.fx_passes.fsdp.bucket_fsdp_all_gather`` /
``bucket_fsdp_reduce_scatter`` (inductor's ``bucket_*_fx = "only_fsdp"`` and the FSDP
pre-bucketing of overlap scheduling, both of which look the name up at call time) and
``torch._inductor.fx_passes.bucketing.bucket_all_gather`` / ``bucket_reduce_scatter``
(``bucket_*_fx = "all"``). The pass and its result are untouched;
a pass bound elsewhere by name (a trainer's own import) is not seen, and its graph has no such
figure.
"""

from __future__ import annotations

import functools
from typing import Any

from parity.capture import post_import
from parity.capture.sources.graph_walk import collective_kind, op_name

__all__ = ["install", "uninstall", "begin", "end", "attach", "spans"]

TARGETS = (
    ("torch._inductor.fx_passes.fsdp", "bucket_fsdp_all_gather", "all_gather"),
    ("torch._inductor.fx_passes.fsdp", "bucket_fsdp_reduce_scatter", "reduce_scatter"),
    ("torch._inductor.fx_passes.bucketing", "bucket_all_gather", "all_gather"),
    ("torch._inductor.fx_passes.bucketing", "bucket_reduce_scatter", "reduce_scatter"),
)

_state: dict[str, Any] = {"patches": [], "sinks": [], "installed": False}


def begin() -> None:
    """A compiler starts on a graph: bucketing passes run now belong to it."""
    _state["sinks"].append([])


def end() -> list[dict]:
    """The compiler returned: what the bucketing passes did to its graph
    (``[{"pass", "collective", "spans"}]``, one per pass call, spans in bucket order)."""
    return _state["sinks"].pop() if _state["sinks"] else []


def spans(gm: Any, ranks: dict[str, int], kind: str) -> list[int]:
    """Spans of the buckets a pass formed: each new ``kind`` collective whose ``from_node``
    lists two or more members that were in the graph before (``ranks``)."""
    out = []
    for node in gm.graph.nodes:
        found = collective_kind(op_name(node))
        if found is None or found[0] != kind or node.name in ranks:
            continue
        members = [getattr(s, "name", None) for s in node.meta.get("from_node") or ()
                   if getattr(s, "pass_name", "") == "bucketing_pass"]
        members = [ranks[m] for m in members if m in ranks]
        if len(members) > 1:
            # AutoParallel's greedy buckets hold their members in graph order (last minus
            # first); a bucket merged in another order (a pass that orders the payload, round
            # 10a) spans the same positions: its latest member's rank minus its earliest's
            out.append(max(members) - min(members))
    return out


def attach(calls: list[dict], buckets: list) -> None:
    """Put what the bucketing passes did on the graph's records of each collective kind (in
    place): ``spans_at_bucketing`` (every span, in pass order) and the passes' names."""
    for kind in ("all_gather", "reduce_scatter"):
        mine = [c for c in calls if c["collective"] == kind]
        if not mine:
            continue
        figure = {"passes": ",".join(dict.fromkeys(c["pass"] for c in mine)),
                  "spans": [s for c in mine for s in c["spans"]]}
        for b in buckets:
            if b.collective == kind:
                b.extra["spans_at_bucketing"] = figure


def _wrap(fn: Any, kind: str) -> Any:
    name = getattr(fn, "__name__", kind)

    @functools.wraps(fn)
    def wrapper(gm, *args, **kwargs):
        sinks = _state["sinks"]
        if not sinks or not hasattr(gm, "graph"):
            return fn(gm, *args, **kwargs)
        try:
            ranks = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        except Exception:  # noqa: BLE001 - never break the pass
            ranks = None
        out = fn(gm, *args, **kwargs)
        if ranks is not None:
            try:
                sinks[-1].append({"pass": name, "collective": kind, "spans": spans(gm, ranks, kind)})
            except Exception:  # noqa: BLE001
                pass
        return out

    wrapper._parity_original = fn  # type: ignore[attr-defined]
    return wrapper


def _patch(module: Any) -> None:
    for module_name, attr, kind in TARGETS:
        if module_name != getattr(module, "__name__", None):
            continue
        fn = getattr(module, attr, None)
        if not callable(fn) or hasattr(fn, "_parity_original"):
            continue
        _state["patches"].append((module, attr, fn))
        setattr(module, attr, _wrap(fn, kind))


def install() -> None:
    """Wrap the bucketing passes' entry points (idempotent): now where their module is imported,
    else when it is (post_import.py): importing inductor for a job that never uses it would cost
    it seconds."""
    if _state["installed"]:
        return
    _state["installed"] = True
    for module_name in dict.fromkeys(m for m, _, _ in TARGETS):
        post_import.when_imported(module_name, _patch)


def uninstall() -> None:
    for module_name in dict.fromkeys(m for m, _, _ in TARGETS):
        post_import.cancel(module_name, _patch)
    for mod, attr, fn in reversed(_state["patches"]):
        if getattr(getattr(mod, attr, None), "_parity_original", None) is fn:
            setattr(mod, attr, fn)
    _state["patches"] = []
    _state["sinks"] = []
    _state["installed"] = False
