"""The process-wide patches capture needs: the loss (``Tensor.backward`` /
``torch.autograd.backward``), results on disk before ``destroy_process_group``, the compiled-graph
hook on the first ``torch.compile``, the error of an uncaught exception (``sys.excepthook``), and
:func:`_tracing`, the test every hook makes before running any code (none inside a trace).

The session is passed in (``install(current)``): this module does not import session.py.
"""

from __future__ import annotations

import functools
import sys

import torch

from parity.capture.env import one_line as _one_line

# Installed once per process and left in place (cheap pass-throughs when no session is active),
# so that a later user patch on top of ours is never undone by restoring an old function.
_ORIG: dict[str, object] = {}
# The session asked at each call (session.current, given to install): this module does not
# import the session.
_current = lambda: None  # noqa: E731


def _graph_capture() -> bool:
    """True while this thread's current CUDA stream is being captured into a CUDA graph (a
    trainer's own ``torch.cuda.graph`` around its step): what runs then is recorded into the
    trainer's graph and replayed without Python, so capture runs no code there (a digest
    launched there would be the trainer's graph's, and a wait on it illegal). Never
    initializes CUDA: a process that has not is not capturing."""
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - a torch without the query: nothing is captured
        return False


def _tracing() -> bool:
    """True inside a trace (dynamo, make_fx/export, fake tensors) or a CUDA graph capture
    (:func:`_graph_capture`): capture runs no code there.

    ``torch.compiler.is_compiling()`` covers dynamo only; GraphTrainer traces its training step
    (backward included) with make_fx, where tensors are fake and a ``.item()`` would fail."""
    if torch.compiler.is_compiling() or _graph_capture():
        return True
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:
            return True
    except Exception:  # noqa: BLE001 - older torch: no proxy mode query
        pass
    try:
        from torch._guards import detect_fake_mode

        return detect_fake_mode() is not None
    except Exception:  # noqa: BLE001
        return False


def _note_loss(t) -> None:
    s = _current()
    if s is None or s.failed:
        return
    s.backwards += 1
    if _NOT_LOSS[0]:  # a pipeline stage's outputs with their incoming gradients
        return
    try:
        if isinstance(t, (list, tuple)):
            t = t[0] if len(t) == 1 else None
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            from parity.capture import loss

            loss.note(s, t)  # summed over the step's backward calls (gradient accumulation)
    except Exception:  # noqa: BLE001 - never get in the way of backward
        pass


def hide_from_dynamo() -> None:
    """Hide the ``backward`` patches from dynamo (at the first ``torch.compile``:
    Session.hide_from_dynamo). A compiled function that calls ``loss.backward()`` (a whole
    training step compiled) had dynamo trace the patch, where ``_tracing()`` is true: the loss
    was never noted (``loss recorded by A only``, exit 3, against the same step run eagerly).

    The patch's own frame is skipped (``torch._dynamo.skip``: a call to it breaks the graph,
    as dynamo does at ``backward`` anyway, and the frame runs eagerly), and its bookkeeping
    runs under ``torch._dynamo.disable``; the original ``backward`` it calls is left to dynamo
    as without parity. Before (round 8b), the whole patch was ``disable``d, recursively: the
    trainer's own Python run inside that backward (gradient hooks, a custom
    ``autograd.Function``'s backward, compiled autograd's runtime) was no longer compiled by
    the enclosing ``torch.compile``: 1 graph under ``parity exec`` against 6 without it for
    a compiled step whose parameters had gradient hooks."""
    import torch._dynamo
    from torch._dynamo.decorators import skip

    _ENTER[0] = torch._dynamo.disable(_enter)
    for fn in _PATCHES:
        if not getattr(fn, "_torchdynamo_disable", False):
            skip(fn)


# Only the outermost call counts: Tensor.backward calls torch.autograd.backward, and a
# reentrant activation checkpoint calls it again from inside the backward pass (possibly on an
# autograd device thread), with tensors that are not the loss.
_DEPTH = [0]


def _enter(t) -> bool:
    """Before a ``backward`` of the patches: note the loss and count the depth, unless inside
    another one or a trace (False: nothing done)."""
    if _DEPTH[0] or _tracing():
        return False
    _note_loss(t)
    for fn in list(ON_BACKWARD):
        try:
            fn()
        except Exception:  # noqa: BLE001 - never get in the way of backward
            pass
    _DEPTH[0] += 1
    return True


# Called before each outermost backward (a manifest source's bookkeeping: c10d_allreduce counts
# the backward passes in which DDP all-reduces its buckets). Sources add and remove their own.
ON_BACKWARD: list = []


_ENTER = [_enter]  # torch._dynamo.disable(_enter) once hidden (hide_from_dynamo)
_PATCHES: list = []  # the backward patches (their frames skipped by dynamo once hidden)


