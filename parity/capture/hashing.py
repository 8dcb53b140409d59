"""Tensor hashing for capture: the hot path of every recorded step.

Two digests, both 16 raw bytes:

* ``host_digest(t)``: xxh3-128 of the tensor's local bytes, read zero-copy through a
  ``view(torch.uint8)`` of the contiguous data exposed to numpy (a copy is made only when the
  tensor is not contiguous, or lives on an accelerator). This is the reference hash.
* ``device_digest(t)``: a position-weighted checksum (four 64-bit lanes, mixed into 16 bytes)
  computed on the tensor's own device, so that only 16 bytes per tensor cross to the host: by
  the Triton kernels of ``hashing_triton`` for CUDA tensors when Triton imports, else by the
  torch ops below (the reference; both give the same value bit for bit). It is NOT xxh3 and
  never equals ``host_digest``; a run says which it used (``meta.json`` ``capture.hasher``) and
  which version of the definition (``capture.device_digest_version``: ``DEVICE_DIGEST_VERSION``).
  Properties (see docs/capture.md): any single-bit flip and any swap of two distinct elements
  changes it (guaranteed for tensors of fewer than 2**31 words); otherwise it is a checksum,
  not a cryptographic hash.

``digest_tensors`` hashes a list (the parameter table) and returns the concatenated raw digests,
``artifacts.NO_HASH`` standing for a missing tensor (a parameter without a gradient).
``digest_tensors_async`` does the same without waiting for the device: CUDA tensors are
digested by kernels queued on the current stream and their 16-byte digests copied into pinned
host memory behind a CUDA event; ``Digests.result()`` waits for that event (capture resolves a
step's digests one step later, or at close: steps.py / writing.py).

With ``figures=True`` both also give, per tensor, three cheap figures of its values computed in
the same call: the fp64 sum, the fp64 sum of squares and max |x| (``artifacts.FIGURE_FIELDS``,
24 bytes each; ``artifacts.NO_FIGURES`` for a missing tensor): ``digest_tensors(...,
figures=True)`` returns ``(digests, figures)``, ``Digests.figures()`` the figures. They size a
difference the hashes found (docs/diff.md "Size of a difference"); they are summaries, never part
of a verdict. Where they are computed (what a new device path must produce: the same three
float64 per tensor, in the same order):

* host (xxh3): tensors of up to ``FIG_CHUNK`` elements are summed together after their digests,
  in batches of about ``FIG_CHUNK`` elements (one float64 concatenation and a few ``reduceat``
  per batch, while the batch is in cache); larger ones chunk by chunk, each chunk fed to a
  streaming xxh3 and summed while it is in cache (``_digest_and_figures``): one read of the
  bytes for both. Per chunk: one cast into a float64 buffer, numpy's ``sum`` and ``einsum``
  over it, max |x| from the max and min of the native values. The same operations over the
  same chunks as the first version of the figures, so old and new runs have the same figures
  bit for bit (``tests/test_capture_hashing.py``); what they cost: docs/capture.md.
* device, torch ops (``device_lanes_torch(..., figures=True)``): on the device, in the same
  call as the lanes, crossing to the host in the same transfer.
* device, Triton kernels (``hashing_triton``, ``digest_kernels``): in the digest's own pass
  over the words (each row's float64 partials, then one launch that adds each tensor's rows in
  a fixed order), in the same pinned copy behind the same CUDA event as the digests; dtypes
  the kernels do not decode (float8, uint16/32/64) by ``_figures_pending``, torch ops queued
  behind them. They equal the host's figures up to the order of float64 additions (tested).

Host and device paths add in different orders, so their figures may differ in the last bits;
the two are never compared (runs of different hashers are not: docs/capture.md). Within one
path the order is fixed: the same tensor gives the same figures every time.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

from parity.artifacts import HASH_BYTES, NO_FIGURES, NO_HASH
from parity.capture import hashing_triton
from parity.capture.hashing_triton import dtype_key
from parity.capture.hashing_triton import materialized as _materialized

__all__ = ["local_tensor", "host_digest", "device_digest", "device_digests", "device_lanes_torch",
           "digest_tensors", "digest_tensors_async", "Digests", "finish", "HASHERS",
           "DEVICE_DIGEST_VERSION", "tensor_figures", "batch_figures"]

HASHERS = ("auto", "xxh3", "device")

_xxh3_128 = xxhash.xxh3_128_digest
_EMPTY = xxhash.xxh3_128_digest(b"")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) not in _PLAIN:
        inner = getattr(t, "_local_tensor", None)
        if inner is not None:
            t = inner
    if t.layout is not torch.strided:  # a sparse gradient (Embedding(sparse=True)): its values
        t = t.detach().to_dense()  # as a dense tensor (storage has no byte view)
    return t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The data this rank holds (a DTensor's ``_local_tensor``, else the tensor), detached."""
    return _local(t).detach()




