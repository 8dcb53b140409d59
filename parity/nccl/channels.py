"""How many channels a Ring collective gets, and which elements each channel reduces.

Why: an element's channel decides its ring, and so the order its ranks' values are summed in. A
payload reorder changes numbers on a cluster exactly where it moves elements between channels.

Two steps, both read from the NVIDIA/nccl sources (tags v2.20.5-1 ... v2.30.7-1):

1. The channel cut (``topoGetAlgoInfo`` in ``src/enqueue.cc`` from 2.22; ``getChannnelThreadInfo``
   in 2.20-2.21; the same loop in every release)::

       nc = comm->nChannels; nt = comm->maxThreads[algo][proto]
       while (nBytes < nc * nt * threadThreshold) { if (nc >= 2) nc--; else break; }

   ``nBytes`` is the whole input: ``elementSize * ncclFuncMaxSendRecvCount`` = nRanks x count for
   a reduce-scatter, count for an all-reduce. Thresholds (``ncclTopoTuneModel``,
   ``src/graph/tuning.cc``): ``NCCL_SIMPLE_THREAD_THRESHOLD`` 64, ``NCCL_LL_THREAD_THRESHOLD`` 8,
   ``NCCL_LL128_THREAD_THRESHOLD`` 8; only Ring LL is multiplied by nRanks. Threads: LL 512
   (``NCCL_LL_MAX_NTHREADS``), LL128 640 (``NCCL_LL128_MAX_NTHREADS``), Simple 512
   (``NCCL_SIMPLE_MAX_NTHREADS``) or 256 where ``bwIntra * nChannels <= PCI_BW``
   (``simpleDefaultThreads``); ``NCCL_NTHREADS`` / ``NCCL_LL128_NTHREADS`` override.

2. The split (``scheduleCollTasksToPlan``, ``ncclCollCbdPart`` in ``src/include/device.h``;
   ``addCBDCollToPlan`` in 2.20-2.21): four families, see :mod:`parity.nccl.versions`. Each
   channel gets one contiguous range of the per-rank count (reduce-scatter: the same range of
   every rank's segment) or of the buffer (all-reduce). A whole kernel plan is split at once:
   the collectives of one ``ncclGroupStart/End`` share the channels (``plan_split``).

Inferred, not read: nothing in the arithmetic. What a real job sets (the communicator's channel
count, the protocol, grouped partners) comes from outside this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.nccl.versions import SPLIT_CELL16, SPLIT_EVEN, SPLIT_MIN32K, Rules

SIMPLE, LL, LL128 = "Simple", "LL", "LL128"
PROTOCOLS = (LL, LL128, SIMPLE)  # NCCL_PROTO_LL 0, LL128 1, SIMPLE 2 (src/include/nccl_common.h)
REDUCE_SCATTER, ALL_REDUCE = "reduce_scatter", "all_reduce"

THREAD_THRESHOLD = {LL: 8, LL128: 8, SIMPLE: 64}  # NCCL_*_THREAD_THRESHOLD (src/include/device.h)
MAX_THREADS = {LL: 512, LL128: 640, SIMPLE: 512}  # NCCL_*_MAX_NTHREADS
SIMPLE_PCIE_THREADS = 256  # simpleDefaultThreads when bwIntra * nChannels <= PCI_BW
WARP_SIZE = 32
# computeCollAlignCount (2.20-2.21, src/enqueue.cc; constants in src/include/enqueue.h)
SIMPLE_ALIGNMENT = WARP_SIZE * 8 * 16  # NCCL_SIMPLE_ALIGNMENT, bytes
LL_ALIGNMENT_PER_THREAD = 8  # NCCL_LL_ALIGNMENT_PER_THREAD, bytes
LL128_ALIGNMENT_PER_WARP = 480  # NCCL_LL128_ALIGNMENT_PER_WARP, bytes
BYTES_ALIGNMENT = 16  # NCCL_BYTES_ALIGNMENT


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def traffic_per_byte(kind: str, nranks: int) -> int:
    """``ncclFuncTrafficPerByte`` (src/enqueue.cc): all-reduce 2, reduce-scatter nRanks."""
    return 2 if kind == ALL_REDUCE else nranks


def input_bytes(kind: str, count: int, elem_size: int, nranks: int) -> int:
    """``nBytes`` of ``getAlgoInfo``: ``elementSize * ncclFuncMaxSendRecvCount`` (the whole
    input: nRanks x count for a reduce-scatter, count for an all-reduce)."""
    return count * elem_size * (nranks if kind == REDUCE_SCATTER else 1)


def thread_threshold(protocol: str, nranks: int) -> int:
    """``comm->threadThresholds[NCCL_ALGO_RING][proto]`` (``ncclTopoTuneModel``): only Ring LL
    is multiplied by nRanks."""
    t = THREAD_THRESHOLD[protocol]
    return t * nranks if protocol == LL else t


def max_threads(protocol: str, pcie: bool = False, env: dict | None = None) -> int:
    """``comm->maxThreads[NCCL_ALGO_RING][proto]`` (``ncclTopoTuneModel``, ``getNthreads``):
    the defaults, ``NCCL_NTHREADS`` (Simple and LL, 64..max, a multiple of 64) and
    ``NCCL_LL128_NTHREADS`` (LL128, 160..640). ``pcie``: Simple's 256 for slow rings."""
    default = SIMPLE_PCIE_THREADS if (protocol == SIMPLE and pcie) else MAX_THREADS[protocol]
    name = "NCCL_LL128_NTHREADS" if protocol == LL128 else "NCCL_NTHREADS"
    text = (env or {}).get(name)
    if text is None:
        return default
    try:
        nt = int(str(text).strip())
    except ValueError:
        return default
    lo = MAX_THREADS[LL128] // 4 if protocol == LL128 else 2 * WARP_SIZE
    hi = MAX_THREADS[protocol]
    if nt <= 0:
        return default
    if nt % WARP_SIZE:  # getNthreads: "not a multiple of WARP_SIZE" -> max
        return hi
    return max(lo, min(hi, nt))


