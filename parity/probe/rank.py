"""The job every rank of a probe runs (``parity nccl-probe --out DIR`` under torchrun or srun).

One rank's work, in order:

1. Its identity from torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or from plain ``srun``
   (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the rendezvous host is the first
   node of ``SLURM_JOB_NODELIST``).
2. With NCCL (the default): ``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS`` with INIT, GRAPH, TUNING
   (and ENV), ``NCCL_DEBUG_FILE=DIR/logs/nccl.rank-NNNNN.log`` and, rank 0,
   ``NCCL_GRAPH_DUMP_FILE=DIR/logs/nccl-graph.xml`` (NCCL 2.6+: ``ncclTopoDumpGraphs`` in
   ``src/graph/search.cc``, written by ``NCCL_GRAPH_DUMP_FILE_RANK``, default 0), set in this
   process before NCCL initializes (NCCL reads them at its first call; its debug file is line
   buffered, ``ncclDebugInit`` in ``src/debug.cc``, so a rank can read back what it printed).
   The process group is initialized eagerly (``device_id``) and one all-reduce of one element
   makes sure the communicator exists. With ``--emulate-nccl TOPOLOGY``: gloo, every
   reduce-scatter and all-reduce summed by parity.capture.nccl_emulation at TOPOLOGY.
3. The topology the model is checked at: rebuilt by rank 0 from every rank's INIT/GRAPH lines
   (``parity.nccl.topology_from_log``; the lines travel by ``gather_object``, so DIR need not be
   shared for this), or the emulated one, or ``--model``; sent to every rank.
4. Every case (parity.probe.cases), ``--repeat`` times: the collective on seeded inputs; a digest
   of each repeat's output; then this rank's share of the output (a reduce-scatter: its own
   segment; an all-reduce: elements [rank*count/n, (rank+1)*count/n)) compared bit for bit
   with the model's emulation of the same inputs (the other ranks' values are regenerated from
   the seed, never sent), under every protocol NCCL may have chosen (the TUNING line says which
   one it did; parity.probe.analysis picks it). The first element that differs is diagnosed
   (parity.probe.orders).
5. ``DIR/ranks/rank-NNNNN.json`` written, the results gathered on rank 0, which writes
   ``DIR/probe.json``, ``DIR/topology.json`` and ``DIR/report.txt`` and prints the report.

The expected sums are computed on the CPU (one IEEE addition per hop in the collective's dtype,
as parity.capture.nccl_emulation computes them; the GPU's additions round the same way).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from parity import __version__
from parity.artifacts import write_json_atomic
from parity.errors import EXIT_INCOMPLETE, ParityError
from parity.nccl import (PROTOCOLS, SIMPLE, Topology, all_reduce_segments, parse_topology,
                         reduce_scatter_segments, ring_families, sum_order, topology_from_log)
from parity.probe import cases as pc
from parity.probe.files import (GRAPH_DUMP, LOGS_DIR, PROBE_FILE, PROBE_FORMAT, RANKS_DIR,
                                REPORT_FILE, TOPOLOGY_FILE, log_name)
from parity.probe.orders import find_orders, ring_candidates

DEBUG_SUBSYS = ("INIT", "GRAPH", "TUNING", "ENV")
ONE_RANK = ("one rank: every reduce-scatter and all-reduce is a copy; nothing about summation "
            "order can show (NCCL refuses two ranks on one GPU)")
GRAPH_DUMP_SINCE = (2, 6)  # NCCL_GRAPH_DUMP_FILE: src/graph/search.cc from v2.6.4-1


@dataclass
class Options:
    """What ``parity nccl-probe`` was asked (every rank gets the same)."""

    out: str
    emulate: str | None = None  # --emulate-nccl TOPOLOGY: gloo, summed as the model says
    model: str | None = None  # --model TOPOLOGY: check this topology instead of the log's
    sizes: list[int] = field(default_factory=lambda: pc.parse_sizes(pc.DEFAULT_SIZES))
    sizes_from: str | None = None
    collectives: list[str] = field(default_factory=lambda: list(pc.COLLECTIVES))
    ops: list[str] = field(default_factory=lambda: list(pc.OPS))
    dtypes: list[str] = field(default_factory=lambda: list(pc.DTYPES))
    repeat: int = 2
    seed: int = 0
    timeout: float = 600.0
    force: bool = False
    argv: list[str] = field(default_factory=list)


@dataclass
class Identity:
    rank: int
    world: int
    local_rank: int
    how: str  # "torchrun" | "srun"


def identity(env=os.environ) -> Identity:
    """This process's rank, from torchrun's variables or plain srun's (which then also sets
    ``MASTER_ADDR``/``MASTER_PORT`` for the env:// rendezvous when they are not set)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Identity(int(env["RANK"]), int(env["WORLD_SIZE"]),
                        int(env.get("LOCAL_RANK", "0")), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return Identity(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                        int(env.get("SLURM_LOCALID", "0")), "srun")
    raise ParityError("nccl-probe runs in every rank of a job: torchrun --nproc_per_node N -m "
                      "parity nccl-probe --out DIR (or srun ... parity nccl-probe --out DIR), or "
                      "give --spec SPEC to start that job with a sweep spec's launcher")


