"""The agreement figure of a topology file written by ``parity nccl-probe``.

Why: a topology file rebuilt from one cluster's logs is only as good as the model's agreement
with that cluster's bits. Every prediction (``parity diff --at FILE``) and emulation
(``--emulate-nccl FILE``) that uses the file therefore names it and its figure, read here from
the file's ``probe`` section (written by parity.probe.analysis next to the topology,
``save_topology(..., extra={"probe": ...})``)::

    {"format": "parity-nccl-topology/1", "topology": {...},
     "probe": {"agreement": {"cases": 96, "modelled": 96, "agree": 96, "differ": 0,
                             "not_modelled": 0, "percent": 100.0, ...},
               "summary": "agreement 100.0%: 96 of 96 modelled cases bit-identical, ...",
               "first_disagreement": null, "backend": "nccl", "nccl": "2.21.5", ...}}

A topology file without that section (written by hand, or by ``save_topology`` alone) has no
figure: said as "agreement not measured". Standard library only.
"""

from __future__ import annotations

import functools
import json
import os

PROBE_KEY = "probe"
NOT_MEASURED = "agreement not measured (not written by parity nccl-probe)"


def is_file_topology(topo) -> bool:
    """Whether a Topology came from a topology file (``parse_topology`` of a .json path)."""
    src = getattr(topo, "source", None)
    return bool(src) and str(src).endswith(".json")


@functools.lru_cache(maxsize=32)
def _read(path: str, mtime: float) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    probe = data.get(PROBE_KEY) if isinstance(data, dict) else None
    return probe if isinstance(probe, dict) else None


def probe_section(path: str | os.PathLike) -> dict | None:
    """The ``probe`` section of a topology file, or None (none, or unreadable)."""
    p = os.fspath(path)
    try:
        mtime = os.stat(p).st_mtime
    except OSError:
        return None
    return _read(p, mtime)


def agreement_text(probe: dict | None) -> str:
    """'agreement 100.0%: 96 of 96 modelled cases bit-identical (NCCL 2.21.5, 2x8)' or the
    not-measured phrase."""
    if not isinstance(probe, dict):
        return NOT_MEASURED
    summary = probe.get("summary")
    if isinstance(summary, str) and summary:
        return summary
    a = probe.get("agreement") or {}
    pct = a.get("percent")
    figure = "no modelled case" if pct is None else f"{pct:.1f}%"
    return (f"agreement {figure}: {a.get('agree', 0)} of {a.get('modelled', 0)} modelled cases "
            f"bit-identical, {a.get('not_modelled', 0)} not modelled")


def describe_file(topo) -> dict | None:
    """``{"path", "agreement", "summary"}`` for a topology that came from a file (None for one
    given as text): what JSON reports carry as ``topology_file``."""
    if not is_file_topology(topo):
        return None
    return describe_path(topo.source)


def describe_path(path: str | os.PathLike) -> dict:
    """``describe_file`` for a topology file's path."""
    probe = probe_section(path)
    return {"path": str(path), "agreement": (probe or {}).get("agreement"),
            "summary": agreement_text(probe)}


def file_line(topo) -> str | None:
    """'topology file probe/topology.json: agreement 100.0%: ...' (None: not from a file)."""
    d = describe_file(topo)
    return None if d is None else f"topology file {d['path']}: {d['summary']}"


def short_figure(info: dict | None) -> str:
    """'nccl-probe agreement 100.0%' (or '... not measured') from ``describe_file``'s dict."""
    a = (info or {}).get("agreement") if isinstance(info, dict) else None
    if not isinstance(a, dict):
        return "agreement not measured"
    pct = a.get("percent")
    return ("nccl-probe agreement n/a (no modelled case)" if pct is None
            else f"nccl-probe agreement {pct:.1f}%")


def topology_label(spec: str | None, info: dict | None) -> str:
    """How a report names the topology it predicted or emulated at: the spec, and for a
    topology file its agreement figure ('probe/topology.json [nccl-probe agreement 100.0%]').
    ``info``: what the JSON recorded (``describe_file``); without it a spec that is a .json
    path is read now."""
    if not isinstance(info, dict):
        if not (spec and str(spec).endswith(".json")):
            return spec or "?"
        info = describe_path(spec)
    return f"{info.get('path') or spec} [{short_figure(info)}]"
