"""The FX graphs torch's bucketing passes produce, as small JSON fixtures (tests/data/
bucketing-graphs/), and the stand-in graphs the walker reads them back as.

Why: the bucketing passes' op signatures move between torch releases (2.11's
``_pre_bucket_all_gather`` takes one dtype where 2.13 takes a list of dtype indices), and CI runs
one pinned torch. Each fixture is what one torch version's passes produced for the built-in
workload (1 layer, dim 16, 2 ranks on gloo, rank 0's graphs), written by running this file on
that torch:

    for c in manual-bf16 auto-fp32; do
        torchrun --standalone --nproc_per_node 2 tests/bucketing_graphs.py OUT.json $c; done

and ``tests/test_bucketing_graphs.py`` runs parity's walker (graph_walk.extract_buckets) over
every fixture on the pinned torch, through :func:`load`. A node keeps what the walker reads: op,
operator name and argument names (its schema on the recording torch), arguments (other nodes by
name), ``meta["val"]`` shapes and dtypes, its module, and the bucketing pass's ``from_node``
marks. The buckets the fixed walker extracted on the recording torch are stored too.
"""

from __future__ import annotations

import json
import operator
import os
import sys
from types import SimpleNamespace

CONFIGS = {  # name -> the workload's arguments (beyond the tiny model)
    "manual-bf16": ["--bucketing", "manual", "--param-dtype", "bfloat16"],
    "auto-fp32": ["--bucketing", "auto"],
}
MODEL = ["--mode", "compiled", "--layers", "1", "--dim", "16", "--heads", "2", "--vocab-size", "32",
         "--seq-len", "8", "--batch-size", "1", "--steps", "1", "--bucket-order", "graph"]


# ------------------------------------------------------------------------------------ recording
def _enc(x):
    import torch

    if hasattr(x, "op") and hasattr(x, "name") and hasattr(x, "meta"):
        return {"n": x.name}
    if isinstance(x, (list, tuple)):
        return [_enc(v) for v in x]
    if isinstance(x, dict):
        return {"kw": {k: _enc(v) for k, v in x.items()}}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x)}
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, torch.SymInt):
        return int(x)
    return {"repr": repr(x)[:80]}


def _val(v):
    if isinstance(v, (list, tuple)):
        return [_val(x) for x in v]
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return {"t": [[int(s) for s in v.shape], str(v.dtype).replace("torch.", "")]}
    return None


def dump_graph(gm, input_fqns, output_fqns, graph_kind, rs_payload_fqns) -> dict:
    from parity.capture.names import node_module
    from parity.capture.sources.graph_walk import op_name

    nodes = []
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        rec = {"name": n.name, "op": n.op, "target": op_name(n) or (
                   n.target if isinstance(n.target, str) else "")}
        if n.args:
            rec["args"] = _enc(n.args)
        if n.kwargs:
            rec["kwargs"] = _enc(dict(n.kwargs))["kw"]
        val = _val(n.meta.get("val"))
        if val is not None:
            rec["val"] = val
        if schema is not None:
            rec["arg_names"] = [a.name for a in schema.arguments]
        if getattr(n.target, "is_view", False):
            rec["view"] = True
        mod = node_module(n)
        if mod:
            rec["module"] = mod
        marks = [getattr(s, "pass_name", "") for s in n.meta.get("from_node") or []]
        if any(marks):
            rec["from_node"] = marks
        nodes.append(rec)
    rs = {k.name: v for k, v in (rs_payload_fqns or {}).items() if k.graph is gm.graph}
    return {"graph_kind": graph_kind, "input_fqns": input_fqns, "output_fqns": output_fqns,
            "rs_payload_fqns": rs, "nodes": nodes}


def record(out_path: str, config: str) -> int:
    """In every rank of a 2-rank torchrun: run the workload of ``config`` with capture on,
    keeping rank 0's post-pass graphs; rank 0 adds them to ``out_path`` (one process per
    config: a second process group in one process hung on torch 2.11)."""
    import torch

    import parity.capture
    from parity.capture.sources import graph as graph_source
    from parity.workloads import train

    rank = int(os.environ.get("RANK", "0"))
    graphs: dict[str, list] = {}
    current: list = []
    original = graph_source.extract_buckets

    def recording(gm, input_fqns, output_fqns, graph_kind, **kw):
        buckets = original(gm, input_fqns, output_fqns, graph_kind, **kw)
        if kw.get("rs_payload_fqns") is not None:  # after the passes (before: None)
            rec = dump_graph(gm, input_fqns, output_fqns, graph_kind, kw.get("rs_payload_fqns"))
            rec["buckets"] = [b.to_dict() for b in buckets]
            rec["warnings"] = list(kw.get("warnings") or [])
            current.append(rec)
        return buckets

    graph_source.extract_buckets = recording
    try:
        from torch._inductor.fx_passes.bucketing import _ALL_DTYPES
        all_dtypes = [str(d) for d in _ALL_DTYPES]
    except Exception:  # noqa: BLE001
        all_dtypes = None
    for name, args in ((config, CONFIGS[config]),):
        current.clear()
        torch._dynamo.reset()
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bucketing-graphs-{name}")
        parity.capture.start(out)
        try:
            rc = train.main(MODEL + args)
        finally:
            parity.capture.stop()
        if rc:
            return rc
        graphs[name] = list(current)
    if rank == 0:
        doc = {"torch": torch.__version__, "all_dtypes": all_dtypes, "graphs": {}}
        if os.path.exists(out_path):
            with open(out_path) as f:
                doc["graphs"] = json.load(f).get("graphs", {})
        doc["graphs"].update(graphs)
        doc["graphs"] = {k: doc["graphs"][k] for k in CONFIGS if k in doc["graphs"]}
        with open(out_path, "w") as f:  # one node per line: readable, and diffs stay small
            f.write(_lines(doc))
    return 0


