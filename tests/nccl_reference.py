"""An independent reference of NCCL's Ring reduce-scatter and all-reduce, for tests only.

Written from the NVIDIA/nccl sources (v2.20.5-1 ... v2.30.7-1), not from parity/nccl: the host
side is a line-by-line transliteration of ``topoGetAlgoInfo`` / ``getChannnelThreadInfo``,
``scheduleCollTasksToPlan`` (and 2.20-2.21's ``addCBDCollToPlan``), ``calcCollChunking`` and
``computeCollChunkInfo``, keeping NCCL's variable names; the device side walks the loops of
``runRing`` in ``src/device/reduce_scatter.h`` and ``src/device/all_reduce.h`` per channel, per
chunk and per ring step, following the data of one destination from the rank that sends it at
step 0 to the rank that finishes it, and asserting at every step that the rank the data reaches
works on that destination. ``ring->index`` is ``setupChannel``'s (``src/init.cc``).

tests/test_nccl_reference.py compares it with the model on thousands of seeded random cases.
Nothing here is imported by parity.
"""

from __future__ import annotations

from dataclasses import dataclass


def divUp(x, y):  # noqa: N802 (NCCL's name)
    return (x + y - 1) // y


def alignUp(x, a):  # noqa: N802
    return divUp(x, a) * a


NCCL_PROTO_LL, NCCL_PROTO_LL128, NCCL_PROTO_SIMPLE = 0, 1, 2
PROTO_IDS = {"LL": NCCL_PROTO_LL, "LL128": NCCL_PROTO_LL128, "Simple": NCCL_PROTO_SIMPLE}
WARP_SIZE = 32
NCCL_STEPS = 8


@dataclass
class Comm:
    nRanks: int
    nChannels: int
    version: tuple  # (2, minor)
    rings: list  # channel -> ring (list of ranks in ring order)

    @property
    def minor(self):
        return self.version[1]

    def maxThreads(self, proto):
        # ncclTopoTuneModel: Ring Simple 512 (NVLink), LL 512, LL128 640
        return {NCCL_PROTO_LL: 512, NCCL_PROTO_LL128: 640, NCCL_PROTO_SIMPLE: 512}[proto]

    def threadThresholds(self, proto):
        # NCCL_LL_THREAD_THRESHOLD 8 (x nRanks for Ring), LL128 8, SIMPLE 64
        t = {NCCL_PROTO_LL: 8, NCCL_PROTO_LL128: 8, NCCL_PROTO_SIMPLE: 64}[proto]
        return t * self.nRanks if proto == NCCL_PROTO_LL else t

    def buffSizes(self, proto):
        return {NCCL_PROTO_LL: 8 * 512 * NCCL_STEPS * 16,
                NCCL_PROTO_LL128: 120 * 640 * NCCL_STEPS * 8,
                NCCL_PROTO_SIMPLE: 1 << 22}[proto]


@dataclass
class TaskColl:
    func: str  # "ReduceScatter" | "AllReduce"
    count: int
    typeSize: int
    protocol: int
    nMaxChannels: int = 0
    nThreads: int = 0
    trafficBytes: int = 0


@dataclass
class DevWork:
    channelLo: int = 0
    channelHi: int = 0
    countLo: int = 0
    countMid: int = 0
    countHi: int = 0
    chunkGrainsLo: int = 0
    chunkGrainsMid: int = 0
    chunkGrainsHi: int = 0
    # 2.20-2.21: per channel (workOffset, workCount, lastChunkCount), chunkCount
    elems: dict | None = None
    chunkCount: int = 0


def ncclFuncMaxSendRecvCount(func, nRanks, count):  # noqa: N802
    return nRanks * count if func == "ReduceScatter" else count


def ncclFuncTrafficPerByte(func, nRanks):  # noqa: N802
    return 2 if func == "AllReduce" else nRanks


def ncclProtoGrainSize(proto):  # noqa: N802
    return {NCCL_PROTO_LL: 16, NCCL_PROTO_LL128: WARP_SIZE * 8 // 16 * 15 * 8,
            NCCL_PROTO_SIMPLE: 512}[proto]


