"""The Triton device digest (parity/capture/hashing_triton.py) against the torch-ops reference.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process (the interpreter has to be
chosen before triton is imported; tests/triton_interpret_cases.py); on CUDA it runs for real."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.capture import hashing, hashing_triton
from test_capture_hashing import spec_lanes

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    HAVE_TRITON = False

need_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable "
                                 "(pip install -e '.[dev]' installs it)")
need_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()),
                               reason="needs CUDA and triton")


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "tests" / "triton_interpret_cases.py")],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@need_triton
def test_kernel_equals_reference_bit_for_bit_under_the_interpreter(interpreted):
    checked = 0
    for name, pair in interpreted.items():
        if name in ("positions_past_2**31", "lanes", "modes", "rows"):
            continue
        ref, got = pair
        assert got == ref, name
        checked += 1
    assert checked >= 80
    assert interpreted["lanes"][0] == interpreted["lanes"][1]
    # the kernel sees what the properties promise: flips and swaps change its digest
    for changed, base in (("flip_first_bit", "float32"), ("flip_last_bit", "float32"),
                          ("swap_across_programs", "float32"), ("bf16_flip_last_bit", "bfloat16_odd"),
                          ("bf16_swap_in_a_word", "bfloat16_odd"),
                          ("bf16_swap_across_words", "bfloat16_odd")):
        assert interpreted[changed][1] != interpreted[base][1], changed
    assert interpreted["empty"][1] != interpreted["empty_bf16"][1]  # keyed by the dtype
    # every row mode ran: words (full and masked), bytes (tails, unaligned), 8-byte elements;
    # all of them in one launch (the table mixes them)
    from parity.capture import digest_kernels as k

    assert set(interpreted["modes"]) == {k.WORDS, k.WORDS + k.FULL, k.BYTES, k.ELEM64,
                                         k.ELEM64 + k.FULL}


@need_triton
def test_kernel_positions_restart_at_2_31_as_defined(interpreted):
    values, first, got = interpreted["positions_past_2**31"]
    assert got == spec_lanes(values, first)


def test_b_mult_is_shared():
    assert hashing_triton.B_MULT == hashing.B_MULT


def test_forced_torch_backend_and_cpu_tensors_never_reach_the_kernel(monkeypatch):
    monkeypatch.setenv(hashing_triton.ENV_BACKEND, "torch")
    assert not hashing_triton.usable()
    assert hashing_triton.digest_all_cuda([torch.randn(3)]) is None
    t = torch.randn(10)
    assert hashing.device_digests([t]) == [hashing.finish(hashing.device_lanes_torch([t])[0],
                                                          40, t.dtype)]


@need_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.int32, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn], ids=str)
def test_kernel_on_cuda_equals_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 1000, hashing_triton.BLOCK * hashing_triton.ITERS + 3, 3 * 2**20 + 7]
    ts = []
    for n in sizes:
        x = torch.randn(n, device="cuda", generator=g)
        ts.append(x > 0 if dtype == torch.bool else x.to(dtype))
    ts.append(torch.randn(64, 48, device="cuda", generator=g).to(dtype).t())  # non-contiguous
    ts.append(torch.zeros(0, device="cuda", dtype=dtype))
    ts.append(torch.randn(41, device="cuda", generator=g).to(dtype)[1:])  # unaligned view
    assert hashing_triton.device_lanes(ts) == hashing.device_lanes_torch(ts)
    assert hashing.device_backend() == "triton"
    ref = [hashing.finish(ln, t.numel() * t.element_size(), t.dtype)
           for ln, t in zip(hashing.device_lanes_torch(ts), ts)]
    assert hashing.device_digests(ts) == ref
    # and through the public digest, flips and swaps included
    base = hashing.device_digests(ts)
    u = ts[2].clone()
    u.view(torch.uint8).reshape(-1)[-1] ^= 1
    assert hashing.device_digest(u) != base[2]
    v = ts[3].clone()
    v[0], v[-1] = ts[3][-1].clone(), ts[3][0].clone()
    if not torch.equal(ts[3][0].reshape(1).view(torch.uint8), ts[3][-1].reshape(1).view(torch.uint8)):
        assert hashing.device_digest(v) != base[3]


@need_triton
def test_kernel_compiles_for_sm90_with_vector_loads():
    """Ahead-of-time compile for an H100 (no GPU needed): the real compiler accepts the kernels,
    full rows of aligned words load 16 bytes at a time (fp32, bf16 and fp16 alike), products
    are 32x32->64-bit, one atomic per lane."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "tests" / "triton_compile_cases.py")],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout)
    lanes = ptx["digest_lanes"]
    assert "ld.global.v4.b32" in lanes["loads"], lanes
    assert lanes["mul_wide"] > 0 and lanes["atomics"] == 4
    assert ptx["digest_finish"]["atomics"] == 0


@need_cuda
def test_the_digest_path_queues_without_a_host_sync():
    """What capture does inside a step (parameters as a stable list, gradients as new tensors
    of the same parameters) raises under torch's sync debug mode if anything in it waits for
    the GPU; the bytes, read afterwards, are the reference's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=g) for n in (5, 1000, 70000)]
    params.append(torch.randn(33, device="cuda", generator=g).bfloat16())
    params.append(torch.randn(41, device="cuda", generator=g).bfloat16()[1:])  # unaligned view
    grads = [p * 2 for p in params]
    want_p = b"".join(hashing._digests_torch(params))
    want_g = b"".join(hashing._digests_torch(grads))
    for _ in range(2):  # the first call compiles the kernels and builds the tables
        hashing.digest_tensors_async(params, "auto", stable=True).result()
        hashing.digest_tensors_async(grads, "auto", owners=params).result()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dp = hashing.digest_tensors_async(params, "auto", stable=True)
        dg = hashing.digest_tensors_async(grads, "auto", owners=params)
        fresh = [p + 1 for p in params]  # new addresses: a new table, still no sync
        df = hashing.digest_tensors_async(fresh, "auto")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert dp.result() == want_p and dg.result() == want_g
    assert df.result() == b"".join(hashing._digests_torch(fresh))


@need_cuda
def test_capture_on_one_gpu_writes_every_step_in_order(tmp_path):
    """parity exec of the workload at one rank on NCCL: device digests, every step recorded
    (step k written at step k+1's end or at close), in order, the loss of each step."""
    import subprocess
    import sys

    from parity.artifacts import read_run

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "parity", "exec", "--out", str(out), "--", sys.executable, "-m",
         "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
         "parity.workloads.train", "--device", "cuda", "--backend", "nccl", "--steps", "4"],
        cwd=root, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rd = read_run(out).ranks[0]
    assert sorted(rd.steps) == [0, 1, 2, 3, 4]
    assert all(rd.steps[k]["loss"] is not None and rd.steps[k]["grad_digest"]
               for k in (1, 2, 3, 4))
    cap = rd.meta["capture"]
    assert cap["hasher"] == "device" and cap["device_digest"] == "triton"
    assert cap["device_digest_version"] == hashing.DEVICE_DIGEST_VERSION
    lines = (out / "rank-00000" / "steps.jsonl").read_text().splitlines()
    import json

    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4]
