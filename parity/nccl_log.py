"""Read a real cluster's rings and channel choices from an NCCL log (``parity diff --nccl-log``).

Why: the Ring model (parity.nccl_model) guesses each channel's ring from the node count; a job
that ran with ``NCCL_DEBUG=INFO`` printed the real ones. This module turns such a log into a
:class:`parity.nccl_model.Topology` whose ``rings`` (and ``tuning``) replace the guesses.

What it reads (any rank's log; lines may carry the usual ``host:pid:tid [dev] NCCL INFO`` prefix):

- ``Channel 00/16 :    0   1   2 ...`` : rank 0's ring of each channel (``ncclBuildRings`` in
  ``src/graph/rings.cc``, printed by ``dumpLine`` starting from rank 0). NCCL cuts the line
  (it ends in ``...``): a ring with fewer ranks than the communicator cannot be used; then the
  model's rings are used and the result says so.
- ``comm 0x... rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 ...`` (``src/init.cc``): the
  node and per-node GPU counts.
- ``NCCL_DEBUG_SUBSYS=TUNING`` (NCCL 2.24.3+): ``ReduceScatter: 8388608 Bytes -> Algo RING proto
  SIMPLE channel{Lo..Hi}={0..15}``: a collective of that size used that algorithm, protocol
  and channel count; the prediction uses them for a bucket of exactly that size.

Standard library only. Errors are one-line ParityErrors (exit 2).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from parity.errors import ParityError
from parity.nccl_model import LL, LL128, SIMPLE, Topology

_CHANNEL = re.compile(r"Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*(\.\.\.)?\s*$")
_COMM = re.compile(r"\bnRanks (\d+) nNodes (\d+) localRanks (\d+)")
_TUNING = re.compile(r"\b(ReduceScatter|AllReduce|AllGather|Broadcast|Reduce): (\d+) Bytes -> "
                     r"Algo (\w+) proto (\w+) channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}")
_COLL = {"ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce", "AllGather": "all_gather",
         "Broadcast": "broadcast", "Reduce": "reduce"}
_PROTO = {"SIMPLE": SIMPLE, "LL": LL, "LL128": LL128}


def parse_nccl_log(path: str | Path, at: Topology | None = None) -> tuple[Topology, list[str]]:
    """The topology a log shows, and notes on what could not be used. ``at`` (``--at``) gives
    the node and GPU counts when the log does not."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise ParityError(f"--nccl-log {path}: cannot read ({e.strerror or e})") from None
    rings: dict[int, list[int]] = {}
    cut: set[int] = set()
    n_channels = None
    nranks = nnodes = local = None
    tuning: dict[tuple, tuple] = {}
    for line in text.splitlines():
        m = _CHANNEL.search(line)
        if m and "->" not in line:
            c = int(m.group(1))
            n_channels = int(m.group(2))
            rings.setdefault(c, [int(x) for x in m.group(3).split()])
            if m.group(4):
                cut.add(c)
            continue
        m = _COMM.search(line)
        if m:
            nranks, nnodes, local = int(m.group(1)), int(m.group(2)), int(m.group(3))
            continue
        m = _TUNING.search(line)
        if m:
            coll, nbytes, algo, proto = _COLL[m.group(1)], int(m.group(2)), m.group(3), m.group(4)
            nch = int(m.group(6)) - int(m.group(5)) + 1
            tuning.setdefault((coll, nbytes), (coll, nbytes, algo.upper(),
                                               _PROTO.get(proto.upper(), proto), nch))
    if not rings and not tuning:
        raise ParityError(f"--nccl-log {path}: no 'Channel NN/MM : ...' ring lines or TUNING "
                          "lines (run with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,TUNING)")
    notes: list[str] = []
    if nnodes is not None and local is not None and nnodes * local == nranks:
        nodes, gpus = nnodes, local
    elif at is not None:
        nodes, gpus = at.nodes, at.gpus
    else:
        raise ParityError(f"--nccl-log {path}: the log does not say nNodes/localRanks; give "
                          "--at NODESxGPUS as well")
    if at is not None and (at.nodes, at.gpus) != (nodes, gpus):
        raise ParityError(f"--nccl-log {path} shows {nodes}x{gpus}, --at says "
                          f"{at.nodes}x{at.gpus}")
    world = nodes * gpus
    ring_tuple = None
    if rings:
        bad = sorted(c for c, r in rings.items()
                     if c in cut or len(r) != world or sorted(r) != list(range(world)))
        missing = sorted(set(range(n_channels or 0)) - set(rings))
        if bad or missing:
            what = (f"channel {bad[0]}'s ring lists {len(rings[bad[0]])} of {world} ranks"
                    + (" (NCCL cut the line)" if bad[0] in cut else "")) if bad else \
                f"channel {missing[0]} has no ring line"
            notes.append(f"the log's rings cannot be used: {what}; the model's rings are used")
        else:
            ring_tuple = tuple(tuple(rings[c]) for c in range(len(rings)))
    rs = [t for t in tuning.values() if t[0] == "reduce_scatter"]
    other = sorted({t[2] for t in rs if t[2] != "RING"})
    if other:
        notes.append(f"the log shows reduce-scatters with algorithm {', '.join(other)}: not "
                     "modelled (Ring only); those sizes are predicted as Ring")
    base = at if at is not None else Topology(nodes, gpus)
    topo = replace(base, nodes=nodes, gpus=gpus, rings=ring_tuple,
                   tuning=tuple(t for t in tuning.values() if t[2] == "RING") or None)
    return topo, notes
