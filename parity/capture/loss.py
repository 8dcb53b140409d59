"""The loss of a training step as the trainer reports it: the sum over the step's backward calls.

Why: with gradient accumulation a step runs several forward/backward passes, each on its share
of the loss (``loss / n`` per micro-batch); the trainer logs their sum. Keeping only the last
backward's scalar recorded one micro-batch's share (2.36 where the trainer logged 4.68), and
the diff then reported a loss difference that was not there. Each outermost ``backward`` (and
each loss a traced GraphTrainer step returns) is noted; when the optimizer step begins the
noted scalars of that step are summed the way torchtitan does (``torch.stack(...).sum()``, in
the loss's dtype). One backward per step: that scalar, untouched. A loss scaled by a GradScaler
is recorded unscaled, with its scale apart (below).
"""

from __future__ import annotations

import functools
import weakref

import torch

from parity.capture.hashing import local_tensor


def note(s, t: torch.Tensor) -> None:
    """Remember ``t`` (a scalar loss, detached) as part of the step after ``s.done``. A loss a
    GradScaler scaled (see :func:`install_scaler_hooks`) is remembered unscaled, its scale
    apart (:func:`step_scale`)."""
    d, scale = unscaled(t)
    if getattr(s, "_loss_parts_after", None) != s.done:
        s._loss_parts = []
        s._loss_scales = []
        s._loss_parts_after = s.done
    s._loss_parts.append(d)
    if scale is not None:
        s._loss_scales.append(scale)
    s.loss_ref = d


def step_scale(s):
    """The scale of the loss of the step now beginning (a one-element tensor), or None when no
    part of it was scaled. The scaler changes its scale only in ``update()``, after the step:
    every micro-batch of a step has the same; the last one is kept."""
    if getattr(s, "_loss_parts_after", None) != s.done:
        return None
    scales = getattr(s, "_loss_scales", None) or []
    return scales[-1] if scales else None


# ------------------------------------------------------------------------------ scaled losses
# ``GradScaler.scale(loss)`` returns ``loss * scale`` and the trainer calls ``backward()`` on
# that: the loss the trainer means (and logs) is ``loss``. Two runs whose scales differ (init
# 65536 vs 1024, no overflow) train bitwise alike, parameters and the unscaled gradients the
# optimizer consumes alike, but their scaled losses differ. So each tensor a scaler returns is
# remembered (by identity, weakly) with the loss it scaled and a copy of the scale, and a
# ``backward()`` on it (or on one op applied to it: ``(scaler.scale(loss) / n).backward()``)
# records the unscaled value and the scale apart. A ``GradScaler.step`` that stepped no
# optimizer skipped the step (inf/NaN gradients): the session records it as a step whose
# optimizer step did not run (steps.py ``_skipped_step``). torch/amp/grad_scaler.py
# (``GradScaler.scale``, ``step``, ``_maybe_opt_step``; torch 2.13); FSDP1's
# ``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py) defines its own
# ``scale`` and is wrapped when imported.
_SCALED: dict[int, tuple] = {}  # id(scaled) -> (weakref(scaled), loss, scale, grad_fn)
_ORIG: dict[tuple[type, str], object] = {}
_current = lambda: None  # noqa: E731
_tracing = lambda: False  # noqa: E731  patches._tracing, given to install_scaler_hooks


def unscaled(t: torch.Tensor):
    """(``t`` detached, None), or for a tensor a scaler made (or one op applied to it): (the
    loss it scaled, detached, the scale)."""
    if _SCALED:
        hit = _SCALED.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1], hit[2]
        fn = getattr(t, "grad_fn", None)
        for nxt, _ in getattr(fn, "next_functions", ()) or ():
            for ref, base, scale, gfn in list(_SCALED.values()):
                if nxt is not None and nxt is gfn and ref() is not None:
                    with torch.no_grad():  # the scale is a power of two: exact
                        return (t.detach() / scale.to(t.device)).to(t.dtype), scale
    return t.detach(), None


def _remember(out, loss, scaler) -> None:
    sc = getattr(scaler, "_scale", None)
    if not isinstance(sc, torch.Tensor) or not isinstance(out, torch.Tensor) or out is loss:
        return
    for k in [k for k, v in _SCALED.items() if v[0]() is None]:
        del _SCALED[k]  # the scaled losses of earlier steps are gone
    ref = weakref.ref(out)
    with torch.no_grad():
        _SCALED[id(out)] = (ref, loss.detach(), sc.detach().clone(), out.grad_fn)


