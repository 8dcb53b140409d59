"""Small pieces of the records capture writes, shared by every manifest source (the eager FSDP2
hooks, the compiled-graph walk, eager DTensor collectives, the parameter table) so that each
field is spelled one way. Standard library only (a dtype is formatted from its ``str``).
"""

from __future__ import annotations

from typing import Any


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"`` (the artifact's dtype spelling)."""
    return str(dtype).removeprefix("torch.")


def common_module(fqns) -> str:
    """The longest module prefix shared by parameter names (``a.b.w``, ``a.b.c.w`` -> ``a.b``);
    a bucket's group when its owner is not known. Empty names are ignored."""
    mods = [f.split(".")[:-1] for f in fqns if f]
    if not mods:
        return ""
    prefix: list[str] = []
    for parts in zip(*mods):
        if all(p == parts[0] for p in parts):
            prefix.append(parts[0])
        else:
            break
    return ".".join(prefix)
