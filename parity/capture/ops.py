"""Op-level capture for ``parity bisect``: a hash of every operation's output at ONE step.

Only ``parity bisect`` turns this on, in the jobs it reruns: it sets ``PARITY_OPS_STEP=K``
(and ``PARITY_OPS_EXIT=1``) next to the usual ``parity exec`` variables; inject.py then calls
:func:`activate_from_env` after the capture session has started. Without that variable this
module is never imported, so a normal run pays nothing.

What is recorded during training step K (from the first module call after step K-1's
optimizer step to the end of step K's optimizer step), one line per operation, in execution
order, to ``RUN_DIR/ops/rank-NNNNN.jsonl``:

* eager processes: a ``TorchDispatchMode`` sees every ATen op (forward, backward, optimizer);
  ``ModTracker`` names the module whose forward or backward is running.
* compiled processes (the model itself compiled, ``torch.compile(model)``): a TorchDispatchMode
  around a compiled call breaks it ("non-infra torch dispatch mode present"), so no mode runs
  during forward/backward. Instead the compiled graphs, hooked where graph.py already wraps
  aot_autograd's compilers (``graph.set_runtime_hook``), are run at step K by an
  ``fx.Interpreter`` that hashes every node's output. That is exact for aot_eager-style graphs
  (the nodes ARE the ops that run); an inductor graph is one opaque record with hashed outputs
  (interpreting it would run other kernels than the job; docs/bisect.md). The module of a node
  is its ``nn_module_stack`` (forward) or ``fwd_nn_module_stack`` (backward). The optimizer
  step runs eagerly and is recorded by the dispatch mode in both kinds.
* mixed processes (some blocks compiled, ``block.compile()`` or ``torch.compile(block)``, the
  model around them eager, as torchtitan compiles per block): the eager ops around the
  compiled blocks are recorded op by op by the dispatch mode and ``ModTracker``, as in an eager
  process; each compiled block's call runs as the job runs it (the mode popped, ModTracker's
  global hooks taken off for the call: a compiled frame sees no hook and no mode it did not see
  when it was compiled) and its graphs are recorded as in a compiled process.
* at the start of step K's optimizer step, one ``parity.grad`` record per parameter: the hash
  of the gradient the optimizer consumes, i.e. after the reduce-scatter. Collectives are not
  hashed (their outputs are not ready before the wait, and eager and compiled jobs bucket them
  differently); these records are where a communication difference shows.

Nothing here runs inside a trace, issues a collective, or recompiles: the interpreter runs the
very graph the compiler returned. With ``PARITY_OPS_EXIT=1`` the job is ended right after step K
(``SystemExit(0)`` from the optimizer post-hook, on every rank at the same point), since later
steps cannot tell bisect anything.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import os
import sys
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parity.capture.sources.graph_walk import JointPhase
from parity.capture.hashing import host_digest
from parity.comm_ops import COMM_NAMESPACES
from parity.capture.env import one_line as _one_line
from parity.capture.env import say as _say
from parity.capture.names import PROPERTY_MODULE, node_module, normalize_fqn, stack_module  # noqa: F401
from parity.rundir import ops_path

ENV_STEP = "PARITY_OPS_STEP"
ENV_EXIT = "PARITY_OPS_EXIT"
GRAD_OP = "parity.grad"

# Communication and bucket plumbing: recorded (so the streams show them) but never hashed or
# aligned op by op; their effect is compared through the gradients they produce.
# (COMM_NAMESPACES: parity/comm_ops.py)
COMM_OPS = ("aten._chunk_cat", "aten.chunk_cat", "aten.split_with_sizes_copy")

_ACTIVE: "OpRecorder | None" = None


def op_kind(name: str, schema=None) -> str:
    """compute | view | comm for an op named ``ns.op.overload``."""
    ns = name.split(".", 1)[0]
    base = ".".join(name.split(".")[:2])
    if ns in COMM_NAMESPACES or base in COMM_OPS or "wait_tensor" in name:
        return "comm"
    if schema is not None:
        for r in schema.returns:
            ai = r.alias_info
            if ai is not None and not ai.is_write:
                return "view"
    return "compute"


def _hex(t) -> str | None:
    try:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        if type(t) is not torch.Tensor:
            t = getattr(t, "_local_tensor", t)
        # A copy: exposing a tensor's own storage to numpy makes it non-resizable, and FSDP2
        # frees its unsharded parameters with storage().resize_(0).
        return host_digest(t.detach().clone(memory_format=torch.contiguous_format)).hex()
    except Exception:  # noqa: BLE001 - an unhashable tensor (fake, sparse...): no hash
        return None


def _sig(t) -> dict:
    lt = getattr(t, "_local_tensor", t) if type(t) is not torch.Tensor else t
    return {"shape": list(lt.shape), "dtype": str(lt.dtype).removeprefix("torch.")}


def _tensors(tree) -> list:
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


# The module of a graph node (shared with the compiled-graph walk): parity/capture/names.py.
_node_module = node_module


class _Mode(TorchDispatchMode):
    """Hashes every op's inputs and output as it runs (outside compiled calls only)."""

    # Higher-order ops (flex_attention run eagerly under selective activation checkpointing's
    # mode, as the job runs it) pass through here too: run them below this mode, record one op.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile'd code is not traced under this mode and dynamo does not skip it
        because of it (torch >= 2.13 asks; older torch ignores this): a compiled function
        in an eager trainer runs compiled, as in the job."""
        return True

    def __init__(self, rec: "OpRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func) if hasattr(func, "_schema") else getattr(func, "__name__", str(func))
        kind = op_kind(name, getattr(func, "_schema", None))
        ins = [_hex(t) for t in _tensors((args, kwargs))] if kind == "compute" else None
        out = func(*args, **kwargs)
        self.rec.add(name, kind, ins, out, self.rec.module(), self.rec.phase(), None)
        return out


class _Interpreter(torch.fx.Interpreter):
    """Runs a compiled graph node by node, hashing each call_function node's output."""

    def __init__(self, gm, rec: "OpRecorder", graph: str, prefix: str = ""):
        super().__init__(gm)
        self.rec = rec
        self.graph_label = graph
        self.kind = graph.split("#")[0]
        self.joint_phase = JointPhase()  # a make_fx joint graph (GraphTrainer aot_fx_trace)
        self.prefix = prefix  # where the compiled module sits in the model (module_prefix)

    def _module(self, n) -> str:
        return _join(self.prefix, _node_module(n))

    def _phase(self, n) -> str:
        return self.joint_phase(n) if self.kind == "joint" else self.kind

    def run_node(self, n):
        if n.op == "call_module":  # a compiled region inside the graph (regional inductor)
            out = super().run_node(n)
            self.rec._opaque(f"inside compiled region {n.target}, not recorded op by op",
                             self._phase(n), self._module(n), f"{self.graph_label}:{n.name}",
                             out)
            return out
        if n.op != "call_function" or n.target is operator.getitem:
            return super().run_node(n)
        name = str(n.target) if hasattr(n.target, "_schema") else getattr(n.target, "__name__",
                                                                           str(n.target))
        kind = op_kind(name, getattr(n.target, "_schema", None))
        if kind == "compute":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            ins = [_hex(t) for t in _tensors((args, kwargs))]
        else:
            ins = None
        out = super().run_node(n)
        self.rec.add(name, kind, ins, out, self._module(n), self._phase(n),
                     f"{self.graph_label}:{n.name}")
        return out