def channel_cut(nbytes: int, comm_channels: int, protocol: str, nranks: int,
                nthreads: int | None = None) -> int:
    """Channels a Ring collective of ``nbytes`` (``input_bytes``) gets out of the communicator's
    ``comm_channels`` (``topoGetAlgoInfo``: ``while (nBytes < nc*nt*threadThreshold) nc--``,
    never below 1)."""
    nt = MAX_THREADS[protocol] if nthreads is None else nthreads
    thr = thread_threshold(protocol, nranks)
    nc = max(1, comm_channels)
    while nc >= 2 and nbytes < nc * nt * thr:
        nc -= 1
    return nc


def thread_count(nbytes: int, nc: int, protocol: str, nranks: int,
                 nthreads: int | None = None) -> int:
    """``collInfo->nThreads`` after the cut (``getChannnelThreadInfo``, 2.20-2.21; the same
    arithmetic sets ``nWarps`` in ``topoGetAlgoInfo`` later): halve while ``nBytes < nc * nt *
    threshold`` and ``nt % 128 == 0``, add a warp for Ring Simple, at least 3 warps. Only
    2.20-2.21's LL/LL128 alignment reads it."""
    nt = MAX_THREADS[protocol] if nthreads is None else nthreads
    thr = thread_threshold(protocol, nranks)
    while nbytes < nc * nt * thr and nt % 128 == 0:
        nt //= 2
    if protocol == SIMPLE:
        nt += WARP_SIZE
    return max(nt, 3 * WARP_SIZE)


@dataclass(frozen=True)
class Task:
    """One collective of a kernel plan, as the split sees it.

    Attributes:
        kind: REDUCE_SCATTER or ALL_REDUCE.
        count: per-rank count (reduce-scatter) or the whole count (all-reduce).
        elem_size: bytes per element.
        protocol: the protocol the plan runs it with.
        nchannels: the task's ``nMaxChannels`` (after the cut).
        nthreads: the task's thread count (``thread_count``; 2.20-2.21 LL/LL128 alignment).
    """

    kind: str
    count: int
    elem_size: int
    protocol: str
    nchannels: int
    nthreads: int = 512


