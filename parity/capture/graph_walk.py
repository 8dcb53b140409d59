"""The pure FX walk: from a compiled graph to its bucket layouts (one
:class:`~parity.records.BucketRecord` per all-gather / reduce-scatter), with no hook and no state.

Buckets are recovered structurally from the collective's input (``cat`` /
``copy_(slice(buf), cat(...))`` / ``bucketing._pre_bucket_*`` / ``fsdp.all_gather_copy_in``);
which parameter each payload is comes from the FQNs of the graph's inputs and outputs
(graph_fqns.py). Nothing here assumes who built the graph.
"""

from __future__ import annotations

import operator
from typing import Any

from parity.capture.names import PROPERTY_MODULE, node_module
from parity.comm_ops import COMM_NAMESPACES
from parity.records import BucketEntry, BucketRecord, common_module, common_prefix, dtype_name


_AG_OPS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")
_AG_COALESCED_OPS = ("_c10d_functional::all_gather_into_tensor_coalesced",)
_RS_OPS = ("_c10d_functional::reduce_scatter_tensor",)
_RS_COALESCED_OPS = ("_c10d_functional::reduce_scatter_tensor_coalesced",)
_WAIT_OPS = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")
_CAT_OPS = ("aten::cat",)
_COPY_OPS = ("aten::copy_", "aten::copy")
_SPLIT_OPS = ("aten::split_with_sizes", "aten::split", "aten::split_with_sizes_copy")
_PRE_AG_OPS = ("bucketing::_pre_bucket_all_gather",)
_PRE_RS_OPS = ("bucketing::_pre_bucket_reduce_scatter",)
_FSDP_COPY_IN_OPS = ("fsdp::all_gather_copy_in",)


def _op_name(node: Any) -> str:
    """``namespace::name`` of a call_function node's operator, '' otherwise."""
    if getattr(node, "op", None) != "call_function":
        return ""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name
    if node.target is operator.getitem:
        return "getitem"
    if any(c.__name__ == "HigherOrderOperator" for c in type(node.target).__mro__):
        # flex_attention and its backward: compute for ``compute_before``
        return f"higher_order::{getattr(node.target, '__name__', None) or node.target.name()}"
    return ""


# Not compute, for ``compute_before``: communication, its waits, bucket plumbing (the buffer
# a bucket is packed into and split out of) and allocations; views are skipped by schema.
_PLUMBING_OPS = frozenset(
    (*_CAT_OPS, *_COPY_OPS, *_SPLIT_OPS, "aten::empty", "aten::empty_strided", "aten::new_empty",
     "aten::new_empty_strided", "aten::zeros", "aten::full", "aten::clone", "aten::contiguous",
     "aten::slice_scatter", "aten::_to_copy", "prims::convert_element_type"))


def _is_compute(node: Any) -> bool:
    """True for a call_function node that computes: not a collective, wait, getitem, view,
    cast, copy, allocation or bucket cat/split (what ``max_consec_compute_between_rs`` counts)."""
    name = _op_name(node)
    if not name or name == "getitem" or name in _PLUMBING_OPS:
        return False
    if name.split("::", 1)[0] in COMM_NAMESPACES:
        return False
    return not getattr(node.target, "is_view", False)


def _issuing_module(node: Any, own_first: bool = True) -> str | None:
    """The module a collective was issued under: the node's own module annotation, else (a
    SimpleFSDP all-gather issued from a parameter property, or a node without module meta) the
    module of the first computing node that uses its result, found through waits and views.
    ``own_first=False`` for one payload's slice of a merged bucket: the pass copies the first
    member's annotation onto the bucket's nodes, so only the slice's users say where it is used."""
    own = node_module(node)
    if own_first and own and own != PROPERTY_MODULE:
        return own
    frontier, seen = list(node.users), set()
    for _ in range(256):
        if not frontier:
            break
        cur = frontier.pop(0)
        if cur in seen:
            continue
        seen.add(cur)
        if _is_compute(cur):
            mod = node_module(cur)
            if mod and mod != PROPERTY_MODULE:
                return mod
        frontier.extend(cur.users)
    return own or None


def _val(node: Any) -> Any:
    meta = getattr(node, "meta", None)
    return meta.get("val") if meta else None


def _numel(val: Any) -> int:
    n = 1
    for s in val.shape:
        n *= int(s)
    return n


def _single_input(node: Any) -> Any:
    inputs = node.all_input_nodes
    return inputs[0] if len(inputs) == 1 else None


