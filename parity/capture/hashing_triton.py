"""The device digest on CUDA: Triton kernels fed by a cached device table, results read back
without waiting (capture's hashing at HBM speed and without a host sync inside a step).

Why: the torch-ops digest (``hashing._lanes_torch``) launches a dozen int64 kernels per chunk of
every tensor and ran at 7.9 GB/s on an H100 whose plain read of the same tensors ran at ~2,500
GB/s. Version 1 of this module launched one kernel per (width, alignment, mask) and copied the
lanes to the host with ``.cpu()``: 9.2 ms of host work for 1,500 small tensors on an H200, and a
sync that drained the GPU queue at every recorded step. Here:

* The kernels (``digest_kernels.py``) read 1-, 2- and 4-byte dtypes as uint32 words, so bf16 and
  fp16 read like fp32 (version 2 of the definition in ``hashing.py``), and compute the final 16
  digest bytes on the device: nothing per tensor is left for the host.
* The table (one row per chunk of ``BLOCK * ITERS`` units: address, count, first unit, slot and
  mode; and per tensor its byte length and dtype key) is built with numpy, copied to the device
  once and reused while the tensors keep their addresses, lengths and dtypes (checked at every
  call: a list of tensors whose storage moved gets a new table). A ``stable`` list (the
  parameter table: the same tensor objects at every step) is checked by identity and address
  only.
* One call is four queued operations on the current stream: zero the lanes, the lanes kernel
  (one program per row, every mode in one launch), the finish kernel, and an asynchronous copy
  of the digests into pinned host memory followed by a CUDA event. :class:`Pending` waits for
  that event only when its bytes are asked for; capture asks one step later (steps.py). From
  a table's second use on, its launches are one CUDA graph replayed on the current stream
  (``_Graphed``: 33 us of host time per call on an H100 host against 129 us for the queued
  launches, 2026-11-26), after a check that the tensors still are what the table describes:
  one compiled call (``host_native``), else a Python loop (``_python_check``).
* With figures (``figures=True``: what capture asks for, issue 34) the lanes kernel also
  decodes the words by dtype and writes each row's float64 partial figures in the same pass
  over the data, and one more launch (``figures_reduce``) adds each tensor's rows in a fixed
  order into its three figures, beside its digest: the same pinned copy and event bring both
  back (40 bytes per tensor instead of 16). Tensors of a dtype the kernel does not decode
  (``Pending.fallback``: float8, uint16/32/64) get their figures from torch ops in
  ``hashing``.

Nothing here runs inside a trace or issues a collective. The kernels read the tensors on the
current stream, where the optimizer reads them too: a tensor freed after the call (a gradient
at ``zero_grad``) is reused by the caching allocator only for work queued after the kernels.
A kernel that fails to compile or launch prints one line and disables this path for the
process (the torch-ops reference computes the same values, slower and with a sync).
"""

from __future__ import annotations

import array
import os
import sys
from collections import OrderedDict
from operator import attrgetter, is_

import numpy as np
import torch
import xxhash

from parity.capture import host_native

__all__ = ["usable", "materialized", "dtype_key", "device_lanes", "digest_cuda", "digest_all_cuda",
           "Pending", "PendingRows", "PendingFigures", "figure_kind", "BLOCK", "ITERS"]

# The lanes kernel's launch configuration, chosen on an H100 (benchmarks/digest_variants.py,
# 2026-11-26, contiguous fp32 state of 2 GiB against t.sum(): 1024/16/4 gave digest 1.12x and
# digest+figures 0.57x, 512/32/4 gave 1.10x and 1.07x; the float64 figures need the registers
# that a wider BLOCK spends). The digest does not depend on it; the figures' float64 sums may
# differ in their last bits (both sides of a diff run one parity).
BLOCK = 512   # units per vector step of a program
ITERS = 32    # vector steps per program: 16 Ki units (64 KiB of words) per full row
FBLOCK = 1024  # slots per program of the finish kernel
RBLOCK = 256  # rows added at a time per tensor by figures_reduce
NUM_WARPS = 4  # warps per program of digest_lanes
B_MULT = 0x9E3779B1  # must equal hashing.B_MULT (tested)
_M64 = (1 << 64) - 1
ENV_BACKEND = "PARITY_DEVICE_DIGEST"  # "torch" forces the torch-ops fallback

_state: dict = {"failed": None, "graphs": None}
_plans: OrderedDict = OrderedDict()  # signature -> _Plan (LRU)
_stable: OrderedDict = OrderedDict()  # (kind, length, ids of the ends) -> [_Seen] (LRU)
_PLAN_CACHE = 8
_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = attrgetter("nbytes")
_DTYPE = attrgetter("dtype")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_GET_DEVICE = torch.Tensor.get_device


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its lazy conjugate/negation applied and contiguous (a copy only if needed)."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


