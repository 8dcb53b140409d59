"""The pure FX walk: from a compiled graph to its bucket layouts (one
:class:`~parity.records.BucketRecord` per all-gather / reduce-scatter / all-reduce), with no hook
and no state.

Buckets are recovered structurally from the collective's input (``cat`` /
``copy_(slice(buf), cat(...))`` / ``_foreach_copy_`` into ``split(slice(buf))`` /
``bucketing._pre_bucket_*`` / ``fsdp.all_gather_copy_in``);
which parameter each payload is comes from the FQNs of the graph's inputs and outputs
(graph_fqns.py). Nothing here assumes who built the graph.

Public, for the other graph modules: ``extract_buckets``, ``rs_payload_map`` (graph.py),
``op_name``, ``collective_kind``, ``walk_back``, the operator tuples (graph_makefx.py,
graph_passes.py), ``JointPhase`` (graph_makefx.py, graph_passes.py, ops.py), ``is_compute``.

All-reduces (``_c10d_functional.all_reduce`` and ``all_reduce_coalesced``, and their in-place
forms) are recorded as the c10d source records eager ones (capture/sources/c10d_allreduce.py):
collective ``all_reduce``, offsets in bytes in the flat buffer (the whole buffer: every rank
holds all of it), one entry per piece in buffer order, each piece the parameter whose gradient
it is (the output its reduced slice reaches, or before the passes its input chain), the op as the
graph says it (``extra["op"]``), the group's size, for a sub-group its ranks (``extra["ranks"]``)
and for ``all_reduce_coalesced`` ``extra["coalesced"]``. Inductor's
bucketing (``bucket_all_reduce``, torch 2.13 ``torch/_inductor/fx_passes/bucketing.py``
``all_reduce_merge_fn_to_trace``) packs a bucket as ``cat([x.reshape(-1) ...])`` and splits the
reduced buffer back: the ``cat`` pattern below. A loss or metric all-reduce carries no parameter:
its payload is classified ``activation`` (or ``token`` for integer counts), as for all-gathers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from parity.capture.names import PROPERTY_MODULE, node_module
from parity.capture.sources.graph_flat import NESTED, flatten
from parity.capture.sources.manifest_source import sub_group_ranks
from parity.comm_ops import COMM_NAMESPACES
from parity.records import (ABSENT, SOURCE_GRAPH, BucketEntry, BucketRecord, common_module,
                            common_prefix, dtype_name)


AG_OPS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")
AG_COALESCED_OPS = ("_c10d_functional::all_gather_into_tensor_coalesced",)
RS_OPS = ("_c10d_functional::reduce_scatter_tensor",)
RS_COALESCED_OPS = ("_c10d_functional::reduce_scatter_tensor_coalesced",)
# ``all_reduce_`` / ``all_reduce_coalesced_``: inductor's reinplacing pass turns the functional
# forms into these (torch/_inductor/fx_passes/reinplace.py, ``inplaceable_collective_ops``, 2.13)
AR_OPS = ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_")
AR_COALESCED_OPS = ("_c10d_functional::all_reduce_coalesced",
                    "_c10d_functional::all_reduce_coalesced_")
REDUCING_OPS = (*RS_OPS, *AR_OPS)  # a gradient's reduction: rs_payload_map, reduce_scatter_targets
_WAIT_OPS = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")
_CAT_OPS = ("aten::cat",)
_COPY_OPS = ("aten::copy_", "aten::copy")
_SPLIT_OPS = ("aten::split_with_sizes", "aten::split", "aten::split_with_sizes_copy")
_PRE_AG_OPS = ("bucketing::_pre_bucket_all_gather",)
_PRE_RS_OPS = ("bucketing::_pre_bucket_reduce_scatter",)
_FSDP_COPY_IN_OPS = ("fsdp::all_gather_copy_in",)


def op_name(node: Any) -> str:
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


def is_compute(node: Any) -> bool:
    """True for a call_function node that computes: not a collective, wait, getitem, view,
    cast, copy, allocation or bucket cat/split (what ``max_consec_compute_between_rs`` counts)."""
    name = op_name(node)
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
        if is_compute(cur):
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


def walk_back(node: Any):
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
    for cur in walk_back(node):
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
    """From a collective's result, walk unary single-user ops to a split; per split index, its
    getitem (or, for ``split_with_sizes_copy(..., out=[...])``, each out tensor's base)."""
    cur = start
    for _ in range(64):
        users = list(cur.users)
        if len(users) != 1:
            return None
        user = users[0]
        if op_name(user) in _SPLIT_OPS:
            bases = _out_bases(user)
            if bases is not None:
                return bases
            pieces: dict[int, Any] = {}
            for g in user.users:
                if op_name(g) == "getitem" and isinstance(g.args[1], int):
                    pieces[g.args[1]] = g
            if not pieces:
                return None
            return [pieces.get(i) for i in range(max(pieces) + 1)]
        if user.op != "call_function" or len(user.all_input_nodes) != 1:
            return None
        cur = user
    return None


def _out_bases(split: Any) -> list[Any] | None:
    """The tensors a ``split_with_sizes_copy(..., out=[...])`` writes each slice into, each
    followed back through views to what it views (torch 2.15's all-gather bucket: each slice
    copied into ``alias(view(view(empty)))``, whose ``empty`` the model then reads through
    other views); None for a split without ``out``."""
    outs = split.kwargs.get("out") if getattr(split, "kwargs", None) else None
    if not isinstance(outs, (list, tuple)) or not outs:
        return None
    bases = []
    for out in outs:
        base = out
        for base in walk_back(out):
            if not getattr(base.target, "is_view", False):
                break
        bases.append(base)
    return bases


def _payload_pieces(buffer: Any, warnings: list[str] | None = None
                    ) -> tuple[list[Any], list[Any] | None, str]:
    """Decompose a collective's input buffer into its concatenated payloads.

    Returns (pieces, dtypes or None, pattern). ``dtypes[i]`` overrides the
    piece's dtype when a bucket stores pieces bit-cast to another dtype
    (``_pre_bucket_all_gather`` with ``out_dtype_ints``). An unbucketed
    collective yields ``[buffer]``.
    """
    foreach = _foreach_copied(buffer)
    if foreach is not None:
        return foreach[0], foreach[1], "foreach_copy"
    cur, cast_to = buffer, None
    for _ in range(64):
        if cur is None or cur.op != "call_function":
            break
        name = op_name(cur)
        if name in _COPY_OPS and len(cur.args) >= 2:
            # copy_(slice(buf), cat(...)): the data comes from src, in the destination's dtype
            # (the copy casts: torch 2.13's default-mode all-gather bucket takes the fp32
            # shards and copies their cat into a bf16 buffer, the cast before the collective
            # folded into the bucket)
            if cast_to is None:
                cast_to = getattr(_val(cur.args[0]), "dtype", None)
            cur = cur.args[1]
            continue
        if name in _CAT_OPS and isinstance(cur.args[0], (list, tuple)):
            pieces = list(cur.args[0])
            cat_val = _val(cur)
            if cast_to is not None and cat_val is not None and cat_val.dtype != cast_to:
                return pieces, [cast_to] * len(pieces), "cat"
            return pieces, None, "cat"
        if name in _PRE_AG_OPS and isinstance(cur.args[0], (list, tuple)):
            dtypes = None
            try:
                dtypes = _pre_bucket_dtypes(cur, len(cur.args[0]))
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


def _foreach_copied(buffer: Any) -> tuple[list[Any], list[Any]] | None:
    """(sources, dtypes) when ``buffer`` is filled in place by one ``_foreach_copy_`` into its
    ``split_with_sizes`` pieces, in split order; None otherwise. torch 2.11's default-mode
    all-gather bucketing (``torch/_inductor/fx_passes/bucketing.py``,
    ``merge_all_gather_bucket``) writes its payloads so, into a slice of the output buffer; a
    payload's dtype is its destination piece's (the copy casts)."""
    if buffer is None or getattr(buffer, "op", None) != "call_function":
        return None
    for split in buffer.users:
        if op_name(split) not in _SPLIT_OPS:
            continue
        pieces = {g.args[1]: g for g in split.users
                  if op_name(g) == "getitem" and isinstance(g.args[1], int)}
        if not pieces or set(pieces) != set(range(len(pieces))):
            continue
        sources, dtypes = [], []
        for i in range(len(pieces)):
            g = pieces[i]
            copy = next((u for u in g.users if op_name(u) == "aten::_foreach_copy_"), None)
            if copy is None or g not in copy.args[0]:
                return None
            sources.append(copy.args[1][list(copy.args[0]).index(g)])
            val = _val(g)
            dtypes.append(val.dtype if val is not None else None)
        return sources, (dtypes if None not in dtypes else None)
    return None


def _pre_bucket_dtypes(node: Any, n: int) -> list[Any]:
    """The dtype each payload of a ``bucketing::_pre_bucket_all_gather`` node is copied in,
    read by the op's own argument names (its schema), which moved between torch versions
    (``torch/_inductor/fx_passes/bucketing.py``, ``_pre_bucket_all_gather``):

    * 2.11: ``(ag_ins, group_size, group_name, dtype, rank)``: every payload is cast to the
      one bucket ``dtype``;
    * later: ``(ag_ins, group_size, [group_name,] dtype, out_dtype_ints, rank, ...)``: payload
      i in ``_ALL_DTYPES[out_dtype_ints[i]]`` (indices into that torch's own dtype tuple).
    """
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs or {})
    ints = bound.get("out_dtype_ints")
    if ints is not None:
        from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

        return [_ALL_DTYPES[i] for i in ints]
    dtype = bound.get("dtype")
    if dtype is None or not hasattr(dtype, "itemsize"):
        raise TypeError(f"no out_dtype_ints or dtype argument in {names or 'its arguments'}")
    return [dtype] * n


