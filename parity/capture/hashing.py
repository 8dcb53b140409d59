"""Tensor hashing for capture: the hot path of every recorded step.

Two digests, both 16 raw bytes:

* ``host_digest(t)``: xxh3-128 of the tensor's local bytes, read zero-copy through a
  ``view(torch.uint8)`` of the contiguous data exposed to numpy (a copy is made only when the
  tensor is not contiguous, or lives on an accelerator). This is the reference hash.
* ``device_digest(t)``: a position-weighted checksum (four 64-bit lanes, mixed into 16 bytes)
  computed on the tensor's own device, so that only 32 bytes per tensor cross to the host: by
  the Triton kernel of ``hashing_triton`` for CUDA tensors when Triton imports, else by the torch
  ops below (the reference; both give the same value bit for bit). It is NOT xxh3 and never
  equals ``host_digest``; a run says which it used (``meta.json`` ``capture.hasher``).
  Properties (see docs/capture.md): any single-bit flip and any swap of two distinct elements
  changes it (guaranteed for tensors of fewer than 2**31 elements); otherwise it is a checksum,
  not a cryptographic or even a well-mixed hash.

``digest_tensors`` hashes a list (the parameter table) and returns the concatenated raw digests,
``artifacts.NO_HASH`` standing for a missing tensor (a parameter without a gradient). With
``figures=True`` it also returns, per tensor, three cheap figures of its values computed in the
same call and, on the host, the same read of the bytes: the fp64 sum, the fp64 sum of squares
and max |x| (``artifacts.FIGURE_FIELDS``, 24 bytes each, ``artifacts.NO_FIGURES`` (NaN, -1,
NaN) for a missing tensor). They size a difference the hashes found (docs/diff.md "Size of a
difference"); they are summaries, never part of a verdict.

Where the figures are computed (what a new device path must produce: the same three float64 per
tensor, in the same order):

* host (xxh3): tensors of up to ``FIG_CHUNK`` elements are summed together, after their digests
  (one numpy concatenate in float64 and three ``reduceat``: a few calls for a whole table);
  larger ones chunk by chunk, each chunk fed to a streaming xxh3 and summed while it is in
  cache (``_digest_and_figures``): one read of the bytes for both.
* device, torch ops (``device_lanes_torch``): in the chunk loop of the lanes, on the device;
  the figures cross to the host in the same transfer as the lanes.
* device, Triton kernel (``hashing_triton``): for now ``device_figures_torch`` (torch ops on the
  device, one transfer per device) after the kernel; the kernel can compute them in its pass.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

from parity.artifacts import NO_FIGURES, NO_HASH

__all__ = ["local_tensor", "host_digest", "device_digest", "device_digests", "device_lanes_torch",
           "device_figures_torch", "digest_tensors", "tensor_figures", "HASHERS"]

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


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its lazy conjugate/negation applied and contiguous (a copy only if needed)."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``t``'s data (a contiguous copy only if it is not contiguous)."""
    t = _materialized(t)
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)  # C-contiguous: its buffer is the tensor's bytes in order


def _xxh3(t: torch.Tensor) -> bytes:
    """host_digest of a local (non-DTensor) tensor."""
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


def _chunk_figures(vals: np.ndarray, buf: np.ndarray, acc: list) -> None:
    """Add one chunk's sum, sum of squares and max |x| (in float64) to ``acc``."""
    d = buf[:vals.size]
    np.copyto(d, vals, casting="unsafe")
    acc[0] += float(d.sum())
    acc[1] += float(np.einsum("i,i->", d, d))  # not BLAS: no thread pool of its own
    np.abs(d, out=d)
    acc[2] = float(np.maximum(acc[2], d.max()))  # NaN anywhere stays NaN


def _digest_and_figures(t: torch.Tensor) -> tuple[bytes, tuple[float, float, float] | None,
                                                  np.ndarray | None]:
    """Host digest of a local tensor and its figures in one read of its bytes: (digest,
    figures, None) for a tensor of more than ``FIG_CHUNK`` elements (each chunk hashed by a
    streaming xxh3, whose digest equals the one-shot digest, and summed while in cache), else
    (digest, None, its values as numpy) for ``batch_figures``."""
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
        _chunk_figures(vals[start:stop] if native else _numeric(flat[start:stop]).numpy(),
                       buf, acc)
    return h.digest(), (acc[0], acc[1], acc[2]), None


