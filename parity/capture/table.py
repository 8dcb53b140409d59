"""The parameter table of one rank: which tensors are hashed, in which order, under which names.

Built on the first optimizer step from the parameters of every optimizer that steps (named from
the module tree that holds them, normalized by names.py), followed by the persistent buffers of
those modules; parameters that join an optimizer later join the table from that step on. The
rows' digests are what the step clock (steps.py) writes.

:class:`ParamTable` is a part of :class:`~parity.capture.session.Session` (a mixin: its state
is initialised in ``Session.__init__``), split out so that each concern reads on its own.
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch

from parity.capture.hashing import digest_tensors, local_tensor
from parity.capture.names import normalize_fqn
from parity.records import dtype_name
from parity.capture.patches import _tracing

def _placement_str(p) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"Shard({p.dim})"
    if name == "_StridedShard":
        return f"_StridedShard({p.dim}, sf={getattr(p, 'split_factor', '?')})"
    if name == "Replicate":
        return "Replicate()"
    if name in ("Partial", "_Partial"):
        return f"Partial({getattr(p, 'reduce_op', '')})"
    return repr(p)


def _is_dtensor(t) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "_local_tensor")


def _module_roots() -> list[torch.nn.Module]:
    """Every live nn.Module that is nobody's child (a gc scan: used once, as a fallback)."""
    module_type = torch.nn.Module
    # type(), not isinstance(): the latter reads __class__, which weak proxies and deprecated
    # module attributes turn into errors or warnings.
    mods = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
    children = set()
    for m in mods:
        for c in m._modules.values():
            if c is not None:
                children.add(id(c))
    return [m for m in mods if id(m) not in children]


class _Buffer:
    """A persistent buffer in the table, looked up on its module at each hash: a module may
    replace a buffer tensor (``self.running_mean = ...``), so a kept reference could go stale."""

    __slots__ = ("module", "name")
    grad = None  # buffers have no gradient: NO_HASH in every grad line

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = module, name

    def tensor(self):
        return self.module._buffers.get(self.name)


