"""The public API: every way NCCL may sum one collective, or ``unknown`` with the reason.

``predict(topology, kind, count, elem_size, ...)`` returns a :class:`Prediction` whose
``scenarios`` are every (protocol, communicator channel count, ring family) NCCL may run the
collective with, each with its channel ranges and, per element range, the order in which the
ranks' values are summed; or an :class:`Unknown` when Ring is not certain (PAT, NVLS, Tree for
an all-reduce, CollNet/SHARP, a tuner plug-in, ``NCCL_ALGO`` without Ring, a release outside
2.20-2.30, or a log that shows another algorithm). A consumer that reports ``differs`` when any
scenario differs reports a superset of what the cluster does, as far as the rules and the named
assumptions hold (``MODEL_LIMITS``).

Rules: :mod:`parity.nccl.versions` (per release), :mod:`parity.nccl.channels` (cut and split),
:mod:`parity.nccl.chunking` (all-reduce chunks and owners), :mod:`parity.nccl.rings` (rings and
channel counts), :mod:`parity.nccl.logs` (what a log pins).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from parity.errors import ParityError
from parity.nccl.channels import (ALL_REDUCE, LL, LL128, PROTOCOLS, REDUCE_SCATTER, SIMPLE, Task,
                                  channel_cut, input_bytes, max_threads, plan_split,
                                  thread_count, traffic_per_byte)
from parity.nccl.chunking import all_reduce_chunks
from parity.nccl.rings import (RingFamily, agrees, apply_channel_env, canonical_order,
                               channel_options, dedupe_families, extrapolate,
                               plausible_families, same_sum, search_channels, sum_order)
from parity.nccl.topology import Topology, TuningRow, parse_topology
from parity.nccl.versions import NEWEST, OLDEST, SPLIT_EVEN, Rules, rules_for

MODEL = "nccl-ring/2"
MODEL_LIMITS = (
    f"NCCL {OLDEST}-{NEWEST} Ring only (PAT, NVLS, Tree, CollNet: unknown where they may run); "
    "every protocol NCCL may choose unless pinned; rings without a log: NVSwitch descending "
    "from the NIC's GPU (with and without the odd-node swap) or PCIe ascending; channels "
    "without a log: 2 or 4 per NIC, 24 on one node; grouped calls only as given (one kernel "
    "plan, one protocol); tuner plug-ins, symmetric-memory kernels and registered NVLS buffers "
    "not modelled")

# ncclFuncStr / ncclAlgoStr (src/init.cc): NCCL_ALGO / NCCL_PROTO tokens
_FUNC_STR = {REDUCE_SCATTER: "ReduceScatter", ALL_REDUCE: "AllReduce"}
_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
SUM_OPS = ("sum",)
_OPS = ("sum", "avg", "premul_sum", "max", "min", "prod")


@dataclass(frozen=True)
class Segment:
    """A contiguous range of a collective's elements and the order their values are summed in.

    Attributes:
        lo, hi: element range [lo, hi); per-rank offsets for a reduce-scatter (the same for
            every owner), buffer offsets for an all-reduce.
        channel: the NCCL channel that reduces it.
        owner: all-reduce: the rank that finishes the chunk (``ring->index`` rule); None for a
            reduce-scatter, where every rank owns its own row.
        order: all-reduce: the rank order of the additions; reduce-scatter: the channel's ring
            (rank d's order is ``sum_order(order, d)``).
    """

    lo: int
    hi: int
    channel: int
    owner: int | None
    order: tuple[int, ...]


@dataclass(frozen=True)
class Scenario:
    """One way NCCL may run the collective.

    Attributes:
        protocol: "Simple" | "LL" | "LL128".
        comm_channels: the communicator's channel count assumed (or stated by a log).
        nchannels: channels this collective uses (after the cut and the split).
        family: the ring family ("log", "file", "one-node", "nvswitch-descending", ...); names
            joined by "+" when several give the same ranges and rings.
        rings: ring per channel id, for every channel up to the last one used.
        segments: the element ranges with their channel and order.
        assumptions: every assumption this scenario rests on, in words.
    """

    protocol: str
    comm_channels: int
    nchannels: int
    family: str
    rings: tuple[tuple[int, ...], ...]
    segments: tuple[Segment, ...]
    assumptions: tuple[str, ...]

    def __repr__(self) -> str:
        return (f"Scenario({self.protocol}, comm_channels={self.comm_channels}, "
                f"nchannels={self.nchannels}, family={self.family!r}, "
                f"ranges={self.ranges()[:4]}{'...' if self.nchannels > 4 else ''})")

    def ranges(self) -> list[tuple[int, int, int]]:
        """(channel, lo, hi) per used channel (all-reduce: the channel's whole range)."""
        out: dict[int, list[int]] = {}
        for s in self.segments:
            r = out.setdefault(s.channel, [s.lo, s.hi])
            r[0], r[1] = min(r[0], s.lo), max(r[1], s.hi)
        return [(c, lo, hi) for c, (lo, hi) in sorted(out.items())]

    def to_dict(self) -> dict:
        return {"protocol": self.protocol, "comm_channels": self.comm_channels,
                "nchannels": self.nchannels, "family": self.family,
                "ranges": [list(r) for r in self.ranges()],
                "assumptions": list(self.assumptions)}


@dataclass(frozen=True)
class Prediction:
    """Every scenario NCCL may run one collective with (union = a superset of the cluster).

    Attributes:
        topology, kind, count, elem_size: what was asked (count per rank for a reduce-scatter).
        rules: the rule family, e.g. "2.23-2.28"; version: the release used and where from.
        scenarios: every plausible scenario (empty for an empty collective or one rank).
        pinned: what pinned the protocol ("proto=", "NCCL_PROTO", "log row"), or None.
        notes: anything the caller should say (a log row that matched, a channel range the
            log showed that no scenario reproduces, ...).
    """

    topology: Topology
    kind: str
    count: int
    elem_size: int
    rules: str
    version: str
    scenarios: tuple[Scenario, ...]
    pinned: str | None = None
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"Prediction({self.kind}, count={self.count}, elem_size={self.elem_size}, "
                f"at {self.topology.spec()}, NCCL {self.version}, {len(self.scenarios)} "
                f"scenario(s): {list(self.scenarios)})")

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.protocol for s in self.scenarios))

    @property
    def bytes_per_rank(self) -> int:
        return self.count * self.elem_size

    @property
    def model(self) -> str:
        return f"{MODEL} (NCCL {self.version}; split {self.rules})"

    def to_dict(self) -> dict:
        return {"verdict": None, "kind": self.kind, "count": self.count,
                "elem_size": self.elem_size, "bytes_per_rank": self.bytes_per_rank,
                "topology": self.topology.spec(), "model": self.model, "rules": self.rules,
                "version": self.version, "pinned": self.pinned,
                "protocols": list(self.protocols),
                "scenarios": [s.to_dict() for s in self.scenarios], "notes": list(self.notes)}