def _scontrol(*argv: str) -> str:
    try:
        r = subprocess.run(["scontrol", *argv], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout if r.returncode == 0 else ""


def srun_rendezvous(env=os.environ) -> dict[str, str]:
    """``MASTER_ADDR`` (the first node of the step, at its ``NodeAddr`` as the SLURM launcher's
    batch script finds it) and ``MASTER_PORT`` (from the job id, the same on every task) for a
    plain ``srun`` job that did not set them."""
    out = {}
    if not env.get("MASTER_ADDR"):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        names = _scontrol("show", "hostnames", nodelist).split()
        if not names:
            raise ParityError("nccl-probe under srun: cannot name the first node (scontrol "
                              "show hostnames failed); set MASTER_ADDR and MASTER_PORT")
        addr = re.search(r"NodeAddr=(\S+)", _scontrol("show", "node", names[0]))
        out["MASTER_ADDR"] = addr.group(1) if addr else names[0]
    if not env.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000)
    return out


def nccl_environment(out: Path, rank: int, version: tuple | None, env=os.environ
                     ) -> tuple[dict[str, str], list[str]]:
    """The NCCL variables this rank sets (and notes on what it overrode)."""
    notes = []
    have = [s.strip().upper() for s in env.get("NCCL_DEBUG_SUBSYS", "").split(",") if s.strip()]
    if have and have[0].startswith("^"):
        notes.append(f"NCCL_DEBUG_SUBSYS={env['NCCL_DEBUG_SUBSYS']} replaced (it excludes "
                     "subsystems)")
        have = []
    subsys = ",".join(dict.fromkeys([*have, *DEBUG_SUBSYS])) if "ALL" not in have else "ALL"
    if env.get("NCCL_DEBUG_FILE"):
        notes.append(f"NCCL_DEBUG_FILE={env['NCCL_DEBUG_FILE']} replaced (the probe reads "
                     "every rank's log from DIR/logs)")
    set_ = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": subsys,
            "NCCL_DEBUG_FILE": str(out / LOGS_DIR / log_name(rank))}
    if version is None or tuple(version[:2]) >= GRAPH_DUMP_SINCE:
        set_["NCCL_GRAPH_DUMP_FILE"] = str(out / LOGS_DIR / GRAPH_DUMP)
    return set_, notes


# ----------------------------------------------------------------------------- the process group