Ranges = tuple[tuple[int, int, int], ...]  # (channel, lo, hi) per used channel, in order


def _traffic_bytes(task: Task, nranks: int, rules: Rules) -> int:
    """``task->trafficBytes`` (``collTaskAppend`` ... ``ncclPrepareTasks``): count x elemSize x
    trafficPerByte, x4 for LL from 2.26."""
    t = task.count * task.elem_size * traffic_per_byte(task.kind, nranks)
    if task.protocol == LL and rules.ll_traffic_x4:
        t *= 4
    return t


def plan_split(tasks: list[Task], comm_channels: int, nranks: int, rules: Rules) -> list[Ranges]:
    """The channel ranges of every task of one kernel plan, in plan order (each task's ranges
    are (channel, lo, hi) in element offsets of its count). ``comm_channels`` is
    ``comm->nChannels``: the overflow check and the "last channel takes everything" rule
    compare with it, not with the task's cut count.

    2.22+: ``scheduleCollTasksToPlan`` (src/enqueue.cc), Ring/Tree tasks only (the
    ``!isCollnet`` branch), a plan that fits the kernel's work budget. 2.20-2.21:
    ``scheduleCollTasksToPlan`` + ``addCBDCollToPlan`` (the "CBD" queue; ``userTuned`` tasks
    excepted)."""
    if rules.split == SPLIT_EVEN:
        return _plan_split_even(tasks, comm_channels, rules)
    return _plan_split_cells(tasks, comm_channels, nranks, rules)