def _found_inf(scaler, optimizer) -> bool:
    """Whether ``scaler.step(optimizer)`` found inf/NaN gradients (its per-optimizer state,
    read before ``update()`` clears it; the values were already read by the scaler, so no
    new synchronization). A torch.optim optimizer whose state cannot be read: its hooks did
    not fire, which only a skip explains; anything else (a foreign optimizer fires no hooks
    at all): not a skip."""
    try:
        state = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return any(float(v.item()) != 0.0 for v in state.values())
    except Exception:  # noqa: BLE001
        return isinstance(optimizer, torch.optim.Optimizer)


def _wrap(cls: type) -> None:
    scale_fn = cls.__dict__.get("scale")
    step_fn = cls.__dict__.get("step")
    if scale_fn is not None and (cls, "scale") not in _ORIG:
        def scale(self, outputs, *args, **kwargs):
            out = scale_fn(self, outputs, *args, **kwargs)
            s = _current()
            if s is not None and not s.failed and isinstance(outputs, torch.Tensor) \
                    and outputs.numel() == 1 and not _tracing():
                try:
                    _remember(out, outputs, self)
                except Exception:  # noqa: BLE001 - never get in the way of training
                    pass
            return out

        functools.update_wrapper(scale, scale_fn)
        _ORIG[cls, "scale"] = scale_fn
        cls.scale = scale
    if step_fn is not None and (cls, "step") not in _ORIG:
        def step(self, optimizer, *args, **kwargs):
            s = _current()
            if s is None or s.failed or not getattr(self, "_enabled", True) or _tracing():
                return step_fn(self, optimizer, *args, **kwargs)
            before = s._opt_pre_calls
            out = step_fn(self, optimizer, *args, **kwargs)
            if s._opt_pre_calls == before and _found_inf(self, optimizer):
                s._skipped_step(optimizer, "inf")  # no optimizer step ran: skipped
            return out

        functools.update_wrapper(step, step_fn)
        _ORIG[cls, "step"] = step_fn
        cls.step = step


def install_scaler_hooks(current, tracing) -> None:
    """Wrap ``torch.amp.GradScaler.scale`` / ``.step`` (and FSDP1's ``ShardedGradScaler``'s,
    once imported) once per process; each asks ``current()`` for the session (None: a
    pass-through) and ``tracing()`` whether a trace is running (patches._tracing: this module
    is imported by patches.py). Class attributes, looked up at each call: scalers made before
    capture started are covered, and nothing is traced (never inside a compiled region)."""
    global _current, _tracing
    _current, _tracing = current, tracing
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "GradScaler"):
        _wrap(amp.GradScaler)
    from parity.capture import post_import

    post_import.when_imported("torch.distributed.fsdp.sharded_grad_scaler",
                              lambda mod: _wrap(mod.ShardedGradScaler)
                              if hasattr(mod, "ShardedGradScaler") else None)


def step_loss(s):
    """The loss of the step now beginning: the sum of its noted parts (None if none)."""
    parts = getattr(s, "_loss_parts", None) or []
    if getattr(s, "_loss_parts_after", None) != s.done or not parts:
        return s.loss_ref
    if len(parts) == 1:
        return parts[0]
    from torch.utils._python_dispatch import _disable_current_modes

    # the sum is capture's own computation: kept out of any dispatch mode (op capture) and
    # out of autograd
    with _disable_current_modes(), torch.no_grad():
        local = [local_tensor(p).reshape(()) for p in parts]
        if len({x.dtype for x in local}) != 1 or len({x.device for x in local}) != 1:
            return s.loss_ref
        local = _fold_totals(local)
        if len(local) == 1:
            return local[0]
        return torch.stack(local).sum()


def _fold_totals(parts: list) -> list:
    """A chunked loss (torchtitan's ChunkedLossWrapper) calls ``backward`` on each chunk's loss
    inside the loss computation and the trainer then calls ``backward`` on their total: the
    total is not another micro-batch. A part equal (to rounding) to the sum of the two or more
    parts since the last such total replaces them; micro-batches (gradient accumulation) stay
    separate parts."""
    out, pending = [], []
    for p in parts:
        if len(pending) >= 2:
            acc = float(torch.stack(pending).sum())
            if abs(float(p) - acc) <= 1e-5 * max(1.0, abs(acc)):
                out.append(p)
                pending = []
                continue
        pending.append(p)
    return out + pending
