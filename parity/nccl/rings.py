"""Rings as clusters build them, the communicator's channel count, and the order of a ring sum.

Why: on a multi-node ring each channel enters a node at a different GPU, so the same element
is summed in another rank order on another channel. Which ring a channel has is decided by
NCCL's topology search on the real machine; without a log it cannot be known exactly, so this
module gives the *plausible families* and the prediction takes their union (a superset).

Read from the NVIDIA/nccl sources (v2.20.5-1 ... v2.30.7-1), ``src/graph/``:

* Inter-node rings start at a NIC (``ncclTopoSearchRecNet``, ``search.cc``): search channel s
  tries ``nets[(nChannels + i) % netCount]`` first, so channel s starts at NIC ``s % nics``,
  and first at that NIC's local GPU (``net->net.localGpu``). The chain then walks the node's
  GPUs. On NVSwitch systems ``ncclTopoSearchNextGpuSort`` moves the next and then the previous
  GPU to the front of the candidate list (``firstGpus = {nextGpu, prevGpu}``, each moved to
  index 0 in turn), so the *previous* GPU is tried first: the chain descends, ``e, e-1, ...,
  e+1`` (NVIDIA/nccl#514, #1453: ``0 7 6 5 4 3 2 1 8 15 ...``).
* Every node runs the same search; node k's chain for channel c follows node k-1's
  (``connectRings``, ``connect.cc``): ring c = node 0's chain, node 1's chain, ... in rank
  terms.
* "Alternate rings to avoid crossing rails" (``ncclTopoPostset``): odd nodes exchange the
  chains of channels c and c^1 when the ring graph needed crossNic (rule per release:
  ``parity.nccl.versions``). Whether a cluster's search needed it depends on its NICs: both
  variants are plausible.
* Duplication: ``ncclTopoPostset`` doubles the search's channels (``nChannels*2``, the copy
  has the same rings); "Use 4 compute channels per search channel" doubles them once more on
  multi-node Hopper (and Blackwell from 2.25) when bwIntra > 45 GB/s and < 16 channels;
  ``NCCL_MAX_NCHANNELS``/``NCCL_MAX_CTAS`` keep the first channels, ``NCCL_MIN_NCHANNELS``/
  ``NCCL_MIN_CTAS`` copy them (``copyChannels``). Channel c's ring is search channel
  ``c % S``'s.
* On one node the search tries PCI order first and then replays the previous channel
  (``ncclTopoSearchRec``; ``sameChannels``), so every channel has one ring: an inference read
  from the search order and confirmed by public one-node logs (every ``Channel NN/24`` line
  the same).

Assumptions (named in every scenario, replaced by ``channels=``, ``nics=`` or a log):

* The communicator's channel count: one search channel per NIC, so 2 x NICs (16 with 8 NICs,
  8 with 4, 2 with 1: the counts public multi-node logs show), and 4 x NICs as well when that
  is below 16 (the Hopper duplication; the GPU is not known); 24 on one node (8-GPU NVSwitch
  A100/H100 logs). NICs default to one per GPU.
* The NIC of search channel s is local to GPU ``(s % nics) * gpus / nics``.
* Families without a log: ``nvswitch-descending`` (the rule above), the same with the odd-node
  swap, and ``pci-ascending`` (a PCIe node: the chain ascends from the NIC's GPU). A cluster
  whose GPU order differs from its PCI order (AWS p4d in NVIDIA/nccl#514) builds none of these:
  give its log.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ONE_NODE_CHANNELS = 24  # one 8-GPU NVSwitch node (A100, H100): public logs' "Channel NN/24"
HOPPER_DUP_LIMIT = 16  # ncclTopoPostset: "... && nChannels < 16"


@dataclass(frozen=True)
class RingFamily:
    """One way a cluster may have built its rings.

    Attributes:
        name: "log", "file", "one-node", "nvswitch-descending", "nvswitch-descending-odd-swap",
            "pci-ascending", "log-extrapolated".
        rings: channel -> ring for every channel of the communicator (shared tuples).
        assumption: what it rests on, in words ("" for a log's or file's rings).
    """

    name: str
    rings: tuple[tuple[int, ...], ...]
    assumption: str


@functools.lru_cache(maxsize=1 << 16)
def sum_order(ring: tuple[int, ...], owner: int) -> tuple[int, ...]:
    """Ranks in the order their values are added into ``owner``'s segment on this ring:
    next(owner), next(next(owner)), ..., owner (``runRing`` in ``src/device/reduce_scatter.h``:
    step 0 sends ``ringRanks[nranks-1]``'s chunk, every later step adds its own)."""
    i = ring.index(owner) + 1
    return tuple(ring[i:] + ring[:i])


def canonical_order(order: tuple[int, ...]) -> tuple[int, ...]:
    """Sum orders that give the same bits map to one key: the first addition commutes
    (a + b == b + a in IEEE arithmetic), every later one does not associate."""
    if len(order) < 2:
        return tuple(order)
    return tuple(sorted(order[:2])) + tuple(order[2:])


def same_sum(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two sum orders of the same ranks are bitwise the same computation."""
    return canonical_order(a) == canonical_order(b)


def nic_gpu(s: int, gpus: int, nics: int) -> int:
    """The local GPU of the NIC search channel ``s`` starts at (an assumption: NIC n is local
    to GPUs ``[n*gpus/nics, (n+1)*gpus/nics)`` and enters at the first)."""
    return (s % nics) * gpus // nics


def chain(entry: int, gpus: int, descending: bool) -> tuple[int, ...]:
    """A node's GPUs from ``entry``: descending (NVSwitch, previous GPU first) or ascending."""
    step = -1 if descending else 1
    return tuple((entry + step * i) % gpus for i in range(gpus))


@functools.lru_cache(maxsize=256)
def build_rings(nodes: int, gpus: int, chains: tuple[tuple[int, ...], ...], channels: int,
                odd_swap: bool = False) -> tuple[tuple[int, ...], ...]:
    """Rings of ``channels`` communicator channels from one local chain per search channel:
    every node runs the chain (odd nodes the chain of c^1 when ``odd_swap``), channel c uses
    search channel ``c % len(chains)``. Rings are shared tuples (callers key on ``id``)."""
    s_count = len(chains)
    base = []
    for s in range(s_count):
        ring = []
        for node in range(nodes):
            src = s ^ 1 if (odd_swap and node % 2 == 1 and (s ^ 1) < s_count) else s
            ring.extend(node * gpus + g for g in chains[src])
        base.append(tuple(ring))
    return tuple(base[c % s_count] for c in range(channels))


def channel_options(nodes: int, gpus: int, nics: int | None, max_channels: int,
                    env: dict | None = None) -> list[tuple[int, int, str]]:
    """Plausible (communicator channels, search channels, assumption) without a log or
    ``channels=`` (see the module docstring), after ``NCCL_MAX_*``/``NCCL_MIN_*``."""
    if nodes == 1:
        s = max(1, min(ONE_NODE_CHANNELS, max_channels) // 2)
        opts = [(2 * s, s, f"{2 * s} channels on one node (8-GPU NVSwitch A100/H100 logs)")]
    else:
        n = nics or gpus
        what = f"{n} NIC{'s' if n > 1 else ''} per node" + ("" if nics else " (one per GPU)")
        opts = [(min(2 * n, max_channels), n,
                 f"{min(2 * n, max_channels)} channels: 2 per NIC, {what}")]
        if 2 * n < HOPPER_DUP_LIMIT:
            opts.append((min(4 * n, max_channels), n,
                         f"{min(4 * n, max_channels)} channels: 4 per NIC (multi-node Hopper/"
                         f"Blackwell duplication), {what}"))
    return [(apply_channel_env(c, env), s, a) for c, s, a in opts]


def apply_channel_env(channels: int, env: dict | None) -> int:
    """``NCCL_MAX_NCHANNELS``/``NCCL_MAX_CTAS`` then ``NCCL_MIN_NCHANNELS``/``NCCL_MIN_CTAS``
    (``ncclTopoPostset``: keep the first channels, then copy them up to the minimum)."""
    env = env or {}

    def num(*names):
        vals = []
        for name in names:
            try:
                vals.append(int(str(env[name]).strip()))
            except (KeyError, ValueError):
                pass
        return vals

    hi = [v for v in num("NCCL_MAX_NCHANNELS", "NCCL_MAX_NRINGS", "NCCL_MAX_CTAS") if v > 0]
    lo = [v for v in num("NCCL_MIN_NCHANNELS", "NCCL_MIN_NRINGS", "NCCL_MIN_CTAS") if v > 0]
    if hi:
        channels = min(channels, min(hi))
    if lo:
        channels = max(channels, max(lo))
    return max(1, channels)


def search_channels(channels: int, nics: int) -> tuple[int, ...]:
    """Plausible search-channel counts behind a stated communicator count: half of it
    (``ncclTopoPostset``'s doubling) and a quarter when the Hopper duplication could have
    applied."""
    out = [max(1, channels // 2)] if channels >= 2 else [1]
    if channels % 4 == 0 and channels // 2 < HOPPER_DUP_LIMIT:
        out.append(channels // 4)
    return tuple(dict.fromkeys(out))


def plausible_families(nodes: int, gpus: int, nics: int | None, channels: int, s_count: int,
                       odd_swap_allowed: bool) -> list[RingFamily]:
    """The ring families a cluster without a log may have (see the module docstring)."""
    if nodes == 1:
        ring = build_rings(1, gpus, (chain(0, gpus, False),), channels)
        return [RingFamily("one-node", ring, "one node: every channel replays one ring")]
    n = nics or gpus
    desc = tuple(chain(nic_gpu(s, gpus, n), gpus, True) for s in range(s_count))
    asc = tuple(chain(nic_gpu(s, gpus, n), gpus, False) for s in range(s_count))
    where = f"search channel s enters each node at GPU (s % {n}) * {gpus} / {n}"
    out = [RingFamily("nvswitch-descending", build_rings(nodes, gpus, desc, channels),
                      f"NVSwitch: {where} and descends")]
    if odd_swap_allowed and s_count % 2 == 0 and nodes > 1:
        out.append(RingFamily("nvswitch-descending-odd-swap",
                              build_rings(nodes, gpus, desc, channels, odd_swap=True),
                              f"NVSwitch, crossNic rings: {where}, descends; odd nodes "
                              "exchange channels c and c^1"))
    out.append(RingFamily("pci-ascending", build_rings(nodes, gpus, asc, channels),
                          f"PCIe: {where} and ascends"))
    return dedupe_families(out)


def dedupe_families(families: list[RingFamily]) -> list[RingFamily]:
    """Families in order, each set of rings once."""
    seen, out = set(), []
    for f in families:
        if f.rings not in seen:
            seen.add(f.rings)
            out.append(f)
    return out


def extrapolate(nodes: int, gpus: int, prefixes: tuple[tuple[int, ...], ...],
                channels: int) -> RingFamily | None:
    """Rings from cut ring lines: per channel, the chain of the first node whose ranks all
    appear in the printed prefix (contiguously), run on every node; a channel without a line
    copies channel ``c - channels/2`` (``ncclTopoPostset``'s duplication). None when a channel
    shows no whole node."""
    chains: list[tuple[int, ...] | None] = []
    for c in range(channels):
        prefix = prefixes[c] if c < len(prefixes) else ()
        found = None
        for node in range(nodes):
            ranks = set(range(node * gpus, (node + 1) * gpus))
            idx = [i for i, r in enumerate(prefix) if r in ranks]
            if len(idx) == gpus and idx[-1] - idx[0] == gpus - 1:
                found = tuple(prefix[i] - node * gpus for i in idx)
                break
        chains.append(found)
    half = channels // 2
    for c in range(channels):
        if chains[c] is None and not (prefixes[c] if c < len(prefixes) else ()) and \
                channels % 2 == 0 and c >= half:
            chains[c] = chains[c - half]
    if any(ch is None for ch in chains):
        return None
    rings = build_rings(nodes, gpus, tuple(chains), channels)
    return RingFamily("log-extrapolated", rings,
                      "every node runs the chain of the first node the log's cut ring line "
                      "shows whole")


def agrees(rings: tuple[tuple[int, ...], ...], prefixes: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every channel's ring, read from rank 0 as NCCL prints it, starts with the log's
    prefix for that channel."""
    for c, prefix in enumerate(prefixes):
        if c >= len(rings):
            return False
        ring = rings[c]
        i = ring.index(0)
        n = len(ring)
        if any(ring[(i + k) % n] != prefix[k] for k in range(min(len(prefix), n))):
            return False
    return True
