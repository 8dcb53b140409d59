"""The capture session inside one rank: its lifecycle and where its manifests come from.

One :class:`Session` per process (the hooks are global). It is started either by injection
(``parity exec``: inject.py calls activation.activate_from_env right after ``import torch``)
or by the API (``parity.capture.start``); both take the same path from there. The session is
assembled from one module per concern: patches.py (process-wide torch patches), table.py (the
parameter table and names), steps.py (the step clock), writing.py (meta.json and step writes);
this module keeps start/stop/fail, the warnings, and one table of manifest sources (the
classes listed in sources/registry.py: FSDP2, compiled graphs, make_fx graphs, DTensor
collectives; the protocol in sources/manifest_source.py) whose bucket records it routes to the
writer.

What happens when (docs/capture.md has the full story):

* global optimizer step pre-hook of the outermost ``step()``: a new training step k begins; on
  the first one the parameter table is built (the parameters of every optimizer that steps
  within it, named from the model) and the parameters are hashed as step 0; on a recorded step
  the gradients it is about to consume are hashed.
* global optimizer step post-hook, when the outermost ``step()`` returns: the parameters are
  hashed and step k is written (with its gradients and the last loss).
* ``Tensor.backward`` / ``torch.autograd.backward``: remember the last scalar (the loss).
* FSDP2 collectives (fsdp2.py) and compiled graphs (graph.py, if present): bucket layouts.

Everything fails soft: an exception inside capture prints ``parity: capture disabled: <reason>``
once, removes the hooks and lets training go on.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import sys
import threading
import time
import traceback
import weakref

import torch

from parity.artifacts import RankWriter
from parity.capture import fingerprint, loss, nccl_emulation, patches, post_import, table
from parity.capture.env import one_line as _one_line
from parity.capture.env import say as _say
from parity.capture.hashing import HASHERS
from parity.capture.sources.manifest_source import ON_COMPILE, GraphRecord, ManifestSource, SourceHooks
from parity.capture.names import normalize_fqn
from parity.capture.steps import StepClock
from parity.capture.table import ParamTable
from parity.capture.writing import RankRecord
from parity.errors import ParityError
from parity.records import BucketRecord
from parity.rundir import rank_dir

__all__ = ["Session", "current"]


_ACTIVE: "Session | None" = None
_LOCK = threading.RLock()
# The reason capture's hooks are ``disable``d with: dynamo would say it where it traced one, which
# since round 15e it does not (a trace sees a no-op: compiled_step.traceable).
_HIDDEN_REASON = ("parity capture's optimizer step hook (parity exec) runs eagerly; a trace "
                  "sees it as a no-op (docs/reliability.md, round 15e)")


def current() -> "Session | None":
    """The session capturing in this process, if any."""
    return _ACTIVE


# ------------------------------------------------------------------------------------ session
class Session(RankRecord, StepClock, ParamTable):
    """Capture in this process, writing ``out_dir/rank-NNNNN/`` (docs/artifacts.md)."""

    def __init__(self, out_dir, *, every: int = 1, grads: bool = True, manifests: bool = True,
                 hasher: str = "auto", rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None, lazy: bool = False, source: str = "api"):
        if not isinstance(every, int) or every < 1:
            raise ParityError(f"capture: every must be an integer >= 1, got {every!r}")
        if hasher not in HASHERS:
            raise ParityError(f"capture: hasher must be one of {', '.join(HASHERS)}, "
                              f"got {hasher!r}")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.every = every
        self.grads = bool(grads)
        self.manifests = bool(manifests)
        self.hasher = hasher
        self._rank_arg = (rank, world_size, local_rank)
        self.lazy = lazy
        self.source = source
        self.pid = os.getpid()

        self.writer: RankWriter | None = None
        self._claim_refused: str | None = None  # another process holds this rank (claims.py)
        self.failed: str | None = None
        self.error: str | None = None
        self.started = False
        self.stopped = False
        self.warnings: list[str] = []
        self._pending_buckets: list[dict] = []
        self._handles: list = []
        # manifest sources tried so far, by name (sources/registry.py); None: tried, not installed
        self._sources: dict[str, ManifestSource | None] = {}
        self._triggers: list[tuple[str, object]] = []  # (module, our post-import callback)
        self._manifest_sources: list[str] = []  # the ``source`` of those recording (meta.json)
        self._lock = threading.RLock()

        # step state
        self.k = 0  # number of the step in progress or last finished
        self.done = 0  # last finished step
        self.depth = 0
        self._outer = None  # weakref to the optimizer at depth 1
        self.open = False  # the finished step k may still be continued by a sibling optimizer
        self.step_opts: set[int] = set()
        self.backwards = 0  # backward calls since the last finished step
        self.loss_ref = None
        self._step_loss = None
        self._step_sampled = True
        self._grad_rows: dict[int, int] = {}  # table row -> its part in _grad_parts
        self._grad_parts: list = []  # (rows or n: all, hashing.Digests with figures) of this step's grads
        self._opt_rows: dict[int, tuple] = {}  # id(optimizer) -> (its _opt_sigs entry, rows)
        self._inflight: collections.deque = collections.deque()  # written steps not yet resolved
        # the last parameter record written (its hashes, (offset, roll-up), step): what the
        # next step's entry (steps.py) and the final state (writing.py) are compared with
        self._last_params: bytes | None = None
        self._last_param_ref: tuple[int, str] | None = None
        self._last_param_step = -1
        self._prev_params: tuple = (None, -1)  # the record of the step before that one
        self._entry = None  # this step's entry digests (hashing.Digests), compared when written
        self._loss_scale = None  # the scale of this step's loss (GradScaler), a tensor
        self._opt_groups = []  # the optimizers' group numbers this step (opt_numbers.py)
        self._opt_impl = []  # their classes and flags this step (opt_impl.py)
        self._rng = None  # the generators' digests after this step (rng_state.py), or None
        self._skipped: str | None = None  # why this step's optimizer step did not run
        self._opt_pre_calls = 0  # optimizer pre-hooks seen (a GradScaler.step that ran none)
        self._after_compiled = False  # noting a compiled function's step (steps.py)
        self._step0_before = None  # step 0's digests taken before that call (table.py)
        self._initialising: int | None = None  # id of the optimizer in a DCP state-init step()
        self._consumed_handles: dict[int, object] = {}  # id(optimizer) -> our last pre-hook
        self._dynamo_hidden = False  # the optimizer hooks wrapped in torch._dynamo.disable
        self.written = -1  # last step written
        # parameter table
        self.table: list = []
        self._table_ids: dict[int, int] = {}
        self.entries: list[dict] = []
        self._table_final = False
        self._table_dirty = False
        self._p0: list[tuple[bytes, bytes]] = []  # step 0: (digests, figures) per group
        self._buffer_keys: set[tuple[int, str]] = set()  # (id(module), name) of buffer rows
        self._trees_dirty = True  # a module tree joined: sync its tensors (table.py)
        self._registration_handles: list = []
        self._name_roots: list = []  # the module trees of the process (table.py, trees.py)
        self._row_homes: dict[int, tuple] = {}  # param row -> (its root, raw name): writing.py
        self._roots_scan = None  # (key, live root modules): one gc scan per step at most
        self._roots_fresh = False  # the next _gc_roots scans whatever the key (periodic scan)
        self._trees_scanned: int | None = None  # the step of the last search for new trees
        self._scan_seconds = 0.0  # time spent in those searches (table.SCAN_BUDGET)
        self._gc_scan_cost: float | None = None  # the last gc scan's seconds
        self._scan_clock = time.perf_counter()
        self._skipped_trees = weakref.WeakSet()  # trees of fake / meta / subclass tensors
        self._trees_skipped: list[dict] = []  # their meta.json ``capture.skipped`` entries
        self._unhashed: dict[str, str] = {}  # fqn -> why it is not hashed (capture.unhashed)
        # non-persistent buffers of the trees (not hashed by design: capture.non_persistent_buffers)
        self._non_persistent: dict[str, None] = {}
        self._fqn_roots: dict[str, object] = {}  # name -> the root module that holds it
        self._unnamed: dict[str, int] = {}  # "dtype[shape]" -> unnamed rows of it so far
        self._root_labels: dict[int, str] = {}  # id(root) -> prefix for its colliding names
        self._labels_said: set[str] = set()
        self._optimizers: set[int] = set()  # ids of the optimizers that stepped
        # the exec summary's count: optimizers whose step() ran at the top (ZeRO's wrapped
        # local optimizer steps inside its own: not another one), a new one counted even when
        # it reuses a freed one's id
        self._top_optimizers: set[int] = set()
        self._top_optimizer_count = 0
        # the same, in the order they first stepped: id -> weakref.finalize that hashes its
        # state when it is freed before capture stops (table._state_rows, opt_state.py)
        self._opt_watch: dict[int, weakref.finalize] = {}
        # freed optimizers' (entries, Digests), or their state read at stop, in the order freed
        # (a list, not keyed by id: a later optimizer may reuse a freed one's id, round 7)
        self._opt_freed: list = []
        self._opt_unwatched: list[str] = []  # optimizer classes whose state is not hashed
        self._opt_state_final = False  # their state was hashed in the final state
        # optimizer class -> its per-parameter state's tensor keys (capture.optimizer_state):
        # not hashed, named on the verdict line; optimizers whose state was read
        self._opt_state: dict[str, list[str]] = {}
        self._opt_state_seen: set[int] = set()
        self._opt_sigs: dict[int, tuple] = {}  # id(optimizer) -> param_groups signature
        self._step_base = 0  # steps recorded by earlier torchelastic attempts of this rank
        self._resolved_hasher: str | None = None
        # overhead accounting
        self.capture_seconds = 0.0
        self.recorded_steps = 0

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> "Session":
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None and _ACTIVE is not self:
                raise ParityError("capture: a session is already active in this process "
                                  f"(writing {_ACTIVE.out_dir})")
            if self.started:
                return self
            patches.install(current)
            # a GradScaler's loss is recorded unscaled, its scale apart
            loss.install_scaler_hooks(current, patches._tracing)
            fingerprint.install_compile_hook()  # each compiled region's inductor options
            self.started = True
            _ACTIVE = self
        try:
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)

            self._handles.append(register_optimizer_step_pre_hook(self._pre_hook))
            self._handles.append(register_optimizer_step_post_hook(self._post_hook))
            if "torch._dynamo" in sys.modules:  # the API, started after a compile
                self.hide_from_dynamo()
            # No module hook: a global forward pre-hook is seen by every tracer (dynamo export
            # cannot trace Module._call_impl's hook path; a compiled model recompiles once it
            # is gone). The model trees come from a gc scan instead (table.py, trees.py).
            # parity exec starts the session as torch finishes importing: no module of the job
            # exists yet, so the hooks see every one (the trees without a gc scan)
            self._registration_handles = table.install_registration_hooks(
                track=self.source == "exec")
            if self.manifests:
                from parity.capture.sources import registry as sources

                for cls in sources.SOURCES:  # ON_COMPILE ones: patches.py, at torch.compile
                    if cls.trigger != ON_COMPILE:
                        callback = functools.partial(self._install_source, cls.name)
                        self._triggers.append((cls.trigger, callback))
                        post_import.when_imported(cls.trigger, callback)
            if not self.lazy:
                self._ensure_writer()
            atexit.register(self._atexit)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return self

    def hide_from_dynamo(self) -> None:
        """Wrap capture's optimizer hooks in ``torch._dynamo.disable`` (once, at the first
        ``torch.compile``: dynamo is imported by then; patches.py). A trainer that compiles
        its optimizer step (``torch.compile(opt.step)`` or a function calling it) has dynamo
        trace ``Optimizer.step``'s hook loop: it inlined capture's hooks, broke the graph
        inside them, and the step ran other code than without parity (a compiled Adam step
        under ``parity exec`` gave the eager step's values at step 1 and other values after:
        capture changed the run it recorded; round 5). Disabled, they run eagerly at a clean
        graph break before and after the step, and the step compiles as it does alone. Since
        round 15e a trace sees them as no-ops (compiled_step.traceable): a compiled function
        that calls ``opt.step()`` compiles as without parity, its step noted after it returns."""
        if self._dynamo_hidden:
            return
        self._dynamo_hidden = True
        patches.hide_from_dynamo()
        self._hide_hooks([*self._handles, *self._consumed_handles.values()])

    @staticmethod
    def _hide_hooks(handles) -> None:
        """Replace each hook of ``handles`` in its hook dict by ``torch._dynamo.disable`` of it,
        traced as a no-op (compiled_step.traceable; once: a wrapped hook is left as it is)."""
        from parity.capture import compiled_step

        for h in handles:
            table = h.hooks_dict_ref() if hasattr(h, "hooks_dict_ref") else None
            fn = table.get(h.id) if table is not None else None
            if fn is not None and not getattr(fn, compiled_step.HIDDEN, False):
                table[h.id] = compiled_step.traceable(fn, _HIDDEN_REASON)

    def stop(self, status: str | None = None, error: str | None = None) -> None:
        """Write what is pending, close the files and remove every hook. Idempotent."""
        global _ACTIVE
        with self._lock:
            if self.stopped:
                return
            if not self.failed:
                try:
                    self.flush_final()
                    self.write_final_state()  # after the trainer's last edit
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
            self.stopped = True
            self._uninstall()
            try:
                atexit.unregister(self._atexit)
            except Exception:  # noqa: BLE001
                pass
            if error is None:
                error = self.error
            if status is None:
                status = "error" if error else "ok"
            if self.writer is not None:
                try:
                    self.writer.meta["capture"] = self._capture_meta()
                    if "numerics" in self.writer.meta:  # regions compiled after step 1
                        self.writer.meta["numerics"] = fingerprint.refresh(
                            self.writer.meta["numerics"])
                    nccl_emulation.record_in(self.writer.meta)
                    self.writer.close(status=status, error=error)
                except Exception as e:  # noqa: BLE001
                    _say(f"capture: cannot finish {rank_dir(self.out_dir, self.rank)}: "
                         f"{_one_line(e)}")
        with _LOCK:
            if _ACTIVE is self:
                _ACTIVE = None

    def _atexit(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherited the registration
            return
        self.stop()

    def _uninstall(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        for h in self._consumed_handles.values():
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._consumed_handles.clear()
        table.uninstall_registration_hooks(self._registration_handles)
        self._registration_handles = []
        for source in self._sources.values():  # kept: its seconds still count (meta.json)
            if source is not None:
                try:
                    source.uninstall()
                except Exception:  # noqa: BLE001
                    pass
        for module, callback in self._triggers:
            post_import.cancel(module, callback)
        self._triggers = []

    def _fail(self, e: BaseException) -> None:
        """Capture broke: say so once, unhook, keep training."""
        if self.failed:
            return
        self.failed = _one_line(e)
        _say(f"capture disabled: {self.failed}")
        if os.environ.get("PARITY_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
            traceback.print_exception(type(e), e, e.__traceback__)
        self._uninstall()
        if self.writer is None and self.k >= 1 and not self._claim_refused:
            try:  # a lazy rank that failed at its first step: its meta.json keeps the reason
                self._ensure_writer()
            except Exception:  # noqa: BLE001
                pass
        if self.writer is not None:
            try:
                self.writer.update_meta(capture=self._capture_meta())
            except Exception:  # noqa: BLE001
                pass

    def warn(self, msg: str, *, echo: bool = True) -> None:
        """A warning recorded in meta.json (``capture.warnings``) and printed once."""
        if msg in self.warnings:
            return
        self.warnings.append(msg)
        if echo:
            _say(msg)
        if self.writer is not None:
            try:
                self.writer.update_meta(capture=self._capture_meta())
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    # ------------------------------------------------------------------------- manifests
    def _install_source(self, name: str, _module=None) -> None:
        """Install the manifest source ``name`` (sources/registry.py): its trigger fired. At most
        once per session; a reason it cannot is one warning (sources/manifest_source.py, [Note:
        when a source installs])."""
        if name in self._sources or self.failed or self.stopped:
            return
        from parity.capture.sources import registry as sources

        cls = sources.BY_NAME[name]
        source = cls(self._source_hooks(cls.source))
        if not source.ready():
            return  # half-imported: torch.compile or the first optimizer step asks again
        self._sources[name] = None
        try:
            reason, echo = source.install(), cls.echo
        except Exception as e:  # noqa: BLE001
            reason, echo = f"{name}.install failed ({_one_line(e)})", True
        if reason:
            self._manifest_warn(cls.source)(f"{cls.unavailable}: {reason}", echo=echo)
            return
        self._sources[name] = source
        self._source_on(cls.source)

    def _install_sources(self, trigger: str) -> None:
        """Every source ``trigger`` installs (patches.py: ON_COMPILE at torch.compile)."""
        from parity.capture.sources import registry as sources

        for cls in sources.SOURCES:
            if cls.trigger == trigger:
                self._install_source(cls.name)

    def _install_imported_sources(self) -> None:
        """Ask again the sources whose trigger module is imported by now (one whose post-import
        callback found it half-imported): at ``torch.compile`` and at each step's first
        optimizer step (patches.py, steps.py)."""
        from parity.capture.sources import registry as sources

        for cls in sources.SOURCES:
            if cls.trigger != ON_COMPILE and cls.trigger in sys.modules:
                self._install_source(cls.name)

    def _source_hooks(self, source: str) -> SourceHooks:
        return SourceHooks(emit=self._emit_bucket, on_graph=self._on_graph,
                           on_loss=self._note_traced_loss, done=lambda: self.done,
                           warn=self.warn, lost=self._manifest_warn(source), fail=self._fail)

    def _source_on(self, source: str) -> None:
        if source not in self._manifest_sources:
            self._manifest_sources.append(source)
            if self.writer is not None:
                self.writer.update_meta(capture=self._capture_meta())

    def _manifest_warn(self, source: str):
        def warn(msg: str, echo: bool = True) -> None:
            if source in self._manifest_sources:
                self._manifest_sources.remove(source)
            self.warn(msg, echo=echo)
        return warn

    def _note_traced_loss(self, t) -> None:
        """The loss a traced step returned (its backward ran inside the graph)."""
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            self.backwards += 1
            from parity.capture import loss

            loss.note(self, t)

    def _on_graph(self, record: GraphRecord) -> None:
        if self.failed or self.stopped:
            return
        try:
            with self._lock:
                for w in record.warnings:
                    self.warn(f"graph {record.graph_id}: {w}")
                for b in record.buckets:
                    b.step = self.done + 1
                    for e in b.entries:
                        if isinstance(e.fqn, str):
                            e.fqn = normalize_fqn(e.fqn)
                    self._emit_bucket(b)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _emit_bucket(self, bucket: BucketRecord | dict) -> None:
        if os.getpid() != self.pid:  # a forked child (data-loader worker) inherited the hooks
            return
        if isinstance(bucket, BucketRecord):
            bucket = bucket.to_dict()
        with self._lock:
            if self.writer is None:
                if self.lazy:
                    self._pending_buckets.append(bucket)
                    return
                self._ensure_writer()
            self.writer.write_bucket(bucket)
