"""The step clock: which optimizer ``step()`` is a training step, and when a step is written.

The global optimizer step pre-hook of the outermost ``step()`` begins training step k (a sibling
optimizer stepping right after continues it); on step 1 the table is built and the parameters
hashed as step 0. On a recorded step the gradients each optimizer consumes are hashed by a
pre-hook of that optimizer kept last among its own pre-hooks (after a hook that clips or scales
them); rows no optimizer stepped are hashed when the step is written. The post-hook of the
outermost ``step()`` ends step k and writes it. ``opt.step(closure)`` records what the closure
computed. Recorded steps: :func:`sampled`.

:class:`StepClock` is a part of :class:`~parity.capture.session.Session` (a mixin: its state is
initialised in ``Session.__init__``).
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import sys
import time
import weakref

import torch

from parity.capture import loss
from parity.capture.patches import _graph_capture, _tracing
from parity.capture.opt_impl import optimizer_impl
from parity.capture.opt_numbers import group_entries
from parity.capture.rng_state import rng_digests
from parity.capture.table import _Buffer

_GRAD = operator.attrgetter("grad")
GRAPH_CAPTURE_WARNING = ("an optimizer step() ran inside the trainer's own CUDA graph capture "
                         "(torch.cuda.graph): that step and the graph's replays run no Python "
                         "hooks, so no step was recorded from there on (the parameters at exit "
                         "are still recorded)")


def sampled(step: int, every: int) -> bool:
    """Steps recorded as they happen: 0, 1 and every multiple of ``every`` (plus the last, at
    the end of the run)."""
    return step <= 1 or step % every == 0


def _running(outer) -> bool:
    """Whether ``outer``'s ``step()`` is on the calling stack (a container's inner optimizer
    steps inside it): a frame whose ``self`` is ``outer`` (the hook wrapper of its ``step``, a
    container's own ``step``) or a ``--step-on`` wrapper whose stand-in it is. Not any frame
    that holds it (the training loop holds its optimizers). Asked only when a pre-hook finds
    another optimizer's step still open."""
    if outer is None:
        return False
    f = sys._getframe(2)
    while f is not None:
        loc = f.f_locals
        if loc.get("self") is outer or (f.f_code.co_name == "step_on"
                                         and loc.get("stand_in") is outer):
            return True
        f = f.f_back
    return False


def _initialising_step(opt) -> bool:
    """Whether this ``step()`` is the one torch.distributed.checkpoint's ``get_state_dict`` /
    ``set_state_dict`` (``_init_optim_state``) runs to give an optimizer without state its
    state: zero gradients, lr 0, no forward or backward. It is no training step: counted, it
    was step 1 of a job that loads a checkpoint this way (torchtitan's), every later step was
    numbered one too high, step 0 was the parameters before the load, and the load itself read
    as an edit between steps 1 and 2 (round 12b). Only an optimizer without state is asked."""
    if getattr(opt, "state", True):
        return False
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if (f.f_code.co_name == "_init_optim_state" and str(
                f.f_globals.get("__name__", "")).startswith("torch.distributed.checkpoint")):
            return True
        f = f.f_back
    return False


class StepClock:
    """Optimizer step hooks (state in ``Session.__init__``)."""

    # -------------------------------------------------------------------------- step hooks
    def _pre_hook(self, opt, args, kwargs):
        self._opt_pre_calls += 1  # a GradScaler.step that ran no optimizer step: loss.py
        if self.failed or self.stopped or os.getpid() != self.pid:
            return None
        if _initialising_step(opt):
            self._initialising = id(opt)  # its post-hook (the state exists by then) skips too
            return None
        if _graph_capture():  # nothing of capture's may enter the trainer's graph
            self.warn(GRAPH_CAPTURE_WARNING)
            return None
        t0 = time.perf_counter()
        try:
            with self._lock:
                outer = self._outer() if self._outer is not None else None
                if self.depth >= 1 and opt is not outer and not _running(outer):
                    # not nested: the outer step() raised midway (a sibling optimizer that
                    # refused, caught by the trainer), and this one would have been counted
                    # as its inner step, unseen (round 5)
                    self.depth = 0
                    if not self.open and self.done == self.k - 1:
                        self.k -= 1  # it began step k and wrote nothing: no step (below)
                if self.depth >= 1 and opt is outer:
                    self.depth = 0  # the previous step() of this optimizer raised midway
                    if not self.open and self.done == self.k - 1:
                        # it began step k and never ended it (no post-hook, nothing written):
                        # it was no step, and this one takes its number. Counting it shifted
                        # every later step by one against a run that skipped the batch
                        # without calling step() (an exception caught around step(), an OOM
                        # retried): a FAILS on identical updates, and a step "missing"
                        self.k -= 1
                self.depth += 1
                known = self._opt_watch.get(id(opt))
                if id(opt) not in self._optimizers or (known is not None and not known.alive):
                    # (a watched one that was freed: a new optimizer reuses its id, round 7)
                    self._optimizers.add(id(opt))
                    self._opt_state_seen.discard(id(opt))
                    self._top_optimizers.discard(id(opt))
                    self._watch_optimizer(opt)  # its state joins the final state (table.py)
                if self.depth == 1:
                    self._outer = weakref.ref(opt)
                    if id(opt) not in self._top_optimizers:
                        self._top_optimizers.add(id(opt))
                        self._top_optimizer_count += 1
                    continuing = (self.open and self.backwards == 0
                                  and id(opt) not in self.step_opts)
                    if not continuing:
                        self._begin_step()
                    self.step_opts.add(id(opt))
                if not self._table_final:
                    if self.manifests:  # a source whose module was half-imported (FSDP2)
                        self._install_imported_sources()
                    self._add_params(opt)
                else:
                    self._check_params(opt)
                if self.grads and self._step_sampled:
                    self._last_pre_hook(opt)
                if self.depth == 1:
                    wrapped = self._wrap_closure(args, kwargs)
                    if wrapped is not None:
                        self.capture_seconds += time.perf_counter() - t0
                        return wrapped
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0
        return None

    def _last_pre_hook(self, opt) -> None:
        """Put our per-optimizer pre-hook last among ``opt``'s own (registered on first sight,
        moved to the end at each step: a hook the trainer adds later runs before it). The
        global pre-hooks run before any optimizer's own, and ``profile_hook_step`` starts on
        the optimizer's hooks only after them, so the reordering is safe here. Without the
        hook dict (a foreign optimizer class) the gradients are hashed now."""
        hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
        h = self._consumed_handles.get(id(opt))
        if self._after_compiled or not hasattr(hooks, "move_to_end") or not hasattr(opt, "register_step_pre_hook"):
            self._note_consumed(opt)
            return
        if h is None or h.id not in hooks:
            self._consumed_handles[id(opt)] = opt.register_step_pre_hook(self._consumed_hook)
            if self._dynamo_hidden:  # a compiled step must not trace it (hide_from_dynamo)
                self._hide_hooks([self._consumed_handles[id(opt)]])
        else:
            hooks.move_to_end(h.id)

    def _consumed_hook(self, opt, args, kwargs):
        if self.failed or self.stopped or os.getpid() != self.pid or _tracing():
            return None  # inside a trace (a compiled step): hashed when the step is written
        t0 = time.perf_counter()
        try:
            with self._lock:
                if self.grads and self._step_sampled:
                    self._note_consumed(opt)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0
        return None

    def _note_consumed(self, opt) -> None:
        """Hash the gradients of ``opt``'s parameters as its step is about to consume them.
        Its rows are looked up again only when its parameter groups changed (``_opt_sigs``)."""
        sig = self._opt_sigs.get(id(opt))
        cached = self._opt_rows.get(id(opt))
        if cached is not None and sig is not None and cached[0] is sig:
            rows = cached[1]
        else:
            rows = [self._table_ids.get(id(p), -1) for g in opt.param_groups for p in g["params"]]
            rows = [i for i in rows if i >= 0]
            self._opt_rows[id(opt)] = (sig, rows)
        self._note_rows(rows)

    def _note_rows(self, rows) -> None:
        """Queue the digests of the gradients of table ``rows`` (one part of this step's line;
        a later part wins for a row noted twice)."""
        rows = list(rows)
        if not rows:
            return
        table = self.table
        if rows == list(range(len(table))):  # every row, in order: rows 0..n-1 (an int)
            owners, key = table, len(table)
        else:
            owners, key = list(map(table.__getitem__, rows)), rows
        grads = list(map(_GRAD, owners))
        self._grad_rows.update(dict.fromkeys(rows, len(self._grad_parts)))
        self._grad_parts.append((key, self._digest_rows(grads, rows, owners=owners,
                                                        figures=True)))

    def _grad_line(self) -> list:
        """This step's gradient digests (and their figures) in table order, as parts still
        perhaps on the device (writing.py resolves them): as consumed (see _note_consumed), else (a row no optimizer
        stepped) as they are now."""
        if len(self._grad_rows) < len(self.table):
            missing = [i for i in range(len(self.table)) if i not in self._grad_rows]
            self._note_rows(missing)
        return list(self._grad_parts)

    def _wrap_closure(self, args, kwargs):
        """``opt.step(closure)`` (LBFGS and the like) computes the step's loss and gradients
        inside ``step``: the pre-hook saw the previous step's. The closure is wrapped so that
        its first call records them (what this step consumed); its result is untouched."""
        if "closure" in kwargs:
            closure = kwargs["closure"]
        elif len(args) > 1:  # args[0] is the optimizer
            closure = args[1]
        else:
            return None
        if not callable(closure):
            return None
        step = self.k
        first = [True]

        def closure_recorded(*a, **kw):
            out = closure(*a, **kw)
            if first[0]:
                first[0] = False
                self._closure_done(step, out)
            return out

        functools.update_wrapper(closure_recorded, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_recorded}
        return (args[0], closure_recorded, *args[2:]), kwargs

    def _closure_done(self, step: int, out) -> None:
        if self.failed or self.stopped or os.getpid() != self.pid:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if step != self.k:
                    return
                if isinstance(out, torch.Tensor) and out.numel() == 1:
                    self._step_loss = out.detach()
                elif self.loss_ref is not None:
                    self._step_loss = self.loss_ref
                if self.grads and self._step_sampled:  # what this step consumed
                    self._note_rows(range(len(self.table)))
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0

    def _post_hook(self, opt, args, kwargs):
        if self._initialising == id(opt):
            self._initialising = None
            return
        if self.failed or self.stopped or os.getpid() != self.pid or _graph_capture():
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if self.depth == 0:
                    return
                if id(opt) not in self._opt_state_seen:
                    self._note_opt_state(opt)
                self._rewatch_optimizer(opt)  # its state replaced by hand since the last step
                if self.depth == 1 and (self.k == 1 or self._step_sampled):
                    # the numbers this step used (opt_numbers.py); not those of an optimizer
                    # stepped inside another's step() (ZeRO's local one): part of the outer
                    both = group_entries(opt)  # numbers and flags in one pass
                    if both is not None:
                        self._opt_groups.extend(both[0])
                        # its class and flags (opt_impl.py)
                        self._opt_impl.append(optimizer_impl(opt, both[1]))
                self.depth -= 1
                if self.depth == 0:
                    self.done = self.k
                    self.open = True
                    self.backwards = 0
                    for source in self._sources.values():  # manifest sources (sources/registry.py)
                        if source is not None:
                            source.new_step()
                    # the generators' state at this boundary (rng_state.py), where a line is written
                    self._rng = rng_digests() if self.k == 1 or self._step_sampled else None
                    if self.k == 1:
                        self._write_first()
                    elif self._step_sampled:
                        self._write(self.k, self._grad_line() if self.grads else None)
                    self._resolve(before=self._step_base + self.k)  # earlier steps' digests
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0

    def _note_opt_state(self, opt) -> None:
        """Name the per-parameter state ``opt`` keeps (Adam's ``exp_avg``, ``exp_avg_sq``,
        ``step``; SGD's ``momentum_buffer``), once it has some: capture hashes parameters,
        gradients and the loss, not optimizer state, so the verdict line says it was not
        compared (``capture.optimizer_state``). A difference there shows in later steps'
        parameters, never in the last step's. Keys only: no tensor is read."""
        state = getattr(opt, "state", None)
        if not state or not hasattr(state, "values"):
            return  # none yet (SGD without momentum, a step that was skipped): asked again
        self._opt_state_seen.add(id(opt))
        keys: set[str] = set()
        for per_param in itertools.islice(state.values(), 4):
            if isinstance(per_param, dict):
                keys.update(str(k) for k, v in per_param.items() if isinstance(v, torch.Tensor))
        if keys:
            name = type(opt).__name__
            self._opt_state[name] = sorted(set(self._opt_state.get(name, ())) | keys)

    def _begin_step(self) -> None:
        if self.k >= 1 and not self._table_final:
            self._table_final = True
        self.k += 1
        self.open = False
        self.step_opts = set()
        self._opt_groups = []  # every stepping optimizer's group numbers (opt_numbers.py)
        self._opt_impl = []  # and its class and flags (opt_impl.py)
        self._step_sampled = sampled(self.k, self.every)
        self._step_loss = loss.step_loss(self)  # the sum over this step's backward calls
        self._loss_scale = loss.step_scale(self)
        self._grad_rows = {}
        self._grad_parts = []
        self._skipped = None
        # after a compiled call stepped (_compiled_step) the parameters are already updated
        self._entry = None if self._after_compiled else self._entry_hashes()

    def _compiled_step(self, opts, first=None, no_grads: bool = False) -> None:
        """The step a compiled function ran inside it (``opt.step()`` traced: capture's hooks
        are no-ops there; compiled_step.call found ``opts``' parameters changed), noted after
        it returned: each optimizer's pre-hook (its gradients hashed as they are now, no hook
        registered on it: a changed hook dict would recompile the function) and post-hook. No
        entry record (the parameters are the step's result). ``first`` (before
        capture's first step): ``(parameters, Digests)`` taken before the call, hashed as
        step 0 for those parameters (table.py ``_add_params``). ``no_grads``: the call ran a
        backward too (a whole training step compiled, ``zero_grad`` perhaps inside): the
        gradients it consumed are not there to hash, so the step is written without gradients
        (the diff says they were not recorded, never that they differ). Round 15e."""
        self._after_compiled = True
        grads = self.grads
        if no_grads:
            self.grads = False
        try:
            if first is not None:
                ps, d = first
                self._step0_before = ({id(p): i for i, p in enumerate(ps)}, d.result(),
                                      d.figures())
            for opt in opts:
                self._pre_hook(opt, (opt,), {})
            for opt in opts:
                self._post_hook(opt, (opt,), {})
        finally:
            self._after_compiled = False
            self._step0_before = None
            self.grads = grads

    def _skipped_step(self, opt, why: str) -> None:
        """A step whose optimizer step did not run (``GradScaler.step`` found inf/NaN gradients
        and skipped ``opt.step()``: loss.py): recorded as a step all the same, marked
        ``skipped``, so that both runs number their iterations alike and the diff can say which
        side skipped. Parity's own optimizer hooks run around it, as for ``--step-on``."""
        if self.failed or self.stopped or os.getpid() != self.pid or _graph_capture():
            return
        self._pre_hook(opt, (opt,), {})
        self._skipped = why
        self._post_hook(opt, (opt,), {})

    def _entry_hashes(self):
        """The digests of the parameters as this step's optimizer step finds them (queued like
        every digest: hashing.Digests), and the buffer rows left out (NO_HASH: the forward pass
        changes buffers by design); None when the previous step was not recorded or this one is
        not. Compared with the previous step's record when this step is written (writing.py):
        an entry record is written only when the trainer changed the parameters in between (a
        clamp, an EMA update, weights loaded)."""
        if not self._step_sampled or self.written != self.k - 1 or self.k < 2:
            return None
        buffers = [i for i, p in enumerate(self.table) if type(p) is _Buffer]
        rows = self._tensors()
        for i in buffers:
            rows[i] = None
        # a tensor it cannot hash: named, not fatal; the same objects every step: stable
        return self._digest_rows(rows, stable=True), buffers
