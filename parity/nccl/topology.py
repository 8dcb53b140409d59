"""Where a reduction is imagined to run: nodes, GPUs, NICs, NCCL release, and what a log showed.

The text form (``--at``, a sweep's ``at``, ``--emulate-nccl``)::

    NODESxGPUS[:channels=C,nics=N,proto=P,nccl=X.Y,algo=Ring]

* ``channels=C``: the communicator's channel count (``comm->nChannels``, as a log's
  ``Channel 00/C`` or ``C coll channels`` states it); every collective is still cut down for
  its size as NCCL does. Default: an assumption per NIC count (``parity.nccl.rings``).
* ``nics=N``: NICs (rails) per node; default one per GPU.
* ``proto=Simple|LL|LL128``: pin the protocol (as ``NCCL_PROTO`` would); default every protocol
  NCCL may choose.
* ``nccl=X.Y[.Z]``: the rules of that release (``parity.nccl.versions``); default the run's
  fingerprint's, else the newest modelled.
* ``algo=Ring``: the run pinned Ring (``NCCL_ALGO=Ring``); without it, an all-reduce (which
  NCCL may run as Tree) and the cases where PAT or NVLS may run are ``unknown``.

A path ending in ``.json`` is a topology file (``parity nccl-probe`` writes one): it is loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parity.errors import ParityError
from parity.nccl.channels import PROTOCOLS
from parity.nccl.versions import NEWEST, OLDEST, parse_version

MAX_CHANNELS = 64  # the largest MAXCHANNELS of any modelled release
TOPOLOGY_FORMAT = "parity-nccl-topology/1"
_TOPO_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(.*))?$")
_KEYS = "channels=C, nics=N, proto=Simple|LL|LL128, nccl=X.Y, algo=Ring"


@dataclass(frozen=True)
class TuningRow:
    """One ``NCCL_DEBUG_SUBSYS=TUNING`` line: what NCCL chose for one collective call.

    Attributes:
        collective: "reduce_scatter", "all_reduce", "all_gather", "broadcast", "reduce".
        nbytes: the bytes the line prints.
        per_rank: True when ``nbytes`` is per rank (2.24+ ReduceScatter/AllGather rows:
            ``task->count * typeSize``); False when it is the whole input (older formats, and
            every all-reduce row).
        algorithm: "RING", "TREE", "PAT", "NVLS", "NVLS_TREE", "COLLNET_DIRECT",
            "COLLNET_CHAIN"; None when the (2.20-2.22) row names no collective.
        protocol: "Simple" | "LL" | "LL128".
        channel_lo, channel_hi: the channels it ran on (2.24+), else None. Channels *used*,
            never the communicator's count.
        fmt: "2.20" | "2.23" | "2.24": which format the line had.
        line: its line number in the log.
    """

    collective: str | None
    nbytes: int
    per_rank: bool
    algorithm: str
    protocol: str
    channel_lo: int | None = None
    channel_hi: int | None = None
    fmt: str = "2.24"
    line: int = 0

    def matches(self, kind: str, count: int, elem_size: int, nranks: int) -> bool:
        """Whether this row is a ``kind`` call of ``count`` elements (per rank for a
        reduce-scatter) of ``elem_size`` bytes."""
        if self.collective is not None and self.collective != kind:
            return False
        per_rank_bytes = count * elem_size
        if kind == "reduce_scatter" and not self.per_rank:
            return self.nbytes == per_rank_bytes * nranks
        return self.nbytes == per_rank_bytes


@dataclass(frozen=True)
class Topology:
    """Where the reduction runs (see the module docstring for the text form).

    Attributes:
        nodes, gpus: nodes and ranks per node; rank = node * gpus + local rank.
        channels: the communicator's channel count, or None (an assumption per NIC count).
        protocol: a pinned protocol, or None (every protocol NCCL may choose).
        rings: channel -> ring (a permutation of the ranks) for every channel of the
            communicator, rebuilt from a log or read from a topology file; None = model.
        tuning: TUNING rows of a log (a call of exactly that size runs as the row says).
        nics: NICs per node, or None (one per GPU).
        nccl: the NCCL release whose rules apply, or None (fingerprint, else newest).
        algorithm: "Ring" when the run pinned Ring, else None.
        ring_prefixes: channel -> the first ranks of its ring, from a log whose ring lines
            NCCL cut: rings are then taken from the families these prefixes agree with.
        source: the file this came from (a log or topology.json), or None.
    """

    nodes: int
    gpus: int
    channels: int | None = None
    protocol: str | None = None
    rings: tuple[tuple[int, ...], ...] | None = None
    tuning: tuple[TuningRow, ...] | None = None
    nics: int | None = None
    nccl: str | None = None
    algorithm: str | None = None
    ring_prefixes: tuple[tuple[int, ...], ...] | None = field(default=None, compare=True)
    source: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def spec(self) -> str:
        """The canonical text form. A topology file's spec is its path (``parse_topology``
        loads it back); a log's carries ``rings=log`` / ``tuning=log`` for display only."""
        if self.source and self.source.endswith(".json"):
            return self.source
        text = f"{self.nodes}x{self.gpus}"
        opts = []
        if self.channels is not None:
            opts.append(f"channels={self.channels}")
        if self.nics is not None:
            opts.append(f"nics={self.nics}")
        if self.protocol is not None:
            opts.append(f"proto={self.protocol}")
        if self.nccl is not None:
            opts.append(f"nccl={self.nccl}")
        if self.algorithm is not None:
            opts.append(f"algo={self.algorithm}")
        if self.rings is not None or self.ring_prefixes is not None:
            opts.append("rings=log")
        if self.tuning:
            opts.append("tuning=log")
        return text + (":" + ",".join(opts) if opts else "")

    def to_dict(self) -> dict:
        out = {"nodes": self.nodes, "gpus": self.gpus, "world": self.world,
               "channels": self.channels, "protocol": self.protocol, "nics": self.nics,
               "nccl": self.nccl, "algorithm": self.algorithm, "spec": self.spec()}
        if self.rings is not None:
            out["rings"] = [list(r) for r in self.rings]
        if self.ring_prefixes is not None:
            out["ring_prefixes"] = [list(r) for r in self.ring_prefixes]
        if self.tuning:
            out["tuning"] = [asdict(t) for t in self.tuning]
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        def rings_of(key):
            v = data.get(key)
            return tuple(tuple(int(x) for x in r) for r in v) if v else None

        tuning = None
        if data.get("tuning"):
            tuning = tuple(TuningRow(**t) if isinstance(t, dict) else _old_row(t)
                           for t in data["tuning"])
        topo = cls(int(data["nodes"]), int(data["gpus"]), _opt_int(data.get("channels")),
                   data.get("protocol"), rings_of("rings"), tuning, _opt_int(data.get("nics")),
                   data.get("nccl"), data.get("algorithm"), rings_of("ring_prefixes"),
                   data.get("source"))
        return validate(topo, f"topology {data.get('spec', '')!r}")