def _join(prefix: str, module: str) -> str:
    return f"{prefix}.{module}" if prefix and module else prefix or module


def module_prefix(gm, args, names: dict[int, str]) -> str | None:
    """Where a compiled module sits in the model, from one run of its forward graph: a graph
    compiled from a submodule (torchtitan compiles each block, ``block.compile()``) names its
    nodes' modules relative to that submodule (``norm``), and one graph serves every block of
    that class. ``names`` maps the parameters registered now (id -> FQN); an argument that is
    one of them, used by a node of module ``rel``, makes ``FQN's module`` minus ``rel`` the
    prefix (``layers.0.norm.weight`` used in ``norm`` -> ``layers.0``). None when no argument
    is a known parameter."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, t in zip(phs, args):
        fqn = names.get(id(t))
        if fqn is None:
            continue
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        rel = next((m for m in map(_node_module, ph.users) if m), "")
        if not rel:
            return owner
        if owner == rel or owner.endswith("." + rel):
            return owner[:len(owner) - len(rel)].rstrip(".")
    return None


def _calls_gm(gm, f) -> bool:
    return f is gm or getattr(f, "__self__", None) is gm or getattr(f, "gm", None) is gm


def runs_graph_as_is(gm, compiled, depth: int = 2) -> bool:
    """Whether ``compiled`` only calls ``gm`` (aot_eager-style: ``boxed_nop``'s runner,
    ``make_boxed_func(gm.forward)``, ``AOTEagerOutputCode``, ``gm`` itself, any of these under
    ``torch._dynamo.disable``): only then is
    interpreting ``gm`` node by node the same computation. Deliberately strict: a wrapper that
    holds anything else callable (inductor's compiled module, a CUDA-graph runner) is not."""
    if _calls_gm(gm, compiled):
        return True
    cells = []
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            continue
    gm_cells = [c for c in cells if _calls_gm(gm, c)]
    if gm_cells:
        return all(c in gm_cells or not callable(c) for c in cells)
    # torch._dynamo.disable(fn) (how aot_autograd hands back a backward): recurse into fn.
    contexts = [c for c in cells if type(c).__name__ in ("DisableContext", "_TorchDynamoContext")]
    rest = [c for c in cells if c not in contexts and callable(c)]
    if depth > 0 and contexts and len(rest) == 1:
        return runs_graph_as_is(gm, rest[0], depth - 1)
    return False


def backend_of(compiled, depth: int = 3) -> str:
    """"inductor" when what the compiler returned is inductor's output, by type: an instance of
    ``torch._inductor.output_code.OutputCode`` (inductor's forward: a ``CompiledFxGraph``) or a
    wrapper whose closure holds one (its backward: ``torch._dynamo.disable`` around a
    ``CompiledFxGraph``). Else "compiled" (a CUDA-graph runner, another backend's callable)."""
    oc = sys.modules.get("torch._inductor.output_code")
    output_code = getattr(oc, "OutputCode", None)
    if output_code is None:  # inductor never ran in this process
        return "compiled"
    todo, seen = [(compiled, 0)], set()
    while todo:
        obj, d = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, output_code):
            return "inductor"
        if d < depth:
            todo += [(c.cell_contents, d + 1) for c in getattr(obj, "__closure__", None) or ()
                     if _has_contents(c)]
            inner = getattr(obj, "__wrapped__", None)
            if inner is not None:
                todo.append((inner, d + 1))
    return "compiled"


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def graph_module(gm) -> str:
    """The module a whole compiled graph belongs to: the deepest module every op node of the
    graph ran in ("" when its nodes name none or several)."""
    mods = set()
    for n in getattr(getattr(gm, "graph", None), "nodes", ()):
        if n.op == "call_function":
            m = _node_module(n)
            if m:
                mods.add(m)
    if not mods:
        return ""
    parts = [m.split(".") for m in mods]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    return ".".join(common)


