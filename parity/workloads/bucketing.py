"""The compiled side's backend: PyTorch's own FSDP bucketing passes on the aot graphs.

``make_backend`` returns a ``torch.compile`` backend that runs aot_autograd
with the min-cut partitioner; its forward/backward compilers run

* ``--bucketing manual``: ``overlap_manual_scheduling.manual_overlap_bucketing``
  with one plan entry per transformer block plus one for the root's
  parameters, like torchtitan's ``transformer_block_bucketing``;
* ``--bucketing auto``: ``fsdp.bucket_fsdp_reduce_scatter`` then
  ``fsdp.bucket_fsdp_all_gather`` (reduce-scatters first, as ``post_grad.py``
  orders them), then ``stable_topological_sort``,

and then run the graph with ``boxed_nop`` (no inductor codegen), so the
numerics are those of eager kernels and can be compared bitwise with FSDP2.

Payload order inside a merged bucket is the order of the node list handed to
``merge_all_gather_bucket`` / ``merge_reduce_scatter_bucket``:

* ``graph``: as upstream, graph order (backward graph order for reduce-scatters,
  the reverse of FSDP2's registration order within a block);
* ``registration``: every bucket's node list sorted into FSDP2 registration
  order before merging (what torchtitan did to match eager FSDP2);
* ``swapped``: ``registration``, then two same-shape payloads exchanged in one
  reduce-scatter bucket's input concatenation only. The output split is left
  alone, so each of those two gradients lands on the other parameter: an
  inconsistent reorder that must change the parameter hashes.

This module deliberately does not import parity: the workload is a plain user
trainer that parity captures from outside.
"""

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx


BUCKET_ORDERS = ("graph", "registration", "swapped")
BUCKETINGS = ("manual", "auto")

# Matched by operator name, so that nothing here resolves ``torch.ops``
# attributes at import time (some only exist once torch.distributed is loaded).
_AG_OPS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")
_RS_OPS = ("_c10d_functional::reduce_scatter_tensor",)


REQUIRED_INTERNALS = (
    ("torch._inductor.fx_passes.bucketing", "merge_all_gather_bucket"),
    ("torch._inductor.fx_passes.bucketing", "merge_reduce_scatter_bucket"),
    ("torch._inductor.fx_passes.fsdp", "bucket_fsdp_all_gather"),
    ("torch._inductor.fx_passes.fsdp", "bucket_fsdp_reduce_scatter"),
    ("torch._inductor.fx_passes.overlap_manual_scheduling", "ManualOverlapScheduler"),
    ("torch._inductor.pattern_matcher", "stable_topological_sort"),
    ("torch._dynamo.backends.common", "aot_autograd"),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition"),
)


def missing_internals() -> list[str]:
    """The PyTorch internals the compiled mode needs that this torch lacks (checked up front,
    so another torch version gets one clear line instead of an error deep inside compilation)."""
    import importlib

    missing = []
    for module, name in REQUIRED_INTERNALS:
        try:
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{module}.{name}")
        except ImportError:
            missing.append(f"{module}.{name}")
    return missing


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return ""
    return node.target._schema.name


def is_all_gather(node: fx.Node) -> bool:
    return _op_name(node) in _AG_OPS


def is_reduce_scatter(node: fx.Node) -> bool:
    return _op_name(node) in _RS_OPS


# ---------------------------------------------------------------------------
# Parameter registration order (FSDP2's bucket order)
# ---------------------------------------------------------------------------


def fsdp2_registration_order(model: torch.nn.Module, group_roots: list[torch.nn.Module]) -> list[str]:
    """FQNs in FSDP2's bucket order, group by group in ``group_roots`` order.

    Mirrors ``_fully_shard/_fsdp_init.py:_get_managed_modules`` (a post-order
    DFS that stops at nested ``fully_shard`` roots, so a module comes after its
    children) and ``_get_managed_states`` (each module's own
    ``named_parameters(recurse=False)``).
    """
    module_to_fqn = {module: fqn for fqn, module in model.named_modules()}
    roots = set(group_roots)
    order: list[str] = []
    for group_root in group_roots:
        managed: list[torch.nn.Module] = []

        def dfs(module: torch.nn.Module) -> None:
            if module is not group_root and module in roots:
                return
            for child in module.children():
                dfs(child)
            managed.append(module)

        dfs(group_root)
        for module in managed:
            prefix = module_to_fqn[module]
            for name, _ in module.named_parameters(recurse=False):
                order.append(f"{prefix}.{name}" if prefix else name)
    return order


