"""Injection: activating capture inside processes that never imported parity.

``parity exec`` (launch.py) prepends ``parity/capture/bootstrap`` to ``PYTHONPATH`` and sets the
``PARITY_CAPTURE_*`` variables below. Every Python process of the job then imports the bootstrap
``sitecustomize``, which first runs the user's own ``sitecustomize`` (the next one on the path),
then decides with ``os``/``sys`` alone whether this process is a rank (``rank_skip_reason``), and
only then imports this module and calls :func:`boot`.

:func:`boot` does not import torch: it waits for the trainer to import it (a one-shot
``sys.meta_path`` finder that wraps the loader of ``torch``), so a trainer that sets thread or
allocator variables before ``import torch`` sees no difference, and a process that never imports
torch pays nothing beyond this module. When torch has finished importing, the session
(session.py) installs its hooks.

This module stays import-light (``os``, ``sys``): it is imported in every rank at startup.
"""

from __future__ import annotations

import os
import sys

ENV_DIR = "PARITY_CAPTURE_DIR"
ENV_EVERY = "PARITY_CAPTURE_EVERY"
ENV_GRADS = "PARITY_CAPTURE_GRADS"
ENV_MANIFESTS = "PARITY_CAPTURE_MANIFESTS"
ENV_HASHER = "PARITY_CAPTURE_HASHER"
# Set (to the pid) by a process once it is a capturing rank; its children inherit it and stay out.
ENV_ACTIVE = "PARITY_CAPTURE_ACTIVE"
ALL_ENV = (ENV_DIR, ENV_EVERY, ENV_GRADS, ENV_MANIFESTS, ENV_HASHER, ENV_ACTIVE)

# Programs that are never ranks, recognized from the command line.
AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")
AGENT_SCRIPTS = ("torchrun",)
HELPER_MARKERS = ("torch._inductor.compile_worker", "compile_worker/__main__",
                  "multiprocessing.forkserver", "multiprocessing.resource_tracker")
_FLAGS_WITH_ARG = ("-W", "-X", "-Q")


def _program(argv: list[str]) -> tuple[str, str]:
    """("module" | "script" | "command" | "", name) of a Python command line."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m" and i + 1 < len(argv):
            return "module", argv[i + 1]
        if a.startswith("-m") and len(a) > 2:
            return "module", a[2:]
        if a == "-c" or (a.startswith("-c") and len(a) > 2):
            return "command", argv[i + 1] if a == "-c" and i + 1 < len(argv) else a[2:]
        if a in _FLAGS_WITH_ARG:
            i += 2
            continue
        if a.startswith("-") and a != "-":
            i += 1
            continue
        return "script", a
    return "", ""


def rank_skip_reason(environ=os.environ, argv=None) -> str | None:
    """Why this process must not capture, or None if it is a rank (or may become one).

    bootstrap/sitecustomize.py applies the same rules with ``os``/``sys`` only (it must not
    import parity in processes that are not ranks); keep the two in step.
    """
    if not environ.get(ENV_DIR):
        return "capture not requested"
    active = environ.get(ENV_ACTIVE)
    if active and active != str(os.getpid()):
        return "a parent process is already a capturing rank"
    if argv is None:
        argv = list(getattr(sys, "orig_argv", sys.argv))
    kind, name = _program(argv)
    if (kind == "module" and name in AGENT_MODULES) or (
            kind == "script" and os.path.basename(name) in AGENT_SCRIPTS):
        return "torchrun agent"
    if any(m in name for m in HELPER_MARKERS) or (
            kind == "command" and any(m in name for m in HELPER_MARKERS)):
        return "helper subprocess"
    return None


# --------------------------------------------------------------------- post-import callbacks
_callbacks: dict[str, list] = {}


def _module_ready(mod) -> bool:
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _PostImportFinder:
    """A meta-path finder that finds nothing itself: it wraps the loader of watched modules so
    that callbacks run right after the module has executed."""

    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _callbacks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                fs = getattr(finder, "find_spec", None)
                if fs is None:
                    continue
                spec = fs(name, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(name)
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        try:
            orig = loader.exec_module
        except AttributeError:
            return spec

        def exec_module(module):
            try:
                orig(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            if getattr(module, "__name__", None) == name:
                _fire(name, module)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec
        return spec


_finder = _PostImportFinder()


def _fire(name: str, module) -> None:
    for cb in _callbacks.pop(name, []):
        try:
            cb(module)
        except Exception as e:  # noqa: BLE001 - never break the user's import
            _say(f"capture disabled: {_one_line(e)}")
    if not _callbacks and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and _module_ready(mod):
        callback(mod)
        return
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def cancel(name: str | None = None) -> None:
    """Forget pending callbacks (all, or those for ``name``)."""
    if name is None:
        _callbacks.clear()
    else:
        _callbacks.pop(name, None)
    if not _callbacks and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


# ------------------------------------------------------------------------------------- boot
def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {msg[0]}" if msg else e.__class__.__name__


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"parity: {msg}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr closed: nothing to do
        pass


def _activate(_torch_module) -> None:
    from parity.capture import session

    s = session.activate_from_env()
    if os.environ.get("PARITY_OPS_STEP"):  # only `parity bisect` reruns set it (ops.py)
        from parity.capture import ops

        ops.activate_from_env(s)


def boot() -> None:
    """Called by the bootstrap sitecustomize in a process that may be a rank."""
    if rank_skip_reason() is not None:
        return
    # PARITY_CAPTURE_ACTIVE (children of a capturing rank stay out) is set by the session when
    # it starts recording, after ``import torch``: a wrapper that starts the real trainer as a
    # child without importing torch itself leaves the child free to be the captured rank.
    when_imported("torch", _activate)
