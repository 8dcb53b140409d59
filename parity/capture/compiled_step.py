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
hash as it does eagerly, so with one the step is compiled as before. Not covered: a compiled function that
calls ``opt.step()`` inside (capture cannot tell it steps an optimizer before it runs; there
the wrapper frame is still skipped, values and graphs as without parity: round 15c)."""

from __future__ import annotations

import functools
from typing import Any, Callable


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
    if opt is None or not callable(compiled):
        return compiled

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
            return compiled(*args, **kwargs)
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
