"""Compiled-graph bucket manifests: which parameter sits at which byte offset in
every all-gather / reduce-scatter / all-reduce of a compiled training graph.

Runs inside user processes. ``install(on_graph)`` wraps the place where
aot_autograd receives its forward/backward compilers, so that after the
user's compiler has run (bucketing passes mutate the ``GraphModule`` in place,
both in hand-written ``aot_autograd(...)`` backends and in inductor's
post-grad passes) we read the final graph and call ``on_graph(record)`` with a
:class:`~parity.capture.sources.manifest_source.GraphRecord` (graph ``"forward"`` or
``"backward"``).

``graph_id`` numbers aot compilations in order (:func:`next_graph_id`, shared
with graph_makefx.py); a forward graph and the backward graph compiled from the
same joint graph share it. :class:`CompiledGraphs` is this hook as a manifest
source (installed at the trainer's first ``torch.compile`` call).

This module is the hook (and its module-global state); graph_walk.py is the
pure FX walk that turns a graph into :class:`~parity.records.BucketRecord` lines,
graph_fqns.py names the graph's inputs and outputs. Nothing assumes who built
the graph (parity's own workload, torchtitan's SimpleFSDP / compiler toolkit,
inductor's own bucketing): buckets are recovered structurally from the
collective's input and parameters are identified through aot descriptors
(``node.meta["desc"]``) and dynamo sources.

Hooked entry points (feature-detected; install is idempotent, ``uninstall``
restores them):

* ``aot_module_simplified`` as bound in ``torch._dynamo.backends.common``
  (what ``aot_autograd(...)`` backends and inductor's ``compile_fx`` call),
  ``torch._functorch.aot_autograd`` and ``functorch.compile``;
* ``torch._functorch.aot_autograd.aot_compile_joint_with_descriptors``
  (torchtitan's compiler toolkit path).

Failures never reach the training job: they are reported once on stderr as
``parity: compiled manifests unavailable: <reason>``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

from parity.capture.sources import graph_bucketing, graph_grads, graph_passes, graph_walk
from parity.capture.sources.graph_fqns import dynamo_input_fqns, graph_io_fqns, source_to_fqn
from parity.capture.sources.graph_walk import extract_buckets, rs_payload_map
from parity.capture.sources.manifest_source import ON_COMPILE, GraphRecord, ManifestSource
from parity.capture.names import normalize_fqn  # re-exported (__all__)
from parity.records import SOURCE_GRAPH


__all__ = ["install", "uninstall", "is_installed", "extract_buckets", "normalize_fqn", "source_to_fqn",
           "next_graph_id", "CompiledGraphs"]

OnGraph = Callable[[GraphRecord], None]

_lock = threading.Lock()
_state: dict[str, Any] = {
    "on_graph": None,
    "patches": [],  # (module, attribute, original)
    "config": [],  # (config module, attribute, original)
    "warned": False,
    "runtime": None,  # set_runtime_hook(): wraps what each compiler returns (parity bisect)
}
_graph_ids = itertools.count()


def next_graph_id() -> int:
    """The next compilation's ``graph_id`` (one numbering for every graph hook in the process)."""
    return next(_graph_ids)


def _warn_once(reason: str) -> None:
    if _state["warned"]:
        return
    _state["warned"] = True
    try:
        print(f"parity: compiled manifests unavailable: {reason}", file=sys.stderr, flush=True)
    except Exception:
        pass


class _Compilation:
    """What one aot compilation knows: its id and the dynamo inputs' FQNs."""

    def __init__(self, plain_fqns: list[str | None]) -> None:
        self.graph_id = next_graph_id()
        self.plain_fqns = plain_fqns


