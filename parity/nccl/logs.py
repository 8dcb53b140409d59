"""Read ``NCCL_DEBUG=INFO`` logs as NCCL writes them: communicators, rings, channels, TUNING rows.

Why: the model guesses rings and channel counts; a job that ran with ``NCCL_DEBUG=INFO
NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING`` printed the real ones. This module reads one log, several
(one per rank), or a directory of them, keeps every communicator apart, and turns the chosen one
into a :class:`parity.nccl.topology.Topology` (``topology_from_log``; ``--nccl-log FILE[:COMM]``).

Lines read (any prefix before ``NCCL INFO``: ``host:pid:tid [dev]``, mpirun's ``[1,0]<stdout>:``,
timestamps), each format read from the NVIDIA/nccl sources (v2.20.5-1 ... v2.30.7-1):

* ``NCCL version 2.21.5+cuda12.4`` (``src/init.cc``): the release, so the rules.
* ``comm 0x.. rank R nRanks N nNodes M localRanks L localRank l MNNVL x`` (``initTransportsRank``,
  ``src/init.cc``): a communicator's size and shape. ``... commId 0x.. - Init START|COMPLETE``
  (``ncclCommInitRankFunc``): its id, the same on every rank; ``ncclCommSplit ... parent 0x..
  splitCount k color c key k`` for split communicators.
* ``Channel 00/16 :    0   7   6 ...`` (``ncclBuildRings`` / ``dumpLine``, ``src/graph/rings.cc``):
  rank 0's ring per channel, every channel of the communicator (printed after every duplication);
  cut at 20 ranks up to 2.22 and at 128 characters (``...``) from 2.23. The channel count it
  states (``/16``) is kept even when the rings are cut.
* ``Ring 00 : 7 -> 0 -> 1`` (``initTransportsRank``, ``src/init.cc``, ``NCCL_DEBUG_SUBSYS=GRAPH``):
  every rank's prev and next per channel: rings of any size are rebuilt from every rank's lines.
* ``Channel 00/0 : 0[0] -> 1[1] via P2P/IPC`` (transport setup): a ring connection when printed
  before the thread's ``Connected all rings``; the last resort for rings.
* ``16 coll channels, ...`` (``src/init.cc``): the communicator's channel count.
* ``NCCL_ALGO set by environment to Ring`` (``ncclGetEnv``): settings that pin choices.
* TUNING (rank 0 of the communicator only): 2.20-2.22 ``N Bytes -> Algo i proto j time t`` and
  2.23 ``Func: N Bytes -> Algo i proto j time t`` (``topoGetAlgoInfo``; N the whole input;
  numeric ids of ``src/include/nccl_common.h``); from 2.24 ``Func: N Bytes -> Algo NAME proto
  NAME channel{Lo..Hi}={a..b}`` (``scheduleCollTasksToPlan``; N = ``task->count * typeSize``, per
  rank for ReduceScatter/AllGather). ``Lo..Hi`` is the channels that call used, never the
  communicator's count.
* ``NCCL_GRAPH_DUMP_FILE`` XML (``ncclTopoGetXmlFromGraph``, ``src/graph/search.cc``): the ring
  graph (id 0) of one node: one chain of local GPUs per search channel.

A line that starts one of these formats but does not parse is refused with its file and line
number (ParityError, exit 2): a half-read log would give a confident wrong prediction.
TUNING lines carry no communicator: they are given to every communicator the printing process is
rank 0 of (said in ``notes`` when that is more than one).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

from parity.errors import ParityError
from parity.nccl.channels import LL, LL128, SIMPLE
from parity.nccl.rings import build_rings
from parity.nccl.topology import Topology, TuningRow, validate
from parity.nccl.versions import minor_of, rules_for

_MARK = re.compile(r"NCCL INFO ?(.*)$")
_PREFIX = re.compile(r"([\w.\-]+):(\d+):(\d+) \[(\d+)\] NCCL INFO")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
_COMM = re.compile(r"^comm (0x[0-9a-fA-F]+) rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+)"
                   r" localRank (\d+)")
_INIT = re.compile(r"comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+) .*- Init (START|COMPLETE)")
_COMM_ID = re.compile(r"commId (0x[0-9a-fA-F]+)")
_PARENT = re.compile(r"parent (0x[0-9a-fA-F]+)(?: splitCount (\d+))? color (-?\d+)")
_OLD_INIT = re.compile(r"^comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+) cudaDev")
_CHANNEL = re.compile(r"^Channel (\d+)/(\d+) :((?:\s+\d+)*)\s*(\S*)$")
_RING = re.compile(r"^Ring (\d+) : (-?\d+) -> (-?\d+) -> (-?\d+)\s*$")
_CONN = re.compile(r"^Channel (\d+)(?:/\d+)? : (\d+)\[[0-9a-fA-Fx]+\] -> (\d+)\[[0-9a-fA-Fx]+\]")
_COLL_CH = re.compile(r"^(\d+) coll channels,")
_ENV = re.compile(r"^(NCCL_[A-Z0-9_]+) set by environment to (.*?)\.?\s*$")
_T24 = re.compile(r"^(\w+): (\d+) Bytes -> Algo (\S+) proto (\S+) channel\{Lo\.\.Hi\}=\{(-?\d+)"
                  r"\.\.(-?\d+)\}\s*$")
_T23 = re.compile(r"^(\w+): (\d+) Bytes -> Algo (-?\d+) proto (-?\d+) time (\S+)\s*$")
_T20 = re.compile(r"^(\d+) Bytes -> Algo (-?\d+) proto (-?\d+) time (\S+)\s*$")

ALGO_NAMES = ("TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT")
_PROTO_NAMES = {"LL": LL, "LL128": LL128, "SIMPLE": SIMPLE}
_PROTO_IDS = (LL, LL128, SIMPLE)  # NCCL_PROTO_LL 0, LL128 1, SIMPLE 2
_FUNCS = {"ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce",
          "AllGather": "all_gather", "Broadcast": "broadcast", "Reduce": "reduce"}
MAX_CHANNELS = 64


@dataclass
class CommLog:
    """What a log shows about one communicator.

    Attributes:
        key: its id: the commId (``0x..``), ``split:<parent>:<color>``, or ``comm#<n>``.
        pointers: the ``comm 0x..`` pointers of its ranks seen in the log.
        nranks, nnodes, local_ranks: its size and shape (None if not printed).
        version: the NCCL release the printing processes ran.
        channels: the channel count the log states (``N coll channels`` or ``Channel NN/N``).
        rings: channel -> complete ring (from rank 0's lines when uncut, else every rank's
            ``Ring`` lines, else connection lines); empty when they cannot be rebuilt.
        ring_source: "channel lines", "ring lines", "connection lines", "graph dump" or "".
        prefixes: channel -> the first ranks of rank 0's (cut) ring line.
        cut: rank 0's ring lines were cut.
        tuning: TUNING rows the communicator's rank 0 printed.
        env: NCCL_* settings the log says were set by environment.
        notes: what could not be used, in words.
    """

    key: str
    pointers: set[str] = field(default_factory=set)
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    version: str | None = None
    channels: int | None = None
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ring_source: str = ""
    prefixes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    cut: bool = False
    tuning: list[TuningRow] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # raw material, merged over ranks
    _channel_lines: dict[int, tuple[tuple[int, ...], bool]] = field(default_factory=dict)
    _stated: dict[str, int] = field(default_factory=dict)
    _next: dict[int, dict[int, int]] = field(default_factory=dict)
    _prev: dict[int, dict[int, int]] = field(default_factory=dict)
    _conn: dict[int, dict[int, int]] = field(default_factory=dict)
    _rank0_procs: set = field(default_factory=set)
    _ranks: dict = field(default_factory=dict)  # rank -> the process that printed it
    _ring_ranks: set = field(default_factory=set)  # ranks whose "Ring NN" lines were seen


@dataclass
class NcclLog:
    """Every communicator of one or more log files, in the order they were first seen."""

    paths: list[str]
    communicators: list[CommLog]
    version: str | None = None
    graph_chains: tuple[tuple[int, ...], ...] | None = None  # from an NCCL_GRAPH_DUMP_FILE
    graph_crossnic: int = 0

    def select(self, comm: str | None = None) -> CommLog:
        """The world communicator (the largest, first seen) or the one ``comm`` names: a
        ``comm 0x..`` pointer of any of its ranks, its commId, or ``#N`` (1-based)."""
        what = ", ".join(self.paths)
        if not self.communicators:
            raise ParityError(f"NCCL log {what}: no communicator (run with NCCL_DEBUG=INFO)")
        if comm is None:
            best = self.communicators[0]
            for c in self.communicators:
                if (c.nranks or 0) > (best.nranks or 0):
                    best = c
            return best
        key = comm.strip()
        if key.startswith("#") and key[1:].isdigit():
            i = int(key[1:])
            if 1 <= i <= len(self.communicators):
                return self.communicators[i - 1]
        for c in self.communicators:
            if key.lower() == c.key.lower() or key.lower() in {p.lower() for p in c.pointers}:
                return c
        names = ", ".join(f"#{i + 1} {c.key} ({c.nranks} ranks)"
                          for i, c in enumerate(self.communicators))
        raise ParityError(f"NCCL log {what}: no communicator {comm!r} (has {names})")