def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``t``'s data (a contiguous copy only if it is not contiguous)."""
    t = _materialized(t)
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)  # C-contiguous: its buffer is the tensor's bytes in order


def _plain_np(t: torch.Tensor) -> np.ndarray | None:
    """A flat zero-copy numpy view of a local CPU tensor whose bytes numpy reads as they are
    (contiguous, a numpy dtype, no lazy negation), else None. The common case of capture's host
    path: one ``detach().numpy()`` instead of the general path's uint8 view and reshapes (the
    digest hashes the same bytes, the figures read the same values)."""
    if (t.is_cpu and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_neg()
            and t.numel()):
        return t.detach().numpy().reshape(-1)
    return None


def _xxh3(t: torch.Tensor) -> bytes:
    """host_digest of a local (non-DTensor) tensor."""
    a = _plain_np(t)
    if a is not None:
        return _xxh3_128(a)
    if t.numel() == 0:
        return _EMPTY
    if not t.is_cpu:
        t = t.cpu()
    return _xxh3_128(_byte_view(t.detach()).numpy())


def host_digest(t: torch.Tensor) -> bytes:
    """xxh3-128 (16 raw bytes) of the local bytes of ``t``. Zero-copy for contiguous CPU tensors."""
    return _xxh3(_local(t))


# ------------------------------------------------------------------------------------ figures
# Three float64 per tensor (artifacts.FIGURE_FIELDS): sum, sum of squares, max |x|, all of the
# local data, accumulated in float64. Cheap summaries that size a difference the hashes found;
# the same tensor always gives the same figures here, so equal hashes never come with other
# figures from one code path.
FIG_CHUNK = 1 << 16  # elements: larger tensors are summed chunk by chunk, each while in cache
# dtypes whose elements numpy reads as they are (a zero-copy view of the hashed bytes)
_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
                 torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}


def _numeric(t: torch.Tensor) -> torch.Tensor:
    """``t`` (local, materialized, flat) as a tensor whose dtype numpy reads: bfloat16, float8
    and the like widened to float32 (exact), complex as its real and imaginary parts."""
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype not in _NUMPY_DTYPES:
        t = t.to(torch.float32)
    return t


def _np_view(flat: torch.Tensor, raw: np.ndarray | None = None) -> np.ndarray:
    """The values of a flat CPU tensor as numpy: ``raw`` (its byte view, already exposed for
    the digest) reinterpreted when numpy knows the dtype, else a widened copy."""
    if raw is not None and flat.dtype in _NUMPY_DTYPES:
        return raw.view(_NUMPY_DTYPES[flat.dtype])
    return _numeric(flat).numpy()


def _max_abs(hi: float, lo: float) -> float:
    """max |x| from the largest and the smallest value (exact: |x| <= max(hi, -lo) for every x;
    NaN when they are, as numpy's and torch's max and min both are when any value is NaN;
    +0.0, never -0.0, for zeros). Python floats: a chunk pays no numpy scalar operations."""
    return abs(hi if hi >= -lo else -lo)


def _chunk_figures(vals: np.ndarray | None, chunk: torch.Tensor, buf: np.ndarray,
                   acc: list) -> None:
    """Add one chunk's sum, sum of squares and max |x| (in float64) to ``acc``: ``vals`` its
    values as numpy (None for a dtype numpy lacks: ``chunk`` is cast by torch). One cast into
    the float64 buffer, then ``sum`` and ``einsum`` over it (the same two reductions over the
    same 64 Ki chunk as before 2026-11-27: the same bits), and max |x| from the native max and
    min (no |x| pass). No BLAS (``np.dot`` would bring its thread pool), no thread."""
    d = buf[:chunk.numel()]
    if vals is not None:
        np.copyto(d, vals, casting="unsafe")
        m = _max_abs(float(vals.max()), float(vals.min()))
    else:  # bfloat16, float8: widened exactly, straight into the buffer
        torch.from_numpy(d).copy_(chunk)
        if chunk.dtype == torch.bfloat16:  # max and min of the 2-byte values: one short pass
            lo, hi = torch.aminmax(chunk)
            m = _max_abs(float(hi), float(lo))
        else:
            m = _max_abs(float(d.max()), float(d.min()))
    acc[0] += float(d.sum())
    acc[1] += float(np.einsum("i,i->", d, d))  # not BLAS: no thread pool of its own
    if m > acc[2] or m != m:  # NaN anywhere stays NaN
        acc[2] = m