@dataclass(frozen=True)
class Unknown:
    """Ring is not certain here: never report "same" for it.

    Attributes:
        reason: one line, e.g. "PAT may run: 1 GPU per node, SUM, NCCL >= 2.23".
        cause: "version" | "pat" | "nvls" | "collnet" | "tree" | "tuner" | "algorithm" | "env"
            | "log".
    """

    reason: str
    cause: str

    def to_dict(self) -> dict:
        return {"verdict": "unknown", "reason": self.reason, "cause": self.cause}


def parse_list(text: str, func: str, elems: Sequence[str]) -> set[str] | None:
    """Which of ``elems`` an ``NCCL_ALGO``/``NCCL_PROTO`` value enables for ``func``
    (``parseList`` in ``src/graph/tuning.cc``: ``a,b``, ``^a``, ``x,y;allreduce:z``; prefixes
    from 2.24); None if the value does not parse (NCCL refuses it)."""
    enabled = set(elems)
    for i, token in enumerate(t for t in str(text).split(";") if t):
        prefix, sep, rest = token.partition(":")
        if not sep:
            if i:
                return None
            prefix, rest = None, token
        if prefix is not None:
            if prefix.strip().lower() not in {f.lower() for f in _FUNCS}:
                return None
            if prefix.strip().lower() != func.lower():
                continue
        rest = rest.strip()
        negate = rest.startswith("^")
        names = [n.strip() for n in rest.lstrip("^").split(",") if n.strip()]
        lower = {e.lower(): e for e in elems}
        if any(n.lower() not in lower for n in names):
            return None
        chosen = {lower[n.lower()] for n in names}
        enabled = (set(elems) - chosen) if negate else chosen
    return enabled