def _group_size(arg: Any) -> int:
    """The collective's group_size argument (a SymInt/Node in some graphs: use its hint)."""
    if isinstance(arg, int):
        return arg
    val = _val(arg)
    try:
        return int(val if val is not None else arg)
    except Exception:
        raise TypeError(f"cannot read group_size from {arg!r}") from None


def rs_payload_map(gm: Any, output_fqns: list[str | None]) -> dict[str, str]:
    """Before passes: map each per-parameter reduce-scatter's (or all-reduce's) input chain
    (node names) -> FQN.

    After bucketing, the merged collective's input list still references
    these nodes, which tells us whose gradient each payload really is (the
    output split tells where the reduced slice is written). Keyed by name: the
    flat copy of the graph after the passes (graph_flat.py) has other node
    objects with the same names.
    """
    mapping: dict[str, str] = {}
    for node in flatten(gm).graph.nodes:
        if op_name(node) not in REDUCING_OPS:
            continue
        pos = _output_position(node)
        fqn = output_fqns[pos] if pos is not None and pos < len(output_fqns) else None
        if fqn is None:
            continue
        for cur in walk_back(node.args[0]):
            if cur.op == "placeholder":
                break
            mapping.setdefault(cur.name, fqn)
    return mapping


def extract_buckets(
    gm: Any,
    input_fqns: list[str | None],
    output_fqns: list[str | None],
    graph_kind: str,
    *,
    graph_id: int = 0,
    warnings: list[str] | None = None,
    rs_payload_fqns: dict[str, str] | None = None,
) -> list[BucketRecord]:
    """Every all-gather, reduce-scatter and all-reduce of ``gm`` in node order, as manifest
    buckets, those a pass nested in higher-order-op subgraphs included (the walk reads
    graph_flat.flatten(gm)).

    ``input_fqns[i]`` is the parameter behind the i-th placeholder,
    ``output_fqns[j]`` the parameter whose gradient is the j-th output (None
    when not a parameter). Offsets are bytes in the per-rank payload: the
    all-gather's input buffer, or one rank's row of the reduce-scatter input
    (= its output chunk), the layout FSDP2's manifest uses; an all-reduce's
    whole buffer (the layout the c10d source records for eager all-reduces).

    ``rs_payload_fqns`` (from a snapshot taken before the passes) identifies
    reduce-scatter payloads from the input side; an entry's ``fqn`` is then
    the parameter whose gradient sits at that offset, and a mismatch with
    the parameter its reduced slice is written to is reported in
    ``warnings``.

    Per collective, in this order: its payloads (:func:`_payloads`), where each one ends up
    (:func:`_payload_outputs`), one entry per payload (:func:`_entries`), the bucket's total
    (:func:`_bucket_total`), the passes' own account (:func:`_check_from_node`), the module it
    was issued under (:func:`_bucket_module`).
    """
    warnings = warnings if warnings is not None else []
    gm = flatten(gm)
    places = _NodePlaces.of(gm)
    names = _PayloadNames.of(gm, input_fqns, output_fqns, rs_payload_fqns)
    counters = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    buckets: list[BucketRecord] = []
    for node in gm.graph.nodes:
        found = collective_kind(op_name(node))
        if found is None:
            continue
        kind, coalesced = found
        index = counters[kind]
        counters[kind] += 1
        buckets.append(_bucket(node, kind, coalesced, index, graph_kind, graph_id, places, names,
                               warnings))
    return buckets