def _digest_and_figures(t: torch.Tensor) -> tuple[bytes, tuple[float, float, float] | None,
                                                  np.ndarray | None]:
    """Host digest of a local tensor and its figures in one read of its bytes: (digest,
    figures, None) for a tensor of more than ``FIG_CHUNK`` elements (each chunk hashed by a
    streaming xxh3, whose digest equals the one-shot digest, and summed while in cache), else
    (digest, None, its values as numpy) for ``batch_figures``."""
    vals = _plain_np(t)
    if vals is not None and vals.size <= FIG_CHUNK:  # the common case, in few steps
        return _xxh3_128(vals), None, vals
    if t.numel() == 0:
        return _EMPTY, (0.0, 0.0, 0.0), None  # (reduceat needs at least one element)
    if not t.is_cpu:
        t = t.cpu()
    t = _materialized(t.detach())
    raw = _byte_view(t).numpy().reshape(-1)  # flat bytes (the view keeps the tensor's dims)
    flat = t.reshape(-1)
    n = flat.numel()
    if n <= FIG_CHUNK:
        return _xxh3_128(raw), None, _np_view(flat, raw)
    h = xxhash.xxh3_128()
    size = flat.element_size()
    native = flat.dtype in _NUMPY_DTYPES and not flat.is_complex()
    vals = raw.view(_NUMPY_DTYPES[flat.dtype]) if native else None
    buf = np.empty(FIG_CHUNK * (2 if flat.is_complex() else 1), dtype=np.float64)
    acc = [0.0, 0.0, 0.0]
    for start in range(0, n, FIG_CHUNK):
        stop = min(n, start + FIG_CHUNK)
        h.update(raw[start * size:stop * size])
        if native:
            _chunk_figures(vals[start:stop], flat[start:stop], buf, acc)
        elif flat.is_complex():  # its real and imaginary parts, as float32 or float64 values
            parts = torch.view_as_real(flat[start:stop]).reshape(-1)
            _chunk_figures(parts.numpy() if parts.dtype in _NUMPY_DTYPES else None, parts,
                           buf, acc)
        else:
            _chunk_figures(None, flat[start:stop], buf, acc)
    return h.digest(), (acc[0], acc[1], acc[2]), None


def batch_figures(arrays: list[np.ndarray]) -> np.ndarray:
    """Figures of many small non-empty arrays in a few numpy calls, as a (len, 3) float64
    array: one float64 concatenation, then ``reduceat`` per figure (float64 sums: exact enough
    for up to ``FIG_CHUNK`` elements, and the same for the same values); max |x| from the
    segments' max and min, the squares in place (no temporaries)."""
    sizes = [a.size for a in arrays]
    offsets = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    d = np.concatenate([a.reshape(-1) for a in arrays], dtype=np.float64, casting="unsafe")
    out = np.empty((len(arrays), 3), dtype="<f8")
    np.add.reduceat(d, offsets, out=out[:, 0])
    hi = np.maximum.reduceat(d, offsets)
    lo = np.minimum.reduceat(d, offsets)
    np.negative(lo, out=lo)
    np.maximum(hi, lo, out=hi)
    np.abs(hi, out=out[:, 2])  # (+0.0 for zeros)
    np.multiply(d, d, out=d)
    np.add.reduceat(d, offsets, out=out[:, 1])
    return out


