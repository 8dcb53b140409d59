"""Issue 23 item 3, local torchrun: ``stop_after_divergence = K`` stops both jobs of a cell K
steps after its first divergent step and keeps the cell as a divergence.

tests/trainers/noisy.py trains 40 slow steps (0.3 s each); the candidate adds 1e-3 to a gradient
at step 2 (``--perturb 0:2``). Both sides run at once (``--jobs 2``). The SLURM path:
tests/test_slurm_early_stop.py. The watcher's comparison logic is also checked on its own.
"""

import json
import subprocess
import sys
from pathlib import Path

from parity.errors import EXIT_MISMATCH

TRAINER = str(Path(__file__).resolve().parent / "trainers" / "noisy.py")
PARITY = [sys.executable, "-m", "parity"]
STEPS = 40


def spec_text(name: str, launcher: str = "local", k: int = 2, nnodes: int = 1) -> str:
    return f'''
name = "{name}"
steps = {STEPS}
nnodes = {nnodes}
nproc_per_node = {2 // nnodes}
timeout = 300
stop_after_divergence = {k}

[env]
OMP_NUM_THREADS = "1"

[reference]
argv = ["{TRAINER}", "--steps", "{{steps}}", "--sleep", "0.3"]

[candidate]
argv = ["{TRAINER}", "--steps", "{{steps}}", "--sleep", "0.3", "--perturb", "0:2"]
env = {{ NCCL_ALGO = "Ring" }}  # named by the diff as a possible cause (numerics fingerprint)

[launcher]
type = "{launcher}"
'''


def run_sweep(tmp_path: Path, text: str, *args) -> tuple[subprocess.CompletedProcess, dict]:
    spec = tmp_path / "stop.toml"
    spec.write_text(text)
    out = tmp_path / "sweep"
    r = subprocess.run(PARITY + ["sweep", str(spec), "--out", str(out), *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    return r, json.loads((out / "sweep.json").read_text())


def check_stopped(r, sweep, k: int = 2) -> dict:
    (cell,) = sweep["cells"]
    assert cell["status"] == "hash_mismatch", (cell["reason"], r.stderr[-3000:])
    assert cell["diff"]["first_divergent_step"] == 2
    assert cell["early_stop"] == {"k": k, "first_divergent_step": 2, "stopped_after_step": 2 + k,
                                  "stopped": ["reference", "candidate"]}, cell["early_stop"]
    assert f"stopped early after step {2 + k}" in cell["reason"]
    problems = [p["message"] for p in cell["diff"]["problems"]]
    assert "NCCL_ALGO differs (A None, B 'Ring'): a possible cause of a bitwise difference" in (
        problems), problems
    for side in ("reference", "candidate"):
        s = cell["sides"][side]
        assert s["status"] == "stopped", s
        assert "stop_after_divergence" in s["reason"]
        # K steps past the divergence were recorded; far fewer than the job's 40
        assert 2 + k + 1 <= s["steps_recorded"] < STEPS, s["steps_recorded"]
    assert r.returncode == EXIT_MISMATCH, r.stdout[-2000:]
    assert f"diverged at step 2; stopping after step {2 + k}" in r.stderr
    return cell


def test_early_stop_local(tmp_path):
    r, sweep = run_sweep(tmp_path, spec_text("stop"), "--jobs", "2")
    cell = check_stopped(r, sweep)
    print(f"early stop: cell wall {cell['wall']:.1f} s, jobs "
          f"{cell['sides']['reference']['wall']:.1f} + {cell['sides']['candidate']['wall']:.1f} s")
    # the gate and every report say hash mismatch, not failure
    g = subprocess.run(PARITY + ["gate", str(tmp_path / "sweep")], capture_output=True, text=True,
                       timeout=120)
    assert g.returncode == EXIT_MISMATCH and "FAILS" in g.stdout


def test_watch_compares_only_steps_every_rank_recorded(tmp_path):
    """A divergence is concluded only over steps all ranks of both sides recorded."""
    from parity.sweep.early_stop import DivergenceWatch

    def write(side, rank, steps):
        d = tmp_path / side / f"rank-{rank:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "params.json").write_text(json.dumps({"v": 1, "params": [{"fqn": "w"}]}))
        with open(d / "steps.jsonl", "w") as f:
            for s, digest in steps:
                f.write(json.dumps({"v": 1, "step": s, "param_digest": digest}) + "\n")

    same = [(s, f"d{s}") for s in range(6)]
    write("a", 0, same)
    write("a", 1, same[:3])
    write("b", 0, [(s, "x" if s >= 4 else f"d{s}") for s in range(6)])
    write("b", 1, same[:3] + [(3, "partial")])
    # rank 1 of A has only steps 0-2: nothing can be concluded past step 2
    w = DivergenceWatch(tmp_path / "a", tmp_path / "b", 2, 1)
    assert w.poll() is None and w.first is None and w.reach == 2
    write("a", 1, same)  # now rank 1 of A reaches step 5, B's rank 1 step 3 (it differs there)
    write("b", 1, same[:3] + [(3, "partial"), (4, "d4"), (5, "d5")])
    assert w.poll() == (3, 4)


def test_watch_compares_by_name_when_tables_differ_in_order(tmp_path):
    """Tables listing the same parameters in other orders: roll-ups are not comparable, the
    watch compares the per-parameter hashes by name (here: equal until step 2, where w2 differs)."""
    from parity.artifacts import RankWriter
    from parity.sweep.early_stop import DivergenceWatch

    h = {name: bytes([i + 1]) * 16 for i, name in enumerate(("w1", "w2"))}
    for side, order in (("a", ("w1", "w2")), ("b", ("w2", "w1"))):
        for rank in (0, 1):
            w = RankWriter(tmp_path / side, rank, {"world_size": 2})
            w.write_params([{"fqn": n, "shape": [1], "dtype": "float32"} for n in order])
            for step in range(4):
                row = dict(h)
                if side == "b" and step >= 2:
                    row["w2"] = b"\xff" * 16
                w.write_step(step, b"".join(row[n] for n in order))
            w.close()
    w = DivergenceWatch(tmp_path / "a", tmp_path / "b", 2, 1)
    assert w.poll() == (2, 3)