# ---------------------------------------------------------------------------
# Collective node -> parameter FQN
# ---------------------------------------------------------------------------

_SOURCE_KEY = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def source_name_to_fqn(name: str) -> str | None:
    """``L['self']._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``.

    Returns None for sources that are not attributes of ``self`` (data inputs).
    """
    if not name.startswith("L['self']"):
        return None
    rest = name[len("L['self']") :]
    parts = []
    for piece in re.split(r"\.(?![^\[]*\])", rest):
        if not piece:
            continue
        head = piece.split("[", 1)[0]
        keys = _SOURCE_KEY.findall(piece)
        if head and head not in ("_modules", "_parameters", "_buffers"):
            parts.append(head)
        parts.extend(keys)
    return ".".join(parts) or None


def dynamo_input_fqns(gm: fx.GraphModule) -> list[str | None]:
    """Per dynamo placeholder (aot's ``PlainAOTInput(idx)``), the parameter FQN or None."""
    fqns: list[str | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node, "_dynamo_source", None)
        if source is None and "grapharg" in node.meta:
            source = getattr(node.meta["grapharg"], "source", None)
        fqns.append(source_name_to_fqn(source.name) if source is not None else None)
    return fqns


def _plain_input_index(desc: Any) -> int | None:
    """Unwrap ``SubclassGetAttrAOTInput`` / ``GradAOTOutput`` down to ``PlainAOTInput.idx``."""
    while desc is not None:
        if hasattr(desc, "grad_of"):
            desc = desc.grad_of
        elif hasattr(desc, "base"):
            desc = desc.base
        elif type(desc).__name__ == "PlainAOTInput":
            return desc.idx
        else:
            return None
    return None


def all_gather_fqn(node: fx.Node, input_fqns: list[str | None]) -> str | None:
    """Walk the (unbucketed) all-gather's input back through unary ops to a placeholder."""
    cur = node.args[0]
    while isinstance(cur, fx.Node) and cur.op != "placeholder":
        inputs = cur.all_input_nodes
        if len(inputs) != 1:
            return None
        cur = inputs[0]
    if not isinstance(cur, fx.Node):
        return None
    idx = _plain_input_index(cur.meta.get("desc"))
    if idx is None or idx >= len(input_fqns):
        return None
    return input_fqns[idx]


def reduce_scatter_fqn(node: fx.Node, input_fqns: list[str | None]) -> str | None:
    """Follow the (unbucketed) reduce-scatter through wait/unary ops to a graph output."""
    cur = node
    while True:
        users = list(cur.users)
        if len(users) != 1:
            return None
        user = users[0]
        if user.op == "output":
            outputs = user.args[0]
            descs = user.meta.get("desc")
            if descs is None:
                return None
            for out, desc in zip(outputs, descs):
                if out is cur:
                    idx = _plain_input_index(desc)
                    if idx is None or idx >= len(input_fqns):
                        return None
                    return input_fqns[idx]
            return None
        if len(user.all_input_nodes) != 1:
            return None
        cur = user


# ---------------------------------------------------------------------------
# Passes
# ---------------------------------------------------------------------------


def _roofline_needs_replacing() -> bool:
    """True where the roofline estimate exists and cannot work: no CUDA or no triton.

    torch 2.11 has no ``estimate_roofline_runtime_ms`` (nothing to replace); on a GPU install
    with triton the estimate works and is left alone.
    """
    import importlib.util

    from torch._inductor.fx_passes import overlap_scheduling

    if not hasattr(overlap_scheduling, "estimate_roofline_runtime_ms"):
        return False
    return not torch.cuda.is_available() or importlib.util.find_spec("triton") is None


