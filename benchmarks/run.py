"""parity's benchmarks: every figure is a ratio against a baseline measured in the same run.

    python benchmarks/run.py [--quick] [--json FILE] [--only hash,capture,diff,sweep,cuda,reduction,emulation]

Figures (targets from the performance issue; a figure that misses its target is marked MISS,
the run still exits 0 so CI tracks numbers rather than machine noise):

  hash_gbps, read_gbps, sha256_gbps   parity's hasher vs a plain memory read (numpy sum of the
                                      same bytes) vs torchtitan-style SHA-256 over tobytes()
  hash_vs_read  >= 0.9                hash_vs_sha256 >= 15
  capture_overhead <= 1.05            built-in workload mean step time with parameter and
                                      gradient hashes every step / without capture
  diff_seconds_step20 <= 10 s, diff_peak_gib < 4   256-rank x 25-step x 1,500-parameter pair
  diff_seconds_step2                  the same pair diverging at step 2 (should cost much less)
  sweep_overhead                      wall time of a small sweep / sum of its jobs' wall times
  reduction_overhead < 1.10           the diff pair above with --at (every reduce-scatter bucket
                                      reordered): 1 + prediction time / diff time
                                      (benchmarks/bench_reduction.py)
  emulation_overhead                  built-in eager workload's mean step time under
                                      `parity exec --emulate-nccl` / plain gloo, both captured
                                      (benchmarks/bench_emulation.py; reported, no target)
  cuda_* (only with CUDA; otherwise the line "cuda  no CUDA: skipped")
    cuda_digest_gbps, cuda_read_gbps, cuda_d2h_xxh3_gbps, cuda_torch_digest_gbps
                                      the device digest as capture runs it (Triton kernel where
                                      Triton imports) vs a plain on-device read (t.sum() of every
                                      tensor) vs copy to host + xxh3 vs the torch-ops digest, on
                                      the same fp32 / bf16 state
    cuda_digest_vs_read >= 0.8        (fp32 and bf16 separately)
    cuda_capture_overhead             the built-in workload on CUDA (a larger model than on CPU)
                                      with device digests every step / without capture

`--quick` (run by .ci/run) uses smaller sizes and fewer repetitions and finishes in about two
minutes on 2 cores; the figures are noisier but the code paths are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.capture.hashing import digest_tensors  # noqa: E402

TARGETS = {
    "cuda_digest_vs_read_fp32": (">=", 0.8),
    "cuda_digest_vs_read_bf16": (">=", 0.8),
    "hash_vs_read": (">=", 0.9),
    "hash_vs_sha256": (">=", 15.0),
    "capture_overhead": ("<=", 1.05),
    "diff_seconds_step20": ("<=", 10.0),
    "diff_peak_gib": ("<", 4.0),
    "reduction_overhead": ("<", 1.10),
}


def _env_one_thread() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


# ------------------------------------------------------------------------------------ hashing


def model_state(total_mib: int) -> list[torch.Tensor]:
    """A realistic model state: many tensors of mixed sizes and dtypes, DTensor shards included."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    tensors: list[torch.Tensor] = []
    budget = total_mib * 2**20
    # per "layer": 4 square attention weights, 3 MLP weights, 2 norms; embeddings at the ends
    dim = 512 if total_mib >= 256 else 256
    shapes = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (4 * dim, dim)] + [(dim,), (dim,)]
    i = 0
    used = 0
    tensors.append(torch.randn(8192, dim, generator=g))  # token embedding
    used += tensors[-1].numel() * 4
    while used < budget:
        shape = shapes[i % len(shapes)]
        t = torch.randn(*shape, generator=g)
        if i % 3 == 1:
            t = t.to(torch.bfloat16)
        if i % 4 == 0:
            t = distribute_tensor(t, mesh, [Shard(0)])
        tensors.append(t)
        used += t.numel() * t.element_size()
        i += 1
    return tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _read(tensors) -> float:
    s = 0
    for t in tensors:
        b = _local(t).detach().reshape(-1).view(torch.uint8).numpy()
        n = len(b) // 8 * 8
        s += int(b[:n].view(np.uint64).sum()) + int(b[n:].sum())
    return s


