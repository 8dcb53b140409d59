"""Which parameter's gradient a reduction in a graph reaches, searched along every path forward:
shared by the aot_autograd hook (graph.py) and the make_fx path (graph_makefx.py), which import
it (graph_makefx imports graph, so the search cannot live in either without an import cycle).

Standard library, torch.fx graphs and the graph modules below only.
"""

from __future__ import annotations

from typing import Any

from parity.capture.sources import graph_flat, graph_walk

__all__ = ["reduce_scatter_targets"]


def reduce_scatter_targets(gm: Any, output_fqns: list[str | None], *,
                           limit: int = 4096) -> dict[str, str]:
    """Each reduce-scatter's (and all-reduce's) input chain (node names) -> the parameter whose
    gradient output it reaches.

    graph.py follows a reduce-scatter's result to the output through unary ops only; a joint
    graph accumulates some gradients first (chunked loss: lm_head's gradient is the sum of
    one reduce-scatter per chunk), so here every path forward is searched. Only an answer that
    names exactly one parameter is kept, and only if the collective's payload has at least as
    many elements as that gradient output: a statistic reduced on the way to one gradient (loss
    parallel's per-token max and sum of exponentials under tensor parallelism, 32 floats that
    reach only lm_head's gradient) is not the gradient (round 9c). Reads the flat graph
    (graph_flat.py)."""
    gm = graph_flat.flatten(gm)
    out_node = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out_node is None:
        return {}
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else (out_node.args[0],)
    position: dict[Any, list[int]] = {}
    for i, o in enumerate(outs):
        position.setdefault(o, []).append(i)
    mapping: dict[str, str] = {}
    for node in gm.graph.nodes:
        if graph_walk.op_name(node) not in graph_walk.REDUCING_OPS:
            continue
        found: set[str] = set()
        reached: list[Any] = []  # the gradient outputs reached
        seen = {node}
        todo = [node]
        while todo and len(seen) < limit:
            cur = todo.pop()
            for i in position.get(cur, ()):
                if i < len(output_fqns) and output_fqns[i]:
                    found.add(output_fqns[i])
                    reached.append(cur)
            for u in cur.users:
                if u not in seen and u.op != "output":
                    seen.add(u)
                    todo.append(u)
        if len(found) == 1 and not _smaller_than(node.args[0], reached):
            fqn = found.pop()
            for cur in graph_walk.walk_back(node.args[0]):
                if cur.op == "placeholder":
                    break
                mapping.setdefault(cur.name, fqn)
    return mapping


def _numel(node: Any) -> int | None:
    val = getattr(node, "meta", {}).get("val")
    try:
        return int(val.numel()) if val is not None else None
    except Exception:  # noqa: BLE001 - symbolic sizes: unknown
        return None


def _smaller_than(payload: Any, outputs: list[Any]) -> bool:
    """The payload has fewer elements than the smallest gradient output it reaches (unknown
    sizes: False, the name stays)."""
    have = _numel(payload)
    sizes = [n for n in map(_numel, outputs) if n is not None]
    return have is not None and bool(sizes) and have < min(sizes)