def batch_figures(arrays: list[np.ndarray]) -> np.ndarray:
    """Figures of many small non-empty arrays in a few numpy calls, as a (len, 3) float64
    array: one float64 concatenation, then ``reduceat`` per figure (sequential float64 sums:
    exact enough for up to ``FIG_CHUNK`` elements, and the same for the same values)."""
    sizes = [a.size for a in arrays]
    offsets = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    d = np.concatenate([a.reshape(-1) for a in arrays], dtype=np.float64, casting="unsafe")
    out = np.empty((len(arrays), 3), dtype="<f8")
    np.add.reduceat(d, offsets, out=out[:, 0])
    np.add.reduceat(d * d, offsets, out=out[:, 1])
    np.abs(d, out=d)
    np.maximum.reduceat(d, offsets, out=out[:, 2])
    return out


def tensor_figures(t: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, max |x|) of ``t``'s local data, in float64, as capture records
    them (host path)."""
    _, fig, vals = _digest_and_figures(_local(t))
    return fig if fig is not None else tuple(batch_figures([vals])[0].tolist())


# ------------------------------------------------------------------------------ device digest
# The definition (docs/capture.md "device"), shared bit for bit with the Triton kernel in
# hashing_triton.py, which is the fast path on CUDA; this torch-ops version is the fallback and the
# reference the kernel is tested against:
#   v_i  the i-th element (row-major) as an unsigned integer of its own width (1, 2, 4 or 8 bytes;
#        wider elements are taken as their 8-byte parts, other widths as bytes);
#   lo_i = v_i mod 2**32, hi_i = v_i >> 32 (0 for elements of up to 4 bytes);
#   q_i  = i mod 2**31, a_i = q_i + 1, b_i = ((((q_i + 1) * B_MULT) mod 2**32) >> 1) | 1;
#   lanes (each mod 2**64): L0 = sum lo_i a_i, L1 = sum hi_i a_i, L2 = sum lo_i b_i,
#        L3 = sum hi_i b_i;
#   digest = xxh3_128(L0..L3 as little-endian u64, the byte length as i64, str(dtype)).
# Every product lo*a, lo*b, hi*a, hi*b is < 2**63, so this version computes the lanes exactly in
# int64 without ever overflowing: it sums the low and high 32-bit halves of the products
# separately and folds the carries after every chunk. The kernel simply wraps in uint64.
B_MULT = 0x9E3779B1
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_CHUNK = 1 << 18  # elements per chunk: bounds the int64 temporaries (~8 MiB per (4, chunk) tensor)
_UINT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The local data, materialized and flat, viewed as integers of the digest's element width."""
    flat = _materialized(local_tensor(t)).reshape(-1)
    size = flat.element_size()
    if size in _UINT_OF_SIZE:
        return flat.view(_UINT_OF_SIZE[size])
    if size % 8 == 0:
        return flat.view(torch.int64)
    return flat.view(torch.uint8)  # exotic widths: bytes