def _opt_int(v):
    return None if v is None else int(v)


def _old_row(t) -> TuningRow:
    """A tuning entry written by parity.nccl_log before the package (collective, total bytes,
    algorithm, protocol, channels)."""
    coll, nbytes, algo, proto, _ = t
    return TuningRow(str(coll), int(nbytes), False, str(algo), str(proto), fmt="old")


def validate(topo: Topology, what: str) -> Topology:
    """Range checks shared by the text form, topology files and logs; ParityError (exit 2)."""
    if topo.nodes < 1 or topo.gpus < 1:
        raise ParityError(f"{what}: nodes and GPUs per node must be at least 1")
    if topo.channels is not None and not 1 <= topo.channels <= MAX_CHANNELS:
        raise ParityError(f"{what}: channels must be 1..{MAX_CHANNELS}")
    if topo.nics is not None and not 1 <= topo.nics <= max(64, topo.gpus):
        raise ParityError(f"{what}: nics must be 1..{max(64, topo.gpus)}")
    if topo.protocol is not None and topo.protocol not in PROTOCOLS:
        raise ParityError(f"{what}: proto must be Simple, LL or LL128")
    if topo.nccl is not None and parse_version(topo.nccl) is None:
        raise ParityError(f"{what}: nccl must be a version like {NEWEST} or {OLDEST}.5")
    if topo.algorithm is not None and topo.algorithm != "Ring":
        raise ParityError(f"{what}: algo must be Ring (other algorithms are not modelled)")
    w = topo.world
    for name, rings in (("rings", topo.rings), ("ring_prefixes", topo.ring_prefixes)):
        for c, ring in enumerate(rings or ()):
            full = name == "rings"
            if (full and sorted(ring) != list(range(w))) or (
                    not full and (len(set(ring)) != len(ring) or any(not 0 <= r < w for r in ring))):
                raise ParityError(f"{what}: channel {c}'s ring is not a permutation of the "
                                  f"{w} ranks")
    return topo


