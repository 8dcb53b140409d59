"""``parity exec --step-on MODULE:FUNCTION``: a training step is a call of FUNCTION.

Why: capture counts a step when a ``torch.optim.Optimizer`` steps (its global step hooks). A
trainer that updates its parameters by hand (``p -= lr * p.grad``) or through an optimizer
outside ``torch.optim`` (a fused or foreign one) never fires those hooks, and nothing would be
recorded. Naming the function that applies the update marks the step without editing the
trainer: each call of FUNCTION is one step, exactly as if an optimizer's ``step()`` ran
around it (parity's own global optimizer hooks are called with a stand-in optimizer before and
after; nobody else's).

FUNCTION is ``name`` or ``Class.method`` in MODULE. MODULE is wrapped right after it is
imported; ``__main__`` (or the stem of the script being run, or the module name it runs under
with ``python -m``) is the trainer script itself, whose
functions are defined as it runs: there the function is wrapped at the first Python call after
its ``def`` (a profile hook that removes itself). A call from a name bound before the wrap (``from
m import f`` executed earlier) is not seen: name the module where the trainer looks it up.

The parameters of the step, in this order: the ``param_groups`` of an argument that has them (a
foreign optimizer, ``self`` of ``Optimizer.step``); the parameters of ``nn.Module`` arguments
and the parameters (tensors that require grad) among the arguments, one level into lists,
tuples and dicts; else the parameters of the model (the live module tree holding the most
trainable parameters). A function given none of these that returns tensors is a stateless
update (``torch.func`` training: a new dict of plain tensors each step) whose results the
model's parameters do not hold: named unhashed (meta.json ``capture.unhashed``), so a diff is
incomplete and says so instead of holding over tensors that never changed (round 15c).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

import torch

from parity.capture import post_import
from parity.capture.env import one_line, say
from parity.capture.patches import _tracing

ENV_STEP_ON = "PARITY_CAPTURE_STEP_ON"


def parse(spec: str) -> tuple[str, str]:
    """``'pkg.mod:Class.method'`` -> ("pkg.mod", "Class.method"); ValueError when malformed."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod.strip() or not attr.strip() or any(
            not p.isidentifier() for p in attr.split(".")) or any(
            not p.isidentifier() for p in mod.split(".")):
        raise ValueError(f"--step-on {spec!r}: expected MODULE:FUNCTION (e.g. train:sgd_update "
                         "or mylib.optim:FusedAdam.step)")
    return mod.strip(), attr.strip()


class _StandIn:
    """What parity's optimizer hooks read from an optimizer: ``param_groups``."""

    def __init__(self, label: str):
        self.label = label
        self.param_groups: list[dict] = [{"params": []}]

    def __repr__(self) -> str:
        return f"<parity --step-on {self.label}>"


def _params(args, kwargs, root) -> list:
    values = [*args, *kwargs.values()]
    for v in values:
        groups = getattr(v, "param_groups", None)
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            return [p for g in groups for p in g.get("params", ())]
    out, seen = [], set()

    def add(p):
        if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)

    for v in values:
        items = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(
            v, (list, tuple)) else [v]
        for x in items:
            if isinstance(x, torch.nn.Module):
                for p in x.parameters():
                    add(p)
            else:
                add(x)
    if not out and root is not None:
        for p in root.parameters():
            add(p)
    return out


# Why a stateless update's result is named unhashed (round 15c): ``torch.func`` training
# updates a dict of plain tensors into a new dict (``{n: p - lr * g[n]}``); given no parameter,
# the step hashes the model's, which that update never changes: lr 0.05 against 0.04 HELD.
STATELESS = ("returned tensors, and was given no parameter (no nn.Module, param_groups or "
             "tensor that requires grad): a stateless update (torch.func); the model's "
             "parameters were hashed as its step's, the tensors it returns were not")


def _holds_tensors(out) -> bool:
    """Whether a step function's result is a tensor or holds floating tensors (one level into
    dicts, lists, tuples): the new parameters of a stateless update."""
    items = (list(out.values()) if isinstance(out, dict) else list(out)
             if isinstance(out, (list, tuple)) else [out])
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in items)


def _parity_hooks(table) -> list:
    """parity's own global optimizer hooks (the session's and op capture's), in order."""
    out = []
    for hook in list(table.values()):
        fn = getattr(hook, "__func__", hook)
        if (getattr(fn, "__module__", "") or "").startswith("parity."):
            out.append(hook)
    return out