class Comm:
    """The probe's process group, and a record of every reduce-scatter and all-reduce it issues
    (the TUNING lines of rank 0's log are matched to them, parity.probe.analysis)."""

    def __init__(self, ident: Identity, emulate: Topology | None, timeout: float):
        import datetime

        import torch
        import torch.distributed as dist

        self.dist, self.torch = dist, torch
        self.rank, self.world = ident.rank, ident.world
        self.emulated = emulate is not None
        kw = {"timeout": datetime.timedelta(seconds=timeout)}
        if self.emulated:
            from parity.capture import nccl_emulation

            if ident.world > 1:  # one rank: a copy, gloo's own (the emulation needs two)
                nccl_emulation.install(emulate.source or emulate.spec())
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", rank=ident.rank, world_size=ident.world, **kw)
        else:
            if not torch.cuda.is_available():
                raise ParityError("nccl-probe: no CUDA device here; NCCL needs one GPU per rank "
                                  "(on CPU: --emulate-nccl TOPOLOGY)")
            n = torch.cuda.device_count()
            if ident.local_rank >= n:
                raise ParityError(f"nccl-probe: rank {ident.rank} is local rank "
                                  f"{ident.local_rank} but this node has {n} CUDA device(s); "
                                  "NCCL refuses two ranks on one GPU (run one rank per GPU)")
            self.device = torch.device("cuda", ident.local_rank)
            torch.cuda.set_device(self.device)
            import inspect

            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                kw["device_id"] = self.device  # eager: the communicator exists after init
            dist.init_process_group("nccl", rank=ident.rank, world_size=ident.world, **kw)
        self.calls: list[dict] = []  # rank 0's reduce-scatters / all-reduces, in issue order

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def warm_up(self) -> None:
        t = self.torch.ones(1, device=self.device)
        self.all_reduce(t, "sum", "warm-up")
        self.sync()

    def reduce_scatter(self, out, inp, op: str, what: str) -> None:
        self.calls.append({"kind": pc.REDUCE_SCATTER, "count": out.numel(),
                           "elem_size": out.element_size(), "what": what})
        # reduce_scatter_single (torch 2.10+) is the same call as reduce_scatter_tensor
        rs = getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
        rs(out, inp, op=self._op(op))

    def all_reduce(self, t, op: str, what: str) -> None:
        self.calls.append({"kind": pc.ALL_REDUCE, "count": t.numel(),
                           "elem_size": t.element_size(), "what": what})
        self.dist.all_reduce(t, op=self._op(op))

    def _op(self, op: str):
        return self.dist.ReduceOp.AVG if op == "avg" else self.dist.ReduceOp.SUM

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere). NCCL's object gather is sends and
        receives: no reduce-scatter or all-reduce, so rank 0's call list stays what it was."""
        got = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, got, dst=0)
        return got

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the results are written; teardown noise is not ours
            pass


# --------------------------------------------------------------------------------- one case


def _bits(t):
    import torch

    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def digest(t) -> str:
    """xxh3 of a tensor's bytes (repeats and ranks are compared by it)."""
    import torch
    import xxhash

    host = t.detach().reshape(-1).cpu().contiguous()
    return xxhash.xxh3_64_hexdigest(host.view(torch.uint8).numpy().tobytes())


def _rows(seed: int, world: int, lo: int, hi: int, dtype: str, op: str):
    """[world, hi - lo]: every rank's input elements [lo, hi), pre-multiplied for AVG as NCCL's
    PreMulSum does (parity.capture.nccl_emulation.avg_scale)."""
    import torch

    from parity.capture.nccl_emulation import avg_scale

    rows = torch.stack([pc.values(seed, s, lo, hi, dtype) for s in range(world)])
    if op == "avg":
        rows = rows * avg_scale(rows.dtype, world)
    return rows