@contextlib.contextmanager
def _no_roofline_estimate() -> Iterator[None]:
    """Replace ``overlap_scheduling.estimate_roofline_runtime_ms`` with 0 where it cannot work.

    The scheduler's constructor estimates every compute node's runtime and the
    roofline model calls ``get_gpu_dram_gbps`` which needs triton and a GPU: on a
    CPU-only install that raises ``No module named 'triton'`` (and with triton
    installed but no GPU, a driver error). The manual scheduler does not use these
    estimates (it orders by the bucket plan). Feature-detected: see
    ``_roofline_needs_replacing``.
    """
    if not _roofline_needs_replacing():
        yield
        return
    from torch._inductor.fx_passes import overlap_scheduling

    original = overlap_scheduling.estimate_roofline_runtime_ms
    overlap_scheduling.estimate_roofline_runtime_ms = lambda node: 0.0
    try:
        yield
    finally:
        overlap_scheduling.estimate_roofline_runtime_ms = original


def _sort_key(
    input_fqns: list[str | None], registration_index: dict[str, int]
) -> Callable[[fx.Node], int]:
    def key(node: fx.Node) -> int:
        if is_all_gather(node):
            fqn = all_gather_fqn(node, input_fqns)
        else:
            fqn = reduce_scatter_fqn(node, input_fqns)
        if fqn is None or fqn not in registration_index:
            raise RuntimeError(f"cannot map collective {node.name} to a parameter FQN")
        return registration_index[fqn]

    return key


def _manual_bucketing(
    gm: fx.GraphModule, plans: list[list[str] | str], sort_key: Callable[[fx.Node], int] | None
) -> None:
    from torch._inductor.fx_passes.overlap_manual_scheduling import ManualOverlapScheduler

    with _no_roofline_estimate():
        scheduler = ManualOverlapScheduler(gm, plans, insert_overlap_deps=False)
        if sort_key is not None:
            # The bucketer hands its node list unchanged to merge_*_bucket, and
            # places the merged collective by node position (first AG, last RS),
            # so sorting the list only changes the payload order.
            bucket_group = scheduler.bucketer._bucket_group
            scheduler.bucketer._bucket_group = lambda nodes: bucket_group(sorted(nodes, key=sort_key))
        scheduler.run()
    gm.recompile()


def _auto_bucketing(gm: fx.GraphModule, sort_key: Callable[[fx.Node], int] | None) -> None:
    """``bucket_fsdp_reduce_scatter`` then ``bucket_fsdp_all_gather``, unrolled so the
    bucket lists can be sorted between the grouping and the merge."""
    from torch._inductor.fx_passes import bucketing, fsdp
    from torch._inductor.pattern_matcher import stable_topological_sort

    cap = bucketing.bucket_cap_mb_by_bucket_idx_default
    rs_buckets = bucketing.bucket_reduce_scatter_by_mb(
        gm, cap, filter_wait_node=fsdp.is_fsdp_reduce_scatter_wait, mode="default"
    )
    if sort_key is not None:
        rs_buckets = [sorted(bucket, key=sort_key) for bucket in rs_buckets]
    if rs_buckets:
        bucketing.merge_reduce_scatter(gm, rs_buckets, "default")
    ag_buckets = bucketing.bucket_all_gather_by_mb(
        gm, cap, filter_wait_node=fsdp.is_fsdp_all_gather_wait, mode="default"
    )
    if sort_key is not None:
        ag_buckets = [sorted(bucket, key=sort_key) for bucket in ag_buckets]
    if ag_buckets:
        bucketing.merge_all_gather(gm, ag_buckets, "default")
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()


def _bucket_input_list_node(rs: fx.Node) -> fx.Node | None:
    """The node whose first argument is the list of per-parameter RS payloads."""
    cur = rs.args[0]
    # default mode: cat(...).flatten() ; custom_ops: _pre_bucket_reduce_scatter(list, group_size)
    while isinstance(cur, fx.Node):
        if cur.op == "call_function" and cur.args and isinstance(cur.args[0], (list, tuple)):
            return cur
        inputs = cur.all_input_nodes
        if len(inputs) != 1:
            return None
        cur = inputs[0]
    return None


