"""Parameter names that do not depend on how a model is wrapped.

Eager and compiled jobs name the same parameter differently (``_orig_mod.`` from torch.compile,
``_checkpoint_wrapped_module.`` from activation checkpointing, parametrizations, DDP's
``module.``); capture stores, and the diff compares, the normalized name. Standard library only:
the graph hook and the session both use it.
"""

from __future__ import annotations

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
