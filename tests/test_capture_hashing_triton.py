"""The Triton device digest (parity/capture/hashing_triton.py) against the torch-ops reference.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process (the interpreter has to be
chosen before triton is imported; tests/triton_interpret_cases.py); on CUDA it runs for real."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parity.capture import hashing, hashing_triton, host_native
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


def _interpret(script: str, **env_vars) -> dict:
    """Run tests/``script`` under the Triton interpreter in a child; its JSON output."""
    env = dict(os.environ, TRITON_INTERPRET="1", **env_vars)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "tests" / script)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def interpreted():
    return _interpret("triton_interpret_cases.py")


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


@pytest.fixture(scope="module")
def interpreted_figures(tmp_path_factory):
    # the compiled host check built afresh (host_native), in a folder of this test run
    return _interpret("triton_interpret_figures.py",
                      PARITY_CACHE_DIR=str(tmp_path_factory.mktemp("parity-cache")))


U = 2.0 ** -53  # float64's unit roundoff


def _close_figures(kernel, host, n: int, abs_sum: float) -> str | None:
    """None when the kernel's figures are the host's up to the order of float64 additions: any
    two orders of adding n terms differ by at most 2 (n - 1) u sum|x_i| (sum) and 2 (n - 1) u
    sum x_i**2 (sum of squares, all terms positive; the kernel's fma rounds each square once
    less); max |x| is exact, so equal. NaN and inf where the host has them."""
    import math

    for i, (k, h) in enumerate(zip(kernel, host)):
        if math.isnan(h) or math.isinf(h):
            if not (math.isnan(k) if math.isnan(h) else k == h):
                return f"figure {i}: kernel {k} host {h}"
            continue
        bound = 0.0 if i == 2 else 2 * max(n - 1, 0) * U * (abs_sum if i == 0 else h) * 1.0001
        if abs(k - h) > bound:
            return f"figure {i}: kernel {k!r} host {h!r} differ by {abs(k - h):.3g} > {bound:.3g}"
    return None


@need_triton
def test_kernel_figures_under_the_interpreter_are_the_host_figures(interpreted_figures):
    """The digest kernels' own figures (one pass with the digest, row partials reduced in a
    fixed order) against ``hashing.tensor_figures`` on every decoded dtype, odd sizes, whole
    and partial rows, unaligned views, NaN, inf, -0.0, subnormals, extreme integers and 60
    small tensors of mixed dtypes in one table; float8 and uint16 are left to torch ops."""
    got = interpreted_figures
    assert got["digests_equal"]  # the figures change nothing in the digests
    assert got["fallback"] == ["f8_fallback", "u16_fallback"]
    worst = [0.0, 0.0]
    checked = 0
    for name, (kernel, host, n, abs_sum, fallback) in got["cases"].items():
        if fallback:
            continue
        kernel, host = [float(x) for x in kernel], [float(x) for x in host]
        why = _close_figures(kernel, host, n, float(abs_sum))
        assert why is None, f"{name}: {why}"
        if all(map(math.isfinite, kernel + host)):
            if float(abs_sum):
                worst[0] = max(worst[0], abs(kernel[0] - host[0]) / float(abs_sum))
            if host[1]:
                worst[1] = max(worst[1], abs(kernel[1] - host[1]) / host[1])
        checked += 1
    assert checked >= 100
    # what "the order of additions" amounts to here: a few units of float64's last place
    assert worst[0] < 1e-14 and worst[1] < 1e-14, worst


@need_triton
def test_kernel_figures_under_the_interpreter_same_bits_at_any_address(interpreted_figures):
    """Fixed order, no float atomics: the same call twice, a tensor alone or among others, and
    the same values at another alignment (FULL, masked and byte-composed rows) give the same
    figure bytes; so two equal tensors never get different figures."""
    same = interpreted_figures["same_bits"]
    assert len(same) >= 20 and all(same.values()), [k for k, v in same.items() if not v]


@need_triton
def test_figures_under_the_interpreter_through_the_capture_path(interpreted_figures):
    """``digest_tensors_async(..., "device", figures=True)`` as capture calls it (a stable list:
    the table built once, then reused; a list with rows left out, as the step's entry digests
    have): one kernel result carries digests and figures; float8 and uint16 tensors get
    torch-ops figures in a part of their own."""
    cap = interpreted_figures["capture_path"]
    assert cap["kernel_pending"] == "Pending"
    # a list with rows left out (None) takes the kernels too, None -> NO_HASH and NO_FIGURES
    assert interpreted_figures["holes"] == {"kernel_pending": "Pending", "digests": True,
                                            "figures": True}
    assert cap["digests_equal"] and cap["same_bits_twice"]
    assert all(cap["fallback_is_torch_ops"])
    for kernel, host, n, abs_sum in cap["figures"]:
        kernel, host = [float(x) for x in kernel], [float(x) for x in host]
        assert _close_figures(kernel, host, n, float(abs_sum)) is None, (kernel, host)


def test_the_cached_table_follows_the_tensors_under_the_interpreter(interpreted_figures):
    """The device table is reused only for the same tensor objects at the same addresses: a
    member given new storage, a list of the same length and ends with other members in
    between (also one at the same address: a view of half a tensor), gradients looked up
    by their owners (also when a row gains or loses its gradient) and wrapped tensors whose
    local tensor is replaced all get the digests of what they hold."""
    want = {"shared_key": [True] * 6 + [1], "holes_in_gradients": [True] * 4,
            "wrapped": [True] * 7, "new_storage": True, "other_members": True,
            "back_to_first": True, "same_addresses_other_member": True,
            "owners": [True, True, True], "same_address_other_layout_or_dtype": [True] * 4}
    # the Python loop (no compiler, or PARITY_HOST_NATIVE=0): a tensor given another byte
    # length, layout or dtype at the same address (a parameter, or a gradient) is read as it is
    assert interpreted_figures["cache_python"] == want
    # the compiled check (host_native) decides the same
    if host_native._compiler() is None:
        pytest.skip("no C++ compiler: the compiled host check was not built")
    assert interpreted_figures["host_check"].startswith("native"), \
        interpreted_figures["host_check"]
    assert interpreted_figures["cache"] == want


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
    # the figures come with them, from the kernels' own pass (float8: torch ops)
    digests, raw = hashing.digest_tensors(ts, "device", figures=True)
    assert digests == b"".join(ref)
    got = np.frombuffer(raw, "<f8").reshape(-1, 3)
    for t, fig in zip(ts, got):
        host = hashing.tensor_figures(t.cpu())
        v = (torch.view_as_real(t) if t.is_complex() else t).double().abs().sum().item()
        assert _close_figures(fig.tolist(), host, t.numel(), v) is None, (dtype, t.shape)
    assert hashing.digest_tensors(ts, "device", figures=True)[1] == raw  # same bits again
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
    """Ahead-of-time compile for an H100 (no GPU needed): the real compiler accepts the kernels
    (with and without figures), full rows of aligned words load 16 bytes at a time (fp32, bf16
    and fp16 alike), products are 32x32->64-bit, one integer atomic per lane."""
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
    assert lanes["mul_wide"] > 0 and lanes["atomics"] == 4 and lanes["fma_f64"] == 0
    # with figures: the same vector loads and integer atomics, float64 fma for the squares,
    # and no float atomic anywhere (the figures' order is fixed)
    figs = ptx["digest_lanes_figures"]
    assert "ld.global.v4.b32" in figs["loads"], figs
    assert figs["atomics"] == 4 and figs["fma_f64"] > 0
    assert all(k["float_atomics"] == 0 for k in ptx.values())
    assert ptx["digest_finish"]["atomics"] == 0 and ptx["figures_reduce"]["atomics"] == 0


@need_cuda
def test_the_digest_path_queues_without_a_host_sync():
    """What capture does inside a step (parameters as a stable list, gradients as new tensors
    of the same parameters, figures with both) raises under torch's sync debug mode if
    anything in it waits for the GPU; the bytes, read afterwards, are the reference's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=g) for n in (5, 1000, 70000)]
    params.append(torch.randn(33, device="cuda", generator=g).bfloat16())
    params.append(torch.randn(41, device="cuda", generator=g).bfloat16()[1:])  # unaligned view
    grads = [p * 2 for p in params]
    want_p = b"".join(hashing._digests_torch(params))
    want_g = b"".join(hashing._digests_torch(grads))
    for _ in range(2):  # the first call compiles the kernels and builds the tables
        hashing.digest_tensors_async(params, "auto", stable=True, figures=True).result()
        hashing.digest_tensors_async(grads, "auto", owners=params, figures=True).result()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dp = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
        dg = hashing.digest_tensors_async(grads, "auto", owners=params, figures=True)
        fresh = [p + 1 for p in params]  # new addresses: a new table, still no sync
        df = hashing.digest_tensors_async(fresh, "auto", figures=True)
        again = [p + 2 for p in params]  # a table used twice: captured and replayed, no sync
        for _ in range(3):
            da = hashing.digest_tensors_async(again, "auto", stable=True, figures=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert dp.result() == want_p and dg.result() == want_g
    assert df.result() == b"".join(hashing._digests_torch(fresh))
    assert da.result() == b"".join(hashing._digests_torch(again))
    assert hashing_triton._state["graphs"] is None
    for d, ts in ((dp, params), (dg, grads), (df, fresh)):
        got = np.frombuffer(d.figures(), "<f8").reshape(-1, 3)
        for t, fig in zip(ts, got):
            v = t.double().abs().sum().item()
            assert _close_figures(fig.tolist(), hashing.tensor_figures(t.cpu()), t.numel(),
                                  v) is None


@need_cuda
def test_a_table_is_captured_only_after_it_ran_with_the_same_figures_setting():
    """Triton compiles a kernel once per class of its integer arguments (1, a multiple of 16,
    other): a table of 16k rows launched with figures, then without, needs a variant that a
    table of other sizes compiled without figures does not provide. Capturing it on its second
    use compiled that variant inside the CUDA graph capture (a refusal turns replay off for the
    process). A table is captured once it ran with that setting itself (plan.launched)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    other = [torch.randn(5, device="cuda", generator=g) for _ in range(3)]  # n = 3
    hashing.digest_tensors_async(other, "auto", stable=True).result()  # no figures, n "other"
    ts = [torch.randn(9, device="cuda", generator=g) for _ in range(32)]  # n = 32
    want = b"".join(hashing._digests_torch(ts))
    assert hashing.digest_tensors_async(ts, "auto", stable=True, figures=True).result() == want
    for _ in range(3):  # launched without figures once, captured after that, then replayed
        assert hashing.digest_tensors_async(ts, "auto", stable=True).result() == want
    seen = [s for same_key in hashing_triton._stable.values() for s in same_key
            if s.members[0] is ts[0]]
    assert hashing_triton._state["graphs"] is None, hashing_triton._state["graphs"]
    assert seen and seen[0].plan.launched == {True, False}
    assert seen[0].plan.graphs.get(False) is not None


@need_cuda
def test_tables_replayed_as_cuda_graphs_follow_the_tensors(monkeypatch):
    """A table used a second time is captured as a CUDA graph and replayed after that
    (hashing_triton._Graphed): the replay reads the tensors' current values; new storage, a
    gradient that appears, and another stream take the launches again; digests and figures
    equal the reference and the queued launches' bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.randn(n, device="cuda", generator=g) for n in (7, 1000, 70000)]
    params.append(torch.randn(33, device="cuda", generator=g).bfloat16())
    from parity.artifacts import NO_HASH

    def ref(ts):
        return b"".join(NO_HASH if t is None else hashing._digests_torch([t])[0] for t in ts)

    for _ in range(3):
        d = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
        assert d.result() == ref(params)
    seen = [s for same_key in hashing_triton._stable.values() for s in same_key
            if s.members[0] is params[0]]
    assert hashing_triton._state["graphs"] is None
    assert seen and seen[0].plan.graphs.get(True) is not None  # captured, replayed
    with torch.no_grad():
        params[1].mul_(2)  # in place: the replay reads the new values
    d = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
    assert d.result() == ref(params)
    monkeypatch.setenv(hashing_triton.ENV_GRAPHS, "0")
    q = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
    assert q.result() == d.result() and q.figures() == d.figures()
    monkeypatch.delenv(hashing_triton.ENV_GRAPHS)
    params[2].data = params[2].data.clone() + 1  # new storage: a new table
    for _ in range(3):
        assert hashing.digest_tensors_async(params, "auto", stable=True).result() == ref(params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # another stream: queued there, never this stream's graph
        d = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
    assert d.result() == ref(params)
    grads = [p * 3 for p in params]
    grads[0] = None
    for _ in range(3):
        assert hashing.digest_tensors_async(grads, "auto", owners=params).result() == ref(grads)
    grads[0] = params[0] * 3
    assert hashing.digest_tensors_async(grads, "auto", owners=params).result() == ref(grads)
    torch.cuda.synchronize()


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

    # the steps in order, then the final-state record (issue 32) last
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4, "final"]