def max_consec_compute_between_rs(gm: Any) -> int:
    """AutoParallel's ``_max_consec_compute_between_rs`` (meta-pytorch/autoparallel,
    ``autoparallel/graph_passes/auto_bucketing.py``, a54c252; the regression figure of #481) on the
    flat graph (graph_flat.py): the longest run of compute nodes not interrupted by a
    reduce-scatter, walking call_function nodes in order. A compute node is torch's
    ``overlap_scheduling.is_compute_node``: its target has a FLOP formula in
    ``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions, attention; torch 2.13
    ``_get_flop_registry_key``, reproduced here: importing the scheduler costs seconds); a
    reduce-scatter is a target whose name says ``reduce_scatter`` and not ``wait``.

    AutoParallel computes it on the graph its overlap scheduler returns, before inductor wraps
    nodes in ``control_deps``; the flat graph is that graph again (each wrapper replaced by the
    node it holds), so the figure is AutoParallel's on overlap-scheduled graphs too. It counts
    matmul-like nodes only, where parity's ``compute_before`` counts every non-plumbing op."""
    from torch.utils.flop_counter import flop_registry

    max_run = cur = 0
    for n in flatten(gm).graph.nodes:
        if n.op != "call_function":
            continue
        target = n.target
        key = getattr(target, "overloadpacket", None)
        if key in flop_registry or (key is None and _hashable(target) and target in flop_registry):
            cur += 1
            max_run = max(max_run, cur)
        elif "reduce_scatter" in str(target) and "wait" not in str(target):
            cur = 0
    return max_run


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def graph_figures(gm: Any, buckets: list[BucketRecord]) -> None:
    """The figures of a graph after its passes, on its reduce-scatter records (in place):
    AutoParallel's ``max_consec_compute_between_rs`` (see above); none without a
    reduce-scatter."""
    rs = [b for b in buckets if b.collective == "reduce_scatter"]
    if not rs:
        return
    value = max_consec_compute_between_rs(gm)
    for b in rs:
        b.extra["max_consec_compute_between_rs"] = value


