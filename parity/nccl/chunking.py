"""Ring all-reduce: how one channel's range is cut into chunks, and which rank finishes each.

Why: in a Ring all-reduce every chunk is summed along the ring starting at a different rank, so
the sum order of an element depends on its chunk, not only on its channel.

Read from the NVIDIA/nccl sources (v2.20.5-1 ... v2.30.7-1):

* ``runRing`` in ``src/device/all_reduce.h``: a channel's range is walked in loops of ``nranks
  * chunkCount`` elements. In a loop, chunk ``k`` (elements ``[k*chunkCount, (k+1)*chunkCount)``
  of the loop) is reduced last ("step k-1: reduce this buffer and data") by the rank whose
  ``ring->index`` is k, after the ranks of index k+1, k+2, ... added theirs in that order
  (step 0 sends chunk ``ringIx - 1``). So chunk k's sum order is the ring read from the rank of
  index k+1 on, ending at index k. A loop shorter than ``nranks * chunkCount`` uses
  ``chunkCount = alignUp(divUp(remCount, nranks), 16 / sizeof(T))`` (2.22+); 2.20-2.21 use
  ``lastChunkCount = DIVUP(DIVUP(remCount, nRanks), alignCount) * alignCount`` with
  ``computeCollAlignCount`` (``computeCollLastChunkInfo``, ``src/enqueue.cc``).
* ``ring->index`` (``setupChannel``, ``src/init.cc``): ``(ixRank - ixZero) % nRanks``, the
  distance from rank 0 along the ring, not a position in some printed list.
* ``chunkCount`` (``calcCollChunking`` from 2.22, ``computeCollChunkInfo`` in 2.20-2.21,
  ``src/enqueue.cc``): ``stepSize = buffSizes[proto] / NCCL_STEPS``; Simple ``stepSize *
  ALLREDUCE_CHUNKSTEPS`` = 4 MiB / 8 * 4 = 2 MiB; LL ``stepSize / 2`` = 524,288 / 8 / 2 =
  32 KiB (``DEFAULT_LL_BUFFSIZE``); LL128 ``stepSize / NCCL_LL128_LINEELEMS *
  NCCL_LL128_DATAELEMS`` = 4,915,200 / 8 / 16 * 15 = 576,000 B (``DEFAULT_LL128_BUFFSIZE``),
  aligned down to the protocol's grain (``ncclProtoGrainSize``: 16, 1,920, 512 B) from 2.22.
  ``NCCL_BUFFSIZE`` (Simple), ``NCCL_LL_BUFFSIZE`` and ``NCCL_LL128_BUFFSIZE`` change them.

A reduce-scatter's order does not depend on chunking (``runRing`` in
``src/device/reduce_scatter.h`` walks chunks, every chunk along the same ring).
"""

from __future__ import annotations

from parity.nccl.channels import LL, LL128, SIMPLE, Task, align_count
from parity.nccl.versions import SPLIT_EVEN, Rules

NCCL_STEPS = 8
ALLREDUCE_CHUNKSTEPS = NCCL_STEPS // 2
DEFAULT_BUFFSIZE = {SIMPLE: 1 << 22,  # DEFAULT_BUFFSIZE
                    LL: 8 * 512 * NCCL_STEPS * 16,  # DEFAULT_LL_BUFFSIZE
                    LL128: 120 * 640 * NCCL_STEPS * 8}  # DEFAULT_LL128_BUFFSIZE
GRAIN = {LL: 16, LL128: 32 * 8 // 16 * 15 * 8, SIMPLE: 512}  # ncclProtoGrainSize
_BUFFSIZE_ENV = {SIMPLE: "NCCL_BUFFSIZE", LL: "NCCL_LL_BUFFSIZE", LL128: "NCCL_LL128_BUFFSIZE"}


def chunk_bytes(protocol: str, rules: Rules, env: dict | None = None) -> int:
    """The Ring all-reduce chunk size in bytes (see the module docstring)."""
    buff = DEFAULT_BUFFSIZE[protocol]
    text = (env or {}).get(_BUFFSIZE_ENV[protocol])
    if text is not None:
        try:
            if int(str(text).strip()) > 0:
                buff = int(str(text).strip())
        except ValueError:
            pass
    step = buff // NCCL_STEPS
    if protocol == SIMPLE:
        size = step * ALLREDUCE_CHUNKSTEPS
    elif protocol == LL:
        size = step // 2
    else:
        size = step // 16 * 15
    if rules.split != SPLIT_EVEN:
        size = size // GRAIN[protocol] * GRAIN[protocol]
    return size


def ring_index(ring: tuple[int, ...]) -> dict[int, int]:
    """rank -> ``ring->index``: its distance from rank 0 along the ring (``setupChannel``)."""
    n = len(ring)
    zero = ring.index(0)
    return {r: (i - zero) % n for i, r in enumerate(ring)}


def owner_of_chunk(ring: tuple[int, ...], k: int) -> int:
    """The rank that finishes chunk ``k`` of a loop: the one whose ``ring->index`` is k."""
    n = len(ring)
    return ring[(ring.index(0) + k) % n]


def all_reduce_chunks(lo: int, hi: int, ring: tuple[int, ...], task: Task, rules: Rules,
                      env: dict | None = None) -> list[tuple[int, int, int]]:
    """(a, b, owner) for every chunk of one channel's range [lo, hi) of a Ring all-reduce
    (``runRing`` in ``src/device/all_reduce.h``), in buffer order."""
    n = len(ring)
    es = task.elem_size
    chunk_full = max(1, chunk_bytes(task.protocol, rules, env) // es)
    if rules.split == SPLIT_EVEN:
        align = align_count(task)
    else:
        align = max(1, 16 // es)
    zero = ring.index(0)
    out = []
    off = lo
    while off < hi:
        rem = hi - off
        chunk = chunk_full
        if rem < n * chunk_full:
            chunk = -(-(-(-rem // n)) // align) * align
        for k in range(n):
            a, b = off + k * chunk, min(hi, off + (k + 1) * chunk)
            if a >= b:
                break
            out.append((a, b, ring[(zero + k) % n]))
        off += min(rem, n * chunk)
    return out
