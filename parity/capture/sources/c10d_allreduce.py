"""Plain c10d all-reduces outside graphs: HSDP's replicate all-reduce and hand-written ones.

Why: on a cluster an all-reduce sums each chunk of its buffer along a ring, and which ring sums
an element depends on where the element lies in the buffer, exactly as for a reduce-scatter
bucket (docs/reduction-order.md). Three kinds of all-reduce reach no other manifest source:
FSDP2's HSDP all-reduce of each reduce-scatter output over the replicate group (``dist.all_reduce``
in ``foreach_reduce``), and a trainer's own all-reduces of a replicated side module's gradients,
one per gradient or one flat buffer (``torch.cat`` of the gradients). Recording their layouts
lets ``parity diff`` compare them and ``--at`` predict them.

Hook point: ``torch.distributed.all_reduce`` and ``all_reduce_coalesced`` as bound in
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (FSDP2 and trainers call
``dist.all_reduce``). A call inside a trace passes through (graph.py reads graphs). Each call
outside one becomes a bucket line with ``"source": "c10d"``, collective ``all_reduce`` and these
payloads (entries), found without running any collective:

- called from FSDP2's ``foreach_reduce``: the reduce-scatter output it all-reduces, i.e. the
  parameter group's shards in payload order (``fsdp_params`` and ``padded_unsharded_sizes`` of
  that frame), ``module: "fsdp2 replicate"``;
- a parameter's gradient (matched by storage among the model's parameters of that shape): one
  entry;
- any other buffer: the gradients it was concatenated from, found by comparing its values with
  the model's gradients in order (``torch.equal`` of each slice; on CUDA one comparison per
  gradient tried). A slice no gradient equals is an entry without a name. Matched once per call
  site, size and dtype; later calls of the same signature reuse the layout.

DDP's buckets are all-reduced by its C++ Reducer, where no Python hook sees them; their layout is
read after each optimizer step from DDP itself, per backward pass that synced: the initial
buckets (``bucket_sizes`` of ``_get_ddp_logging_data()``, filled from the first parameter on and
reversed, as ``_ddp_init_helper`` assigns them) until DDP's ``_pre_forward`` rebuilds them in
gradient-ready order (``_has_rebuilt_buckets``, read before each syncing backward), then the
rebuilt ones (``rebuilt_per_bucket_param_indices``; in the step of the rebuild, which the
logging data shows a step late, read once from the Reducer: ``_ddp_plans``). One bucket line
each with ``group: "ddp"``, in the order the buckets are
all-reduced. A bucket holding a sparse gradient (``nn.Embedding(sparse=True)``) says
so (``sparse``); reading these needs no collective.

Extra fields (kept by the reader): ``op`` (``sum``/``avg``/...), ``ranks`` (the group's global
ranks when it is not the whole world), ``coalesced`` (an ``all_reduce_coalesced`` call: one
collective per entry, in one NCCL group). ``module`` is the calling function (``file:function``)
or ``fsdp2 replicate``. A step's sequence is written when first seen and again when it changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from parity.capture.names import normalize_fqn
from parity.capture import patches
from parity.capture.patches import _tracing
from parity.capture.sources.fsdp2 import param_fqn
from parity.capture.sources import manifest_source
from parity.capture.sources.manifest_source import ManifestSource, SourceHooks, sub_group_ranks
from parity.capture.table import _module_roots, registered_ddp
from parity.records import (SOURCE_C10D, BucketEntry, BucketRecord, dtype_name, ends_record,
                            reduce_op_name)

__all__ = ["C10dAllReduces"]

MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
_FNS = ("all_reduce", "all_reduce_coalesced")
_FSDP_COLLECTIVES = "_fsdp_collectives.py"
MAX_MATCH = 4096  # gradients compared against one flat buffer at most


def _caller(depth: int) -> tuple[Any, str]:
    """The first frame outside torch.distributed's c10d module and this one: (frame, label)."""
    frame = sys._getframe(depth)
    while frame is not None and (frame.f_code.co_filename.endswith("distributed_c10d.py")
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_name == "wrapper"):
        frame = frame.f_back
    if frame is None:
        return None, ""
    return frame, f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def _is_foreach_reduce(frame: Any) -> bool:
    return frame.f_code.co_name == "foreach_reduce" and \
        frame.f_code.co_filename.endswith(_FSDP_COLLECTIVES)