def _env_flag(env: dict, name: str) -> str | None:
    v = env.get(name)
    return None if v is None else str(v).strip()


def _ring_certain(topo: Topology, kind: str, op: str, env: dict, rules: Rules,
                  row: TuningRow | None) -> Unknown | None:
    """Unknown when NCCL may run another algorithm than Ring for this call (see
    ``updateCollCostTable`` in src/enqueue.cc and ``ncclTopoTuneModel`` in
    src/graph/tuning.cc: PAT needs one GPU per node, Simple, and no PreMulSum/SumPostDiv for a
    reduce-scatter; NVLS needs an NVSwitch sm90 node, SUM/MIN/MAX, and across nodes CollNet;
    Tree runs all-reduces; CollNet needs NCCL_COLLNET_ENABLE=1)."""
    tuner = _env_flag(env, "NCCL_TUNER_PLUGIN")
    if tuner and tuner.lower() not in ("none", "0", ""):
        return Unknown(f"NCCL_TUNER_PLUGIN={tuner}: a tuner plug-in chooses the algorithm, "
                       "protocol and channels", "tuner")
    if row is not None:
        if row.algorithm != "RING":
            return Unknown(f"the log's TUNING line {row.line} shows {row.algorithm} for this "
                           "call (only Ring is modelled)", "log")
        return None
    func = _FUNC_STR[kind]
    allowed = set(_ALGOS)
    algo_env = _env_flag(env, "NCCL_ALGO")
    if algo_env:
        parsed = parse_list(algo_env, func, _ALGOS)
        if parsed is None:
            return Unknown(f"NCCL_ALGO={algo_env} does not parse (NCCL refuses it)", "env")
        allowed = parsed
    if topo.algorithm == "Ring":
        allowed = {"Ring"}
    if "Ring" not in allowed:
        return Unknown(f"NCCL_ALGO={algo_env} excludes Ring for {func}", "algorithm")
    collnet = _env_flag(env, "NCCL_COLLNET_ENABLE") == "1"
    nvls_on = _env_flag(env, "NCCL_NVLS_ENABLE") != "0"
    if kind == ALL_REDUCE and "Tree" in allowed and topo.world > 2:
        return Unknown("NCCL may run an all-reduce as Tree (Ring not pinned: NCCL_ALGO=Ring, "
                       "algo=Ring or a TUNING log row)", "tree")
    if collnet and topo.nodes > 1 and ({"CollNetDirect", "CollNetChain", "NVLS"} & allowed):
        return Unknown("NCCL_COLLNET_ENABLE=1: CollNet/SHARP may run across nodes", "collnet")
    if (kind == REDUCE_SCATTER and rules.pat and "PAT" in allowed and topo.gpus == 1
            and topo.nodes > 1 and op in SUM_OPS and _env_flag(env, "NCCL_PAT_ENABLE") != "0"):
        return Unknown("PAT may run: 1 GPU per node, SUM, NCCL >= 2.23 (NCCL_PAT_ENABLE=0 or "
                       "NCCL_ALGO=Ring pins Ring)", "pat")
    nvls_algos = {"NVLS", "NVLSTree"} if kind == ALL_REDUCE else {"NVLS"}
    if (topo.nodes == 1 and topo.gpus > 1 and nvls_on and nvls_algos & allowed
            and op in ("sum", "max", "min")):
        return Unknown("NVLS may run on one NVSwitch Hopper/Blackwell node for SUM "
                       "(NCCL_NVLS_ENABLE=0 or NCCL_ALGO=Ring pins Ring)", "nvls")
    return None