def collective_kind(name: str) -> tuple[str, bool] | None:
    """``(kind, coalesced)`` of an operator name (op_name): kind ``all_gather``,
    ``reduce_scatter`` or ``all_reduce``; None for any other operator."""
    if name in AG_OPS or name in AG_COALESCED_OPS:
        return "all_gather", name in AG_COALESCED_OPS
    if name in RS_OPS or name in RS_COALESCED_OPS:
        return "reduce_scatter", name in RS_COALESCED_OPS
    if name in AR_OPS or name in AR_COALESCED_OPS:
        return "all_reduce", name in AR_COALESCED_OPS
    return None


class JointPhase:
    """The phase of each node of a make_fx joint graph, asked in graph order: ``phase(node)``.

    A node traced under autograd's backward carries ``meta["autograd_backward"]``; a node made
    by a pass may not: it then counts as backward from the first backward node on. One rule for
    the bucket labels (graph_makefx.split_joint), the pass counts (graph_passes) and the op
    records (ops.py)."""

    def __init__(self) -> None:
        self.in_backward = False

    def __call__(self, node: Any) -> str:
        flag = node.meta.get("autograd_backward")
        if flag:
            self.in_backward = True
        return "backward" if (flag or (flag is None and self.in_backward)) else "forward"


@dataclass
class _NodePlaces:
    """Where each node sits: its index in graph order and the compute nodes before it (the
    bucketing summary's spans and compute-between-reduce-scatters, parity/diff/bucket_summary.py)."""

    position: dict[Any, int]
    compute_before: dict[Any, int]

    @classmethod
    def of(cls, gm: Any) -> "_NodePlaces":
        position: dict[Any, int] = {}
        compute_before: dict[Any, int] = {}
        computed = 0
        for i, n in enumerate(gm.graph.nodes):
            position[n] = i
            compute_before[n] = computed
            if is_compute(n):
                computed += 1
        return cls(position, compute_before)


