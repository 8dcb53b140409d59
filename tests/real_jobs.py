"""Real torchrun jobs captured with ``parity exec``, for the tests that need recorded runs
(test_reduction_real.py, test_nccl_emulation_real.py, the reliability rounds): one place that
finds the executables, starts a round's trainer with its knobs and says why a job failed, so a
module-scoped fixture is a table of jobs and one call."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def exe(name: str, module: str) -> list[str]:
    """The console script ``name`` next to this interpreter (or on PATH), else
    ``python -m module``: the tests run from a venv that may not be activated."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def capture(run: Path, entry: list[str], *, nproc: int = 4, exec_args: list[str] = (),
            env: dict[str, str] | None = None) -> Path:
    """``parity exec [exec_args] --out run -- torchrun --standalone --nproc_per_node nproc
    entry...`` in ``run``'s parent, one thread per rank; a failed job fails the test with its
    stderr's end (the fixture's other jobs would be compared against nothing)."""
    cmd = [*exe("parity", "parity"), "exec", *exec_args, "--out", str(run), "--",
           *exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
           str(nproc), *entry]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=run.parent, capture_output=True, text=True, timeout=900,
                          env=full_env)
    if proc.returncode != 0:
        pytest.fail(f"{run.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return run


def run_table(jobs: dict, start, at_once: int = 3, timeout: float = 900) -> dict:
    """``{name: (run dir, exit code, stderr)}`` of a table of jobs ``{name: knobs}``, ``at_once``
    at a time; ``start(name, knobs)`` returns ``(run dir, Popen)`` (stderr piped, text)."""
    out, pending, running = {}, list(jobs.items()), []
    while pending or running:
        while pending and len(running) < at_once:
            name, knobs = pending.pop(0)
            running.append((name, *start(name, dict(knobs))))
        name, run, p = running.pop(0)
        _, err = p.communicate(timeout=timeout)
        out[name] = (run, p.returncode, err)
    return out


def with_plain(jobs: dict) -> dict:
    """A round's table of jobs ``{name: knobs}`` with ``name.plain`` (the same knobs, run
    without ``parity exec``) before each job whose knobs say ``"plain": True``."""
    table = {}
    for name, knobs in jobs.items():
        knobs = dict(knobs)
        if knobs.pop("plain", False):
            table[name + ".plain"] = knobs
        table[name] = knobs
    return table


def start_trainer(out: Path, prefix: str, knobs: dict, entry: list[str], *, nproc: int = 2,
                  exec: bool = True, exec_args: tuple = ()) -> subprocess.Popen:
    """A reliability round's trainer ``entry`` (``torchrun --standalone --nproc_per_node
    nproc``; nproc 0: ``python`` alone, one process) under ``parity exec --out out`` (``exec``
    false: without parity), from the repository root, with the knobs (``prefix``: ``R9_``...)
    and ``{prefix}SAVE=out.truth`` (where the trainer saves its ground truth) in a clean
    environment (:func:`knob_env`); stdout and stderr piped, text. ``exec_args``: options of
    ``parity exec`` (``--emulate-nccl 2x2``)."""
    knobs = {**knobs, prefix + "SAVE": str(out) + ".truth"}
    cmd = ([*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node",
            str(nproc), *entry] if nproc else [sys.executable, *entry])
    if exec:
        cmd = [sys.executable, "-m", "parity", "exec", *exec_args, "--out", str(out), "--", *cmd]
    return subprocess.Popen(cmd, env=knob_env(prefix, **knobs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def trainer_runs(root: Path, jobs: dict, trainer: str, prefix: str, *, nproc: int = 2,
                 timeout: float = 900) -> dict:
    """:func:`run_table` of a round's jobs ``{name: knobs}``, two at a time, each the trainer
    started by :func:`start_trainer` into ``root / name``. Knobs that are not the trainer's:
    ``plain`` (:func:`with_plain`), ``exec`` (0: this job without parity), ``nproc`` (ranks;
    default ``nproc``), ``entry`` (another script and its arguments instead of ``trainer``),
    ``emu`` (a topology: ``parity exec --emulate-nccl``)."""
    def start(name, knobs):
        out = root / name
        entry, ranks = knobs.pop("entry", [trainer]), knobs.pop("nproc", nproc)
        on = bool(knobs.pop("exec", 1)) and not name.endswith(".plain")
        emu = knobs.pop("emu", None)
        return out, start_trainer(out, prefix, knobs, entry, nproc=ranks, exec=on,
                                  exec_args=("--emulate-nccl", emu) if emu else ())

    return run_table(with_plain(jobs), start, at_once=2, timeout=timeout)


def free_port() -> int:
    """A TCP port free now on this host (torchrun's ``--master_port`` without ``--standalone``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_without_torchtitan() -> None:
    """Skip the calling test module (call it at import) where torchtitan 0.3.0 cannot run: not
    importable (it imports triton at import time: both must be there) or torch too old."""
    try:
        import torchtitan  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torchtitan is not importable ({type(e).__name__}: {e}); "
                    "pip install -e '.[dev]' installs it", allow_module_level=True)
    from tests.test_torchtitan import _torch_too_old_for_torchtitan

    if _torch_too_old_for_torchtitan():
        pytest.skip(f"torchtitan 0.3.0 needs torch >= 2.13 ({_torch_too_old_for_torchtitan()})",
                    allow_module_level=True)


def torchtitan_workdir(tmp: Path) -> Path:
    """A working directory holding torchtitan's test assets (tests/torchtitan_cpu/assets.py)."""
    sys.path.insert(0, str(REPO / "tests" / "torchtitan_cpu"))
    try:
        import assets
    finally:
        sys.path.remove(str(REPO / "tests" / "torchtitan_cpu"))
    return Path(assets.make(str(tmp)))


def torchtitan_job(workdir: Path, name: str, launch: Path, args: list[str], knobs: dict,
                   clean: tuple[str, ...] = ("R9C_",)) -> tuple[Path, str]:
    """``parity exec --out workdir/run-NAME`` of a torchtitan launcher on 2 ranks (a free
    master port) in ``workdir``, with the launcher's ``knobs`` and ``R9C_SAVE`` (its ground
    truth: ``workdir/truth-NAME.pt``) in an environment without the knobs starting with
    ``clean``; a failed job fails the test with its stderr's end. Returns (run dir, truth)."""
    run, truth = workdir / f"run-{name}", str(workdir / f"truth-{name}.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(clean)}
    env.update(knobs, R9C_SAVE=truth, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "parity", "exec", "--out", str(run), "--", sys.executable,
           "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(launch), *args]
    p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, f"{name} failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return run, truth


def saved(prefix: str, rank: int = 0) -> dict:
    """What a trainer saved for ``rank`` (``prefix``, ``prefix.1``, ...)."""
    import torch

    return torch.load(prefix + (f".{rank}" if rank else ""), weights_only=False)


def diff_cli(a: Path, b: Path, *extra: str, timeout: float = 900) -> tuple[int, str, dict]:
    """(exit code, verdict line, diff JSON) of the real ``parity diff A B [extra]`` (its JSON
    beside B, one file per number of extra options)."""
    import json

    js = Path(str(b) + f".diff{len(extra)}.json")
    p = subprocess.run([sys.executable, "-m", "parity", "diff", str(a), str(b), "--json",
                        str(js), *extra], capture_output=True, text=True, timeout=timeout)
    assert p.returncode in (0, 1, 3), p.stderr
    line = p.stdout.splitlines()[0] if p.stdout else ""
    return p.returncode, line, json.loads(js.read_text())


def run_ok(runs: dict, name: str) -> Path:
    """The run directory of job ``name`` of a :func:`run_table`, which must have exited 0 (its
    stderr's tail otherwise)."""
    from parity.errors import EXIT_OK

    d, rc, err = runs[name]
    assert rc == EXIT_OK, err[-3000:]
    return d


def knob_env(prefix: str, **knobs) -> dict[str, str]:
    """This process's environment without the knobs of a test trainer (``prefix``: ``R4_``...)
    or parity's own capture switches, one thread, and ``knobs`` set."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((prefix, "PARITY_CAPTURE", "PARITY_OPS"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def values_equal(a, b) -> bool:
    """Ground truth of the reliability rounds: bitwise equality of saved values (tensors by
    dtype, shape and ``torch.equal``; dicts by keys; lists and tuples item by item)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(values_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(values_equal(x, y) for x, y in zip(a, b)))
    return a == b


# ------------------------------------------- graph rounds (trainers/round9b.py, round10a.py)
# Both trainers save, per rank, every step's ``shards``, ``grads`` and ``losses``, the final
# ``model``, every executed collective's ``records`` (its ``input``) and dynamo's ``extra``.

SAVED = ("shards", "grads", "losses", "model")


def differing(x: dict, y: dict, keys=SAVED) -> list[str]:
    """The keys of two ranks' saved values that are not bitwise equal."""
    return [k for k in keys if not values_equal(x[k], y[k])]


def compiled(run: Path) -> dict:
    """Dynamo's counters and the graphs compiled (rank 0), less the compile caches' counters
    (off under ``parity exec`` by design: a cache hit would give no manifest; docs/capture.md)."""
    extra = saved(f"{run}.truth")["extra"]
    counters = {k: {c: n for c, n in v.items() if "cache" not in c}
                for k, v in extra["counters"].items()}
    return {"counters": counters, "graphs": extra["graphs"]}


def capture_differences(run: Path, alone: Path, ranks=(0, 1)) -> list[str]:
    """What differs between a job under ``parity exec`` and the same job without it: each
    rank's saved values, every collective's input, dynamo's counters and the graphs compiled
    (:func:`compiled`). Empty: capture changed nothing."""
    out = []
    for rank in ranks:
        x, y = saved(f"{run}.truth", rank), saved(f"{alone}.truth", rank)
        out += [f"rank {rank}: {k}" for k in differing(x, y)]
        if not values_equal([r["input"] for r in x["records"]],
                            [r["input"] for r in y["records"]]):
            out.append(f"rank {rank}: collective inputs")
    if compiled(run) != compiled(alone):
        out.append(f"compiled: {compiled(run)} against {compiled(alone)}")
    return out


def first_differing(a: Path, b: Path, kind: str) -> int | None:
    """Ground truth of "the first bucket whose payload order differs": the index, among the
    executed collectives of ``kind`` in step 0 on rank 0, of the first whose input differs
    between A and B (their values are equal: only the packing can differ)."""
    ra = [r for r in saved(f"{a}.truth")["records"] if r["step"] == 0 and kind in r["op"]]
    rb = [r for r in saved(f"{b}.truth")["records"] if r["step"] == 0 and kind in r["op"]]
    for i, (x, y) in enumerate(zip(ra, rb)):
        if not values_equal(x["input"], y["input"]):
            return i
    return None


def graph_lines(run: Path) -> list[str]:
    """Rank 0's ``"source": "graph"`` bucket lines after the passes, as written."""
    return [b for b in (run / "rank-00000" / "buckets.jsonl").read_text().splitlines()
            if '"source":"graph"' in b and "before_passes" not in b]


def edited_copy(run: Path, dest: Path, edit) -> bool:
    """A copy of ``run`` at ``dest`` in which ``edit(line)`` changed the first graph line
    (after the passes) of rank 0's buckets.jsonl that it would change (``edit`` changes a line
    in place and returns True, or leaves it and returns False); whether one was changed. For
    showing that a judge of the manifests is not vacuous."""
    import json

    shutil.copytree(run, dest)
    path = dest / "rank-00000" / "buckets.jsonl"
    lines, done = [], False
    for line in path.read_text().splitlines():
        b = json.loads(line)
        if not done and b.get("source") == "graph" and b.get("stage") != "before_passes":
            done = bool(edit(b))
        lines.append(json.dumps(b))
    path.write_text("\n".join(lines) + "\n")
    return done