def install(current) -> None:
    """Patch ``Tensor.backward``, ``torch.autograd.backward``, ``destroy_process_group``,
    ``torch.compile`` and ``sys.excepthook`` once per process; each asks ``current()`` for the
    active session (None: a pass-through)."""
    global _current
    _current = current
    if _ORIG:
        return
    orig_tensor_backward = torch.Tensor.backward
    orig_autograd_backward = torch.autograd.backward

    def backward(self, *args, **kwargs):
        if not _ENTER[0](self):
            return orig_tensor_backward(self, *args, **kwargs)
        try:
            return orig_tensor_backward(self, *args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    def autograd_backward(tensors, *args, **kwargs):
        if not _ENTER[0](tensors):
            return orig_autograd_backward(tensors, *args, **kwargs)
        try:
            return orig_autograd_backward(tensors, *args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    for new, old in ((backward, orig_tensor_backward), (autograd_backward, orig_autograd_backward)):
        new.__wrapped__ = old
        new.__name__ = old.__name__
        new.__qualname__ = old.__qualname__
        new.__doc__ = old.__doc__
    _ORIG["Tensor.backward"] = orig_tensor_backward
    _ORIG["autograd.backward"] = orig_autograd_backward
    torch.Tensor.backward = backward
    torch.autograd.backward = autograd_backward
    _PATCHES.extend((backward, autograd_backward))

    import torch.distributed as dist

    if dist.is_available() and hasattr(dist, "destroy_process_group"):
        orig_destroy = dist.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            s = _current()
            if s is not None:
                s.flush_final()  # results on disk before the process group goes away
            return orig_destroy(*args, **kwargs)

        destroy_process_group.__wrapped__ = orig_destroy
        destroy_process_group.__name__ = orig_destroy.__name__
        destroy_process_group.__doc__ = orig_destroy.__doc__
        _ORIG["destroy_process_group"] = orig_destroy
        dist.destroy_process_group = destroy_process_group

    orig_compile = torch.compile

    def compile(*args, **kwargs):
        s = _current()
        if s is not None:
            try:  # a compiled optimizer step must not trace capture's hooks
                s.hide_from_dynamo()
            except Exception as e:  # noqa: BLE001  (fail soft: session.py)
                s._fail(e)
        if s is not None and s.manifests:
            from parity.capture.sources.manifest_source import ON_COMPILE

            s._install_imported_sources()
            s._install_sources(ON_COMPILE)
        out = orig_compile(*args, **kwargs)
        target = args[0] if args else kwargs.get("model")
        if target is not None:  # an optimizer step compiled (in a function too) is noted
            from parity.capture import compiled_step

            compiled_step.TRACING[0] = _tracing
            out = compiled_step.wrap(target, out, _current)
        return out

    functools.update_wrapper(compile, orig_compile)
    _ORIG["compile"] = orig_compile
    torch.compile = compile

    orig_excepthook = sys.excepthook

    def excepthook(tp, value, tb):
        s = _current()
        if s is not None:
            s.error = _one_line(value) if value is not None else tp.__name__
        return orig_excepthook(tp, value, tb)

    _ORIG["excepthook"] = orig_excepthook
    sys.excepthook = excepthook

    from parity.capture import post_import

    post_import.when_imported(_PIPE_STAGE, _wrap_stage_backward_input)


_PIPE_STAGE = "torch.distributed.pipelining.stage"
_NOT_LOSS = [0]  # > 0 while a pipeline stage back-propagates its outputs' gradients


def _wrap_stage_backward_input(mod) -> None:
    """The loss of a pipeline's last stage under the split-backward schedules. Zero-bubble
    schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, and DualPipeV
    for some micro-batches) compute the last stage's input gradients with
    ``stage_backward_input(losses, None, ...)``, i.e. ``torch.autograd.grad`` of the loss,
    never ``backward()``: zero-bubble runs recorded no loss (bitwise-equal runs against
    DualPipeV were incomplete, "loss recorded by B only"), and DualPipeV recorded the part of
    the micro-batches it ran through ``backward()`` (2.79 where the trainer's losses summed
    3.20). ``stage.py`` looks the function up by its module global at each call; a call with
    ``output_grads`` None is a loss's (the schedules' last stage), noted as ``backward()``
    notes it."""
    _wrap_stage_backward(mod)
    orig = getattr(mod, "stage_backward_input", None)
    if orig is None or "stage_backward_input" in _ORIG:
        return

    def stage_backward_input(stage_outputs_or_loss, output_grads, *args, **kwargs):
        if output_grads is None and not _tracing():
            _note_loss(stage_outputs_or_loss)
        return orig(stage_outputs_or_loss, output_grads, *args, **kwargs)

    functools.update_wrapper(stage_backward_input, orig)
    _ORIG["stage_backward_input"] = orig
    mod.stage_backward_input = stage_backward_input


def _wrap_stage_backward(mod) -> None:
    """A stage that is not the last back-propagates its outputs with the gradients the next
    stage sent (``stage_backward(outputs, output_grads, ...)``: ``torch.autograd.backward``
    with ``grad_tensors``). An output of one element per micro-batch (a one-feature boundary,
    micro-batches of one sample) was noted as that rank's loss: the first stage "recorded a
    loss" (the sum of its outputs) where the trainer has none. Inside such a call nothing is
    a loss; the last stage's call (``output_grads`` None) is noted as before."""
    orig = getattr(mod, "stage_backward", None)
    if orig is None or "stage_backward" in _ORIG:
        return

    def stage_backward(stage_output, output_grads, *args, **kwargs):
        if output_grads is None:
            return orig(stage_output, output_grads, *args, **kwargs)
        _NOT_LOSS[0] += 1
        try:
            return orig(stage_output, output_grads, *args, **kwargs)
        finally:
            _NOT_LOSS[0] -= 1

    functools.update_wrapper(stage_backward, orig)
    _ORIG["stage_backward"] = orig
    mod.stage_backward = stage_backward
