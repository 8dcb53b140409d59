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

What is computed, per collective of a floating dtype with op SUM or AVG on a group of
NODES x GPUS ranks:

* reduce-scatter: one gloo all-to-all brings every rank's row d to rank d; rank d sums each
  channel range of ``reduce_scatter_segments`` in ``sum_order(ring, d)``, one add per hop in the
  collective's dtype (torch rounds each add to the dtype, like NCCL's per-hop store).
* all-reduce: one gloo all-gather; every rank computes every chunk of ``all_reduce_segments`` in
  its order (all ranks compute the same bits, as NCCL's all-gather phase copies them).
* AVG on floats is NCCL's PreMulSum (``hostToDevRedOp`` in ``src/enqueue.cc``): every input is
  multiplied by ``1/nRanks`` (a float rounded to the dtype) before the ring sum.

Passed to gloo unchanged: integer/bool dtypes (their sums do not depend on order), MIN/MAX/
PRODUCT, groups whose size is not NODES x GPUS (counted and warned), every other collective
(all-gather, broadcast, all-to-all, send/recv: copies). Refused: PREMUL_SUM (gloo cannot run it
either), ``reduce`` to one root of a float SUM (not modelled).
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch

from parity.capture.env import say
from parity.errors import EXIT_USAGE, ParityError
from parity.nccl.probe_file import describe_file
from parity.nccl import (MODEL, MODEL_LIMITS, Topology, all_reduce_segments,
                               parse_topology, reduce_scatter_segments, sum_order)

BACKEND_NAME = "parity_nccl_emu"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_lock = threading.Lock()
_topology: Topology | None = None
_counts: collections.Counter = collections.Counter()  # kind -> collectives emulated
_passed: collections.Counter = collections.Counter()  # reason -> collectives left to gloo
_warned: set[str] = set()


# ----------------------------------------------------------------------------- the arithmetic
def avg_scale(dtype: torch.dtype, nranks: int) -> torch.Tensor:
    """NCCL's ncclAvg scalar for a float dtype: ``float(1.0/nRanks)`` converted to the dtype
    (``__float2half`` / ``__float2bfloat16`` of the float; a double for fp64)."""
    if dtype == torch.float64:
        return torch.tensor(1.0 / nranks, dtype=torch.float64)
    return torch.tensor(1.0 / nranks, dtype=torch.float32).to(dtype)


def ring_sum(rows: torch.Tensor, order, lo: int, hi: int) -> torch.Tensor:
    """``((rows[o0] + rows[o1]) + rows[o2]) + ...`` over [lo, hi), one rounding per add."""
    acc = rows[order[0], lo:hi].clone()
    for s in order[1:]:
        acc.add_(rows[s, lo:hi])
    return acc


def reduce_scatter_rows(rows: torch.Tensor, owner: int, topo: Topology) -> torch.Tensor:
    """Rank ``owner``'s reduce-scatter output from ``rows`` ([nranks, count]: row s is rank s's
    contribution to ``owner``'s segment, pre-multiplied already for AVG), per channel range of
    :func:`~parity.nccl.reduce_scatter_segments` in ``sum_order(ring, owner)``."""
    count = rows.shape[1]
    out = torch.empty(count, dtype=rows.dtype)
    for seg in reduce_scatter_segments(topo, count, rows.element_size()):
        out[seg.lo:seg.hi] = ring_sum(rows, sum_order(seg.order, owner), seg.lo, seg.hi)
    return out


def all_reduce_rows(rows: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The all-reduce of ``rows`` ([nranks, count]) chunk by chunk of
    :func:`~parity.nccl.all_reduce_segments`, each in its owner's sum order."""
    count = rows.shape[1]
    out = torch.empty(count, dtype=rows.dtype)
    for seg in all_reduce_segments(topo, count, rows.element_size()):
        out[seg.lo:seg.hi] = ring_sum(rows, seg.order, seg.lo, seg.hi)
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

        def __init__(self, inner, rank: int, size: int, topo: Topology):
            super().__init__(rank, size)
            self.inner = inner
            self._rank = rank
            self._size = size
            self.topo = topo

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
            """None if gloo can run it unchanged, else 'sum' | 'avg'."""
            op = _op_kind(opts)
            if op == "premul":
                _refuse("--emulate-nccl: PREMUL_SUM is not emulated (gloo cannot run it "
                        "either)")
            if op == "other" or any(t.dtype not in _FLOATS for t in tensors):
                _note_passed(f"{kind}: integer dtype or MIN/MAX/PRODUCT (order-independent)")
                return None
            if any(t.device.type != "cpu" for t in tensors):
                _refuse(f"--emulate-nccl: only CPU tensors can be emulated, got "
                        f"{tensors[0].device}")
            if self._size != self.topo.world:
                _note_passed(f"{kind} on a group of {self._size} ranks (the topology has "
                             f"{self.topo.world}): summed by gloo")
                return None
            if self._size == 1:
                return None
            return op

        def _rows_to_owner(self, inp: torch.Tensor, count: int) -> torch.Tensor:
            """all-to-all: row d of every rank's ``inp`` ([size * count]) to rank d."""
            send = inp.reshape(-1).contiguous()
            recv = torch.empty_like(send)
            self.inner.all_to_all_single(_bytes(recv), _bytes(send), [], []).wait()
            return recv.view(self._size, count)

        def _all_rows(self, t: torch.Tensor) -> torch.Tensor:
            send = t.reshape(-1).contiguous()
            recv = torch.empty(self._size * send.numel(), dtype=send.dtype)
            self.inner.all_gather_single(_bytes(recv), _bytes(send)).wait()
            return recv.view(self._size, send.numel())

        def _reduce_scatter_one(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
            rows = self._rows_to_owner(inp, out.numel())
            if op == "avg":
                rows = rows * avg_scale(rows.dtype, self._size)
            out.copy_(reduce_scatter_rows(rows, self._rank, self.topo).view(out.shape))
            _count("reduce_scatter")

        def _all_reduce_one(self, t: torch.Tensor, op: str) -> None:
            rows = self._all_rows(t)
            if op == "avg":
                rows = rows * avg_scale(rows.dtype, self._size)
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
            return f"EmulatedRingGroup({self.topo.spec()}, rank {self._rank} of {self._size})"

    return EmulatedRingGroup


_GROUP_CLASS = None


def _count(kind: str) -> None:
    with _lock:
        _counts[kind] += 1


def _note_passed(reason: str) -> None:
    with _lock:
        _passed[reason] += 1
        if reason in _warned:
            return
        _warned.add(reason)
    say(f"--emulate-nccl: not emulated: {reason}")


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


def _create(store, rank, size, timeout):
    """Backend creator (``Backend.register_backend``): a gloo group wrapped in the emulation."""
    global _GROUP_CLASS
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    topo = _topology
    if _counts["groups"] == 0 and size != topo.world:
        _refuse(f"--emulate-nccl {topo.spec()} needs {topo.world} ranks (NODES x GPUS); "
                f"this job has {size}")
    _count("groups")
    gloo = ProcessGroupGloo(store, rank, size, timeout)
    inner = ProcessGroup(store, rank, size)
    inner._set_default_backend(ProcessGroup.BackendType.GLOO)
    inner._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    if _GROUP_CLASS is None:
        _GROUP_CLASS = _make_group_class()
    outer = _GROUP_CLASS(inner if hasattr(inner, "all_to_all_single") else _OldNames(inner),
                         rank, size, topo)
    # The C++ functional all-gather with an out= buffer (bucketed graphs) calls ProcessGroup
    # methods that have no Python trampoline; they reach this gloo backend directly. That is
    # right for copies; that no reduction takes this way is checked once (_probe).
    outer._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    # torch 2.15's init_process_group asks the new group's default backend at once (its flight
    # recorder hook, distributed_c10d._maybe_attach_flight_recorder): gloo's, as for inner
    outer._set_default_backend(ProcessGroup.BackendType.GLOO)
    return outer


# ----------------------------------------------------------------------------------- install
def _redirect(backend):
    """The backend the trainer asked for -> ours; refuse what cannot run on CPU/gloo."""
    if backend is None or str(backend).lower() in ("gloo", "cpu:gloo", "undefined"):
        if backend is None and torch.cuda.is_available():
            _refuse("--emulate-nccl runs CPU/gloo jobs; this machine has CUDA and the trainer "
                    "chose no backend (pass backend='gloo')")
        return BACKEND_NAME
    if str(backend).lower() == BACKEND_NAME:
        return backend
    _refuse(f"--emulate-nccl runs CPU/gloo jobs; the trainer asked for backend {backend!r}")
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
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
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
        passed = dict(_passed)
    return {"topology": _topology.spec(), "detail": _topology.to_dict(), "model": MODEL,
            "topology_file": describe_file(_topology),  # a probe's file: its agreement
            "limits": MODEL_LIMITS, "backend": BACKEND_NAME, "emulated": counts,
            "passed_to_gloo": passed}


def record_in(meta: dict) -> None:
    """Put (or refresh) ``nccl_emulation`` in a rank's meta.json dict when this job emulates."""
    m = describe()
    if m is not None:
        meta["nccl_emulation"] = m