def _halves(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lo, hi) 32-bit halves of the elements as non-negative int64; hi is None below 8 bytes."""
    size = e.element_size()
    if size == 8:
        return e & _M32, (e >> 32) & _M32
    w = e.to(torch.int64)
    if size != 1:
        w = w & _MASK[size]
    return w, None


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _make_weights(dev: torch.device, start: int, m: int) -> torch.Tensor:
    """(a_i, b_i) for positions start..start+m-1, shape (2, m), int64, each in [1, 2**31]."""
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


def _lanes_torch(t: torch.Tensor, figures: bool = False) -> torch.Tensor:
    """Lane halves of ``t`` as int64 of shape (2, 4) on ``t``'s device: row 0 the low 32 bits of
    L0..L3, row 1 the high 32 bits (``_combine`` joins them on the host). With ``figures``,
    shape (11,): the 8 lane halves, then the three figures (float64 bits) accumulated in the
    same chunk loop."""
    lo, hi = _halves(_elements(t))
    dev = lo.device
    parts = [lo] if hi is None else [lo, hi]
    acc_lo = torch.zeros(2, len(parts), dtype=torch.int64, device=dev)  # [weight a/b, lo/hi word]
    acc_hi = torch.zeros_like(acc_lo)
    n = lo.numel()
    vals = _numeric(_materialized(local_tensor(t)).reshape(-1)) if figures else None
    per = 1 if vals is None else vals.numel() // max(n, 1)  # complex: two values per element
    if vals is not None and per == 0:  # elements hashed as bytes (exotic widths): all at once
        per, vals, rest = 1, None, vals
    else:
        rest = None
    fig = torch.zeros(3, dtype=torch.float64, device=dev)
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
        if vals is not None:
            v = vals[start * per:(start + m) * per].to(torch.float64)
            fig[0] += v.sum()
            fig[1] += torch.dot(v, v)
            fig[2] = torch.maximum(fig[2], v.abs().max())
    if rest is not None and rest.numel():
        v = rest.to(torch.float64)
        fig = torch.stack([v.sum(), torch.dot(v, v), v.abs().max()])
    out = torch.zeros(2, 4, dtype=torch.int64, device=dev)
    # lane order L0 = (a, lo), L1 = (a, hi), L2 = (b, lo), L3 = (b, hi)
    out[0, 0::2], out[1, 0::2] = acc_lo[:, 0], acc_hi[:, 0]
    if hi is not None:
        out[0, 1::2], out[1, 1::2] = acc_lo[:, 1], acc_hi[:, 1]
    if not figures:
        return out
    return torch.cat([out.reshape(-1), fig.view(torch.int64)])


def _figures_of(bits: list[int]) -> tuple[float, float, float]:
    """The three figures from their float64 bits (as ``_lanes_torch`` returns them)."""
    return struct.unpack("<3d", struct.pack("<3q", *bits))


def _combine(halves: list[list[int]]) -> list[int]:
    """Host side of ``_lanes_torch``: the four lanes as unsigned 64-bit Python ints."""
    return [(lo + (hi << 32)) & _M64 for lo, hi in zip(halves[0], halves[1])]


def _finish(lanes: list[int], nbytes: int, dtype: torch.dtype) -> bytes:
    # The lanes are not well mixed; xxh3 over them (and the length) spreads them into 16 bytes.
    return _xxh3_128(struct.pack("<4Qq", *lanes, nbytes) + str(dtype).encode())


def device_lanes_torch(tensors: list[torch.Tensor], figures: bool = False):
    """The four lanes of each tensor computed with torch ops, one device-to-host transfer per
    device. The reference for ``hashing_triton.device_lanes``. With ``figures``: (lanes, figures),
    the figures computed in the same chunk loop and carried by the same transfer."""
    locals_ = [local_tensor(t) for t in tensors]
    host: list[list[int] | None] = [None] * len(tensors)
    figs: list[tuple | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(locals_):
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        rows = [_lanes_torch(locals_[i], figures) for i in idx]
        stacked = torch.stack(rows).cpu().tolist()
        for i, row in zip(idx, stacked):
            if figures:
                host[i] = _combine([row[:4], row[4:8]])
                figs[i] = _figures_of(row[8:])
            else:
                host[i] = _combine(row)
    if figures:
        return host, figs
    return host  # type: ignore[return-value]


def device_figures_torch(tensors: list[torch.Tensor]) -> list[tuple[float, float, float]]:
    """The figures of each tensor with torch ops on its own device, one transfer per device:
    what a device path whose kernel does not compute them adds (the Triton kernel, for now)."""
    out: list[tuple | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    locals_ = [local_tensor(t) for t in tensors]
    for i, t in enumerate(locals_):
        by_dev.setdefault(t.device, []).append(i)
    for dev, idx in by_dev.items():
        rows = []
        for i in idx:
            v = _numeric(_materialized(locals_[i]).reshape(-1))
            if v.numel() == 0:
                rows.append(torch.zeros(3, dtype=torch.float64, device=dev))
                continue
            s = v.sum(dtype=torch.float64)
            q = torch.linalg.vector_norm(v, 2, dtype=torch.float64)
            rows.append(torch.stack([s, q * q, v.abs().max().to(torch.float64)]))
        for i, row in zip(idx, torch.stack(rows).cpu().tolist()):
            out[i] = tuple(row)
    return out  # type: ignore[return-value]


def _device_lanes(tensors: list[torch.Tensor], figures: bool = False):
    """Lanes of local tensors: CUDA ones through the Triton kernel where it is usable, the rest
    (and all of them if the kernel fails) with torch ops. Both give the same values, so which one
    ran never changes a digest. With ``figures``: (lanes, figures)."""
    cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
    out: list[list[int] | None] = [None] * len(tensors)
    figs: list[tuple | None] = [None] * len(tensors)
    if cuda:
        from parity.capture import hashing_triton

        if hashing_triton.usable():
            by_dev: dict[torch.device, list[int]] = {}
            for i in cuda:
                by_dev.setdefault(tensors[i].device, []).append(i)
            for idx in by_dev.values():
                lanes = hashing_triton.device_lanes([_elements(tensors[i]) for i in idx])
                if lanes is None:
                    break
                for i, ln in zip(idx, lanes):
                    out[i] = ln
                if figures:  # the kernel does not compute them (yet): torch ops, same device
                    for i, f in zip(idx, device_figures_torch([tensors[i] for i in idx])):
                        figs[i] = f
    rest = [i for i, ln in enumerate(out) if ln is None]
    if rest:
        got = device_lanes_torch([tensors[i] for i in rest], figures)
        lanes, rest_figs = got if figures else (got, None)
        for k, i in enumerate(rest):
            out[i] = lanes[k]
            if figures:
                figs[i] = rest_figs[k]
    if figures:
        return out, figs
    return out  # type: ignore[return-value]


def device_backend() -> str:
    """``triton`` or ``torch``: what computes device digests of CUDA tensors in this process
    (recorded in meta.json; the values are the same either way)."""
    if not torch.cuda.is_available():
        return "torch"
    from parity.capture import hashing_triton

    return "triton" if hashing_triton.usable() else "torch"


def device_digest(t: torch.Tensor) -> bytes:
    """16-byte position-weighted checksum of ``t``'s local data, computed on its device."""
    return device_digests([t])[0]


