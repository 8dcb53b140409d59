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
        if name in ("positions_past_2**31", "launches"):
            continue
        ref, got = pair
        assert got == ref, name
        checked += 1
    assert checked >= 15
    # the kernel sees what the properties promise: a flip and a swap change its lanes
    for changed in ("flip_first_bit", "flip_last_bit", "swap_across_programs"):
        assert interpreted[changed][1] != interpreted["float32"][1], changed
    assert interpreted["empty"][1] == [0, 0, 0, 0]
    # every kernel variant ran: all widths; aligned full chunks, unaligned, masked tails
    launches = {tuple(x) for x in interpreted["launches"]}
    assert {w for w, _, _ in launches} == {1, 2, 4, 8}
    assert {(4, True, False), (4, True, True), (4, False, True)} <= launches
    assert len(launches) <= 16  # a launch per (width, alignment, mask), not per tensor


@need_triton
def test_kernel_positions_restart_at_2_31_as_defined(interpreted):
    values, first, got = interpreted["positions_past_2**31"]
    assert got == spec_lanes(values, first)


def test_b_mult_is_shared():
    assert hashing_triton.B_MULT == hashing.B_MULT


def test_forced_torch_backend_and_cpu_tensors_never_reach_the_kernel(monkeypatch):
    monkeypatch.setenv(hashing_triton.ENV_BACKEND, "torch")
    assert not hashing_triton.usable()
    t = torch.randn(10)
    assert hashing.device_digests([t]) == [hashing._finish(hashing.device_lanes_torch([t])[0],
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
    elems = [hashing._elements(t) for t in ts]
    assert hashing_triton.device_lanes(elems) == hashing.device_lanes_torch(ts)
    assert hashing.device_backend() == "triton"
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
    """Ahead-of-time compile for an H100 (no GPU needed): the real compiler accepts the kernel,
    full chunks of aligned fp32/bf16 tensors load 16 bytes at a time, products are 32x32->64."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "tests" / "triton_compile_cases.py")],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout)
    for variant in ("4,1,0", "2,1,0"):
        assert "ld.global.v4.b32" in ptx[variant]["loads"], ptx[variant]
        assert ptx[variant]["mul_wide"] > 0 and ptx[variant]["atomics"] == 2
    assert ptx["8,0,1"]["atomics"] == 4  # 8-byte elements: the hi lanes too