def expected_share(case: pc.Case, topo: Topology, rank: int, world: int, rows, share_lo: int):
    """The model's bits for this rank's share and, per element, (channel, order): for a
    reduce-scatter rank ``rank``'s whole segment (rows = every rank's row ``rank``), for an
    all-reduce the elements [share_lo, share_lo + rows.shape[1]) of the buffer."""
    from parity.capture.nccl_emulation import ring_sum

    import torch

    n_el = rows.shape[1]
    out = torch.empty(n_el, dtype=rows.dtype)
    where: list[tuple[int, int, int, tuple[int, ...]]] = []  # (lo, hi, channel, order) in share
    if world == 1:  # one rank: NCCL copies (the model has no segment to sum)
        out.copy_(rows[0])
        where.append((0, n_el, 0, (0,)))
    elif case.collective == pc.REDUCE_SCATTER:
        for seg in reduce_scatter_segments(topo, case.count, case.elem_size):
            order = sum_order(seg.order, rank)
            out[seg.lo:seg.hi] = ring_sum(rows, order, seg.lo, seg.hi)
            where.append((seg.lo, seg.hi, seg.channel, order))
    else:
        hi_share = share_lo + n_el
        for seg in all_reduce_segments(topo, case.count, case.elem_size):
            a, b = max(seg.lo, share_lo), min(seg.hi, hi_share)
            if a >= b:
                continue
            out[a - share_lo:b - share_lo] = ring_sum(rows, seg.order, a - share_lo,
                                                      b - share_lo)
            where.append((a - share_lo, b - share_lo, seg.channel, seg.order))
    return out, where


def protocol_variants(topo: Topology, case: pc.Case, protocols) -> list[tuple[list[str], Topology]]:
    """The topologies to emulate this case under, one per distinct channel layout: protocols
    whose split comes out the same share one emulation. A protocol of None: the one the
    model's primary scenario picks (what the emulation runs: a pinned one, a log row's, else
    Simple)."""
    from parity.nccl import primary_scenario

    groups: dict[tuple, tuple[list[str], Topology]] = {}
    for p in protocols:
        t = topo if p is None else replace(topo, protocol=p)
        s = primary_scenario(t, case.collective, case.count, case.elem_size)
        key = s.segments if s is not None else ()
        name = p or (s.protocol if s is not None else SIMPLE)
        if key in groups:
            groups[key][0].append(name)
        else:
            groups[key] = ([name], t)
    return list(groups.values())


def diagnose(case: pc.Case, rank: int, world: int, rows, observed, expected, i: int,
             where, share_lo: int, rings_sets: list[tuple[str, tuple]]) -> dict:
    """What the first differing element of this rank's share says: its index, the model's order,
    both sums' bits, and which orders reproduce NCCL's bits."""
    chan, order = next(((c, o) for lo, hi, c, o in where if lo <= i < hi), (None, ()))
    cands, seen = [], set()
    owner = rank if case.collective == pc.REDUCE_SCATTER else None
    for label, rings in rings_sets:  # the cluster's own rings first, then the checked ones
        cands.extend(ring_candidates(rings, label, owner, seen))
    found = find_orders(rows[:, i].contiguous(), observed[i], cands)
    element = i if case.collective == pc.REDUCE_SCATTER else share_lo + i
    return {"rank": rank, "element": element,
            "where": ("rank's output offset" if case.collective == pc.REDUCE_SCATTER
                      else "buffer offset"),
            "input_offset": (rank * case.count + i) if case.collective == pc.REDUCE_SCATTER
            else share_lo + i,
            "channel": chan, "expected_order": list(order),
            "expected": _hex(expected[i]), "observed": _hex(observed[i]),
            "expected_value": float(expected[i]), "observed_value": float(observed[i]),
            "inputs": [_hex(v) for v in rows[:, i]],
            "reproduced_by": found}


def _hex(v) -> str:
    b = _bits(v.reshape(1))[0].item() & ((1 << (8 * v.element_size())) - 1)
    return f"0x{b:0{2 * v.element_size()}x}"