def _protocols(topo: Topology, kind: str, env: dict, protocol: str | None,
               row: TuningRow | None) -> tuple[tuple[str, ...], str | None] | Unknown:
    if protocol is not None:
        if protocol not in PROTOCOLS:
            raise ParityError(f"protocol {protocol!r}: must be Simple, LL or LL128")
        return (protocol,), "protocol="
    if topo.protocol is not None:
        return (topo.protocol,), "proto="
    if row is not None:
        return (row.protocol,), f"log row (line {row.line})"
    text = _env_flag(env, "NCCL_PROTO")
    if text:
        parsed = parse_list(text, _FUNC_STR[kind], PROTOCOLS)
        if parsed is None:
            return Unknown(f"NCCL_PROTO={text} does not parse (NCCL refuses it)", "env")
        if not parsed:
            return Unknown(f"NCCL_PROTO={text} enables no protocol for {_FUNC_STR[kind]}", "env")
        return tuple(p for p in PROTOCOLS if p in parsed), ("NCCL_PROTO" if len(parsed) == 1
                                                            else None)
    return PROTOCOLS, None


def _row(topo: Topology, kind: str, count: int, elem_size: int) -> TuningRow | None:
    for row in topo.tuning or ():
        if row.matches(kind, count, elem_size, topo.world):
            return row
    return None


def _channel_plans(topo: Topology, rules: Rules, env: dict) -> list[tuple[int, list[RingFamily], str]] | Unknown:
    """(communicator channels, ring families, assumption) to try."""
    if topo.rings is not None:
        name = "file" if (topo.source or "").endswith(".json") else "log"
        fam = RingFamily(name, tuple(topo.rings), "")
        return [(len(topo.rings), [fam], f"{len(topo.rings)} channels from the {name}")]
    odd_ok = rules.odd_swap != "even-nodes" or topo.nodes % 2 == 0
    plans = []
    if topo.channels is not None:
        c = min(topo.channels, rules.max_channels)
        s_counts = search_channels(c, topo.nics or topo.gpus) if topo.nodes > 1 else (1,)
        fams: list[RingFamily] = []
        for s in s_counts:
            fams.extend(plausible_families(topo.nodes, topo.gpus, topo.nics, c, s, odd_ok))
        plans.append((c, dedupe_families(fams), f"{c} channels (channels=)"))
    else:
        for c, s, what in channel_options(topo.nodes, topo.gpus, topo.nics, rules.max_channels,
                                          env):
            fams = plausible_families(topo.nodes, topo.gpus, topo.nics, c, s, odd_ok)
            plans.append((c, fams, what))
    if topo.ring_prefixes:
        kept = []
        for c, fams, what in plans:
            ok = [f for f in fams if agrees(f.rings, topo.ring_prefixes)]
            ext = extrapolate(topo.nodes, topo.gpus, topo.ring_prefixes, c)
            if ext is not None and agrees(ext.rings, topo.ring_prefixes) and all(
                    ext.rings != f.rings for f in ok):
                ok.append(ext)
            if ok:
                kept.append((c, ok, what))
        if not kept:
            return Unknown("the log's cut ring lines match no modelled ring family; give every "
                           "rank's 'Ring NN : a -> b -> c' lines (NCCL_DEBUG_SUBSYS=INIT,GRAPH) "
                           "or an NCCL_GRAPH_DUMP_FILE", "log")
        plans = kept
    return plans


def _sorter_bin(traffic: int) -> int:
    """The size bin of ``ncclTaskCollSorterInsert`` (src/include/comm.h): ``u32fpEncode(min(1G,
    size) >> 10, 2)`` (src/include/bitops.h); a larger bin is a larger task."""
    x = min(1 << 30, traffic) >> 10
    log2x = (x | 1).bit_length() - 1
    bits = 2
    mant = (x >> (log2x - bits if log2x >= bits else 0)) & ((1 << bits) - 1)
    expo = log2x - (bits - 1) if log2x >= bits else 0
    return expo << bits | mant