def _hook_caller(frame: Any, tensor: Any, depth: int = 4) -> Any:
    """FSDP2's ``foreach_reduce`` frame when ``tensor`` is its ``reduce_output`` handed to the
    job's all-reduce hook (``set_all_reduce_hook``: the hook, or a function it calls, issues
    this all-reduce), else None. Why: the payload is the reduce-scatter's output, laid out as
    FSDP2's HSDP all-reduce is; without this its entry had no name (round 11a)."""
    f = frame.f_back
    for _ in range(depth):
        if f is None:
            return None
        if _is_foreach_reduce(f):
            return f if f.f_locals.get("reduce_output") is tensor else None
        f = f.f_back
    return None


class C10dAllReduces(ManifestSource):
    """Wraps ``all_reduce`` / ``all_reduce_coalesced`` and hands records to ``hooks.emit``."""

    name = "c10d"
    source = SOURCE_C10D
    trigger = "torch.distributed.distributed_c10d"
    unavailable = "c10d all-reduce manifests unavailable"

    def __init__(self, hooks: SourceHooks):
        super().__init__(hooks)
        self.emit = hooks.emit
        self.step = hooks.done
        self.fail = hooks.fail
        self.patches: list[tuple[Any, str, Any]] = []
        self.current: list[BucketRecord] = []
        self.last_signature: tuple | None = None
        self.layouts: dict[tuple, list[BucketEntry]] = {}  # flat buffers matched: call site...
        self._by_shape: dict[tuple, list[tuple[str, Any]]] | None = None
        self.rebuilds = 3  # the parameter map is rebuilt (a gc scan) at most this often
        self._ddps: list | None = None  # weak references to the job's DDP modules
        self._ddp_scans = 3  # gc scans for them while none is found
        self._ddp_sig: tuple | None = None  # the DDP buckets last written, and their step
        self._ddp_step: int | None = None
        self._ddp_rebuilt = False
        self._ddp_live = False  # each pass's buckets known as it ran (no stamping a step late)
        self._ddp_passes: dict[int, list] = {}  # id(DDP) -> per syncing pass: rebuilt yet?
        self._ddp_read: dict[int, list] = {}  # id(DDP) -> its rebuilt buckets, read once
        self._ddp_counts: tuple | None = None  # the syncing passes per DDP last written
        self._ddp_syncs: dict[int, int] = {}  # id(DDP) -> backward passes that synced, this step
        self._ddp_backward: set[int] = set()  # id(DDP) of those that saw a backward this step
        self.busy = False

    def ready(self) -> bool:
        mod = sys.modules.get("torch.distributed")
        return mod is not None and callable(getattr(mod, "all_reduce", None))

    # ---------------------------------------------------------------------------- install
    def install(self) -> str | None:
        for name in MODULES:
            mod = sys.modules.get(name)
            for fn_name in _FNS:
                fn = getattr(mod, fn_name, None) if mod is not None else None
                if fn is None or hasattr(fn, "_parity_original"):
                    continue
                self.patches.append((mod, fn_name, fn))
                setattr(mod, fn_name, self._wrap(fn, fn_name == "all_reduce_coalesced"))
        if not any(attr == "all_reduce" for _, attr, _ in self.patches):
            return "torch.distributed.all_reduce not found in this torch version"
        patches.ON_BACKWARD.append(self._count_ddp_syncs)
        return None

    def uninstall(self) -> None:
        if self._count_ddp_syncs in patches.ON_BACKWARD:
            patches.ON_BACKWARD.remove(self._count_ddp_syncs)
        for mod, attr, fn in reversed(self.patches):
            if getattr(getattr(mod, attr, None), "_parity_original", None) is fn:
                setattr(mod, attr, fn)
        self.patches = []

    def _wrap(self, original: Callable, coalesced: bool) -> Callable:
        import inspect

        rec = self
        sig = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if not rec.busy and not rec.tracing():
                try:
                    rec.busy = True
                    a = sig.bind(*args, **kwargs).arguments
                    rec.record(a.get("tensors", a.get("tensor")), a.get("op"), a.get("group"),
                               coalesced)
                except Exception:  # noqa: BLE001 - never in the way of the job
                    pass
                finally:
                    rec.busy = False
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper._parity_original = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        wrapper.__name__ = original.__name__
        return wrapper

    @staticmethod
    def tracing() -> bool:
        return _tracing()

    # ---------------------------------------------------------------------------- records
    def _params(self) -> dict[tuple, list[tuple[str, Any]]]:
        """(shape, dtype) -> [(fqn, parameter)], built once (the model is built by the first
        all-reduce of gradients)."""
        if self._by_shape is None:
            out: dict[tuple, list[tuple[str, Any]]] = {}
            seen: set[int] = set()
            for root in _module_roots():
                for n, p in root.named_parameters():
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    out.setdefault((tuple(p.shape), p.dtype), []).append((normalize_fqn(n), p))
            self._by_shape = out
        return self._by_shape

    def _grad_of(self, t: Any) -> str | None:
        """The parameter whose gradient ``t`` is (same storage), else None."""
        ptr = t.data_ptr()
        for fqn, p in self._params().get((tuple(t.shape), t.dtype), ()):
            g = p.grad
            if g is not None and g.data_ptr() == ptr:
                return fqn
        return None

    def _match_flat(self, t: Any) -> list[BucketEntry]:
        """The gradients a flat buffer was concatenated from, in buffer order, by value: at each
        offset, the gradients whose first element equals the buffer's there are compared whole
        (``torch.equal``); the first equal one is the payload."""
        import torch

        flat = t.reshape(-1)
        n_total = flat.numel()
        esize = t.element_size()
        dtype = dtype_name(t.dtype)
        grads = [(f, p.grad.reshape(-1), list(p.grad.shape)) for ps in self._params().values() for f, p in ps
                 if p.grad is not None and p.grad.layout == torch.strided
                 and type(p.grad) is torch.Tensor and p.grad.numel()
                 and p.grad.device == flat.device][:MAX_MATCH]
        entries: list[BucketEntry] = []
        if grads:
            firsts = torch.stack([g[0].to(flat.dtype) for _, g, _ in grads])
            sizes = [g.numel() for _, g, _ in grads]
        used: set[int] = set()
        off = 0
        while off < n_total:
            found = None
            if grads:
                for i in (firsts == flat[off]).nonzero().flatten().tolist():
                    n = sizes[i]
                    if i in used or off + n > n_total:
                        continue
                    if torch.equal(flat[off:off + n], grads[i][1].to(flat.dtype)):
                        found = i
                        break
            if found is None:  # the rest: one payload without a name
                entries.append(BucketEntry(None, off * esize, (n_total - off) * esize,
                                           n_total - off, dtype, [n_total - off]))
                break
            used.add(found)
            f, g, shape = grads[found]
            entries.append(BucketEntry(f, off * esize, g.numel() * esize, g.numel(), dtype,
                                       shape))
            off += g.numel()
        return entries

    @staticmethod
    def _fsdp2_entries(frame: Any, dtype: str, esize: int) -> list[BucketEntry] | None:
        """FSDP2's HSDP all-reduce: the reduce-scatter output of ``foreach_reduce``'s frame."""
        loc = frame.f_locals
        params, sizes = loc.get("fsdp_params"), loc.get("padded_unsharded_sizes")
        world = loc.get("world_size") or 1
        if not params or not sizes or len(params) != len(sizes):
            return None
        entries, off = [], 0
        for i, (fp, size) in enumerate(zip(params, sizes)):
            numel = size.numel() // world
            fqn = param_fqn(fp)  # FSDP2's name, else its owner module's (fsdp2.py)
            entries.append(BucketEntry(normalize_fqn(fqn) if fqn else f"<fsdp param {i}>",
                                       off * esize, numel * esize, numel, dtype,
                                       list(getattr(fp, "sharded_size", ()) or ())))
            off += numel
        return entries

    def record(self, tensor: Any, op: Any, group: Any, coalesced: bool) -> None:
        import torch
        import torch.distributed as dist

        tensors = list(tensor) if coalesced else [tensor]
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            return
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        size = group.size()
        ranks = sub_group_ranks(group)
        frame, label = _caller(3)
        t0 = tensors[0]
        dtype, esize = dtype_name(t0.dtype), t0.element_size()
        entries: list[BucketEntry] | None = None
        module = label
        if frame is not None and _is_foreach_reduce(frame) and not coalesced:
            entries, module = self._fsdp2_entries(frame, dtype, esize), "fsdp2 replicate"
        elif frame is not None and not coalesced:
            hooked = _hook_caller(frame, t0)
            if hooked is not None:  # FSDP2's all-reduce hook reducing the reduce-scatter output
                entries, module = self._fsdp2_entries(hooked, dtype, esize), "fsdp2 hook"
        if entries is None:
            entries, off = [], 0
            for t in tensors:
                if t.layout != torch.strided:
                    entries.append(BucketEntry(None, off * esize, None, t.numel(), dtype,
                                               list(t.shape)))
                    continue
                fqn = self._grad_of(t)
                if fqn is not None:
                    entries.append(BucketEntry(fqn, off * esize, t.numel() * esize, t.numel(),
                                               dtype, list(t.shape)))
                else:
                    key = (label, tuple(t.shape), dtype, size)
                    got = self.layouts.get(key)
                    if got is None:
                        got = self.layouts[key] = self._match_flat(t)
                    entries.extend(BucketEntry(e.fqn, off * esize + e.offset, e.size, e.numel,
                                               e.dtype, e.shape) for e in got)
                if not coalesced:
                    break
                off += t.numel()
        total = sum(e.size or 0 for e in entries)
        # the caller goes in ``group`` (no ``module``: it is a call site, not an nn.Module)
        rec = BucketRecord(SOURCE_C10D, "all_reduce", len(self.current), entries,
                           group=module, dtype=dtype, world_size=size, total_bytes=total)
        rec.extra["op"] = reduce_op_name(op if op is not None else dist.ReduceOp.SUM)
        if ranks:
            rec.extra["ranks"] = ranks
        if coalesced:
            rec.extra["coalesced"] = True
        self.current.append(rec)
        manifest_source.EAGER_ALL_REDUCES[0] = len(self.current)  # eager_funcol.py's ``after``

    def _ddp_modules(self) -> list:
        """The job's DistributedDataParallel modules: those the registration hooks saw register
        their module (table.registered_ddp); without the hooks, a gc scan, at most a few times
        while none exists (once found, weak references)."""
        import weakref

        mod = sys.modules.get("torch.nn.parallel.distributed")
        if mod is None:
            return []
        registered = registered_ddp()  # the registration hooks saw each one being built
        if registered is not None:
            return [d for d in registered if isinstance(d, mod.DistributedDataParallel)]
        if self._ddps is None or (not self._ddps and self._ddp_scans):
            self._ddp_scans -= 1
            found = [r for r in _module_roots() if isinstance(r, mod.DistributedDataParallel)]
            self._ddps = [weakref.ref(r) for r in found]
        return [d for d in (r() for r in self._ddps) if d is not None]

    def _count_ddp_syncs(self) -> None:
        """Before each outermost ``backward()``: count it for each DDP whose last forward
        prepared its reducer for a backward (``_post_forward`` sets ``require_forward_param_sync``
        True exactly then; under ``no_sync()`` False). DDP's buckets are read from its logging
        data once a step, which says nothing of how many backward passes all-reduced them:
        ``no_sync()`` for all micro-batches but the last against syncing at each one (equal
        values at one rank) read "bucket layouts identical", a HOLD under ``--fail-on any``,
        where FSDP2's same pair fails "a gradient reduced by a different number of
        collectives" (round 8a). The buckets are now written once per syncing pass; a DDP that
        saw backward passes this step and synced at none all-reduced nothing (``_ddp_records``)."""
        for ddp in self._ddp_modules():
            self._ddp_backward.add(id(ddp))
            if getattr(ddp, "require_forward_param_sync", False):
                self._ddp_syncs[id(ddp)] = self._ddp_syncs.get(id(ddp), 0) + 1
                # which buckets this pass all-reduces: DDP rebuilds them once, in the forward
                # whose ``_pre_forward`` sets ``_has_rebuilt_buckets`` (with micro-batches,
                # between the passes of one step: round 9a); an attribute read, nothing more
                self._ddp_passes.setdefault(id(ddp), []).append(
                    getattr(ddp, "_has_rebuilt_buckets", None))

    def _ddp_records(self) -> list[BucketRecord]:
        """One all-reduce bucket line per DDP bucket, in the order DDP all-reduces them; the
        whole plan again for each further backward pass of the step that synced
        (``_count_ddp_syncs``; once where none was seen: a backward capture does not see)."""
        import torch

        out: list[BucketRecord] = []
        for ddp in self._ddp_modules():
            if getattr(ddp, "_use_python_reducer", False):
                # torch._dynamo.config.optimize_ddp = "python_reducer" (compiled autograd):
                # DDP's per-parameter hooks all-reduce each gradient (in the compiled autograd
                # graph: graph.py records those), its C++ Reducer's buckets never run. Read,
                # they stood for what ran: "bucket layouts identical" against C++ DDP's one
                # bucket, under --fail-on any too (round 8b).
                continue
            if id(ddp) in self._ddp_backward and id(ddp) not in self._ddp_syncs:
                continue  # every backward of the step under no_sync(): nothing all-reduced
            try:
                info = ddp._get_ddp_logging_data()
            except Exception:  # noqa: BLE001 - an older DDP: nothing to read
                continue
            ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
            params = [(normalize_fqn(n), p) for n, p in ddp.module.named_parameters()
                      if p.requires_grad and n not in ignore]
            sparse = {id(p) for m in ddp.module.modules()
                      if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                      and getattr(m, "sparse", False) for p in m.parameters(recurse=False)}
            passes = max(1, self._ddp_syncs.get(id(ddp), 1))
            plans = self._ddp_plans(ddp, info, params, passes)
            if plans is None:
                continue
            pg = getattr(ddp, "process_group", None)
            size = pg.size() if pg else 1
            ranks = sub_group_ranks(pg)
            for idx in (b for plan in plans for b in plan):
                entries, off = [], 0
                for i in idx:
                    fqn, p = params[i]
                    es = p.element_size()
                    entries.append(BucketEntry(fqn, off, p.numel() * es, p.numel(),
                                               dtype_name(p.dtype), list(p.shape)))
                    off += p.numel() * es
                dtypes = {e.dtype for e in entries}
                rec = BucketRecord(SOURCE_C10D, "all_reduce", len(out), entries, group="ddp",
                                   dtype=dtypes.pop() if len(dtypes) == 1 else "",
                                   world_size=size, total_bytes=off)
                rec.extra["op"] = "sum"
                if ranks:
                    rec.extra["ranks"] = ranks
                if any(id(params[i][1]) in sparse for i in idx):
                    rec.extra["sparse"] = True
                out.append(rec)
        return out

    def _ddp_plans(self, ddp: Any, info: dict, params: list,
                   passes: int) -> list[list[list[int]]] | None:
        """Per syncing pass of this step, the buckets it all-reduced (parameter indices).

        DDP all-reduces its initial buckets (``bucket_sizes``, ``_ddp_groups``) until it
        rebuilds them in gradient-ready order, once, in a forward (the second iteration; the
        third with ``static_graph``; never with ``find_unused_parameters``): its Python
        ``_pre_forward`` then sets ``_has_rebuilt_buckets``, which ``_count_ddp_syncs`` notes
        for each pass. The rebuilt buckets are in the logging data from the forward after
        the rebuild on; in the step of the rebuild they are read once from the Reducer itself
        (``_get_zeros_like_grad_buckets()``, at the end of the step, when activations are
        freed: it allocates a zeroed copy of the buckets, freed at once).

        Why (round 9a, against the bytes each all-reduce sent): the logging data alone showed
        the rebuild one step late, ``static_graph``'s at its third iteration not its second (a
        3-step job's manifest held one bucket for every step while step 3 all-reduced three:
        another ``bucket_cap_mb`` HELD "bucket layouts identical"), and a step whose
        micro-batches straddle the rebuild has passes of both plans."""
        flags = self._ddp_passes.pop(id(ddp), None)
        now = getattr(ddp, "_has_rebuilt_buckets", None)
        if now is None:  # a DDP without the flag: the logging data, the rebuild a step late
            groups = _ddp_groups(info, params)
            return None if groups is None else [groups] * passes
        self._ddp_live = True
        if not flags or len(flags) != passes or any(f is None for f in flags):
            flags = [now] * passes  # no backward seen (a compiled step): as DDP is now
        initial = _ddp_groups({"bucket_sizes": info.get("bucket_sizes")}, params)
        rebuilt = None
        if any(flags):
            rebuilt = _ddp_groups(info, params) if info.get("has_rebuilt_buckets") else None
            if rebuilt is None:
                if id(ddp) not in self._ddp_read:
                    self._ddp_read[id(ddp)] = _reducer_groups(ddp, params)
                rebuilt = self._ddp_read[id(ddp)]
        plans = [rebuilt if f else initial for f in flags]
        return None if any(p is None for p in plans) else plans

    def _new_ddp_step(self) -> None:
        """DDP's buckets, written when they change. DDP rebuilds them once, in gradient-ready
        order, at the start of its second iteration; its logging data shows the rebuilt ones a
        step later, so they are stamped with the step after the first one recorded. A step whose
        backward passes all ran under ``no_sync()`` all-reduced no DDP bucket: an ``ends`` line
        (group ``ddp``) says the buckets last written are not in force there (they were, for the
        reader, until written again), and the next syncing step writes them again."""
        counts = tuple(sorted(self._ddp_syncs.values()))
        recs = self._ddp_records()
        quiet = bool(self._ddp_backward) and not recs and not self._ddp_syncs
        self._ddp_syncs, self._ddp_passes, self._ddp_backward = {}, {}, set()
        if quiet and self._ddp_sig is not None:
            end = ends_record(SOURCE_C10D, "all_reduce", 0, self.step())
            end.group = "ddp"
            self.emit(end)
            self._ddp_sig = self._ddp_counts = None  # written again at the next syncing step
            return
        sig = tuple(dict.fromkeys((r.world_size, tuple((e.fqn, e.numel) for e in r.entries))
                                  for r in recs))  # the plan (a pass repeated: once)
        if not recs or (sig == self._ddp_sig and counts == self._ddp_counts):
            return
        step = self.step()
        if (sig != self._ddp_sig and self._ddp_sig is not None and self._ddp_step is not None
                and not self._ddp_rebuilt and not self._ddp_live):
            step = self._ddp_step + 1  # the rebuilt buckets ran from DDP's second iteration on
            self._ddp_rebuilt = True
        self._ddp_sig, self._ddp_step, self._ddp_counts = sig, step, counts
        for r in recs:
            r.step = step
            self.emit(r)

    def new_step(self) -> None:
        """End of an optimizer step: write this step's sequence if it is new."""
        self._new_ddp_step()
        calls, self.current = self.current, []
        manifest_source.EAGER_ALL_REDUCES[0] = 0
        if self.rebuilds and any(e.fqn is None for c in calls for e in c.entries):
            self.rebuilds -= 1  # a model built after the first all-reduce: look again
            self._by_shape = None
            self.layouts.clear()
        sig = tuple((c.group, c.dtype, c.world_size, c.extra.get("op"),
                     tuple(c.extra.get("ranks") or ()),
                     tuple((e.fqn, e.offset, e.numel) for e in c.entries)) for c in calls)
        if sig == self.last_signature or (not calls and self.last_signature is None):
            return
        self.last_signature = sig
        step = self.step()
        if not calls:  # none this step: the last sequence written is no longer in force
            self.emit(ends_record(SOURCE_C10D, "all_reduce", 0, step))
        for c in calls:
            c.step = step
            self.emit(c)