def swap_first_reduce_scatter_payloads(gm: fx.GraphModule) -> tuple[str, int, int] | None:
    """Exchange two same-shape entries of the first bucketed reduce-scatter's input list.

    Returns (node name, i, j) of the swap, or None if no bucket has two
    same-shape payloads.
    """
    for node in gm.graph.nodes:
        if not is_reduce_scatter(node):
            continue
        list_node = _bucket_input_list_node(node)
        if list_node is None:
            continue
        payloads = list(list_node.args[0])
        shapes = [
            (tuple(p.meta["val"].shape), p.meta["val"].dtype) if isinstance(p, fx.Node) else None
            for p in payloads
        ]
        for i in range(len(payloads)):
            for j in range(i + 1, len(payloads)):
                if shapes[i] is not None and shapes[i] == shapes[j]:
                    payloads[i], payloads[j] = payloads[j], payloads[i]
                    list_node.args = (payloads, *list_node.args[1:])
                    gm.recompile()
                    return node.name, i, j
    return None


def run_passes(
    gm: fx.GraphModule,
    graph_kind: str,
    *,
    bucketing: str,
    bucket_order: str,
    plans: list[list[str] | str],
    input_fqns: list[str | None],
    registration_order: list[str],
) -> None:
    sort_key = None
    if bucket_order in ("registration", "swapped"):
        index = {fqn: i for i, fqn in enumerate(registration_order)}
        sort_key = _sort_key(input_fqns, index)
    if bucketing == "manual":
        _manual_bucketing(gm, plans, sort_key)
    elif bucketing == "auto":
        _auto_bucketing(gm, sort_key)
    else:
        raise ValueError(f"unknown bucketing {bucketing!r}")
    if bucket_order == "swapped" and graph_kind == "backward":
        if swap_first_reduce_scatter_payloads(gm) is None:
            raise RuntimeError("--bucket-order swapped: no reduce-scatter bucket with two same-shape payloads")


# ---------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------


def _boxed_nop(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    try:
        from torch._dynamo.backends.debugging import boxed_nop
    except ImportError:  # older layouts
        from functorch.compile import make_boxed_func

        gm.recompile()
        return make_boxed_func(gm.forward)
    return boxed_nop(gm, example_inputs)


def make_backend(
    *,
    bucketing: str,
    bucket_order: str,
    plans: list[list[str] | str],
    registration_order: list[str],
    cudagraphs: bool = False,
) -> Callable[..., Any]:
    """A ``torch.compile`` backend: aot_autograd + bucketing passes + eager execution."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        input_fqns = dynamo_input_fqns(gm)

        def compiler(graph_kind: str, fx_g: fx.GraphModule, inputs: Any) -> Callable[..., Any]:
            run_passes(
                fx_g,
                graph_kind,
                bucketing=bucketing,
                bucket_order=bucket_order,
                plans=plans,
                input_fqns=input_fqns,
                registration_order=registration_order,
            )
            compiled = _boxed_nop(fx_g, inputs)
            if cudagraphs:
                compiled = _cudagraphify(compiled, fx_g, inputs)
            return compiled

        return aot_autograd(
            fw_compiler=functools.partial(compiler, "forward"),
            bw_compiler=functools.partial(compiler, "backward"),
            inference_compiler=functools.partial(compiler, "forward"),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    return backend


def _cudagraphify(compiled: Callable[..., Any], gm: fx.GraphModule, inputs: Any) -> Callable[..., Any]:
    """Wrap a compiled graph in inductor's static-input CUDA graph runner.

    Built lazily on the first call because ``cudagraphify_impl`` needs real
    tensors (compile time only has fakes). Only reachable with CUDA (train.py
    refuses --cudagraphs without it); not exercised on CPU-only machines.
    """
    from torch._inductor.compile_fx import cudagraphify_impl

    runner = None

    def model(args: list[Any]) -> Any:
        return compiled(list(args))

    def run(args: list[Any]) -> Any:
        nonlocal runner
        if runner is None:
            runner = cudagraphify_impl(model, list(args), static_input_idxs=())
        return runner(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