def _walk_back(node: Any):
    """Yield node and its chain of single-tensor-input producers (views, casts, copies)."""
    cur = node
    for _ in range(64):
        if cur is None:
            return
        yield cur
        if cur.op != "call_function":
            return
        cur = _single_input(cur)


def _placeholder_of(node: Any) -> Any:
    for cur in _walk_back(node):
        if cur.op == "placeholder":
            return cur
    return None


def _output_position(node: Any) -> int | None:
    """Follow single-user unary ops from node to the graph output; its position there."""
    cur = node
    for _ in range(64):
        users = list(cur.users)
        for user in users:
            if user.op == "output":
                outs = user.args[0] if isinstance(user.args[0], (list, tuple)) else (user.args[0],)
                for i, out in enumerate(outs):
                    if out is cur:
                        return i
                return None
        if len(users) != 1:
            return None
        user = users[0]
        if user.op != "call_function" or len(user.all_input_nodes) != 1:
            return None
        cur = user
    return None


def _split_outputs(start: Any) -> list[Any] | None:
    """From a collective's result, walk unary single-user ops to a split; per split index, its getitem."""
    cur = start
    for _ in range(64):
        users = list(cur.users)
        if len(users) != 1:
            return None
        user = users[0]
        if _op_name(user) in _SPLIT_OPS:
            pieces: dict[int, Any] = {}
            for g in user.users:
                if _op_name(g) == "getitem" and isinstance(g.args[1], int):
                    pieces[g.args[1]] = g
            if not pieces:
                return None
            return [pieces.get(i) for i in range(max(pieces) + 1)]
        if user.op != "call_function" or len(user.all_input_nodes) != 1:
            return None
        cur = user
    return None


def _payload_pieces(buffer: Any, warnings: list[str] | None = None
                    ) -> tuple[list[Any], list[Any] | None, str]:
    """Decompose a collective's input buffer into its concatenated payloads.

    Returns (pieces, dtypes or None, pattern). ``dtypes[i]`` overrides the
    piece's dtype when a bucket stores pieces bit-cast to another dtype
    (``_pre_bucket_all_gather`` with ``out_dtype_ints``). An unbucketed
    collective yields ``[buffer]``.
    """
    cur = buffer
    for _ in range(64):
        if cur is None or cur.op != "call_function":
            break
        name = _op_name(cur)
        if name in _COPY_OPS and len(cur.args) >= 2:
            cur = cur.args[1]  # copy_(slice(buf), cat(...)): the data comes from src
            continue
        if name in _CAT_OPS and isinstance(cur.args[0], (list, tuple)):
            return list(cur.args[0]), None, "cat"
        if name in _PRE_AG_OPS and isinstance(cur.args[0], (list, tuple)):
            dtypes = None
            try:
                from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

                dtypes = [_ALL_DTYPES[i] for i in cur.args[3]]
            except Exception as e:  # said: the sizes then come from the traced values' dtypes
                if warnings is not None:
                    warnings.append(f"{cur.name}: payload dtypes not read from torch's bucketing "
                                    f"pass ({type(e).__name__}: {e}); traced dtypes used")
            return list(cur.args[0]), dtypes, "pre_bucket_all_gather"
        if name in _PRE_RS_OPS and isinstance(cur.args[0], (list, tuple)):
            return list(cur.args[0]), None, "pre_bucket_reduce_scatter"
        if name in _FSDP_COPY_IN_OPS and isinstance(cur.args[0], (list, tuple)):
            return list(cur.args[0]), None, "fsdp_all_gather_copy_in"
        if name == "getitem":
            cur = cur.args[0]
            continue
        nxt = _single_input(cur)
        if nxt is None:
            break
        cur = nxt
    return [buffer], None, "single"


def _group_size(arg: Any) -> int:
    """The collective's group_size argument (a SymInt/Node in some graphs: use its hint)."""
    if isinstance(arg, int):
        return arg
    val = _val(arg)
    try:
        return int(val if val is not None else arg)
    except Exception:
        raise TypeError(f"cannot read group_size from {arg!r}") from None


def _rs_payload_map(gm: Any, output_fqns: list[str | None]) -> dict[Any, str]:
    """Before passes: map each per-parameter reduce-scatter's input chain -> FQN.

    After bucketing, the merged reduce-scatter's input list still references
    these nodes, which tells us whose gradient each payload really is (the
    output split tells where the reduced slice is written).
    """
    mapping: dict[Any, str] = {}
    for node in gm.graph.nodes:
        if _op_name(node) not in _RS_OPS:
            continue
        pos = _output_position(node)
        fqn = output_fqns[pos] if pos is not None and pos < len(output_fqns) else None
        if fqn is None:
            continue
        for cur in _walk_back(node.args[0]):
            if cur.op == "placeholder":
                break
            mapping.setdefault(cur, fqn)
    return mapping