def tensor_figures(t: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, max |x|) of ``t``'s local data, in float64, as capture records
    them (host path)."""
    _, fig, vals = _digest_and_figures(_local(t))
    return fig if fig is not None else tuple(batch_figures([vals])[0].tolist())


# ------------------------------------------------------------------------------ device digest
# The definition, version 2 (docs/capture.md "device"), shared bit for bit with the Triton
# kernels in digest_kernels.py, which are the fast path on CUDA; this torch-ops version is the
# fallback and the reference the kernels are tested against:
#   units: tensors of 1-, 2- or 4-byte elements (and of widths that are no multiple of 8) are
#        read as their bytes in little-endian uint32 words w_k (the last word padded with zero
#        bytes): lo_k = w_k, hi_k = 0. Tensors of 8-byte elements (or multiples of 8: complex128
#        as its 8-byte parts) are read element by element: lo_k = v_k mod 2**32, hi_k = v_k >> 32.
#   q_k  = k mod 2**31, a_k = q_k + 1, b_k = ((((q_k + 1) * B_MULT) mod 2**32) >> 1) | 1;
#   lanes (each mod 2**64): L0 = sum lo_k a_k, L1 = sum hi_k a_k, L2 = sum lo_k b_k,
#        L3 = sum hi_k b_k;
#   digest = finish(L0..L3, byte length, dtype): a keyed 128-bit mix (see finish), computed on
#        the device by the kernels, so the host copies 16 bytes per tensor and does nothing else.
# Version 1 (before 2026-11-27) took every element as one unit (a bf16 tensor: one 2-byte unit
# per element, half the speed of fp32 on an H200) and mixed the lanes with xxh3 on the host;
# meta.json records the version and runs of different versions are never compared.
# Every product lo*a, lo*b, hi*a, hi*b is < 2**63, so this version computes the lanes exactly in
# int64 without ever overflowing: it sums the low and high 32-bit halves of the products
# separately and folds the carries after every chunk. The kernels simply wrap in uint64.
DEVICE_DIGEST_VERSION = 2
B_MULT = 0x9E3779B1
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_FMIX_C1 = 0xFF51AFD7ED558CCD  # murmur3 fmix64
_FMIX_C2 = 0xC4CEB9FE1A85EC53
_SEED_B = 0x9E3779B97F4A7C15
_CHUNK = 1 << 18  # units per chunk: bounds the int64 temporaries (~8 MiB per (4, chunk) tensor)


def _units(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lo, hi) of the local data's units as non-negative int64 (see the definition); hi is
    None for word units (it is 0)."""
    flat = _materialized(local_tensor(t)).reshape(-1)
    if flat.element_size() % 8 == 0:
        e = flat.view(torch.int64)
        return e & _M32, (e >> 32) & _M32
    b = flat.view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad or b.storage_offset() % 4:  # a copy that is whole words and 4-byte aligned
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int32).to(torch.int64) & _M32, None


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _make_weights(dev: torch.device, start: int, m: int) -> torch.Tensor:
    """(a_k, b_k) for positions start..start+m-1, shape (2, m), int64, each in [1, 2**31]."""
    q1 = (torch.arange(start, start + m, dtype=torch.int64, device=dev) & 0x7FFFFFFF) + 1
    b = (((q1 * B_MULT) & _M32) >> 1) | 1  # (q+1) * B_MULT < 2**63: exact
    return torch.stack([q1, b])


def _weights(dev: torch.device, start: int, m: int) -> torch.Tensor:
    if start == 0:
        w = _WEIGHTS.get(dev)
        if w is None:
            w = _WEIGHTS[dev] = _make_weights(dev, 0, _CHUNK)
        return w[:, :m]
    return _make_weights(dev, start, m)


def _lanes_torch(t: torch.Tensor) -> torch.Tensor:
    """Lane halves of ``t`` as int64 of shape (2, 4) on ``t``'s device: row 0 the low 32 bits of
    L0..L3, row 1 the high 32 bits (``_combine`` joins them on the host)."""
    lo, hi = _units(t)
    dev = lo.device
    parts = [lo] if hi is None else [lo, hi]
    acc_lo = torch.zeros(2, len(parts), dtype=torch.int64, device=dev)  # [weight a/b, lo/hi word]
    acc_hi = torch.zeros_like(acc_lo)
    n = lo.numel()
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        w = _weights(dev, start, m)  # (2, m)
        words = torch.stack([p[start:start + m] for p in parts])  # (k, m)
        prods = w.unsqueeze(1) * words.unsqueeze(0)  # (2, k, m), each < 2**63
        acc_lo += (prods & _M32).sum(dim=2)  # each sum < 2**50: no overflow
        acc_hi += (prods >> 32).sum(dim=2)
        # fold the carry; only the low 32 bits of the high half matter mod 2**64
        acc_hi = (acc_hi + (acc_lo >> 32)) & _M32
        acc_lo = acc_lo & _M32
    out = torch.zeros(2, 4, dtype=torch.int64, device=dev)
    # lane order L0 = (a, lo), L1 = (a, hi), L2 = (b, lo), L3 = (b, hi)
    out[0, 0::2], out[1, 0::2] = acc_lo[:, 0], acc_hi[:, 0]
    if hi is not None:
        out[0, 1::2], out[1, 1::2] = acc_lo[:, 1], acc_hi[:, 1]
    return out