def _lines(doc: dict) -> str:
    head = {k: v for k, v in doc.items() if k != "graphs"}
    out = ["{" + json.dumps(head, separators=(",", ":"))[1:-1] + ',"graphs":{']
    for gi, (name, graphs) in enumerate(doc["graphs"].items()):
        out.append(json.dumps(name) + ":[")
        for j, g in enumerate(graphs):
            rest = {k: v for k, v in g.items() if k != "nodes"}
            out.append("{" + json.dumps(rest, separators=(",", ":"))[1:-1] + ',"nodes":[')
            out.append(",\n".join(json.dumps(n, separators=(",", ":")) for n in g["nodes"]))
            out.append("]}" + ("," if j < len(graphs) - 1 else ""))
        out.append("]" + ("," if gi < len(doc["graphs"]) - 1 else ""))
    out.append("}}")
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------- loading
class _Target:
    def __init__(self, name: str, arg_names: list[str] | None, view: bool):
        self._schema = SimpleNamespace(name=name, arguments=[SimpleNamespace(name=a)
                                                             for a in arg_names or []])
        self.is_view = view


class _Node:
    def __init__(self, rec: dict):
        self.name, self.op = rec["name"], rec["op"]
        self.users: dict = {}
        self.meta: dict = {}
        self.rec = rec


def _dtype(name: str):
    import torch

    return getattr(torch, name.split(".", 1)[1], None) if name.startswith("torch.") else None


def _dec(x, nodes):
    if isinstance(x, list):
        return [_dec(v, nodes) for v in x]
    if isinstance(x, dict):
        if "n" in x:
            return nodes[x["n"]]
        if "dtype" in x:
            return _dtype(x["dtype"])
        if "repr" in x:
            return x["repr"]
        if "kw" in x:
            return {k: _dec(v, nodes) for k, v in x["kw"].items()}
        return {k: _dec(v, nodes) for k, v in x.items()}
    return x


def _meta_val(v):
    if isinstance(v, list):
        return [_meta_val(x) for x in v]
    if isinstance(v, dict):
        return SimpleNamespace(shape=tuple(v["t"][0]), dtype=_dtype("torch." + v["t"][1]))
    return None


def load(graph: dict):
    """A stand-in GraphModule (``.graph.nodes``) of one fixture graph, and the name -> node map.
    Nodes have what graph_walk reads: op, target (``_schema.name`` and argument names,
    ``is_view``; ``operator.getitem``), args, kwargs, users, all_input_nodes, meta."""
    nodes = {r["name"]: _Node(r) for r in graph["nodes"]}
    order = [nodes[r["name"]] for r in graph["nodes"]]
    for node in order:
        r = node.rec
        if r["op"] == "call_function":
            node.target = operator.getitem if r["target"] == "getitem" else \
                _Target(r["target"], r.get("arg_names"), r.get("view", False))
        else:
            node.target = r["target"]
        node.args = tuple(_dec(r.get("args", []), nodes))
        node.kwargs = {k: _dec(v, nodes) for k, v in r.get("kwargs", {}).items()}
        node.meta["val"] = _meta_val(r.get("val"))
        if "module" in r:
            node.meta["module_fqn"] = r["module"]
        if "from_node" in r:
            node.meta["from_node"] = [SimpleNamespace(pass_name=p) for p in r["from_node"]]
    for node in order:
        inputs: list = []

        def walk(x):
            if isinstance(x, _Node):
                if x not in inputs:
                    inputs.append(x)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)

        walk(node.args)
        walk(node.kwargs)
        node.all_input_nodes = inputs
        for i in inputs:
            i.users[node] = None
    gm = SimpleNamespace(graph=SimpleNamespace(nodes=order))
    return gm, nodes


if __name__ == "__main__":
    sys.exit(record(sys.argv[1], sys.argv[2]))