def _plan_split_cells(tasks: list[Task], comm_channels: int, nranks: int,
                      rules: Rules) -> list[Ranges]:
    min_traffic = rules.min_traffic
    n_max = comm_channels
    traffic = 0
    nch = 0
    for t in tasks:  # the budget loop at the top of scheduleCollTasksToPlan
        tb = _traffic_bytes(t, nranks, rules)
        traffic += tb if rules.split == SPLIT_CELL16 else max(min_traffic, tb)
        nch = min(nch + t.nchannels, n_max)
    if rules.split == SPLIT_MIN32K:
        per_channel = _div_up(traffic // nch, 16) * 16
    else:
        per_channel = max(min_traffic, traffic // nch)
    channel_id = 0
    current = 0
    out: list[Ranges] = []
    for t in tasks:
        es = t.elem_size
        tpb = traffic_per_byte(t.kind, nranks)
        if t.protocol == LL and rules.ll_traffic_x4:
            tpb *= 4
        cell_size = 16 if rules.split == SPLIT_CELL16 else _div_up(_div_up(min_traffic, tpb), 16) * 16
        epc = cell_size // es
        cells = _div_up(t.count * es, cell_size)
        tpe = es * tpb
        tpcell = cell_size * tpb
        cells_per_ch = min(cells, _div_up(per_channel, tpcell))
        if channel_id + 1 == n_max:  # on the last channel everything goes to "lo"
            cells_lo = cells
        elif rules.split == SPLIT_CELL16:
            cells_lo = min(cells, (per_channel - current) // tpcell)
        else:
            cells_lo = min(cells, _div_up(per_channel - current, tpcell))
        n_mid = (cells - cells_lo) // cells_per_ch
        cells_hi = (cells - cells_lo) % cells_per_ch
        n_ch = (1 if cells_lo else 0) + n_mid + (1 if cells_hi else 0)
        if n_max < channel_id + n_ch:  # overflowed the available channels
            n_mid = n_max - channel_id - 2
            cells_per_ch = (cells - cells_lo) // (n_mid + 1)
            cells_hi = cells_per_ch + (cells - cells_lo) % (n_mid + 1)
        if cells_hi == 0 and n_mid != 0:
            cells_hi = cells_per_ch
            n_mid -= 1
        if cells_lo == 0:  # least channel skipped: the next channel is the new least
            channel_id += 1
            if n_mid == 0:
                cells_lo, cells_hi = cells_hi, 0
            else:
                cells_lo = cells_per_ch
                n_mid -= 1
        count_mid = cells_per_ch * epc if n_mid != 0 else 0
        count_lo = cells_lo * epc
        count_hi = cells_hi * epc
        pad = cells * epc - t.count
        if count_hi != 0:
            count_hi -= pad
        else:
            count_lo -= pad
        n_ch = (1 if count_lo else 0) + n_mid + (1 if cells_hi else 0)
        ranges = []
        lo = 0
        for i in range(n_ch):  # ncclCollCbdPart: lo, mid..., hi
            size = count_lo if i == 0 else (count_hi if i == n_ch - 1 else count_mid)
            ranges.append((channel_id + i, lo, lo + size))
            lo += size
        out.append(tuple(r for r in ranges if r[2] > r[1]))
        if count_hi != 0:
            channel_id += n_ch - 1
            current = (count_hi if rules.split == SPLIT_CELL16 else cells_hi * epc) * tpe
        elif n_mid != 0:
            channel_id += n_ch
            current = 0
        else:
            current += (count_lo if rules.split == SPLIT_CELL16 else cells_lo * epc) * tpe
        if current >= per_channel and channel_id + 1 != n_max:
            channel_id += 1
            current = 0
    return out


def align_count(task: Task) -> int:
    """``computeCollAlignCount`` (2.20-2.21, src/enqueue.cc): Simple ``NCCL_SIMPLE_ALIGNMENT /
    typeSize``; LL ``NCCL_LL_ALIGNMENT_PER_THREAD / typeSize * nThreads``; LL128
    ``NCCL_LL128_ALIGNMENT_PER_WARP / typeSize * nWarps``."""
    es = task.elem_size
    if task.protocol == SIMPLE:
        return max(1, SIMPLE_ALIGNMENT // es)
    if task.protocol == LL128:
        return max(1, LL128_ALIGNMENT_PER_WARP // es * (task.nthreads // WARP_SIZE))
    return max(1, LL_ALIGNMENT_PER_THREAD // es * task.nthreads)


def _plan_split_even(tasks: list[Task], comm_channels: int, rules: Rules) -> list[Ranges]:
    usable = min(comm_channels, sum(t.nchannels for t in tasks))
    total = sum(t.count * t.elem_size for t in tasks)  # workBytes: per-rank bytes for RS
    max_per_channel = _div_up(_div_up(total, usable), BYTES_ALIGNMENT) * BYTES_ALIGNMENT
    used = [0] * usable  # chans[c].collBytes
    out: list[Ranges] = []
    for t in tasks:
        es = t.elem_size
        align = align_count(t)
        bytes_left, count_left, offset = t.count * es, t.count, 0
        ranges = []
        for c in range(usable):
            if max_per_channel <= used[c]:
                continue
            if bytes_left == 0:
                break
            enq = min(max_per_channel - used[c], bytes_left)
            n = min(_div_up(_div_up(enq, es), align) * align, count_left)
            ranges.append((c, offset, offset + n))
            bytes_left -= n * es
            count_left -= n
            used[c] += n * es
            offset += n
        out.append(tuple(ranges))
    return out


def channel_split(count: int, elem_size: int, nranks: int, nchannels: int,
                  protocol: str = SIMPLE, kind: str = REDUCE_SCATTER, rules: Rules | None = None,
                  comm_channels: int | None = None) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of ``count`` per channel for one collective alone in its
    plan; the list index is the channel id (every family fills channels 0.. in order for a
    lone task). ``nchannels`` is the task's cut count, ``comm_channels`` the communicator's
    (default: the same)."""
    from parity.nccl.versions import rules_for

    if count <= 0:
        return []
    rules = rules or rules_for(None)
    nt = thread_count(input_bytes(kind, count, elem_size, nranks), nchannels, protocol, nranks)
    task = Task(kind, count, elem_size, protocol, nchannels, nt)
    (ranges,) = plan_split([task], comm_channels or nchannels, nranks, rules)
    return [(lo, hi) for _, lo, hi in ranges]