def wrap(fn, label: str, session):
    """``fn`` with parity's optimizer step hooks around each call."""
    stand_in = _StandIn(label)

    @functools.wraps(fn)
    def step_on(*args, **kwargs):
        if session.failed or session.stopped or os.getpid() != session.pid or _tracing():
            return fn(*args, **kwargs)
        from torch.optim import optimizer as _opt

        given = _params(args, kwargs, None)
        root = None if given else session._model_root()  # no module hook tells which ran
        stand_in.param_groups = [{"params": given or _params((), {}, root)}]
        for hook in _parity_hooks(_opt._global_optimizer_pre_hooks):
            hook(stand_in, (stand_in,), {})
        out = fn(*args, **kwargs)
        if not given and _holds_tensors(out):
            session._note_unhashed(f"<{label} result>", STATELESS)
        for hook in _parity_hooks(_opt._global_optimizer_post_hooks):
            hook(stand_in, (stand_in,), {})
        return out

    step_on._parity_step_on = True  # type: ignore[attr-defined]
    return step_on


def _install_on(owner, attr_path: str, label: str, session) -> bool:
    *parents, name = attr_path.split(".")
    obj = owner
    for p in parents:
        obj = getattr(obj, p, None) if not isinstance(obj, dict) else obj.get(p)
        if obj is None:
            return False
    current = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    if current is None:
        return False
    if getattr(current, "_parity_step_on", False):
        return True
    if not callable(current):
        raise TypeError(f"--step-on {label}: {attr_path} is not callable")
    if isinstance(obj, dict):
        obj[name] = wrap(current, label, session)
    else:
        setattr(obj, name, wrap(current, label, session))
    return True


def _main_names() -> set[str]:
    """The names the running trainer answers to: ``__main__``, its script's stem, and when it
    runs as ``python -m pkg.train`` (torchrun ``-m``) its module name ``pkg.train``
    (``__main__.__spec__.name``: it is never imported under that name, so a wait for its
    import would never end)."""
    names = {"__main__"}
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path:
        names.add(os.path.splitext(os.path.basename(path))[0])
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name:
        names.add(spec_name)
        if spec_name.endswith(".__main__"):  # python -m pkg runs pkg/__main__.py
            names.add(spec_name.rsplit(".", 1)[0])
    return names


def install(spec: str, session) -> None:
    """Arrange for MODULE:FUNCTION to mark the steps (called when the session starts)."""
    try:
        module, attr = parse(spec)
    except ValueError as e:
        session.warn(str(e))
        return
    main_mod = sys.modules.get("__main__")
    if module == "__main__" or (module in _main_names()
                                and sys.modules.get(module) in (None, main_mod)):
        _install_in_script(attr, spec, session, main_mod)
        return
    sref = weakref.ref(session)

    def on_import(mod):
        s = sref()
        if s is None:
            return
        try:
            if not _install_on(mod, attr, spec, s):
                s.warn(f"--step-on {spec}: {module} has no {attr}: no step will be recorded "
                       "through it")
        except Exception as e:  # noqa: BLE001
            s.warn(f"--step-on {spec}: {one_line(e)}")

    post_import.when_imported(module, on_import)


def _install_in_script(attr: str, spec: str, session, main_mod) -> None:
    """The trainer script defines FUNCTION as it runs: wrap it at the first call after that."""
    if main_mod is None:
        session.warn(f"--step-on {spec}: no __main__ module")
        return
    g = main_mod.__dict__
    head = attr.split(".", 1)[0]
    previous = sys.getprofile()

    def profiler(frame, event, arg):
        if head in g:
            try:
                if _install_on(g, attr, spec, session):
                    _remove()
            except Exception as e:  # noqa: BLE001
                _remove()
                session.warn(f"--step-on {spec}: {one_line(e)}")
        if previous is not None:
            return previous(frame, event, arg)
        return None

    def _remove():
        if sys.getprofile() is profiler:
            sys.setprofile(previous)

    try:
        if not _install_on(g, attr, spec, session):
            sys.setprofile(profiler)
    except Exception as e:  # noqa: BLE001
        say(f"--step-on {spec}: {one_line(e)}")