def run_case(comm: Comm, case: pc.Case, seed: int, repeat: int, topo: Topology, protocols,
             rings_sets) -> dict:
    import torch

    rank, world = comm.rank, comm.world
    t0 = time.perf_counter()
    inp = pc.values(seed, rank, 0, case.input_count(world), case.dtype).to(comm.device)
    digests, kept = [], None
    for r in range(repeat):
        what = f"case {case.index} repeat {r}"
        if case.collective == pc.REDUCE_SCATTER:
            out = torch.empty(case.count, dtype=inp.dtype, device=comm.device)
            comm.reduce_scatter(out, inp, case.op, what)
        else:
            out = inp.clone()
            comm.all_reduce(out, case.op, what)
        comm.sync()
        digests.append(digest(out))
        if kept is None:
            kept = out
        else:
            del out
    seconds = time.perf_counter() - t0
    if case.collective == pc.REDUCE_SCATTER:
        share_lo, share_hi = 0, case.count
        rows = _rows(seed, world, rank * case.count, (rank + 1) * case.count, case.dtype, case.op)
        observed = kept.cpu()
    else:
        share_lo, share_hi = rank * case.count // world, (rank + 1) * case.count // world
        rows = _rows(seed, world, share_lo, share_hi, case.dtype, case.op)
        observed = kept[share_lo:share_hi].cpu()
    del kept, inp
    variants = {}
    for names, t in protocol_variants(topo, case, protocols):
        exp, where = expected_share(case, t, rank, world, rows, share_lo)
        ne = _bits(observed) != _bits(exp)
        n_bad = int(ne.sum().item())
        entry = {"protocols": names, "mismatches": n_bad,
                 "channels": sorted({c for _, _, c, _ in where}),
                 "first": None, "diagnosis": None}
        if n_bad:
            i = int(ne.nonzero()[0].item())
            entry["first"] = i
            entry["diagnosis"] = diagnose(case, rank, world, rows, observed, exp, i, where,
                                          share_lo, rings_sets)
        for p in names:
            variants[p] = entry
    return {"case": case.index, "digests": digests, "share": [share_lo, share_hi],
            "seconds": round(seconds, 6), "variants": variants}


# ---------------------------------------------------------------------------- the whole job


def materialize(topo: Topology) -> tuple[Topology, str]:
    """A topology whose rings are written out: the first ring family the model would use (the
    one the emulation runs), and that family's name and assumption."""
    if topo.rings is not None:
        return topo, "rings given"
    fam = ring_families(topo)[0]
    what = fam.name + (f" ({fam.assumption})" if fam.assumption else "")
    return replace(topo, rings=tuple(fam.rings), channels=len(fam.rings)), what


