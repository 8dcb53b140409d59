"""The parameter table of one rank: which tensors are hashed, in which order, under which names.

Built on the first optimizer step from the parameters of every optimizer that steps (named from
the module tree that holds them, normalized by names.py), followed by the persistent buffers of
those module trees; parameters that join an optimizer later (``add_param_group``, another
optimizer's first step, a parameter swapped into a group in place) and buffers that appear later
(a second model's, ``register_buffer`` after step 1) join the table from that step on (``since``).
Names are unique across models: a parameter or buffer whose name another model already holds
is prefixed with its model's class name. The rows' digests are what the step clock (steps.py)
writes.

:class:`ParamTable` is a part of :class:`~parity.capture.session.Session` (a mixin: its state
is initialised in ``Session.__init__``), split out so that each concern reads on its own.
"""

from __future__ import annotations

import gc
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


def _persistent_buffers(roots) -> list[tuple[str, torch.nn.Module, str, torch.Tensor, object]]:
    """(fqn, owning module, attribute name, tensor, root) of every persistent buffer under
    ``roots`` (what ``state_dict`` saves: BatchNorm running statistics, step counters)."""
    out, seen = [], set()
    for root in roots:
        for prefix, mod in root.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", ())
            for name, buf in mod._buffers.items():
                if buf is None or name in skip or id(buf) in seen:
                    continue
                seen.add(id(buf))
                out.append((f"{prefix}.{name}" if prefix else name, mod, name, buf, root))
    return out


# Set when a module anywhere registers a buffer or a submodule (global registration hooks): the
# buffer set may have changed, so the next step rescans (without the hooks: every step).
_REGISTRATION = {"dirty": True, "hooked": False}


def _note_registration(*_args) -> None:
    _REGISTRATION["dirty"] = True


def install_registration_hooks() -> list:
    """Global buffer/submodule registration hooks (handles), once per process; [] if absent."""
    if _REGISTRATION["hooked"]:
        return []
    mm = torch.nn.modules.module
    reg_b = getattr(mm, "register_module_buffer_registration_hook", None)
    reg_m = getattr(mm, "register_module_module_registration_hook", None)
    if reg_b is None or reg_m is None:
        return []
    _REGISTRATION["hooked"] = True
    return [reg_b(_note_registration), reg_m(_note_registration)]