def _plan_tasks(kind: str, counts: Sequence[int], elem_size: int, protocol: str, comm: int,
                nranks: int, rules: Rules, env: dict, pcie: bool) -> tuple[list[Task], int]:
    """The plan's tasks in plan order, and the index of the asked collective (the last of
    ``counts``). 2.22+: ``ncclPrepareTasks`` orders a (func, op, type) bin by size ascending
    (sorter bins, issue order within a bin) and gives tasks within 4x of the smallest of a run
    the channel count of their sum; 2.20-2.21: issue order, each task cut for its own size."""
    nt_max = max_threads(protocol, pcie, env)
    order = list(range(len(counts)))
    if rules.split != SPLIT_EVEN:
        tpb = traffic_per_byte(kind, nranks)
        order.sort(key=lambda i: _sorter_bin(counts[i] * elem_size * tpb))
    nchan: dict[int, int] = {}
    nthr: dict[int, int] = {}
    if rules.split == SPLIT_EVEN:
        for i in order:
            nb = input_bytes(kind, counts[i], elem_size, nranks)
            nchan[i] = channel_cut(nb, comm, protocol, nranks, nt_max)
            nthr[i] = thread_count(nb, nchan[i], protocol, nranks, nt_max)
    else:
        j = 0
        while j < len(order):
            first = counts[order[j]] * elem_size * traffic_per_byte(kind, nranks)
            k = j + 1
            while k < len(order) and counts[order[k]] * elem_size * traffic_per_byte(
                    kind, nranks) < 4 * first:
                k += 1
            nb = input_bytes(kind, sum(counts[order[i]] for i in range(j, k)), elem_size, nranks)
            nc = channel_cut(nb, comm, protocol, nranks, nt_max)
            for i in range(j, k):
                nchan[order[i]] = nc
                nthr[order[i]] = thread_count(nb, nc, protocol, nranks, nt_max)
            j = k
    tasks = [Task(kind, counts[i], elem_size, protocol, nchan[i], nthr[i]) for i in order]
    return tasks, order.index(len(counts) - 1)


@functools.lru_cache(maxsize=8192)
def _predict(topo: Topology, kind: str, count: int, elem_size: int, op: str,
             env_items: tuple, protocol: str | None, group: tuple, version: str | None,
             ring_only: bool) -> Prediction | Unknown:
    env = dict(env_items)
    vtext = topo.nccl or version
    rules = rules_for(vtext)
    if rules is None:
        return Unknown(f"NCCL {vtext} is outside the modelled releases {OLDEST}-{NEWEST}",
                       "version")
    where = ("topology nccl=" if topo.nccl else "run fingerprint" if version
             else "newest modelled: no nccl= and no fingerprint version")
    vlabel = f"{rules.version} ({where})"
    if count <= 0 or topo.world == 1:
        why = "an empty collective (NCCL skips it)" if count <= 0 else "one rank (a copy)"
        return Prediction(topo, kind, count, elem_size, rules.family, vlabel, (), None, (why,))
    row = _row(topo, kind, count, elem_size)
    if not ring_only:
        unknown = _ring_certain(topo, kind, op, env, rules, row)
        if unknown is not None:
            return unknown
    protos = _protocols(topo, kind, env, protocol, row)
    if isinstance(protos, Unknown):
        return protos
    protocols, pinned = protos
    plans = _channel_plans(topo, rules, env)
    if isinstance(plans, Unknown):
        return plans
    notes = []
    if row is not None:
        notes.append(f"log TUNING line {row.line}: {row.algorithm} {row.protocol}"
                     + (f" channel{{{row.channel_lo}..{row.channel_hi}}}"
                        if row.channel_lo is not None else ""))
    scenarios: dict[tuple, Scenario] = {}
    ring_hash: dict[int, int] = {}
    for proto in protocols:
        for comm, families, what in plans:
            for fam in families:
                pcie = fam.name == "pci-ascending"
                tasks, mine = _plan_tasks(kind, tuple(group) + (count,), elem_size, proto, comm,
                                          topo.world, rules, env, pcie)
                ranges = plan_split(tasks, comm, topo.world, rules)[mine]
                segs = _segments(kind, ranges, fam.rings, tasks[mine], rules, env)
                last = max((c for c, _, _ in ranges), default=0)
                assumptions = tuple(a for a in (what, fam.assumption) if a)
                if group:
                    assumptions += (f"one kernel plan with {len(group)} grouped partner(s), "
                                    f"all {proto}",)
                used = sorted({c for c, _, _ in ranges})
                key = (proto, comm, tuple(ranges),  # rings by content hash (hashed once each)
                       tuple(ring_hash.setdefault(id(fam.rings[c]), hash(fam.rings[c]))
                             for c in used))
                old = scenarios.get(key)
                if old is not None:
                    scenarios[key] = replace(old, family=old.family + "+" + fam.name)
                    continue
                scenarios[key] = Scenario(proto, comm, len(ranges), fam.name,
                                          tuple(fam.rings[c] for c in range(last + 1)), segs,
                                          assumptions)
    out = tuple(scenarios.values())
    if row is not None and row.channel_lo is not None:
        want = (row.channel_lo, row.channel_hi)
        fit = tuple(s for s in out if _span(s) == want)
        if fit:
            out = fit
        else:
            notes.append(f"the log's channel{{{want[0]}..{want[1]}}} for this call matches no "
                         "modelled channel count: every scenario kept")
    return Prediction(topo, kind, count, elem_size, rules.family, vlabel, out, pinned,
                      tuple(notes))


