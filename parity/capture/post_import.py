"""Post-import callbacks: run a function right after a module has been imported.

Used by inject.py (the session starts when the trainer imports torch) and by session.py (the
FSDP2, GraphTrainer and DTensor hooks install when those modules are imported). Import-light
(``sys`` only): it is imported in every rank at startup.
"""

from __future__ import annotations

import sys

from parity.capture.env import one_line, say

_callbacks: dict[str, list] = {}


def module_ready(mod) -> bool:
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
            say(f"capture disabled: {one_line(e)}")
    if not _callbacks and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and module_ready(mod):
        callback(mod)
        return
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def cancel(name: str | None = None, callback=None) -> None:
    """Forget pending callbacks (all, those for ``name``, or that one ``callback`` of ``name``)."""
    if name is None:
        _callbacks.clear()
    elif callback is None:
        _callbacks.pop(name, None)
    else:
        pending = [cb for cb in _callbacks.get(name, ()) if cb is not callback]
        if pending:
            _callbacks[name] = pending
        else:
            _callbacks.pop(name, None)
    if not _callbacks and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
