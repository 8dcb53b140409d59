"""``parity bisect``: rerun both sides to the divergent step and name the first op that differs.

Three parts, in this order:

1. :func:`plan_rerun` reads what ``parity exec`` recorded in a side's ``run.json`` (argv, cwd)
   and turns it into a command that can run again here, or refuses with one line naming what is
   missing (no ``run.json``, no argv, a multi-node or SLURM launch, a rendezvous on another
   host). Only the torchrun options that would collide (rendezvous port, log directory) change.
2. :func:`rerun` runs it under ``parity exec`` with ``PARITY_OPS_STEP=K`` and
   ``PARITY_OPS_EXIT=1``: capture/ops.py records every op of step K and the job ends after it.
3. :func:`align` pairs the two op streams of one rank and :func:`first_difference` finds the
   first pair, in the reference's execution order (forward, backward, gradients, optimizer),
   whose outputs differ. Ops are paired by phase, module, op name and output shapes/dtypes:
   first pairs with identical outputs (evidence that they are the same computation, wherever
   the compiler moved them), then, for a key with the same number of ops left on both sides,
   the rest in order. Whatever is left (a key with different counts: fused, recomputed,
   decomposed or FSDP-internal ops) is reported as not aligned, with counts, never guessed.
   Communication and bucket copies are never compared op by op (their outputs are not ready
   before the wait, and bucketing differs by design): the gradients the optimizer consumes
   (``parity.grad`` records) are where a communication difference shows.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from parity.artifacts import write_json_atomic
from parity.capture import env_record
from parity.errors import (EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE,
                           ParityError)
from parity.rundir import ops_ranks, read_ops
from parity.text import ranges

SCHEMA_VERSION = 1  # bisect.json: parity/schemas/bisect.schema.json
GRAD_OP = "parity.grad"
SIDES = ("a", "b")
SKIP_NAMESPACES = ("profiler",)
# Allocations: their output is whatever memory held (not a value), and in-place resizes.
ALLOC_OPS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize",
             "set"}
UNSUPPORTED_LAUNCHERS = ("srun", "sbatch", "salloc", "mpirun", "mpiexec")
TORCHRUN_BOOL_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


# ------------------------------------------------------------------------------ 1. rerun plan
@dataclass
class RerunPlan:
    side: str  # "a" | "b"
    run_dir: Path
    argv: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    capture: dict = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)  # what was rewritten, for the report
    recorded_env: dict | None = None  # run.json "env" (capture/env_record.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_start(argv: list[str]) -> int | None:
    """Index of the first torchrun option in ``argv``, or None when it is not torchrun."""
    for i, a in enumerate(argv[:4]):
        if os.path.basename(a) == "torchrun":
            return i + 1
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] in ("torch.distributed.run",
                                                                "torch.distributed.launch"):
            return i + 2
    return None


def _rewrite_torchrun(argv: list[str], label: str, log_dir: Path) -> tuple[list[str], list[str]]:
    """Fresh rendezvous port and log directory; refuse a rendezvous on another host."""
    start = _torchrun_start(argv)
    if start is None:
        return list(argv), []
    out = list(argv[:start])
    changed: list[str] = []
    i = start
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--module") or not a.startswith("-"):
            break
        if a in TORCHRUN_BOOL_FLAGS:
            out.append(a)
            i += 1
            continue
        name, eq, value = a.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        step = 1 if eq else 2
        key = name.replace("_", "-")
        if key == "--rdzv-endpoint":
            host = value.rsplit(":", 1)[0] if ":" in value else value
            if host.strip("[]") not in LOCAL_HOSTS and host != socket.gethostname():
                raise ParityError(f"{label}: recorded with a rendezvous on {host} (--rdzv-endpoint "
                                  f"{value}): bisect reruns single-host jobs only", EXIT_USAGE)
            value = f"{host or '127.0.0.1'}:{_free_port()}"
            changed.append(f"--rdzv-endpoint {value}")
        elif key == "--master-port":
            value = str(_free_port())
            changed.append(f"--master-port {value}")
        elif key == "--log-dir":
            value = str(log_dir)
            changed.append(f"--log-dir {value}")
        elif key == "--nnodes" and value.split(":")[-1] not in ("1", ""):
            raise ParityError(f"{label}: recorded as a {value}-node torchrun: bisect reruns "
                              "single-host jobs only", EXIT_USAGE)
        out += [f"{name}={value}"] if eq else [name, value]
        i += step
    return out + argv[i:], changed


def plan_rerun(side: str, run_dir: str | os.PathLike, out_dir: Path,
               env: dict[str, str] | None = None) -> RerunPlan:
    """What to run again for one side, or a ParityError (exit 2) naming what is missing."""
    label = f"{side.upper()} ({run_dir})"
    d = Path(run_dir)
    if not d.is_dir():
        raise ParityError(f"{label}: not a directory", EXIT_USAGE)
    rj = d / "run.json"
    if not rj.is_file():
        if (d / "nodes").is_dir():
            raise ParityError(f"{label}: recorded by a multi-node launch (one run.json per node "
                              f"under {d / 'nodes'}): bisect reruns a single recorded command",
                              EXIT_USAGE)
        raise ParityError(f"{label}: no command recorded ({rj} is missing; bisect reruns what "
                          "`parity exec` recorded)", EXIT_USAGE)
    try:
        run = json.loads(rj.read_text())
    except (OSError, ValueError) as e:
        raise ParityError(f"{label}: {rj} is unreadable ({e})", EXIT_USAGE) from None
    argv = run.get("argv") if isinstance(run, dict) else None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ParityError(f"{label}: {rj} records no command (argv)", EXIT_USAGE)
    prog = os.path.basename(argv[0])
    if prog in UNSUPPORTED_LAUNCHERS:
        raise ParityError(f"{label}: recorded under {prog}, a launcher bisect cannot reproduce "
                          "here (rerun it by hand with PARITY_OPS_STEP set, docs/bisect.md)",
                          EXIT_USAGE)
    cwd = run.get("cwd") or os.getcwd()
    if not os.path.isdir(cwd):
        raise ParityError(f"{label}: recorded working directory {cwd} does not exist", EXIT_USAGE)
    argv, changed = _rewrite_torchrun(argv, label, out_dir / "logs" / side)
    capture = run.get("capture") if isinstance(run.get("capture"), dict) else {}
    plan = RerunPlan(side, d, argv, cwd, dict(env or {}), capture, changed)
    plan.recorded_env = run.get("env")
    return plan


@contextlib.contextmanager
def _redirected(log_path: Path):
    """Send this process's (and so the job's) stdout/stderr to ``log_path`` meanwhile."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with open(log_path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def rerun(plan: RerunPlan, out_dir: Path, step: int) -> tuple[int, Path, Path]:
    """Run the plan under ``parity exec`` with op capture at ``step``; (exit code, run dir, log)."""
    from parity.capture.launch import exec_command

    run_dir = out_dir / plan.side
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log = out_dir / "logs" / f"{plan.side}.log"
    extra = {**plan.env, "PARITY_OPS_STEP": str(step), "PARITY_OPS_EXIT": "1"}
    saved_env = {k: os.environ.get(k) for k in extra}
    old_cwd = os.getcwd()
    cap = plan.capture
    try:
        os.environ.update(extra)
        base, _ = env_record.restore(plan.recorded_env, os.environ)
        if base is not None:
            base.update(extra)
        os.chdir(plan.cwd)
        with _redirected(log):
            rc = exec_command(run_dir, plan.argv, every=1, grads=True, force=True, base_env=base,
                              manifests=bool(cap.get("manifests", True)),
                              hasher=cap.get("hasher") if cap.get("hasher") in ("auto", "xxh3",
                                                                                "device") else "auto",
                              step_on=(cap.get("step_on") if isinstance(cap.get("step_on"), str)
                                       else None))
    finally:
        os.chdir(old_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, run_dir, log


# -------------------------------------------------------------------------------- 2. records
def base_op(name: str) -> str:
    """``aten.mul_.Tensor`` -> ``mul`` (namespace, overload and the in-place mark dropped)."""
    if name == GRAD_OP:
        return "grad"
    parts = name.split(".")
    op = parts[1] if len(parts) >= 2 else parts[0]
    return op[:-1] if op.endswith("_") and not op.endswith("__") else op


def comparable(rec: dict) -> bool:
    """A record whose output is a value to compare (compute ops with hashed outputs, grads)."""
    if rec.get("kind") == "grad":
        return True
    if rec.get("kind") != "compute":
        return False
    if rec["op"].split(".", 1)[0] in SKIP_NAMESPACES or base_op(rec["op"]) in ALLOC_OPS:
        return False
    outs = rec.get("out") or []
    return bool(outs) and all(o.get("hash") for o in outs)


def _key(rec: dict) -> tuple:
    if rec.get("kind") == "grad":
        return ("backward", "grad", rec.get("param"))
    sig = tuple((tuple(o["shape"]), o["dtype"]) for o in rec["out"])
    return (rec["phase"], rec["module"], base_op(rec["op"]), sig)


def _value(rec: dict) -> tuple:
    return tuple(o.get("hash") for o in rec.get("out") or ())


# --------------------------------------------------------------------------------- 3. align
@dataclass
class OpAlignment:
    """Ops of one rank's two op streams paired by what they compute (diff.hashes'
    ``ParamAlignment`` pairs parameter table rows instead)."""

    pairs: list[tuple[dict, dict]]  # (a, b), a's order
    a_only: list[dict]
    b_only: list[dict]
    a_skipped: int  # views, allocations, communication (not compared op by op)
    b_skipped: int
    a_comm: int
    b_comm: int


def align(a_recs: list[dict], b_recs: list[dict]) -> OpAlignment:
    ca = [r for r in a_recs if comparable(r)]
    cb = [r for r in b_recs if comparable(r)]
    groups_a: dict[tuple, list[dict]] = collections.defaultdict(list)
    groups_b: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in ca:
        groups_a[_key(r)].append(r)
    for r in cb:
        groups_b[_key(r)].append(r)
    pairs: list[tuple[dict, dict]] = []
    left_a: list[dict] = []
    left_b: list[dict] = []
    for key in list(groups_a) + [k for k in groups_b if k not in groups_a]:
        la, lb = groups_a.get(key, []), groups_b.get(key, [])
        ra, rb = _pair_equal(la, lb, pairs)
        if ra and len(ra) == len(rb):
            pairs.extend(zip(ra, rb))
        else:
            left_a += ra
            left_b += rb
    # A module attributed differently on the two sides (a backward op, a graph node without a
    # module stack): pair only where the outputs are identical, never by position.
    by_value: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in left_b:
        by_value[(r.get("phase"), base_op(r["op"]), _value(r))].append(r)
    a_only = []
    for r in left_a:
        cands = by_value.get((r.get("phase"), base_op(r["op"]), _value(r)))
        if cands:
            pairs.append((r, cands.pop(0)))
        else:
            a_only.append(r)
    used_b = {id(b) for _, b in pairs}
    b_only = [r for r in left_b if id(r) not in used_b]
    pairs.sort(key=lambda p: p[0]["i"])
    a_only.sort(key=lambda r: r["i"])
    b_only.sort(key=lambda r: r["i"])
    return OpAlignment(pairs, a_only, b_only,
                     a_skipped=len(a_recs) - len(ca), b_skipped=len(b_recs) - len(cb),
                     a_comm=sum(1 for r in a_recs if r.get("kind") == "comm"),
                     b_comm=sum(1 for r in b_recs if r.get("kind") == "comm"))


def _pair_equal(la: list[dict], lb: list[dict], pairs: list) -> tuple[list[dict], list[dict]]:
    """Pair ops of one key whose outputs are identical; return what is left on each side."""
    waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    for r in lb:
        waiting[_value(r)].append(r)
    rest_a = []
    used = set()
    for r in la:
        q = waiting.get(_value(r))
        if q:
            b = q.popleft()
            used.add(id(b))
            pairs.append((r, b))
        else:
            rest_a.append(r)
    return rest_a, [r for r in lb if id(r) not in used]


# ------------------------------------------------------------------------------- 4. verdict
def _describe(rec: dict | None) -> dict | None:
    if rec is None:
        return None
    d = {"index": rec["i"], "op": rec["op"], "module": rec.get("module", ""),
         "phase": rec.get("phase"),
         "outputs": [{"shape": o["shape"], "dtype": o["dtype"]} for o in rec.get("out") or ()],
         "hashes": [o.get("hash") for o in rec.get("out") or ()]}
    for k in ("node", "param"):
        if rec.get(k):
            d[k] = rec[k]
    return d


def _hashes(recs: list[dict]) -> set[str]:
    return {o["hash"] for r in recs for o in r.get("out") or () if o.get("hash")}


def _opaque_records(recs: list[dict], i: int | None, other: set[str] | None = None) -> list[dict]:
    """The first record of each region not recorded op by op (inductor graphs, compiled graphs
    in an eager process) before index ``i`` (None: anywhere), in order. With ``other`` (every
    output hash the other side recorded), a region whose outputs all appear there computed
    the same values and is left out: the difference cannot enter there."""
    out: list[dict] = []
    names: set[str] = set()
    for r in recs:
        if i is not None and r["i"] >= i:
            break
        if r.get("kind") != "opaque":
            continue
        outs = [o.get("hash") for o in r.get("out") or ()]
        if other is not None and outs and all(h and h in other for h in outs):
            continue
        if r["op"] not in names:
            names.add(r["op"])
            out.append(r)
    return out


def _opaque_before(recs: list[dict], i: int | None, other: set[str] | None = None) -> list[str]:
    return [r["op"] for r in _opaque_records(recs, i, other)]


def _entering(a: dict, b: dict, a_recs: list[dict], b_recs: list[dict]) -> list[dict]:
    """The regions not recorded op by op, before the first differing pair on their side, that
    computed values the other side never had: where the difference can enter unseen. Each
    ``{"region", "side", "module"}``, A's first, in execution order."""
    return [{"region": r["op"], "side": side, "module": r.get("module") or ""}
            for side, recs, i, other in (("A", a_recs, a["i"], b_recs), ("B", b_recs, b["i"], a_recs))
            for r in _opaque_records(recs, i, _hashes(other))]


def _regions(recs: list[dict]) -> list[str]:
    """Every region not recorded op by op, by name: opaque records and compiled functions
    (one record each, compared by their outputs)."""
    names = _opaque_before(recs, None)
    for r in recs:
        node = str(r.get("node") or "")
        if node.startswith("compiled ") and node not in names:
            names.append(node)
    return names


def _grad_verdict(a: dict, b: dict, a_recs: list[dict], b_recs: list[dict], fb_before: int,
                  layouts: str | None) -> dict:
    """Where a difference first seen in a gradient enters, as far as the records tell."""
    entering = _entering(a, b, a_recs, b_recs)
    if fb_before:
        head = (f"it is a gradient as the optimizer consumes it, and the {fb_before} aligned "
                "forward/backward op(s) before it matched")
    elif entering:
        head = ("it is a gradient as the optimizer consumes it; no forward/backward op before it "
                "could be compared op by op")
    else:
        return {"differed": None, "detail": "it is a gradient as the optimizer consumes it; no "
                "forward/backward op before it could be compared, so the ops do not tell where "
                "the difference enters"}
    if entering:
        opaque = [f"{e['region']} ({e['side']})" for e in entering]
        where = "; ".join(opaque[:4]) + (f" (+{len(opaque) - 4} more)" if len(opaque) > 4 else "")
        tail = ("" if layouts == "identical" else
                ", or in the reduce-scatter or its bucketing (`parity diff` shows the layouts)")
        return {"differed": None, "detail": f"{head}: the difference enters in a region not "
                f"recorded op by op: {where}{tail}"}
    if layouts == "identical":
        return {"differed": None, "detail": f"{head}: the difference enters between the backward "
                "computation and the optimizer, in the gradient reduction (the bucket layouts "
                "are identical: not the bucketing, but how the reduction sums, e.g. a gradient "
                "reduce-scattered in chunks; `parity diff` explains it)"}
    return {"differed": None, "detail": f"{head}: the difference enters between the backward "
            "computation and the optimizer, i.e. in the reduce-scatter or its bucketing "
            "(communication is not compared op by op; `parity diff` shows the bucket layouts)"}


# ops whose output comes from a random generator, not from their inputs alone (round 13b)
RANDOM_OPS = frozenset({
    "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
    "randperm", "normal", "uniform", "random", "exponential", "geometric", "cauchy",
    "log_normal", "multinomial", "poisson", "binomial", "native_dropout", "dropout",
    "_fused_dropout", "feature_dropout", "alpha_dropout", "rrelu_with_noise",
    "inductor_seeds", "inductor_random", "inductor_randint", "philox_rand"})


def _random_fill(op: str) -> bool:
    """An in-place random op (``aten.bernoulli_.float``, ``normal_``...): it overwrites its first
    input, whose contents (often an uninitialised ``empty_like``) do not matter."""
    parts = op.split(".")
    return len(parts) >= 2 and parts[1].endswith("_") and base_op(op) in RANDOM_OPS


def _inputs_verdict(a: dict, b: dict, a_recs: list[dict]) -> dict:
    a_in, b_in = a.get("in"), b.get("in")
    if a_in is None or b_in is None:
        return {"differed": None, "detail": "inputs were not hashed"}
    skip = 1 if _random_fill(a["op"]) and _random_fill(b["op"]) else 0
    # dropout's mask is bernoulli_ into an empty tensor: the garbage it held read as "values A
    # never had before this op: the difference arose earlier" (round 13b)
    a_in, b_in = a_in[skip:], b_in[skip:]
    if a_in == b_in and base_op(a["op"]) in RANDOM_OPS:
        return {"differed": False, "random": True, "detail": "no: what it reads is identical on "
                f"both sides (a tensor it fills in place is not read), and {base_op(a['op'])} is "
                "a random op: its output comes from the "
                "random generator's state, which differed when it ran (another seed, or a draw "
                "one side made and the other did not; `parity diff` says from which step the "
                "states differ)"}
    if a_in == b_in:
        return {"differed": False, "detail": "no: identical inputs on both sides; this op "
                "itself computed a different result"}
    known = set()
    for r in a_recs:
        if r["i"] >= a["i"]:
            break
        known.update(h for h in r.get("in") or () if h)
        known.update(o.get("hash") for o in r.get("out") or () if o.get("hash"))
    unknown = [k for k, h in enumerate(b_in, skip) if h and h not in known]
    if not unknown and sorted(h for h in a_in if h) != sorted(h for h in b_in if h):
        return {"differed": True, "reordered": True,
                "detail": "its inputs differ, but each input B used is a value A also had "
                "before this op: the same values combined in another order"}
    if not unknown:
        return {"differed": True, "detail": "its inputs are the same values in another "
                "argument order"}
    return {"differed": True, "detail": f"yes: B's input(s) {', '.join(map(str, unknown))} are "
            "values A never had before this op: the difference arose earlier, in ops that could "
            "not be aligned or in communication"}


FEW_OPS = 10  # fewer forward/backward ops than this (or 10% of the other side's): too few


def _too_few(a_recs: list[dict], b_recs: list[dict]) -> dict | None:
    """Comparable forward/backward ops per side, and which side recorded too few for a
    comparison to mean anything (None when both recorded enough)."""
    n = {side: sum(1 for r in recs if comparable(r) and r.get("phase") in ("forward", "backward")
                   and r.get("kind") != "grad")
         for side, recs in (("a", a_recs), ("b", b_recs))}
    few = [s for s in SIDES if n[s] < max(FEW_OPS, n["b" if s == "a" else "a"] // 10)]
    return {"a": n["a"], "b": n["b"], "sides": few} if few else None


def analyse_rank(a_recs: list[dict], b_recs: list[dict], layouts: str | None = None) -> dict:
    al = align(a_recs, b_recs)
    differing = [(a, b) for a, b in al.pairs if _value(a) != _value(b)]
    equal = len(al.pairs) - len(differing)
    out: dict = {"aligned": len(al.pairs), "equal": equal,
                 "not_aligned": {"a": len(al.a_only), "b": len(al.b_only)},
                 "not_compared": {"a": al.a_skipped, "b": al.b_skipped},
                 "communication": {"a": al.a_comm, "b": al.b_comm},
                 "communication_ops": {side: dict(collections.Counter(
                     r["op"] for r in recs if r.get("kind") == "comm").most_common())
                     for side, recs in (("a", a_recs), ("b", b_recs))},
                 "opaque_graph_runs": {"a": sum(1 for r in a_recs if r.get("kind") == "opaque"),
                                       "b": sum(1 for r in b_recs if r.get("kind") == "opaque")},
                 "unaligned_groups": _groups(al.a_only, al.b_only),
                 "opaque_regions": {"a": _regions(a_recs), "b": _regions(b_recs)},
                 "too_few_ops": _too_few(a_recs, b_recs)}
    if not differing:
        out.update(verdict="no_aligned_difference" if (al.a_only or al.b_only) else "match",
                   first=None)
        return out
    a, b = differing[0]
    last = None
    for pa, pb in al.pairs:
        if pa["i"] >= a["i"]:
            break
        if _value(pa) == _value(pb):
            last = (pa, pb)
    before = [r for r in al.a_only if r["i"] < a["i"]]
    inputs = (_grad_verdict(a, b, a_recs, b_recs, sum(
        1 for pa, _ in al.pairs if pa["i"] < a["i"] and pa.get("kind") != "grad"), layouts)
        if a.get("kind") == "grad" else _inputs_verdict(a, b, a_recs))
    # Where the difference enters when the first differing op did not compute it itself: the
    # first region not recorded op by op whose outputs the other side never had.
    entering = _entering(a, b, a_recs, b_recs) if inputs.get("differed") is not False else []
    if entering and inputs.get("differed") and not inputs.get("reordered"):
        e = entering[0]
        inputs = {**inputs, "detail": f"yes: its inputs on {'B' if e['side'] == 'B' else 'A'} "
                  f"are values the other side never had: they come from {e['region']} "
                  f"({e['side']}{', ' + e['module'] if e['module'] else ''}), where the "
                  "difference enters"}
    out.update(verdict="differs", first={"a": _describe(a), "b": _describe(b)},
               last_match={"a": _describe(last[0]), "b": _describe(last[1])} if last else None,
               inputs=inputs, enters=entering[0] if entering else None,
               unaligned_before={"a": len(before),
                                 "groups": _groups(before, [])[:8]},
               differing_pairs=len(differing))
    return out


def _groups(a_only: list[dict], b_only: list[dict]) -> list[dict]:
    counts: dict[tuple, list[int]] = collections.OrderedDict()
    for side, recs in ((0, a_only), (1, b_only)):
        for r in recs:
            k = (r.get("phase"), r.get("module", ""), base_op(r["op"]))
            counts.setdefault(k, [0, 0])[side] += 1
    return [{"phase": p, "module": m, "op": o, "a": c[0], "b": c[1]}
            for (p, m, o), c in counts.items()]


# ------------------------------------------------------------------------------ 5. command
@dataclass
class _Pair:
    """What ``parity diff A B`` says of the pair that bisect needs before rerunning anything."""

    step: int | None  # the first divergent step
    ranks: list[int]  # its ranks
    verdict: str  # the hash verdict
    layouts: str | None  # the bucket-layout verdict
    incomplete: list[str]  # why the diff is incomplete
    ranks_compared: list[int]
    steps_compared: list[int]


def _first_divergence(a_dir: Path, b_dir: Path) -> _Pair:
    """The diff of the recorded runs: first divergent step and ranks, verdicts, and what both
    sides recorded (to check --rank and --step before any rerun)."""
    from parity.diff import diff_runs

    result = diff_runs(a_dir, b_dir)
    fd = result.first_divergence
    return _Pair(result.first_divergent_step, list(fd.ranks) if fd is not None else [],
                 result.verdict, result.order.verdict, list(result.incomplete),
                 list(result.ranks_compared), list(result.steps_compared))


def _check_request(pair: _Pair | None, step: int | None, rank: int | None) -> None:
    """--rank and --step against the recorded runs, before anything is rerun: a rank neither
    side recorded, or a step past the last one both recorded, is a usage error (exit 2)."""
    if pair is None:
        return
    if rank is not None and pair.ranks_compared and rank not in pair.ranks_compared:
        raise ParityError(f"--rank {rank}: the runs recorded rank(s) "
                          f"{ranges(pair.ranks_compared)} (both sides)", EXIT_USAGE)
    if step is not None and pair.steps_compared and step > max(pair.steps_compared):
        raise ParityError(f"--step {step}: the runs recorded steps up to "
                          f"{max(pair.steps_compared)} (both sides): the recorded jobs do not reach "
                          f"step {step}", EXIT_USAGE)


def _check_reproduced(orig: Path, new: Path, step: int, rank: int) -> str | None:
    """A warning when the rerun's step-``step`` hashes differ from what the side recorded."""
    try:
        from parity.artifacts import read_run

        ro, rn = read_run(orig).ranks.get(rank), read_run(new).ranks.get(rank)
        if ro is None or rn is None or step not in ro.steps or step not in rn.steps:
            return None
        for kind in ("grad", "param"):
            ho, hn = ro.hashes(step, kind), rn.hashes(step, kind)
            # the rerun ends at this step: rows that join the table later (a second model's
            # parameters, padded with NO_HASH in the original) are not in its table
            n = min(len(ho), len(hn)) if ho is not None and hn is not None else 0
            if n and ho[:n].tobytes() != hn[:n].tobytes():
                return (f"the rerun of {orig} did not reproduce its recorded step-{step} {kind} "
                        "hashes: the job is not deterministic run to run, so the op found may "
                        "not explain the recorded divergence")
    except Exception:  # noqa: BLE001 - a check, not a requirement
        return None
    return None


def sweep_sides(sweep_dir: Path, cell: str) -> tuple[Path, Path, dict[str, dict[str, str]]]:
    """A sweep cell's reference and candidate run directories and each side's spec env."""
    from parity.sweep import state as st

    cdir = st.cell_dir(sweep_dir, cell)
    if not cdir.is_dir():
        raise ParityError(f"{sweep_dir}: no cell {cell!r} (looked in {cdir})", EXIT_USAGE)
    envs: dict[str, dict[str, str]] = {"reference": {}, "candidate": {}}
    spec_path = sweep_dir / st.SPEC_COPY
    if spec_path.is_file():
        try:
            from parity.sweep.spec import load_spec

            for c in load_spec(spec_path).cells(sweep_dir=sweep_dir):
                if c.id == cell:
                    envs = {s: dict(j.env) for s, j in c.sides.items()}
        except ParityError:
            pass
    return cdir / "reference", cdir / "candidate", envs


def bisect(a_dir: str | os.PathLike, b_dir: str | os.PathLike, *, out_dir: str | os.PathLike,
           step: int | None = None, rank: int | None = None,
           envs: tuple[dict, dict] = ({}, {}), say=print) -> tuple[int, dict]:
    """The whole command: (exit code, report dict). Raises ParityError for bad input."""
    a_dir, b_dir, out = Path(a_dir).resolve(), Path(b_dir).resolve(), Path(out_dir).resolve()
    if out in (a_dir, b_dir):
        raise ParityError(f"--out {out} would overwrite a side's run directory", EXIT_USAGE)
    plans = [plan_rerun("a", a_dir, out, envs[0]), plan_rerun("b", b_dir, out, envs[1])]
    div_ranks: list[int] = []
    why = "given with --step"
    layouts = None
    if step is None:
        pair = _first_divergence(a_dir, b_dir)
        _check_request(pair, None, rank)
        step, div_ranks, layouts = pair.step, pair.ranks, pair.layouts
        if step is None and pair.verdict != "match":
            # not "the runs do not diverge": what was not compared may diverge
            why_not = "; ".join(pair.incomplete[:2]) or f"diff verdict {pair.verdict!r}"
            raise ParityError(f"the pair is incomplete, so no divergent step is known: {why_not} "
                              "(parity diff A B says what is missing; give --step K to look at "
                              "a step anyway)", EXIT_INCOMPLETE)
        if step is None:
            return EXIT_OK, {"schema_version": SCHEMA_VERSION, "verdict": "nothing_to_bisect",
                             "diff_verdict": pair.verdict,
                             "detail": "the runs do not diverge at any compared step (give "
                             "--step K to look at a step anyway)"}
        why = "first divergent step"
    else:
        try:
            pair = _first_divergence(a_dir, b_dir)
        except Exception:  # noqa: BLE001 - the diff only refines the wording and the checks
            pair = None
        _check_request(pair, step, rank)
        layouts = pair.layouts if pair is not None else None
    if step < 1:
        raise ParityError(f"step {step} is the initial parameters: bisect looks at training "
                          "steps >= 1 (the models differ before the first op runs)", EXIT_USAGE)
    out.mkdir(parents=True, exist_ok=True)
    say(f"step {step} ({why}); rerunning both sides with op capture at that step into {out}")
    runs = {}
    for plan in plans:
        say(f"  {plan.side.upper()}: {' '.join(plan.argv)}")
        for note in env_record.restore(plan.recorded_env, {**os.environ, **plan.env})[1]:
            say(f"  {plan.side.upper()}: {note}")
        rc, run_dir, log = rerun(plan, out, step)
        runs[plan.side] = (rc, run_dir, log)
        if rc == EXIT_INTERRUPTED:  # Ctrl-C, forwarded to the job by parity exec
            raise KeyboardInterrupt
        if rc != EXIT_OK:
            raise ParityError(f"the rerun of {plan.side.upper()} ({plan.run_dir}) exited with "
                              f"code {rc}; its output is in {log}", EXIT_INCOMPLETE)
    ranks = sorted(set(ops_ranks(runs["a"][1])) & set(ops_ranks(runs["b"][1])))
    if not ranks:
        raise ParityError(f"the reruns recorded no ops at step {step} (does the job run that "
                          f"many steps? logs: {out / 'logs'})", EXIT_INCOMPLETE)
    if rank is None:
        rank = div_ranks[0] if div_ranks and div_ranks[0] in ranks else ranks[0]
    if rank not in ranks:
        raise ParityError(f"--rank {rank}: ops recorded for ranks {ranks} only", EXIT_USAGE)

    report: dict = {"schema_version": SCHEMA_VERSION, "step": step, "step_source": why, "rank": rank, "out": str(out),
                    "a": {"run": str(a_dir), "rerun": str(runs["a"][1])},
                    "b": {"run": str(b_dir), "rerun": str(runs["b"][1])},
                    "warnings": [], "ranks": {}}
    for side, plan in zip(SIDES, plans):
        report[side]["changed"] = plan.changed
        w = _check_reproduced(plan.run_dir, runs[side][1], step, rank)
        if w:
            report["warnings"].append(w)
    per_rank = {}
    for r in ranks:
        la, lb = read_ops(runs["a"][1], r), read_ops(runs["b"][1], r)
        if la is None or lb is None:
            report["warnings"].append(f"rank {r}: an ops file is unreadable")
            continue
        for side, (meta, _) in zip(SIDES, (la, lb)):
            if r == rank:
                report[side].update(process=meta.get("process"), ops=meta.get("ops"),
                                     complete=meta.get("complete"))
                report["warnings"] += [f"{side.upper()}: {w}" for w in meta.get("warnings") or ()]
        per_rank[r] = analyse_rank(la[1], lb[1], layouts)
    if rank not in per_rank:
        raise ParityError(f"rank {rank}: no readable ops on both sides", EXIT_INCOMPLETE)
    report.update(per_rank[rank])
    for r, res in per_rank.items():
        f = res.get("first")
        report["ranks"][str(r)] = ({"verdict": res["verdict"],
                                    "op": (f"gradient of {f['a']['param']}"
                                           if f["a"].get("param") else f["a"]["op"]),
                                    "module": f["a"]["module"], "phase": f["a"]["phase"],
                                    "index": f["a"]["index"]} if f else
                                   {"verdict": res["verdict"]})
    report["bucket_layouts"] = layouts
    report["headline"] = headline(report)
    if not report["a"].get("complete") or not report["b"].get("complete"):
        report["warnings"].append("a side's op record is incomplete (the job ended inside "
                                  f"step {step})")
    write_json_atomic(out / "bisect.json", report)
    code = EXIT_MISMATCH if report["verdict"] == "differs" else EXIT_OK
    return code, report


# ------------------------------------------------------------------------------- 6. printing
def _op_line(d: dict) -> str:
    shapes = ", ".join(f"{o['dtype']}{list(o['shape'])}" for o in d["outputs"])
    where = d["module"] or "(root / outside any module)"
    what = f"gradient of {d['param']}" if d.get("param") else d["op"]
    return f"{what} in {where} ({d['phase']}) -> {shapes}"


PROCESS_WORDS = {"mixed": "eager with compiled blocks"}


def headline(rep: dict) -> dict | None:
    """What bisect found first, in execution order (bisect.json ``headline``): the region not
    recorded op by op where values the other side never computed come out, when the first
    differing op did not compute the difference itself (``kind: region``); else that op
    (``op``, or ``gradient`` for a gradient as the optimizer consumes it); None without one.
    A gradient that differs downstream of a region is never the headline."""
    enters, f = rep.get("enters"), rep.get("first")
    if enters:
        other = "A" if enters["side"] == "B" else "B"
        name = enters["region"]
        where = "" if name.startswith("inside") else "in "
        return {"kind": "region", "side": enters["side"], "region": name,
                "module": enters.get("module") or "",
                "text": f"first difference: {where}{name} ({enters['side']}"
                        + (f", {enters['module']}" if enters.get("module") else "")
                        + f"): values {other} never computed come out of it"}
    if f:
        kind = "gradient" if f["a"].get("param") else "op"
        return {"kind": kind, "text": f"first differing op: {_op_line(f['a'])}"}
    return None


def format_report(rep: dict) -> str:
    if rep.get("verdict") == "nothing_to_bisect":
        return f"nothing to bisect: {rep['detail']}"
    lines = [f"step {rep['step']} ({rep['step_source']}), rank {rep['rank']}: "
             f"A {PROCESS_WORDS.get(rep['a'].get('process'), rep['a'].get('process'))} "
             f"({rep['a'].get('ops')} ops), "
             f"B {PROCESS_WORDS.get(rep['b'].get('process'), rep['b'].get('process'))} "
             f"({rep['b'].get('ops')} ops)"]
    few = rep.get("too_few_ops")
    enters = rep.get("enters")
    if few:
        who = " and ".join(s.upper() for s in few["sides"])
        lines[0] += (f"; {who} recorded too few forward/backward ops to compare op by op "
                     f"(A {few['a']}, B {few['b']})" + (
                         ": compared by the outputs of the regions not recorded op by op"
                         if enters else ": what follows says little about where the difference "
                         "enters"))
    head = rep.get("headline") or headline(rep)
    if head:
        lines.append(head["text"])
    f = rep.get("first")
    if f:
        a, b = f["a"], f["b"]
        if enters:
            lines.append(f"first differing op recorded op by op after it: {_op_line(a)}")
        elif not head:
            lines.append(f"first differing op: {_op_line(a)}")
        lines.append(f"  A #{a['index']}{' ' + a['node'] if a.get('node') else ''}: "
                     f"{', '.join(h or '-' for h in a['hashes'])}")
        lines.append(f"  B #{b['index']}{' ' + b['node'] if b.get('node') else ''}: "
                     f"{', '.join(h or '-' for h in b['hashes'])}"
                     + (f"  (B: {b['op']} in {b['module'] or '(root)'})"
                        if (b["op"], b["module"]) != (a["op"], a["module"]) else ""))
        lines.append(f"  inputs already differed: {rep['inputs']['detail']}")
        lm = rep.get("last_match")
        lines.append("last matching op before it: "
                     + (f"{_op_line(lm['a'])}, A #{lm['a']['index']} / B #{lm['b']['index']}"
                        if lm else "none (it is the first op compared)"))
        ub = rep["unaligned_before"]
        if ub["a"]:
            g = "; ".join(f"{x['op']} in {x['module'] or '(root)'} ({x['phase']}) x{x['a']}"
                          for x in ub["groups"])
            lines.append(f"  caution: {ub['a']} op(s) of A before it could not be aligned "
                         f"(e.g. {g}); a difference among them would not be seen")
    elif rep["verdict"] == "match":
        lines.append("no difference: every aligned op has identical outputs on both sides")
    else:
        lines.append("no aligned op differs; a difference among the ops that could not be "
                     "aligned (below) would not be seen")
    lines.append(f"aligned {rep['aligned']} ops ({rep['equal']} equal); not aligned: "
                 f"A {rep['not_aligned']['a']}, B {rep['not_aligned']['b']}; communication "
                 f"(compared through the gradients only): A {rep['communication']['a']}, "
                 f"B {rep['communication']['b']}; views/allocations not compared: "
                 f"A {rep['not_compared']['a'] - rep['communication']['a']}, "
                 f"B {rep['not_compared']['b'] - rep['communication']['b']}")
    comm = rep.get("communication_ops") or {}
    for side in SIDES:
        if comm.get(side):
            lines.append(f"  communication {side.upper()}: " + ", ".join(
                f"{op} x{n}" for op, n in comm[side].items()))
    opaque = rep.get("opaque_graph_runs") or {}
    regions = rep.get("opaque_regions") or {}
    if opaque.get("a") or opaque.get("b") or regions.get("a") or regions.get("b"):
        named = "; ".join(f"{side.upper()}: {', '.join(regions[side][:3])}"
                          + (f" (+{len(regions[side]) - 3} more)" if len(regions[side]) > 3 else "")
                          for side in SIDES if regions.get(side))
        lines.append(f"NOT RECORDED op by op (their outputs are hashed, their ops not compared): "
                     f"{named or 'compiled graph runs'} (A {opaque.get('a', 0)}, "
                     f"B {opaque.get('b', 0)} run(s))")
    groups = rep.get("unaligned_groups") or []
    if groups:
        shown = "; ".join(f"{g['op']} in {g['module'] or '(root)'} ({g['phase']}) A {g['a']} / "
                          f"B {g['b']}" for g in groups[:6])
        more = f" (+{len(groups) - 6} more in bisect.json)" if len(groups) > 6 else ""
        lines.append(f"not aligned (op counts differ: fused, recomputed, decomposed or "
                     f"runtime-internal ops): {shown}{more}")
    others = [f"rank {r}: " + (f"{v['op']} in {v['module'] or '(root)'} ({v['phase']})"
                               if v.get("op") else v["verdict"])
              for r, v in rep["ranks"].items() if int(r) != rep["rank"]]
    if others:
        lines.append("other ranks: " + "; ".join(others))
    for w in rep.get("warnings") or ():
        lines.append(f"warning: {w}")
    lines.append(f"report: {os.path.join(rep['out'], 'bisect.json')}")
    return "\n".join(lines)
