"""Compiled manifests for make_fx-traced training steps: torchtitan GraphTrainer's default mode
(``aot_fx_trace``) and its precompiled variant.

Why a separate hook point: those graphs never pass through ``aot_module_simplified`` (graph.py's
hook). GraphTrainer traces forward + backward + loss into one joint graph with ``make_fx``
(``minimal_fx_tracer``), rewrites it with its passes, and runs it every step with
``run_traced(traced_result, module=...)``. Both names are looked up in GraphTrainer's trainer
module at call time, so wrapping them there (after that module is imported; nothing in the
trainer is edited) sees:

* ``minimal_fx_tracer(...)(...)`` returns a ``TracedResult``: the graph *before* the passes
  (recorded with ``"stage": "before_passes"``), with ``state_fqns`` naming the placeholders;
* the first ``run_traced(...)`` of each ``TracedResult.gm``: the graph *after* the passes (or the
  precompiled graph loaded from disk), recorded as the manifest the diff compares;
* each call of the runner ``run_traced`` returns: output 0 is the loss the trainer computed
  inside the graph (backward runs in the graph: no ``.backward()`` call happens at run time).

Nothing runs inside the trace: the wrappers act on the tracer's *result* and on the runner's
outputs, after make_fx is done. The FX walk itself is graph_walk.py's ``extract_buckets``.
:class:`MakeFxGraphs` is this hook as a manifest source (installed once the trainer module is
imported).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

from parity.capture.sources import graph, graph_flat, graph_grads, graph_passes, graph_walk
from parity.capture.sources.manifest_source import GraphRecord, ManifestSource
from parity.capture.names import normalize_fqn
from parity.records import SOURCE_GRAPH, BucketRecord

__all__ = ["TRAINER_MODULE", "install", "uninstall", "placeholder_fqns", "split_joint",
           "MakeFxGraphs"]

TRAINER_MODULE = "torchtitan.experiments.graph_trainer.trainer"
_NAMES = ("minimal_fx_tracer", "run_traced")
_OPTIONAL = ("apply_graph_passes",)  # collective counts around each pass (graph_passes.py)

_state: dict[str, Any] = {"patches": [], "hooks": None, "seen": None}


def placeholder_fqns(traced: Any, n_placeholders: int) -> list[str | None]:
    """Per flat placeholder of a traced step, the state FQN it carries (None for user inputs).

    Flat inputs are the module state (``state_fqns`` order) then the user inputs, each subclass
    input (DTensor) unwrapped into ``input_subclass_layouts[i].num_tensors`` tensors (DTensor:
    one, its local tensor)."""
    fqns: list[str | None] = []
    layouts = getattr(traced, "input_subclass_layouts", None) or {}
    for i, fqn in enumerate(getattr(traced, "state_fqns", None) or ()):
        layout = layouts.get(i)
        n = getattr(layout, "num_tensors", 1) if layout is not None else 1
        fqns.extend([normalize_fqn(fqn)] * max(int(n), 1))
    fqns = fqns[:n_placeholders]
    return fqns + [None] * (n_placeholders - len(fqns))


def _output_fqns(traced: Any, grad_fqns: list[str]) -> list[str | None]:
    """Per flat output: output 0 is the loss, then one gradient per trainable parameter."""
    layouts = getattr(traced, "output_subclass_layouts", None) or {}
    names: list[str | None] = [None, *grad_fqns]
    out: list[str | None] = []
    for i, name in enumerate(names):
        layout = layouts.get(i)
        n = getattr(layout, "num_tensors", 1) if layout is not None else 1
        out.extend([name] * max(int(n), 1))
    return out


def split_joint(gm: Any, buckets: list[BucketRecord]) -> None:
    """Label each bucket of a joint graph ``forward`` or ``backward`` (in place), by its node's
    phase (graph_walk.JointPhase)."""
    phase_of = graph_walk.JointPhase()
    where = {node.name: phase_of(node) for node in graph_flat.flatten(gm).graph.nodes}
    for b in buckets:
        b.graph = where.get(b.node, "forward" if b.collective == "all_gather" else "backward")


def _grad_fqns(module: Any) -> list[str]:
    if module is None:
        return []
    return [normalize_fqn(n) for n, p in module.named_parameters(remove_duplicate=False)
            if p.requires_grad]


def _record(traced: Any, module: Any, stage: str, pre: dict | None,
            graph_id: int | None = None) -> tuple[GraphRecord, dict | None]:
    gm = traced.gm
    n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    inputs = placeholder_fqns(traced, n_ph)
    outputs = _output_fqns(traced, _grad_fqns(module))
    warnings: list[str] = []
    rs_map = graph_grads.reduce_scatter_targets(gm, outputs)
    if pre:
        rs_map = {**rs_map, **pre}  # pre-pass nodes still in the graph name their payloads
    if graph_id is None:
        graph_id = graph.next_graph_id()
    buckets = graph_walk.extract_buckets(gm, inputs, outputs, "joint", graph_id=graph_id,
                                         warnings=warnings, rs_payload_fqns=rs_map)
    split_joint(gm, buckets)
    if stage == "after_passes":
        graph_walk.graph_figures(gm, buckets)  # AutoParallel's figure on the graph that runs
    for b in buckets:
        b.stage = stage
        b.trace = "make_fx"
    return GraphRecord("joint", graph_id, buckets, warnings, stage), rs_map


def _wrap_tracer(original: Callable) -> Callable:
    def minimal_fx_tracer(fn, *args, **kwargs):
        tracer = original(fn, *args, **kwargs)
        module = kwargs.get("module")

        def trace(*a, **k):
            traced = tracer(*a, **k)
            hooks = _state["hooks"]
            if hooks is not None:
                try:
                    record, rs_map = _record(traced, module, "before_passes", None)
                    _state["pre"] = (weakref.ref(traced.gm), rs_map, record.graph_id)
                    hooks["on_graph"](record)
                except Exception as e:  # noqa: BLE001 - never break the trainer
                    hooks["warn"](f"compiled manifests: make_fx graph before passes not read "
                                  f"({type(e).__name__}: {e})")
            return traced

        return trace

    minimal_fx_tracer.__wrapped__ = original  # type: ignore[attr-defined]
    minimal_fx_tracer._parity_original = original  # type: ignore[attr-defined]
    return minimal_fx_tracer


def _wrap_runner(original: Callable) -> Callable:
    def run_traced(traced, *args, **kwargs):
        runner = original(traced, *args, **kwargs)
        hooks = _state["hooks"]
        if hooks is None:
            return runner
        gm = getattr(traced, "gm", None)
        seen = _state["seen"]
        if gm is not None and seen is not None and gm not in seen:
            seen.add(gm)
            try:
                pre_ref, rs_map, pre_id = _state.get("pre") or (None, None, None)
                # the passes mutate the traced graph in place: its pre-pass nodes identify
                # reduce-scatter payloads from the input side
                rs_map = rs_map if rs_map else None
                # the same graph before and after the passes shares one graph_id, so that the
                # bucketing summary pairs them (parity/diff/bucket_summary.py)
                record, _ = _record(traced, kwargs.get("module"), "after_passes", rs_map,
                                    graph_id=pre_id if pre_ref is not None else None)
                if pre_ref is None:
                    record.warnings.append("no graph before passes (precompiled artifact)")
                around = graph_passes.around_bucketing(_state.pop("pass_runs", None) or [])
                for b in record.buckets if around else ():
                    counts = around.get(f"{b.collective}/{b.graph}")
                    if counts is not None:
                        b.extra["around_bucketing"] = counts
                hooks["on_graph"](record)
            except Exception as e:  # noqa: BLE001
                hooks["warn"](f"compiled manifests: make_fx graph not read "
                              f"({type(e).__name__}: {e})")

        def run(*a, **k):
            interpreter = None
            hook = _state.get("runtime")
            if hook is not None and gm is not None and "interpreter_cls" not in kwargs:
                interpreter = hook(gm)
            if interpreter is not None:
                # parity bisect at its step: the same graph, run node by node by an FX
                # interpreter that hashes each node's output (run_traced's own option)
                outputs = original(traced, *args, interpreter_cls=interpreter, **kwargs)(*a, **k)
            else:
                outputs = runner(*a, **k)
            on_loss = hooks.get("on_loss")
            if on_loss is not None:
                try:
                    first = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else None
                    on_loss(first)
                except Exception:  # noqa: BLE001
                    pass
            return outputs

        return run

    run_traced.__wrapped__ = original  # type: ignore[attr-defined]
    run_traced._parity_original = original  # type: ignore[attr-defined]
    return run_traced


def set_runtime_hook(hook: Callable[[Any], Any] | None) -> None:
    """``hook(gm)`` is asked before each run of a traced step: an FX interpreter class (called
    as ``cls(gm)``) to run it with, or None to run it as is (op capture, ops.py)."""
    _state["runtime"] = hook


def _wrap_apply(original: Callable) -> Callable:
    def apply_graph_passes(gm, example_inputs, passes, *args, **kwargs):
        if _state["hooks"] is None:
            return original(gm, example_inputs, passes, *args, **kwargs)
        runs: list[dict] = []
        try:
            counted = graph_passes.wrap_passes(list(passes), runs)
        except Exception:  # noqa: BLE001 - never break the trainer
            counted = passes
        out = original(gm, example_inputs, counted, *args, **kwargs)
        _state["pass_runs"] = runs
        return out

    apply_graph_passes.__wrapped__ = original  # type: ignore[attr-defined]
    apply_graph_passes._parity_original = original  # type: ignore[attr-defined]
    return apply_graph_passes


def install(on_graph: Callable[[GraphRecord], None], on_loss: Callable[[Any], None],
            warn: Callable[[str], None]) -> str | None:
    """Wrap GraphTrainer's tracer and runner (its trainer module must be imported). Returns
    None when installed, else the reason."""
    mod = sys.modules.get(TRAINER_MODULE)
    if mod is None:
        return f"{TRAINER_MODULE} is not imported"
    _state["hooks"] = {"on_graph": on_graph, "on_loss": on_loss, "warn": warn}
    if _state["patches"]:
        return None
    missing = [n for n in _NAMES if not callable(getattr(mod, n, None))]
    if missing:
        return (f"GraphTrainer's {', '.join(missing)} not found in {TRAINER_MODULE} (this "
                "torchtitan version is not supported): make_fx graphs are not recorded")
    _state["seen"] = weakref.WeakSet()
    for name, wrap in (("minimal_fx_tracer", _wrap_tracer), ("run_traced", _wrap_runner),
                       ("apply_graph_passes", _wrap_apply)):
        current = getattr(mod, name, None)
        if current is None or (name in _OPTIONAL and not callable(current)):
            continue
        if hasattr(current, "_parity_original"):
            continue
        _state["patches"].append((mod, name, current))
        setattr(mod, name, wrap(current))
    return None


def uninstall() -> None:
    for mod, name, original in reversed(_state["patches"]):
        setattr(mod, name, original)
    _state["patches"] = []
    _state["hooks"] = None
    _state.pop("pre", None)


class MakeFxGraphs(ManifestSource):
    """This hook as a manifest source (manifest_source.py); the patches are process-wide, so the
    state stays module-global. Its graphs are ``source: graph`` like graph.py's."""

    name = "graph_makefx"
    source = SOURCE_GRAPH
    trigger = TRAINER_MODULE
    unavailable = "compiled manifests unavailable"

    def install(self) -> str | None:
        return install(self.hooks.on_graph, self.hooks.on_loss, self.hooks.lost)

    def uninstall(self) -> None:
        uninstall()
