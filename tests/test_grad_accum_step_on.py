"""Gradient accumulation and hand-written updates under `parity exec` (issue 22, items 3-4).

Real torchrun jobs (gloo, 2 ranks, CPU) of tests/trainers/grad_accum.py, which imports nothing
from parity: an FSDP2 trainer with two micro-batches per step, stepped by AdamW or by a
hand-written ``sgd_update(model, lr)`` in the script.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity.artifacts import read_run

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "grad_accum.py")
TIMEOUT = 600


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GA_", "PARITY_CAPTURE", "PARITY_OPS"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _exec(out, *opts, trainer=(TRAINER,), cwd=None, **knobs):
    argv = [sys.executable, "-m", "parity", "exec", "--out", str(out), *opts, "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *trainer]
    return subprocess.run(argv, env=_env(**knobs), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd)


_FLOAT = r"-?\d+\.\d+(?:e[-+]?\d+)?"  # the ranks' lines may run into each other


def _reported(log: str) -> dict:
    """(rank, step) -> (the step's loss as the trainer reports it, the last micro-batch's)."""
    return {(int(r), int(s)): (float(a), float(b)) for r, s, a, b in
            re.findall(r"rank (\d+) step (\d+) loss ({f}) last ({f})".format(f=_FLOAT), log)}


@pytest.fixture(scope="module")
def ga(tmp_path_factory):
    out = tmp_path_factory.mktemp("ga") / "run"
    p = _exec(out)
    assert p.returncode == 0, p.stdout + p.stderr
    return out, p


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    d = tmp_path_factory.mktemp("hand")
    plain = _exec(d / "plain", GA_UPDATE="hand")
    marked = _exec(d / "marked", "--step-on", "grad_accum:sgd_update", GA_UPDATE="hand")
    return d, plain, marked


@pytest.fixture(scope="module")
def importable(tmp_path_factory):
    """--step-on naming importable modules: the trainer run as ``-m trainers.grad_accum`` (its
    dotted name, not the script's stem), and an update function in a module it imports."""
    d = tmp_path_factory.mktemp("importable")
    as_module = _exec(d / "as_module", "--step-on", "trainers.grad_accum:sgd_update",
                      trainer=("-m", "trainers.grad_accum"), cwd=HERE, GA_UPDATE="hand")
    imported = _exec(d / "imported", "--step-on", "hand_update:sgd_update",
                     GA_UPDATE="imported")
    return d, as_module, imported


def test_step_on_names_importable_modules(importable):
    d, as_module, imported = importable
    for name, p in (("as_module", as_module), ("imported", imported)):
        assert p.returncode == 0, (name, p.stdout + p.stderr)
        run = read_run(d / name)
        reported = _reported(p.stdout)
        for rank in (0, 1):
            assert max(run.ranks[rank].steps) == 2, name
            assert run.ranks[rank].steps[2]["loss"] == reported[(rank, 2)][0], name


def test_loss_is_the_sum_over_the_steps_backward_calls(ga):
    out, p = ga
    reported = _reported(p.stdout)
    assert len(reported) == 4, p.stdout
    run = read_run(out)
    for rank in (0, 1):
        for step in (1, 2):
            total, last = reported[(rank, step)]
            recorded = run.ranks[rank].steps[step]["loss"]
            assert recorded == total, (rank, step, recorded, total)  # bitwise: the same sum
            assert recorded != last


def test_forward_all_gathers_told_by_autograd_state(ga):
    out, _ = ga
    j = out.parent / "inspect.json"
    p = subprocess.run([sys.executable, "-m", "parity", "inspect", str(out), "--json", str(j)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {(r["graph"], r["collective"]): r for r in json.loads(j.read_text())["graphs"]
            if r["source"] == "fsdp2"}
    # per micro-batch: 3 groups gathered in forward, the 2 resharded blocks again in backward
    assert rows[("forward", "all_gather")]["count_after"] == 6
    assert rows[("backward", "all_gather")]["count_after"] == 4
    recs = [json.loads(x) for x in (out / "rank-00000" / "buckets.jsonl").read_text().split("\n")
            if x.strip()]
    phases = [r["graph"] for r in recs if r["collective"] == "all_gather" and r["step"] == 1]
    assert phases == ["forward"] * 3 + ["backward"] * 2 + ["forward"] * 3 + ["backward"] * 2


def test_hand_written_update_without_step_on_says_what_is_missing(hand):
    _, plain, _ = hand
    assert plain.returncode == 3, plain.stderr
    assert "imported torch, but no torch.optim optimizer stepped" in plain.stderr
    assert "--step-on MODULE:FUNCTION" in plain.stderr


def test_step_on_marks_each_call_as_a_step(hand):
    d, _, marked = hand
    assert marked.returncode == 0, marked.stdout + marked.stderr
    run = read_run(d / "marked")
    reported = _reported(marked.stdout)
    for rank in (0, 1):
        rd = run.ranks[rank]
        assert max(rd.steps) == 2
        assert rd.steps[2]["loss"] == reported[(rank, 2)][0]
    assert json.loads((d / "marked" / "run.json").read_text())["capture"]["step_on"] == \
        "grad_accum:sgd_update"


def test_step_on_is_checked_before_running(tmp_path):
    p = _exec(tmp_path / "bad", "--step-on", "no-colon")
    assert p.returncode == 2 and "MODULE:FUNCTION" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_chunked_loss_total_is_not_another_micro_batch():
    """torchtitan's chunked loss calls backward on each chunk and then on their total: the
    total replaces its chunks; micro-batches of gradient accumulation stay separate."""
    import torch

    from parity.capture.loss import _fold_totals

    def vals(*v):
        return [float(x) for x in _fold_totals([torch.tensor(x) for x in v])]

    assert vals(2.0, 2.01, 4.01) == pytest.approx([4.01])
    assert vals(2.0, 2.01) == pytest.approx([2.0, 2.01])
    assert vals(1.0, 1.5, 2.5, 1.2, 1.3, 2.5) == pytest.approx([2.5, 2.5])
    assert vals(4.0, 4.0) == pytest.approx([4.0, 4.0])
