"""``torch.compile(optimizer.step)``: capture's optimizer hooks run around the compiled step,
never inside it (round 15c, docs/reliability.md).

``Optimizer.step`` is ``profile_hook_step``'s ``wrapper``, which calls every global and
per-optimizer step hook in a ``for`` loop. Dynamo traces that loop when the step is compiled.
Capture's hooks are ``torch._dynamo.disable``d there (round 5: traced, they broke the graph
inside them and changed the values), so the loop breaks the graph, and a graph break inside a
loop makes dynamo skip the whole frame. Measured (torch 2.13, CPU, aot_eager): an optimizer
whose step does not break the graph itself (a hand-written ``Optimizer`` subclass) compiled
into 1 graph without parity and into none under ``parity exec`` (the step ran eagerly, 36
frames), and with ``fullgraph=True`` the job that runs without parity raised ``Unsupported:
Skip calling torch.compiler.disable()d function`` (``StepClock._pre_hook``) under it: nothing
was captured, exit 3. torch.optim's own optimizers graph-break at ``_use_grad_for_differentiable``
either way, but the wrapper frame was skipped (8 dynamo frames without parity, 5 with it).

So a callable ``torch.compile`` returns for a bound ``step`` of a ``torch.optim.Optimizer`` is
wrapped: each call runs capture's pre-hooks eagerly (the global one, then its per-optimizer
one), takes capture's entries out of the hook dicts while the compiled step runs (dynamo traces
and guards the dicts as they are without parity: the same graphs and frames, no recompile),
puts them back in their order, and runs capture's post-hook eagerly. Only where capture's hooks
are the only step hooks (``only_ours``): a trainer's own hook must run before capture's gradient
hash as it does eagerly, so with one the step is compiled as before (its step noted after it
returns, below).

Round 15e: a compiled *function* that calls ``opt.step()`` (the "compiled optimizer" tutorial's
shape, a whole training step compiled) traced capture's disabled hooks: the step's wrapper
frame skipped (a graph break in a loop), a trainer's own optimizer run eagerly (0 graphs
against 1), and under ``fullgraph=True`` the job raised under parity only. Now every hook
capture puts in torch's hook dicts is :func:`traceable`: ``torch._dynamo.disable``d eagerly,
a no-op function to a trace (dynamo's ``substitute_in_graph``; not a ``torch.compiler
.is_compiling()`` branch, which marks the frame as having side effects and changed which frames
dynamo skips: 9 frames against 10). The job compiles exactly as without parity (dynamo's
counters equal), and :func:`call` notes the step after the compiled function returns: it
compares the parameter version counters (``_version``, bumped by a compiled in-place update,
aot_eager and inductor alike) of the process's optimizers before and after the call, and runs
capture's pre- and post-hooks for each optimizer whose parameters changed, unless capture's
hooks ran eagerly during the call (a frame dynamo skipped: the step was recorded there).
Before capture's first step each call hashes those parameters before it runs: a step 0 taken
after the call would be the updated parameters (against the eager run: ``FAILS from step 0``)."""

from __future__ import annotations

import functools
import gc
import types
import weakref
from typing import Any, Callable

# The attribute that marks a hook :func:`traceable` made (a wrapped hook is not wrapped again).
HIDDEN = "_parity_hidden"


def traceable(fn: Callable, reason: str) -> Callable:
    """``fn`` (a step hook of capture's) as it goes into torch's hook dict:
    ``torch._dynamo.disable(fn)`` eagerly (run where dynamo's frame callback is active, in a
    frame dynamo skipped, it must not be compiled: round 5), and to a trace a function that
    does nothing and returns None (so a compiled ``opt.step()`` traces no code of capture's,
    breaks no graph, and dynamo skips and compiles the frames it does without parity)."""
    import torch._dynamo
    from torch._dynamo.decorators import substitute_in_graph

    disabled = torch._dynamo.disable(fn, reason=reason)

    def traced(opt, args, kwargs):
        return None

    substitute_in_graph(disabled, skip_signature_check=True)(traced)
    setattr(disabled, HIDDEN, True)
    return disabled


