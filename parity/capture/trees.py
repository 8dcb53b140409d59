"""Which module trees a process holds, and which of their tensors capture can hash.

Capture hashes every parameter and persistent buffer of every module tree the process holds on
real tensors, whether an optimizer steps it or not (an EMA copy updated by hand, a frozen
backbone whose BatchNorm statistics move in train mode). It finds those trees without touching
the job: no module hook (a global forward pre-hook is what tracers see: dynamo export fails
on it, a compiled model recompiles when it goes away), only a ``gc`` scan of live modules, at
the first optimizer step and again when something may have changed (table.py says when).

Not every live tree is the model that trains:

* fake, meta and other subclass tensors hold no data to hash (AutoParallel keeps a
  FakeTensorMode copy of the model it traced; the user built the original on ``meta``). A tree
  whose tensors are all of that kind is *skipped*, with its reason, and never enters the table;
* an FX ``GraphModule`` is a compiler's object (dynamo, aot_autograd, make_fx keep constants as
  buffers): only one whose parameters an optimizer steps is a model (a trained ``torch.export``
  module);
* a tree that is already garbage (an unreachable reference cycle gc has not collected yet)
  would be hashed on one side and not on the other, depending on when gc ran: a new tree that
  no optimizer steps counts only if it survives a collection (:func:`alive`).

A tensor of a real tree that cannot be hashed (a subclass other than DTensor, a meta buffer) is
not in the table either: it is *unhashed*, and the verdict line names it (meta.json
``capture.unhashed``, parity/diff/one_sided.py).
"""

from __future__ import annotations

import gc
import weakref

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def unhashable(t) -> str | None:
    """Why capture cannot hash ``t`` (``"fake tensor"``, ``"meta tensor"``, ``"tensor subclass
    NF4Tensor"``), None if it can: a plain tensor, or a DTensor whose local shard is one."""
    if t is None:
        return None
    cls = type(t)
    if cls not in _PLAIN:
        inner = getattr(t, "_local_tensor", None)
        if inner is None or type(inner) not in _PLAIN:
            odd = type(inner) if inner is not None else cls
            return "fake tensor" if "Fake" in odd.__name__ else f"tensor subclass {odd.__name__}"
        t = inner
    if t.is_meta:
        return "meta tensor"
    return None


def module_roots() -> list[torch.nn.Module]:
    """Every live nn.Module that is nobody's child, oldest first (gc's oldest generation first,
    each in its own order: roughly creation order, so that two trees of one class are named the
    same way in two runs)."""
    module_type = torch.nn.Module
    mods: list = []
    seen: set[int] = set()
    for gen in (2, 1, 0):
        # type(), not isinstance(): the latter reads __class__, which weak proxies and
        # deprecated module attributes turn into errors or warnings.
        for o in gc.get_objects(generation=gen):
            if issubclass(type(o), module_type) and id(o) not in seen:
                seen.add(id(o))
                mods.append(o)
    children = set()
    for m in mods:
        for c in m._modules.values():
            if c is not None:
                children.add(id(c))
    return [m for m in mods if id(m) not in children]


def is_graph_module(m) -> bool:
    """An FX GraphModule: a compiler's object unless an optimizer steps its parameters."""
    try:
        from torch.fx import GraphModule
    except Exception:  # noqa: BLE001
        return False
    return isinstance(m, GraphModule)


def tree_tensors(root, non_persistent: list[str] | None = None
                 ) -> tuple[list[tuple[str, object]], list[tuple[str, object, str, object]]]:
    """(parameters ``[(fqn, p)]``, persistent buffers ``[(fqn, module, name, t)]``) of a tree,
    each tensor once (the first name that reaches it). Buffers are what ``state_dict`` saves.
    The names of the non-persistent buffers left out are appended to ``non_persistent`` when
    given (the verdict line says they were not compared: meta.json
    ``capture.non_persistent_buffers``)."""
    params: list[tuple[str, object]] = []
    buffers: list[tuple[str, object, str, object]] = []
    seen: set[int] = set()
    for prefix, mod in root.named_modules(remove_duplicate=True):
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            params.append((f"{prefix}.{name}" if prefix else name, p))
        skip = getattr(mod, "_non_persistent_buffers_set", ())
        for name, b in mod._buffers.items():
            if b is not None and name in skip and non_persistent is not None:
                non_persistent.append(f"{prefix}.{name}" if prefix else name)
            if b is None or name in skip or id(b) in seen:
                continue
            seen.add(id(b))
            buffers.append((f"{prefix}.{name}" if prefix else name, mod, name, b))
    return params, buffers


