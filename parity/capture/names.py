"""Parameter names that do not depend on how a model is wrapped.

Eager and compiled jobs name the same parameter differently (``_orig_mod.`` from torch.compile,
``_checkpoint_wrapped_module.`` from activation checkpointing, parametrizations, DDP's
``module.``); capture stores, and the diff compares, the normalized name. Standard library only:
the graph hook and the session both use it.
"""

from __future__ import annotations

import re
from typing import Any

WRAPPER_COMPONENTS = frozenset(
    {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_fsdp_module",
     "module_wrapped"})


def normalize_fqn(fqn: str) -> str:
    """The wrapper-free name of a parameter, identical for eager and compiled jobs.

    Drops ``_orig_mod`` (torch.compile), ``_checkpoint_wrapped_module`` (activation
    checkpointing), ``_fsdp_wrapped_module`` / ``_fsdp_module`` (FSDP1), a leading ``module``
    (DDP / DataParallel wrap the root), and rewrites ``parametrizations.X.original`` -> ``X``
    (``originalN`` -> ``X.originalN``). Idempotent.
    """
    parts = fqn.split(".")
    out: list[str] = []
    i = 0
    n = len(parts)
    while i < n:
        c = parts[i]
        if c in WRAPPER_COMPONENTS or (c == "module" and not out and i + 1 < n):
            i += 1
            continue
        if c == "parametrizations" and i + 2 < n and parts[i + 2].startswith("original"):
            tail = parts[i + 2][len("original"):]
            if tail == "" or tail.isdigit():
                out.append(parts[i + 1])
                if tail:
                    out.append(parts[i + 2])
                i += 3
                continue
        out.append(c)
        i += 1
    return ".".join(out)


# ---------------------------------------------------------------------------
# The module a graph node was traced under (op-level capture, bucket attribution)
# ---------------------------------------------------------------------------

PROPERTY_MODULE = "(parameter property)"

_BRACKET = re.compile(r"\[\s*(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\s*\]")
_OWNER = re.compile(r"type\((\s*[LG](?:\.self|\['self'\])[^)]*)\)")


def stack_module(path: str) -> str:
    """``L['self'].layers[1].ffn_norm`` (an ``nn_module_stack`` path) -> ``layers.1.ffn_norm``.

    A module reached through a parameter property (SimpleFSDP's all-gather parametrization:
    ``dict(type(L.self.norm).__dict__).weight.fget.__closure__...``) is one object shared by
    many parameters, named by dynamo after the first access: it is reported as
    ``(parameter property)``, not as a module it does not belong to."""
    if _OWNER.search(path) or "__closure__" in path:
        return PROPERTY_MODULE
    path = re.sub(r"^[LG]\.self\b", "", path)
    path = re.sub(r"^\s*[LG]\[[^\]]*\]", "", path)
    path = _BRACKET.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    parts = [p for p in path.split(".") if p and p not in ("_modules", "_parameters")]
    return normalize_fqn(".".join(parts))


def node_module(node: Any) -> str:
    """The module an FX node was traced under: torchtitan's ``module_fqn`` annotation (in
    ``meta["custom"]`` or ``meta``) when present, else the innermost ``nn_module_stack`` entry
    (``fwd_nn_module_stack`` for backward nodes); "" when the node carries neither."""
    meta = getattr(node, "meta", None) or {}
    custom = meta.get("custom")
    for holder in (custom if isinstance(custom, dict) else {}, meta):
        fqn = holder.get("module_fqn")
        if isinstance(fqn, str):
            return normalize_fqn(fqn)
    stack = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, (tuple, list)) else str(last)
    return stack_module(path) if isinstance(path, str) else ""
