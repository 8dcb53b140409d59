"""Collective counts around each of GraphTrainer's graph passes, so that ``parity inspect`` can
report before/after around the bucketing passes themselves.

Why: "before" = the traced graph and "after" = the graph that runs mix in what other passes do:
a dedup pass that removes lm_head re-gathers before bucketing, rematerialization that creates
re-gathers after it. Counting the collectives (per kind and phase) right before and right after
every pass lets the figures AutoParallel-style reports quote (all-gathers in forward, in
backward (recomputed), reduce-scatters) be read around the passes that bucket.

Each pass is wrapped with a function of the same name (``_get_pass_name`` and
``--compile.disable_passes`` see the original name) that walks the graph before and after
calling it: read-only, on the graph the pass receives; the pass and its result are untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from parity.capture.sources import graph_flat, graph_walk


def pass_name(fn: Any) -> str:
    return fn.func.__name__ if isinstance(fn, functools.partial) else getattr(
        fn, "__name__", type(fn).__name__)


def count_collectives(gm: Any, graph_phase: str | None = None) -> dict[str, int]:
    """``{"all_gather/forward": n, ...}`` in a joint graph (phase: graph_walk.JointPhase),
    or in a forward or backward graph (``graph_phase``: aot_autograd's partitioned graphs)."""
    out: dict[str, int] = {}
    phase_of = graph_walk.JointPhase()
    for node in graph_flat.flat_nodes(gm):  # collectives nested in subgraphs too
        phase = phase_of(node)  # asked of every node: a backward node turns the phase
        found = graph_walk.collective_kind(graph_walk.op_name(node))
        if found is None:
            continue
        key = f"{found[0]}/{graph_phase or phase}"
        out[key] = out.get(key, 0) + 1
    return out


def wrap_passes(passes: list, sink: list[dict]) -> list:
    """``passes`` with each one counted into ``sink`` (one dict per pass run)."""
    def wrap(fn: Callable) -> Callable:
        name = pass_name(fn)

        def counted(gm, *args, **kwargs):
            try:
                before = count_collectives(gm)
            except Exception:  # noqa: BLE001 - counting never breaks the pass
                before = None
            out = fn(gm, *args, **kwargs)
            try:
                after = count_collectives(out if hasattr(out, "graph") else gm)
            except Exception:  # noqa: BLE001
                after = None
            sink.append({"pass": name, "before": before, "after": after})
            return out

        counted.__name__ = name
        counted.__qualname__ = name
        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    return [wrap(p) for p in passes]


def around_bucketing(runs: list[dict]) -> dict[str, dict] | None:
    """Per ``kind/phase``: the count right before the first bucketing pass and right after the
    last one (a pass whose name says ``bucket``), with the passes' names; None if none ran."""
    idx = [i for i, r in enumerate(runs) if "bucket" in r["pass"].lower()
           and r.get("before") is not None and r.get("after") is not None]
    if not idx:
        return None
    first, last = runs[idx[0]], runs[idx[-1]]
    names = ",".join(runs[i]["pass"] for i in idx)
    keys = set(first["before"]) | set(last["after"])
    return {k: {"before": first["before"].get(k, 0), "after": last["after"].get(k, 0),
                "passes": names} for k in sorted(keys)}


def _bucketing_name(compiler: Any, depth: int = 3) -> str | None:
    """The name of the bucketing pass ``compiler`` is, looking through the wrappers torch puts
    around it (dynamo's ``aot_autograd`` wraps the backward compiler in ``_wrapped_bw_compiler``,
    which holds it in its closure); None when it is no bucketing pass."""
    todo, seen = [(compiler, 0)], set()
    while todo:
        fn, d = todo.pop(0)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        name = pass_name(fn)
        if "bucket" in name.lower():
            return name
        if d < depth:
            todo.append((getattr(fn, "__wrapped__", None), d + 1))
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    inner = cell.cell_contents
                except ValueError:
                    continue
                if callable(inner):
                    todo.append((inner, d + 1))
    return None


class AroundCompiler:
    """GraphTrainer jit (``--compile.mode jit --compile.backend aot_eager``): the forward and
    backward compilers aot_autograd calls ARE torchtitan's bucketing pass
    (``transformer_block_bucketing_reordering_pass``, ``autobucketing_reordering_pass``), so
    the counts right before and after the compiler are the counts around bucketing. A compiler
    whose name does not say ``bucket`` (inductor's ``compile_fx``, where bucketing is one of
    its post-grad passes among others) gets none."""

    def __init__(self, compiler: Any, gm: Any, graph_phase: str):
        self.name = _bucketing_name(compiler)
        self.phase = graph_phase
        self.before = None
        if self.name is not None:
            try:
                self.before = count_collectives(gm, graph_phase)
            except Exception:  # noqa: BLE001 - counting never breaks the compile
                self.before = None

    def counts(self, gm: Any) -> dict[str, dict] | None:
        """``around_bucketing``'s shape, for the graph the compiler left (``gm``, in place)."""
        if self.before is None:
            return None
        try:
            after = count_collectives(gm, self.phase)
        except Exception:  # noqa: BLE001
            return None
        return around_bucketing([{"pass": self.name, "before": self.before, "after": after}])
