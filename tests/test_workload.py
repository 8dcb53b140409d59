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


# ------------------------------------------------------------------ CUDA configuration (pure logic)
def _ns(*argv):
    from parity.workloads.train import build_parser

    return build_parser().parse_args(list(argv))


def test_cuda_device_is_local_rank_modulo_device_count():
    from parity.workloads.train import cuda_index

    assert [cuda_index(r, 1) for r in range(3)] == [0, 0, 0]
    assert [cuda_index(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert cuda_index(5, 8) == 5


@pytest.mark.parametrize("argv,cuda,gpus,local,world,want", [
    (("--mode", "eager"), False, 0, 2, 2, None),
    (("--device", "cuda"), True, 1, 1, 1, None),
    (("--device", "cuda", "--mode", "compiled", "--cudagraphs"), True, 1, 1, 1, None),
    (("--device", "cuda", "--backend", "gloo"), True, 1, 2, 2, None),  # two ranks share a GPU
    (("--device", "cuda"), True, 1, 2, 2, "cannot put two ranks on one GPU"),
    (("--device", "cuda", "--cudagraphs"), True, 1, 1, 1, "requires --mode compiled"),
    (("--device", "cuda", "--mode", "compiled", "--cudagraphs", "--backend", "gloo"), True, 1, 2, 2,
     "cannot capture gloo collectives"),
    (("--device", "cuda", "--attention", "flash"), True, 1, 1, 1, "--param-dtype bfloat16"),
    (("--device", "cuda", "--attention", "flash", "--param-dtype", "bfloat16"), True, 1, 1, 1, None),
    (("--attention", "flash",), False, 0, 1, 1, None),  # CPU FLASH runs in float32
    (("--backend", "nccl",), True, 1, 1, 1, "needs --device cuda"),
    (("--device", "cuda",), False, 0, 1, 1, "CUDA is not available"),
])
def test_refusals_are_one_line(monkeypatch, argv, cuda, gpus, local, world, want):
    from parity.workloads.train import refusal

    monkeypatch.setenv("WORLD_SIZE", str(world))
    why = refusal(_ns(*argv), cuda, gpus, local)
    if want is None:
        assert why is None
    else:
        assert want in why and "\n" not in why


def test_default_backend_follows_the_device():
    from parity.workloads.train import default_backend

    assert default_backend(_ns()) == "gloo"
    assert default_backend(_ns("--device", "cuda")) == "nccl"
    assert default_backend(_ns("--device", "cuda", "--backend", "gloo")) == "gloo"


def test_roofline_estimate_is_replaced_only_where_it_cannot_work():
    from torch._inductor.fx_passes import overlap_scheduling

    from parity.workloads import bucketing

    has = hasattr(overlap_scheduling, "estimate_roofline_runtime_ms")
    if not torch.cuda.is_available():
        assert bucketing._roofline_needs_replacing() == has
    original = getattr(overlap_scheduling, "estimate_roofline_runtime_ms", None)
    with bucketing._no_roofline_estimate():
        pass
    assert getattr(overlap_scheduling, "estimate_roofline_runtime_ms", None) is original


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [
    ("--mode", "eager"),
    ("--mode", "compiled", "--bucket-order", "registration"),
    ("--mode", "compiled", "--cudagraphs", "--attention", "flash", "--param-dtype", "bfloat16"),
], ids=["eager", "compiled", "compiled-cudagraphs-flash-bf16"])
def test_workload_runs_on_cuda_single_rank(extra):
    proc = _python("-m", "parity.workloads.train", "--device", "cuda", "--steps", "2", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 loss" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_on_cuda_eager_vs_compiled_two_ranks_sharing_a_gpu(tmp_path):
    """The issue-12 check: 2 ranks over gloo on GPU 0 (or NCCL on 2 GPUs), captured by `parity
    exec` with device digests; eager FSDP2 and compiled registration order hash the same."""
    import json

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    runs = {}
    for name, mode in (("eager", ["--mode", "eager"]),
                       ("compiled", ["--mode", "compiled", "--bucket-order", "registration"])):
        out = tmp_path / name
        proc = _python("-c", "import cli; cli.main()", "exec", "--out", str(out), "--",
                       sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", "2", "-m", "parity.workloads.train", "--device",
                       "cuda", "--backend", backend, "--steps", "3", *mode)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out
        meta = json.loads((out / "rank-00000" / "meta.json").read_text())
        assert meta["capture"]["hasher"] == "device"
        assert meta["capture"]["device_digest"] in ("triton", "torch")
        assert meta["gpu"]["name"] and meta["gpu"]["cuda"]
    proc = _python("-c", "import cli; cli.main()", "diff", str(runs["eager"]), str(runs["compiled"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