# What FSDP2 sets on a module in place of its sharded parameter, without a registration hook
# (``FSDPParam._setattr_on_modules``): the unsharded parameter between an all-gather and its
# reshard, and, with ``reshard_after_forward=<int>``, the post-forward shard on the smaller group
# between a forward and the backward's all-gather (an eval forward leaves it there).
_FSDP_STAND_INS = ("_unsharded_param", "_sharded_post_forward_param")


def fsdp_unsharded(root) -> set[int]:
    """The ids of the parameters FSDP2 has set on modules of ``root`` in place of their shards
    (``FSDPParam._unsharded_param``, between an all-gather and its reshard: the root after an
    eval forward, any module in a step that was interrupted; ``_sharded_post_forward_param``,
    a module with ``reshard_after_forward=<int>`` after its forward). They are the state of the
    shards the table holds, registered without a hook, not parameters of their own.
    Read through FSDP2's private state (torch 2.11-2.15: ``FSDPModule._get_fsdp_state()``,
    ``_fsdp_param_group`` or ``_fsdp_param_groups``, ``fsdp_params``); empty where absent."""
    ids: set[int] = set()
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001 - no FSDP2 here
        return ids
    for mod in root.modules():
        if not isinstance(mod, FSDPModule):
            continue
        try:
            state = mod._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):  # 2.14+: a list (the singular property
                groups = list(state._fsdp_param_groups or ())  # raises for several groups)
            else:
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            for g in groups:
                for fp in getattr(g, "fsdp_params", ()):
                    for attr in _FSDP_STAND_INS:
                        u = fp.__dict__.get(attr)
                        if u is not None:
                            ids.add(id(u))
        except Exception:  # noqa: BLE001 - another torch's layout: nothing skipped
            continue
    return ids


def skip_reason(root) -> str | None:
    """Why a tree is not a model of this process (``"fake tensors (23)"``): it holds a fake
    tensor (a tracer's copy; AutoParallel's, after ``apply_placement``, shares the parallel
    module's real parameters and keeps a fake ``freqs_cis``), or only meta / subclass tensors.
    None when it holds real tensors and no fake one, or nothing at all. A meta or subclass
    tensor beside real ones is named by the table instead (``capture.unhashed``)."""
    params, buffers = tree_tensors(root)
    kinds: dict[str, int] = {}
    for t in [p for _, p in params] + [b for *_, b in buffers]:
        why = unhashable(t) or "real"
        kinds[why] = kinds.get(why, 0) + 1
    if not kinds or (kinds.get("real") and not kinds.get("fake tensor")):
        return None
    return ", ".join(_kind(k, n) for k, n in
                     sorted(kinds.items(), key=lambda kv: (kv[0] == "real", -kv[1])))


def _kind(kind: str, n: int) -> str:
    if kind == "real":
        return f"real tensors ({n})"
    return f"{kind} ({n})" if kind.startswith("tensor subclass") else f"{kind}s ({n})"


def alive(candidates: list) -> list:
    """The candidates still reachable after a garbage collection (a dropped model in a
    reference cycle is not): asked only for new trees that no optimizer steps, which are rare.
    The collection frees what was garbage already; nothing the job holds changes."""
    refs = []
    for m in candidates:
        try:
            refs.append(weakref.ref(m))
        except TypeError:  # no weakref support: keep it
            refs.append(lambda m=m: m)
    candidates.clear()  # the caller's list too: nothing but the weak references left here
    gc.collect()
    return [m for m in (r() for r in refs) if m is not None]


def describe(root) -> str:
    """A tree's label in a message: its class name."""
    return type(root).__name__