def _reducer_groups(ddp: Any, params: list) -> list[list[int]] | None:
    """Per bucket of the Reducer as it is now, the indices (into ``params``) of its parameters
    in buffer order, in the order the buckets are all-reduced
    (``reducer._get_zeros_like_grad_buckets()``, which allocates a zeroed copy of each bucket,
    freed at once: called once per DDP, at the end of the step that rebuilt them); None where
    this DDP cannot say."""
    get = getattr(getattr(ddp, "reducer", None), "_get_zeros_like_grad_buckets", None)
    if get is None:
        return None
    try:
        buckets = [[id(p) for p in b.parameters()] for b in get()]
    except Exception:  # noqa: BLE001 - an older Reducer
        return None
    index = {id(p): i for i, (_, p) in enumerate(params)}
    groups = [[index.get(i) for i in b] for b in buckets]
    if not groups or any(i is None for g in groups for i in g):
        return None
    return groups


def _ddp_groups(info: dict, params: list) -> list[list[int]] | None:
    """Per DDP bucket, the indices of its parameters (into ``params``), in bucket order, from
    DDP's logging data: the rebuilt buckets (``"5 4 3 2, 1 0"``), else the initial ones (the
    parameters in reverse order, cut at ``bucket_sizes`` bytes)."""
    text = info.get("rebuilt_per_bucket_param_indices") if info.get("has_rebuilt_buckets") \
        else None
    if isinstance(text, str) and text.strip():
        groups = [[int(x) for x in part.split()] for part in text.split(",") if part.strip()]
        if all(0 <= i < len(params) for g in groups for i in g):
            return groups
        return None
    sizes = info.get("bucket_sizes")
    if not isinstance(sizes, str) or not sizes.strip():
        return None
    want = [int(x) for x in sizes.replace(",", " ").split()]
    # DDP's initial assignment (``_compute_bucket_assignment_by_size``) fills buckets from the
    # first parameter on, each in parameter order, and the Reducer takes the list reversed: the
    # last bucket holds parameter 0 first. (Read reversed within the bucket, every offset of a
    # first step's single bucket was wrong against the bytes sent: round 9a.)
    groups, cur, got = [], [], 0
    cuts = want[::-1]
    for i in range(len(params)):
        cur.append(i)
        got += params[i][1].numel() * params[i][1].element_size()
        if len(groups) < len(cuts) and got >= cuts[len(groups)]:
            groups.append(cur)
            cur, got = [], 0
    if cur:
        groups.append(cur)
    groups.reverse()
    sizes_ok = [sum(params[i][1].numel() * params[i][1].element_size() for i in g)
                for g in groups] == want
    return groups if sizes_ok else None