def _persistent_buffers(roots) -> list[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """(fqn, owning module, attribute name, tensor) of every persistent buffer under ``roots``
    (what ``state_dict`` saves: BatchNorm running statistics, step counters)."""
    out, seen = [], set()
    for root in roots:
        for prefix, mod in root.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", ())
            for name, buf in mod._buffers.items():
                if buf is None or name in skip or id(buf) in seen:
                    continue
                seen.add(id(buf))
                out.append((f"{prefix}.{name}" if prefix else name, mod, name, buf))
    return out


class ParamTable:
    """Module names and the parameter table (state in ``Session.__init__``)."""

    # ------------------------------------------------------------------------ module names
    def _forward_pre_hook(self, module, args):
        # Runs on the first module call of the program (normally the model, outside any compiled
        # region) and removes itself: a lingering global hook makes dynamo recompile. Inside a
        # trace it does nothing (and records nothing); torch.compile and the first optimizer
        # step remove it if it is still there.
        if _tracing():
            return None
        try:
            self._root_ref = weakref.ref(module)
            self._remove_forward_hook()
            if self.manifests and self._fsdp is None:
                from parity.capture import fsdp2

                if fsdp2.GROUP_MODULE in sys.modules:
                    self._install_fsdp2()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    def _forget_forward_hook(self) -> None:
        """Remove the forward pre-hook before it can be traced (names then come from the gc
        scan of root modules, see _names), doing first what it would have done."""
        if self._fwd_handle is None:
            return
        self._remove_forward_hook()
        try:
            if self.manifests and self._fsdp is None:
                from parity.capture import fsdp2

                if fsdp2.GROUP_MODULE in sys.modules:
                    self._install_fsdp2()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _remove_forward_hook(self) -> None:
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()

    def _names(self, params: list) -> dict[int, str]:
        """Raw FQNs of ``params``, from the module tree that holds them.

        Fast path: the first module called (normally the model) holds them all. Otherwise
        (the first call was a helper, or several models) every live root module is a
        candidate, and each parameter takes its name from the root holding the most of them.
        """
        want = {id(p) for p in params}

        def scan(root) -> dict[int, str]:
            found: dict[int, str] = {}
            for n, p in root.named_parameters():
                if id(p) in want:
                    found.setdefault(id(p), n)
            return found

        first = self._root_ref() if self._root_ref is not None else None
        if first is not None:
            names = scan(first)
            if len(names) == len(want):
                if first not in self._name_roots:
                    self._name_roots.append(first)
                return names
        candidates = ([first] if first is not None else []) + [
            r for r in _module_roots() if r is not first]
        scans = [scan(r) for r in candidates]
        names: dict[int, str] = {}
        for found, root in sorted(zip(scans, candidates), key=lambda x: len(x[0]),
                                  reverse=True):  # stable: the first root wins ties
            if found and not any(root is r for r in self._name_roots):
                self._name_roots.append(root)
            for k, v in found.items():
                names.setdefault(k, v)
            if len(names) == len(want):
                break
        return names

    def _tensors(self) -> list:
        """What the table's rows hold now (parameters, and buffers looked up on their module)."""
        return [p.tensor() if type(p) is _Buffer else p for p in self.table]

    def _add_params(self, opt) -> None:
        """First step: extend the table with this optimizer's parameters (hashed as step 0)."""
        new = []
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self._table_ids:
                    self._table_ids[id(p)] = -1
                    new.append(p)
        if not new:
            return
        self._ensure_writer()
        names = self._names(new)
        for p in new:
            self._append_param(p, names.get(id(p)))
        self._p0.append(digest_tensors(new, self.hasher))
        if self.grads:
            self._g1.append(digest_tensors([p.grad for p in new], self.hasher))
        self._table_dirty = True
        if not self._buffers_added:
            self._buffers_added = True
            self._add_buffers()

    def _append_param(self, p, raw: str | None, **extra) -> None:
        """One parameter joins the table: its params.json entry (a DTensor's placement and mesh
        coordinate included), ``extra`` keys after the common ones (``since`` for late joiners)."""
        i = len(self.table)
        self._table_ids[id(p)] = i
        self.table.append(p)
        lt = local_tensor(p)
        entry = {"fqn": normalize_fqn(raw) if raw else f"<unnamed {i}>", "raw_fqn": raw,
                 "shape": list(lt.shape), "global_shape": list(p.shape),
                 "dtype": dtype_name(lt.dtype), "placement": None, "mesh_coord": None, **extra}
        if _is_dtensor(p):
            entry["placement"] = ", ".join(_placement_str(pl) for pl in p.placements)
            coord = p.device_mesh.get_coordinate()
            entry["mesh_coord"] = list(coord) if coord is not None else None
        self.entries.append(entry)

    def _add_buffers(self) -> None:
        """Persistent buffers of the modules that hold the parameters join the table after the
        first optimizer's parameters, hashed in the same digest calls (no gradient)."""
        bufs = []
        for fqn, mod, name, t in _persistent_buffers(self._name_roots):
            i = len(self.table)
            self._table_ids[id(t)] = i
            self.table.append(_Buffer(mod, name))
            lt = local_tensor(t)
            self.entries.append({"fqn": normalize_fqn(fqn), "raw_fqn": fqn, "kind": "buffer",
                                 "shape": list(lt.shape), "global_shape": list(t.shape),
                                 "dtype": dtype_name(lt.dtype), "placement": None,
                                 "mesh_coord": None})
            bufs.append(t)
        if bufs:
            self._p0.append(digest_tensors(bufs, self.hasher))
            if self.grads:
                self._g1.append(digest_tensors([None] * len(bufs), self.hasher))

    def _check_params(self, opt) -> None:
        """After step 1: parameters that joined an optimizer (``add_param_group``, an optimizer
        that steps for the first time) join the table from this step on. The per-step cost is a
        signature of the param groups; the parameters are walked only when it changes."""
        sig = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        if self._opt_sigs.get(id(opt)) == sig:
            return
        self._opt_sigs[id(opt)] = sig
        new = [p for g in opt.param_groups for p in g["params"] if id(p) not in self._table_ids]
        if not new:
            return
        names = self._names(new)
        for p in new:
            self._append_param(p, names.get(id(p)), since=self._step_base + self.k)
        if self._step_grads is not None:  # this step's gradients, in table order
            self._step_grads += digest_tensors([p.grad for p in new], self.hasher)
        self._ensure_writer().write_params(self.entries)
        shown = ", ".join(e["fqn"] for e in self.entries[-len(new):][:3])
        self.warn(f"{len(new)} parameter(s) joined the optimizers at step "
                  f"{self._step_base + self.k} and are hashed from then on ({shown}"
                  f"{', ...' if len(new) > 3 else ''})")