_DTYPE_KEYS: dict[torch.dtype, int] = {}


def dtype_key(dtype: torch.dtype) -> int:
    """The 64-bit key of a dtype in the device digest's finish (both implementations): xxh3-64
    of its name (``torch.bfloat16``)."""
    k = _DTYPE_KEYS.get(dtype)
    if k is None:
        k = _DTYPE_KEYS[dtype] = xxhash.xxh3_64_intdigest(str(dtype).encode())
    return k


def _triton():
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return None
    return triton


def usable() -> bool:
    """True when CUDA tensors should go through the kernels: Triton imports, CUDA is present,
    the kernels have not failed in this process, and ``PARITY_DEVICE_DIGEST`` is not ``torch``.
    (CUDA and Triton are looked at once per process: every digest call asks.)"""
    if os.environ.get(ENV_BACKEND, "") == "torch" or _state["failed"] is not None:
        return False
    ok = _state.get("cuda_triton")
    if ok is None:
        ok = _state["cuda_triton"] = torch.cuda.is_available() and _triton() is not None
    return ok


def _kernels():
    """digest_kernels, imported on first use (``TRITON_INTERPRET=1`` set before that makes the
    kernels run in Triton's interpreter: how the tests run them on CPU)."""
    from parity.capture import digest_kernels

    return digest_kernels


# ------------------------------------------------------------------------------------ the table
_KIND_NAMES = {torch.float32: "K_F32", torch.bfloat16: "K_BF16", torch.float16: "K_F16",
               torch.complex32: "K_F16", torch.int8: "K_I8", torch.uint8: "K_U8",
               torch.bool: "K_BOOL", torch.int16: "K_I16", torch.int32: "K_I32",
               torch.float64: "K_F64", torch.complex128: "K_F64", torch.int64: "K_I64",
               torch.complex64: "K_C64"}


def figure_kind(dtype: torch.dtype) -> int:
    """How the kernels decode a dtype's units for the figures (``digest_kernels.K_*``);
    ``K_NONE`` (0): not in the kernel, torch ops compute them (hashing)."""
    name = _KIND_NAMES.get(dtype)
    return getattr(_kernels(), name) if name else 0


class _Plan:
    """A device table for one list of tensors (see the module docstring). ``fallback``: the
    slots whose dtype the kernels do not decode for the figures."""

    __slots__ = ("table", "keys", "rows", "n", "device", "fallback", "graphs", "uses",
                 "launched")

    def __init__(self, table, keys, rows: int, n: int, device, fallback: tuple = ()):
        self.table, self.keys, self.rows, self.n, self.device = table, keys, rows, n, device
        self.fallback = fallback
        self.graphs: dict = {}  # figures (bool) -> _Graphed: this table's launches, replayable
        self.uses = 0  # launches so far (a table is captured on its second use)
        # figures settings this table was launched with on the device: its kernels' variants
        # (Triton compiles one per class of n and rows: 1, a multiple of 16, other) are loaded
        self.launched: set = set()


