"""The built-in workload: both modes train, and compiled fp32 is bitwise eager FSDP2.

Each torchrun job (2 ranks, gloo, CPU) runs once per session through
``workload_harness.run_job``; tests/test_graph_manifest.py reuses the compiled
ones.
"""

import os
import subprocess
import sys

import pytest
import torch

from workload_harness import (
    COMPILED_GRAPH,
    COMPILED_REGISTRATION,
    COMPILED_SWAPPED,
    EAGER,
    EAGER_PERTURBED,
    NPROC,
    PERTURB_FQN,
    REPO,
    run_job,
    STEPS,
)


def param_names() -> list[str]:
    """Optimizer order = ``model.parameters()`` order of the workload's model."""
    from parity.workloads.model import ModelArgs, Transformer

    return [name for name, _ in Transformer(ModelArgs()).named_parameters()]


def differing(a: list[str], b: list[str]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


@pytest.mark.parametrize(
    "args", [EAGER, COMPILED_REGISTRATION, COMPILED_GRAPH], ids=["eager", "compiled-registration", "compiled-graph"]
)
def test_job_finishes(args):
    result = run_job(args, manifests="compiled" in args)
    result.check_ok()
    for rank in range(NPROC):
        assert len(result.digests(rank)) == STEPS
    assert f"step {STEPS} loss" in result.log
    assert "done mode=" in result.log


@pytest.mark.parametrize("args", [COMPILED_REGISTRATION, COMPILED_GRAPH], ids=["registration", "graph"])
def test_compiled_fp32_is_bitwise_eager(args):
    eager = run_job(EAGER)
    compiled = run_job(args, manifests=True)
    eager.check_ok()
    compiled.check_ok()
    for rank in range(NPROC):
        for step, (e, c) in enumerate(zip(eager.digests(rank), compiled.digests(rank), strict=True), 1):
            assert differing(e, c) == [], f"rank {rank} step {step}"


def test_swapped_reduce_scatter_payloads_change_hashes():
    eager = run_job(EAGER)
    swapped = run_job(COMPILED_SWAPPED, manifests=True)
    swapped.check_ok()
    for rank in range(NPROC):
        first = differing(eager.digests(rank)[0], swapped.digests(rank)[0])
        # Step 1: exactly the two parameters whose gradients were exchanged.
        assert len(first) == 2, first
        # Later steps: the wrong update has propagated through the forward.
        assert len(differing(eager.digests(rank)[-1], swapped.digests(rank)[-1])) > 2


def test_perturbed_gradient_changes_hashes():
    eager = run_job(EAGER)
    perturbed = run_job(EAGER_PERTURBED)
    perturbed.check_ok()
    index = param_names().index(PERTURB_FQN)
    for rank in range(NPROC):
        assert differing(eager.digests(rank)[0], perturbed.digests(rank)[0]) == []
    # Step 2: only rank 1's shard of that parameter; step 3: everything, everywhere.
    assert differing(eager.digests(1)[1], perturbed.digests(1)[1]) == [index]
    assert differing(eager.digests(0)[1], perturbed.digests(0)[1]) == []
    for rank in range(NPROC):
        assert len(differing(eager.digests(rank)[2], perturbed.digests(rank)[2])) > 1


def _python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cudagraphs_without_cuda_exits_2():
    proc = _python("-m", "parity.workloads.train", "--mode", "compiled", "--cudagraphs")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "cudagraphs requested but CUDA is not available"


def test_library_main_single_rank():
    """``main(argv)`` works without torchrun (a 1-rank gloo group) and returns 0."""
    proc = _python(
        "-c",
        "import sys; from parity.workloads.train import main; sys.exit(main(['--steps', '2', '--layers', '1']))",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 loss" in proc.stdout