def optimizer_of(fn: Any):
    """The optimizer whose bound ``step`` ``fn`` is, else None."""
    try:
        from torch.optim import Optimizer
    except Exception:  # noqa: BLE001
        return None
    opt = getattr(fn, "__self__", None)
    if isinstance(opt, Optimizer) and getattr(fn, "__name__", None) == "step":
        return opt
    return None


def _ours(table: dict, ids: set) -> list:
    return [(k, v) for k, v in table.items() if k in ids]


def only_ours(tables) -> bool:
    """Whether every ``(hook dict, capture's ids)`` pair holds capture's hooks alone. A hook of
    the trainer's own (a pre-hook that clips the gradients, a global post-hook) must run where
    it runs eagerly, before capture's gradient hash and after its parameter hash: with one, the
    compiled step is called as it is (capture's hooks traced, disabled: the frame skipped, as
    before round 15c) rather than have capture hash what the step does not consume."""
    return all(k in ids for table, ids in tables for k in table)


def _remove(table: dict, ids: set) -> list | None:
    """Take the entries of ``ids`` out of hook dict ``table``; its items before (to restore
    the order), or None when none was there."""
    if not any(k in table for k in ids):
        return None
    before = list(table.items())
    for k in ids:
        table.pop(k, None)
    return before


def _restore(table: dict, before: list | None) -> None:
    if before is not None:
        table.clear()
        table.update(before)


def wrap(fn: Any, compiled: Callable, current: Callable[[], Any]) -> Callable:
    """``compiled`` (what ``torch.compile(fn)`` returned), wrapped as the module docstring says
    when ``fn`` is a bound optimizer ``step``; else ``compiled`` itself. ``current()`` gives the
    active session (None: a pass-through)."""
    opt = optimizer_of(fn)
    if opt is None:
        return call(compiled, current) if isinstance(compiled, types.FunctionType) else compiled
    if not callable(compiled):
        return compiled
    noted = call(compiled, current)  # the trainer's own hooks: traced, the step noted after

    @functools.wraps(compiled)
    def compiled_step(*args, **kwargs):
        s = current()
        if s is None or s.stopped or s.failed:
            return compiled(*args, **kwargs)
        saved, hook_args, post = [], None, []
        try:  # capture breaking here must not stop the step (fail soft: session.py)
            hook_args, kwargs, saved, post = _before(s, opt, args, kwargs)
        except Exception as e:  # noqa: BLE001
            _put_back(saved)
            s._fail(e)
        if hook_args is None:
            return noted(*args, **kwargs)
        try:
            out = compiled(*hook_args[1:], **kwargs)
        finally:
            _put_back(saved)
        for hook in post:
            hook(opt, hook_args, kwargs)
        return out

    return compiled_step


def _before(s, opt, args, kwargs):
    """Capture's pre-hooks run eagerly and its hooks taken out of the dicts: ``(hook args,
    kwargs, what to put back, capture's post-hooks)``; hook args None where the trainer has
    hooks of its own (``only_ours``)."""
    from torch.optim import optimizer as optim_mod

    pre_g, post_g = optim_mod._global_optimizer_pre_hooks, optim_mod._global_optimizer_post_hooks
    own = getattr(opt, "_optimizer_step_pre_hooks", {})
    ids = {h.id for h in s._handles if hasattr(h, "id")}
    consumed = s._consumed_handles.get(id(opt))
    own_ids = {consumed.id} if consumed is not None else set()
    if not only_ours([(pre_g, ids), (post_g, ids), (own, own_ids)]):
        return None, kwargs, [], []  # the trainer's hooks: kept in eager order
    hook_args = (opt, *args)
    for _, hook in _ours(pre_g, ids):
        res = hook(opt, hook_args, kwargs)
        if isinstance(res, tuple) and len(res) == 2:
            hook_args, kwargs = res
    consumed = s._consumed_handles.get(id(opt))  # registered by the pre-hook on first sight
    own_ids = {consumed.id} if consumed is not None else set()
    for _, hook in _ours(own, own_ids):
        hook(opt, hook_args, kwargs)
    post = [hook for _, hook in _ours(post_g, ids)]
    saved = [(t, _remove(t, i)) for t, i in ((pre_g, ids), (post_g, ids), (own, own_ids))]
    return hook_args, kwargs, saved, post


