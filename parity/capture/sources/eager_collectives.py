"""Collectives issued eagerly by DTensor, outside any compiled graph and outside FSDP2.

Why: a compiled trainer can leave part of the model out of its graph. torchtitan GraphTrainer's
jit mode runs lm_head under the chunked loss eagerly: per step 8 DTensor all-gathers of
lm_head.weight and 8 reduce-scatters of its gradient chunks, which no graph hook and no FSDP2 hook
sees. Eager FSDP2 reduce-scatters the accumulated gradient once, and the two sum in different
orders (torchtitan#3770's bug class). Recording them lets the diff say so.

Hook point: ``torch.distributed.tensor._redistribute.redistribute_local_tensor``, the one function
every DTensor placement change goes through (``DTensor.redistribute`` and its backward, and
implicit redistributions in op dispatch), as bound in the modules that call it. Inside a trace
(dynamo, make_fx, fake tensors) the wrapper only passes through: there it is part of a graph that
graph.py / graph_makefx.py read.

Each call outside a trace becomes one record, written as a bucket line (docs/artifacts.md) with
``"source": "dtensor"``, one entry (the parameter FQN when the tensor is a parameter's local
shard or, for a Partial tensor, that parameter's gradient: eager_grads.py; else null with its
shape) and ``module``: the chain of objects it was issued under
(``loss_fn(ChunkedLossWrapper) > lm_head``), read from the Python stack. A step's sequence is
written when first seen and again only when it changes (``new_step``).

A gradient-norm clip's all-reduce (torch's ``clip_grad_norm_`` and torchtitan's over DTensor
gradients) carries the per-parameter norms stacked into one vector: a ``_NormPartial`` tensor
of one value per gradient, no parameter's memory. Which value is whose is known only where the
vector is built, in ``get_total_norm``: that function is wrapped too (``NORM_FUNCTIONS``, where
bound), and the next Partial redistribution of a vector of that many values inside it is
written with one entry per value, ``<parameter FQN>:grad_norm``, in the stack's order (torch's
``_group_tensors_by_device_and_dtype``). The reduction order of those values at another
topology can then be predicted like any named payload's (round 13, lead).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from parity.capture.sources import eager_grads
from parity.capture.sources.eager_grads import key as _key
from parity.capture.sources.manifest_source import (REDISTRIBUTE_WRAPPED, REDISTRIBUTING,
                                                    ManifestSource, SourceHooks,
                                                    sub_group_ranks)
from parity.capture.names import normalize_fqn
from parity.capture.patches import _tracing
from parity.capture.table import _module_roots
from parity.records import NORM_SUFFIX, SOURCE_DTENSOR, BucketEntry, BucketRecord, dtype_name, ends_record

__all__ = ["EagerCollectives", "kind_of", "MODULES", "NORM_FUNCTIONS"]

MODULES = ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._dispatch",
           "torch.distributed.tensor._api")
_FN = "redistribute_local_tensor"
# where the total-norm function is bound (torch >= 2.6): torch's clip_grad_norm_ calls the first
# by its module global, torchtitan's clip_grad_norm_ the second by attribute
NORM_FUNCTIONS = (("torch.nn.utils.clip_grad", "_get_total_norm"),
                  ("torch.nn.utils", "get_total_norm"))


def kind_of(current: Any, target: Any) -> str:
    """The collective a placement change issues, by mesh dimension (joined with '+')."""
    kinds = []
    for a, b in zip(current.placements, target.placements):
        if a == b:
            continue
        if a.is_partial() and b.is_replicate():
            kinds.append("all_reduce")
        elif a.is_partial():
            kinds.append("reduce_scatter")
        elif b.is_replicate():
            kinds.append("all_gather")
        elif a.is_replicate():
            kinds.append("local_chunk")
        else:
            kinds.append("all_to_all")
    return "+".join(kinds) or "none"


def _padded_gather_numel(local: Any, current: Any, target: Any, numel: int) -> int:
    """What one rank sends in an all-gather of an unevenly sharded dimension: DTensor pads every
    shard to the largest (``ceil(dim / n)`` rows) before it all-gathers. The local numel was
    written, so the rank holding the short shard recorded fewer bytes than it sent (round 9a:
    a 7-row Shard(0) parameter on 2 ranks, 12 bytes recorded, 16 sent). Only the plain case
    (one mesh dimension changes, Shard(d) -> Replicate, no other mesh dimension shards d);
    otherwise the local numel, as before."""
    meta = getattr(current, "tensor_meta", None)
    changed = [(a, n) for a, b, n in zip(current.placements, target.placements, current.mesh.shape)
               if a != b]
    if meta is None or len(changed) != 1 or not changed[0][0].is_shard():
        return numel
    d = changed[0][0].dim
    if sum(1 for p in current.placements if p.is_shard() and p.dim == d) != 1:
        return numel
    rows = local.shape[d] if local.dim() > d else 0
    if rows == 0:
        return numel
    return numel // rows * -(-int(meta.shape[d]) // int(changed[0][1]))


def _placements(spec: Any) -> str:
    return ", ".join(repr(p) for p in spec.placements)


def _owners(depth: int = 40) -> list[tuple]:
    """The objects the current call runs under, innermost first, as (id, is_module, label):
    each frame whose ``self`` is an nn.Module (named later, by its FQN in the model) or a
    callable object such as a loss wrapper (labelled now by the attribute that holds it on the
    next owner out, e.g. the trainer's ``loss_fn``). Ids only: the objects outlive the step."""
    import torch

    frame = sys._getframe(3)
    objs: list[Any] = []
    for _ in range(depth):
        if frame is None:
            break
        obj = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames[:1] else None
        if obj is not None and (not objs or objs[-1] is not obj):
            objs.append(obj)
        frame = frame.f_back
    out: list[tuple] = []
    for i, obj in enumerate(objs):
        if isinstance(obj, torch.nn.Module):
            out.append((id(obj), True, type(obj).__name__))
        elif i + 1 < len(objs) and type(obj).__module__.split(".")[0] not in ("torch", "parity"):
            holder = objs[i + 1]
            attr = next((k for k, v in getattr(holder, "__dict__", {}).items() if v is obj), None)
            if attr is not None:
                out.append((id(obj), False, f"{attr}({type(obj).__name__})"))
    return out


def _chain(owners: list[tuple], names: dict[int, str]) -> str:
    """Outermost first; a module outside the model (no name) is left out."""
    parts = []
    for oid, is_module, label in owners:
        if is_module:
            name = names.get(oid)
            if name is None:
                continue
            parts.append(name or label)
        else:
            parts.append(label)
    return " > ".join(reversed(parts))


class EagerCollectives(ManifestSource):
    """Wraps ``redistribute_local_tensor`` and hands records to ``hooks.emit(record)`` (a
    manifest source, manifest_source.py)."""

    name = "dtensor"
    source = SOURCE_DTENSOR
    trigger = MODULES[0]
    unavailable = "eager collectives unavailable"

    def __init__(self, hooks: SourceHooks):
        super().__init__(hooks)
        self.emit = hooks.emit
        self.step = hooks.done  # new_step runs when the step has finished
        self.modules = _module_roots  # the model roots, for parameter and module names
        self.tracing = _tracing
        self.normalize = normalize_fqn
        self.patches: list[tuple[Any, str, Any]] = []
        # this step's calls: (record, tensor key, owner chain, for a Partial tensor [the FQN
        # of the parameter whose gradient it is, found at the call (eager_grads.py), weak
        # output] else None); names are resolved in new_step
        self.current: list[tuple[BucketRecord, tuple, list, list | None]] = []
        self.grad_map = eager_grads.GradMap()
        self._early = False  # this step has scanned for the parameters before new_step
        self.last_signature: tuple | None = None
        self._params: dict[tuple, str] | None = None
        self._param_list: list[tuple[str, Any]] = []
        self._by_id: dict[int, str] = {}  # id(parameter) -> FQN (parameters outlive the job)
        self._modules: dict[int, str] = {}
        self._by_module: dict[int, list] = {}
        self.busy = False
        # inside get_total_norm: weak references to the local tensors of the gradients whose
        # norms its all-reduce will carry, in the stack's order (None: not inside, or not known)
        self.norm_pending: list | None = None

    # ---------------------------------------------------------------------------- install
    def install(self) -> str | None:
        """Wrap the function where it is bound now; a module imported later binds the wrapper
        (install right after ``_redistribute`` is imported: nothing else imported here)."""
        for name in MODULES:
            mod = sys.modules.get(name)
            fn = getattr(mod, _FN, None) if mod is not None else None
            if fn is None or hasattr(fn, "_parity_original"):
                continue
            self.patches.append((mod, _FN, fn))
            setattr(mod, _FN, self._wrap(fn))
        if not self.patches:
            return f"{MODULES[0]}.{_FN} not found in this torch version"
        REDISTRIBUTE_WRAPPED[0] = True
        wrapped: dict[int, Callable] = {}  # one wrapper per function, however many names
        for name, attr in NORM_FUNCTIONS:
            mod = sys.modules.get(name)
            fn = getattr(mod, attr, None) if mod is not None else None
            if fn is None or hasattr(fn, "_parity_original"):
                continue  # absent: the norm's values stay unnamed, as before
            self.patches.append((mod, attr, fn))
            setattr(mod, attr, wrapped.setdefault(id(fn), self._wrap_norm(fn)))
        return None

    def uninstall(self) -> None:
        for mod, attr, fn in reversed(self.patches):
            setattr(mod, attr, fn)
        self.patches = []
        REDISTRIBUTE_WRAPPED[0] = False

    def _wrap(self, original: Callable) -> Callable:
        rec = self

        def redistribute_local_tensor(local_tensor, current_spec, target_spec, *args, **kwargs):
            partial = None
            if not rec.busy and not rec.tracing():
                try:
                    rec.busy = True
                    partial = rec.record(local_tensor, current_spec, target_spec)
                except Exception:  # noqa: BLE001 - never in the way of the job
                    pass
                finally:
                    rec.busy = False
            deep = REDISTRIBUTING  # the functional source skips what this issues
            deep.depth += 1
            try:
                out = original(local_tensor, current_spec, target_spec, *args, **kwargs)
            finally:
                deep.depth -= 1
            if partial is not None:
                partial[1] = eager_grads.weak(out)  # what the reduced tensor became
            return out

        redistribute_local_tensor.__wrapped__ = original  # type: ignore[attr-defined]
        redistribute_local_tensor._parity_original = original  # type: ignore[attr-defined]
        redistribute_local_tensor.__doc__ = original.__doc__
        return redistribute_local_tensor

    def _wrap_norm(self, original: Callable) -> Callable:
        """``get_total_norm`` as it was, after noting which gradient each stacked norm is."""
        rec = self

        def get_total_norm(tensors, *args, **kwargs):
            if rec.tracing():  # inside a trace: nothing of capture's, no state written
                return original(tensors, *args, **kwargs)
            tensors = [tensors] if _is_tensor(tensors) else list(tensors)  # as it does
            try:
                pending = _stack_order(tensors)
            except Exception:  # noqa: BLE001 - never in the way of the job
                pending = None
            saved, rec.norm_pending = rec.norm_pending, pending
            try:
                return original(tensors, *args, **kwargs)
            finally:
                rec.norm_pending = saved

        functools.update_wrapper(get_total_norm, original)
        get_total_norm._parity_original = original  # type: ignore[attr-defined]
        return get_total_norm

    # ---------------------------------------------------------------------------- records
    def _names(self) -> None:
        params: dict[tuple, str] = {}
        self._param_list = []
        mods: dict[int, str] = {}
        by_module: dict[int, list[tuple[str, tuple]]] = {}  # module -> (fqn, global shape)
        for root in self.modules():
            for n, m in root.named_modules():
                if id(m) in mods:
                    continue
                mods[id(m)] = self.normalize(n)
                by_module[id(m)] = [
                    (self.normalize(f"{n}.{pn}" if n else pn), tuple(p.shape))
                    for pn, p in m.named_parameters()]
            for n, p in root.named_parameters():
                params.setdefault(_key(getattr(p, "_local_tensor", p)), self.normalize(n))
                self._param_list.append((self.normalize(n), p))
        self._params, self._modules, self._by_module = params, mods, by_module
        self.grad_map.set_params(self._param_list)
        self._by_id = {}
        for n, p in self._param_list:
            self._by_id.setdefault(id(p), n)

    def _fqn(self, key: tuple, owners: list[tuple], shape: list, dtype: str,
             partial: list | None = None, grads: Callable | None = None) -> str | None:
        """The parameter this tensor is: by its memory, else (a cast or copy of it, such as a
        bf16 all-gather input) the one parameter of that global shape in the innermost module
        it was issued under. A tensor of bool or integer values is no cast of a parameter (a
        mask of one: on torch 2.15 torchtitan's chunked loss all-gathers a bool tensor of
        lm_head.weight's shape): it is named by its memory only. A Partial tensor (a sum still
        to be taken) is no copy of a parameter: it is named after the parameter whose gradient
        it is (eager_grads.py: found at the call, by autograd or by the memory of its ``.grad``;
        else the ``.grad`` its output is, by identity: ``grads`` builds that map once a step),
        else left unnamed."""
        fqn = self._params.get(key) if self._params else None
        if fqn is not None:
            return fqn
        if partial is not None:
            if partial[0] is not None:
                return partial[0]
            out = partial[1]() if partial[1] is not None else None
            return grads().get(id(out)) if out is not None and grads is not None else None
        if not dtype.startswith(("float", "bfloat", "complex")):
            return None
        for oid, is_module, _ in owners:  # innermost first
            if not is_module or oid not in self._by_module:
                continue
            same = [f for f, sh in self._by_module[oid] if list(sh) == list(shape)]
            if len(same) == 1:
                return same[0]
            if same:
                return None  # ambiguous
        return None

    def record(self, local_tensor: Any, current_spec: Any, target_spec: Any) -> list | None:
        """One call; names are resolved at the end of the step (new_step), when the model is
        surely built: the first redistribution may come before (weight init). Returns, for a
        Partial tensor, the list the wrapper completes with a weak reference to the output."""
        kind = kind_of(current_spec, target_spec)
        if kind in ("none", "local_chunk"):
            return None  # no communication
        meta = getattr(target_spec, "tensor_meta", None)
        shape = list(meta.shape) if meta is not None else list(local_tensor.shape)
        dtype = dtype_name(local_tensor.dtype)
        numel = local_tensor.numel()
        world, dims = 1, []
        for dim, (a, b, n) in enumerate(zip(current_spec.placements, target_spec.placements,
                                            current_spec.mesh.shape)):
            if a != b:
                world *= int(n)
                dims.append(dim)
        if kind == "reduce_scatter":
            # one byte unit with FSDP2 and graph records: a reduce-scatter's per-rank payload
            # is the shard it ends with, not the full tensor it starts from
            numel = -(-numel // world)
        elif kind == "all_gather":
            numel = _padded_gather_numel(local_tensor, current_spec, target_spec, numel)
        size = numel * local_tensor.element_size()
        rec = BucketRecord(SOURCE_DTENSOR, kind, len(self.current),
                           [BucketEntry(None, 0, size, numel, dtype, shape)], group="",
                           dtype=dtype, world_size=world, total_bytes=size,
                           placements=f"{_placements(current_spec)} -> "
                                      f"{_placements(target_spec)}")
        ranks = _mesh_dim_ranks(current_spec.mesh, dims)
        if ranks:
            rec.extra["ranks"] = ranks
        partial = None
        if any(p.is_partial() for p in current_spec.placements):
            norms = self.norm_pending
            if (norms is not None and kind == "all_reduce" and len(shape) == 1
                    and shape[0] == len(norms) == numel):
                self.norm_pending = None  # one vector per get_total_norm
                rec.extra["norm_of"] = norms  # resolved to names in new_step, then dropped
            else:
                partial = [self._grad_of(local_tensor, shape), None]
        self.current.append((rec, _key(local_tensor), _owners(), partial))
        return partial

    def _grad_of(self, local_tensor: Any, shape: list) -> str | None:
        """The parameter whose gradient this Partial tensor is, found at the call
        (eager_grads.py): in ``Redistribute``'s backward by autograd, else by the memory of
        its current ``.grad``. Before the first step's end the parameters are not named yet:
        they are scanned for once a step (a Partial gradient means the model exists)."""
        leaf = eager_grads.autograd_leaf(shape)
        if leaf is not None or not self._param_list:
            if self._params is None and not self._early:
                self._early = True
                self._names()
                self._params = None  # named again at the step's end (the authoritative scan)
            if leaf is not None:
                return self._by_id.get(id(leaf))
        return self.grad_map.find(local_tensor, shape)

    def new_step(self) -> None:
        """End of an optimizer step: write this step's sequence if it is new."""
        calls, self.current = self.current, []
        self._early = False
        if calls and self._params is None:
            self._names()  # once, at the end of the first step with eager collectives
        memo: dict = {}

        def grads() -> dict[int, str]:
            if "map" not in memo:
                memo["map"] = eager_grads.grad_owners(self._param_list)
            return memo["map"]

        for c, key, owners, partial in calls:
            e = c.entries[0]
            norms = c.extra.pop("norm_of", None)
            named = _norm_entries(e, norms, grads()) if norms is not None else None
            if named is not None:  # a clip's norms: grouped as the unnamed vector was
                c.entries, c.group = named, ""
            else:
                e.fqn = self._fqn(key, owners, e.shape, e.dtype, partial, grads)
                c.group = e.fqn.rsplit(".", 1)[0] if e.fqn else ""
            c.module = _chain(owners, self._modules)
        sig = tuple((c.collective, c.module, c.placements, c.dtype, c.total_bytes,
                     tuple(e.fqn for e in c.entries), tuple(c.extra.get("ranks") or ()))
                    for c, _, _, _ in calls)
        if sig == self.last_signature or (not calls and self.last_signature is None):
            return
        self.last_signature = sig
        step = self.step()
        if not calls:  # none this step: the last sequence written is no longer in force
            self.emit(ends_record(SOURCE_DTENSOR, "all_gather", 0, step))
        for c, _, _, _ in calls:
            c.step = step
            self.emit(c)


def _mesh_dim_ranks(mesh: Any, dims: list[int]) -> list[int] | None:
    """The ``ranks`` of a redistribution along one mesh dimension (that dimension's group of
    this rank, manifest_source.sub_group_ranks); None along several or none, or where the mesh
    does not say (a fake mesh in a trace)."""
    if len(dims) != 1:
        return None
    try:
        return sub_group_ranks(mesh.get_group(dims[0]))
    except Exception:  # noqa: BLE001 - optional: the line is written without it
        return None


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _stack_order(tensors: list) -> list:
    """Weak references to the local tensors of ``tensors`` in the order ``get_total_norm``
    stacks their norms: grouped by device and dtype as torch groups them
    (``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``, the function it calls),
    each group in the given order."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    if len(tensors) > 1:
        grouped = _group_tensors_by_device_and_dtype([tensors])
        tensors = [t for ([group], _) in grouped.values() for t in group]
    return [eager_grads.weak(getattr(t, "_local_tensor", t)) for t in tensors]


def _norm_entries(e: BucketEntry, norms: list, owners: dict[int, str]) -> list | None:
    """One entry per value of a stacked norm vector, ``<FQN>:grad_norm``, where every value's
    gradient is a parameter's ``.grad`` still alive at the step's end (by identity); else None
    (the vector stays one unnamed entry: its reduction order is then not predicted)."""
    names = []
    for ref in norms:
        t = ref() if ref is not None else None
        fqn = owners.get(id(t)) if t is not None else None
        if fqn is None:
            return None
        names.append(fqn + NORM_SUFFIX)
    esize = e.size // max(e.numel or 1, 1)
    return [BucketEntry(n, i * esize, esize, 1, e.dtype, [1]) for i, n in enumerate(names)]