def _span(s: Scenario) -> tuple[int, int]:
    chans = [c for c, _, _ in s.ranges()]
    return (min(chans), max(chans)) if chans else (0, 0)


def _segments(kind: str, ranges, rings, task: Task, rules: Rules, env: dict) -> tuple[Segment, ...]:
    out = []
    orders: dict[int, dict[int, tuple[int, ...]]] = {}  # id(ring) -> owner -> order
    for c, lo, hi in ranges:
        ring = rings[c % len(rings)]
        if kind == REDUCE_SCATTER:
            out.append(Segment(lo, hi, c, None, ring))
        else:
            of = orders.setdefault(id(ring), {})
            for a, b, owner in all_reduce_chunks(lo, hi, ring, task, rules, env):
                order = of.get(owner)
                if order is None:
                    order = of[owner] = sum_order(ring, owner)
                out.append(Segment(a, b, c, owner, order))
    return tuple(out)


def _norm(topo, kind, count, elem_size, op, env, protocol, group, version):
    if isinstance(topo, str):
        topo = parse_topology(topo)
    if kind not in (REDUCE_SCATTER, ALL_REDUCE):
        raise ParityError(f"collective {kind!r}: the model covers reduce_scatter and all_reduce")
    op = str(op).lower()
    if op not in _OPS:
        raise ParityError(f"reduce op {op!r}: expected one of {', '.join(_OPS)}")
    env_items = tuple(sorted((str(k), str(v)) for k, v in (env or {}).items()
                             if str(k).startswith("NCCL_")))
    return topo, kind, int(count), int(elem_size), op, env_items, protocol, tuple(
        int(g) for g in group), version


def predict(topo: Topology | str, kind: str, count: int, elem_size: int, *, op: str = "sum",
            env: Mapping[str, str] | None = None, protocol: str | None = None,
            group: Sequence[int] = (), version: str | None = None) -> Prediction | Unknown:
    """Every scenario NCCL may run a ``kind`` collective of ``count`` elements (per rank for a
    reduce-scatter, the whole buffer for an all-reduce) of ``elem_size`` bytes with, or an
    :class:`Unknown`.

    Args:
        op: "sum", "avg" (floats: PreMulSum), "premul_sum", "max", "min", "prod".
        env: the run's NCCL_* settings (its fingerprint): NCCL_ALGO, NCCL_PROTO,
            NCCL_MIN/MAX_NCHANNELS, NCCL_MIN/MAX_CTAS, NCCL_NTHREADS, NCCL_LL128_NTHREADS,
            NCCL_BUFFSIZE, NCCL_PAT_ENABLE, NCCL_NVLS_ENABLE, NCCL_COLLNET_ENABLE,
            NCCL_TUNER_PLUGIN.
        protocol: pin the protocol (else the topology's ``proto=``, a log row, NCCL_PROTO).
        group: counts of the other collectives of the same kind, op and dtype in the same
            ``ncclGroupStart/End`` (issued before this one).
        version: the fingerprint's NCCL version, used when the topology has no ``nccl=``.

    Cached on its arguments; rings are shared tuples.
    """
    return _predict(*_norm(topo, kind, count, elem_size, op, env, protocol, group, version),
                    ring_only=False)


def primary_scenario(topo: Topology | str, kind: str, count: int, elem_size: int, *,
                     env: Mapping[str, str] | None = None, protocol: str | None = None,
                     version: str | None = None) -> Scenario | None:
    """The one scenario the emulation runs (Ring assumed): the pinned protocol (``proto=``, a
    log row, NCCL_PROTO) else Simple, the first channel count, the first ring family. None
    for an empty collective or one rank; ParityError for a release outside the families."""
    t, k, n, es, op, env_items, proto, group, v = _norm(topo, kind, count, elem_size, "sum",
                                                        env, protocol, (), version)
    if proto is None and t.protocol is None and _row(t, k, n, es) is None and not dict(
            env_items).get("NCCL_PROTO"):
        proto = SIMPLE
    p = _predict(t, k, n, es, op, env_items, proto, group, v, ring_only=True)
    if isinstance(p, Unknown):
        raise ParityError(f"topology {t.spec()}: {p.reason}")
    if not p.scenarios:
        return None
    return _first(p)