def _rank_meta(comm: Comm, ident: Identity, set_env: dict, env_notes: list[str]) -> dict:
    import torch

    meta = {"rank": ident.rank, "local_rank": ident.local_rank, "host": socket.gethostname(),
            "pid": os.getpid(), "launcher": ident.how, "torch": torch.__version__,
            "parity": __version__, "device": str(comm.device),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
            "set_env": set_env, "notes": env_notes}
    if comm.device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(comm.device)
        meta["gpus_on_host"] = torch.cuda.device_count()
        v = torch.cuda.nccl.version()
        meta["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return meta


def _read_own_log(out: Path, rank: int) -> str:
    try:
        return (out / LOGS_DIR / log_name(rank)).read_text(errors="replace")
    except OSError:
        return ""


def run(opts: Options) -> int:
    """Run the probe in this rank; rank 0 also analyses and reports. Returns the exit code
    every rank exits with (0: the probe ran and wrote its files, whatever the agreement)."""
    ident = identity()
    out = Path(opts.out).resolve()
    if ident.how == "srun":
        os.environ.update(srun_rendezvous())
    os.environ.setdefault("RANK", str(ident.rank))
    os.environ.setdefault("WORLD_SIZE", str(ident.world))
    os.environ.setdefault("LOCAL_RANK", str(ident.local_rank))
    emulate = None
    if opts.emulate:
        emulate = parse_topology(opts.emulate)
        if emulate.world != ident.world:
            raise ParityError(f"--emulate-nccl {emulate.spec()} needs {emulate.world} ranks "
                              f"(NODES x GPUS); this job has {ident.world}")
    checked = parse_topology(opts.model) if opts.model else None
    if checked is not None and checked.world != ident.world:
        raise ParityError(f"--model {checked.spec()} has {checked.world} ranks; this job has "
                          f"{ident.world}")
    for sub in (LOGS_DIR, RANKS_DIR):
        (out / sub).mkdir(parents=True, exist_ok=True)
    set_env, env_notes = {}, []
    if emulate is None:
        if "%" in str(out):
            raise ParityError(f"nccl-probe: --out {out} contains '%' (NCCL_DEBUG_FILE would "
                              "read it as a pattern)")
        version = None
        try:
            import torch

            version = torch.cuda.nccl.version()
        except Exception:  # noqa: BLE001 - no NCCL in this torch: init says so below
            pass
        set_env, env_notes = nccl_environment(out, ident.rank, version)
        os.environ.update(set_env)
    recorded, size_notes = [], []
    if opts.sizes_from:
        recorded, size_notes = pc.sizes_from_run(opts.sizes_from, ident.world)
    cases = pc.build_cases(opts.sizes, ident.world, opts.collectives, opts.ops, opts.dtypes,
                           recorded)
    started = time.time()
    try:
        comm = Comm(ident, emulate, opts.timeout)
    except (RuntimeError, ValueError) as e:  # NCCL / the rendezvous: the job failed, not parity
        raise ParityError(f"nccl-probe: rank {ident.rank}: the process group could not start: "
                          f"{_first_line(e)}", EXIT_INCOMPLETE) from None
    try:
        return _run(comm, ident, opts, out, emulate, checked, cases, set_env, env_notes,
                    size_notes, started)
    except ParityError:
        raise
    except RuntimeError as e:  # a collective failed (NCCL error, a peer gone, a timeout)
        raise ParityError(f"nccl-probe: rank {ident.rank}: {_first_line(e)}",
                          EXIT_INCOMPLETE) from None
    finally:
        comm.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _run(comm: Comm, ident: Identity, opts: Options, out: Path, emulate, checked, cases,
         set_env, env_notes, size_notes, started) -> int:
    from parity.probe.analysis import analyse_and_report

    busy = None
    if ident.rank == 0 and not opts.force and (out / PROBE_FILE).exists():
        busy = f"nccl-probe: {out} already holds a probe ({PROBE_FILE}); give --force or another --out"
    busy = comm.broadcast(busy)
    if busy:
        raise ParityError(busy)
    if ident.rank == 0:
        for name in (PROBE_FILE, TOPOLOGY_FILE, REPORT_FILE):
            (out / name).unlink(missing_ok=True)
    if not comm.emulated:
        comm.warm_up()
    meta = _rank_meta(comm, ident, set_env, env_notes)
    # the topology the model is checked at, decided on rank 0 and sent to every rank
    plan = None
    init_logs = comm.gather(None if comm.emulated else _read_own_log(out, ident.rank))
    if ident.rank == 0:
        try:
            plan = _plan(out, emulate, checked, init_logs, comm.world)
        except ParityError as e:  # every rank stops with it (not waiting for rank 0 in vain)
            plan = {"error": str(e)}
    plan = comm.broadcast(plan)
    if plan.get("error"):
        raise ParityError(plan["error"])
    topo = Topology.from_dict(plan["checked"])
    # emulated: exactly what the emulation runs; NCCL: every protocol (its TUNING line says
    # which one ran)
    protocols = [None] if (comm.emulated or topo.protocol) else list(PROTOCOLS)
    rings_sets = [("channel", topo.rings)]
    if plan.get("cluster_rings") and plan["cluster_rings"] != plan["checked"].get("rings"):
        rings_sets.insert(0, ("cluster channel",
                              tuple(tuple(r) for r in plan["cluster_rings"])))
    results = []
    for k, case in enumerate(cases):
        results.append(run_case(comm, case, opts.seed, opts.repeat, topo, protocols, rings_sets))
        if ident.rank == 0 and (k + 1) % 16 == 0:
            print(f"parity: nccl-probe: {k + 1}/{len(cases)} cases", file=sys.stderr, flush=True)
    mine = {"meta": meta, "results": results}
    write_json_atomic(out / RANKS_DIR / f"rank-{ident.rank:05d}.json", mine)
    every = comm.gather(mine)
    if ident.rank != 0:
        return 0
    record = {"format": PROBE_FORMAT, "parity": __version__, "argv": opts.argv,
              "started": started, "ended": time.time(), "world": comm.world,
              "backend": "gloo (emulated)" if comm.emulated else "nccl",
              "emulate": (emulate.source or emulate.spec()) if emulate is not None else None,
              "model": opts.model, "seed": opts.seed, "repeat": opts.repeat,
              "sizes": opts.sizes, "sizes_from": opts.sizes_from, "size_notes": size_notes,
              "protocols_checked": [p or "primary" for p in protocols], "cases": [c.to_dict() for c in cases],
              "plan": plan, "calls": comm.calls,
              "ranks": [e["meta"] for e in every],
              "results": [[e["results"][k] for e in every] for k in range(len(cases))]}
    return analyse_and_report(out, record)


def _one_rank_plan(out: Path, text: str, log_files: list[str]) -> dict:
    """One rank (one GPU): NCCL copies, there is no ring to rebuild; the release from the log."""
    from parity.nccl.versions import minor_of

    m = re.search(r"NCCL version (\d+\.\d+\.\d+)", text)
    topo = Topology(1, 1, channels=1, rings=((0,),), nccl=minor_of(m.group(1)) if m else None)
    return _plan_dict(out, topo, topo, [ONE_RANK], log_files)


def _plan(out: Path, emulate: Topology | None, checked: Topology | None, init_logs,
          world: int) -> dict:
    """Rank 0: the topology the cluster showed (the log's, or the emulated one) and the one the
    model is checked at (``--model``, else the cluster's)."""
    notes: list[str] = []
    log_files: list[str] = []
    if emulate is not None:
        cluster, family = materialize(emulate)
        cluster = replace(cluster, algorithm="Ring", source=None)
        notes.append(f"emulated cluster {emulate.source or emulate.spec()}: rings of the "
                     f"{family} family")
    else:
        for r, text in enumerate(init_logs or []):
            p = out / LOGS_DIR / log_name(r)
            if not p.exists() and text:  # DIR not shared between nodes: keep rank r's lines
                p.write_text(text)
            if p.exists():
                log_files.append(str(p))
        if not log_files:
            raise ParityError(f"nccl-probe: no NCCL log was written in {out / LOGS_DIR} "
                              "(NCCL_DEBUG_FILE not honoured?)")
        if world == 1:
            return _one_rank_plan(out, init_logs[0] if init_logs else "", log_files)
        cluster, log_notes = topology_from_log(log_files)
        notes.extend(log_notes)
        cluster = replace(cluster, tuning=None, source=None)
        if cluster.rings is None:  # cut lines, no Ring lines: the family they agree with
            cluster, family = materialize(cluster)
            notes.append(f"the logs do not hold every ring: checked at the {family} family "
                         "(an assumption; NCCL_DEBUG_SUBSYS=GRAPH prints every rank's rings)")
    if checked is not None:
        model, family = materialize(checked)
        if emulate is not None and model.algorithm is None:
            model = replace(model, algorithm="Ring")  # the emulated cluster runs only Ring
        notes.append(f"checked at --model {checked.source or checked.spec()}: rings of the "
                     f"{family} family")
    else:
        model = cluster
    if world == 1:
        notes.append(ONE_RANK)
    return _plan_dict(out, cluster, model, notes, log_files)


def _plan_dict(out: Path, cluster: Topology, model: Topology, notes: list[str],
               log_files: list[str]) -> dict:
    return {"cluster": cluster.to_dict(), "checked": replace(model, source=None).to_dict(),
            "cluster_rings": [list(r) for r in cluster.rings] if cluster.rings else None,
            "notes": notes, "log_files": [os.path.relpath(f, out) for f in log_files]}
