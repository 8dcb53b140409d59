"""Issue 34, "labels that follow the evidence", on a real FSDP2 trainer (2 ranks, CPU, gloo;
tests/trainers/compiled_region.py imports nothing from parity):

* a forward change (the norm's epsilon, 1e-6 -> 1e-2) is labelled by what was compared ("loss
  differs, gradients differ"), with no box claiming the backward differs first; `parity bisect`
  names the op (the norm's add);
* ``torch.compile`` of one block (inductor) in an otherwise eager model: the eager ops around
  the compiled block, block 0 included, are recorded op by op; bisect's headline is the
  compiled region where the difference enters, never a gradient that differs downstream; the
  rerun recompiles nothing (TORCH_LOGS=recompiles in the job's recorded environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.diff import diff_runs

TIMEOUT = 900
TRAINER = Path(__file__).resolve().parent / "trainers" / "compiled_region.py"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_", "PARITY_", "TORCH_LOGS"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _parity(args, cwd, **extra):
    return subprocess.run([sys.executable, "-m", "parity", *map(str, args)], env=_env(**extra),
                          cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def _job(*flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(TRAINER), "--steps", "2", *flags]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("labels")
    sides = {"a": ([], {}), "eps": (["--eps", "0.01"], {}),
             "block": (["--backend", "inductor", "--compile-blocks", "1"],
                       {"TORCH_LOGS": "recompiles"})}
    for name, (flags, extra) in sides.items():
        p = _parity(["exec", "--out", d / name, "--", *_job(*flags)], d, **extra)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return d


def test_a_forward_change_is_labelled_by_what_differs(runs):
    r = diff_runs(runs / "a", runs / "eps")
    fd = r.first_divergence
    assert r.first_divergent_step == 1 and fd.loss_differs and fd.grads
    assert fd.label == "loss differs, gradients differ"
    p = _parity(["diff", runs / "a", runs / "eps"], runs)
    assert p.returncode == 1
    assert "(loss differs, gradients differ)" in p.stdout.splitlines()[0]
    assert "Diverged first in" not in p.stdout and "backward pass differs" not in p.stdout
    assert "[forward]" not in p.stdout and "[backward]" not in p.stdout


def test_bisect_names_the_changed_op_of_a_forward_change(runs):
    p = _parity(["bisect", runs / "a", runs / "eps", "--out", runs / "bis-eps"], runs)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    rep = json.loads((runs / "bis-eps" / "bisect.json").read_text())
    assert rep["headline"]["kind"] == "op"
    assert rep["first"]["a"]["module"] == "layers.0.norm"
    assert rep["first"]["a"]["phase"] == "forward" and rep["first"]["a"]["op"].startswith("aten.add")
    assert p.stdout.splitlines()[1].startswith("first differing op: aten.add")


def test_one_compiled_block_is_the_headline_and_the_eager_ops_around_it_are_recorded(runs):
    p = _parity(["bisect", runs / "a", runs / "block", "--out", runs / "bis-block"], runs)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    rep = json.loads((runs / "bis-block" / "bisect.json").read_text())
    assert rep["a"]["process"] == "eager" and rep["b"]["process"] == "mixed"
    head = rep["headline"]
    assert head["kind"] == "region" and head["side"] == "B" and head["module"] == "layers.1"
    assert "inductor graph forward#" in head["region"]
    lines = p.stdout.splitlines()
    assert "eager with compiled blocks" in lines[0]
    assert lines[1].startswith("first difference: inside inductor graph forward#")
    assert "(B, layers.1)" in lines[1]
    assert not any(x.startswith("first differing op: gradient") for x in lines)
    # the eager block 0 and the embedding ran op by op on both sides and matched
    assert rep["too_few_ops"] is None
    assert rep["last_match"]["a"]["module"].startswith(("layers.0", "emb"))
    assert rep["first"]["a"]["phase"] == "forward"
    assert not rep["first"]["a"]["module"].startswith("layers.0")
    # recording around the compiled block recompiled nothing
    log = (runs / "bis-block" / "logs" / "b.log").read_text()
    assert "Recompiling" not in log, log[-3000:]
