"""GPU facts in meta.json (capture/gpu_facts.py) and the diff's warning when they differ
(parity/diff/env.py)."""

import json

import torch

from parity.artifacts import rank_dir
from parity.capture import gpu_facts
from parity.diff import diff_runs
from parity.diff.env import numerics_env_differences
from synth import make_run

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "driver": "570.124.06",
        "driver_cuda": 12080, "cuda": "13.0", "hip": None, "cudnn": 91300, "nccl": "2.27.5",
        "matmul_allow_tf32": False, "cudnn_allow_tf32": True,
        "float32_matmul_precision": "highest", "cudnn_enabled": True,
        "cudnn_deterministic": False, "cudnn_benchmark": False,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _meta(**gpu):
    return {"device": "cuda:0", "gpu": {**H100, **gpu}}


def test_equal_facts_say_nothing_and_each_difference_is_one_line():
    assert numerics_env_differences(_meta(), _meta()) == []
    diffs = numerics_env_differences(_meta(), _meta(matmul_allow_tf32=True, nccl="2.26.2",
                                                    CUBLAS_WORKSPACE_CONFIG=None))
    assert len(diffs) == 3
    assert any("NCCL differs (A '2.27.5', B '2.26.2')" in d for d in diffs)
    assert any(d.startswith("TF32 matmul") for d in diffs)
    assert any("CUBLAS_WORKSPACE_CONFIG differs (A ':4096:8', B None)" in d for d in diffs)


def test_device_types_and_old_runs():
    assert "different devices (A cuda, B cpu)" in numerics_env_differences(
        _meta(), {"device": "cpu", "gpu": None})[0]
    # CPU runs, and runs recorded before meta.json had "gpu", are not compared here
    assert numerics_env_differences({"device": "cpu", "gpu": None}, {"device": "cpu"}) == []
    assert numerics_env_differences(None, _meta()) == []


def test_diff_warns_but_keeps_the_verdict(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_run(a, world_size=2, steps=2)
    make_run(b, world_size=2, steps=2)
    for run, gpu in ((a, H100), (b, {**H100, "name": "NVIDIA A100-SXM4-80GB", "cudnn": 90100})):
        for r in (0, 1):
            p = rank_dir(run, r) / "meta.json"
            meta = json.loads(p.read_text())
            meta.update(device=f"cuda:{r}", gpu=gpu)
            p.write_text(json.dumps(meta))
    res = diff_runs(a, b)
    assert res.verdict == "match"
    msgs = [p.message for p in res.problems if p.side is None]
    assert any(m.startswith("GPU differs (A 'NVIDIA H100 80GB HBM3', B 'NVIDIA A100") for m in msgs)
    assert any(m.startswith("cuDNN differs") for m in msgs)
    assert res.exit_code() == 0
    # and the console report shows them as warnings
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "diff", str(a), str(b)],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: GPU differs (A 'NVIDIA H100 80GB HBM3', B 'NVIDIA A100" in " ".join(proc.stdout.split())


def test_collect_without_cuda_is_none():
    if torch.cuda.is_available():
        facts = gpu_facts.collect("cuda:0")
        assert set(H100) <= set(facts) and facts["name"]
    else:
        assert gpu_facts.collect() is None and gpu_facts.collect("cuda:0") is None
    assert gpu_facts.collect("cpu") is None
