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
``artifacts.NO_HASH`` standing for a missing tensor (a parameter without a gradient).
"""

from __future__ import annotations

import struct

import torch
import xxhash

from parity.artifacts import NO_HASH

__all__ = ["local_tensor", "host_digest", "device_digest", "device_digests", "device_lanes_torch",
           "digest_tensors", "HASHERS"]

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


def _lanes_torch(t: torch.Tensor) -> torch.Tensor:
    """Lane halves of ``t`` as int64 of shape (2, 4) on ``t``'s device: row 0 the low 32 bits of
    L0..L3, row 1 the high 32 bits (``_combine`` joins them on the host)."""
    lo, hi = _halves(_elements(t))
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


def _finish(lanes: list[int], nbytes: int, dtype: torch.dtype) -> bytes:
    # The lanes are not well mixed; xxh3 over them (and the length) spreads them into 16 bytes.
    return _xxh3_128(struct.pack("<4Qq", *lanes, nbytes) + str(dtype).encode())


def device_lanes_torch(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The four lanes of each tensor computed with torch ops, one device-to-host transfer per
    device. The reference for ``hashing_triton.device_lanes``."""
    locals_ = [local_tensor(t) for t in tensors]
    host: list[list[int] | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(locals_):
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        stacked = torch.stack([_lanes_torch(locals_[i]) for i in idx]).cpu().tolist()
        for i, halves in zip(idx, stacked):
            host[i] = _combine(halves)
    return host  # type: ignore[return-value]


def _device_lanes(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Lanes of local tensors: CUDA ones through the Triton kernel where it is usable, the rest
    (and all of them if the kernel fails) with torch ops. Both give the same values, so which one
    ran never changes a digest."""
    cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
    out: list[list[int] | None] = [None] * len(tensors)
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
    rest = [i for i, ln in enumerate(out) if ln is None]
    if rest:
        for i, ln in zip(rest, device_lanes_torch([tensors[i] for i in rest])):
            out[i] = ln
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


def device_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """``device_digest`` of each tensor with one device-to-host transfer per device."""
    if not tensors:
        return []
    locals_ = [local_tensor(t) for t in tensors]
    lanes = _device_lanes(locals_)
    return [_finish(ln, t.numel() * t.element_size(), t.dtype) for ln, t in zip(lanes, locals_)]


def digest_tensors(tensors: list[torch.Tensor | None], hasher: str = "auto") -> bytes:
    """Concatenated 16-byte digests in list order; ``None`` -> ``NO_HASH``."""
    if hasher == "xxh3":
        return b"".join(NO_HASH if t is None else _xxh3(_local(t)) for t in tensors)
    out: list[bytes | None] = [None] * len(tensors)
    dev_idx = []
    for i, t in enumerate(tensors):
        if t is None:
            out[i] = NO_HASH
            continue
        lt = _local(t)
        if hasher == "device" or lt.is_cuda:
            dev_idx.append(i)
        else:
            out[i] = _xxh3(lt)
    if dev_idx:
        for i, d in zip(dev_idx, device_digests([tensors[i] for i in dev_idx])):
            out[i] = d
    return b"".join(out)
