"""A model of the order in which NCCL's Ring algorithm sums a reduce-scatter or all-reduce.

Why this exists: on gloo, or on one node, a bucket whose payload order changed gives the same
numbers, so a capture on a laptop cannot show what 64-256 GPUs would. What decides the numbers on
a cluster is, per element, the order in which the ranks' values are added. This module computes
that order from a topology and a buffer size alone, so that the diff can *predict* which elements
would be summed differently (``parity.diff.reduction``) and a CPU job can *emulate* it
(``parity.capture.nccl_emulation``). Both read the same functions here, so prediction and
emulation cannot drift apart.

The model (``MODEL``), read from the NVIDIA/nccl sources (see docs/reduction-order.md):

* Ring per channel (``src/device/reduce_scatter.h`` ``runRing``): the segment owned by rank d on
  channel c is built along channel c's ring as ``((x[next(d)] + x[next2(d)]) + ...) + x[d]``,
  stored in the collective's dtype after every hop. Chunking inside a channel does not change
  the order. All-reduce on Ring is a reduce-scatter over chunks of each channel's range
  (``src/device/all_reduce.h``) followed by a copy.
* Channel split (``scheduleCollTasksToPlan`` in ``src/enqueue.cc``, ``ncclCollCbdPart`` in
  ``src/include/device.h``): each rank's segment (reduce-scatter) or the whole buffer
  (all-reduce) is cut into contiguous ranges of whole "cells" per channel (cell = 16 KiB of
  traffic / traffic-per-byte, rounded to 16 B; x4 for LL), lo / mid... / hi channels, the last
  range shortened by the padding. Modelled for a collective alone in its kernel plan.
* Channel count: the communicator's channels (``channels=C``, else ``default_channels``), cut
  down for small messages as ``topoGetAlgoInfo`` does (``nBytes < nc * nThreads *
  threadThreshold``: 512 threads, Simple threshold 64 x nRanks for Ring). ``channels=C`` forces C.
* Rings (``src/graph/search.cc``, ``connect.cc``): one node -> every channel replays one ring
  (0 1 ... G-1), so order-only changes are harmless there. Several nodes -> channel c leaves each
  node through NIC ``c % G`` and enters the next node at GPU ``c % G``: node k's ranks appear in the
  ring rotated by ``c % G``. Real rings are read from an ``NCCL_DEBUG=INFO`` log instead
  (``Topology.rings``), when one is given.

Not modelled (said wherever the model is printed): NVLS, PAT (one GPU per node), CollNet, Tree
(never used for reduce-scatter), LL/LL128 chunk interleaving, several collectives sharing one
kernel plan (``ncclGroupStart``/coalescing), the odd-node channel swap (``crossNic==2``), and
NCCL's tuner plug-ins.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from parity.errors import ParityError

MODEL = "nccl-ring-cbd/1"
MODEL_LIMITS = ("Ring only (not NVLS, PAT, CollNet); one collective per kernel plan; "
                "rings rotate by NIC per channel unless read from an NCCL log")

SIMPLE, LL, LL128 = "Simple", "LL", "LL128"
_MIN_TRAFFIC_PER_CHANNEL = 16 << 10  # enqueue.cc MinTrafficPerChannel
_NTHREADS = 512  # NCCL_SIMPLE_MAX_NTHREADS / NCCL_LL_MAX_NTHREADS
_THREAD_THRESHOLD = {SIMPLE: 64, LL: 8, LL128: 8}  # NCCL_*_THREAD_THRESHOLD (Ring: x nRanks)
_MAX_CHANNELS = 64  # MAXCHANNELS
# all_reduce.h: a Ring all-reduce loop covers nRanks chunks of chunkSize bytes; Simple's chunk
# is buffSize / NCCL_STEPS * ALLREDUCE_CHUNKSTEPS = 4 MiB / 8 * 4.
_ALLREDUCE_CHUNK_BYTES = {SIMPLE: 2 << 20, LL: 1 << 14, LL128: 1 << 19}

REDUCE_SCATTER, ALL_REDUCE = "reduce_scatter", "all_reduce"

_TOPO_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(.*))?$")


@dataclass(frozen=True)
class Topology:
    """Where the reduction is imagined to run.

    Attributes:
        nodes: number of nodes.
        gpus: ranks (GPUs) per node; rank = node * gpus + local rank.
        channels: forced channel count (``channels=C``), or None to derive it per collective.
        protocol: NCCL protocol assumed for every collective (``proto=Simple|LL|LL128``).
        rings: channel -> ring (a permutation of the ranks), read from a real NCCL log; None to
            use the model's rings.
    """

    nodes: int
    gpus: int
    channels: int | None = None
    protocol: str = SIMPLE
    rings: tuple[tuple[int, ...], ...] | None = None
    # calls seen in an NCCL TUNING log (parity.nccl_log): (collective, total bytes, algorithm,
    # protocol, channels); a collective of exactly that size uses them instead of the model's
    tuning: tuple[tuple[str, int, str, str, int], ...] | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def spec(self) -> str:
        """The canonical text form (``parse`` reads it back)."""
        text = f"{self.nodes}x{self.gpus}"
        opts = []
        if self.channels is not None:
            opts.append(f"channels={self.channels}")
        if self.protocol != SIMPLE:
            opts.append(f"proto={self.protocol}")
        if self.rings is not None or self.tuning:
            opts.append("rings=log" if self.rings is not None else "tuning=log")
        return text + (":" + ",".join(opts) if opts else "")

    def to_dict(self) -> dict:
        out = {"nodes": self.nodes, "gpus": self.gpus, "world": self.world,
               "channels": self.channels, "protocol": self.protocol, "spec": self.spec()}
        if self.rings is not None:
            out["rings"] = [list(r) for r in self.rings]
        if self.tuning:
            out["tuning"] = [list(t) for t in self.tuning]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        rings = data.get("rings")
        return cls(int(data["nodes"]), int(data["gpus"]), data.get("channels"),
                   data.get("protocol", SIMPLE),
                   tuple(tuple(int(x) for x in r) for r in rings) if rings else None,
                   tuple((str(c), int(n), str(a), str(p), int(k))
                         for c, n, a, p, k in data["tuning"]) if data.get("tuning") else None)


def parse_topology(text: str) -> Topology:
    """``NODESxGPUS[:channels=C][,proto=P]`` -> Topology; a one-line ParityError otherwise."""
    m = _TOPO_RE.match(str(text))
    if not m:
        raise ParityError(f"topology {text!r}: expected NODESxGPUS[:channels=C], e.g. 8x8 or "
                          "32x8:channels=16")
    nodes, gpus = int(m.group(1)), int(m.group(2))
    if nodes < 1 or gpus < 1:
        raise ParityError(f"topology {text!r}: nodes and GPUs per node must be at least 1")
    channels, protocol = None, SIMPLE
    for opt in filter(None, (o.strip() for o in (m.group(3) or "").split(","))):
        key, _, value = opt.partition("=")
        key, value = key.strip(), value.strip()
        if key == "channels":
            if not value.isdigit() or not 1 <= int(value) <= _MAX_CHANNELS:
                raise ParityError(f"topology {text!r}: channels must be 1..{_MAX_CHANNELS}")
            channels = int(value)
        elif key in ("proto", "protocol"):
            names = {p.lower(): p for p in (SIMPLE, LL, LL128)}
            if value.lower() not in names:
                raise ParityError(f"topology {text!r}: proto must be Simple, LL or LL128")
            protocol = names[value.lower()]
        else:
            raise ParityError(f"topology {text!r}: unknown option {key!r} (channels=C, proto=P)")
    return Topology(nodes, gpus, channels, protocol)


def default_channels(topo: Topology) -> int:
    """The communicator's ring channel count when none is forced: two per GPU of a node (one
    NIC per GPU, two channels per NIC on current multi-node systems), at least 2, at most 32.
    An assumption, stated in docs/reduction-order.md; ``channels=C`` or an NCCL log replaces it."""
    if topo.rings is not None:
        return len(topo.rings)
    return max(2, min(32, 2 * topo.gpus))


def channel_count(topo: Topology, total_bytes: int) -> int:
    """Channels NCCL would give one collective moving ``total_bytes`` (the whole input)."""
    if topo.channels is not None:
        return topo.channels
    nc = default_channels(topo)
    threshold = _THREAD_THRESHOLD[topo.protocol] * topo.world  # Ring: x nRanks (tuning.cc)
    while nc >= 2 and total_bytes < nc * _NTHREADS * threshold:
        nc -= 1
    return nc


def tuned(topo: Topology, kind: str, total_bytes: int) -> tuple[str, str, int] | None:
    """(algorithm, protocol, channels) an NCCL TUNING log showed for a ``kind`` collective of
    exactly ``total_bytes`` (the whole input), or None."""
    for coll, nbytes, algo, proto, nch in topo.tuning or ():
        if coll == kind and nbytes == total_bytes:
            return algo, proto, nch
    return None


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def channel_split(count: int, elem_size: int, nranks: int, nchannels: int,
                  protocol: str = SIMPLE, kind: str = REDUCE_SCATTER) -> list[tuple[int, int]]:
    """Contiguous element ranges [lo, hi) of ``count`` per channel, for one collective alone in
    its plan (``scheduleCollTasksToPlan``): ``count`` is the per-rank count for a
    reduce-scatter, the whole count for an all-reduce. Channels that get nothing are absent;
    the list index is the channel id."""
    if count <= 0:
        return []
    traffic_per_byte = nranks if kind == REDUCE_SCATTER else 2
    if protocol == LL:
        traffic_per_byte *= 4
    cell_size = _div_up(_div_up(_MIN_TRAFFIC_PER_CHANNEL, traffic_per_byte), 16) * 16
    elems_per_cell = max(1, cell_size // elem_size)
    cells = _div_up(count * elem_size, cell_size)
    traffic = max(_MIN_TRAFFIC_PER_CHANNEL, count * elem_size * traffic_per_byte)
    traffic_per_channel = max(_MIN_TRAFFIC_PER_CHANNEL, traffic // nchannels)
    traffic_per_cell = cell_size * traffic_per_byte
    cells_per_channel = min(cells, _div_up(traffic_per_channel, traffic_per_cell))
    if nchannels == 1:
        cells_lo = cells
    else:
        cells_lo = min(cells, _div_up(traffic_per_channel, traffic_per_cell))
    n_mid = (cells - cells_lo) // cells_per_channel
    cells_hi = (cells - cells_lo) % cells_per_channel
    n_used = (1 if cells_lo else 0) + n_mid + (1 if cells_hi else 0)
    if nchannels < n_used:  # overflowed the channels: the rest goes to the last ones
        n_mid = nchannels - 2
        cells_per_channel = (cells - cells_lo) // (n_mid + 1)
        cells_hi = cells_per_channel + (cells - cells_lo) % (n_mid + 1)
    if cells_hi == 0 and n_mid != 0:
        cells_hi = cells_per_channel
        n_mid -= 1
    sizes = [cells_lo * elems_per_cell] + [cells_per_channel * elems_per_cell] * n_mid
    if cells_hi:
        sizes.append(cells_hi * elems_per_cell)
    sizes[-1] -= cells * elems_per_cell - count  # padding comes off the last range
    out, lo = [], 0
    for size in sizes:
        out.append((lo, lo + size))
        lo += size
    return out


def rings(topo: Topology, nchannels: int) -> list[tuple[int, ...]]:
    """Channel -> ring (rank order), for the first ``nchannels`` channels. Cached per topology:
    a prediction asks once per bucket, and every caller gets the same tuple objects."""
    every = _all_rings(topo)
    if nchannels <= len(every):
        return list(every[:nchannels])
    return [every[c % len(every)] for c in range(nchannels)]


@functools.lru_cache(maxsize=64)
def _all_rings(topo: Topology) -> tuple[tuple[int, ...], ...]:
    if topo.rings is not None:
        return tuple(topo.rings)
    g = topo.gpus
    distinct: dict[int, tuple[int, ...]] = {}  # channel c's ring depends on c % g only
    out = []
    for c in range(_MAX_CHANNELS):
        shift = 0 if topo.nodes == 1 else c % g
        ring = distinct.get(shift)
        if ring is None:
            ring = tuple(node * g + (shift + i) % g for node in range(topo.nodes)
                         for i in range(g))
            distinct[shift] = ring
        out.append(ring)
    return tuple(out)


def sum_order(ring: tuple[int, ...], owner: int) -> tuple[int, ...]:
    """Ranks in the order their values are added into ``owner``'s segment on this ring:
    next(owner), next(next(owner)), ..., owner (reduce_scatter.h runRing)."""
    i = ring.index(owner)
    n = len(ring)
    return tuple(ring[(i + 1 + k) % n] for k in range(n))


@dataclass(frozen=True)
class Segment:
    """A contiguous range of a collective's elements and the order their values are summed in.

    Attributes:
        lo, hi: element range [lo, hi); per-rank offsets for a reduce-scatter (the same for
            every owner), buffer offsets for an all-reduce.
        channel: the NCCL channel that reduces it.
        owner: the rank that ends up with the sum (all-reduce: the rank that finishes the
            chunk's reduction); None for a reduce-scatter, where every rank owns its own row.
        order: the rank order of the additions, or for a reduce-scatter the ring itself (use
            :func:`sum_order` with the owning rank).
    """

    lo: int
    hi: int
    channel: int
    owner: int | None
    order: tuple[int, ...]


def reduce_scatter_segments(topo: Topology, count: int, elem_size: int) -> list[Segment]:
    """The channel ranges of a reduce-scatter whose per-rank output has ``count`` elements, each
    with its channel's ring (``order``); rank d's elements in [lo, hi) are summed in
    ``sum_order(order, d)``."""
    nc, proto = channel_count(topo, count * elem_size * topo.world), topo.protocol
    seen = tuned(topo, REDUCE_SCATTER, count * elem_size * topo.world)
    if seen is not None:
        nc, proto = seen[2], seen[1]
    split = channel_split(count, elem_size, topo.world, nc, proto, REDUCE_SCATTER)
    ring_of = rings(topo, max(1, len(split)))
    return [Segment(lo, hi, c, None, ring_of[c]) for c, (lo, hi) in enumerate(split)]


def all_reduce_segments(topo: Topology, count: int, elem_size: int) -> list[Segment]:
    """Chunks of an all-reduce of ``count`` elements, each with its owner and sum order
    (all_reduce.h runRing: a loop covers nRanks chunks; chunk k of a loop is finished by ring
    position k, having been summed from ring position k+1 on; a short last loop is cut into
    nRanks chunks aligned to 16 bytes)."""
    n = topo.world
    nc = channel_count(topo, count * elem_size)
    split = channel_split(count, elem_size, n, nc, topo.protocol, ALL_REDUCE)
    ring_of = rings(topo, max(1, len(split)))
    chunk_full = max(1, _ALLREDUCE_CHUNK_BYTES[topo.protocol] // elem_size)
    align = max(1, 16 // elem_size)
    out = []
    for c, (lo, hi) in enumerate(split):
        ring = ring_of[c]
        off = lo
        while off < hi:
            rem = hi - off
            chunk = chunk_full
            if rem < n * chunk_full:
                chunk = _div_up(_div_up(rem, n), align) * align
            for k in range(n):
                a, b = off + k * chunk, min(hi, off + (k + 1) * chunk)
                if a >= b:
                    break
                owner = ring[k]
                out.append(Segment(a, b, c, owner, sum_order(ring, owner)))
            off += min(rem, n * chunk)
    return out


def canonical_order(order: tuple[int, ...]) -> tuple[int, ...]:
    """Sum orders that give the same bits map to one key: the first addition commutes
    (a + b == b + a in IEEE arithmetic), every later one does not associate."""
    if len(order) < 2:
        return tuple(order)
    return tuple(sorted(order[:2])) + tuple(order[2:])


def same_sum(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two sum orders of the same ranks are bitwise the same computation."""
    return canonical_order(a) == canonical_order(b)


def orders_differ(topo: Topology) -> bool:
    """Whether any two channels of this topology sum in a different order (if not, no layout
    change can change a Ring result)."""
    rs = rings(topo, default_channels(topo) if topo.channels is None else topo.channels)
    for owner in range(topo.world):
        if len({canonical_order(sum_order(r, owner)) for r in rs}) > 1:
            return True
    return False
