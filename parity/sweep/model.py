"""Typed records of a sweep: one side's job, one cell, the sweep report (docs/sweep.md).

The runner builds them, state.py writes them (cell.json, sweep.json) and reads them back, and
the reports read them typed (``state.load_report`` or ``as_report``). Their JSON is the
JSON of schema version 1 exactly: ``to_dict`` writes the keys that were set, in the order of the
fields (a side still running has no exit code; a skipped cell has no sides), and ``from_dict``
keeps keys it does not know in ``extra``, written back after the known ones, so a file written
by another parity version survives a read-write round trip. Field meanings: docs/sweep.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


class _Unset:
    """A field that was not set: ``to_dict`` leaves its key out."""

    _it = None

    def __new__(cls):
        if cls._it is None:
            cls._it = super().__new__(cls)
        return cls._it

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


def got(value, default=None):
    """``value``, or ``default`` when the field was not set (what ``dict.get(key, default)``
    gave the reports when they read sweep.json as dicts)."""
    return default if value is UNSET else value


def _local(f) -> bool:
    """A field that is not part of the JSON (where the record was read from)."""
    return f.name == "extra" or bool(f.metadata.get("local"))


def _plain(x):
    return x.to_dict() if isinstance(x, _Record) else x


class _Record:
    """to_dict / from_dict for the dataclasses below. ``_nested`` names the fields holding other
    records (a dict of them, or a list of them)."""

    _nested: ClassVar[dict[str, tuple[str, type]]] = {}

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            if _local(f):
                continue
            v = getattr(self, f.name)
            if v is UNSET:
                continue
            shape = self._nested.get(f.name)
            if shape and v is not None:
                kind, _ = shape
                v = ({k: _plain(x) for k, x in v.items()} if kind == "dict"
                     else [_plain(x) for x in v])
            out[f.name] = v
        for k, v in self.extra.items():  # type: ignore[attr-defined]
            out.setdefault(k, v)
        return out

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls) if not _local(f)}  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        for k in known & d.keys():
            v = d[k]
            shape = cls._nested.get(k)
            if shape and isinstance(v, (dict, list)):
                kind, rec = shape
                if kind == "dict" and isinstance(v, dict):
                    v = {n: rec.from_dict(x) if isinstance(x, dict) else x for n, x in v.items()}
                elif kind == "list" and isinstance(v, list):
                    v = [rec.from_dict(x) if isinstance(x, dict) else x for x in v]
            kw[k] = v
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})


@dataclass
class SideResult(_Record):
    """One side (reference or candidate) of a cell: its job and what became of it.
    ``status``: running | ok | stopped | failed | timeout | cancelled | not_found | not_run
    (``stopped``: ended by ``stop_after_divergence`` after the cell diverged; its steps count)."""

    status: str = UNSET
    label: str | None = UNSET
    exit_code: int | None = UNSET
    reason: str = UNSET
    started: float | None = UNSET
    ended: float | None = UNSET
    wall: float | None = UNSET
    command: list[str] | None = UNSET
    run_dir: str | None = UNSET  # paths relative to the sweep directory
    log_dir: str | None = UNSET
    console_log: str | None = UNSET
    rank_logs: list[dict] = UNSET  # {rank, stdout, stderr, error, ...} per rank
    steps_recorded: int = UNSET  # lines of rank 0's steps.jsonl
    leftovers_killed: int = UNSET
    reused: bool = UNSET  # kept from an earlier run by --resume
    # the cell whose folder holds this job, when cells share one reference job (issue 23)
    shared_from: str | None = UNSET
    extra: dict = field(default_factory=dict)


@dataclass
class CellResult(_Record):
    """One cell: its state in cell.json (``v``, ``fingerprint``, ``updated``, ``resumed`` set)
    or its public form in sweep.json (``wall`` set instead). The status is decided by
    parity.policy (``cell_status``, ``settled_cell``)."""

    v: int = UNSET
    id: str = UNSET
    axes: dict = UNSET
    status: str = UNSET
    reason: str | None = UNSET
    fingerprint: dict | None = UNSET
    requires: list[str] | None = UNSET
    started: float | None = UNSET
    ended: float | None = UNSET
    sides: dict[str, SideResult] = UNSET
    diff: dict | None = UNSET  # the cell's DiffResult.to_dict(), or None
    diff_json: str | None = UNSET
    wall: float | None = UNSET
    resumed: bool = UNSET
    updated: float = UNSET
    # issue 23: the determinism control's verdict on this cell's reference (control.py), the
    # cells sharing this cell's reference job, and the early stop (early_stop.py)
    control: dict | None = UNSET
    shares_reference_with: list[str] | None = UNSET
    early_stop: dict | None = UNSET
    extra: dict = field(default_factory=dict)

    _nested: ClassVar[dict] = {"sides": ("dict", SideResult)}


@dataclass
class SweepReport(_Record):
    """sweep.json: the spec's shape, this invocation's timing, and every cell's public form."""

    v: int = UNSET
    kind: str = UNSET  # "parity-sweep"
    name: str = UNSET
    description: str | None = UNSET
    spec: str | None = UNSET
    spec_source: str | None = UNSET
    launcher: str | None = UNSET
    steps: int | None = UNSET
    seed: int | None = UNSET
    nnodes: int = UNSET
    nproc_per_node: int = UNSET
    only: str | None = UNSET
    fail_on: str | None = UNSET
    axes: list[dict] = UNSET  # [{name, values}] in the spec's order
    sides: dict = UNSET  # {reference: {label}, candidate: {label}}
    started: float | None = UNSET
    ended: float | None = UNSET
    wall: float | None = UNSET
    timing: dict | None = UNSET
    complete: bool = UNSET
    counts: dict = UNSET
    cells: list[CellResult] = UNSET
    extra: dict = field(default_factory=dict)
    # the directory sweep.json was read from (its recorded paths are relative to it); not JSON
    dir: str | None = field(default=None, compare=False, metadata={"local": True})
    # sweep.json as read, key order and all (``parity report --format json`` reprints it); not JSON
    source: dict | None = field(default=None, compare=False, repr=False,
                                metadata={"local": True})

    _nested: ClassVar[dict] = {"cells": ("list", CellResult)}

    def is_complete(self) -> bool:
        """False when the sweep did not finish; a report without ``complete`` counts as finished."""
        return bool(got(self.complete, True))


def as_report(sweep) -> SweepReport:
    """A sweep report typed: ``sweep`` itself, or a sweep.json dict (as ``load_sweep`` returns
    it: its ``_dir`` becomes ``dir``; other ``_`` keys are in-memory only and dropped)."""
    if isinstance(sweep, SweepReport):
        return sweep
    public = {k: v for k, v in sweep.items() if not k.startswith("_")}
    report = SweepReport.from_dict(public)
    report.dir, report.source = sweep.get("_dir"), public
    return report