def _put_back(saved) -> None:
    for table, before in saved:
        _restore(table, before)


def optimizers() -> list:
    """The process's live ``torch.optim.Optimizer`` objects (a gc scan: once per compiled
    function, at its first call)."""
    from torch.optim import Optimizer

    return [o for o in gc.get_objects() if issubclass(type(o), Optimizer)]  # no __class__ read


# (step, weakrefs) of the last gc scan: functions compiled anew every step (a library that
# calls torch.compile lazily, a trainer compiling inside its loop) share one scan a step
_SCANNED: list = [None, []]


def _optimizers_at(k: int) -> list:
    """Weakrefs to the process's optimizers, scanned at most once per step ``k`` (again while
    none was found: a function called before the trainer made its optimizer)."""
    if _SCANNED[0] != k or not _SCANNED[1]:
        _SCANNED[0], _SCANNED[1] = k, [weakref.ref(o) for o in optimizers()]
    return list(_SCANNED[1])


def versions(opt) -> tuple:
    """The version counters of ``opt``'s parameters (in-place updates bump them)."""
    return tuple(getattr(p, "_version", -1) for g in opt.param_groups for p in g["params"])


def stepped(before: list) -> list:
    """The optimizers of ``before`` (``(weakref, versions)`` pairs) whose parameters changed."""
    out = []
    for ref, v in before:
        opt = ref()
        if opt is not None and versions(opt) != v:
            out.append(opt)
    return out


def params_of(refs) -> list:
    """The parameters of the optimizers ``refs`` point to, each once, in their order."""
    out, seen = [], set()
    for ref in refs:
        opt = ref()
        for g in opt.param_groups if opt is not None else ():
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


# patches._tracing, set by patches' torch.compile before it wraps (patches imports this
# module: no import back)
TRACING: list = [lambda: False]


def _tracing() -> bool:
    return TRACING[0]()


def call(compiled: Callable, current: Callable[[], Any]) -> Callable:
    """``compiled`` (a function ``torch.compile`` returned), wrapped to note an optimizer step
    run inside it (module docstring, round 15e): the job's call is ``compiled``'s, untouched."""
    known: list = []  # weakrefs to the process's optimizers, found at the first call
    scanned = []

    @functools.wraps(compiled)
    def compiled_call(*args, **kwargs):
        s = current()
        if s is None or s.stopped or s.failed or s.depth or _tracing():
            # depth: inside an optimizer step capture's hooks saw (an optimizer whose step
            # calls a compiled update per parameter): that step is noted by its own hooks.
            # Tracing: a compiled function called inside a trace (GraphTrainer's make_fx of
            # its step, an outer torch.compile): no code of capture's runs there, and the
            # parameters are fake (hashing them named all 45 of torchtitan's unhashed)
            return compiled(*args, **kwargs)
        try:
            if not scanned:
                scanned.append(True)
                known.extend(_optimizers_at(s.k))
            before = [(r, versions(r())) for r in known if r() is not None]
            eager, backwards = s._opt_pre_calls, s.backwards
            # before capture's first step: the parameters' digests as they are now (step 0,
            # if the call steps: hashed, not copied; the same hashing step 0 does)
            first = None
            if before and s.k == 0:
                ps = params_of(r for r, _ in before)
                first = (ps, s._digest_rows(ps, figures=True))
        except Exception as e:  # noqa: BLE001 - fail soft (session.py)
            s._fail(e)
            return compiled(*args, **kwargs)
        out = compiled(*args, **kwargs)
        try:
            if before and s._opt_pre_calls == eager:  # no hook of capture's ran eagerly
                opts = stepped(before)
                if opts:
                    # a backward inside (a whole step): its gradients are gone
                    s._compiled_step(opts, first, s.backwards > backwards)
        except Exception as e:  # noqa: BLE001
            s._fail(e)
        return out

    return compiled_call