@dataclass
class _PayloadNames:
    """Which parameter a payload is: the graph input it comes from (all-gather), the graph
    output its reduced slice reaches or, before the passes, its input chain (reduce-scatter)."""

    placeholder_fqn: dict[Any, str | None]
    output_fqns: list[str | None]
    rs_payload_fqns: dict[str, str] | None  # node name -> FQN (rs_payload_map)

    @classmethod
    def of(cls, gm: Any, input_fqns: list[str | None], output_fqns: list[str | None],
           rs_payload_fqns: dict[str, str] | None) -> "_PayloadNames":
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return cls({n: (input_fqns[i] if i < len(input_fqns) else None)
                    for i, n in enumerate(placeholders)}, output_fqns, rs_payload_fqns)

    def of_input(self, placeholder: Any) -> str | None:
        return self.placeholder_fqn.get(placeholder) if placeholder is not None else None

    def of_output(self, node: Any) -> str | None:
        pos = _output_position(node)
        return self.output_fqns[pos] if pos is not None and pos < len(self.output_fqns) else None

    def of_reduce_input(self, piece: Any) -> str | None:
        if not self.rs_payload_fqns:
            return None
        for cur in walk_back(piece):
            if cur.name in self.rs_payload_fqns:
                return self.rs_payload_fqns[cur.name]
        return None


def _bucket(node: Any, kind: str, coalesced: bool, index: int, graph_kind: str, graph_id: int,
            places: _NodePlaces, names: _PayloadNames, warnings: list[str]) -> BucketRecord:
    """One collective node as a bucket record."""
    label = f"{graph_kind} {kind} #{index} ({node.name})"
    extra: dict[str, Any] = {}
    if kind == "all_reduce":
        world_size = _all_reduce_group(node, extra, label, warnings)
        if coalesced:  # one collective per payload in one NCCL group, as the c10d source says
            extra["coalesced"] = True
    else:
        world_size = _group_size(node.args[1] if kind == "all_gather" else node.args[2])
        if kind == "reduce_scatter":
            _reduce_op(node, _bound(node), extra)
        ranks = _sub_group_ranks(node, kind)
        if ranks:
            extra["ranks"] = ranks
    pieces, dtypes, pattern = _payloads(node, coalesced, warnings)
    outs = _payload_outputs(node, kind, coalesced, pattern, len(pieces), label, warnings)
    own = node_module(node)  # the collective's own annotation, when it names a module
    own = own if own and own != PROPERTY_MODULE else None
    entries, offset = _entries(node, kind, pieces, dtypes, outs, world_size, own, label, names,
                               warnings)
    bucket_dtype, total = _bucket_total(node, kind, coalesced, pieces, entries, offset,
                                        world_size, label, warnings)
    _check_from_node(node, entries, label, warnings)
    if node.meta.get(NESTED):  # inside a control-flow subgraph (cond, while_loop, ...)
        extra["nested"] = node.meta[NESTED]
    return BucketRecord(
        SOURCE_GRAPH, kind, index, entries, graph=graph_kind, graph_id=graph_id, node=node.name,
        group=common_module([e.fqn for e in entries]),
        dtype=dtype_name(bucket_dtype) if bucket_dtype is not None else "",
        world_size=world_size, total_bytes=total, position=places.position[node],
        compute_before=places.compute_before[node], extra=extra, module=_bucket_module(
            None if kind != "all_gather" and any(e.fqn for e in entries) else own, entries))