def uninstall_registration_hooks(handles: list) -> None:
    for h in handles:
        try:
            h.remove()
        except Exception:  # noqa: BLE001
            pass
    if handles:
        _REGISTRATION["hooked"] = False
        _REGISTRATION["dirty"] = True


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
            if self.manifests:
                self._install_imported_sources()
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
            if self.manifests:
                self._install_imported_sources()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _remove_forward_hook(self) -> None:
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()

    def _names(self, params: list) -> dict[int, tuple[str, object]]:
        """Raw FQNs of ``params`` and the root module that names each, from the module tree
        that holds them.

        Fast path: the first module called (normally the model) holds them all. Otherwise
        (the first call was a helper, or several models) every live root module is a
        candidate, and each parameter takes its name from the root holding the most of them.
        """
        want = {id(p) for p in params}

        def scan(root) -> dict[int, tuple[str, object]]:
            found: dict[int, tuple[str, object]] = {}
            for n, p in root.named_parameters():
                if id(p) in want:
                    found.setdefault(id(p), (n, root))
            return found

        first = self._root_ref() if self._root_ref is not None else None
        if first is not None:
            names = scan(first)
            if len(names) == len(want):
                self._add_root(first)
                return names
        # earlier roots first (a later model's parameter keeps the name its own model gives it)
        known = [r for r in self._name_roots if r is not first]
        candidates = ([first] if first is not None else []) + known + [
            r for r in _module_roots() if r is not first and not any(r is k for k in known)]
        scans = [scan(r) for r in candidates]
        names: dict[int, tuple[str, object]] = {}
        for found, root in sorted(zip(scans, candidates), key=lambda x: len(x[0]),
                                  reverse=True):  # stable: the first root wins ties
            if found:
                self._add_root(root)
            for k, v in found.items():
                names.setdefault(k, v)
            if len(names) == len(want):
                break
        return names

    def _add_root(self, root) -> None:
        """A module tree that names parameters: its buffers are hashed (rescan at next step)."""
        if not any(root is r for r in self._name_roots):
            self._name_roots.append(root)
            self._buffers_dirty = True

    def _unique_name(self, raw: str | None, root, i: int) -> tuple[str, str | None]:
        """(normalized name, raw name) of a new row: a name that another model already holds
        gets this model's class name as a prefix (``Discriminator.l1.weight``), and a counter
        if two models of one class collide (``Net#2.l1.weight``); said once in a warning."""
        if not raw:
            return f"<unnamed {i}>", raw
        name = normalize_fqn(raw)
        holder = self._fqn_roots.get(name)
        if root is None or holder is None or holder is root:
            self._fqn_roots.setdefault(name, root)
            return name, raw
        label = self._root_labels.get(id(root))
        if label is None:
            cls = type(root).__name__
            same = sum(1 for lab in self._root_labels.values() if lab.split("#")[0] == cls)
            if not same and any(type(r).__name__ == cls and r is not root
                                for r in self._name_roots):
                same = 1  # the first model of this class kept the plain names
            label = cls if not same else f"{cls}#{same + 1}"
            self._root_labels[id(root)] = label
        qualified = f"{label}.{name}"
        self._fqn_roots.setdefault(qualified, root)
        if label not in self._labels_said:
            self._labels_said.add(label)
            self.warn(f"several models hold parameters or buffers of one name (first: {name}): "
                      f"the colliding names of {label}'s are prefixed '{label}.'")
        return qualified, f"{label}.{raw}"

    def _tensors(self) -> list:
        """What the table's rows hold now (parameters, and buffers looked up on their module)."""
        if not self._buffer_keys:  # no buffer rows: the table itself (a copy)
            return list(self.table)
        return [p.tensor() if type(p) is _Buffer else p for p in self.table]

    def _add_params(self, opt) -> None:
        """First step: extend the table with this optimizer's parameters and the buffers of
        the models that hold them (hashed as step 0)."""
        self._opt_sigs[id(opt)] = _signature(opt)
        new = []
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self._table_ids:
                    self._table_ids[id(p)] = -1
                    new.append(p)
        if new:
            self._ensure_writer()
            names = self._names(new)
            for p in new:
                self._append_param(p, *names.get(id(p), (None, None)))
            self._p0.append(digest_tensors(new, self.hasher, figures=True))
            self._table_dirty = True
        self._sync_buffers(None)

    def _append_param(self, p, raw: str | None, root=None, **extra) -> None:
        """One parameter joins the table: its params.json entry (a DTensor's placement and mesh
        coordinate included), ``extra`` keys after the common ones (``since`` for late joiners)."""
        i = len(self.table)
        self._table_ids[id(p)] = i
        self.table.append(p)
        self.entries.append(self._param_entry(p, raw, root, i, extra))

    def _param_entry(self, p, raw, root, i: int, extra: dict) -> dict:
        lt = local_tensor(p)
        fqn, raw = self._unique_name(raw, root, i)
        entry = {"fqn": fqn, "raw_fqn": raw, "shape": list(lt.shape), "global_shape": list(p.shape),
                 "dtype": dtype_name(lt.dtype), "placement": None, "mesh_coord": None, **extra}
        if _is_dtensor(p):
            entry["placement"] = ", ".join(_placement_str(pl) for pl in p.placements)
            coord = p.device_mesh.get_coordinate()
            entry["mesh_coord"] = list(coord) if coord is not None else None
        return entry

    def _sync_buffers(self, since: int | None) -> int:
        """Persistent buffers of the model trees that hold optimized parameters, not yet in the
        table, join it (no gradient). On the first step (``since`` None) they are hashed as
        step 0; later they are hashed from step ``since`` on. Rescans only when something may
        have changed (a new model tree, a buffer or submodule registered anywhere); returns
        how many joined."""
        if not (self._buffers_dirty or _REGISTRATION["dirty"] or not _REGISTRATION["hooked"]):
            return 0
        self._buffers_dirty = False
        _REGISTRATION["dirty"] = False
        bufs, start = [], len(self.table)
        for fqn, mod, name, t, root in _persistent_buffers(self._name_roots):
            key = (id(mod), name)
            if key in self._buffer_keys:
                continue
            self._buffer_keys.add(key)
            i = len(self.table)
            self.table.append(_Buffer(mod, name))
            lt = local_tensor(t)
            qfqn, qraw = self._unique_name(fqn, root, i)
            entry = {"fqn": qfqn, "raw_fqn": qraw, "kind": "buffer", "shape": list(lt.shape),
                     "global_shape": list(t.shape), "dtype": dtype_name(lt.dtype),
                     "placement": None, "mesh_coord": None}
            if since is not None:
                entry["since"] = since
            self.entries.append(entry)
            bufs.append(t)
        if not bufs:
            return 0
        if since is None:
            self._p0.append(digest_tensors(bufs, self.hasher, figures=True))
            self._table_dirty = True
        else:
            self._ensure_writer().write_params(self.entries)
            shown = ", ".join(e["fqn"] for e in self.entries[start:start + 3])
            self.warn(f"{len(bufs)} buffer(s) joined the table at step {since} and are hashed "
                      f"from then on ({shown}{', ...' if len(bufs) > 3 else ''})")
        return len(bufs)

    def _check_params(self, opt) -> None:
        """After step 1: parameters that joined an optimizer (``add_param_group``, an optimizer
        that steps for the first time, ``group["params"][i] = new``) join the table from this
        step on; a parameter swapped into a group's slot in place of one that left every
        optimizer takes over that row. The per-step cost is the ids of the group lists; the
        parameters are walked only when they change. Then the buffers (see _sync_buffers)."""
        step = self._step_base + self.k
        sig = _signature(opt)
        old = self._opt_sigs.get(id(opt))
        if old != sig:
            self._opt_sigs[id(opt)] = sig
            self._params_changed(opt, old, sig, step)
        self._sync_buffers(step)

    def _params_changed(self, opt, old, sig, step: int) -> None:
        now = {i for g in sig for i in g}
        others = set().union(*(s for _, s in self._all_sigs(opt)))
        swapped = []
        if old is not None and len(old) == len(sig):
            for g, (og, ng) in enumerate(zip(old, sig)):
                if len(og) != len(ng):
                    continue
                for j, (oi, ni) in enumerate(zip(og, ng)):
                    if oi == ni or ni in self._table_ids or oi not in self._table_ids \
                            or oi in now or oi in others:
                        continue
                    swapped.append((self._table_ids[oi], opt.param_groups[g]["params"][j]))
        for row, p in swapped:
            old_p = self.table[row]
            del self._table_ids[id(old_p)]
            self._table_ids[id(p)] = row
            self.table[row] = p
            e = self.entries[row]
            fresh = self._param_entry(p, e.get("raw_fqn"), None, row, {})
            e.update(shape=fresh["shape"], global_shape=fresh["global_shape"],
                     dtype=fresh["dtype"], placement=fresh["placement"],
                     mesh_coord=fresh["mesh_coord"], replaced=step)
            self._grad_rows.pop(row, None)
        new = [p for g in opt.param_groups for p in g["params"] if id(p) not in self._table_ids]
        if new:
            names = self._names(new)
            for p in new:
                self._append_param(p, *names.get(id(p), (None, None)), since=step)
        if not (new or swapped):
            return
        self._ensure_writer().write_params(self.entries)
        if swapped:
            shown = ", ".join(self.entries[r]["fqn"] for r, _ in swapped[:3])
            self.warn(f"{len(swapped)} parameter(s) were swapped into an optimizer group at step "
                      f"{step} and are hashed from then on in place of the old ones ({shown}"
                      f"{', ...' if len(swapped) > 3 else ''})")
        if new:
            shown = ", ".join(e["fqn"] for e in self.entries[-len(new):][:3])
            self.warn(f"{len(new)} parameter(s) joined the optimizers at step "
                      f"{step} and are hashed from then on ({shown}"
                      f"{', ...' if len(new) > 3 else ''})")

    def _all_sigs(self, opt):
        """The other optimizers' signatures (a parameter still stepped by one keeps its row)."""
        return [(o, {i for g in s for i in g}) for o, s in self._opt_sigs.items() if o != id(opt)]


def _signature(opt) -> tuple:
    """The parameters of each of ``opt``'s groups, by id: a list replaced, grown, shrunk or a
    slot assigned in place (``group["params"][i] = new``) all change it."""
    return tuple(tuple(map(id, g["params"])) for g in opt.param_groups)