def _files(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(sorted(q for q in p.iterdir() if q.is_file()))
        else:
            out.append(p)
    return out


def read_log(paths: str | Path | Sequence[str | Path]) -> NcclLog:
    """Read one log file, several (one per rank), or every file of a directory."""
    files = _files(paths)
    if not files:  # an empty directory: say so (not "no communicator" with no file named)
        given = [paths] if isinstance(paths, (str, Path)) else list(paths)
        raise ParityError(f"NCCL log {', '.join(str(p) for p in given) or '(none given)'}: "
                          "no log file (an empty directory; give the NCCL_DEBUG=INFO logs, "
                          "e.g. NCCL_DEBUG_FILE's files)")
    log = NcclLog([str(p) for p in files], [])
    state = _State(log)
    for p in files:
        try:
            text = p.read_text(errors="replace")
        except OSError as e:
            raise ParityError(f"NCCL log {p}: cannot read ({e.strerror or e})") from None
        if text.lstrip().startswith("<graphs"):
            _read_graph_dump(log, p, text)
            continue
        state.read(str(p), text.splitlines())
    anon = state.by_key.get("comm#?")
    named = [c for c in log.communicators if c is not anon]
    if anon is not None and len(named) == 1:
        # an excerpt: lines printed before any communicator line of their thread belong to
        # the only communicator the log shows
        _merge(anon, named[0])
        named[0].notes.append("lines without their thread's communicator line are given to "
                              "the only communicator in the log")
        log.communicators.remove(anon)
    for c in log.communicators:
        for k, v in state.env.items():
            c.env.setdefault(k, v)
        _shape_from_hosts(c)
        _finish(c)
    return log


class _State:
    """Line-by-line reading: which communicator each thread is setting up."""

    def __init__(self, log: NcclLog):
        self.log = log
        self.by_key: dict[str, CommLog] = {}
        self.by_ptr: dict[str, CommLog] = {}
        self.current: dict[tuple, CommLog] = {}
        self.rank_of: dict[tuple, int] = {}  # (thread, comm key) -> rank
        self.rings_done: set[tuple] = set()
        self.ordinal: dict[tuple, int] = {}
        self.version_of: dict[tuple, str] = {}
        self.env: dict[str, str] = {}  # settings printed before any communicator

    def comm(self, key: str) -> CommLog:
        c = self.by_key.get(key)
        if c is None:
            c = CommLog(key)
            self.by_key[key] = c
            self.log.communicators.append(c)
        return c

    def read(self, path: str, lines: Iterable[str]) -> None:
        for no, raw in enumerate(lines, 1):
            m = _MARK.search(raw)
            vm = _VERSION.search(raw)
            pm = _PREFIX.search(raw)
            proc = (path, pm.group(1), pm.group(2)) if pm else (path, "", "")
            thread = proc + ((pm.group(3),) if pm else ("",))
            if vm:
                v = vm.group(1)
                self.version_of[proc] = v
                self.log.version = self.log.version or v
                if not m or m.group(1).startswith("NCCL version"):
                    continue
            if not m:
                continue
            msg = m.group(1).strip()
            try:
                self._line(msg, proc, thread, f"{path}:{no}", no)
            except ParityError:
                raise
            except (ValueError, IndexError) as e:
                raise ParityError(f"{path}:{no}: malformed NCCL line ({e}): {msg[:80]}") from None

    def _attach(self, c: CommLog, ptr: str, proc, thread, rank: int) -> None:
        anon = self.current.get(thread)
        if anon is not None and anon is not c and anon.key == "comm#?":
            _merge(anon, c)  # an excerpt's lines seen before this thread's comm line
            self.log.communicators.remove(anon)
            self.by_key.pop(anon.key, None)
            for t, x in list(self.current.items()):
                if x is anon:
                    self.current[t] = c
        c.pointers.add(ptr)
        self.by_ptr[ptr + "@" + "/".join(proc)] = c
        self.current[thread] = c
        self.rank_of[(thread, c.key)] = rank
        c._ranks.setdefault(rank, proc)
        if rank == 0:
            c._rank0_procs.add(proc)
        v = self.version_of.get(proc)
        if v and not c.version:
            c.version = v

    def _line(self, msg: str, proc, thread, where: str, no: int) -> None:
        m = _INIT.search(msg)
        if m:
            ptr, rank, nranks = m.group(1), int(m.group(2)), int(m.group(3))
            idm, pm = _COMM_ID.search(msg), _PARENT.search(msg)
            if idm:
                key = idm.group(1).lower()
            elif pm:
                parent = self.by_ptr.get(pm.group(1) + "@" + "/".join(proc))
                key = (f"split:{parent.key if parent else pm.group(1)}:{pm.group(2) or ''}:"
                       f"{pm.group(3)}")
            else:
                return
            c = self.by_ptr.get(ptr + "@" + "/".join(proc))
            if c is None or c.key != key:
                new = self.comm(key)
                if c is not None:
                    _merge(c, new)
                    self.log.communicators.remove(c)
                    self.by_key.pop(c.key, None)
                c = new
            c.nranks = nranks
            self._attach(c, ptr, proc, thread, rank)
            return
        m = _COMM.match(msg)
        if m:
            ptr = m.group(1)
            rank, nranks, nnodes, local = (int(m.group(i)) for i in range(2, 6))
            if nranks < 1 or nnodes < 1 or local < 1 or rank >= nranks:
                raise ParityError(f"{where}: malformed communicator line: {msg[:100]}")
            c = self.by_ptr.get(ptr + "@" + "/".join(proc))
            if c is None:
                n = self.ordinal.get((thread, nranks), 0)
                self.ordinal[(thread, nranks)] = n + 1
                k = 0
                while True:  # an ordinal key another process already holds this rank of
                    c = self.comm(f"comm#{nranks}r{n}" + (f".{k}" if k else ""))
                    if c._ranks.get(rank, proc) == proc:
                        break
                    k += 1
            c.nranks, c.nnodes, c.local_ranks = nranks, nnodes, local
            self._attach(c, ptr, proc, thread, rank)
            return
        m = _OLD_INIT.match(msg)
        if m:
            return
        if msg.startswith("Ring ") and "->" in msg:
            m = _RING.match(msg)
            if not m:
                if re.match(r"^Ring \d+ : \d+\[", msg):
                    return  # pre-2.9 connection trace ("Ring 00 : 12[41000] -> 11[2d000] via")
                raise ParityError(f"{where}: malformed ring line: {msg[:100]}")
            c = self._current(thread, where)
            ch, prev, rank, nxt = (int(m.group(i)) for i in range(1, 5))
            self._check_channel(ch, where)
            if c.nranks is not None and not all(0 <= x < c.nranks for x in (prev, rank, nxt)):
                raise ParityError(f"{where}: ring line names a rank outside the communicator's "
                                  f"{c.nranks}: {msg[:100]}")
            c._ring_ranks.add(rank)
            nx = c._next.setdefault(ch, {})
            pv = c._prev.setdefault(ch, {})
            for a, b in ((prev, rank), (rank, nxt)):
                if nx.get(a, b) != b or pv.get(b, a) != a:
                    old = f"{a} -> {nx[a]}" if nx.get(a, b) != b else f"{pv[b]} -> {b}"
                    raise ParityError(f"{where}: ring line contradicts an earlier one (channel "
                                      f"{ch}: {old} and {a} -> {b})")
                nx[a] = b
                pv[b] = a
            return
        if msg.startswith("Channel "):
            m = _CHANNEL.match(msg)
            if m and ":" in msg and "->" not in msg:
                ch, total = int(m.group(1)), int(m.group(2))
                tail = m.group(4)
                nums = [int(x) for x in m.group(3).split()]
                cut = False
                if tail:
                    if not tail.endswith("..."):
                        raise ParityError(f"{where}: malformed ring line: {msg[:100]}")
                    cut = True
                    head = tail[:-3]
                    if head and not head.isdigit():
                        raise ParityError(f"{where}: malformed ring line: {msg[:100]}")
                    # a number glued to "..." was overwritten by dumpLine's marker: drop it
                self._check_channel(ch, where)
                if not 1 <= total <= MAX_CHANNELS or ch >= total:
                    raise ParityError(f"{where}: ring line states {total} channels "
                                      f"(channel {ch}): {msg[:100]}")
                c = self._current(thread, where)
                c._stated.setdefault("channel lines", total)
                if len(set(nums)) != len(nums):
                    raise ParityError(f"{where}: ring line repeats a rank: {msg[:100]}")
                c._channel_lines.setdefault(ch, (tuple(nums), cut))
                return
            m = _CONN.match(msg)
            if m:
                c = self.current.get(thread)
                if c is not None and (thread, c.key) not in self.rings_done:
                    ch, a, b = int(m.group(1)), int(m.group(2)), int(m.group(3))
                    if ch < MAX_CHANNELS:
                        c._conn.setdefault(ch, {}).setdefault(a, b)
                return
            if re.match(r"^Channel \d+/\d+ :", msg):
                raise ParityError(f"{where}: malformed ring line: {msg[:100]}")
            return
        if msg.startswith("Connected all rings"):
            c = self.current.get(thread)
            if c is not None:
                self.rings_done.add((thread, c.key))
            return
        m = _COLL_CH.match(msg)
        if m:
            n = int(m.group(1))
            if not 1 <= n <= MAX_CHANNELS:
                raise ParityError(f"{where}: states {n} coll channels (1..{MAX_CHANNELS})")
            self._current(thread, where)._stated["coll channels"] = n
            return
        m = _ENV.match(msg)
        if m:
            c = self.current.get(thread)
            (c.env if c else self.env).setdefault(m.group(1), m.group(2).strip())
            return
        if "Bytes -> Algo" in msg:
            row = _tuning_row(msg, where, no)
            owners = [c for c in self.log.communicators if proc in c._rank0_procs]
            if not owners:
                owners = [self.current.get(thread) or self._current(thread, where)]
            for c in owners:
                c.tuning.append(row)
            if len(owners) > 1:
                for c in owners:
                    note = ("TUNING lines carry no communicator: those of a process that is rank 0 "
                            f"of {len(owners)} communicators are given to each")
                    if note not in c.notes:
                        c.notes.append(note)
            return

    def _current(self, thread, where) -> CommLog:
        c = self.current.get(thread)
        if c is None:
            # a log without the comm line (an excerpt): one anonymous communicator
            c = self.comm("comm#?")
            self.current[thread] = c
        return c

    @staticmethod
    def _check_channel(ch: int, where: str) -> None:
        if not 0 <= ch < MAX_CHANNELS:
            raise ParityError(f"{where}: channel {ch} outside 0..{MAX_CHANNELS - 1}")


def _shape_from_hosts(c: CommLog) -> None:
    """nNodes and localRanks from the hosts that printed every rank (Init lines of 2.20-2.22
    excerpts carry no nNodes): only when every rank was seen and the hosts hold equal
    shares."""
    if c.nnodes is not None or c.nranks is None or len(c._ranks) != c.nranks:
        return
    hosts: dict[str, int] = {}
    for proc in c._ranks.values():
        if not proc[1]:
            return
        hosts[proc[1]] = hosts.get(proc[1], 0) + 1
    if len(set(hosts.values())) == 1:
        c.nnodes, c.local_ranks = len(hosts), c.nranks // len(hosts)


def _merge(src: CommLog, dst: CommLog) -> None:
    """An ordinal-keyed communicator found to be ``dst``: fold what it gathered into it."""
    dst.pointers |= src.pointers
    for k in ("nranks", "nnodes", "local_ranks", "version"):
        if getattr(dst, k) is None:
            setattr(dst, k, getattr(src, k))
    dst._channel_lines = {**src._channel_lines, **dst._channel_lines}
    dst._stated = {**src._stated, **dst._stated}
    for ch, nx in src._next.items():
        dst._next.setdefault(ch, {}).update(nx)
    for ch, nx in src._conn.items():
        dst._conn.setdefault(ch, {}).update(nx)
    for k, v in src.env.items():
        dst.env.setdefault(k, v)
    dst._rank0_procs |= src._rank0_procs
    for r, proc in src._ranks.items():
        dst._ranks.setdefault(r, proc)
    dst._ring_ranks |= src._ring_ranks
    dst.tuning = src.tuning + dst.tuning
    dst.notes.extend(n for n in src.notes if n not in dst.notes)


def _tuning_row(msg: str, where: str, no: int) -> TuningRow:
    m = _T24.match(msg)
    if m:
        func, nbytes, algo, proto, lo, hi = m.groups()
        algo_u, proto_u = algo.upper(), proto.upper()
        if algo_u not in ALGO_NAMES:
            raise ParityError(f"{where}: TUNING line names algorithm {algo!r}")
        if proto_u not in _PROTO_NAMES:
            raise ParityError(f"{where}: TUNING line names protocol {proto!r}")
        lo_i, hi_i = int(lo), int(hi)
        if lo_i < 0 or hi_i < lo_i or hi_i >= MAX_CHANNELS:
            raise ParityError(f"{where}: TUNING line channel range {{{lo}..{hi}}} is not within "
                              f"0..{MAX_CHANNELS - 1}")
        if func not in _FUNCS:
            raise ParityError(f"{where}: TUNING line names collective {func!r}")
        coll = _FUNCS[func]
        return TuningRow(coll, int(nbytes), coll in ("reduce_scatter", "all_gather"), algo_u,
                         _PROTO_NAMES[proto_u], lo_i, hi_i, "2.24", no)
    m = _T23.match(msg) or _T20.match(msg)
    if m:
        if m.re is _T23:
            func, nbytes, algo, proto, _ = m.groups()
            if func not in _FUNCS:
                raise ParityError(f"{where}: TUNING line names collective {func!r}")
            coll, fmt = _FUNCS[func], "2.23"
        else:
            nbytes, algo, proto, _ = m.groups()
            coll, fmt = None, "2.20"
        a, p = int(algo), int(proto)
        if not 0 <= a < len(ALGO_NAMES) or not 0 <= p < len(_PROTO_IDS):
            raise ParityError(f"{where}: TUNING line algorithm {a} / protocol {p} out of range")
        return TuningRow(coll, int(nbytes), False, ALGO_NAMES[a], _PROTO_IDS[p], None, None,
                         fmt, no)
    raise ParityError(f"{where}: malformed TUNING line: {msg[:100]}")


def _cycle(nx: dict[int, int], nranks: int) -> tuple[int, ...] | None:
    if 0 not in nx:
        return None
    ring, cur = [], 0
    for _ in range(nranks):
        ring.append(cur)
        cur = nx.get(cur, -1)
        if cur < 0:
            return None
    if cur != 0 or sorted(ring) != list(range(nranks)):
        return None
    return tuple(ring)


def _finish(c: CommLog) -> None:
    """Rebuild rings: rank 0's uncut lines, else every rank's Ring lines, else connections."""
    c.channels = c._stated.get("coll channels") or c._stated.get("channel lines")
    if c._stated.get("coll channels") and c._stated.get("channel lines") and \
            c._stated["coll channels"] != c._stated["channel lines"]:
        c.notes.append(f"the log states {c._stated['channel lines']} ring channels and "
                       f"{c._stated['coll channels']} coll channels; the latter is used")
    n = c.nranks
    if n is None:  # no communicator line: the largest rank any line names
        seen = [x for r, _ in c._channel_lines.values() for x in r]
        seen += [x for nx in c._next.values() for kv in nx.items() for x in kv]
        n = max(seen) + 1 if seen else None
    nch = c.channels or (max(c._channel_lines) + 1 if c._channel_lines else
                         max(c._next) + 1 if c._next else 0)
    lines_ok = n is not None and c._channel_lines and all(
        ch in c._channel_lines and not c._channel_lines[ch][1]
        and len(c._channel_lines[ch][0]) == n and sorted(c._channel_lines[ch][0]) == list(range(n))
        for ch in range(nch))
    c.cut = any(cut or (n is not None and len(r) < n) for r, cut in c._channel_lines.values())
    full = {ch: r for ch, (r, cut) in c._channel_lines.items()
            if n is not None and not cut and len(r) == n and sorted(r) == list(range(n))}
    half = nch // 2
    if lines_ok:
        c.rings = {ch: c._channel_lines[ch][0] for ch in range(nch)}
        c.ring_source = "channel lines"
    elif nch >= 2 and nch % 2 == 0 and all(ch in full for ch in range(half)) and all(
            full[ch] == full[ch - half] for ch in full if ch >= half):
        # ncclTopoPostset copies channels 0..S-1 to S..2S-1: the missing lines are copies
        c.rings = {ch: full[ch % half] for ch in range(nch)}
        c.ring_source = "channel lines"
        c.notes.append(f"channels {half}..{nch - 1} taken as copies of 0..{half - 1} "
                       "(ncclTopoPostset duplicates the search's channels); the log lacks "
                       + ", ".join(str(ch) for ch in range(nch) if ch not in full))
    elif n is not None and nch and c._next and all(_cycle(c._next.get(ch, {}), n)
                                                  for ch in range(nch)):
        c.rings = {ch: _cycle(c._next[ch], n) for ch in range(nch)}
        c.ring_source = "ring lines"
    elif n is not None and nch and c._conn and all(_cycle(c._conn.get(ch, {}), n)
                                                  for ch in range(nch)):
        c.rings = {ch: _cycle(c._conn[ch], n) for ch in range(nch)}
        c.ring_source = "connection lines"
    else:
        for ch, (nums, cut) in sorted(c._channel_lines.items()):
            c.prefixes[ch] = nums[:-1] if cut and nums else nums
        if c._channel_lines or c._next:
            have = len(c._ring_ranks)
            c.notes.append(
                f"the log's rings are incomplete (rank 0's ring lines "
                f"{'are cut' if c.cut else 'are missing'}; 'Ring NN' lines of "
                f"{have} rank(s)): give every rank's log (NCCL_DEBUG_SUBSYS=INIT,GRAPH)")


def _read_graph_dump(log: NcclLog, path: Path, text: str) -> None:
    """An ``NCCL_GRAPH_DUMP_FILE``: the ring graph's (id 0, pattern 4) chain per search channel,
    in local GPU indices."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ParityError(f"{path}: malformed NCCL graph dump ({e})") from None
    for g in root.iter("graph"):
        if g.get("id") == "0" or g.get("pattern") == "4":
            chains = []
            for ch in g.iter("channel"):
                try:
                    chains.append(tuple(int(x.get("dev")) for x in ch.iter("gpu")))
                except (TypeError, ValueError):
                    raise ParityError(f"{path}: malformed NCCL graph dump channel") from None
            if not chains or any(sorted(c) != list(range(len(chains[0]))) for c in chains):
                raise ParityError(f"{path}: the ring graph's channels are not permutations of "
                                  "the node's GPUs")
            log.graph_chains = tuple(chains)
            log.graph_crossnic = int(g.get("crossnic", "0") or 0)
            return
    raise ParityError(f"{path}: NCCL graph dump without a ring graph (id 0)")


def _split_spec(spec: str) -> tuple[str, str | None]:
    """``FILE[:COMM]`` -> (FILE, COMM); COMM is ``0x..`` or ``#N``."""
    m = re.match(r"^(.*):(0x[0-9a-fA-F]+|#\d+|split:[^/]*|comm#[\w?]+)$", spec)
    if m and not Path(spec).exists():
        return m.group(1), m.group(2)
    return spec, None


def topology_from_log(spec: str | Path | Sequence, at: Topology | None = None
                      ) -> tuple[Topology, list[str]]:
    """The topology one communicator of a log shows (``FILE[:COMM]``; FILE may be a directory of
    per-rank logs or an NCCL_GRAPH_DUMP_FILE), and notes on what could not be used. ``at``
    (``--at``) gives what the log does not (nodes and GPUs, nics, nccl=, proto=)."""
    comm = None
    if isinstance(spec, (str, Path)):
        path, comm = _split_spec(str(spec))
        paths: Sequence = [path]
    else:
        paths = list(spec)
    log = read_log(paths)
    what = ", ".join(log.paths)
    notes: list[str] = []
    if log.graph_chains is not None and not log.communicators:
        return _from_graph(log, at, what)
    c = log.select(comm)
    if len(log.communicators) > 1:
        notes.append(f"the log has {len(log.communicators)} communicators; using "
                     f"{c.key} ({c.nranks} ranks)" + ("" if comm else " (the largest; pick "
                                                      "another with FILE:COMM)"))
    if c.nnodes and c.local_ranks and c.nnodes * c.local_ranks == c.nranks:
        nodes, gpus = c.nnodes, c.local_ranks
    elif at is not None:
        nodes, gpus = at.nodes, at.gpus
    else:
        raise ParityError(f"--nccl-log {what}: the log does not say nNodes/localRanks of "
                          f"communicator {c.key}; give --at NODESxGPUS as well")
    if c.nranks is not None and nodes * gpus != c.nranks:
        raise ParityError(f"--nccl-log {what}: communicator {c.key} has {c.nranks} ranks, not "
                          f"{nodes}x{gpus}")
    if at is not None and (at.nodes, at.gpus) != (nodes, gpus):
        raise ParityError(f"--nccl-log {what} shows {nodes}x{gpus}, --at says "
                          f"{at.nodes}x{at.gpus}")
    if not c.rings and not c.prefixes and not c.tuning and c.channels is None:
        raise ParityError(f"--nccl-log {what}: no ring lines, channel count or TUNING lines "
                          f"for communicator {c.key} (run with NCCL_DEBUG=INFO "
                          "NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING)")
    notes.extend(c.notes)
    version = c.version or log.version
    base = at or Topology(nodes, gpus)
    nccl = base.nccl or (minor_of(version) if version else None)
    fmts = {r.fmt for r in c.tuning}
    if nccl is None and "2.23" in fmts:
        nccl = "2.23"  # only 2.23 prints "Func: N Bytes -> Algo i proto j time t"
        notes.append("the TUNING lines have the 2.23 format: NCCL 2.23 rules")
    elif nccl is None and ("2.20" in fmts or (c.cut and not any(
            len(p) > 20 for p in c.prefixes.values()))):
        notes.append("the log's TUNING or ring lines have the format of NCCL 2.22 or older and "
                     "it names no version: give nccl=X.Y in --at for its rules (the newest "
                     "modelled are used)")
    if version and rules_for(version) is None:
        notes.append(f"NCCL {version} is outside the modelled releases: predictions are unknown")
    protocol, algorithm = base.protocol, base.algorithm
    proto_env, algo_env = c.env.get("NCCL_PROTO"), c.env.get("NCCL_ALGO")
    if protocol is None and proto_env and proto_env.strip().lower() in {p.lower() for p in (LL, LL128, SIMPLE)}:
        protocol = {p.lower(): p for p in (LL, LL128, SIMPLE)}[proto_env.strip().lower()]
    if algorithm is None and algo_env and algo_env.strip().lower() == "ring":
        algorithm = "Ring"
    for k in sorted(c.env):
        if k in ("NCCL_PROTO", "NCCL_ALGO") and (protocol or algorithm):
            continue
        notes.append(f"the log shows {k}={c.env[k]} (pass it in the run's fingerprint)")
    rings = tuple(c.rings[ch] for ch in sorted(c.rings)) if c.rings else None
    prefixes = None
    if rings is None and c.prefixes:
        nch = max(c.channels or 0, max(c.prefixes) + 1)
        prefixes = tuple(c.prefixes.get(ch, ()) for ch in range(nch))
    if rings is None and log.graph_chains is not None:
        rings, more = _rings_from_graph(log, nodes, gpus, c.channels, nccl)
        notes.extend(more)
    topo = replace(base, nodes=nodes, gpus=gpus,
                   channels=c.channels if rings is None else len(rings),
                   rings=rings, ring_prefixes=prefixes, tuning=tuple(c.tuning) or None,
                   nccl=nccl, protocol=protocol, algorithm=algorithm, source=what)
    return validate(topo, f"--nccl-log {what}"), notes


def _rings_from_graph(log: NcclLog, nodes: int, gpus: int, channels: int | None,
                      nccl: str | None) -> tuple[tuple[tuple[int, ...], ...], list[str]]:
    chains = log.graph_chains
    if len(chains[0]) != gpus:
        raise ParityError(f"NCCL graph dump: {len(chains[0])} GPUs per node, the topology has "
                          f"{gpus}")
    s = len(chains)
    comm = channels or 2 * s
    rules = rules_for(nccl)
    swap = bool(log.graph_crossnic == 2 or (log.graph_crossnic and rules and
                                            rules.odd_swap in ("even-nodes", "crossnic")))
    swap = swap and s % 2 == 0 and nodes > 1
    notes = [f"rings from the NCCL graph dump ({s} search channels, every node the same chains"
             + (", odd nodes swap channels c and c^1" if swap else "") + ")"]
    if channels is None:
        notes.append(f"the log states no channel count: {comm} assumed (ncclTopoPostset doubles "
                     "the search's channels)")
    return build_rings(nodes, gpus, chains, comm, odd_swap=swap), notes


def _from_graph(log: NcclLog, at: Topology | None, what: str) -> tuple[Topology, list[str]]:
    if at is None:
        raise ParityError(f"--nccl-log {what}: a graph dump does not say the node count; give "
                          "--at NODESxGPUS as well")
    rings, notes = _rings_from_graph(log, at.nodes, at.gpus, at.channels, at.nccl)
    topo = replace(at, channels=len(rings), rings=rings, source=what)
    return validate(topo, f"--nccl-log {what}"), notes


parse_nccl_log = topology_from_log
