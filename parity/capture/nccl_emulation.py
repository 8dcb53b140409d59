"""NCCL Ring emulation on CPU/gloo (``parity exec --emulate-nccl TOPOLOGY``).

Why: a consistent payload reorder inside a reduce-scatter bucket changes no hash on gloo, but on
a multi-node NCCL job it can change the sums, because each channel adds the ranks' values in its
own ring order (parity/nccl). This module makes a CPU job compute every reduce-scatter
and all-reduce exactly as that model says, so the numbers of a 2x2 (or 8x8) cluster show up on a
laptop. It is the one capture mode that changes the job's numbers, on purpose; meta.json says so
(``nccl_emulation``) and ``parity diff`` refuses to compare an emulated run with a plain one.

How: the trainer's ``init_process_group("gloo")`` (or no backend on a CPU machine) is redirected
to the backend :data:`BACKEND_NAME`, registered with ``torch.distributed.Backend.register_backend``.
Its process group (:class:`EmulatedRingGroup`) is a Python ``ProcessGroup`` holding a real gloo
group (``inner``). Python callers (``dist.reduce_scatter_tensor``, FSDP2) and the C++ functional
collectives of compiled graphs (``torch.ops._c10d_functional.*``, which reach a Python process
group through its pybind trampoline) both land in its methods. The compiled graphs' all-gathers
with an ``out=`` buffer reach the gloo backend registered on the outer group directly (a copy:
fine); that the functional reductions do come through Python on this torch is checked once,
right after ``init_process_group``, with one tiny reduce-scatter and all-reduce (:func:`_probe`):
if they did not, the job stops (exit 2) instead of being summed by gloo in silence.

What is computed, per collective of a floating dtype with op SUM or AVG, on the tensors' own
device (CPU or CUDA: gloo carries host copies, the sums run where the tensors live):

* Every group is a communicator of its own: the default group is the whole NODES x GPUS
  cluster; a sub-group (an HSDP shard or replicate group, a DeviceMesh dimension) is the cluster
  its global ranks make (:func:`group_topology`: k ranks on each of n nodes -> n x k, e.g. the
  replicate groups of a 2x2 HSDP mesh are 2x1, shard groups that span two nodes 2x1 too).
* reduce-scatter: one gloo all-to-all brings every rank's row d to rank d; rank d sums each
  channel range of the model's split (:func:`rs_ranges`) in ``sum_order(ring, d)``, one add per
  hop in the collective's dtype (torch rounds each add to the dtype, like NCCL's per-hop store).
* all-reduce: one gloo all-gather; every rank computes every chunk of the model's split
  (:func:`ar_chunks`) in its owner's order (all ranks compute the same bits, as NCCL's
  all-gather phase copies them).
* AVG on floats is NCCL's PreMulSum (``hostToDevRedOp`` in ``src/enqueue.cc``): every input is
  multiplied by ``1/nRanks`` (a float rounded to the dtype) before the ring sum.

Passed to gloo unchanged, because order cannot matter (meta.json ``passed_to_gloo``): integer/
bool dtypes, MIN/MAX/PRODUCT, one-rank groups, every other collective (all-gather, broadcast,
all-to-all, send/recv: copies). Summed by gloo although order matters, each said once on stderr,
counted in meta.json ``not_emulated`` and named by ``parity diff`` as incomplete (exit 3): a
sparse tensor (the model covers dense buffers), a group whose ranks sit unevenly on the nodes.
Refused (one line, exit 2): PREMUL_SUM (gloo cannot run it either), ``reduce`` to one root of a
float SUM (not modelled), an NCCL backend.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch

from parity.capture.env import say
from parity.errors import EXIT_USAGE, ParityError
from parity.nccl import (MODEL, MODEL_LIMITS, Topology, parse_topology, primary_scenario,
                         sum_order)
from parity.nccl.probe_file import describe_file

BACKEND_NAME = "parity_nccl_emu"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_lock = threading.Lock()
_topology: Topology | None = None
_counts: collections.Counter = collections.Counter()  # kind -> collectives emulated
_passed: collections.Counter = collections.Counter()  # reason -> left to gloo, order-free
_gaps: collections.Counter = collections.Counter()  # reason -> summed by gloo, NOT emulated
_groups: collections.Counter = collections.Counter()  # sub-topology spec -> groups emulated
_warned: set[str] = set()
_env: dict[str, str] = {}  # the job's NCCL_* settings: the model applies them (the fingerprint's)


# ------------------------------------------------------------------- the model, in one place
def _segments(topo: Topology, kind: str, count: int, esize: int) -> list:
    """The model's primary scenario (``parity.nccl.primary_scenario``: the pinned protocol else
    Simple, the first channel count and ring family) for one collective, under the job's NCCL
    settings: what one emulated run computes (a prediction covers every scenario)."""
    s = primary_scenario(topo, kind, count, esize, env=_env)
    return list(s.segments) if s is not None else []


def rs_ranges(topo: Topology, count: int, esize: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(lo, hi, ring) per channel range of a reduce-scatter whose per-rank output has ``count``
    elements of ``esize`` bytes: rank d's elements in [lo, hi) are summed in
    ``sum_order(ring, d)``. The one call of the model's reduce-scatter split."""
    return [(g.lo, g.hi, g.order) for g in _segments(topo, "reduce_scatter", count, esize)]