def parse_topology(text: str) -> Topology:
    """``NODESxGPUS[:channels=C,nics=N,proto=P,nccl=X.Y,algo=Ring]`` (or a topology.json path)
    -> Topology; a one-line ParityError (exit 2) otherwise."""
    text = str(text)
    if text.strip().endswith(".json"):
        return load_topology(text.strip())
    m = _TOPO_RE.match(text)
    if not m:
        raise ParityError(f"topology {text!r}: expected NODESxGPUS[:{_KEYS}], e.g. 8x8 or "
                          "32x8:channels=16,nccl=2.27, or a topology.json file")
    nodes, gpus = int(m.group(1)), int(m.group(2))
    kw: dict = {}
    names = {p.lower(): p for p in PROTOCOLS}
    for opt in filter(None, (o.strip() for o in (m.group(3) or "").split(","))):
        key, _, value = opt.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key in ("channels", "nics"):
            if not value.isdigit():
                raise ParityError(f"topology {text!r}: {key} must be a positive integer")
            kw[key] = int(value)
        elif key in ("proto", "protocol"):
            if value.lower() not in names:
                raise ParityError(f"topology {text!r}: proto must be Simple, LL or LL128")
            kw["protocol"] = names[value.lower()]
        elif key == "nccl":
            kw["nccl"] = value
        elif key in ("algo", "algorithm"):
            if value.lower() != "ring":
                raise ParityError(f"topology {text!r}: algo must be Ring (other algorithms are "
                                  "not modelled)")
            kw["algorithm"] = "Ring"
        else:
            raise ParityError(f"topology {text!r}: unknown option {key!r} ({_KEYS})")
    return validate(Topology(nodes, gpus, **kw), f"topology {text!r}")


def load_topology(path: str | os.PathLike) -> Topology:
    """A topology file: ``{"format": "parity-nccl-topology/1", "topology": {...}, ...}`` or a
    bare ``Topology.to_dict()``. Its ``source`` is the path."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ParityError(f"topology file {path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ParityError(f"topology file {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ParityError(f"topology file {path}: not a JSON object")
    body = data.get("topology", data)
    if not isinstance(body, dict) or "nodes" not in body or "gpus" not in body:
        raise ParityError(f"topology file {path}: no topology (nodes, gpus)")
    try:
        topo = Topology.from_dict({**body, "spec": str(path)})
    except (TypeError, ValueError, KeyError) as e:
        raise ParityError(f"topology file {path}: malformed topology ({e})") from None
    from dataclasses import replace

    return replace(topo, source=str(path))


def save_topology(topo: Topology, path: str | os.PathLike, extra: dict | None = None) -> None:
    """Write a topology file atomically (``load_topology`` reads it back). ``extra``: more
    top-level keys (the probe's agreement figures)."""
    from dataclasses import replace

    p = Path(path)
    body = replace(topo, source=None).to_dict()
    doc = {"format": TOPOLOGY_FORMAT, "topology": body, **(extra or {})}
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, p)
