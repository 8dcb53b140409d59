"""A graph with its higher-order-op subgraphs inlined: the collectives a pass nested in them seen
as if the graph were flat (manifests, counts, spans, attribution).

Why: passes nest operations in subgraphs. Inductor's overlap scheduling with
``insert_overlap_deps`` (``torch/_inductor/fx_passes/control_dependencies.py``,
``preserve_node_ordering``, torch 2.13) replaces a node by ``control_deps(deps, subgraph, *args)``
whose subgraph holds the original node (its name and meta kept on the wrapper, its meta copied
onto the inner node): collectives, their waits, matmuls, even getitems and clones. A walk of the
top-level nodes alone misses them (AutoParallel's overlap-scheduled llama3: forward all-gathers
29 -> 10 counted as 29 -> 7). ``invoke_subgraph`` (nested compile regions), ``wrap`` and
``tag_activation_checkpoint`` nest a region the same way: called once, in place.

:func:`flatten` copies the graph into a new one (the job's graph is only read), replacing each
such call by its subgraph's nodes, placeholders bound to the call's operands and the call's
result to the subgraph's output, recursively. Control flow (``cond``, ``while_loop``, ``scan``,
``map``, ...) runs a subgraph zero, one or many times: those calls stay, and the collectives
inside their subgraphs are added right after them, marked ``meta["parity_nested"]`` (e.g.
``cond true_graph_0``) so that a record says where it came from. Top-level nodes keep their
names; a node inlined from ``control_deps`` takes the wrapper's name (the original node's), any
other inlined node ``<call>__<inner>``, so that records of the flat graph name the nodes the
job's graph shows. Standard library and torch.fx only; torch is never imported at module level.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["flatten", "FlatGraph", "flat_nodes", "hop_name", "INLINED", "NESTED"]

# Higher-order ops whose subgraph runs exactly once per call, in place of the call.
INLINED = frozenset({"control_deps", "invoke_subgraph", "wrap", "tag_activation_checkpoint",
                     "hints_wrapper", "local_map_hop"})
NESTED = "parity_nested"  # meta key of a node copied from a control-flow subgraph


class FlatGraph:
    """What the FX walk reads of a graph module: ``graph`` (flat) and ``meta`` (the module's).
    ``nested`` says how many nodes came from control-flow subgraphs (not inlined)."""

    def __init__(self, graph: Any, meta: dict, nested: int = 0) -> None:
        self.graph = graph
        self.meta = meta
        self.nested = nested


def hop_name(node: Any) -> str | None:
    """The name of a higher-order op a call_function node calls (``control_deps``), else None."""
    if getattr(node, "op", None) != "call_function":
        return None
    target = node.target
    if not any(c.__name__ == "HigherOrderOperator" for c in type(target).__mro__):
        return None
    name = getattr(target, "_name", None) or getattr(target, "__name__", None)
    if not isinstance(name, str):
        try:
            name = target.name()
        except Exception:  # noqa: BLE001
            name = type(target).__name__
    return name


def _subgraph(owner: Any, arg: Any) -> Any:
    """The GraphModule a ``get_attr`` argument names on ``owner``, else None."""
    if getattr(arg, "op", None) != "get_attr" or owner is None:
        return None
    obj = owner
    for part in str(arg.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "graph") and hasattr(obj.graph, "nodes") else None


def _node_leaves(x: Any, out: list) -> list:
    if hasattr(x, "op") and hasattr(x, "users"):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _node_leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _node_leaves(y, out)
    return out


def _calls(node: Any, owner: Any) -> tuple[list[tuple[int, Any]], list[Any]]:
    """(subgraphs ``[(arg index, GraphModule)]``, operands) of a higher-order call: the operands
    are the Node leaves after the last subgraph argument (``control_deps``' deps, ``cond``'s
    predicate and anything before the subgraphs are not operands), kwargs last."""
    subs = [(i, g) for i, g in ((i, _subgraph(owner, a)) for i, a in enumerate(node.args))
            if g is not None]
    if not subs:
        return [], []
    last = subs[-1][0]
    operands: list = []
    for a in node.args[last + 1:]:
        _node_leaves(a, operands)
    _node_leaves(dict(node.kwargs), operands)
    return subs, operands


def has_subgraphs(gm: Any) -> bool:
    """Whether any higher-order call of ``gm`` has a GraphModule subgraph."""
    for node in gm.graph.nodes:
        if hop_name(node) is not None and _calls(node, gm)[0]:
            return True
    return False


def flatten(gm: Any) -> Any:
    """``gm`` itself when nothing is nested (or it is flat already), else a :class:`FlatGraph`."""
    if isinstance(gm, FlatGraph) or not has_subgraphs(gm):
        return gm
    import torch.fx as fx

    g = fx.Graph()
    counter = {"nested": 0}
    _copy(gm.graph, gm, g, {}, None, None, counter)
    return FlatGraph(g, dict(getattr(gm, "meta", None) or {}), counter["nested"])


def _copy(src: Any, owner: Any, g: Any, env: dict, prefix: str | None, nested: str | None,
          counter: dict, rename: str | None = None) -> Any:
    """Copy ``src``'s nodes into ``g``: top level (``prefix`` None) placeholders and output
    included; a subgraph's placeholders must be bound in ``env`` and its output is returned."""
    body = [n for n in src.nodes if n.op not in ("placeholder", "output")]
    single = rename if rename is not None and sum(1 for n in body
                                                  if n.op == "call_function") == 1 else None
    for node in src.nodes:
        if node.op == "placeholder" and prefix is not None:
            continue  # bound by the caller
        if node.op == "output" and prefix is not None:
            return _map(node.args[0], env)
        name = hop_name(node)
        subs, operands = _calls(node, owner) if name is not None else ([], [])
        if subs and name in INLINED and len(subs) == 1:
            sub = subs[0][1]
            phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            if len(phs) == len(operands):
                inner = dict(zip(phs, (_map(o, env) for o in operands)))
                env[node] = _copy(sub.graph, sub, g, inner, node.name, nested, counter,
                                  rename=node.name if name == "control_deps" else None)
                continue
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env.get(node.args[0]), (list, tuple)):
            env[node] = env[node.args[0]][node.args[1]]  # a getitem of an inlined tuple
            continue
        new = g.node_copy(node, lambda n: _map(n, env))
        if prefix is not None:
            new._rename(single if (single is not None and node.op == "call_function")
                        else f"{prefix}__{node.name}")
            if nested is not None:
                new.meta = {**new.meta, NESTED: nested}
                counter["nested"] += 1
        env[node] = new
        for i, sub in subs:  # control flow: its collectives, right after the call
            label = f"{name} {node.args[i].target}"
            phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            inner = {ph: (_map(operands[k], env) if len(phs) == len(operands)
                          else _stand_in(g, ph, f"{node.name}__{ph.name}"))
                     for k, ph in enumerate(phs)}
            _copy(sub.graph, sub, g, inner, f"{node.name}__{node.args[i].target}",
                  label, counter)
    return None


def _stand_in(g: Any, ph: Any, name: str) -> Any:
    """A subgraph input that cannot be bound to the call's operands: an opaque node with the
    placeholder's meta (a payload walked back to it is traced to no parameter)."""
    node = g.create_node("get_attr", name, name=name)
    node.meta = dict(ph.meta)
    return node


def _map(x: Any, env: dict) -> Any:
    if hasattr(x, "op") and hasattr(x, "users"):
        return env.get(x, x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, env) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, env) for k, v in x.items()}
    return x


def flat_nodes(gm: Any):
    """Every node of ``gm`` and of its subgraphs in execution order, without copying: an
    inlined call is replaced by its subgraph's nodes, a control-flow call is followed by them.
    For counting (graph_passes.py); placeholders and outputs of subgraphs are left out."""
    yield from _walk(gm.graph, gm, top=True)


def _walk(graph: Any, owner: Any, top: bool):
    for node in graph.nodes:
        if not top and node.op in ("placeholder", "output"):
            continue
        name = hop_name(node)
        subs = _calls(node, owner)[0] if name is not None else []
        if not (subs and name in INLINED and len(subs) == 1):
            yield node
        for _, sub in subs:
            yield from _walk(sub.graph, sub, top=False)