def ar_chunks(topo: Topology, count: int, esize: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(lo, hi, sum order) per chunk of an all-reduce of ``count`` elements (chunk sizes and
    owners as the model gives them: the owner is ``ring->index`` steps from rank 0): the order
    in which the chunk's owner adds the ranks' values. The one call of the model's all-reduce
    split."""
    return [(g.lo, g.hi, g.order) for g in _segments(topo, "all_reduce", count, esize)]


def group_topology(topo: Topology, ranks) -> Topology | str:
    """The topology of a communicator over global ``ranks`` (a sub-group: an HSDP shard or
    replicate group, a DeviceMesh dimension) of the emulated cluster, or why it cannot be
    modelled. Global rank r sits on node ``r // gpus``; NCCL numbers a communicator's ranks in
    the order given (torch's ``new_group`` sorts them), so a group of k ranks on each of n nodes,
    listed node by node, is an n x k cluster of its own: its rings and channels are the model's
    for n x k. A group with unequal ranks per node is not modelled (NCCL's rings over it are not
    the model's)."""
    ranks = list(ranks) if ranks else list(range(topo.world))
    if ranks == list(range(topo.world)):
        return topo
    if any(not 0 <= r < topo.world for r in ranks) or len(set(ranks)) != len(ranks):
        return f"ranks {_short(ranks)} are not ranks of {topo.spec()}"
    per_node: dict[int, list[int]] = {}
    for r in ranks:
        per_node.setdefault(r // topo.gpus, []).append(r)
    sizes = {len(v) for v in per_node.values()}
    if len(sizes) != 1:
        return (f"ranks {_short(ranks)} put {sorted(len(v) for v in per_node.values())} ranks "
                "on its nodes (unequal: not modelled)")
    if ranks != sorted(ranks):
        return f"ranks {_short(ranks)} are not in node order (not modelled)"
    from dataclasses import replace

    return replace(topo, nodes=len(per_node), gpus=sizes.pop(), rings=None, tuning=None,
                   ring_prefixes=None, nics=None, source=None)


def _short(ranks) -> str:
    ranks = list(ranks)
    return "[" + ",".join(map(str, ranks[:8])) + (",...]" if len(ranks) > 8 else "]")


# ----------------------------------------------------------------------------- the arithmetic
def avg_scale(dtype: torch.dtype, nranks: int, device=None) -> torch.Tensor:
    """NCCL's ncclAvg scalar for a float dtype: ``float(1.0/nRanks)`` converted to the dtype
    (``__float2half`` / ``__float2bfloat16`` of the float; a double for fp64), on ``device``."""
    if dtype == torch.float64:
        return torch.tensor(1.0 / nranks, dtype=torch.float64, device=device)
    return torch.tensor(1.0 / nranks, dtype=torch.float32).to(device=device, dtype=dtype)


def ring_sum(rows: torch.Tensor, order, lo: int, hi: int) -> torch.Tensor:
    """``((rows[o0] + rows[o1]) + rows[o2]) + ...`` over [lo, hi), one rounding per add."""
    acc = rows[order[0], lo:hi].clone()
    for s in order[1:]:
        acc.add_(rows[s, lo:hi])
    return acc


def reduce_scatter_rows(rows: torch.Tensor, owner: int, topo: Topology) -> torch.Tensor:
    """Rank ``owner``'s reduce-scatter output from ``rows`` ([nranks, count]: row s is rank s's
    contribution to ``owner``'s segment, pre-multiplied already for AVG), per channel range of
    :func:`rs_ranges` in ``sum_order(ring, owner)``; computed on ``rows``' device, in its
    dtype."""
    count = rows.shape[1]
    out = torch.empty(count, dtype=rows.dtype, device=rows.device)
    for lo, hi, ring in rs_ranges(topo, count, rows.element_size()):
        out[lo:hi] = ring_sum(rows, sum_order(ring, owner), lo, hi)
    return out


def all_reduce_rows(rows: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The all-reduce of ``rows`` ([nranks, count]) chunk by chunk of :func:`ar_chunks`, each
    in its owner's sum order; on ``rows``' device, in its dtype."""
    count = rows.shape[1]
    out = torch.empty(count, dtype=rows.dtype, device=rows.device)
    for lo, hi, order in ar_chunks(topo, count, rows.element_size()):
        out[lo:hi] = ring_sum(rows, order, lo, hi)
    return out


# --------------------------------------------------------------------------- the process group
def _c10d():
    return torch._C._distributed_c10d


def _done(result):
    """A completed Work whose future holds ``result`` (what gloo's Work would hold)."""
    fut = torch.futures.Future()
    fut.set_result(result)
    return _c10d()._create_work_from_future(fut)


def _op_kind(opts) -> str:
    """'sum' | 'avg' | 'premul' | 'other' for a c10d options object."""
    from torch.distributed import ReduceOp

    op = opts.reduceOp
    if op == ReduceOp.SUM:
        return "sum"
    if op == ReduceOp.AVG:
        return "avg"
    if op == ReduceOp.PREMUL_SUM:
        return "premul"
    return "other"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _make_group_class():
    from torch.distributed import ProcessGroup

    class EmulatedRingGroup(ProcessGroup):
        """A process group whose reduce-scatters and all-reduces follow the NCCL Ring model;
        everything else goes to the gloo group ``inner``."""

        def __init__(self, inner, rank: int, size: int, topo: Topology | str, ranks=()):
            super().__init__(rank, size)
            self.inner = inner
            self._rank = rank
            self._size = size
            # the communicator's own topology (group_topology), or why it has none
            self.topo = topo if isinstance(topo, Topology) else None
            self.why_not = topo if isinstance(topo, str) else None
            self.ranks = list(ranks)

        # identity: kept on the inner group (no backend is registered on this one)
        def getBackendName(self):
            return "gloo"

        def getGroupName(self):
            return self.inner.group_name

        def setGroupName(self, name):
            self.inner._set_group_name(name)

        def getGroupDesc(self):
            return self.inner.group_desc

        def setGroupDesc(self, desc):
            self.inner._set_group_desc(desc)

        def _get_backend(self, device):
            return self.inner._get_backend(device)

        def _set_sequence_number_for_group(self):
            return self.inner._set_sequence_number_for_group()

        def __getattr__(self, name):  # anything else the ProcessGroup API has
            return getattr(self.__dict__["inner"], name)

        # which collectives are emulated
        def _emulated(self, tensors, opts, kind: str) -> str | None:
            """None if gloo runs it (order-free, a one-rank group, or a gap said in meta.json),
            else 'sum' | 'avg'."""
            op = _op_kind(opts)
            if op == "premul":
                _refuse("--emulate-nccl: PREMUL_SUM is not emulated (gloo cannot run it "
                        "either)")
            if any(t.layout != torch.strided for t in tensors):
                if op != "other" and any(t.dtype in _FLOATS for t in tensors):
                    _note_gap(f"{kind} of a sparse tensor (e.g. a sparse embedding gradient): "
                              "summed by gloo, the Ring model covers dense buffers only")
                else:
                    _note_passed(f"{kind} of a sparse integer tensor or MIN/MAX/PRODUCT "
                                 "(order-independent)")
                return None
            if op == "other" or any(t.dtype not in _FLOATS for t in tensors):
                _note_passed(f"{kind}: integer dtype or MIN/MAX/PRODUCT (order-independent)")
                return None
            if self._size == 1:
                return None
            if self.topo is None:
                _note_gap(f"{kind} on a group of {self._size} ranks: {self.why_not}; summed by "
                          "gloo")
                return None
            return op

        def _rows_to_owner(self, inp: torch.Tensor, count: int) -> torch.Tensor:
            """all-to-all: row d of every rank's ``inp`` ([size * count]) to rank d, on
            ``inp``'s device (gloo carries host copies)."""
            send = inp.reshape(-1).contiguous()
            host = send if send.device.type == "cpu" else send.cpu()
            recv = torch.empty_like(host)
            self.inner.all_to_all_single(_bytes(recv), _bytes(host), [], []).wait()
            return recv.view(self._size, count).to(inp.device)

        def _all_rows(self, t: torch.Tensor) -> torch.Tensor:
            send = t.reshape(-1).contiguous()
            host = send if send.device.type == "cpu" else send.cpu()
            recv = torch.empty(self._size * host.numel(), dtype=host.dtype)
            self.inner.all_gather_single(_bytes(recv), _bytes(host)).wait()
            return recv.view(self._size, host.numel()).to(t.device)

        def _reduce_scatter_one(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
            rows = self._rows_to_owner(inp, out.numel())
            if op == "avg":
                rows = rows * avg_scale(rows.dtype, self._size, rows.device)
            out.copy_(reduce_scatter_rows(rows, self._rank, self.topo).view(out.shape))
            _count("reduce_scatter")

        def _all_reduce_one(self, t: torch.Tensor, op: str) -> None:
            rows = self._all_rows(t)
            if op == "avg":
                rows = rows * avg_scale(rows.dtype, self._size, rows.device)
            t.copy_(all_reduce_rows(rows, self.topo).view(t.shape))
            _count("all_reduce")

        # reduce-scatter entry points
        def reduce_scatter_single(self, output, input, opts=None):
            opts = opts or _c10d().ReduceScatterOptions()
            op = self._emulated([input], opts, "reduce_scatter")
            if op is None:
                return self.inner.reduce_scatter_single(output, input, opts)
            self._reduce_scatter_one(output, input, op)
            return _done([output])

        _reduce_scatter_base = reduce_scatter_single

        def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
            opts = opts or _c10d().ReduceScatterOptions()
            op = self._emulated(list(inputs), opts, "reduce_scatter")
            if op is None:
                return self.inner.reduce_scatter_single_coalesced(outputs, inputs, opts)
            for out, inp in zip(outputs, inputs):  # each alone in its plan (the model's limit)
                self._reduce_scatter_one(out, inp, op)
            return _done(list(outputs))

        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

        def reduce_scatter(self, output_tensors, input_lists, opts=None):
            opts = opts or _c10d().ReduceScatterOptions()
            flat = [t for lst in input_lists for t in lst]
            op = self._emulated(flat, opts, "reduce_scatter")
            if op is None:
                return self.inner.reduce_scatter(output_tensors, input_lists, opts)
            for out, lst in zip(output_tensors, input_lists):
                inp = torch.cat([t.reshape(-1) for t in lst])
                self._reduce_scatter_one(out, inp, op)
            return _done(list(output_tensors))

        # all-reduce entry points
        def allreduce(self, tensors, opts=None):
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            if opts is None:
                opts = _c10d().AllreduceOptions()
            elif not hasattr(opts, "reduceOp"):  # allreduce(tensors, op)
                o = _c10d().AllreduceOptions()
                o.reduceOp = opts
                opts = o
            op = self._emulated(list(tensors), opts, "all_reduce")
            if op is None:
                return self.inner.allreduce(tensors, opts)
            for t in tensors:
                self._all_reduce_one(t, op)
            return _done(list(tensors))

        def allreduce_coalesced(self, tensors, opts=None):
            opts = opts or _c10d().AllreduceCoalescedOptions()
            op = self._emulated(list(tensors), opts, "all_reduce")
            if op is None:
                return self.inner.allreduce_coalesced(tensors, opts)
            for t in tensors:
                self._all_reduce_one(t, op)
            return _done(list(tensors))

        def reduce(self, tensors, opts=None):
            opts = opts or _c10d().ReduceOptions()
            if self._emulated(list(tensors), opts, "reduce") is not None:
                _refuse("--emulate-nccl: reduce (to one root) of a float sum is not modelled")
            return self.inner.reduce(tensors, opts)

        # the rest: plain copies, run by gloo
        def allgather(self, *a, **k):
            return self.inner.allgather(*a, **k)

        def all_gather_single(self, *a, **k):
            return self.inner.all_gather_single(*a, **k)

        _allgather_base = all_gather_single

        def all_gather_single_coalesced(self, *a, **k):
            return self.inner.all_gather_single_coalesced(*a, **k)

        allgather_into_tensor_coalesced = all_gather_single_coalesced

        def allgather_coalesced(self, *a, **k):
            return self.inner.allgather_coalesced(*a, **k)

        def all_to_all_single(self, *a, **k):
            return self.inner.all_to_all_single(*a, **k)

        alltoall_base = all_to_all_single

        def alltoall(self, *a, **k):
            return self.inner.alltoall(*a, **k)

        def broadcast(self, *a, **k):
            return self.inner.broadcast(*a, **k)

        def barrier(self, *a, **k):
            return self.inner.barrier(*a, **k)

        def monitored_barrier(self, *a, **k):
            return self.inner.monitored_barrier(*a, **k)

        def gather(self, *a, **k):
            return self.inner.gather(*a, **k)

        def scatter(self, *a, **k):
            return self.inner.scatter(*a, **k)

        def send(self, *a, **k):
            return self.inner.send(*a, **k)

        def recv(self, *a, **k):
            return self.inner.recv(*a, **k)

        def recv_anysource(self, *a, **k):
            return self.inner.recv_anysource(*a, **k)

        def shutdown(self, *a, **k):
            return self.inner.shutdown(*a, **k)

        def abort(self, *a, **k):
            return self.inner.abort(*a, **k)

        def __repr__(self):
            what = self.topo.spec() if self.topo is not None else f"not modelled: {self.why_not}"
            return f"EmulatedRingGroup({what}, rank {self._rank} of {self._size})"

    return EmulatedRingGroup


_GROUP_CLASS = None


def _count(kind: str) -> None:
    with _lock:
        _counts[kind] += 1


def _note_passed(reason: str) -> None:
    """A collective gloo runs unchanged because its result cannot depend on the order."""
    _note(_passed, reason, "passed to gloo")


def _note_gap(reason: str) -> None:
    """A float reduction summed by gloo in gloo's order, not the modelled one: meta.json's
    ``not_emulated`` names it and ``parity diff`` makes the comparison incomplete (exit 3)."""
    _note(_gaps, reason, "NOT emulated")


def _note(counter: collections.Counter, reason: str, what: str) -> None:
    """Count ``reason``; rank 0 says it once (every rank records it in meta.json)."""
    with _lock:
        counter[reason] += 1
        if reason in _warned:
            return
        _warned.add(reason)
    if _says():
        say(f"--emulate-nccl: {what}: {reason}")


def _says() -> bool:
    """Rank 0 says what the emulation left to gloo (every rank records it in meta.json)."""
    return os.environ.get("RANK", "0") == "0"


def _refuse(msg: str) -> None:
    """A job that cannot be emulated stops here, with one line (exit 2): running it plain would
    give numbers the user did not ask for."""
    say(f"error: {msg}")
    try:
        from parity.capture.launch import note_refusal

        note_refusal(msg)  # parity exec then exits 2 too, not torchrun's 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(EXIT_USAGE)


class _OldNames:
    """The gloo group as the emulating group calls it, on a torch that names its single-tensor
    collectives the old way (2.11: ``alltoall_base``, ``_allgather_base``,
    ``_reduce_scatter_base``, ``reduce_scatter_tensor_coalesced``,
    ``allgather_into_tensor_coalesced``; the new names came with 2.12). Everything else is the
    group's own (feature-detected in ``_create``: ``ProcessGroup.all_to_all_single``)."""

    _NEW = {"all_to_all_single": "alltoall_base", "all_gather_single": "_allgather_base",
            "reduce_scatter_single": "_reduce_scatter_base",
            "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
            "all_gather_single_coalesced": "allgather_into_tensor_coalesced"}

    def __init__(self, group):
        self.__dict__["group"] = group

    def __getattr__(self, name):
        return getattr(self.__dict__["group"], self._NEW.get(name, name))


def _create(opts, _backend_options=None):
    """Backend creator (``Backend.register_backend(..., extended_api=True)``, which hands over
    the group's global ranks): a gloo group wrapped in the emulation, at the topology the
    group's ranks make on the emulated cluster (:func:`group_topology`)."""
    global _GROUP_CLASS
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    ranks = list(opts.global_ranks_in_group or [])
    topo = _topology
    if _counts["groups"] == 0 and size != topo.world:
        _refuse(f"--emulate-nccl {topo.spec()} needs {topo.world} ranks (NODES x GPUS); "
                f"this job has {size}")
    _count("groups")
    sub = group_topology(topo, ranks or range(size))
    if isinstance(sub, Topology) and size > 1:
        with _lock:
            _groups[sub.spec()] += 1
    gloo = ProcessGroupGloo(store, rank, size, timeout)
    inner = ProcessGroup(store, rank, size)
    inner._set_default_backend(ProcessGroup.BackendType.GLOO)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():  # gloo copies CUDA tensors too (the out= all-gather below)
        devices.append(torch.device("cuda"))
    for dev in devices:
        inner._register_backend(dev, ProcessGroup.BackendType.GLOO, gloo)
    if _GROUP_CLASS is None:
        _GROUP_CLASS = _make_group_class()
    outer = _GROUP_CLASS(inner if hasattr(inner, "all_to_all_single") else _OldNames(inner),
                         rank, size, sub, ranks)
    # The C++ functional all-gather with an out= buffer (bucketed graphs) calls ProcessGroup
    # methods that have no Python trampoline; they reach this gloo backend directly. That is
    # right for copies; that no reduction takes this way is checked once (_probe).
    for dev in devices:
        outer._register_backend(dev, ProcessGroup.BackendType.GLOO, gloo)
    # torch 2.15's init_process_group asks the new group's default backend at once (its flight
    # recorder hook, distributed_c10d._maybe_attach_flight_recorder): gloo's, as for inner
    outer._set_default_backend(ProcessGroup.BackendType.GLOO)
    return outer


# ----------------------------------------------------------------------------------- install
_GLOO_SPELLINGS = {"gloo", "cpu:gloo", "cuda:gloo", "cpu:gloo,cuda:gloo", "cuda:gloo,cpu:gloo",
                   "undefined"}


def _redirect(backend):
    """The backend the trainer asked for -> ours; refuse what gloo does not run. gloo (for CPU
    and CUDA tensors) or none becomes the emulation; a CUDA tensor's ring sums are computed on
    its device. NCCL is refused: the job would need real NCCL communicators."""
    if backend is None or str(backend).lower().replace(" ", "") in _GLOO_SPELLINGS:
        return BACKEND_NAME
    if str(backend).lower() == BACKEND_NAME:
        return backend
    _refuse(f"--emulate-nccl runs gloo jobs (CPU or CUDA tensors); the trainer asked for "
            f"backend {backend!r} (use gloo)")
    return backend


def _probe() -> None:
    """Check, once, that the functional collectives (compiled graphs, DTensor) of this torch
    reach the emulating group's Python methods: one reduce-scatter and one all-reduce of a
    tiny tensor on the default group (every rank runs it, right after init_process_group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = distributed_c10d._get_default_group()
    if not hasattr(group, "topo") or group.size() != _topology.world:
        return
    ops = torch.ops._c10d_functional
    before = dict(_counts)
    name = group.group_name
    t = torch.zeros(group.size(), dtype=torch.float32)
    ops.wait_tensor(ops.reduce_scatter_tensor(t, "sum", group.size(), name))
    ops.wait_tensor(ops.all_reduce(t, "sum", name))
    with _lock:
        seen = (_counts["reduce_scatter"] - before.get("reduce_scatter", 0),
                _counts["all_reduce"] - before.get("all_reduce", 0))
        _counts["reduce_scatter"] -= seen[0]
        _counts["all_reduce"] -= seen[1]
    if seen != (1, 1):
        _refuse("--emulate-nccl: this torch's functional collectives do not reach a Python "
                "process group (compiled graphs would be summed by gloo); not emulated")


def _wrap_init(orig):
    def init_process_group(*args, **kwargs):
        if args:
            args = (_redirect(args[0]), *args[1:])
        else:
            kwargs["backend"] = _redirect(kwargs.get("backend"))
        out = orig(*args, **kwargs)
        _probe()
        return out

    init_process_group.__wrapped__ = orig
    init_process_group.__doc__ = orig.__doc__
    init_process_group._parity_emulation = True
    return init_process_group


def _wrap_new_group(orig):
    """``new_group(backend="gloo")`` gets the emulating backend too (None already inherits it)."""
    def new_group(*args, **kwargs):
        if len(args) >= 3:
            if str(args[2]).lower() in ("gloo", "cpu:gloo"):
                args = (*args[:2], BACKEND_NAME, *args[3:])
        elif str(kwargs.get("backend")).lower() in ("gloo", "cpu:gloo"):
            kwargs["backend"] = BACKEND_NAME
        return orig(*args, **kwargs)

    new_group.__wrapped__ = orig
    new_group.__doc__ = orig.__doc__
    new_group._parity_emulation = True
    return new_group


def _patch_module(mod) -> None:
    for name, wrap in (("init_process_group", _wrap_init), ("new_group", _wrap_new_group)):
        f = getattr(mod, name, None)
        if f is not None and not getattr(f, "_parity_emulation", False):
            setattr(mod, name, wrap(f))


def install(spec: str) -> Topology:
    """Make this process's gloo groups emulate ``spec`` (``NODESxGPUS[:channels=C]``); called in
    every rank by activation.py before the trainer initializes its process group."""
    global _topology
    topo = parse_topology(spec)
    import torch.distributed as dist

    if not dist.is_available():
        raise ParityError("--emulate-nccl: this torch has no torch.distributed")
    for need in ("_create_work_from_future", "ProcessGroup", "ReduceScatterOptions"):
        if not hasattr(_c10d(), need):
            raise ParityError(f"--emulate-nccl: this torch lacks c10d.{need}")
    from torch.distributed import distributed_c10d

    if distributed_c10d.is_initialized():
        raise ParityError("--emulate-nccl: the process group was initialized before capture "
                          "started")
    _topology = topo
    _env.clear()
    _env.update({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    _patch_module(distributed_c10d)
    _patch_module(dist)
    from parity.capture.post_import import when_imported

    when_imported("torch.distributed.device_mesh", _patch_module)
    return topo


def install_or_refuse(spec: str) -> None:
    """:func:`install`, or stop this rank with one line (exit 2) if it cannot be done."""
    try:
        install(spec)
    except Exception as e:  # noqa: BLE001 - a plain run would not be what was asked for
        from parity.capture.env import one_line

        _refuse(str(e) if isinstance(e, ParityError) else f"--emulate-nccl: {one_line(e)}")


def active() -> Topology | None:
    return _topology


def describe() -> dict | None:
    """What meta.json records (``nccl_emulation``): the topology, the model, what was emulated."""
    if _topology is None:
        return None
    with _lock:
        counts = {k: v for k, v in _counts.items() if k != "groups"}
        passed, gaps, groups = dict(_passed), dict(_gaps), dict(_groups)
    return {"topology": _topology.spec(), "detail": _topology.to_dict(), "model": MODEL,
            "topology_file": describe_file(_topology),  # a probe's file: its agreement
            "limits": MODEL_LIMITS, "backend": BACKEND_NAME, "emulated": counts,
            "groups": groups, "passed_to_gloo": passed, "not_emulated": gaps}


def record_in(meta: dict) -> None:
    """Put (or refresh) ``nccl_emulation`` in a rank's meta.json dict when this job emulates."""
    m = describe()
    if m is not None:
        meta["nccl_emulation"] = m