def _dynamo_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._dynamo.disable(fn)``, or ``fn`` where dynamo cannot be had."""
    try:
        import torch._dynamo

        return torch._dynamo.disable(fn)
    except Exception:  # noqa: BLE001 - no dynamo: nothing watches frames
        return fn


def _dynamo_skipped(fn: Callable[..., Any]) -> None:
    """Mark ``fn``'s own frame skipped by dynamo (what it calls is not)."""
    try:
        from torch._dynamo.decorators import skip

        skip(fn)
    except Exception:  # noqa: BLE001 - no dynamo: nothing watches frames
        pass


def _wrap_compiler(compiler: Any, graph_kind: str, comp: _Compilation) -> Any:
    if compiler is None:
        return None
    # Never stack our own wrappers: a stale one would report the wrong graph_id.
    compiler = getattr(compiler, "_parity_inner", compiler)

    def before(gm: Any) -> tuple:
        pre = None
        try:
            if hasattr(gm, "graph"):
                _, output_fqns = graph_io_fqns(gm, comp.plain_fqns)
                pre = rs_payload_map(gm, output_fqns)
                # a gradient summed from several reduce-scatters before it is an output (a
                # tied weight read twice: one reduce-scatter per read) is reached through
                # its sum only: every path forward is searched (round 9b)
                for name, fqn in graph_grads.reduce_scatter_targets(gm, output_fqns).items():
                    pre.setdefault(name, fqn)
                # the graph as the user's passes receive it (the bucketing comparison's input)
                _emit(gm, graph_kind, comp, None, stage="before_passes")
        except Exception as e:  # never break compilation
            _warn_once(f"{type(e).__name__}: {e} (before {graph_kind} passes)")
        around = graph_passes.AroundCompiler(compiler, gm, graph_kind)  # jit: it IS the pass
        graph_bucketing.begin()  # inductor's bucketing passes, if they run in this compiler
        return pre, around

    def after(gm: Any, pre: Any, around: Any, bucketed: list, result: Any) -> Any:
        _emit(gm, graph_kind, comp, pre, around=around.counts(gm), bucketed=bucketed)
        runtime = _state["runtime"]
        if runtime is not None and hasattr(gm, "graph"):
            result = runtime(gm, graph_kind, comp.graph_id, result)
        return result

    # aot_autograd compiles a backward graph lazily, at the first backward, from inside the
    # trainer's code, where dynamo may be watching frames (a compiled step that calls
    # ``backward()``). Torch wraps its own backward compiler in ``torch._dynamo.disable``; this
    # wrapper stands outside it, so dynamo traced capture's graph walk (``resume_in_
    # extract_buckets`` frames; round 8b). Capture's parts run with dynamo disabled, the
    # wrapper's own frame is skipped, and the compiler it wraps is called as without parity.
    before, after = _dynamo_disabled(before), _dynamo_disabled(after)
    end_bucketing = _dynamo_disabled(graph_bucketing.end)

    def wrapped(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        pre, around = before(gm)
        try:
            result = compiler(gm, example_inputs, *args, **kwargs)
        finally:
            bucketed = end_bucketing()
        return after(gm, pre, around, bucketed, result)

    _dynamo_skipped(wrapped)
    try:
        functools.update_wrapper(wrapped, compiler)
    except Exception:
        pass
    wrapped._parity_inner = compiler  # type: ignore[attr-defined]

    try:
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    except Exception:
        SerializableAOTDispatchCompiler = None  # type: ignore[assignment,misc]
    if SerializableAOTDispatchCompiler is not None and isinstance(compiler, SerializableAOTDispatchCompiler):
        # Keep the type: aot_autograd's cache logic checks isinstance.
        new = SerializableAOTDispatchCompiler(compiler.output_code_ty, wrapped)
        new._parity_inner = compiler  # type: ignore[attr-defined]
        return new
    return wrapped


def _emit(gm: Any, graph_kind: str, comp: _Compilation, pre: dict | None,
          stage: str | None = None, around: dict | None = None,
          bucketed: list[dict] | None = None) -> None:
    on_graph = _state["on_graph"]
    if on_graph is None:
        return
    try:
        if not hasattr(gm, "graph"):
            raise TypeError(f"{graph_kind} compiler received {type(gm).__name__}, not a GraphModule")
        input_fqns, output_fqns = graph_io_fqns(gm, comp.plain_fqns)
        warnings: list[str] = []
        buckets = extract_buckets(
            gm,
            input_fqns,
            output_fqns,
            graph_kind,
            graph_id=comp.graph_id,
            warnings=warnings,
            rs_payload_fqns=pre,
        )
        for b in buckets if around else ():  # counts around the bucketing pass (graph_passes)
            counts = around.get(f"{b.collective}/{b.graph}")
            if counts is not None:
                b.extra["around_bucketing"] = counts
        if stage is not None:
            for b in buckets:
                b.stage = stage
            warnings = []  # said again, if still true, for the graph after the passes
        else:  # after the passes: the figures AutoParallel reports (graph_walk, graph_bucketing)
            graph_walk.graph_figures(gm, buckets)
            graph_bucketing.attach(bucketed or [], buckets)
        record = GraphRecord(graph_kind, comp.graph_id, buckets, warnings)
    except Exception as e:
        _warn_once(f"{type(e).__name__}: {e} (reading the {graph_kind} graph)")
        return
    try:
        on_graph(record)
    except Exception as e:
        _warn_once(f"{type(e).__name__}: {e} (in the manifest callback)")


def _wrap_entry(original: Callable[..., Any], input_fqns: Callable[[dict], list], *,
                apply_defaults: bool = False) -> Callable[..., Any]:
    """Wrap an AOTAutograd entry point so that its forward/backward (and inference) compilers
    report the final graphs. ``input_fqns(arguments)`` names the graph inputs: from the dynamo
    graph for ``aot_module_simplified``; empty for ``aot_compile_joint_with_descriptors``, whose
    inputs carry their FQN (``ParamAOTInput(target=fqn)``). Any failure here falls back to the
    unwrapped call: capture must never break compilation."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
            if apply_defaults:  # the joint API's compilers may come from its defaults
                bound.apply_defaults()
            params = bound.arguments
            comp = _Compilation(input_fqns(params))
            fw = params.get("fw_compiler")
            bw = params.get("bw_compiler") or fw
            params["fw_compiler"] = _wrap_compiler(fw, "forward", comp)
            params["bw_compiler"] = _wrap_compiler(bw, "backward", comp)
            if "inference_compiler" in signature.parameters:
                inference = params.get("inference_compiler") or fw
                params["inference_compiler"] = _wrap_compiler(inference, "forward", comp)
            call_args, call_kwargs = bound.args, bound.kwargs
        except Exception as e:
            _warn_once(f"{type(e).__name__}: {e} (wrapping {original.__name__})")
            return original(*args, **kwargs)
        return original(*call_args, **call_kwargs)

    wrapper._parity_original = original  # type: ignore[attr-defined]
    return wrapper


def _wrap_aot_module_simplified(original: Callable[..., Any]) -> Callable[..., Any]:
    return _wrap_entry(original, lambda params: dynamo_input_fqns(params.get("mod")))


def _wrap_aot_compile_joint(original: Callable[..., Any]) -> Callable[..., Any]:
    return _wrap_entry(original, lambda params: [], apply_defaults=True)


def install(on_graph: OnGraph, *, disable_caches: bool = True,
            warn: Callable[[str], Any] | None = None) -> str | None:
    """Start calling ``on_graph(record)`` for every compiled forward/backward graph.

    Idempotent (a second call only replaces the callback). Returns None when
    installed, else the reason (also printed once to stderr); never raises.

    ``disable_caches`` turns off the AOTAutograd and FX graph caches: on a cache
    hit the compilers (and the passes) do not run, so there would be no graph
    to read, or an unbucketed one. A cache that cannot be turned off is said
    through ``warn`` (the session's capture warnings, in meta.json).
    """
    with _lock:
        _state["on_graph"] = on_graph
        if _state["patches"]:
            return None
        graph_bucketing.install()
        try:
            import torch._dynamo.backends.common as dynamo_common
            import torch._functorch.aot_autograd as aot_autograd
        except Exception as e:
            reason = f"cannot import aot_autograd entry points ({type(e).__name__}: {e})"
            _warn_once(reason)
            return reason

        original = getattr(aot_autograd, "aot_module_simplified", None)
        if original is None or not hasattr(dynamo_common, "aot_module_simplified"):
            reason = "torch._dynamo.backends.common.aot_module_simplified not found in this torch version"
            _warn_once(reason)
            return reason
        wrapper = _wrap_aot_module_simplified(original)
        modules = [dynamo_common, aot_autograd]
        if "functorch.compile" in sys.modules:
            modules.append(sys.modules["functorch.compile"])
        for module in modules:
            current = getattr(module, "aot_module_simplified", None)
            if current is original:
                _state["patches"].append((module, "aot_module_simplified", current))
                setattr(module, "aot_module_simplified", wrapper)
            elif current is not None and not hasattr(current, "_parity_original"):
                # Bound to something else (another tool's wrapper): wrap that one.
                _state["patches"].append((module, "aot_module_simplified", current))
                setattr(module, "aot_module_simplified", _wrap_aot_module_simplified(current))

        joint = getattr(aot_autograd, "aot_compile_joint_with_descriptors", None)
        if joint is not None:
            _state["patches"].append((aot_autograd, "aot_compile_joint_with_descriptors", joint))
            aot_autograd.aot_compile_joint_with_descriptors = _wrap_aot_compile_joint(joint)

        if disable_caches:
            for module_name, attr in (
                ("torch._functorch.config", "enable_autograd_cache"),
                ("torch._inductor.config", "fx_graph_cache"),
            ):
                try:
                    config = __import__(module_name, fromlist=["_"])
                    _state["config"].append((config, attr, getattr(config, attr)))
                    setattr(config, attr, False)
                except Exception as e:  # a cache hit would then yield no manifest: say so
                    msg = (f"cannot disable {module_name}.{attr} ({type(e).__name__}: {e}): "
                           "a compile cache hit yields no compiled manifest")
                    if warn is not None:
                        warn(msg)
                    else:
                        _warn_once(msg)
        return None


def set_runtime_hook(hook: Callable[[Any, str, int, Any], Any] | None) -> str | None:
    """Also pass every compiled graph through ``hook(gm, graph_kind, graph_id, compiled)``, whose
    return value replaces the compiled callable (op capture for ``parity bisect``, ops.py).
    Installs the entry-point patches if the manifests have not; keeps their callback. Returns
    None when installed, else the reason."""
    _state["runtime"] = hook
    return install(_state["on_graph"])


def uninstall() -> None:
    """Restore every patched attribute and config value; stop calling the callback."""
    with _lock:
        graph_bucketing.uninstall()
        for module, attr, original in reversed(_state["patches"]):
            setattr(module, attr, original)
        _state["patches"] = []
        for config, attr, original in reversed(_state["config"]):
            try:
                setattr(config, attr, original)
            except Exception:
                pass
        _state["config"] = []
        _state["on_graph"] = None
        _state["runtime"] = None


def is_installed() -> bool:
    return bool(_state["patches"])


class CompiledGraphs(ManifestSource):
    """This hook as a manifest source (manifest_source.py). The patches are process-wide, so
    the state stays module-global; this class is how the session turns them on and off."""

    name = "graph"
    source = SOURCE_GRAPH
    trigger = ON_COMPILE  # earlier, aot_autograd may be half-imported
    unavailable = "compiled manifests unavailable"
    echo = False  # install() has printed its reason on stderr already

    def install(self) -> str | None:
        return install(self.hooks.on_graph, warn=self.hooks.warn)

    def uninstall(self) -> None:
        uninstall()