def _combine(halves: list[list[int]]) -> list[int]:
    """Host side of ``_lanes_torch``: the four lanes as unsigned 64-bit Python ints."""
    return [(lo + (hi << 32)) & _M64 for lo, hi in zip(halves[0], halves[1])]


def _fmix(x: int) -> int:
    """murmur3's fmix64: a bijection of 64-bit words (digest_kernels._fmix does the same)."""
    x ^= x >> 33
    x = (x * _FMIX_C1) & _M64
    x ^= x >> 33
    x = (x * _FMIX_C2) & _M64
    return x ^ (x >> 33)


def finish(lanes: list[int], nbytes: int, dtype: torch.dtype) -> bytes:
    """The 16 digest bytes of four lanes, keyed by the byte length and the dtype.

    For fixed (L1, L3, length, dtype) it is a bijection of (L0, L2): a Feistel-like pair of
    rounds of fmix64, each invertible given the other half. Word units have L1 = L3 = 0, so two
    tensors of one dtype and length whose lanes differ (a bit flip, a swap: docs/capture.md)
    always get different digests; 8-byte units fold L1 and L3 in (128 bits from 256)."""
    seed_a = _fmix((nbytes ^ dtype_key(dtype)) & _M64)
    seed_b = _fmix(seed_a ^ _SEED_B)
    x = lanes[0] ^ _fmix(lanes[1] ^ seed_a)
    y = lanes[2] ^ _fmix(lanes[3] ^ seed_b)
    x = _fmix(x ^ seed_a)
    y = _fmix(y ^ x)
    x = _fmix(x ^ y)
    return struct.pack("<QQ", x, y)


def _figures_torch(t: torch.Tensor) -> torch.Tensor:
    """The three figures of a local tensor as a float64 (3,) tensor on its device, accumulated
    chunk by chunk (bounded temporaries)."""
    v = _numeric(_materialized(t).reshape(-1))
    fig = torch.zeros(3, dtype=torch.float64, device=v.device)
    for start in range(0, v.numel(), _CHUNK):
        c = v[start:start + _CHUNK].to(torch.float64)
        fig[0] += c.sum()
        fig[1] += torch.dot(c, c)
        fig[2] = torch.maximum(fig[2], c.abs().max())  # NaN anywhere stays NaN
    return fig


