"""Tensor hashing for capture: the hot path of every recorded step.

Two digests, both 16 raw bytes:

* ``host_digest(t)``: xxh3-128 of the tensor's local bytes, read zero-copy through a
  ``view(torch.uint8)`` of the contiguous data exposed to numpy (a copy is made only when the
  tensor is not contiguous, or lives on an accelerator). This is the reference hash.
* ``device_digest(t)``: a 128-bit position-weighted checksum computed with torch ops on the
  tensor's own device, so that only 32 bytes per tensor cross to the host. It is NOT xxh3 and
  never equals ``host_digest``; a run says which it used (``meta.json`` ``capture.hasher``).
  Properties (see docs/capture.md): any single-bit flip and any swap of two distinct elements
  changes it (guaranteed for tensors of fewer than 2**30 elements); otherwise it is a checksum,
  not a cryptographic or even a well-mixed hash.

``digest_tensors`` hashes a list (the parameter table) and returns the concatenated raw digests,
``artifacts.NO_HASH`` standing for a missing tensor (a parameter without a gradient).
"""

from __future__ import annotations

import struct

import torch
import xxhash

from parity.artifacts import NO_HASH

__all__ = ["local_tensor", "host_digest", "device_digest", "device_digests", "digest_tensors",
           "HASHERS"]

HASHERS = ("auto", "xxh3", "device")

_xxh3_128 = xxhash.xxh3_128_digest
_EMPTY = xxhash.xxh3_128_digest(b"")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) not in _PLAIN:
        inner = getattr(t, "_local_tensor", None)
        if inner is not None:
            return inner
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
# Four lanes, each a sum modulo a prime p_j < 2**31 of (word_i mod p_j) * weight_j(i), where the
# words are the tensor's elements reinterpreted as integers of their own width (1, 2, 4 or 8
# bytes; wider elements are split into 8-byte words) and the weights are (i+1) for lanes 0-1 and
# (i+1)**2 for lanes 2-3. Every product is < 2**62 and every partial sum of reduced terms fits in
# int64, so the arithmetic is exact on every device.
_PRIMES = (2147483647, 2147483629, 2147483587, 2147483579)
_QUADRATIC = (False, False, True, True)
_CHUNK = 1 << 18  # words per chunk: bounds the int64 temporaries (~8 MiB per (4, chunk) tensor)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}


def _words(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The elements as int64 words: unsigned values of their width, or raw 64-bit (``True``)."""
    t = _materialized(local_tensor(t))
    flat = t.reshape(-1)
    size = flat.element_size()
    if size in _INT_OF_SIZE:
        w = flat.view(_INT_OF_SIZE[size])
    elif size % 8 == 0:
        w = flat.view(torch.int64)
        size = 8
    else:  # exotic widths: bytes
        w = flat.view(torch.uint8)
        size = 1
    if size == 8:
        return w, True
    w = w.to(torch.int64)
    if size != 1:
        w = w & _MASK[size]
    return w, False


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(dev: torch.device, start: int, m: int, primes: torch.Tensor) -> torch.Tensor:
    """Lane weights for word positions start..start+m-1, shape (4, m), each in [1, p)."""
    if start == 0:
        w = _WEIGHTS.get(dev)
        if w is None:
            w = _WEIGHTS[dev] = _make_weights(dev, 0, _CHUNK, primes)
        return w[:, :m]
    return _make_weights(dev, start, m, primes)


def _make_weights(dev: torch.device, start: int, m: int, primes: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(start + 1, start + m + 1, dtype=torch.int64, device=dev)
    lin = pos.unsqueeze(0).expand(2, m) % primes[:2]
    quad = (pos * pos).unsqueeze(0).expand(2, m) % primes[2:]
    return torch.cat([lin, quad], dim=0)


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """The four lane sums of ``t`` as an int64 tensor of shape (4,) on ``t``'s device."""
    w, wide = _words(t)
    n = w.numel()
    dev = w.device
    primes = torch.tensor(_PRIMES, dtype=torch.int64, device=dev).unsqueeze(1)
    acc = torch.zeros(4, dtype=torch.int64, device=dev)
    for start in range(0, n, _CHUNK):
        chunk = w[start:start + _CHUNK]
        m = chunk.numel()
        # words of up to 32 bits are < 2**32, so word * weight < 2**63 needs no reduction first
        vals = torch.remainder(chunk.unsqueeze(0), primes) if wide else chunk.unsqueeze(0)
        terms = (vals * _weights(dev, start, m, primes)) % primes  # each < p < 2**31
        acc = (acc + terms.sum(dim=1)) % primes.squeeze(1)
    return acc


def _finish(lanes: list[int], nbytes: int, dtype: torch.dtype) -> bytes:
    # The lanes are not well mixed; xxh3 over them (and the length) spreads them into 16 bytes.
    return _xxh3_128(struct.pack("<4qq", *lanes, nbytes) + str(dtype).encode())


def device_digest(t: torch.Tensor) -> bytes:
    """16-byte position-weighted checksum of ``t``'s local data, computed on its device."""
    lt = local_tensor(t)
    return _finish(_lanes(lt).tolist(), lt.numel() * lt.element_size(), lt.dtype)


def device_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """``device_digest`` of each tensor with one device-to-host transfer per device."""
    if not tensors:
        return []
    locals_ = [local_tensor(t) for t in tensors]
    lanes = [_lanes(t) for t in locals_]
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(locals_):
        by_dev.setdefault(t.device, []).append(i)
    host: list[list[int] | None] = [None] * len(tensors)
    for dev, idx in by_dev.items():
        stacked = torch.stack([lanes[i] for i in idx]).cpu().tolist()
        for i, row in zip(idx, stacked):
            host[i] = row
    return [_finish(host[i], t.numel() * t.element_size(), t.dtype) for i, t in enumerate(locals_)]


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