def _bound(node: Any) -> dict:
    """A collective node's arguments by name (its schema's), positional and keyword."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs or {})
    return bound


def _reduce_op(node: Any, bound: dict, extra: dict) -> None:
    """A reduction's op as the graph says it, into ``extra["op"]`` (``avg``, ``sum``...): the
    second argument of ``_c10d_functional::reduce_scatter_tensor(Tensor input, str reduce_op,
    int group_size, str group_name)``, ``all_reduce(Tensor input, str reduce_op, Any
    group_name)`` and their coalesced forms (torch 2.6-2.15). Why: the op decides which of
    NCCL's algorithms may run (AVG on floats is PreMulSum, which PAT and NVLS do not take:
    parity/nccl/api.py), so the reduction model reads it; unrecorded, it counts as a SUM."""
    op = bound.get("reduce_op", node.args[1] if len(node.args) > 1 else None)
    if isinstance(op, str):
        extra["op"] = op.lower()


def _all_reduce_group(node: Any, extra: dict, label: str, warnings: list[str]) -> int | None:
    """An all-reduce's group size (None, said, when its group is not known in this process),
    and into ``extra`` its ``op`` as the graph says it and, for a sub-group, its global
    ``ranks`` (the c10d source's fields). Its schema has no group size, only the group's name
    (``_c10d_functional::all_reduce(Tensor input, str reduce_op, Any group_name)``, torch
    2.13), resolved as the collective itself resolves it
    (``distributed_c10d._resolve_process_group``)."""
    bound = _bound(node)
    _reduce_op(node, bound, extra)
    group = bound.get("group_name", node.args[2] if len(node.args) > 2 else None)
    try:
        pg = _process_group(group)
        size = int(pg.size())
    except Exception as e:  # noqa: BLE001 - the size is unknown, not guessed
        warnings.append(f"{label}: the size of group {_group_arg(group)!r} is not known in this "
                        f"process ({type(e).__name__}: {e})")
        return None
    ranks = sub_group_ranks(pg)
    if ranks:
        extra["ranks"] = ranks
    return size


def _group_arg(group: Any) -> Any:
    """A collective's group argument as traced: a graph input stands for its traced value."""
    if hasattr(group, "op") and hasattr(group, "users"):
        return _val(group)
    return group


def _process_group(group: Any) -> Any:
    """The process group a collective's ``group_name`` argument names, resolved as the
    collective itself resolves it (``distributed_c10d._resolve_process_group``); raises where
    this process does not know it."""
    group = _group_arg(group)
    if hasattr(group, "size") and callable(group.size):
        return group
    import torch.distributed as dist

    return dist.distributed_c10d._resolve_process_group(group)


def _sub_group_ranks(node: Any, kind: str) -> list[int] | None:
    """A reduce-scatter's or all-gather's ``ranks`` (manifest_source.sub_group_ranks), or None
    where its group is the whole world or not known here (a graph read outside its job)."""
    arg = 2 if kind == "all_gather" else 3
    group = _bound(node).get("group_name", node.args[arg] if len(node.args) > arg else None)
    try:
        return sub_group_ranks(_process_group(group))
    except Exception:  # noqa: BLE001 - optional: the line is written without it
        return None


def _payloads(node: Any, coalesced: bool, warnings: list[str]
              ) -> tuple[list[Any], list[Any] | None, str]:
    """(pieces, dtypes or None, pattern) of a collective's input, as _payload_pieces."""
    if coalesced:
        return list(node.args[0]), None, "coalesced"
    pieces, dtypes, pattern = _payload_pieces(node.args[0], warnings)
    if pattern == "cat":
        # A plain cat may be the user's own math (e.g. the backward of
        # a split weight); it is a bucket only if the result is split
        # back into as many pieces.
        split = _split_outputs(node)
        if split is None or len(split) != len(pieces):
            return [node.args[0]], None, "single"
    return pieces, dtypes, pattern


def _payload_outputs(node: Any, kind: str, coalesced: bool, pattern: str, n: int, label: str,
                     warnings: list[str]) -> list[Any]:
    """Per payload, the node its slice of the result ends up in (None: not found), by position.

    A reduce-scatter's or all-reduce's slice names the gradient it is written to (a coalesced
    one: after its wait); an all-gather's slice, where the gathered parameter is used (its
    module)."""
    if coalesced:
        by_idx = {u.args[1]: u for u in node.users if op_name(u) == "getitem"}
        outs = [by_idx.get(i) for i in range(n)]
        if kind != "all_gather":
            outs = [_waited(g) for g in outs]
    elif pattern == "single":
        outs = [node]
    else:
        outs = _split_outputs(node) or []
    if kind != "all_gather" and len(outs) != n:
        warnings.append(f"{label}: {n} input payloads but {len(outs)} output slices")
    return (outs + [None] * n)[:n]


def _waited(node: Any) -> Any:
    """The wait on ``node``'s result, if any, else ``node``."""
    waits = [u for u in node.users if op_name(u) in _WAIT_OPS] if node is not None else []
    return waits[0] if waits else node


def _entries(node: Any, kind: str, pieces: list[Any], dtypes: list[Any] | None, outs: list[Any],
             world_size: int, own: str | None, label: str, names: _PayloadNames,
             warnings: list[str]) -> tuple[list[BucketEntry], int]:
    """One entry per payload, at its byte offset; and the bytes they cover. A payload without a
    traced value leaves the bucket without entries (said)."""
    entries: list[BucketEntry] = []
    offset = 0
    for i, piece in enumerate(pieces):
        val = _val(piece)
        if val is None:
            warnings.append(f"{label}: payload {i} ({getattr(piece, 'name', piece)}) has no meta['val']")
            return [], offset
        dtype = dtypes[i] if dtypes else val.dtype
        if kind == "all_gather":
            numel, fqn, shape = _gathered(piece, val, names)
            out = outs[i]  # each payload's module: where its gathered slice is used
            module = _issuing_module(out, own_first=out is node) if out is not None else None
        else:  # a reduce-scatter's payload is one rank's row of it, an all-reduce's all of it
            numel, fqn, shape = _reduced(piece, val, outs[i],
                                         world_size if kind == "reduce_scatter" else 1, offset,
                                         label, names, warnings)
            # A parameter's gradient is reduced for the module that owns the parameter. The
            # backward nodes' module annotations are not evidence of anything else: AutoParallel's
            # graphs carry the first module's ``fwd_nn_module_stack`` on every backward node.
            # Another payload (an activation's gradient): the module whose backward produced it.
            module = (fqn.rsplit(".", 1)[0] if "." in fqn else "") if fqn else next(
                (node_module(c) for c in walk_back(piece) if is_compute(c)), None)
        size = numel * dtype.itemsize
        payload = None if fqn is not None else _payload_class(piece, dtype)
        if payload is None and fqn is None:  # a parameter input whose name is not known
            warnings.append(f"{label}: payload {i} at offset {offset} is a parameter input "
                            "whose name is not known")
            payload = "activation"
        if not (kind != "all_gather" and fqn):
            module = (module if module and module != PROPERTY_MODULE else None) or (
                own if len(pieces) == 1 else None)
        entries.append(BucketEntry(fqn, offset, size, numel, dtype_name(dtype), shape,
                                   module=module,
                                   payload=payload if payload is not None else ABSENT))
        offset += size
    return entries, offset


def _payload_class(piece: Any, dtype: Any) -> str | None:
    """What a payload that is no known parameter is: ``"token"`` (integer or bool data: token
    ids, sizes, flags), ``"activation"`` (computed in the graph, a user input, a tangent, or a
    gradient of one of them); None for a graph input that aot_autograd describes as a parameter
    (``ParamAOTInput``) while its name is unknown: a naming failure, said as a warning."""
    if not (getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False)):
        return "token"
    ph = _placeholder_of(piece)
    desc = ph.meta.get("desc") if ph is not None else None
    for _ in range(16):
        if desc is None:
            break
        if type(desc).__name__ == "ParamAOTInput":
            return None
        desc = getattr(desc, "base", None)
    return "activation"