def _build(ptrs: list[int], nbytes: list[int], dtypes: list, device, chunk: int) -> _Plan:
    """The rows of every tensor (grouped by tensor, in order) and its keys (byte length, dtype
    key, first row, end row), on ``device``.

    Per tensor, by its element size and address: 8-byte elements -> ELEM64 rows (FULL for whole
    chunks of a 16-byte aligned tensor, masked for the rest); other sizes at a 4-byte aligned
    address -> WORDS rows over its whole words (FULL likewise), at another address -> BYTES rows
    over its whole words; and, when its length is not a multiple of 4, one BYTES row for the
    last, partial word. Aligned or not, a tensor is cut into the same rows at the same units,
    which keeps its figures independent of its address (digest_kernels)."""

    k = _kernels()
    n = len(ptrs)
    addr = np.array(ptrs, dtype=np.int64)
    nb = np.array(nbytes, dtype=np.int64)
    esize = np.array([d.itemsize for d in dtypes], dtype=np.int64)
    wide = esize % 8 == 0
    aligned4 = addr % 4 == 0
    aligned16 = addr % 16 == 0
    by_bytes = ~wide & ~aligned4
    units = np.where(wide, nb // 8, nb // 4)  # whole units; a partial last word has its own row
    count = np.where(by_bytes, units * 4, units)  # what the kernel's mask compares against
    base = np.where(wide, k.ELEM64, np.where(by_bytes, k.BYTES, k.WORDS))
    nfull = units // chunk
    has_rest = units % chunk > 0
    kind = np.array([figure_kind(d) for d in dtypes], dtype=np.int64)
    slot = (np.arange(n, dtype=np.int64) << k.SLOT_SHIFT) | (kind << k.KIND_SHIFT)
    parts = []
    # whole chunks: FULL where the tensor is 16-byte aligned and read in words or elements
    sel = np.flatnonzero(nfull > 0)
    if len(sel):
        per = nfull[sel]
        idx = np.repeat(sel, per)
        first = (np.arange(len(idx)) - np.repeat(np.cumsum(per) - per, per)) * chunk
        mode = base[idx] + np.where(aligned16[idx] & ~by_bytes[idx], k.FULL, 0)
        parts.append(np.stack([addr[idx], count[idx], first, slot[idx] | mode], 1))
    # the rest of the last chunk, masked
    sel = np.flatnonzero(has_rest)
    if len(sel):
        parts.append(np.stack([addr[sel], count[sel], nfull[sel] * chunk, slot[sel] | base[sel]],
                              1))
    # the last, partial word of a tensor read by words: one BYTES row over the whole byte length
    sel = np.flatnonzero(~wide & (nb % 4 != 0))
    if len(sel):
        parts.append(np.stack([addr[sel], nb[sel], units[sel], slot[sel] | k.BYTES], 1))
    table = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
    if len(table):
        table = table[np.lexsort((table[:, 2], table[:, 3] >> k.SLOT_SHIFT))]  # by tensor, start
    end = np.cumsum(np.bincount(table[:, 3] >> k.SLOT_SHIFT, minlength=n)) if len(table) else \
        np.zeros(n, np.int64)
    counts = np.diff(end, prepend=0)
    keys = np.stack([nb, np.array([dtype_key(d) for d in dtypes], dtype=np.uint64).view(np.int64),
                     end - counts, end], 1).astype(np.int64) if n else np.zeros((0, 4), np.int64)
    rows = len(table)
    table_t = torch.from_numpy(np.ascontiguousarray(table if rows else np.zeros((1, 4), np.int64)))
    keys_t = torch.from_numpy(np.ascontiguousarray(keys if n else np.zeros((1, 4), np.int64)))
    if device.type == "cuda":
        table_t = table_t.pin_memory().to(device, non_blocking=True)
        keys_t = keys_t.pin_memory().to(device, non_blocking=True)
    fallback = tuple(np.flatnonzero(kind == k.K_NONE).tolist()) if n else ()
    return _Plan(table_t, keys_t, rows, n, device, fallback)


def _plan(ptrs, nbytes, dtypes, device, chunk: int) -> _Plan:
    key = (device, chunk, tuple(ptrs), tuple(nbytes), tuple(dtypes))
    hit = _plans.get(key)
    if hit is not None:
        _plans.move_to_end(key)
        return hit
    plan = _plans[key] = _build(ptrs, nbytes, dtypes, device, chunk)
    if len(_plans) > _PLAN_CACHE:
        _plans.popitem(last=False)
    return plan


# ------------------------------------------------------------------------------------ launching
class Pending:
    """Results on their way to the host: ``buf`` (pinned, or the results themselves under the
    interpreter) holds per slot 2 int64 of digest and, ``with_figures``, 3 float64 figures;
    its first ``n`` rows are this call's. ``result()`` (the 16-byte digests) and
    ``figures_bytes()`` (24 bytes a slot; ``figures()``) wait for the copy's event and read the
    rows through numpy (no torch views at launch: they cost more host time than the reads).
    ``fallback``: the slots whose figures the kernels did not compute (``_Plan.fallback``)."""

    __slots__ = ("buf", "n", "event", "keep", "with_figures", "fallback")

    def __init__(self, buf: torch.Tensor, n: int, event, keep, with_figures: bool = False,
                 fallback: tuple = ()):
        self.buf, self.n, self.event, self.keep = buf, n, event, keep
        self.with_figures, self.fallback = with_figures, fallback

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.keep = None  # the device buffers may be reused now

    def result(self) -> bytes:
        self.wait()
        return _rows(self.buf.numpy(), self.n, 0, ROW16)

    def figures_bytes(self) -> bytes:
        if not self.with_figures:
            raise ValueError("these digests were computed without figures")
        self.wait()
        return _rows(self.buf.numpy(), self.n, 16, ROW24)

    def figures(self) -> PendingFigures:
        return PendingFigures(self)


ROW16 = np.dtype((np.void, 16))  # a row's digest (two int64) as one numpy item
ROW24 = np.dtype((np.void, 24))  # a row's figures (three float64) as one numpy item


def _rows(a, n: int, offset: int, item) -> bytes:
    """Bytes ``offset`` to ``offset + item.itemsize`` of each of the first ``n`` rows of the
    C-contiguous array ``a``, concatenated: one strided item per row (numpy's ``tobytes`` of a
    strided 2-D slice copies element by element: 11 us against 2 us for 1,500 rows)."""
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return np.ndarray((n,), dtype=item, buffer=a, offset=offset,
                      strides=(a.strides[0],)).tobytes()


class PendingRows(Pending):
    """A whole buffer of rows on its way to the host (``hashing._figures_pending``: float64
    figures by torch ops): ``result()`` is every byte of it, in row order."""

    __slots__ = ()

    def __init__(self, buf: torch.Tensor, event, keep):
        super().__init__(buf, len(buf), event, keep)

    def result(self) -> bytes:
        self.wait()
        return self.buf.numpy().tobytes()


class PendingFigures:
    """The figures part of a :class:`Pending` (or ``_Grouped``), as ``hashing.Digests`` reads
    its parts: ``ready()``, ``result()`` (24 bytes per slot: three little-endian float64)."""

    __slots__ = ("of",)

    def __init__(self, of):
        self.of = of

    def ready(self) -> bool:
        return self.of.ready()

    def result(self) -> bytes:
        return self.of.figures_bytes()


def _queue(plan: _Plan, lanes, res, parts, block: int, iters: int, figures: bool) -> None:
    """The kernels of ``plan`` on the current stream: lanes, finish and, with ``figures``, the
    figures' reduce, into ``lanes`` (zeroed by the caller), ``res`` and ``parts``."""
    k = _kernels()
    n = max(plan.n, 1)
    stride = 5 if figures else 2
    if plan.rows:
        k.digest_lanes[(plan.rows,)](plan.table, lanes, parts, BLOCK=block, ITERS=iters,
                                     B_MULT=B_MULT, FIGURES=figures, num_warps=NUM_WARPS)
    k.digest_finish[(triton_cdiv(n, FBLOCK),)](lanes, plan.keys, res, plan.n, STRIDE=stride,
                                              FBLOCK=FBLOCK)
    if figures and plan.n:
        k.figures_reduce[(plan.n,)](parts, plan.keys, res, STRIDE=stride, RBLOCK=RBLOCK)


def _buffers(plan: _Plan, figures: bool):
    """The device buffers of one launch of ``plan``: lanes (zeroed), results, row partials."""
    dev = plan.device
    n = max(plan.n, 1)
    lanes = torch.zeros(n, 4, dtype=torch.int64, device=dev)
    res = torch.empty(n, 5 if figures else 2, dtype=torch.int64, device=dev)
    parts = torch.empty(max(plan.rows, 1), 3, dtype=torch.int64, device=dev) if figures else lanes
    return lanes, res, parts


def _to_host(plan: _Plan, res, keep, figures: bool, stream=None) -> Pending:
    """One asynchronous copy of ``res`` into pinned memory and an event behind it."""
    host = torch.empty(res.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(res, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return _pending(plan, host, event, keep, figures)


def _pending(plan: _Plan, host, event, keep, figures: bool) -> Pending:
    """The Pending of a results buffer (rows of 2 int64 of digest, then 3 float64 figures
    with ``figures``), its first ``plan.n`` rows."""
    return Pending(host, plan.n, event, keep, figures, plan.fallback if figures else ())


def _launch(plan: _Plan, block: int, iters: int, figures: bool = False) -> Pending:
    """Queue the kernels of ``plan`` (lanes, finish and, with ``figures``, the figures' reduce)
    and one copy of their results (digests and figures side by side) to the host."""
    lanes, res, parts = _buffers(plan, figures)
    _queue(plan, lanes, res, parts, block, iters, figures)
    keep = (lanes, res, parts, plan)
    if plan.device.type == "cuda":
        plan.launched.add(figures)
        return _to_host(plan, res, keep, figures)
    return _pending(plan, res, None, keep, figures)  # the interpreter, on CPU tensors


# ------------------------------------------------------------------------ replaying a table
# Why: a Triton launch costs ~80-100 us of Python on the host (JITFunction.run: binding,
# specialization, cache key), three of them per call, and capture makes three calls per step
# (the parameters at the step's entry, the gradients, the parameters after it): with queued
# launches 1.3-1.5 ms of host time per step for 3,000 tensors on an H100 host, 0.9-1.2 ms
# replayed (2026-11-26; target 0.5 ms: docs/gpu.md says where the rest goes). A table used a
# second time (the parameter table, the gradients of the same parameters) has its launches
# captured once as a CUDA graph with its own buffers, then replayed: one cudaGraphLaunch on
# the current stream. Capture here changes nothing in the job: it runs on parity's own side
# stream in thread-local mode (no allocation, no sync, no kernel of the job in it), ordered
# with the job's stream, and the graph uses no random numbers. A graph is replayed only on
# the stream it was made for (its buffers are then reused in stream order); on another
# stream, or where capture fails (the process then stops trying: one line on stderr), the
# launches are queued as before.
ENV_GRAPHS = "PARITY_DIGEST_GRAPHS"  # "0": never replay a table (queue the launches each call)
_side: dict = {}  # device -> parity's capture stream


class _Graphed:
    """One table's launches (with or without figures) as a CUDA graph, with its buffers."""

    __slots__ = ("graph", "lanes", "res", "parts", "stream")

    def __init__(self, graph, lanes, res, parts, stream):
        self.graph, self.lanes, self.res, self.parts, self.stream = graph, lanes, res, parts, \
            stream


def _graphs_failed(e: BaseException) -> None:
    _state["graphs"] = f"{type(e).__name__}: {e}"
    print(f"parity: device digest tables are not replayed as CUDA graphs in this process "
          f"({_state['graphs'].splitlines()[0][:200]}); launches are queued each call",
          file=sys.stderr)


def _graphs_on() -> bool:
    return _state.get("graphs") is None and os.environ.get(ENV_GRAPHS, "1") != "0"


def _capture(plan: _Plan, figures: bool, stream) -> _Graphed | None:
    """Capture ``plan``'s launches (zeroing its lanes first) on the side stream; None (and no
    more captures in this process) when CUDA refuses."""
    dev = plan.device
    try:
        lanes, res, parts = _buffers(plan, figures)  # allocated and zeroed on the job's stream
        side = _side.get(dev)
        if side is None:
            side = _side[dev] = torch.cuda.Stream(dev)
        graph = torch.cuda.CUDAGraph()
        # capture_begin writes the default CUDA generator's graph RNG state (seed and offset
        # tensors that, in some torch versions, the job's own CUDA graphs read too) on the side
        # stream before capturing: ordered after the job's queued work and before what it
        # queues next, so no graph of the job can read them while they change.
        side.wait_stream(stream)
        with torch.cuda.device(dev), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                lanes.zero_()
                _queue(plan, lanes, res, parts, BLOCK, ITERS, figures)
            finally:
                graph.capture_end()
        stream.wait_stream(side)
    except Exception as e:  # noqa: BLE001 - never lose the step: the launches are queued instead
        _graphs_failed(e)
        return None
    g = plan.graphs[figures] = _Graphed(graph, lanes, res, parts, stream)
    return g


def _launch_plan(plan: _Plan, figures: bool = False) -> Pending | None:
    """A table used before: replayed where it can be (see above), else launched."""
    try:
        if plan.device.type != "cuda":
            return _launch(plan, BLOCK, ITERS, figures)
        stream = torch.cuda.current_stream(plan.device)
        g = plan.graphs.get(figures)
        on = _graphs_on()
        # captured once this very table ran with these figures: a kernel Triton has not
        # compiled for its sizes would compile and load inside the capture, which CUDA refuses
        if g is None and on and figures in plan.launched:
            g = _capture(plan, figures, stream)
        plan.uses += 1
        if g is not None and g.stream == stream and on:
            try:
                g.graph.replay()
            except Exception as e:  # noqa: BLE001 - replay off for the process, launches queued
                _graphs_failed(e)
            else:
                return _to_host(plan, g.res, (g, plan), figures, stream)
        with torch.cuda.device(plan.device):
            return _launch(plan, BLOCK, ITERS, figures)
    except Exception as e:  # noqa: BLE001
        _failed(e)
        return None


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _failed(e: BaseException) -> None:
    """A compile or launch failure: fall back to torch ops for the rest of the process."""
    _state["failed"] = f"{type(e).__name__}: {e}"
    print(f"parity: Triton device digest unavailable, using torch ops: "
          f"{_state['failed'].splitlines()[0][:200]}", file=sys.stderr)


def _run(locs: list[torch.Tensor], ptrs: list[int], block: int = BLOCK,
         iters: int = ITERS, figures: bool = False, nbytes: list[int] | None = None,
         dtypes: list | None = None) -> Pending | None:
    """Digest flat-contiguous ``locs`` (one device) whose addresses are ``ptrs`` (and byte
    lengths and dtypes ``nbytes``/``dtypes`` when the caller has them)."""
    dev = locs[0].device
    try:
        plan = _plan(ptrs, list(map(_NBYTES, locs)) if nbytes is None else nbytes,
                     list(map(_DTYPE, locs)) if dtypes is None else dtypes, dev, block * iters)
        if block == BLOCK and iters == ITERS:
            return _launch_plan(plan, figures)
        with torch.cuda.device(dev) if dev.type == "cuda" else _nothing():
            return _launch(plan, block, iters, figures)
    except Exception as e:  # noqa: BLE001 - never lose the step: the caller falls back
        _failed(e)
        return None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _plain(locs: list[torch.Tensor]) -> bool:
    """Every tensor is contiguous and holds its values as stored (no lazy conj/neg bit)."""
    if not all(map(_IS_CONTIGUOUS, locs)):
        return False
    if any(d.is_complex for d in set(map(_DTYPE, locs))):
        return not any(t.is_conj() or t.is_neg() for t in locs)
    return True


_PLAIN_TYPES = {torch.Tensor, torch.nn.Parameter}
_LOCAL = attrgetter("_local_tensor")


def _locals(tensors: list) -> tuple[list, int]:
    """The local tensors of a list without None rows (a DTensor's ``_local_tensor``), with as
    few Python steps per tensor as the list allows, and how they were read (``_Seen.unwrap``):
    0 plain tensors as they are, 1 a list of DTensors through one attrgetter, 2 row by row."""
    types = set(map(type, tensors))
    if types <= _PLAIN_TYPES:
        return tensors, 0
    if not types & _PLAIN_TYPES and all(hasattr(t, "_local_tensor") for t in types):
        return list(map(_LOCAL, tensors)), 1
    return [getattr(t, "_local_tensor", t) for t in tensors], 2


class _Seen:
    """A list seen before, whose table is reused while it holds the same tensors: ``members``
    (the list itself, or the gradients' owners), the address of each row (0 for a row left
    out), the rows hashed (``idx``) and left out (``holes``: checked again for gradients, whose
    owners do not say whether they have one), ``pos`` (the rows hashed, for ``hashing.Digests``;
    None for all), how the local tensors are read (``unwrap``: 0 as they are, 1 every row a
    DTensor, 2 row by row) and the plan. A stable list of DTensors also keeps their local
    tensors (``locs``): a DTensor whose local tensor was replaced (FSDP2's
    ``reset_sharded_param``) is built again even where the new one starts at the same address.
    ``ptrs_b``/``nbytes_b``/``dtypes``: each row's address, byte length and dtype as the
    compiled check reads them (host_native: int64 bytes, a list; 0/None for a row left out);
    ``row_ptrs``/``sizes``/``row_dtypes``: the addresses, byte lengths and dtypes of the rows
    hashed, for the Python loop; ``lazy_bits``: a row is complex (its lazy conj/neg bits are
    read again at every call, as the compiled check reads every row's)."""

    __slots__ = ("members", "ptrs", "idx", "holes", "pos", "unwrap", "plan", "locs", "ptrs_b",
                 "nbytes_b", "dtypes", "row_ptrs", "sizes", "row_dtypes", "lazy_bits")

    def __init__(self, members, ptrs, idx, holes, pos, unwrap, plan, locs=None,
                 nbytes=None, dtypes=None):
        self.members, self.ptrs, self.idx, self.holes, self.pos = members, ptrs, idx, holes, pos
        self.unwrap, self.plan = unwrap, plan
        self.locs = locs  # a stable list of DTensors: their local tensors, checked by identity
        self.ptrs_b = array.array("q", ptrs).tobytes()
        self.nbytes_b = array.array("q", nbytes).tobytes()
        self.dtypes = dtypes
        self.row_ptrs = [ptrs[i] for i in idx]
        self.sizes = [nbytes[i] for i in idx]
        self.row_dtypes = [dtypes[i] for i in idx]
        self.lazy_bits = any(d.is_complex for d in set(self.row_dtypes))


# One C++ loop that compares every listed tensor's address with the one recorded (the check
# inductor's CUDA graph trees run before each replay; in torch's CUDA builds only). Elsewhere,
# or when torch lacks it, a Python loop over data_ptr (about 100 ns a tensor on an H100 host).
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _native_reuse(check, seen: _Seen, tensors: list, members: list, figures: bool):
    """``_reuse`` in one call of the compiled check (host_native): (pos, Pending); False when
    ``seen`` holds other members (the caller looks at the next one); None when its table no
    longer describes ``tensors`` (the caller builds again)."""
    got = check(tensors, members, seen.members, seen.ptrs_b, seen.nbytes_b, seen.dtypes,
                seen.unwrap, seen.locs, True)  # layout too, stable or not: it costs ~nothing here
    if got == 0:
        return False
    if got != 1:
        return None
    pending = _launch_plan(seen.plan, figures)
    return None if pending is None else (seen.pos, pending)


def _reuse(seen: _Seen, tensors: list, figures: bool):
    """(pos, Pending) from ``seen``'s table when ``tensors`` still are what it was built for;
    None when not (the caller builds again). The members were checked by identity already.
    (The Python loop; ``_native_reuse`` decides the same in one compiled call.)"""
    if not _python_check(seen, tensors):
        return None
    pending = _launch_plan(seen.plan, figures)
    return None if pending is None else (seen.pos, pending)


def _python_check(seen: _Seen, tensors: list) -> bool:
    """True when ``seen``'s table still describes ``tensors`` (its members already checked by
    identity): the rows left out still are, the local tensors are the ones recorded (a stable
    list of DTensors), and every hashed row has its recorded address, byte length and dtype,
    is contiguous and, in a list with complex rows, has no lazy conj/neg bit."""
    for i in seen.holes:
        if tensors[i] is not None:
            return False  # a gradient that was missing is there now
    try:
        if seen.unwrap == 0:
            locs = tensors
        elif seen.unwrap == 1:
            locs = list(map(_LOCAL, tensors))
        else:
            locs = [None if t is None else getattr(t, "_local_tensor", t) for t in tensors]
        if seen.locs is not None and not all(map(is_, seen.locs, locs)):
            return False
        rows = locs if len(seen.idx) == len(locs) else [locs[i] for i in seen.idx]
        if _PTRS_EQUAL is not None:
            if not _PTRS_EQUAL(locs, seen.ptrs, seen.idx):
                return False
        elif list(map(_DATA_PTR, rows)) != seen.row_ptrs:
            return False
        # what the compiled check reads too, row by row (~0.2 us a tensor here): a tensor
        # re-pointed at the same address (``p.data = p.data[:n]``, ``.t()``,
        # ``.view(torch.int32)``; or a gradient of such a parameter, allocated where the old one
        # was) under a table of the old length would be read past its bytes or short of them,
        # under the old dtype keyed and decoded as that, under the old layout as its storage's
        # order; and a gradient is a new tensor at each step, of any layout
        if (list(map(_NBYTES, rows)) != seen.sizes or list(map(_DTYPE, rows)) != seen.row_dtypes
                or not all(map(_IS_CONTIGUOUS, rows))):
            return False
        if seen.lazy_bits and any(t.is_conj() or t.is_neg() for t in rows):
            return False
    except (TypeError, RuntimeError, AttributeError):  # None, no storage, another kind of tensor
        return False
    return True


def _by_row(n: int, idx: list[int], values: list, missing) -> list:
    """``values`` (one per row of ``idx``) laid out over ``n`` rows, ``missing`` elsewhere."""
    out = [missing] * n
    for i, v in zip(idx, values):
        out[i] = v
    return out


def digest_all_cuda(tensors: list, stable: bool = False, owners: list | None = None,
                    figures: bool = False):
    """The fast path of ``hashing.digest_tensors_async``: ``(pos, Pending)`` for a list whose
    tensors are strided, CUDA, on one device and contiguous, rows left out (None) excepted:
    ``pos`` is None when every row is hashed, else the rows that are (a numpy array, in order).
    None when any tensor is not so (the caller takes the general path), when every row is
    None, or when the kernels are not usable.

    The table of an earlier call is reused without looking at more than the addresses when the
    list is ``stable`` (the same tensor objects: the parameter table) or when ``owners`` says
    whose ``.grad`` each tensor is (the same parameters as then): autograd gives a parameter's
    gradient the parameter's shape and dtype, and with unified addressing an address names one
    device, so only contiguity (and, for gradients, which rows have one) is checked again.
    ``figures``: the figures too, in the same pass and transfer (``Pending.figures()``,
    ``Pending.fallback``)."""
    if not usable() or not tensors:
        return None
    members = key = None
    if stable:
        members = tensors
    elif owners is not None and len(owners) == len(tensors):
        members = owners
    if members:
        # looked up by length and end members, then checked member by member: the same objects
        # (held by seen.members, so their ids are still theirs) in the same order. (An identity
        # check costs a third of hashing a tuple of every id: 23 vs 67 us for 1,500 on CPU.)
        # Several lists may share a key: the parameters at a step's entry (buffer rows None)
        # and after it (every row) have the same length and, often, the same ends.
        key = ("same" if stable else "grads of", len(members), id(members[0]), id(members[-1]))
        check = host_native.get() if type(tensors) is list and type(members) is list else None
        for seen in _stable.get(key, ()):
            if check is not None:
                got = _native_reuse(check, seen, tensors, members, figures)
                if got is False:
                    continue
            elif all(map(is_, seen.members, members)):
                got = _reuse(seen, tensors, figures)
            else:
                continue
            if got is not None:
                _stable.move_to_end(key)
                return got
            break
    pos = None
    present = tensors
    if type(None) in set(map(type, tensors)):  # rows left out: the others
        pos = [i for i, t in enumerate(tensors) if t is not None]
        if not pos:
            return None
        present = [tensors[i] for i in pos]
    try:
        locs, unwrap = _locals(present)
        ptrs = list(map(_DATA_PTR, locs))  # RuntimeError for sparse
    except (TypeError, RuntimeError):
        return None
    devs = set(map(_GET_DEVICE, locs))
    if len(devs) != 1 or min(devs) < 0 or not _plain(locs):
        return None
    nbytes, dtypes = list(map(_NBYTES, locs)), list(map(_DTYPE, locs))
    pending = _run(locs, ptrs, figures=figures, nbytes=nbytes, dtypes=dtypes)
    if pending is None:
        return None
    pos_arr = None if pos is None else np.asarray(pos, dtype=np.int64)
    if key is not None and pending.keep:
        n = len(tensors)
        idx = list(range(n)) if pos is None else pos
        holes = [] if stable or pos is None else sorted(set(range(n)) - set(pos))
        if unwrap == 1 and pos is not None:
            unwrap = 2  # the attrgetter reads no None row
        seen = _Seen(list(members), _by_row(n, idx, ptrs, 0), idx, holes, pos_arr, unwrap,
                     pending.keep[-1], _by_row(n, idx, locs, None) if stable and unwrap else None,
                     _by_row(n, idx, nbytes, 0), _by_row(n, idx, dtypes, None))
        same_key = [s for s in _stable.get(key, ()) if not all(map(is_, s.members, members))]
        _stable[key] = [seen, *same_key[:3]]
        _stable.move_to_end(key)
        if len(_stable) > 8:
            _stable.popitem(last=False)
    return pos_arr, pending


def digest_cuda(locs: list[torch.Tensor], figures: bool = False) -> Pending | None:
    """Digests (and with ``figures`` the figures) of local CUDA tensors (any layout: copied
    contiguous where needed), grouped by device; None if the kernels failed (the caller falls
    back to torch ops)."""
    flat = [materialized(t) for t in locs]
    devs = {t.device for t in flat}
    if len(devs) == 1:
        return _run(flat, list(map(_DATA_PTR, flat)), figures=figures)
    return _Grouped([(i, t) for i, t in enumerate(flat)], figures) if devs else None


class _Grouped:
    """Pending digests of tensors on several devices, one launch per device, in list order."""

    def __init__(self, items, figures: bool = False):
        self.n = len(items)
        self.parts = []
        by_dev: dict = {}
        for i, t in items:
            by_dev.setdefault(t.device, []).append((i, t))
        for group in by_dev.values():
            p = _run([t for _, t in group], [_DATA_PTR(t) for _, t in group], figures=figures)
            if p is None:
                raise RuntimeError(_state["failed"] or "kernel failed")
            self.parts.append(([i for i, _ in group], p))
        self.fallback = tuple(sorted(idx[j] for idx, p in self.parts for j in p.fallback))

    def ready(self) -> bool:
        return all(p.ready() for _, p in self.parts)

    def _assemble(self, size: int, get) -> bytes:
        out = [b""] * self.n
        for idx, p in self.parts:
            raw = get(p)
            for j, i in enumerate(idx):
                out[i] = raw[size * j:size * j + size]
        return b"".join(out)

    def result(self) -> bytes:
        return self._assemble(16, Pending.result)

    def figures_bytes(self) -> bytes:
        return self._assemble(24, Pending.figures_bytes)

    def figures(self) -> PendingFigures:
        return PendingFigures(self)


# ------------------------------------------------------------------------------------ for tests
def digest_interpreted(locs: list[torch.Tensor], block: int, iters: int, figures: bool = False):
    """The digests the kernels compute for CPU tensors under ``TRITON_INTERPRET=1`` (tests:
    ``block``/``iters`` tiny so that the interpreter is fast and tensors span many rows). With
    ``figures``: (digests, figures bytes, the fallback slots)."""
    flat = [materialized(t) for t in locs]
    plan = _build(list(map(_DATA_PTR, flat)), list(map(_NBYTES, flat)),
                  list(map(_DTYPE, flat)), flat[0].device, block * iters)
    p = _launch(plan, block, iters, figures)
    return (p.result(), p.figures_bytes(), p.fallback) if figures else p.result()


def device_lanes(locs: list[torch.Tensor], block: int = BLOCK,
                 iters: int = ITERS) -> list[list[int]]:
    """The four lanes of each tensor from the lanes kernel alone (waits; for tests and the
    reference comparison on CUDA or under the interpreter)."""
    flat = [materialized(t) for t in locs]
    plan = _build(list(map(_DATA_PTR, flat)), list(map(_NBYTES, flat)),
                  list(map(_DTYPE, flat)), flat[0].device, block * iters)
    lanes = torch.zeros(max(plan.n, 1), 4, dtype=torch.int64, device=plan.device)
    if plan.rows:
        _kernels().digest_lanes[(plan.rows,)](plan.table, lanes, lanes, BLOCK=block, ITERS=iters,
                                              B_MULT=B_MULT, FIGURES=False)
    return [[v & _M64 for v in row] for row in lanes[:plan.n].cpu().tolist()]
