"""The asynchronous half of capture's writing (writing.py ``_write``/``_resolve``, hashing
``Digests``) with CPU stand-ins for device results: a recorded step is written only once its
digests are on the host, steps are written in step order, an older step is waited for at the
next step's end, and everything is written at close."""

import numpy as np
import torch

from parity.artifacts import NO_HASH
from parity.capture import hashing
from parity.capture.hashing import Digests, digest_tensors_async
from parity.capture.writing import RankRecord, _InFlight


class FakePending:
    """A device result whose event completes when the test says so (or when waited for)."""

    def __init__(self, raw: bytes, log: list, name: str):
        self.raw, self.done, self.log, self.name = raw, False, log, name

    def ready(self) -> bool:
        return self.done

    def result(self) -> bytes:
        if not self.done:
            self.log.append(f"waited {self.name}")
            self.done = True
        return self.raw


class FakeWriter:
    def __init__(self):
        self.steps = []

    def write_step(self, step, params, grads, loss, loss_hash, param_figures=None,
                   grad_figures=None, **extra):  # figures (issue 34): None for Digests without them
        self.steps.append((step, params, grads, loss))
        self.extra = getattr(self, "extra", []) + [extra]


class Recorder(RankRecord):
    """Just the state _resolve reads."""

    def __init__(self):
        import collections

        self._inflight = collections.deque()
        self.writer = FakeWriter()

    def _ensure_writer(self):
        return self.writer


def _d(i: int) -> bytes:
    return bytes([i]) * 16


def test_steps_are_written_in_order_once_their_digests_are_on_the_host():
    log: list = []
    rec = Recorder()
    p1, p2 = FakePending(_d(1), log, "step 1"), FakePending(_d(2), log, "step 2")
    rec._inflight.append(_InFlight(1, 1, Digests(1, [], [(None, p1)]), None, (1.0, "h")))
    rec._resolve(before=1)  # the step being written stays queued: nothing waits
    assert rec.writer.steps == [] and log == []
    rec._inflight.append(_InFlight(2, 1, Digests(1, [], [(None, p2)]), None, (2.0, "h")))
    p2.done = True  # step 2 is ready first, but step 1 comes first in the file
    rec._resolve(before=2)  # step 2's end: step 1 is waited for, step 2 is written too
    assert log == ["waited step 1"]
    assert [s[0] for s in rec.writer.steps] == [1, 2]
    assert rec.writer.steps[0][1] == _d(1) and rec.writer.steps[1][1] == _d(2)


def test_close_writes_every_queued_step():
    log: list = []
    rec = Recorder()
    for k in (3, 4, 5):
        p = FakePending(_d(k), log, f"step {k}")
        rec._inflight.append(_InFlight(k, 1, Digests(1, [], [(None, p)]), None, (None, None)))
    rec._resolve()
    assert [s[0] for s in rec.writer.steps] == [3, 4, 5] and len(log) == 3


def test_grad_line_assembles_parts_in_table_order_later_parts_win():
    log: list = []
    a = Digests(2, [], [(None, FakePending(_d(7) + _d(8), log, "a"))])  # rows [2, 0]
    b = Digests(1, [(None, _d(9))], [])  # row 1
    c = Digests(1, [(None, _d(5))], [])  # row 0 again (a closure re-noted it)
    f = _InFlight(1, 3, Digests(0, [(None, b"")], []), [([2, 0], a), ([1], b), ([0], c)],
                  (None, None))
    assert f.grad_line() == _d(5) + _d(9) + _d(7)
    # a part of every row (an int n: rows 0..n-1) makes the earlier parts irrelevant
    whole = Digests(3, [(None, _d(1) + _d(2) + _d(3))], [])
    g = _InFlight(1, 3, whole, [([2, 0], a), (3, whole)], (None, None))
    assert g.grad_line() == _d(1) + _d(2) + _d(3)
    # a part noted when the table was shorter (an optimizer that joined later adds rows)
    h = _InFlight(1, 3, whole, [(2, Digests(2, [(None, _d(1) + _d(2))], [])),
                                ([2], Digests(1, [(None, _d(4))], []))], (None, None))
    assert h.grad_line() == _d(1) + _d(2) + _d(4)


def test_digests_mix_known_missing_and_pending_parts(monkeypatch):
    """digest_tensors_async: None is NO_HASH, CPU tensors are hashed now, and a device part
    stays pending until asked for."""
    from parity.capture import hashing_triton

    log: list = []
    pending = FakePending(_d(42), log, "device")
    monkeypatch.setattr(hashing_triton, "usable", lambda: True)
    monkeypatch.setattr(hashing_triton, "digest_all_cuda",
                        lambda t, stable, owners, figures=False: (None, pending))
    d = digest_tensors_async([torch.zeros(2)], "auto")
    assert not d.ready() and d.result() == _d(42) and log == ["waited device"]
    monkeypatch.setattr(hashing_triton, "digest_all_cuda",
                        lambda t, stable, owners, figures=False: None)
    a, b = torch.randn(3), torch.randn(4)
    got = digest_tensors_async([a, None, b], "device")
    assert got.ready()
    assert got.result() == hashing.device_digest(a) + NO_HASH + hashing.device_digest(b)
    assert np.frombuffer(got.result(), np.uint8).reshape(-1, 16).shape == (3, 16)


def test_an_entry_record_is_written_only_when_the_parameters_changed_between_steps():
    """Issue 32: step k's entry digests are queued with it and compared, when it is written,
    with step k-1's record (buffer rows left out); equal: no entry record."""
    rec = Recorder()
    p1 = _d(1) + _d(9)  # row 0 a parameter, row 1 a buffer
    rec._inflight.append(_InFlight(1, 2, Digests(2, [(None, p1)], []), None, (1.0, "h")))
    same = (Digests(2, [(None, _d(1) + NO_HASH)], []), [1])  # the buffer changed: not an edit
    rec._inflight.append(_InFlight(2, 2, Digests(2, [(None, _d(2) + _d(8))], []), None,
                                   (1.0, "h"), entry=same))
    edited = (Digests(2, [(None, _d(7) + NO_HASH)], []), [1])  # the parameter changed
    rec._inflight.append(_InFlight(3, 2, Digests(2, [(None, _d(3) + _d(8))], []), None,
                                   (1.0, "h"), entry=edited, skipped="inf"))
    rec._resolve()
    assert [x.get("entry_hashes") for x in rec.writer.extra] == [None, None, _d(7) + NO_HASH]
    assert [x.get("skipped") for x in rec.writer.extra] == [None, None, "inf"]