class OpRecorder:
    def __init__(self, session, step: int, exit_after: bool):
        self.session = session
        self.step = step
        self.exit_after = exit_after
        self.records: list[dict] = []
        self.compiled = False  # torch.compile was called on a module in this process
        self.mixed = False  # compiled blocks inside an eager model: eager ops recorded around them
        self._job_depth = 0  # nesting of _as_the_job_runs
        self.backends: list[str] = []  # the backends torch.compile was asked for, in order
        self.recording = False
        self.in_optimizer = False
        self.done = False
        self.mode: _Mode | None = None
        self.tracker = None
        self.graphs_run = 0
        self._runtime_hooked = False
        self._in_compiled_fn = False
        self._makefx_ids: dict[int, int] = {}
        self._prefixes: dict[int, list[str]] = {}  # graph id -> forward runs' module prefixes
        self._roots: list | None = None
        self.warnings: list[str] = []
        self._fwd_handle = None
        self._handles = []
        self._lock = threading.RLock()
        self.pid = os.getpid()

    # ------------------------------------------------------------------------------ hooks
    def install(self) -> None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        orig_compile = torch.compile

        @functools.wraps(orig_compile)
        def compile(*args, **kwargs):
            target = args[0] if args else kwargs.get("model")
            # A compiled module (or its forward) makes a compiled process: forward/backward come
            # from its graphs. A compiled function (torchtitan's flex attention) inside an
            # eager trainer does not: the trainer stays eager and the function is one opaque
            # region, named (a dispatch mode around it would make dynamo skip it and run it
            # eagerly: another computation).
            is_module = isinstance(target, torch.nn.Module) or isinstance(
                getattr(target, "__self__", None), torch.nn.Module)
            if is_module:
                self.compiled = True
            backend = kwargs.get("backend", "inductor")  # torch.compile's default
            backend = backend if isinstance(backend, str) else getattr(
                backend, "__name__", type(backend).__name__)
            if backend not in self.backends:
                self.backends.append(backend)
            if not self._runtime_hooked:  # hooked here, not at start: eager jobs never import dynamo
                self._runtime_hooked = True
                from parity.capture.sources import graph

                reason = graph.set_runtime_hook(self._wrap_compiled)
                if reason:
                    self.warnings.append(f"compiled graphs cannot be recorded: {reason}")
            out = orig_compile(*args, **kwargs)
            if not is_module and callable(out) and target is not None:
                return self._compiled_function(out, getattr(target, "__name__", None)
                                               or type(target).__name__)
            if is_module and not isinstance(target, torch.nn.Module) and callable(out):
                return self._compiled_block(out)  # module.compile(): its _compiled_call_impl
            return out

        torch.compile = compile
        self._patch_optimized_module()
        from parity.capture.sources import graph_makefx

        graph_makefx.set_runtime_hook(self._makefx_interpreter)
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        if self.step == 1:
            self._arm()

    def _arm(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.recording = True
        self._fwd_handle = register_module_forward_pre_hook(self._first_forward)

    def _first_forward(self, module, args):
        # One shot: removed at its first call, before any compiled frame is entered. Inside a
        # trace (dynamo, GraphTrainer's make_fx) it does nothing and waits for a real call.
        from parity.capture.patches import _tracing

        if _tracing():
            return None
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()
        if type(module).__name__ == "OptimizedModule" or getattr(
                module, "_compiled_call_impl", None) is not None:
            self.compiled = True
            return None  # the model itself is compiled: forward/backward from its graphs
        # an eager model, perhaps around compiled blocks: its own ops recorded op by op
        self.mixed = self.compiled
        try:
            from torch.distributed._tools.mod_tracker import ModTracker

            self.tracker = ModTracker()
            self.tracker._get_pop_fn = self._tolerant_pop(self.tracker._get_pop_fn)
            self.tracker.__enter__()
            self.tracker._fw_pre_hook(module, args)  # this call's own pre-hook has passed
        except Exception as e:  # noqa: BLE001
            self.tracker = None
            self.warnings.append(f"module names unavailable: {_one_line(e)}")
        self.mode = _Mode(self)
        self.mode.__enter__()
        return None

    def _tolerant_pop(self, get_pop_fn):
        """ModTracker raises inside the job's forward when a post-hook finds no matching
        pre-hook (seen with activation checkpointing in torchtitan): module names are ours to
        lose, the job is not. The mismatch becomes a warning."""
        def get(w_mod, name, is_bw):
            fn = get_pop_fn(w_mod, name, is_bw)

            def pop(*args):
                try:
                    return fn(*args)
                except RuntimeError as e:
                    if "hierarchy tracking" not in str(e):
                        raise
                    msg = "module names may be off: ModTracker lost track of the module nesting"
                    if msg not in self.warnings:
                        self.warnings.append(msg)
                    return None

            return pop

        return get

    def _opt_pre(self, opt, args, kwargs):
        s = self.session
        if not self.recording or self.in_optimizer or s.depth != 1 or s.k != self.step:
            return
        self.in_optimizer = True
        try:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # the hashing's own copies are not the job's ops
                self._grads()
        except Exception as e:  # noqa: BLE001
            self.warnings.append(f"gradients not recorded: {_one_line(e)}")
        if self.mode is None:  # compiled process: the optimizer runs eagerly, record it
            self.mode = _Mode(self)
            self.mode.__enter__()

    def _opt_post(self, opt, args, kwargs):
        s = self.session
        if s.depth != 0 or os.getpid() != self.pid:
            return
        if not self.recording and not self.done and s.done == self.step - 1:
            self._arm()
            return
        if self.recording and s.done == self.step:
            self._finish(complete=True)
            if self.exit_after:
                raise SystemExit(0)

    def _grads(self) -> None:
        s = self.session
        for p, entry in zip(s.table, s.entries):
            g = p.grad
            rec = {"op": GRAD_OP, "kind": "grad", "phase": "backward",
                   "module": entry["fqn"].rsplit(".", 1)[0] if "." in entry["fqn"] else "",
                   "param": entry["fqn"], "in": None}
            rec["out"] = [dict(_sig(g), hash=_hex(g))] if g is not None else []
            self._append(rec)

    # ------------------------------------------------------------------------- recording
    def phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        if self.tracker is not None and self.tracker.is_bw:
            return "backward"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def module(self) -> str:
        if self.tracker is None:
            return ""
        names = [p for p in self.tracker.parents if p != "Global"]
        if not names:
            return ""
        best = max(sorted(names), key=lambda n: n.count("."))
        return normalize_fqn(best.split(".", 1)[1]) if "." in best else ""

    def add(self, name, kind, ins, out, module, phase, node) -> None:
        outs = _tensors(out)
        rec = {"op": name, "kind": kind, "phase": phase, "module": module, "in": ins,
               "out": [dict(_sig(t), hash=_hex(t) if kind == "compute" else None) for t in outs]}
        if node:
            rec["node"] = node
        self._append(rec)

    def _append(self, rec: dict) -> None:
        with self._lock:
            rec["i"] = len(self.records)
            self.records.append(rec)

    # ------------------------------------------------------------------------ compiled
    def _opaque(self, op: str, phase: str, module: str, node: str, out) -> None:
        """One record for a region not recorded op by op; its outputs are hashed (where the
        values leave the region), but it is not compared as an op."""
        self._append({"op": op, "kind": "opaque", "phase": phase, "module": module, "in": None,
                      "out": [dict(_sig(t), hash=_hex(t)) for t in _tensors(out)],
                      "node": node})

    def _wrap_in_eager(self, compiled, label: str, boxed: bool):
        """A compiled function's graph in an eager process. Its forward runs inside
        ``_compiled_function`` (recorded there); its backward runs within autograd's backward,
        under the dispatch mode: run as the job runs it (mode off), one opaque record."""
        def record(call):
            if self._in_compiled_fn or not self._eager_recording():
                return call()
            from torch.utils import _python_dispatch as pd

            if pd._get_current_dispatch_mode() is not self.mode:
                return call()
            with pd._pop_mode_temporarily():  # only our own mode, the top one
                out = call()
            self._opaque(f"compiled graph {label} (not recorded op by op)", self.phase(),
                         self.module(), label, out)
            return out

        if boxed:
            def run(args):
                return record(lambda: compiled(args))

            run._boxed_call = True  # type: ignore[attr-defined]
        else:
            def run(*args):
                return record(lambda: compiled(*args))
        return run

    def _makefx_interpreter(self, gm):
        """GraphTrainer aot_fx_trace (graph_makefx's runner): at step K the traced joint graph
        (forward, loss and backward) is run by the hashing interpreter; the process is then a
        compiled one (no dispatch mode: every op of the step is a node of that graph)."""
        if not self._graph_recording():
            return None
        if not self.compiled or self.mixed:
            self.compiled = True
            self.mixed = False
            h, self._fwd_handle = self._fwd_handle, None
            if h is not None:
                h.remove()
            self._stop_mode()
        gid = self._makefx_ids.setdefault(id(gm), len(self._makefx_ids))
        self.graphs_run += 1
        return functools.partial(_Interpreter, rec=self, graph=f"joint#{gid}")

    def _stop_mode(self) -> None:
        """Leave the dispatch mode and the module tracker (whichever is on)."""
        for ctx in (self.mode, self.tracker):
            if ctx is not None:
                try:
                    ctx.__exit__(None, None, None)
                except Exception:  # noqa: BLE001
                    pass
        self.mode = self.tracker = None

    def _graph_recording(self) -> bool:
        """Step K's forward/backward in this process: compiled graphs run here are recorded."""
        return self.recording and not self.in_optimizer and os.getpid() == self.pid

    def _eager_recording(self) -> bool:
        """An eager (or mixed) process recording forward/backward with its dispatch mode."""
        return (self.recording and self.mode is not None and not self.in_optimizer
                and (not self.compiled or self.mixed) and os.getpid() == self.pid)

    @contextlib.contextmanager
    def _as_the_job_runs(self):
        """Around a compiled block's call (or a compiled graph run from autograd) in a mixed
        process at step K: our dispatch mode popped when it is the top one, ModTracker's global
        module hooks taken off, both put back after. The compiled frame then sees the hooks and
        modes it was compiled with (none of ours): no guard fails, nothing recompiles."""
        from torch.utils import _python_dispatch as pd

        self._job_depth += 1
        tracker = self.tracker if self._job_depth == 1 else None  # the outermost call only
        if tracker is not None:
            tracker._fw_pre_handle.remove()
            tracker._fw_post_handle.remove()
        try:
            if self.mode is not None and pd._get_current_dispatch_mode() is self.mode:
                with pd._pop_mode_temporarily():
                    yield
            else:
                yield
        finally:
            self._job_depth -= 1
            if tracker is not None and tracker is self.tracker:
                tracker.__enter__()  # registers its two global hooks again

    def _compiled_block(self, fn):
        """``module.compile()``'s compiled call: as the job runs it when a mixed process records
        (:meth:`_as_the_job_runs`), its graphs recorded through the runtime hook."""
        rec = self

        @functools.wraps(fn)
        def compiled_block(*args, **kwargs):
            if torch.compiler.is_compiling() or not (rec.mixed and rec._eager_recording()):
                return fn(*args, **kwargs)
            with rec._as_the_job_runs():
                return fn(*args, **kwargs)

        return compiled_block

    def _patch_optimized_module(self) -> None:
        """``torch.compile(block)`` returns an OptimizedModule whose ``__call__`` runs global
        module hooks (and warns about them) before its compiled frame: in a mixed process at
        step K its call runs as :meth:`_compiled_block`'s. Class-level, once per process, and a
        plain pass-through whenever this recorder is not recording a mixed step."""
        try:
            from torch._dynamo.eval_frame import OptimizedModule
        except Exception:  # noqa: BLE001 - no dynamo: nothing compiled to wrap
            return
        original = OptimizedModule.__call__
        if getattr(original, "_parity_ops", False):
            return
        rec = self

        @functools.wraps(original)
        def __call__(mod, *args, **kwargs):
            if not (rec.mixed and rec._eager_recording()) or torch.compiler.is_compiling():
                return original(mod, *args, **kwargs)
            with rec._as_the_job_runs():
                return original(mod, *args, **kwargs)

        __call__._parity_ops = True  # type: ignore[attr-defined]
        OptimizedModule.__call__ = __call__

    def _compiled_function(self, fn, name: str):
        """A function compiled inside an eager trainer (flex attention): at step K, its call
        runs with the dispatch mode off (as the job runs it) and is one record, ``name``, with
        its inputs' and outputs' hashes: opaque inside, compared by its outputs."""
        rec = self

        @functools.wraps(fn)
        def compiled_function(*args, **kwargs):
            if torch.compiler.is_compiling() or not rec._eager_recording():
                return fn(*args, **kwargs)
            from torch.utils import _python_dispatch as pd

            if pd._get_current_dispatch_mode() is not rec.mode:
                # another mode (selective activation checkpointing's) above ours: leave the
                # stack alone; the job's own modes decide how the call runs
                return fn(*args, **kwargs)
            with pd._pop_mode_temporarily():  # only our own mode, the top one
                ins = [_hex(t) for t in _tensors((args, kwargs))]
                rec._in_compiled_fn = True
                try:
                    out = fn(*args, **kwargs)
                finally:
                    rec._in_compiled_fn = False
            rec.add(name, "compute", ins, out, rec.module(), rec.phase(),
                    f"compiled {name} (not recorded op by op)")
            return out

        return compiled_function

    def _wrap_compiled(self, gm, graph_kind: str, graph_id: int, compiled):
        label = f"{graph_kind}#{graph_id}"
        boxed = getattr(compiled, "_boxed_call", False)
        if not self.compiled:
            return self._wrap_in_eager(compiled, label, boxed)
        if runs_graph_as_is(gm, compiled):
            def run(*args):
                self.graphs_run += 1
                interp = _Interpreter(gm, self, label,
                                      self._prefix(gm, graph_kind, graph_id, args, boxed))
                return interp.boxed_run(args[0]) if boxed else interp.run(*args)
        else:
            # Inductor kernels, CUDA graphs...: interpreting the FX graph would record values
            # the job never computed. One record per run, named by what torch produced.
            backend = backend_of(compiled)
            module = graph_module(gm)
            self.warnings.append(f"{label}: the compiled callable ({type(compiled).__name__}, "
                                 f"{backend}) does not run its FX graph node by node: its ops "
                                 "are not recorded")

            def run(*args):
                prefix = self._prefix(gm, graph_kind, graph_id, args, boxed)
                out = compiled(*args)
                self._opaque(f"inside {backend} graph {label}, not recorded op by op",
                             graph_kind, _join(prefix, module), label, out)
                return out

        def recorded(*args):
            if not self._graph_recording():
                return compiled(*args)
            if self.mixed:  # a backward run from autograd under our mode: off for the graph
                with self._as_the_job_runs():
                    return run(*args)
            return run(*args)

        if boxed:
            recorded._boxed_call = True  # type: ignore[attr-defined]
        return recorded

    def _prefix(self, gm, graph_kind: str, graph_id: int, args, boxed: bool) -> str:
        """The model path of the module a compiled graph runs for (module_prefix): found at
        each forward run from its parameter arguments and kept per compilation; a backward
        run takes the latest forward's (backwards run in reverse order of their forwards)."""
        stack = self._prefixes.setdefault(graph_id, [])
        if graph_kind == "backward":
            return stack.pop() if stack else ""
        names: dict[int, str] = {}
        try:
            roots = list(getattr(self.session, "_name_roots", ()) or ())
            ref = getattr(self.session, "_root_ref", None)
            if not roots and ref is not None and ref() is not None:
                roots = [ref()]  # names not resolved yet (step 1): the first module called
            if not roots:  # nor that: every module tree (a gc scan, once)
                if self._roots is None:
                    from parity.capture.table import _module_roots

                    self._roots = _module_roots()
                roots = self._roots
            for root in roots:
                for fqn, p in root.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), normalize_fqn(fqn))
            prefix = module_prefix(gm, args[0] if boxed else args, names) or ""
        except Exception:  # noqa: BLE001 - names only
            prefix = ""
        if graph_kind == "forward":
            stack.append(prefix)
        return prefix

    # --------------------------------------------------------------------------- output
    def _finish(self, complete: bool) -> None:
        if self.done:
            return
        self.done = True
        self.recording = False
        self.in_optimizer = False
        self._stop_mode()
        for h in self._handles:
            h.remove()
        self._handles = []
        rank = self.session.rank
        path = ops_path(self.session.out_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        meta = {"meta": {"step": self.step, "rank": rank, "complete": complete,
                         "process": ("mixed" if self.mixed else "compiled" if self.compiled
                                     else "eager"),
                         "graphs_run": self.graphs_run, "ops": len(self.records),
                         "compile_backends": self.backends,
                         "warnings": self.warnings, "time": time.time()}}
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(json.dumps(meta) + "\n")
            for r in self.records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        os.replace(tmp, path)


def activate_from_env(session) -> OpRecorder | None:
    """Start op capture if ``PARITY_OPS_STEP`` asks for it (called by inject.py); fails soft."""
    global _ACTIVE
    raw = os.environ.get(ENV_STEP)
    if not raw or session is None or _ACTIVE is not None:
        return _ACTIVE
    try:
        step = int(raw)
        if step < 1:
            raise ValueError(f"{ENV_STEP} must be >= 1, got {raw!r}")
        rec = OpRecorder(session, step, os.environ.get(ENV_EXIT, "0") == "1")
        rec.install()
        _ACTIVE = rec

        import atexit

        atexit.register(lambda: rec._finish(complete=False) if not rec.done and rec.records
                        else None)
        return rec
    except Exception as e:  # noqa: BLE001
        _say(f"op capture disabled: {_one_line(e)}")
        return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit("parity.capture.ops is activated by `parity bisect`, not run directly")