def device_digests(tensors: list[torch.Tensor], figures: bool = False):
    """``device_digest`` of each tensor with one device-to-host transfer per device. With
    ``figures``: (digests, figures), the figures as ``digest_tensors`` gives them."""
    if not tensors:
        return ([], []) if figures else []
    locals_ = [local_tensor(t) for t in tensors]
    got = _device_lanes(locals_, figures)
    lanes, figs = got if figures else (got, None)
    digests = [_finish(ln, t.numel() * t.element_size(), t.dtype) for ln, t in zip(lanes, locals_)]
    return (digests, figs) if figures else digests


def digest_tensors(tensors: list[torch.Tensor | None], hasher: str = "auto",
                   figures: bool = False) -> bytes | tuple[bytes, bytes]:
    """Concatenated 16-byte digests in list order; ``None`` -> ``NO_HASH``. With ``figures``:
    ``(digests, figures)``, the figures 24 bytes per tensor in the same order (sum, sum of
    squares, max |x| as little-endian float64; ``NO_FIGURES`` for ``None``), computed in the
    same call: see the module docstring for where, per path."""
    if hasher == "xxh3" and not figures:
        return b"".join(NO_HASH if t is None else _xxh3(_local(t)) for t in tensors)
    out: list[bytes | None] = [None] * len(tensors)
    figs = np.frombuffer(NO_FIGURES * len(tensors), dtype="<f8").reshape(-1, 3).copy() \
        if figures else None
    small_rows: list[int] = []
    small: list[np.ndarray] = []
    dev_idx = []
    for i, t in enumerate(tensors):
        if t is None:
            out[i] = NO_HASH
            continue
        lt = _local(t)
        if hasher == "device" or (hasher == "auto" and lt.is_cuda):
            dev_idx.append(i)
        elif not figures:
            out[i] = _xxh3(lt)
        else:
            out[i], fig, vals = _digest_and_figures(lt)
            if vals is not None:
                small_rows.append(i)
                small.append(vals)
            else:
                figs[i] = fig
    if small:  # the small tensors' figures together: a few numpy calls for the whole table
        figs[small_rows] = batch_figures(small)
    if dev_idx:
        got = device_digests([tensors[i] for i in dev_idx], figures=figures)
        for k, i in enumerate(dev_idx):
            out[i] = got[0][k] if figures else got[k]
            if figures:
                figs[i] = got[1][k]
    if not figures:
        return b"".join(out)
    return b"".join(out), figs.tobytes()