def topoGetAlgoInfo(comm: Comm, task: TaskColl):  # noqa: N802
    """Ring channel and thread tuning (same code in getChannnelThreadInfo, 2.20-2.21)."""
    nBytes = task.typeSize * ncclFuncMaxSendRecvCount(task.func, comm.nRanks, task.count)
    nc = comm.nChannels
    nt = comm.maxThreads(task.protocol)
    threadThreshold = comm.threadThresholds(task.protocol)
    while nBytes < nc * nt * threadThreshold:
        if nc >= 2:
            nc -= 1
        else:
            break
    while nBytes < nc * nt * threadThreshold:
        if nt % 128 == 0:
            nt //= 2
        else:
            break
    if task.protocol == NCCL_PROTO_SIMPLE:
        nt += WARP_SIZE
    nt = 3 * WARP_SIZE if nt // WARP_SIZE < 3 else nt
    task.nMaxChannels = nc
    task.nThreads = nt


def chunkSizeOf(comm: Comm, task: TaskColl):  # noqa: N802
    """calcCollChunking / computeCollChunkInfo for Ring."""
    stepSize = comm.buffSizes(task.protocol) // NCCL_STEPS
    chunkSteps = (NCCL_STEPS // 2) if task.protocol == NCCL_PROTO_SIMPLE else 1
    chunkSize = stepSize * chunkSteps
    if task.protocol == NCCL_PROTO_LL:
        chunkSize //= 2
    if task.protocol == NCCL_PROTO_LL128:
        chunkSize = (chunkSize // 16) * 15
    if comm.minor >= 22:
        grainSize = ncclProtoGrainSize(task.protocol)
        chunkSize = chunkSize // grainSize * grainSize
    return chunkSize


def scheduleCollTasksToPlan(comm: Comm, tasks: list):  # noqa: N802
    """2.22+: the !isCollnet branch, one kind, a plan that fits the budget."""
    minor = comm.minor
    MinTrafficPerChannel = 512 if minor == 22 else (16 << 10) if minor <= 28 else (32 << 10)
    nMaxChannels = comm.nChannels
    trafficBytes = 0
    nChannels = 0
    for task in tasks:
        trafficBytes += task.trafficBytes if minor == 22 else max(MinTrafficPerChannel,
                                                                    task.trafficBytes)
        nChannels += task.nMaxChannels
        nChannels = min(nChannels, nMaxChannels)
    if minor >= 29:
        trafficPerChannel = divUp(trafficBytes // nChannels, 16) * 16
    else:
        trafficPerChannel = max(MinTrafficPerChannel, trafficBytes // nChannels)
    channelId = 0
    currentTraffic = 0
    works = []
    for task in tasks:
        elementSize = task.typeSize
        devWork = DevWork()
        trafficPerByte = ncclFuncTrafficPerByte(task.func, comm.nRanks)
        if minor >= 26 and task.protocol == NCCL_PROTO_LL:
            trafficPerByte *= 4
        if minor == 22:
            cellSize = 16
        else:
            cellSize = divUp(divUp(MinTrafficPerChannel, trafficPerByte), 16) * 16
        elementsPerCell = cellSize // elementSize
        cells = divUp(task.count * elementSize, cellSize)
        trafficPerElement = elementSize * trafficPerByte
        trafficPerCell = cellSize * trafficPerByte
        cellsPerChannel = min(cells, divUp(trafficPerChannel, trafficPerCell))
        if channelId + 1 == nMaxChannels:
            cellsLo = cells
        elif minor == 22:
            cellsLo = min(cells, (trafficPerChannel - currentTraffic) // trafficPerCell)
        else:
            cellsLo = min(cells, divUp((trafficPerChannel - currentTraffic), trafficPerCell))
        nMidChannels = (cells - cellsLo) // cellsPerChannel
        cellsHi = (cells - cellsLo) % cellsPerChannel
        nCh = (1 if cellsLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
        if nMaxChannels < channelId + nCh:
            nMidChannels = nMaxChannels - channelId - 2
            cellsPerChannel = (cells - cellsLo) // (nMidChannels + 1)
            cellsHi = cellsPerChannel + (cells - cellsLo) % (nMidChannels + 1)
        if cellsHi == 0 and nMidChannels != 0:
            cellsHi = cellsPerChannel
            nMidChannels -= 1
        if cellsLo == 0:
            channelId += 1
            if nMidChannels == 0:
                cellsLo = cellsHi
                cellsHi = 0
            else:
                cellsLo = cellsPerChannel
                nMidChannels -= 1
        countMid = cellsPerChannel * elementsPerCell if nMidChannels != 0 else 0
        countLo = cellsLo * elementsPerCell
        countHi = cellsHi * elementsPerCell
        if countHi != 0:
            countHi -= cells * elementsPerCell - task.count
        else:
            countLo -= cells * elementsPerCell - task.count
        nCh = (1 if countLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
        devWork.channelLo = channelId
        devWork.channelHi = channelId + nCh - 1
        devWork.countLo, devWork.countMid, devWork.countHi = countLo, countMid, countHi
        grainSize = ncclProtoGrainSize(task.protocol)
        chunkSize = chunkSizeOf(comm, task)
        devWork.chunkGrainsLo = devWork.chunkGrainsMid = devWork.chunkGrainsHi = \
            chunkSize // grainSize
        if countHi != 0:
            channelId += nCh - 1
            if minor == 22:
                currentTraffic = countHi * trafficPerElement
            else:
                currentTraffic = cellsHi * elementsPerCell * trafficPerElement
        elif nMidChannels != 0:
            channelId += nCh
            currentTraffic = 0
        else:
            if minor == 22:
                currentTraffic += countLo * trafficPerElement
            else:
                currentTraffic += cellsLo * elementsPerCell * trafficPerElement
        if currentTraffic >= trafficPerChannel and channelId + 1 != nMaxChannels:
            channelId += 1
            currentTraffic = 0
        works.append(devWork)
    return works


def computeCollAlignCount(task: TaskColl):  # noqa: N802
    if task.protocol == NCCL_PROTO_SIMPLE:
        return WARP_SIZE * 8 * 16 // task.typeSize
    if task.protocol == NCCL_PROTO_LL128:
        return 480 // task.typeSize * (task.nThreads // WARP_SIZE)
    return 8 // task.typeSize * task.nThreads


def addCBDCollsToPlan(comm: Comm, tasks: list):  # noqa: N802
    """2.20-2.21: scheduleCollTasksToPlan's CBD queue and addCBDCollToPlan."""
    usableChannels = min(comm.nChannels, sum(t.nMaxChannels for t in tasks))
    totalCBDBytes = sum(t.count * t.typeSize for t in tasks)
    maxBytesPerChannel = divUp(divUp(totalCBDBytes, usableChannels), 16) * 16
    collBytes = [0] * comm.nChannels
    works = []
    for task in tasks:
        typeSize = task.typeSize
        workBytesTotal = task.count * typeSize
        workCountTotal = task.count
        workOffset = 0
        alignCount = computeCollAlignCount(task)
        chunkCount = chunkSizeOf(comm, task) // typeSize
        elems = {}
        for c in range(usableChannels):
            if maxBytesPerChannel <= collBytes[c]:
                continue
            if workBytesTotal == 0:
                break
            enqBytes = min(maxBytesPerChannel - collBytes[c], workBytesTotal)
            workCount = min(divUp(divUp(enqBytes, typeSize), alignCount) * alignCount,
                            workCountTotal)
            enqBytes = workCount * typeSize
            # computeCollLastChunkInfo (Ring all-reduce)
            remCount = workCount % (comm.nRanks * chunkCount)
            lastChunkCount = divUp(divUp(remCount, comm.nRanks), alignCount) * alignCount
            elems[c] = (workOffset, workCount, lastChunkCount)
            workBytesTotal -= enqBytes
            workCountTotal -= workCount
            collBytes[c] += enqBytes
            workOffset += workCount
        works.append(DevWork(elems=elems, chunkCount=chunkCount))
    return works


def ncclCollCbdPart(work: DevWork, channelId, proto, eltSize):  # noqa: N802
    """(partOffset, partCount, chunkCount) of one channel (src/include/device.h)."""
    if work.elems is not None:
        off, cnt, _ = work.elems[channelId]
        return off, cnt, work.chunkCount
    eltPerGrain = ncclProtoGrainSize(proto) // eltSize
    nMidChannels = work.channelHi - work.channelLo - 1
    if channelId == work.channelLo:
        return 0, work.countLo, work.chunkGrainsLo * eltPerGrain
    if channelId == work.channelHi:
        return (work.countLo + nMidChannels * work.countMid, work.countHi,
                work.chunkGrainsHi * eltPerGrain)
    mid = channelId - work.channelLo - 1
    return work.countLo + mid * work.countMid, work.countMid, work.chunkGrainsMid * eltPerGrain


def channels_of(work: DevWork):
    if work.elems is not None:
        return sorted(work.elems)
    return list(range(work.channelLo, work.channelHi + 1))


class UserRanks:  # noqa: N801
    """ncclRing.userRanks of every rank of one ring: ``of(rank)[k]`` is the rank k steps after
    ``rank`` (``userRanks[0]`` is the rank itself)."""

    def __init__(self, ring):
        self.ring = list(ring)
        self.pos = {r: i for i, r in enumerate(ring)}

    def at(self, rank, k):
        return self.ring[(self.pos[rank] + k) % len(self.ring)]


def ringIndex(u: UserRanks, rank):  # noqa: N802
    """setupChannel (src/init.cc): ring->index = (ixRank - ixZero) % nranks."""
    return (u.pos[rank] - u.pos[0] + len(u.ring)) % len(u.ring)


def rs_order(comm: Comm, channel: int, dest: int) -> list:
    """runRing (reduce_scatter.h) for one chunk: the ranks whose data is added into ``dest``'s
    segment, in order, following the data along the ring step by step."""
    ring = comm.rings[channel]
    n = comm.nRanks
    u = UserRanks(ring)
    # step 0: each rank sends rankDest = ringRanks[nranks-1] (its prev); data moves to
    # ringRanks[1] (ring->next)
    senders = [r for r in ring if u.at(r, n - 1) == dest]
    assert len(senders) == 1
    r = senders[0]
    order = [r]
    for j in range(2, n):  # recvReduceSend of rankDest = ringRanks[nranks-j]
        r = u.at(r, 1)
        assert u.at(r, n - j) == dest
        order.append(r)
    r = u.at(r, 1)  # step k-1: recvReduceCopy into its own output
    assert u.at(r, 0) == dest == r
    order.append(r)
    return order


def ar_order(comm: Comm, channel: int, chunk: int) -> list:
    """runRing (all_reduce.h) for chunk ``chunk`` of a loop: the ranks that add into it."""
    ring = comm.rings[channel]
    n = comm.nRanks
    u = UserRanks(ring)

    def modRanks(r):  # noqa: N802
        return r - (n if r >= n else 0)

    senders = [r for r in ring if modRanks(ringIndex(u, r) + n - 1) == chunk]
    assert len(senders) == 1
    r = senders[0]
    order = [r]
    for j in range(2, n):  # directRecvReduceDirectSend
        r = u.at(r, 1)
        assert modRanks(ringIndex(u, r) + n - j) == chunk
        order.append(r)
    r = u.at(r, 1)  # step k-1: directRecvReduceCopyDirectSend, chunk = ringIx + 0
    assert ringIndex(u, r) == chunk
    order.append(r)
    return order


def element_order(comm: Comm, work: DevWork, task: TaskColl, e: int, dest: int = 0
                  ) -> tuple[int, list]:
    """(channel, sum order) of element ``e``: for a reduce-scatter ``e`` is a per-rank offset
    and the order is the one of destination rank ``dest``."""
    for c in channels_of(work):
        gridOffset, channelCount, chunkCount = ncclCollCbdPart(work, c, task.protocol,
                                                               task.typeSize)
        if not gridOffset <= e < gridOffset + channelCount:
            continue
        if task.func == "ReduceScatter":
            return c, rs_order(comm, c, dest)
        n = comm.nRanks
        loopCount = n * chunkCount
        elemOffset = 0
        while elemOffset < channelCount:
            remCount = channelCount - elemOffset
            if remCount < loopCount:
                if work.elems is not None:
                    chunkCount = work.elems[c][2]
                else:
                    chunkCount = alignUp(divUp(remCount, n), 16 // task.typeSize)
            for chunk in range(n):
                chunkOffset = chunk * chunkCount
                nelem = min(chunkCount, remCount - chunkOffset)
                off = gridOffset + elemOffset + chunkOffset
                if nelem > 0 and off <= e < off + nelem:
                    return c, ar_order(comm, c, chunk)
            elemOffset += loopCount
        raise AssertionError("element not reached by the loop")
    raise AssertionError("element on no channel")


def run(minor: int, func: str, count: int, typeSize: int, proto: str, nRanks: int,
        nChannels: int, rings: list):
    """Plan one collective alone; returns (comm, work, task)."""
    comm = Comm(nRanks, nChannels, (2, minor), rings)
    task = TaskColl(func, count, typeSize, PROTO_IDS[proto])
    topoGetAlgoInfo(comm, task)
    task.trafficBytes = count * typeSize * ncclFuncTrafficPerByte(func, nRanks)
    if minor >= 26 and task.protocol == NCCL_PROTO_LL:
        task.trafficBytes *= 4  # ncclPrepareTasks
    if minor <= 21:
        (work,) = addCBDCollsToPlan(comm, [task])
    else:
        (work,) = scheduleCollTasksToPlan(comm, [task])
    return comm, work, task


def channel_parts(comm, work, task):
    """(channel, lo, hi) per channel with elements, in channel order."""
    out = []
    for c in channels_of(work):
        off, cnt, _ = ncclCollCbdPart(work, c, task.protocol, task.typeSize)
        if cnt > 0:
            out.append((c, off, off + cnt))
    return out
