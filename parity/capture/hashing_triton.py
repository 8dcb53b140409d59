"""The device digest as one Triton kernel: capture's hashing at HBM speed on CUDA.

Why: the torch-ops digest (``hashing._lanes_torch``) launches a dozen int64 kernels per chunk of
every tensor and ran at 7.9 GB/s on an H100 whose plain read of the same tensors ran at ~2,500
GB/s; a step of an 8B model would spend about a second hashing. This kernel reads every element
once and does a few 32/64-bit integer multiply-adds per element.

It computes exactly the lanes ``hashing.py`` defines (the definition is written there; the
interpreter test compares the two bit for bit), so the digest a run records does not depend on
whether Triton was importable, and a failure here falls back to torch ops without changing any
value.

Shape of the work:

* The tensors (already flat, contiguous integer views of 1, 2, 4 or 8 bytes per element, as
  ``hashing._elements`` makes them; non-contiguous tensors were copied there, contiguous ones are
  read in place) are cut into chunks of ``BLOCK * ITERS`` elements. A table row per chunk holds
  (address, element count, first element, output slot); the table crosses to the device in one
  host-to-device copy and is cached by its contents (parameters keep their addresses).
* One launch per (element width, 16-byte aligned or not, full chunks or tails) present: usually
  two to four launches per step whatever the number of tensors. One program per chunk; each
  keeps its partial lanes in registers and adds them to its tensor's output lanes with one
  atomic add per lane (uint64 wrapping arithmetic, which is what the definition's "mod 2**64"
  is). Full chunks of aligned tensors load without a mask and with alignment hints, so that
  Triton can emit vector loads (an address loaded from a table carries no alignment otherwise).
* The output (tensors x 4 int64) crosses to the host in one device-to-host copy.

Nothing here runs inside a trace or issues a collective; it runs on the current stream after the
optimizer step, like the rest of capture.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["usable", "device_lanes", "BLOCK", "ITERS"]

BLOCK = 1024  # elements per vector step of a program
ITERS = 16    # vector steps per program: 16 Ki elements (64 KiB of fp32) per program
B_MULT = 0x9E3779B1  # must equal hashing.B_MULT (tested)
_M64 = (1 << 64) - 1
_WIDTHS = (1, 2, 4, 8)
ENV_BACKEND = "PARITY_DEVICE_DIGEST"  # "torch" forces the torch-ops fallback

_state = {"failed": None}
_kernels: dict[bool, object] = {}
_tables: OrderedDict = OrderedDict()
_TABLE_CACHE = 8


def _triton():
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return None
    return triton


def usable() -> bool:
    """True when CUDA tensors should go through the kernel: Triton imports, CUDA is present, the
    kernel has not failed in this process, and ``PARITY_DEVICE_DIGEST`` is not ``torch``."""
    if os.environ.get(ENV_BACKEND, "") == "torch" or _state["failed"] is not None:
        return False
    return torch.cuda.is_available() and _triton() is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel():
    """The jitted kernel, built on first use (``triton.jit`` picks the interpreter when
    ``TRITON_INTERPRET=1`` at that time, which is how the tests run it on CPU)."""
    key = _interpreting()
    k = _kernels.get(key)
    if k is not None:
        return k
    import triton
    import triton.language as tl

    def digest_lanes(table_ptr, out_ptr, WIDTH: tl.constexpr, ALIGNED: tl.constexpr,
                     MASKED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                     B_MULT: tl.constexpr):
        # One program = one table row = up to BLOCK * ITERS elements of one tensor. Rows of full
        # chunks (MASKED False) load without a mask and, for 16-byte aligned tensors (ALIGNED),
        # with the alignment and contiguity hints that let Triton emit vector loads; a loaded
        # address or length carries no such information by itself.
        row = table_ptr + tl.program_id(0) * 4
        addr = tl.load(row)
        n = tl.load(row + 1)
        start = tl.load(row + 2)
        slot = tl.load(row + 3)
        if WIDTH == 1:
            ptr = addr.to(tl.pointer_type(tl.uint8))
        elif WIDTH == 2:
            ptr = addr.to(tl.pointer_type(tl.uint16))
        elif WIDTH == 4:
            ptr = addr.to(tl.pointer_type(tl.uint32))
        else:
            ptr = addr.to(tl.pointer_type(tl.uint64))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        acc_a_lo = tl.zeros([BLOCK], dtype=tl.uint64)
        acc_b_lo = tl.zeros([BLOCK], dtype=tl.uint64)
        acc_a_hi = tl.zeros([BLOCK], dtype=tl.uint64)
        acc_b_hi = tl.zeros([BLOCK], dtype=tl.uint64)
        if ALIGNED:  # on the pointer itself: a hint on the integer is lost in the cast
            ptr = tl.multiple_of(ptr, 16)
        lane = tl.arange(0, BLOCK)
        # a_i = (i mod 2**31) + 1. A row starts at a multiple of BLOCK * ITERS, which divides
        # 2**31, so i mod 2**31 does not wrap inside a row: a scalar base plus the lane.
        q_base = ((start & 0x7FFFFFFF) + 1).to(tl.uint32)
        for it in tl.static_range(ITERS):
            idx = start + it * BLOCK + lane  # int64 element index
            idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
            if MASKED:
                v = tl.load(ptr + idx, mask=idx < n, other=0)
            else:
                v = tl.load(ptr + idx)
            # b_i in uint32 (the truncation is the "mod 2**32" whatever type the product was
            # computed in); products as 32x32 -> 64-bit.
            q1 = q_base + it * BLOCK + lane.to(tl.uint32)
            b = (((q1 * B_MULT).to(tl.uint32)) >> 1) | 1
            a64 = q1.to(tl.uint64)
            b64 = b.to(tl.uint64)
            if WIDTH == 8:
                lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64)
                hi = (v >> 32).to(tl.uint32).to(tl.uint64)
                acc_a_hi += hi * a64
                acc_b_hi += hi * b64
            else:
                lo = v.to(tl.uint32).to(tl.uint64)
            acc_a_lo += lo * a64
            acc_b_lo += lo * b64
        out = out_ptr + slot * 4
        tl.atomic_add(out, tl.sum(acc_a_lo, axis=0).to(tl.int64, bitcast=True))
        tl.atomic_add(out + 2, tl.sum(acc_b_lo, axis=0).to(tl.int64, bitcast=True))
        if WIDTH == 8:
            tl.atomic_add(out + 1, tl.sum(acc_a_hi, axis=0).to(tl.int64, bitcast=True))
            tl.atomic_add(out + 3, tl.sum(acc_b_hi, axis=0).to(tl.int64, bitcast=True))

    k = _kernels[key] = triton.jit(digest_lanes)
    return k


def _table(elems: list[torch.Tensor], dev: torch.device, chunk: int):
    """(table on ``dev``, [(width, aligned, masked, first row, rows)]) for ``elems``, cached by
    its contents (a pure function of the addresses, lengths and widths).

    Each tensor gives one row per full chunk (launched without a mask) and one row for its tail
    (masked); rows are grouped by element width, 16-byte alignment of the address, and mask.
    """
    key = (dev, chunk, tuple((e.data_ptr(), e.numel(), e.element_size()) for e in elems))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    addr = np.array([e.data_ptr() for e in elems], dtype=np.int64)
    n = np.array([e.numel() for e in elems], dtype=np.int64)
    width = np.array([e.element_size() for e in elems], dtype=np.int64)
    slot = np.arange(len(elems), dtype=np.int64)
    aligned = addr % 16 == 0
    full = n - n % chunk
    parts: list[np.ndarray] = []
    launches = []
    rows = 0
    for w in _WIDTHS:
        for al in (True, False):
            sel = (width == w) & (aligned == al)
            if not sel.any():
                continue
            # full chunks: one row per chunk, no mask
            per = full[sel] // chunk
            if per.sum() > 0:
                idx = np.repeat(np.flatnonzero(sel), per)
                starts = (np.arange(len(idx)) - np.repeat(np.cumsum(per) - per, per)) * chunk
                parts.append(np.stack([addr[idx], n[idx], starts, slot[idx]], axis=1))
                launches.append((w, al, False, rows, len(idx)))
                rows += len(idx)
            # tails: one masked row per tensor that has one
            tail = np.flatnonzero(sel & (full < n))
            if len(tail):
                parts.append(np.stack([addr[tail], n[tail], full[tail], slot[tail]], axis=1))
                launches.append((w, al, True, rows, len(tail)))
                rows += len(tail)
    table = torch.from_numpy(np.concatenate(parts) if parts else np.zeros((1, 4), np.int64))
    if dev.type == "cuda":
        table = table.pin_memory().to(dev, non_blocking=True)
    else:
        table = table.to(dev)
    hit = _tables[key] = (table, launches)
    if len(_tables) > _TABLE_CACHE:
        _tables.popitem(last=False)
    return hit


def device_lanes(elems: list[torch.Tensor], block: int = BLOCK,
                 iters: int = ITERS) -> list[list[int]] | None:
    """The four lanes (unsigned 64-bit ints) of each tensor, or None if the kernel failed (the
    caller then uses the torch-ops reference; the failure is printed once and disables the kernel
    for this process).

    ``elems`` must be flat contiguous tensors of 1, 2, 4 or 8-byte elements on one device (CUDA,
    or CPU under ``TRITON_INTERPRET=1``); ``block``/``iters`` are for tests (tiny sizes keep the
    interpreter fast).
    """
    if not elems:
        return []
    dev = elems[0].device
    for e in elems:
        if e.device != dev or e.element_size() not in _WIDTHS or not e.is_contiguous():
            raise ValueError("device_lanes: flat contiguous 1/2/4/8-byte tensors on one device")
    try:
        kernel = _kernel()
        table, launches = _table(elems, dev, block * iters)
        out = torch.zeros(len(elems), 4, dtype=torch.int64, device=dev)
        # Triton launches on the current device: make it the tensors' one
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            for width, aligned, masked, first, rows in launches:
                kernel[(rows,)](table[first:], out, WIDTH=width, ALIGNED=aligned,
                                MASKED=masked, BLOCK=block, ITERS=iters, B_MULT=B_MULT)
        host = out.cpu().tolist()
    except Exception as e:  # a compile or launch failure: fall back, never lose the step
        _state["failed"] = f"{type(e).__name__}: {e}"
        print(f"parity: Triton device digest unavailable, using torch ops: "
              f"{_state['failed'].splitlines()[0][:200]}", file=sys.stderr)
        return None
    return [[v & _M64 for v in row] for row in host]
