"""The Triton kernels of the device digest (version 2) and of the figures beside it; imported
only by ``hashing_triton``.

Why a module of its own: Triton kernels and the helpers they call must be module-level
``triton.jit`` functions, and this module imports triton at import time, which no other capture
module may do (triton is optional; ``hashing_triton`` imports this one only when it is usable).
Under ``TRITON_INTERPRET=1`` set before this import, the kernels run in Triton's interpreter on
CPU tensors (how the tests check their logic).

The definition they compute is written in ``hashing.py`` (the torch-ops reference is tested bit
for bit against these kernels). Three kernels:

* ``digest_lanes``: one program per table row. A row is (address, count, first unit,
  slot << SLOT_SHIFT | kind << KIND_SHIFT | mode); ``mode`` says how the row reads its tensor:

  - ``WORDS`` (+ ``FULL``): the bytes as little-endian uint32 words (1-, 2- and 4-byte
    elements: fp32, bf16 and fp16 all read at the same 4 bytes per load, which is what makes
    bf16 as fast as fp32); ``count`` is the tensor's number of whole words; a ``FULL`` row is a
    whole chunk of a 16-byte aligned tensor, read without a mask and with the alignment hints
    that let Triton emit 16-byte vector loads;
  - ``BYTES``: words composed from single bytes (``count`` is the byte length the row may read,
    bytes past it read as 0): the last, partial word of a tensor whose length is not a multiple
    of 4, and every whole word of a tensor whose address is not 4-byte aligned (a bf16 view at
    an odd element offset), where a uint32 load would be misaligned;
  - ``ELEM64`` (+ ``FULL``): 8-byte elements, low and high 32-bit halves (version 1's lanes).

  The row's partial lanes go to its slot with one atomic add per lane (uint64 wrapping: the
  definition's "mod 2**64"; integer addition, so the order of the adds changes nothing).

  With ``FIGURES`` (a compile-time switch: the digest alone compiles without any of it) the
  same pass also decodes every unit by the row's ``kind`` (the tensor's dtype, ``KINDS``) and
  writes the row's partial figures, in float64, to its own three slots of ``fig_ptr`` (no
  atomics): the sum and the sum of squares of its values (each lane accumulates its units in
  unit order, ``tl.fma`` for the squares, then one ``tl.sum`` over the lanes) and max |x|
  (the largest absolute bit pattern, an integer maximum: exact, and NaN wins because a NaN's
  pattern is above infinity's). Every mode visits a lane's units in the same order, and bytes
  past a tensor's end (zero) add nothing, so a tensor's row partials do not depend on its
  address or alignment (``hashing_triton._build`` cuts an unaligned tensor into the same rows
  as an aligned one). Decoded in the kernel: float32, bfloat16, float16, float64, int8, uint8,
  bool, int16, int32, int64, complex64 and complex128 (their real and imaginary parts), and
  complex32 (as float16 pairs). Any other dtype (float8 formats, uint16/32/64, ...) has kind
  ``K_NONE``: its partials are zeros, and ``hashing`` computes its figures with torch ops.
* ``digest_finish``: one lane per slot: the keyed 128-bit mix of the four lanes, the byte length
  and the dtype key into the slot's 16 digest bytes (``hashing.finish``), so that nothing per
  tensor is left to the host but copying the bytes.
* ``figures_reduce`` (with figures): one program per slot, which adds the partials of the
  slot's rows (consecutive in the table, in unit order) ``RBLOCK`` rows at a time in a fixed
  order and writes the slot's three float64 figures beside its digest. Fixed order, no float
  atomics: the same tensor gives the same figures bit for bit at every call, so two equal
  tensors never get different figures. They equal the host reference (``hashing.tensor_figures``)
  up to the order of float64 additions (tests/test_capture_hashing_triton.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

WORDS = 0
BYTES = 1
ELEM64 = 2
FULL = 4  # a whole chunk of a 16-byte aligned tensor: no mask, vector loads
MODE_BITS = 3  # the low bits of a row's last field: its mode
KIND_SHIFT = 3  # then the kind of its values (for the figures)
SLOT_SHIFT = 8  # then its slot (the tensor's index in the table)

# kinds: how a row's units decode into values for the figures (hashing_triton.figure_kind)
K_NONE = 0  # not decoded here: figures by torch ops (hashing)
K_F32 = 1   # a word: one float32
K_BF16 = 2  # a word: two bfloat16
K_F16 = 3   # a word: two float16 (complex32: its parts)
K_I8 = 4    # a word: four int8
K_U8 = 5    # a word: four uint8
K_BOOL = 6  # a word: four bool (a byte other than 0 is 1)
K_I16 = 7   # a word: two int16
K_I32 = 8   # a word: one int32
K_F64 = 9   # an 8-byte unit: one float64 (complex128: its parts)
K_I64 = 10  # an 8-byte unit: one int64
K_C64 = 11  # an 8-byte unit: a complex64, two float32
KINDS = 12

# what the kernels read of the above (a jitted function reads only constexpr globals)
_WORDS = tl.constexpr(WORDS)
_BYTES = tl.constexpr(BYTES)
_ELEM64 = tl.constexpr(ELEM64)
_WORDS_FULL = tl.constexpr(WORDS + FULL)
_ELEM64_FULL = tl.constexpr(ELEM64 + FULL)
_KIND_SHIFT = tl.constexpr(KIND_SHIFT)
_SLOT_SHIFT = tl.constexpr(SLOT_SHIFT)
_K_NONE = tl.constexpr(K_NONE)
_K_F32 = tl.constexpr(K_F32)
_K_BF16 = tl.constexpr(K_BF16)
_K_F16 = tl.constexpr(K_F16)
_K_I8 = tl.constexpr(K_I8)
_K_U8 = tl.constexpr(K_U8)
_K_BOOL = tl.constexpr(K_BOOL)
_K_I16 = tl.constexpr(K_I16)
_K_I32 = tl.constexpr(K_I32)
_K_F64 = tl.constexpr(K_F64)
_K_I64 = tl.constexpr(K_I64)
_K_C64 = tl.constexpr(K_C64)
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


# ------------------------------------------------------------------------------------ figures
# Per lane: fs (float64 sum), fq (float64 sum of squares), fm (uint64: the largest absolute bit
# pattern, or absolute integer value, seen; decoded by _max_value at the row's end).


@triton.jit
def _add(v, fs, fq):
    return fs + v, tl.fma(v, v, fq)


@triton.jit
def _sext(x, BITS: tl.constexpr):
    """The low BITS bits of uint32 ``x`` as a signed int32."""
    h = x & ((1 << BITS) - 1)
    return (h ^ (1 << (BITS - 1))).to(tl.int32) - (1 << (BITS - 1))


@triton.jit
def _iabs(x):
    """|x| of int32 ``x`` as uint64 (|-2**31| = 2**31)."""
    return tl.where(x < 0, -x, x).to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _word_figures(w, fs, fq, fm, KIND):
    """Add the values of uint32 words ``w`` (one per lane) to the lanes' figures. ``KIND`` is a
    constexpr in the unrolled loops (Triton specializes the call: one branch compiled) and the
    row's run-time kind in the masked loop (a branch per kind)."""
    if KIND == _K_F32:
        fs, fq = _add(w.to(tl.float32, bitcast=True).to(tl.float64), fs, fq)
        fm = tl.maximum(fm, (w & 0x7FFFFFFF).to(tl.uint64))
    elif KIND == _K_BF16:
        fs, fq = _add((w << 16).to(tl.float32, bitcast=True).to(tl.float64), fs, fq)
        fs, fq = _add((w & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.float64), fs, fq)
        fm = tl.maximum(fm, tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF).to(tl.uint64))
    elif KIND == _K_F16:
        fs, fq = _add((w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float64),
                      fs, fq)
        fs, fq = _add((w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float64),
                      fs, fq)
        fm = tl.maximum(fm, tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF).to(tl.uint64))
    elif KIND == _K_I8:
        for j in tl.static_range(4):
            x = _sext(w >> (8 * j), 8)
            fs, fq = _add(x.to(tl.float64), fs, fq)
            fm = tl.maximum(fm, _iabs(x))
    elif KIND == _K_U8:
        for j in tl.static_range(4):
            x = (w >> (8 * j)) & 0xFF
            fs, fq = _add(x.to(tl.float64), fs, fq)
            fm = tl.maximum(fm, x.to(tl.uint64))
    elif KIND == _K_BOOL:
        for j in tl.static_range(4):
            x = (((w >> (8 * j)) & 0xFF) != 0).to(tl.uint32)
            fs, fq = _add(x.to(tl.float64), fs, fq)
            fm = tl.maximum(fm, x.to(tl.uint64))
    elif KIND == _K_I16:
        for j in tl.static_range(2):
            x = _sext(w >> (16 * j), 16)
            fs, fq = _add(x.to(tl.float64), fs, fq)
            fm = tl.maximum(fm, _iabs(x))
    elif KIND == _K_I32:
        x = w.to(tl.int32, bitcast=True)
        fs, fq = _add(x.to(tl.float64), fs, fq)
        fm = tl.maximum(fm, _iabs(x))
    return fs, fq, fm