def _sha256(tensors) -> None:
    for t in tensors:
        lt = _local(t).detach()
        if lt.dtype == torch.bfloat16:
            lt = lt.view(torch.int16)
        hashlib.sha256(lt.numpy().tobytes()).digest()


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_hash(quick: bool) -> dict:
    torch.set_num_threads(1)
    tensors = model_state(128 if quick else 512)
    nbytes = sum(_local(t).numel() * _local(t).element_size() for t in tensors)
    reps = 3 if quick else 7
    t_hash = _best(lambda: digest_tensors(tensors, "xxh3"), reps)
    t_read = _best(lambda: _read(tensors), reps)
    sha_tensors = tensors[: max(8, len(tensors) // (4 if quick else 1))]
    sha_bytes = sum(_local(t).numel() * _local(t).element_size() for t in sha_tensors)
    t_sha = _best(lambda: _sha256(sha_tensors), 1 if quick else 2)
    t_dev = _best(lambda: digest_tensors(tensors, "device"), 1)
    gb = 1e9
    out = {
        "hash_bytes": nbytes,
        "hash_tensors": len(tensors),
        "hash_gbps": nbytes / t_hash / gb,
        "read_gbps": nbytes / t_read / gb,
        "sha256_gbps": sha_bytes / t_sha / gb,
        "device_digest_cpu_gbps": nbytes / t_dev / gb,
    }
    out["hash_vs_read"] = out["hash_gbps"] / out["read_gbps"]
    out["hash_vs_sha256"] = out["hash_gbps"] / out["sha256_gbps"]
    return out


# ---------------------------------------------------------------------------- capture overhead


def _train_cmd(steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "parity.workloads.train", "--mode", "eager", "--steps", str(steps)]


def _mean_step_ms(cmd: list[str], cwd: Path) -> float:
    proc = subprocess.run(cmd, cwd=cwd, env=_env_one_thread(), capture_output=True, text=True,
                          timeout=600)
    m = re.search(r"mean_step_ms=([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or not m:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"workload failed (exit {proc.returncode}): {' | '.join(tail)}")
    return float(m.group(1))


def bench_capture(quick: bool, tmp: Path) -> dict:
    steps = 30 if quick else 100
    rounds = 1 if quick else 3
    base, capt = [], []
    for i in range(rounds):  # interleaved, so drift in machine load hits both sides alike
        base.append(_mean_step_ms(_train_cmd(steps), ROOT))
        out = tmp / f"capture-{i}"
        capt.append(_mean_step_ms([sys.executable, "-m", "parity", "exec",
                                   "--out", str(out), "--"] + _train_cmd(steps), ROOT))
        shutil.rmtree(out, ignore_errors=True)
    b, c = statistics.median(base), statistics.median(capt)
    return {"step_ms_no_capture": b, "step_ms_capture": c, "capture_overhead": c / b,
            "capture_steps": steps}


# ---------------------------------------------------------------------------------------- diff


def _timed_child(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (GiB) and exit code of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 2**20, proc.returncode


def bench_diff(quick: bool, tmp: Path) -> dict:
    from tests.synth import make_run

    ranks, steps, params = (256, 25, 1500) if not quick else (64, 25, 1500)
    t0 = time.perf_counter()
    a = make_run(tmp / "a", world_size=ranks, steps=steps, n_params=params)
    b20 = make_run(tmp / "b20", world_size=ranks, steps=steps, n_params=params, diverge_at=20,
                   diverge_rank=3, diverge_param=17)
    b2 = make_run(tmp / "b2", world_size=ranks, steps=steps, n_params=params, diverge_at=2,
                  diverge_rank=3, diverge_param=17)
    gen = time.perf_counter() - t0
    base = [sys.executable, "-m", "parity", "diff"]
    # Baseline in the same run: the diff of identical runs (all roll-ups equal, no drill-down).
    t_same, m_same, rc_same = _timed_child(base + [str(a), str(a)])
    t20, m20, rc20 = _timed_child(base + [str(a), str(b20), "--json", str(tmp / "d20.json")])
    t2, m2, rc2 = _timed_child(base + [str(a), str(b2), "--json", str(tmp / "d2.json")])
    for name, rc, want in (("identical", rc_same, 0), ("step20", rc20, 1), ("step2", rc2, 1)):
        if rc != want:
            raise RuntimeError(f"diff {name}: exit {rc}, expected {want}")
    found = json.loads((tmp / "d20.json").read_text()).get("first_divergent_step")
    if found != 20:
        raise RuntimeError(f"diff step20 found first divergence at {found}")
    return {
        "diff_ranks": ranks, "diff_steps": steps, "diff_params": params,
        "diff_generate_seconds": gen,
        "diff_seconds_identical": t_same, "diff_seconds_step20": t20, "diff_seconds_step2": t2,
        "diff_peak_gib": max(m_same, m20, m2),
        "diff_step2_vs_step20": t2 / t20,
        "diff_step20_vs_identical": t20 / t_same,
    }


# ---------------------------------------------------------------------------------------- cuda


def cuda_state(total_mib: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Model-like CUDA tensors of ``dtype``: many mixed sizes (a few non-contiguous views)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dim = 4096
    shapes = [(dim, dim)] * 4 + [(3 * dim, dim), (dim, 3 * dim), (3 * dim, dim), (dim,), (dim,)]
    tensors, used, i = [], 0, 0
    budget = total_mib * 2**20
    while used < budget:
        t = torch.randn(*shapes[i % len(shapes)], device="cuda", generator=g).to(dtype)
        tensors.append(t.t() if i % 17 == 16 and t.dim() == 2 else t)
        used += t.numel() * t.element_size()
        i += 1
    return tensors


def _best_cuda(fn, reps: int) -> float:
    fn()  # warm-up: kernel compilation, table cache, allocator
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _cuda_read(tensors) -> None:
    for t in tensors:
        t.sum(dtype=torch.float32)


def bench_cuda(quick: bool, tmp: Path) -> dict:
    if not torch.cuda.is_available():
        return {"cuda": "no CUDA: skipped"}
    from parity.capture import hashing, hashing_triton

    out: dict = {"cuda_device": torch.cuda.get_device_name(0),
                 "cuda_digest_backend": hashing.device_backend()}
    gb = 1e9
    reps = 3 if quick else 10
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tensors = cuda_state(1024 if quick else 4096, dtype)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        t_read = _best_cuda(lambda: _cuda_read(tensors), reps)
        t_dig = _best_cuda(lambda: digest_tensors(tensors, "device"), reps)
        # D2H + xxh3 and the torch-ops digest are slow: measured on a slice of the state
        part = tensors[: max(4, len(tensors) // 8)]
        pbytes = sum(t.numel() * t.element_size() for t in part)
        t_xxh = _best_cuda(lambda: digest_tensors(part, "xxh3"), 1)
        os.environ[hashing_triton.ENV_BACKEND] = "torch"
        try:
            t_tops = _best_cuda(lambda: digest_tensors(part, "device"), 1)
        finally:
            os.environ.pop(hashing_triton.ENV_BACKEND, None)
        out.update({
            f"cuda_bytes_{label}": nbytes, f"cuda_tensors_{label}": len(tensors),
            f"cuda_read_gbps_{label}": nbytes / t_read / gb,
            f"cuda_digest_gbps_{label}": nbytes / t_dig / gb,
            f"cuda_d2h_xxh3_gbps_{label}": pbytes / t_xxh / gb,
            f"cuda_torch_digest_gbps_{label}": pbytes / t_tops / gb,
        })
        out[f"cuda_digest_vs_read_{label}"] = out[f"cuda_digest_gbps_{label}"] / out[f"cuda_read_gbps_{label}"]
        del tensors, part
        torch.cuda.empty_cache()
    out.update(_cuda_capture(quick, tmp))
    return out


def _cuda_capture(quick: bool, tmp: Path) -> dict:
    """Capture overhead of the built-in workload on CUDA: 2 ranks (NCCL with 2+ GPUs, else gloo
    sharing one GPU), a model big enough that a step is GPU work, device digests every step."""
    steps = 20 if quick else 60
    gpus = torch.cuda.device_count()
    nproc = 2
    backend = "nccl" if gpus >= 2 else "gloo"
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(nproc), "-m", "parity.workloads.train", "--mode", "eager", "--device", "cuda",
             "--backend", backend, "--steps", str(steps), "--dim", "1024", "--layers", "8",
             "--heads", "16", "--vocab-size", "32768", "--seq-len", "512", "--batch-size", "4"]
    env_extra = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    os.environ.update(env_extra)
    base = _mean_step_ms(train, ROOT)
    out = tmp / "cuda-capture"
    capt = _mean_step_ms([sys.executable, "-c", "import cli; cli.main()", "exec", "--out",
                          str(out), "--"] + train, ROOT)
    shutil.rmtree(out, ignore_errors=True)
    return {"cuda_step_ms_no_capture": base, "cuda_step_ms_capture": capt,
            "cuda_capture_overhead": capt / base, "cuda_capture_backend": backend}


# --------------------------------------------------------------------------------------- sweep


def bench_sweep(quick: bool, tmp: Path) -> dict:
    out = tmp / "sweep"
    only = ("flash=false,cudagraphs=false,bucket_order=registration" if quick
            else "cudagraphs=false")
    cmd = [sys.executable, "-m", "parity", "sweep", "--out", str(out),
           "--only", only, "--steps", "2" if quick else "3"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env_one_thread(), capture_output=True, text=True,
                          timeout=1800)
    wall = time.perf_counter() - t0
    sweep = json.loads((out / "sweep.json").read_text())
    jobs_wall = sweep.get("timing", {}).get("jobs_wall")
    if not jobs_wall:
        raise RuntimeError(f"sweep recorded no job times (exit {proc.returncode})")
    return {"sweep_wall_seconds": wall, "sweep_jobs_seconds": jobs_wall,
            "sweep_overhead": wall / jobs_wall, "sweep_exit": proc.returncode}


# ---------------------------------------------------------------------------------------- main


def _bench_reduction(quick: bool, tmp: Path) -> dict:
    from benchmarks.bench_reduction import bench_reduction

    return bench_reduction(quick, tmp)


def _bench_emulation(quick: bool, tmp: Path) -> dict:
    from benchmarks.bench_emulation import bench_emulation

    return bench_emulation(quick, tmp)


def _fmt(name: str, value) -> str:
    if isinstance(value, float):
        text = f"{value:.3f}"
    else:
        text = str(value)
    mark = ""
    if name in TARGETS and isinstance(value, (int, float)):
        op, target = TARGETS[name]
        ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
        mark = f"   target {op} {target}: {'ok' if ok else 'MISS'}"
    return f"{name:28s} {text}{mark}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes; about two minutes")
    ap.add_argument("--json", dest="json_file", help="write every figure to this JSON file")
    ap.add_argument("--only", default="hash,capture,diff,sweep,cuda,reduction,emulation",
                    help="comma-separated subset of: hash, capture, diff, sweep, cuda, reduction, "
                         "emulation")
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    figures: dict = {"quick": args.quick, "torch": torch.__version__, "cpus": os.cpu_count()}
    errors = {}
    tmp = Path(tempfile.mkdtemp(prefix="parity-bench-"))
    benches = {"hash": lambda: bench_hash(args.quick),
               "capture": lambda: bench_capture(args.quick, tmp),
               "diff": lambda: bench_diff(args.quick, tmp / "diff"),
               "sweep": lambda: bench_sweep(args.quick, tmp),
               "cuda": lambda: bench_cuda(args.quick, tmp),
               "reduction": lambda: _bench_reduction(args.quick, tmp / "reduction"),
               "emulation": lambda: _bench_emulation(args.quick, tmp / "emulation")}
    try:
        for name in wanted:
            if name not in benches:
                print(f"benchmarks: unknown benchmark {name!r}", file=sys.stderr)
                return 2
            t0 = time.perf_counter()
            try:
                res = benches[name]()
            except Exception as e:  # report and go on: one broken figure must not hide the rest
                errors[name] = f"{e.__class__.__name__}: {e}"
                print(f"{name}: FAILED: {errors[name]}", flush=True)
                continue
            figures.update(res)
            for k, v in res.items():
                print(_fmt(k, v), flush=True)
            print(f"{'(' + name + ' took':28s} {time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["errors"] = errors
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(figures, indent=1) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