def _gathered(piece: Any, val: Any, names: _PayloadNames) -> tuple[int, str | None, list]:
    """An all-gather payload: (numel, parameter, its shape): the graph input it comes from."""
    ph = _placeholder_of(piece)
    shape = list(_val(ph).shape) if ph is not None and _val(ph) is not None else list(val.shape)
    return _numel(val), names.of_input(ph), shape


def _reduced(piece: Any, val: Any, out_node: Any, world_size: int, offset: int, label: str,
             names: _PayloadNames, warnings: list[str]) -> tuple[int, str | None, list]:
    """A reduce-scatter payload: (numel per rank, parameter, shape of its reduced slice); an
    all-reduce's with ``world_size`` 1 (the whole piece; its shape: the gradient's as it reaches
    the output, else the piece's). The parameter is whose gradient the input side says (before
    the passes), else the one the reduced slice is written to; a disagreement is said."""
    out_fqn = names.of_output(out_node) if out_node is not None else None
    in_fqn = names.of_reduce_input(piece)
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
    return _numel(val) // world_size, in_fqn or out_fqn, shape


def _bucket_total(node: Any, kind: str, coalesced: bool, pieces: list[Any],
                  entries: list[BucketEntry], offset: int, world_size: int, label: str,
                  warnings: list[str]) -> tuple[Any, int]:
    """(dtype, bytes per rank) of the bucket: its input buffer's, checked against the entries;
    a coalesced collective has no buffer: its first payload's dtype, the entries' bytes."""
    buffer_val = _val(node.args[0]) if not coalesced else None
    if buffer_val is None:
        first = _val(pieces[0]) if pieces else None
        return (first.dtype if first is not None else None), offset
    total = _numel(buffer_val) * buffer_val.dtype.itemsize
    if kind == "reduce_scatter" and world_size:
        total //= world_size
    if entries and total != offset:
        warnings.append(f"{label}: entries cover {offset} bytes of a {total}-byte payload")
    return buffer_val.dtype, total


def _check_from_node(node: Any, entries: list[BucketEntry], label: str,
                     warnings: list[str]) -> None:
    """A merged bucket lists the collectives the bucketing pass merged: as many as payloads."""
    sources = node.meta.get("from_node") or []
    bucketed_from = [s for s in sources if getattr(s, "pass_name", "") == "bucketing_pass"]
    if bucketed_from and len(bucketed_from) != len(entries):
        warnings.append(f"{label}: from_node lists {len(bucketed_from)} collectives, found {len(entries)} payloads")


def _bucket_module(own: str | None, entries: list[BucketEntry]) -> str | None:
    """A merged bucket is issued under the innermost module holding every payload's module
    ("" the root); a single collective under its own annotation when it has one. A merged
    bucket's own annotation is its first member's (copied by the pass)."""
    common = common_prefix([e.module for e in entries])
    return own if (own is not None and len(entries) == 1) or common is None else common


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