@triton.jit
def _elem_figures(v, fs, fq, fm, KIND):
    """Add the values of uint64 units ``v`` (one per lane) to the lanes' figures (``KIND``: as
    in ``_word_figures``)."""
    if KIND == _K_F64:
        fs, fq = _add(v.to(tl.float64, bitcast=True), fs, fq)
        fm = tl.maximum(fm, v & 0x7FFFFFFFFFFFFFFF)
    elif KIND == _K_I64:
        x = v.to(tl.int64, bitcast=True)
        fs, fq = _add(x.to(tl.float64), fs, fq)
        fm = tl.maximum(fm, tl.where(x < 0, -x, x).to(tl.uint64, bitcast=True))
    elif KIND == _K_C64:
        lo = (v & 0xFFFFFFFF).to(tl.uint32)
        hi = (v >> 32).to(tl.uint32)
        fs, fq = _add(lo.to(tl.float32, bitcast=True).to(tl.float64), fs, fq)
        fs, fq = _add(hi.to(tl.float32, bitcast=True).to(tl.float64), fs, fq)
        fm = tl.maximum(fm, tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF).to(tl.uint64))
    return fs, fq, fm


@triton.jit
def _max_value(m, kind):
    """The float64 value of a row's largest pattern ``m`` (uint64) for its kind; a NaN pattern
    gives NaN. Returned with its sign bit clear, as int64 bits (figures_reduce compares them as
    integers)."""
    if (kind == _K_F32) | (kind == _K_C64):
        x = m.to(tl.uint32).to(tl.float32, bitcast=True).to(tl.float64)
    elif kind == _K_BF16:
        x = (m.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(tl.float64)
    elif kind == _K_F16:
        x = m.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float64)
    elif kind == _K_F64:
        x = m.to(tl.float64, bitcast=True)
    elif kind == _K_NONE:
        x = m.to(tl.float64) * 0.0
    else:  # integers: |x| itself (int64's rounds like the host's float64 conversion)
        x = m.to(tl.float64)
    return x.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF


# ------------------------------------------------------------------------------------- lanes
@triton.jit
def _words_full(ptr, start, q_base, lane, acc_a, acc_b, fs, fq, fm, BLOCK: tl.constexpr,
                ITERS: tl.constexpr, B_MULT: tl.constexpr, KIND: tl.constexpr,
                FIGURES: tl.constexpr):
    for it in tl.static_range(ITERS):
        idx = tl.max_contiguous(tl.multiple_of(start + it * BLOCK + lane, BLOCK), BLOCK)
        w32 = tl.load(ptr + idx)
        w = w32.to(tl.uint64)
        a, b = _weights(q_base, it, lane, BLOCK, B_MULT)
        acc_a += w * a
        acc_b += w * b
        if FIGURES:
            fs, fq, fm = _word_figures(w32, fs, fq, fm, KIND)
    return acc_a, acc_b, fs, fq, fm


@triton.jit
def _elems_full(ptr, start, q_base, lane, acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm,
                BLOCK: tl.constexpr, ITERS: tl.constexpr, B_MULT: tl.constexpr,
                KIND: tl.constexpr, FIGURES: tl.constexpr):
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
        if FIGURES:
            fs, fq, fm = _elem_figures(v, fs, fq, fm, KIND)
    return acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm


@triton.jit
def digest_lanes(table_ptr, out_ptr, fig_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                 B_MULT: tl.constexpr, FIGURES: tl.constexpr):
    """Lanes of every row (atomic adds into ``out_ptr``: slots x 4 int64) and, with
    ``FIGURES``, the row's partial figures (``fig_ptr``: rows x 3 float64, the max as int64
    bits)."""
    row_id = tl.program_id(0)
    row = table_ptr + row_id * 4
    addr = tl.load(row)
    n = tl.load(row + 1)
    start = tl.load(row + 2)
    slot_mode = tl.load(row + 3)
    mode = slot_mode & 7
    kind = (slot_mode >> _KIND_SHIFT) & 31
    slot = slot_mode >> _SLOT_SHIFT
    lane = tl.arange(0, BLOCK)
    # a_k = (k mod 2**31) + 1. A row starts at a multiple of BLOCK * ITERS, which divides 2**31,
    # so k mod 2**31 does not wrap inside a row: a scalar base plus the lane.
    q_base = ((start & 0x7FFFFFFF) + 1).to(tl.uint32)
    acc_a = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_ah = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_bh = tl.zeros([BLOCK], dtype=tl.uint64)
    fs = tl.zeros([BLOCK], dtype=tl.float64)
    fq = tl.zeros([BLOCK], dtype=tl.float64)
    fm = tl.zeros([BLOCK], dtype=tl.uint64)
    # Whole aligned chunks run unrolled loops with 16-byte loads; with FIGURES only the dtypes
    # models hold (float32, bfloat16, float16, float64) get a loop of their own (each kind's
    # decoding unrolled on its own: compile time and code size grow with every one), the other
    # kinds read their whole chunks through the masked loop below, decoded at run time.
    if (mode == _WORDS_FULL) & ((not FIGURES) | (kind == _K_F32) | (kind == _K_BF16)
                                | (kind == _K_F16)):
        ptr = tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16)
        if not FIGURES:
            acc_a, acc_b, fs, fq, fm = _words_full(ptr, start, q_base, lane, acc_a, acc_b, fs,
                                                   fq, fm, BLOCK, ITERS, B_MULT, _K_NONE, False)
        elif kind == _K_F32:
            acc_a, acc_b, fs, fq, fm = _words_full(ptr, start, q_base, lane, acc_a, acc_b, fs,
                                                   fq, fm, BLOCK, ITERS, B_MULT, _K_F32, True)
        elif kind == _K_BF16:
            acc_a, acc_b, fs, fq, fm = _words_full(ptr, start, q_base, lane, acc_a, acc_b, fs,
                                                   fq, fm, BLOCK, ITERS, B_MULT, _K_BF16, True)
        else:
            acc_a, acc_b, fs, fq, fm = _words_full(ptr, start, q_base, lane, acc_a, acc_b, fs,
                                                   fq, fm, BLOCK, ITERS, B_MULT, _K_F16, True)
    elif (mode == _ELEM64_FULL) & ((not FIGURES) | (kind == _K_F64)):
        ptr = tl.multiple_of(addr.to(tl.pointer_type(tl.uint64)), 16)
        if not FIGURES:
            acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm = _elems_full(
                ptr, start, q_base, lane, acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm, BLOCK,
                ITERS, B_MULT, _K_NONE, False)
        else:
            acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm = _elems_full(
                ptr, start, q_base, lane, acc_a, acc_b, acc_ah, acc_bh, fs, fq, fm, BLOCK,
                ITERS, B_MULT, _K_F64, True)
    else:
        # masked rows: a tensor's last chunk, small tensors, unaligned ones. Only the vector
        # steps the row needs load (a 1 KB tensor is one step of ITERS).
        # (and, with FIGURES, whole chunks of the other kinds: ``mode & 3`` drops FULL)
        how = mode & 3
        if how == _BYTES:
            units = (n + 3) // 4  # words, the last one partial
        else:
            units = n
        left = units - start
        for it in range(0, ITERS):
            if it * BLOCK < left:  # (a loop bounded by `left` trips Triton 3.6's interpreter)
                idx = start + it * BLOCK + lane
                a, b = _weights(q_base, it, lane, BLOCK, B_MULT)
                if how == _WORDS:
                    ptr = addr.to(tl.pointer_type(tl.uint32))
                    w32 = tl.load(ptr + idx, mask=idx < n, other=0)
                    w = w32.to(tl.uint64)
                    acc_a += w * a
                    acc_b += w * b
                    if FIGURES:
                        fs, fq, fm = _word_figures(w32, fs, fq, fm, kind)
                elif how == _BYTES:
                    p8 = addr.to(tl.pointer_type(tl.uint8))
                    byte = idx * 4
                    w = tl.load(p8 + byte, mask=byte < n, other=0).to(tl.uint64)
                    w |= tl.load(p8 + byte + 1, mask=byte + 1 < n, other=0).to(tl.uint64) << 8
                    w |= tl.load(p8 + byte + 2, mask=byte + 2 < n, other=0).to(tl.uint64) << 16
                    w |= tl.load(p8 + byte + 3, mask=byte + 3 < n, other=0).to(tl.uint64) << 24
                    acc_a += w * a
                    acc_b += w * b
                    if FIGURES:
                        fs, fq, fm = _word_figures(w.to(tl.uint32), fs, fq, fm, kind)
                else:
                    ptr = addr.to(tl.pointer_type(tl.uint64))
                    v = tl.load(ptr + idx, mask=idx < n, other=0)
                    lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64)
                    hi = (v >> 32).to(tl.uint32).to(tl.uint64)
                    acc_a += lo * a
                    acc_b += lo * b
                    acc_ah += hi * a
                    acc_bh += hi * b
                    if FIGURES:
                        fs, fq, fm = _elem_figures(v, fs, fq, fm, kind)
    out = out_ptr + slot * 4
    tl.atomic_add(out, tl.sum(acc_a, axis=0).to(tl.int64, bitcast=True))
    tl.atomic_add(out + 2, tl.sum(acc_b, axis=0).to(tl.int64, bitcast=True))
    if (mode & 3) == _ELEM64:
        tl.atomic_add(out + 1, tl.sum(acc_ah, axis=0).to(tl.int64, bitcast=True))
        tl.atomic_add(out + 3, tl.sum(acc_bh, axis=0).to(tl.int64, bitcast=True))
    if FIGURES:
        part = fig_ptr + row_id * 3
        tl.store(part, tl.sum(fs, axis=0).to(tl.int64, bitcast=True))
        tl.store(part + 1, tl.sum(fq, axis=0).to(tl.int64, bitcast=True))
        tl.store(part + 2, _max_value(tl.max(fm, axis=0), kind))


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
def digest_finish(lanes_ptr, keys_ptr, digest_ptr, n, STRIDE: tl.constexpr,
                  FBLOCK: tl.constexpr):
    """Slots [pid * FBLOCK, ...): lanes (n x 4 int64) and keys (n x 4: byte length, dtype key,
    first row, end row) -> digests (the first 2 int64 of each slot's STRIDE in ``digest_ptr``,
    little-endian: the 16 digest bytes of each slot)."""
    s = tl.program_id(0) * FBLOCK + tl.arange(0, FBLOCK)
    m = s < n
    l0 = tl.load(lanes_ptr + s * 4, mask=m, other=0).to(tl.uint64, bitcast=True)
    l1 = tl.load(lanes_ptr + s * 4 + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    l2 = tl.load(lanes_ptr + s * 4 + 2, mask=m, other=0).to(tl.uint64, bitcast=True)
    l3 = tl.load(lanes_ptr + s * 4 + 3, mask=m, other=0).to(tl.uint64, bitcast=True)
    nbytes = tl.load(keys_ptr + s * 4, mask=m, other=0).to(tl.uint64, bitcast=True)
    dkey = tl.load(keys_ptr + s * 4 + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    seed_a = _fmix(nbytes ^ dkey)
    seed_b = _fmix(seed_a ^ _SEED_B)
    x = l0 ^ _fmix(l1 ^ seed_a)
    y = l2 ^ _fmix(l3 ^ seed_b)
    x = _fmix(x ^ seed_a)
    y = _fmix(y ^ x)
    x = _fmix(x ^ y)
    tl.store(digest_ptr + s * STRIDE, x.to(tl.int64, bitcast=True), mask=m)
    tl.store(digest_ptr + s * STRIDE + 1, y.to(tl.int64, bitcast=True), mask=m)


@triton.jit
def figures_reduce(fig_ptr, keys_ptr, res_ptr, STRIDE: tl.constexpr, RBLOCK: tl.constexpr):
    """One program per slot: the partial figures of its rows [first, end) (``keys``: n x 4,
    rows consecutive and in unit order) -> its three float64 figures, stored as int64 bits
    after its digest (``res_ptr``: n x STRIDE). Each of RBLOCK lanes adds every RBLOCK-th row
    in row order, then one ``tl.sum``: a fixed order, so the same rows give the same bits.
    The max partials are float64 bits with the sign clear, compared as integers: NaN's are
    above infinity's, so a NaN anywhere makes the max NaN."""
    s = tl.program_id(0)
    first = tl.load(keys_ptr + s * 4 + 2)
    end = tl.load(keys_ptr + s * 4 + 3)
    off = tl.arange(0, RBLOCK)
    acc_s = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_q = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_m = tl.zeros([RBLOCK], dtype=tl.int64)
    r = first
    while r < end:
        idx = r + off
        m = idx < end
        acc_s += tl.load(fig_ptr + idx * 3, mask=m, other=0).to(tl.float64, bitcast=True)
        acc_q += tl.load(fig_ptr + idx * 3 + 1, mask=m, other=0).to(tl.float64, bitcast=True)
        acc_m = tl.maximum(acc_m, tl.load(fig_ptr + idx * 3 + 2, mask=m, other=0))
        r += RBLOCK
    out = res_ptr + s * STRIDE
    tl.store(out + 2, tl.sum(acc_s, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 3, tl.sum(acc_q, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 4, tl.max(acc_m, axis=0))