def _first(p: Prediction) -> Scenario:
    order = {SIMPLE: 0, LL128: 1, LL: 2}
    return min(p.scenarios, key=lambda s: order[s.protocol])


def reduce_scatter_segments(topo: Topology | str, count: int, elem_size: int) -> list[Segment]:
    """The primary scenario's channel ranges of a reduce-scatter whose per-rank output has
    ``count`` elements; rank d's elements in [lo, hi) are summed in ``sum_order(order, d)``."""
    s = primary_scenario(topo, REDUCE_SCATTER, count, elem_size)
    return list(s.segments) if s else []


def all_reduce_segments(topo: Topology | str, count: int, elem_size: int) -> list[Segment]:
    """The primary scenario's chunks of a Ring all-reduce of ``count`` elements, each with its
    owner and sum order."""
    s = primary_scenario(topo, ALL_REDUCE, count, elem_size)
    return list(s.segments) if s else []


def channel_count(topo: Topology | str, total_bytes: int, protocol: str | None = None,
                  kind: str = REDUCE_SCATTER) -> int:
    """Channels the primary scenario gives one collective whose whole input is
    ``total_bytes`` (the cut of ``topoGetAlgoInfo``)."""
    t = parse_topology(topo) if isinstance(topo, str) else topo
    comm = communicator_channels(t)[0]
    proto = protocol or t.protocol or SIMPLE
    return channel_cut(total_bytes, comm, proto, t.world)


def communicator_channels(topo: Topology | str, env: Mapping[str, str] | None = None) -> list[int]:
    """The communicator channel counts a prediction tries, first = the primary one."""
    t = parse_topology(topo) if isinstance(topo, str) else topo
    rules = rules_for(t.nccl) or rules_for(None)
    if t.rings is not None:
        return [len(t.rings)]
    if t.channels is not None:
        return [t.channels]
    return [c for c, _, _ in channel_options(t.nodes, t.gpus, t.nics, rules.max_channels,
                                             dict(env or {}))]


def default_channels(topo: Topology | str) -> int:
    """The primary communicator channel count (the first of ``communicator_channels``); kept
    for callers of the old model."""
    return communicator_channels(topo)[0]


def ring_families(topo: Topology | str, env: Mapping[str, str] | None = None) -> list[RingFamily]:
    """Every ring family a prediction tries (over every channel count), first = primary."""
    t = parse_topology(topo) if isinstance(topo, str) else topo
    rules = rules_for(t.nccl) or rules_for(None)
    plans = _channel_plans(t, rules, dict(env or {}))
    if isinstance(plans, Unknown):
        raise ParityError(f"topology {t.spec()}: {plans.reason}")
    return [f for _, fams, _ in plans for f in fams]


def rings(topo: Topology | str, nchannels: int) -> list[tuple[int, ...]]:
    """Channel -> ring of the primary family, for the first ``nchannels`` channels."""
    every = ring_families(topo)[0].rings
    return [every[c % len(every)] for c in range(nchannels)]


def orders_differ(topo: Topology | str) -> bool:
    """Whether any two channels of any family sum some owner's segment in a different order
    (if not, no layout change can change a Ring result)."""
    t = parse_topology(topo) if isinstance(topo, str) else topo
    for fam in ring_families(t):
        rs = set(fam.rings)
        for owner in range(t.world):
            if len({canonical_order(sum_order(r, owner)) for r in rs}) > 1:
                return True
    return False


__all__ = ["MODEL", "MODEL_LIMITS", "Prediction", "Scenario", "Segment", "Unknown", "predict",
           "primary_scenario", "reduce_scatter_segments", "all_reduce_segments",
           "channel_count", "communicator_channels", "default_channels", "ring_families", "rings", "orders_differ",
           "sum_order", "same_sum", "canonical_order", "parse_list", "apply_channel_env"]
