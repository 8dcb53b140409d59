"""The Triton kernels of the device digest (version 2); imported only by ``hashing_triton``.

Why a module of its own: Triton kernels and the helpers they call must be module-level
``triton.jit`` functions, and this module imports triton at import time, which no other capture
module may do (triton is optional; ``hashing_triton`` imports this one only when it is usable).
Under ``TRITON_INTERPRET=1`` set before this import, the kernels run in Triton's interpreter on
CPU tensors (how the tests check their logic).

The definition they compute is written in ``hashing.py`` (the torch-ops reference is tested bit
for bit against these kernels). Two kernels:

* ``digest_lanes``: one program per table row. A row is (address, count, first unit, slot *
  8 + mode); ``mode`` says how the row reads its tensor:

  - ``WORDS`` (+ ``FULL``): the bytes as little-endian uint32 words (1-, 2- and 4-byte
    elements: fp32, bf16 and fp16 all read at the same 4 bytes per load, which is what makes
    bf16 as fast as fp32); ``count`` is the tensor's number of whole words; a ``FULL`` row is a
    whole chunk of a 16-byte aligned tensor, read without a mask and with the alignment hints
    that let Triton emit 16-byte vector loads;
  - ``BYTES``: words composed from single bytes (``count`` is the tensor's byte length, bytes
    past it read as 0): the last, partial word of a tensor whose length is not a multiple of 4,
    and every word of a tensor whose address is not 4-byte aligned (a bf16 view at an odd
    element offset), where a uint32 load would be misaligned;
  - ``ELEM64`` (+ ``FULL``): 8-byte elements, low and high 32-bit halves (version 1's lanes).

  The row's partial lanes go to its slot with one atomic add per lane (uint64 wrapping: the
  definition's "mod 2**64"; integer addition, so the order of the adds changes nothing).
* ``digest_finish``: one lane per slot: the keyed 128-bit mix of the four lanes, the byte length
  and the dtype key into the slot's 16 digest bytes (``hashing.finish``), so that nothing per
  tensor is left to the host but copying the bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

WORDS = 0
BYTES = 1
ELEM64 = 2
FULL = 4  # a whole chunk of a 16-byte aligned tensor: no mask, vector loads
MODE_BITS = 3  # slot_mode = slot << MODE_BITS | mode

# what the kernels read of the above (a jitted function reads only constexpr globals)
_WORDS = tl.constexpr(WORDS)
_BYTES = tl.constexpr(BYTES)
_ELEM64 = tl.constexpr(ELEM64)
_WORDS_FULL = tl.constexpr(WORDS + FULL)
_ELEM64_FULL = tl.constexpr(ELEM64 + FULL)
# murmur3's fmix64 constants and the second seed (hashing.py has the same)
_C1 = tl.constexpr(0xFF51AFD7ED558CCD)
_C2 = tl.constexpr(0xC4CEB9FE1A85EC53)
_SEED_B = tl.constexpr(0x9E3779B97F4A7C15)


@triton.jit
def _weights(q_base, it, lane, BLOCK: tl.constexpr, B_MULT: tl.constexpr):
    """(a, b) weights of the units ``start + it * BLOCK + lane`` as uint64 (see hashing.py):
    32-bit arithmetic (the truncation is the definition's "mod 2**32"), widened for the
    32x32 -> 64-bit products."""
    q1 = q_base + it * BLOCK + lane.to(tl.uint32)
    b = (((q1 * B_MULT).to(tl.uint32)) >> 1) | 1
    return q1.to(tl.uint64), b.to(tl.uint64)


@triton.jit
def digest_lanes(table_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                 B_MULT: tl.constexpr):
    row = table_ptr + tl.program_id(0) * 4
    addr = tl.load(row)
    n = tl.load(row + 1)
    start = tl.load(row + 2)
    slot_mode = tl.load(row + 3)
    mode = slot_mode & 7
    slot = slot_mode >> 3
    lane = tl.arange(0, BLOCK)
    # a_k = (k mod 2**31) + 1. A row starts at a multiple of BLOCK * ITERS, which divides 2**31,
    # so k mod 2**31 does not wrap inside a row: a scalar base plus the lane.
    q_base = ((start & 0x7FFFFFFF) + 1).to(tl.uint32)
    acc_a = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_ah = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_bh = tl.zeros([BLOCK], dtype=tl.uint64)
    if mode == _WORDS_FULL:
        ptr = tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16)
        for it in tl.static_range(ITERS):
            idx = tl.max_contiguous(tl.multiple_of(start + it * BLOCK + lane, BLOCK), BLOCK)
            w = tl.load(ptr + idx).to(tl.uint64)
            a, b = _weights(q_base, it, lane, BLOCK, B_MULT)
            acc_a += w * a
            acc_b += w * b
    elif mode == _ELEM64_FULL:
        ptr = tl.multiple_of(addr.to(tl.pointer_type(tl.uint64)), 16)
        for it in tl.static_range(ITERS):
            idx = tl.max_contiguous(tl.multiple_of(start + it * BLOCK + lane, BLOCK), BLOCK)
            v = tl.load(ptr + idx)
            lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64)
            hi = (v >> 32).to(tl.uint32).to(tl.uint64)
            a, b = _weights(q_base, it, lane, BLOCK, B_MULT)
            acc_a += lo * a
            acc_b += lo * b
            acc_ah += hi * a
            acc_bh += hi * b
    else:
        # masked rows: a tensor's last chunk, small tensors, unaligned ones. Only the vector
        # steps the row needs load (a 1 KB tensor is one step of ITERS).
        if mode == _BYTES:
            units = (n + 3) // 4  # words, the last one partial
        else:
            units = n
        left = units - start
        for it in range(0, ITERS):
            if it * BLOCK < left:  # (a loop bounded by `left` trips Triton 3.6's interpreter)
                idx = start + it * BLOCK + lane
                a, b = _weights(q_base, it, lane, BLOCK, B_MULT)
                if mode == _WORDS:
                    ptr = addr.to(tl.pointer_type(tl.uint32))
                    w = tl.load(ptr + idx, mask=idx < n, other=0).to(tl.uint64)
                    acc_a += w * a
                    acc_b += w * b
                elif mode == _BYTES:
                    p8 = addr.to(tl.pointer_type(tl.uint8))
                    byte = idx * 4
                    w = tl.load(p8 + byte, mask=byte < n, other=0).to(tl.uint64)
                    w |= tl.load(p8 + byte + 1, mask=byte + 1 < n, other=0).to(tl.uint64) << 8
                    w |= tl.load(p8 + byte + 2, mask=byte + 2 < n, other=0).to(tl.uint64) << 16
                    w |= tl.load(p8 + byte + 3, mask=byte + 3 < n, other=0).to(tl.uint64) << 24
                    acc_a += w * a
                    acc_b += w * b
                else:
                    ptr = addr.to(tl.pointer_type(tl.uint64))
                    v = tl.load(ptr + idx, mask=idx < n, other=0)
                    lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64)
                    hi = (v >> 32).to(tl.uint32).to(tl.uint64)
                    acc_a += lo * a
                    acc_b += lo * b
                    acc_ah += hi * a
                    acc_bh += hi * b
    out = out_ptr + slot * 4
    tl.atomic_add(out, tl.sum(acc_a, axis=0).to(tl.int64, bitcast=True))
    tl.atomic_add(out + 2, tl.sum(acc_b, axis=0).to(tl.int64, bitcast=True))
    if (mode & 3) == _ELEM64:
        tl.atomic_add(out + 1, tl.sum(acc_ah, axis=0).to(tl.int64, bitcast=True))
        tl.atomic_add(out + 3, tl.sum(acc_bh, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def _fmix(x):
    """murmur3's fmix64 on uint64: a bijection of 64-bit words."""
    x ^= x >> 33
    x *= _C1
    x ^= x >> 33
    x *= _C2
    x ^= x >> 33
    return x


@triton.jit
def digest_finish(lanes_ptr, keys_ptr, digest_ptr, n, FBLOCK: tl.constexpr):
    """Slots [pid * FBLOCK, ...): lanes (n x 4 int64) and keys (n x 2: byte length, dtype key)
    -> digests (n x 2 int64, little-endian: the 16 digest bytes of each slot)."""
    s = tl.program_id(0) * FBLOCK + tl.arange(0, FBLOCK)
    m = s < n
    l0 = tl.load(lanes_ptr + s * 4, mask=m, other=0).to(tl.uint64, bitcast=True)
    l1 = tl.load(lanes_ptr + s * 4 + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    l2 = tl.load(lanes_ptr + s * 4 + 2, mask=m, other=0).to(tl.uint64, bitcast=True)
    l3 = tl.load(lanes_ptr + s * 4 + 3, mask=m, other=0).to(tl.uint64, bitcast=True)
    nbytes = tl.load(keys_ptr + s * 2, mask=m, other=0).to(tl.uint64, bitcast=True)
    dkey = tl.load(keys_ptr + s * 2 + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    seed_a = _fmix(nbytes ^ dkey)
    seed_b = _fmix(seed_a ^ _SEED_B)
    x = l0 ^ _fmix(l1 ^ seed_a)
    y = l2 ^ _fmix(l3 ^ seed_b)
    x = _fmix(x ^ seed_a)
    y = _fmix(y ^ x)
    x = _fmix(x ^ y)
    tl.store(digest_ptr + s * 2, x.to(tl.int64, bitcast=True), mask=m)
    tl.store(digest_ptr + s * 2 + 1, y.to(tl.int64, bitcast=True), mask=m)