def device_lanes_torch(tensors: list[torch.Tensor], figures: bool = False):
    """The four lanes of each tensor computed with torch ops, one device-to-host transfer per
    device. The reference for ``hashing_triton.device_lanes``. With ``figures``: (lanes,
    figures), the figures computed on the device in the same call and carried by the same
    transfer (their float64 bits beside the lanes)."""
    locals_ = [local_tensor(t) for t in tensors]
    host: list[list[int] | None] = [None] * len(tensors)
    figs: list[tuple | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(locals_):
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        rows = [_lanes_torch(locals_[i]).reshape(-1) for i in idx]
        if figures:
            rows = [torch.cat([r, _figures_torch(locals_[i]).view(torch.int64)])
                    for r, i in zip(rows, idx)]
        for i, row in zip(idx, torch.stack(rows).cpu().tolist()):
            host[i] = _combine([row[:4], row[4:8]])
            if figures:
                figs[i] = struct.unpack("<3d", struct.pack("<3q", *row[8:]))
    return (host, figs) if figures else host


def device_backend() -> str:
    """``triton`` or ``torch``: what computes device digests of CUDA tensors in this process
    (recorded in meta.json; the values are the same either way)."""
    if not torch.cuda.is_available():
        return "torch"
    return "triton" if hashing_triton.usable() else "torch"


def device_digest(t: torch.Tensor) -> bytes:
    """16-byte position-weighted checksum of ``t``'s local data, computed on its device."""
    return device_digests([t])[0]


def _digests_torch(locals_: list[torch.Tensor], figures: bool = False):
    """Digests (and with ``figures`` their figures, as a (k, 3) array) by torch ops."""
    got = device_lanes_torch(locals_, figures)
    lanes, figs = got if figures else (got, None)
    digests = [finish(ln, t.numel() * t.element_size(), t.dtype) for ln, t in zip(lanes, locals_)]
    return (digests, np.array(figs, dtype="<f8").reshape(-1, 3)) if figures else digests


def _figures_pending(tensors: list[torch.Tensor]):
    """The figures of device tensors by torch ops (``_figures_torch``) queued on the device and
    copied into pinned host memory behind a CUDA event, like the Triton kernels' results
    (``hashing_triton.Pending``, 24 bytes per tensor): no wait in the digest path. Used with
    the kernels only for the dtypes they do not decode (``hashing_triton.Pending.fallback``):
    about five launches per tensor and 256 Ki elements."""
    rows = torch.stack([_figures_torch(t) for t in tensors])
    if rows.device.type != "cuda":
        return hashing_triton.PendingRows(rows.cpu(), None, None)
    host = torch.empty(rows.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return hashing_triton.PendingRows(host, event, rows)


def device_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """``device_digest`` of each tensor (waits for the device)."""
    if not tensors:
        return []
    raw = digest_tensors_async(tensors, "device").result()
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


# ------------------------------------------------------------------------------- lists of tensors
class Digests:
    """The digests of a list of tensors, some perhaps still being computed on a device.

    ``parts`` are (positions, bytes) already known and (positions, pending) device results
    (``hashing_triton.Pending``: 16 bytes per position once its event has completed). ``figs``
    (with ``figures=True``): the same for the figures, 24 bytes per position (the known ones
    as (positions, (k, 3) float64 array)); None without figures."""

    __slots__ = ("n", "known", "pending", "figs")

    def __init__(self, n: int, known: list[tuple[list[int] | None, bytes]],
                 pending: list[tuple[list[int] | None, object]], figs: list | None = None):
        self.n, self.known, self.pending, self.figs = n, known, pending, figs

    def ready(self) -> bool:
        """True when neither ``result()`` nor ``figures()`` would wait for a device."""
        return all(p.ready() for _, p in self.pending) and all(
            p.ready() for _, p in self.figs or () if not isinstance(p, np.ndarray))

    def figures(self) -> bytes | None:
        """The 24-byte figures in list order (``NO_FIGURES`` where there was no tensor; waits
        for the device if needed); None when they were not asked for."""
        if self.figs is None:
            return None
        if len(self.figs) == 1 and self.figs[0][0] is None and not isinstance(self.figs[0][1],
                                                                            np.ndarray):
            return self.figs[0][1].result()  # one device part covering the list in order
        # one 24-byte item per row (numpy copies whole items, not 3 floats each)
        out = np.frombuffer(NO_FIGURES * self.n, dtype=hashing_triton.ROW24).copy()
        for pos, part in self.figs:
            raw = np.ascontiguousarray(part, dtype="<f8").tobytes() \
                if isinstance(part, np.ndarray) else part.result()
            rows = np.frombuffer(raw, dtype=hashing_triton.ROW24)
            if pos is None:
                out[:] = rows
            elif len(pos):
                out[np.asarray(pos, dtype=np.int64)] = rows
        return out.tobytes()

    def result(self) -> bytes:
        """The concatenated 16-byte digests in list order (waits for the device if needed)."""
        parts = self.known + [(pos, p.result()) for pos, p in self.pending]
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]  # one part covering the whole list in order: no assembly
        # one 16-byte item per row; NO_HASH (zero bytes) where nothing is set
        out = np.zeros(self.n, dtype=hashing_triton.ROW16)
        for pos, raw in parts:
            rows = np.frombuffer(raw, dtype=hashing_triton.ROW16)
            if pos is None:
                out[:] = rows
            elif len(pos):
                out[np.asarray(pos, dtype=np.int64)] = rows
        return out.tobytes()


def digest_tensors_async(tensors: list, hasher: str = "auto", *, stable: bool = False,
                         owners: list | None = None, figures: bool = False) -> Digests:
    """``digest_tensors`` without waiting for a device: CUDA tensors (``device``/``auto``) go to
    the Triton kernels where they are usable and come back as a pending part; everything else
    (xxh3, the torch-ops fallback) is computed now. ``stable`` says the list holds the same
    tensor objects from call to call (the parameter table), ``owners`` that ``tensors[i]`` is
    ``owners[i].grad`` for parameters that stay the same: hashing_triton then reuses its device
    table after checking little more than the addresses. ``figures``: the figures too
    (``Digests.figures()``; where each path computes them: the module docstring)."""
    n = len(tensors)
    if hasher == "xxh3" and not figures:
        return Digests(n, [(None, b"".join(NO_HASH if t is None else _xxh3(_local(t))
                                           for t in tensors))], [])
    if n and hasher in ("auto", "device"):
        got = hashing_triton.digest_all_cuda(tensors, stable, owners, figures)  # common case
        if got is not None:  # pos: the rows hashed when some are None (left out), else None
            pos, fast = got
            figs = None
            if figures:
                figs = [(pos, fast.figures())]
                if fast.fallback:  # dtypes the kernels do not decode: torch ops, later part wins
                    fb = list(fast.fallback) if pos is None else \
                        [int(pos[j]) for j in fast.fallback]
                    figs.append((fb, _figures_pending([_local(tensors[i]) for i in fb])))
            return Digests(n, [], [(pos, fast)], figs)
    known: list[tuple[list[int] | None, bytes]] = []
    pending: list[tuple[list[int] | None, object]] = []
    figs: list | None = [] if figures else None
    host_pos, host_raw, dev_pos, dev_t = [], [], [], []
    fig_pos, fig_rows, small_pos, small, small_n = [], [], [], [], 0
    for i, t in enumerate(tensors):
        if t is None:
            continue
        lt = _local(t)
        if hasher == "device" or (hasher == "auto" and lt.is_cuda):
            dev_pos.append(i)
            dev_t.append(lt)
        elif not figures:
            host_pos.append(i)
            host_raw.append(_xxh3(lt))
        else:  # digest and figures in one read of the bytes (small ones summed together below)
            digest, fig, vals = _digest_and_figures(lt)
            host_pos.append(i)
            host_raw.append(digest)
            if vals is not None:
                small_pos.append(i)
                small.append(vals)
                small_n += vals.size
                if small_n >= FIG_CHUNK:  # summed together while still in cache
                    figs.append((small_pos, batch_figures(small)))
                    small_pos, small, small_n = [], [], 0
            else:
                fig_pos.append(i)
                fig_rows.append(fig)
    if host_pos:
        known.append((host_pos, b"".join(host_raw)))
    if figures:
        if fig_pos:
            figs.append((fig_pos, np.array(fig_rows, dtype="<f8").reshape(-1, 3)))
        if small:
            figs.append((small_pos, batch_figures(small)))
    if dev_pos:
        cuda = [k for k, t in enumerate(dev_t) if t.is_cuda]
        if cuda:
            p = hashing_triton.digest_cuda([dev_t[k] for k in cuda], figures) \
                if hashing_triton.usable() else None
            if p is not None:
                pos = [dev_pos[k] for k in cuda]
                pending.append((pos, p))
                if figures:
                    figs.append((pos, p.figures()))
                    if p.fallback:
                        figs.append(([pos[j] for j in p.fallback],
                                     _figures_pending([dev_t[cuda[j]] for j in p.fallback])))
                done = set(cuda)
                rest = [k for k in range(len(dev_t)) if k not in done]
            else:
                rest = list(range(len(dev_t)))
        else:
            rest = list(range(len(dev_t)))
        if rest:
            pos = [dev_pos[k] for k in rest]
            got = _digests_torch([dev_t[k] for k in rest], figures)
            known.append((pos, b"".join(got[0] if figures else got)))
            if figures:
                figs.append((pos, got[1]))
    return Digests(n, known, pending, figs)


def digest_tensors(tensors: list[torch.Tensor | None], hasher: str = "auto",
                   figures: bool = False) -> bytes | tuple[bytes, bytes]:
    """Concatenated 16-byte digests in list order; ``None`` -> ``NO_HASH``. With ``figures``:
    ``(digests, figures)``, the figures 24 bytes per tensor in the same order (sum, sum of
    squares, max |x| as little-endian float64; ``NO_FIGURES`` for ``None``), computed in the
    same call (where, per path: the module docstring)."""
    d = digest_tensors_async(tensors, hasher, figures=figures)
    return (d.result(), d.figures()) if figures else d.result()