def extract_buckets(
    gm: Any,
    input_fqns: list[str | None],
    output_fqns: list[str | None],
    graph_kind: str,
    *,
    graph_id: int = 0,
    warnings: list[str] | None = None,
    rs_payload_fqns: dict[Any, str] | None = None,
) -> list[BucketRecord]:
    """Every all-gather and reduce-scatter of ``gm`` in node order, as manifest buckets.

    ``input_fqns[i]`` is the parameter behind the i-th placeholder,
    ``output_fqns[j]`` the parameter whose gradient is the j-th output (None
    when not a parameter). Offsets are bytes in the per-rank payload: the
    all-gather's input buffer, or one rank's row of the reduce-scatter input
    (= its output chunk), the layout FSDP2's manifest uses.

    ``rs_payload_fqns`` (from a snapshot taken before the passes) identifies
    reduce-scatter payloads from the input side; an entry's ``fqn`` is then
    the parameter whose gradient sits at that offset, and a mismatch with
    the parameter its reduced slice is written to is reported in
    ``warnings``.
    """
    warnings = warnings if warnings is not None else []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Where each node sits: its index in graph order and the compute nodes before it (the
    # bucketing summary's spans and compute-between-reduce-scatters, parity/diff/bucket_summary.py).
    position: dict[Any, int] = {}
    compute_before: dict[Any, int] = {}
    computed = 0
    for i, n in enumerate(gm.graph.nodes):
        position[n] = i
        compute_before[n] = computed
        if _is_compute(n):
            computed += 1
    placeholder_fqn = {n: (input_fqns[i] if i < len(input_fqns) else None) for i, n in enumerate(placeholders)}
    buckets: list[BucketRecord] = []
    counters = {"all_gather": 0, "reduce_scatter": 0}

    def ag_fqn(piece: Any) -> str | None:
        ph = _placeholder_of(piece)
        return placeholder_fqn.get(ph) if ph is not None else None

    def output_fqn(node: Any) -> str | None:
        pos = _output_position(node)
        return output_fqns[pos] if pos is not None and pos < len(output_fqns) else None

    def input_side_fqn(piece: Any) -> str | None:
        if not rs_payload_fqns:
            return None
        for cur in _walk_back(piece):
            if cur in rs_payload_fqns:
                return rs_payload_fqns[cur]
        return None

    for node in gm.graph.nodes:
        name = _op_name(node)
        if name in _AG_OPS or name in _AG_COALESCED_OPS:
            kind = "all_gather"
        elif name in _RS_OPS or name in _RS_COALESCED_OPS:
            kind = "reduce_scatter"
        else:
            continue
        coalesced = name in _AG_COALESCED_OPS or name in _RS_COALESCED_OPS
        world_size = _group_size(node.args[1] if kind == "all_gather" else node.args[2])
        index = counters[kind]
        counters[kind] += 1
        label = f"{graph_kind} {kind} #{index} ({node.name})"

        if coalesced:
            pieces, dtypes, pattern = list(node.args[0]), None, "coalesced"
        else:
            pieces, dtypes, pattern = _payload_pieces(node.args[0], warnings)
            if pattern == "cat":
                # A plain cat may be the user's own math (e.g. the backward of
                # a split weight); it is a bucket only if the result is split
                # back into as many pieces.
                split = _split_outputs(node)
                if split is None or len(split) != len(pieces):
                    pieces, dtypes, pattern = [node.args[0]], None, "single"
        buffer_val = _val(node.args[0]) if not coalesced else None

        # Where each payload ends up (output side), by position.
        if kind == "reduce_scatter":
            if coalesced:
                by_idx = {u.args[1]: u for u in node.users if _op_name(u) == "getitem"}
                outs = [by_idx.get(i) for i in range(len(pieces))]
                wait_outs = []
                for g in outs:
                    waits = [u for u in g.users if _op_name(u) in _WAIT_OPS] if g is not None else []
                    wait_outs.append(waits[0] if waits else g)
                outs = wait_outs
            elif pattern == "single":
                outs = [node]
            else:
                outs = _split_outputs(node) or []
            if len(outs) != len(pieces):
                warnings.append(f"{label}: {len(pieces)} input payloads but {len(outs)} output slices")
                outs = (outs + [None] * len(pieces))[: len(pieces)]

        own = node_module(node)  # the collective's own annotation, when it names a module
        own = own if own and own != PROPERTY_MODULE else None
        if kind == "all_gather":  # each payload's module: where its gathered slice is used
            if coalesced:
                by_idx = {u.args[1]: u for u in node.users if _op_name(u) == "getitem"}
                ag_outs = [by_idx.get(i) for i in range(len(pieces))]
            elif pattern == "single":
                ag_outs = [node]
            else:
                ag_outs = _split_outputs(node) or []
            ag_outs = (ag_outs + [None] * len(pieces))[: len(pieces)]

        entries = []
        offset = 0
        for i, piece in enumerate(pieces):
            val = _val(piece)
            if val is None:
                warnings.append(f"{label}: payload {i} ({getattr(piece, 'name', piece)}) has no meta['val']")
                entries = []
                break
            dtype = dtypes[i] if dtypes else val.dtype
            if kind == "all_gather":
                numel = _numel(val)
                fqn = ag_fqn(piece)
                ph = _placeholder_of(piece)
                shape = list(_val(ph).shape) if ph is not None and _val(ph) is not None else list(val.shape)
            else:
                numel = _numel(val) // world_size
                out_node = outs[i]
                out_fqn = output_fqn(out_node) if out_node is not None else None
                in_fqn = input_side_fqn(piece)
                fqn = in_fqn or out_fqn
                if in_fqn and out_fqn and in_fqn != out_fqn:
                    warnings.append(
                        f"{label}: payload at offset {offset} is the gradient of {in_fqn} "
                        f"but its reduced slice is written to {out_fqn}"
                    )
                final = _output_node_value(out_node)
                if final is not None:
                    shape = list(final.shape)
                else:
                    full = list(val.shape)
                    shape = [full[0] // world_size, *full[1:]] if full else []
            if kind == "all_gather":
                out = ag_outs[i]
                module = _issuing_module(out, own_first=out is node) if out is not None else None
            else:  # the module whose backward produced the gradient
                module = next((node_module(c) for c in _walk_back(piece) if _is_compute(c)), None)
            size = numel * dtype.itemsize
            if fqn is None:
                warnings.append(f"{label}: payload {i} at offset {offset} not traced to a parameter")
            entries.append(BucketEntry(
                fqn, offset, size, numel, dtype_name(dtype), shape,
                module=(module if module and module != PROPERTY_MODULE else None)
                or (own if len(pieces) == 1 else None)))
            offset += size

        if buffer_val is not None:
            bucket_dtype = buffer_val.dtype
            total = _numel(buffer_val) * bucket_dtype.itemsize
            if kind == "reduce_scatter":
                total //= world_size
            if entries and total != offset:
                warnings.append(f"{label}: entries cover {offset} bytes of a {total}-byte payload")
        else:
            bucket_dtype = _val(pieces[0]).dtype if pieces and _val(pieces[0]) is not None else None
            total = offset

        sources = node.meta.get("from_node") or []
        bucketed_from = [s for s in sources if getattr(s, "pass_name", "") == "bucketing_pass"]
        if bucketed_from and len(bucketed_from) != len(entries):
            warnings.append(f"{label}: from_node lists {len(bucketed_from)} collectives, found {len(entries)} payloads")

        # A merged bucket is issued under the innermost module holding every payload's module
        # ("" the root); a single collective under its own annotation when it has one.
        # A merged bucket's own annotation is its first member's (copied by the pass).
        common = common_prefix([e.module for e in entries])
        bucket_module = own if (own is not None and len(entries) == 1) or common is None else common
        buckets.append(BucketRecord(
            "graph", kind, index, entries, graph=graph_kind, graph_id=graph_id, node=node.name,
            group=common_module([e.fqn for e in entries]),
            dtype=dtype_name(bucket_dtype) if bucket_dtype is not None else "",
            world_size=world_size, total_bytes=total, position=position[node],
            compute_before=compute_before[node], module=bucket_module))
    return buckets


def _output_node_value(node: Any) -> Any:
    """The value reaching the graph output from ``node`` (the local shard), if any."""
    if node is None:
        return None
    cur = node
    for _ in range(64):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            return _val(cur)
        if len(users) != 1 or users[0].op != "call_function" or len(users[0].all_input_nodes) != 1:
            return None
        cur = users[0]
    return None
