"""Which parameter a compiled graph's input or output is: FQNs from dynamo sources
(``L['self']._modules['layers']...``) and from aot_autograd's descriptors (``node.meta["desc"]``),
normalized by names.py. Used by the hook (graph.py) and the make_fx path (graph_makefx.py)."""

from __future__ import annotations

import re
from typing import Any

from parity.capture.names import normalize_fqn


_BRACKET_KEY = re.compile(r"\[\s*(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\s*\]")


def source_to_fqn(name: str) -> str | None:
    """Dynamo source name of a parameter -> normalized FQN, else None.

    ``L['self']._modules['layers']._modules['0']._parameters['weight']`` ->
    ``layers.0.weight``. The root (``L['self']``, ``L['model']``,
    ``G['model']``...) is dropped; sources that do not end in a
    ``_parameters[...]`` access (data inputs, buffers) are not parameters.
    """
    if "_parameters[" not in name:
        return None
    m = re.match(r"^\s*[LG]\[[^\]]*\]", name)
    rest = name[m.end() :] if m else name
    parts: list[str] = []
    pos = 0
    while pos < len(rest):
        ch = rest[pos]
        if ch == ".":
            end = pos + 1
            while end < len(rest) and (rest[end].isalnum() or rest[end] == "_"):
                end += 1
            attr = rest[pos + 1 : end]
            if attr not in ("_modules", "_parameters", "_buffers"):
                parts.append(attr)
            pos = end
        elif ch == "[":
            km = _BRACKET_KEY.match(rest, pos)
            if km is None:
                return None
            parts.append(next(g for g in km.groups() if g is not None))
            pos = km.end()
        else:
            return None
    return normalize_fqn(".".join(parts)) or None


def dynamo_input_fqns(gm: Any) -> list[str | None]:
    """Per placeholder of a dynamo graph (aot's ``PlainAOTInput(idx)``), its parameter FQN."""
    fqns: list[str | None] = []
    graph = getattr(gm, "graph", None)
    if graph is None:
        return fqns
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node, "_dynamo_source", None)
        if source is None and "grapharg" in node.meta:
            source = getattr(node.meta["grapharg"], "source", None)
        name = getattr(source, "name", None)
        if callable(name):  # older Source.name() was a method
            name = name()
        fqns.append(source_to_fqn(name) if isinstance(name, str) else None)
    return fqns


def _desc_fqn(desc: Any, plain_fqns: list[str | None], flat_name_map: dict[str, str]) -> str | None:
    """Resolve an aot input/output descriptor to a parameter FQN.

    Unwraps ``SubclassGetAttrAOT{Input,Output}`` (only the tensor payload of a
    subclass, e.g. DTensor's ``_local_tensor``, counts) and
    ``GradAOTOutput(grad_of=...)`` down to ``ParamAOTInput(target)`` or
    ``PlainAOTInput(idx)``.
    """
    seen = 0
    while desc is not None and seen < 16:
        seen += 1
        name = type(desc).__name__
        if name in ("SubclassGetAttrAOTInput", "SubclassGetAttrAOTOutput"):
            attr = getattr(desc, "attr", "")
            if attr in ("device_mesh", "_spec", "spec"):
                return None
            desc = desc.base
        elif name == "GradAOTOutput":
            desc = desc.grad_of
        elif name == "ParamAOTInput":
            target = desc.target
            return normalize_fqn(flat_name_map.get(target, target))
        elif name == "PlainAOTInput":
            idx = desc.idx
            return plain_fqns[idx] if 0 <= idx < len(plain_fqns) else None
        else:
            return None
    return None


def graph_io_fqns(gm: Any, plain_fqns: list[str | None]) -> tuple[list[str | None], list[str | None]]:
    """(per placeholder, per output position) parameter FQN of an aot fw/bw graph."""
    flat_name_map = {}
    meta = getattr(gm, "meta", None) or {}
    if isinstance(meta.get("dynamo_flat_name_to_original_fqn"), dict):
        flat_name_map = meta["dynamo_flat_name_to_original_fqn"]
    input_fqns: list[str | None] = []
    output_fqns: list[str | None] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            input_fqns.append(_desc_fqn(node.meta.get("desc"), plain_fqns, flat_name_map))
        elif node.op == "output":
            outs = node.args[0] if node.args else ()
            outs = outs if isinstance(outs, (list, tuple)) else (outs,)
            descs = node.meta.get("desc")
            if not isinstance(descs, (list, tuple)) or len(descs) != len(outs):
                descs = [None] * len(outs)
            output_fqns = [_desc_fqn(d, plain_fqns, flat_name_map) for d in descs]
    return input_fqns, output_fqns
