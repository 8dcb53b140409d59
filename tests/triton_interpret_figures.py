"""Run by tests/test_capture_hashing_triton.py in a child process with TRITON_INTERPRET=1 (the
interpreter must be chosen before triton is first imported): the figures the digest kernels
compute in their own pass (digest_kernels ``FIGURES``) against the host reference
(``hashing.tensor_figures``). Prints one JSON object:

* ``cases``: name -> [kernel figures, host figures, numel, sum |x|, fallback?] (floats as
  ``repr`` strings so NaN and inf survive JSON);
* ``same_bits``: name -> True when two things that must give the same figure bytes do (the same
  call twice, a tensor and its unaligned copy);
* ``capture_path``: ``hashing.digest_tensors(..., "device", figures=True)`` run through the
  kernels as capture runs them (CPU tensors standing in for one device), against the torch-ops
  reference digests and the host figures.

Sizes are tiny (BLOCK 8, ITERS 2: 16 units per row) so that tensors span many rows, whole
rows (FULL) included."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from parity.capture import hashing, hashing_triton  # noqa: E402

BLOCK, ITERS = 8, 2
CHUNK = BLOCK * ITERS


def _r(row):
    return [repr(float(x)) for x in row]


def _aligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A copy of ``t`` whose data starts ``offset_bytes`` past a 64-byte boundary."""
    es = t.element_size()
    n = t.numel()
    pad = 64 // es + 8
    buf = torch.zeros(n + 2 * pad, dtype=t.dtype)
    base = (-buf.data_ptr() % 64) // es  # elements to the next 64-byte boundary
    start = base + offset_bytes // es
    out = buf[start:start + n]
    out.copy_(t.reshape(-1))
    assert (out.data_ptr() - offset_bytes) % 64 == 0
    return out


def cases(g) -> dict:
    x = torch.randn(5 * CHUNK + 3, generator=g)
    c = {
        "f32_one": torch.tensor([-2.5]),
        "f32_37": torch.randn(37, generator=g),
        "f32_whole_rows": _aligned(torch.randn(4 * CHUNK, generator=g), 0),  # FULL rows only
        "f32_rows_and_rest": _aligned(x, 0),
        "f32_rows_at_4": _aligned(x, 4),  # 4-byte aligned, not 16: masked rows
        "f32_2d_transposed": torch.randn(7, 9, generator=g).t(),
        "f32_nan": torch.tensor([1.0, float("nan"), -3.0] * 11),
        "f32_inf": torch.tensor([1.0, float("inf"), 2.0] * 11),
        "f32_inf_both": torch.tensor([float("-inf"), 1.0, float("inf")] * 11),
        "f32_neg_zero": torch.tensor([-0.0] * 9),
        "f32_huge": torch.tensor([3.0e38, -3.0e38, 1.0] * 7),
        "f32_tiny": torch.tensor([1e-45, -1e-44, 1e-38] * 7),  # subnormals
        "bf16_1": torch.tensor([1.5], dtype=torch.bfloat16),
        "bf16_67": torch.randn(67, generator=g).bfloat16(),
        "bf16_rows_half_word": _aligned(torch.randn(4 * CHUNK + 1, generator=g).bfloat16(), 0),
        "bf16_at_odd_element": _aligned(torch.randn(4 * CHUNK + 1, generator=g).bfloat16(), 2),
        "bf16_nan": torch.tensor([1.0, float("nan"), 2.0, -1.0, 4.0], dtype=torch.bfloat16),
        "bf16_inf": torch.tensor([1.0, float("-inf"), 2.0], dtype=torch.bfloat16),
        "f16_33": torch.randn(33, generator=g).half(),
        "f16_rows": _aligned(torch.randn(6 * CHUNK + 3, generator=g).half() * 1000, 0),
        "f16_at_odd_element": torch.randn(41, generator=g).half()[1:],
        "f16_nan_inf": torch.tensor([float("nan"), 1.0, float("inf")], dtype=torch.float16),
        "f16_subnormal": torch.tensor([6e-8, -1e-7, 3e-5] * 5, dtype=torch.float16),
        "f64_13": torch.randn(13, generator=g, dtype=torch.float64),
        "f64_rows": _aligned(torch.randn(3 * CHUNK + 5, generator=g, dtype=torch.float64), 0),
        "f64_at_8": _aligned(torch.randn(3 * CHUNK + 5, generator=g, dtype=torch.float64), 8),
        "f64_wide_range": torch.tensor([1e300, -1e-300, 1e10, -7.0] * 5, dtype=torch.float64),
        "f64_nan": torch.tensor([1.0, float("nan")] * 9, dtype=torch.float64),
        "i8_rows": _aligned(torch.randint(-128, 128, (10 * CHUNK + 3,), generator=g,
                                          dtype=torch.int8), 0),  # whole rows of a rare kind
        "i8_min": torch.tensor([-128, 127, 0, -1, 5], dtype=torch.int8),
        "u8_70": torch.randint(0, 256, (70,), generator=g, dtype=torch.uint8),
        "u8_at_3": torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8)[3:],
        "bool_rows": _aligned(torch.rand(5 * CHUNK + 2, generator=g) > 0.5, 0),
        "i16_77": torch.randint(-2**15, 2**15, (77,), generator=g, dtype=torch.int16),
        "i32_rows": _aligned(torch.randint(-2**31, 2**31 - 1, (3 * CHUNK + 1,), generator=g,
                                           dtype=torch.int32), 0),
        "i32_min": torch.tensor([-2**31, 2**31 - 1, -1], dtype=torch.int32),
        "i64_rows": _aligned(torch.randint(-2**62, 2**62, (3 * CHUNK + 1,), generator=g), 0),
        "i64_min": torch.tensor([-2**63, 2**63 - 1, 3], dtype=torch.int64),
        "c64_rows": _aligned(torch.randn(2 * CHUNK + 3, generator=g, dtype=torch.complex64), 0),
        "c128_21": torch.randn(21, generator=g, dtype=torch.complex128),
        "c64_conj": torch.randn(9, generator=g, dtype=torch.complex64).conj(),
        "c32_21": torch.view_as_complex(torch.randn(21, 2, generator=g)).to(torch.complex32),
        "scalar": torch.tensor(-2.5),
        "empty_f32": torch.zeros(0),
        "empty_bf16": torch.zeros(0, dtype=torch.bfloat16),
        "f8_fallback": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "u16_fallback": torch.arange(30, dtype=torch.int32).to(torch.uint16),
    }
    # many small tensors of mixed dtypes and odd sizes in one table, as a parameter list
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]
    for i in range(60):
        n = int(torch.randint(0, 45, (1,), generator=g))
        c[f"small_{i}"] = (torch.randn(n, generator=g) * 3).to(dtypes[i % len(dtypes)])
    return c


def main():
    g = torch.Generator().manual_seed(0)
    c = cases(g)
    names = list(c)
    tensors = [c[n] for n in names]
    digests, raw, fallback = hashing_triton.digest_interpreted(tensors, BLOCK, ITERS, figures=True)
    got = np.frombuffer(raw, "<f8").reshape(-1, 3)
    ref_digests = b"".join(hashing.finish(ln, t.numel() * t.element_size(), t.dtype)
                           for ln, t in zip(hashing.device_lanes_torch(tensors), tensors))
    out = {"digests_equal": digests == ref_digests, "fallback": [names[i] for i in fallback],
           "cases": {}, "same_bits": {}}
    for i, (name, t) in enumerate(zip(names, tensors)):
        host = hashing.tensor_figures(t)
        v = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
        v = v.to(torch.float64).reshape(-1)
        abs_sum = float(v.abs().sum()) if v.numel() else 0.0
        out["cases"][name] = [_r(got[i]), _r(host), v.numel(), repr(abs_sum), i in fallback]

    # the same call again: the same bytes; and each tensor alone, in a table of its own
    again = hashing_triton.digest_interpreted(tensors, BLOCK, ITERS, figures=True)[1]
    out["same_bits"]["second_call"] = again == raw
    for name in ("f32_rows_and_rest", "bf16_rows_half_word", "f16_rows", "f64_rows", "i8_rows"):
        t = c[name]
        alone = hashing_triton.digest_interpreted([t], BLOCK, ITERS, figures=True)[1]
        out["same_bits"][f"{name}_alone"] = alone == got[names.index(name)].tobytes()
        # the same values at other alignments (unaligned: BYTES rows; 4- or 8-byte: masked
        # rows; 16-byte: FULL rows) give the same bytes
        for off in (t.element_size(), 4, 8, 12):
            if off % t.element_size():
                continue
            moved = _aligned(t, off)
            fig = hashing_triton.digest_interpreted([moved], BLOCK, ITERS, figures=True)[1]
            out["same_bits"][f"{name}_at_{off}"] = fig == got[names.index(name)].tobytes()

    # as capture runs it: hashing.digest_tensors(..., "device", figures=True) through the
    # kernels (the real BLOCK and ITERS), CPU tensors standing in for one CUDA device
    hashing_triton.usable = lambda: True
    hashing_triton._GET_DEVICE = lambda t: 0
    some = [c[n] for n in ("f32_rows_and_rest", "bf16_67", "f8_fallback", "i8_rows", "f64_13",
                           "u16_fallback", "f32_nan")]
    d1 = hashing.digest_tensors_async(some, "device", stable=True, figures=True)
    d2 = hashing.digest_tensors_async(some, "device", stable=True, figures=True)  # cached table
    ref = b"".join(hashing._digests_torch(some))
    cap_raw = d1.figures()
    cap = np.frombuffer(cap_raw, "<f8").reshape(-1, 3)
    # rows left out (None: the buffers of the step's entry digests, steps.py) go the same way
    from parity.artifacts import NO_FIGURES, NO_HASH

    holes = [some[0], None, some[2], None, some[1]]
    dh = hashing.digest_tensors_async(holes, "device", stable=True, figures=True)
    dh2 = hashing.digest_tensors_async(holes, "device", stable=True)
    want = hashing.digest_tensors([some[0], some[2], some[1]], "device", figures=True)
    want_d, want_f = want[0], want[1]
    out["holes"] = {
        "kernel_pending": type(dh.pending[0][1]).__name__,
        "digests": dh.result() == dh2.result() == (want_d[:16] + NO_HASH + want_d[16:32] + NO_HASH
                                                    + want_d[32:]),
        "figures": dh.figures() == (want_f[:24] + NO_FIGURES + want_f[24:48] + NO_FIGURES
                                    + want_f[48:]),
    }
    out["capture_path"] = {
        "kernel_pending": type(d1.pending[0][1]).__name__,
        "digests_equal": d1.result() == ref and d2.result() == ref,
        "same_bits_twice": d2.figures() == cap_raw,
        "figures": [[_r(cap[i]), _r(hashing.tensor_figures(t)), t.numel(),
                     repr(float(t.to(torch.float64).abs().sum()))] for i, t in enumerate(some)],
        "fallback_is_torch_ops": [cap[i].tobytes() == hashing._figures_torch(
            hashing.local_tensor(some[i])).numpy().tobytes() for i in (2, 5)],
    }
    # the cached tables, with the compiled host check where it builds, then with the Python
    # loop (PARITY_HOST_NATIVE=0 is read at every call); each from empty caches
    from parity.capture import host_native

    host_native.build_now()
    out["host_check"] = host_native.status()
    for label, env in (("cache", "1"), ("cache_python", "0")):
        os.environ[host_native.ENV] = env
        hashing_triton._stable.clear()
        hashing_triton._plans.clear()
        out[label] = _cache_cases(some, ref, NO_HASH)
    print(json.dumps(out))


def _cache_cases(some, ref, NO_HASH):
    """How the cached tables behave (hashing_triton digest_all_cuda), run once with the
    compiled host check (host_native) and once with the Python loop."""
    # the cached table is reused only for the same objects at the same addresses (hashing_triton
    # digest_all_cuda): a member given new storage (``p.data = ...``), a list with the same
    # length and ends but other members, and gradients looked up by their owners
    hashing.digest_tensors_async(some, "device", stable=True).result()  # cached
    first = some[0]
    kept = first.data
    first.data = kept.clone() * 2  # new storage, other values
    d3 = hashing.digest_tensors_async(some, "device", stable=True)
    new_storage = d3.result() == b"".join(hashing._digests_torch(some))
    first.data = kept
    other = [some[0], some[3], some[2], some[1], some[4], some[5], some[6]]
    d4 = hashing.digest_tensors_async(other, "device", stable=True)
    # the same addresses but another member object: a view of the first half of some[3]
    half = [*some[:3], some[3].reshape(-1)[: some[3].numel() // 2], *some[4:]]
    d_half = hashing.digest_tensors_async(half, "device", stable=True)
    d5 = hashing.digest_tensors_async(some, "device", stable=True)
    owners = [torch.empty(0) for _ in some]
    g1 = [t.clone() for t in some]
    g2 = [t.clone() for t in some]
    g2[3] = g2[3] + 1
    e1 = hashing.digest_tensors_async(g1, "device", owners=owners)
    e1b = hashing.digest_tensors_async(g1, "device", owners=owners)  # the cached table
    e2 = hashing.digest_tensors_async(g2, "device", owners=owners)  # other storage: rebuilt

    def want(lst):
        return b"".join(NO_HASH if t is None
                        else hashing._digests_torch([hashing.local_tensor(t)])[0] for t in lst)

    # gradients with a row missing (a parameter without one): left out while it has none,
    # hashed once it has one, left out again when it loses it
    gh = [t.clone() for t in some]
    gh[3] = None
    holes_grads = [hashing.digest_tensors_async(gh, "device", owners=owners).result() == want(gh)
                   for _ in range(2)]  # the second from the cached table
    gh[3] = some[3].clone() + 1
    holes_grads.append(hashing.digest_tensors_async(gh, "device", owners=owners).result()
                       == want(gh))
    gh[5] = None
    holes_grads.append(hashing.digest_tensors_async(gh, "device", owners=owners).result()
                       == want(gh))

    # wrapped tensors (a DTensor's _local_tensor, as FSDP2's parameters): the local tensor read
    # at every call, so a parameter given a new local tensor (FSDP2's reset_sharded_param) is
    # seen; with a row left out too
    class Wrapped:
        def __init__(self, t):
            self._local_tensor = t

    wrapped = [Wrapped(t.clone()) for t in some]
    wrapped_ok = [hashing.digest_tensors_async(wrapped, "device", stable=True).result()
                  == want(wrapped) for _ in range(2)]
    wrapped[1]._local_tensor = some[1].clone() * 3
    wrapped_ok.append(hashing.digest_tensors_async(wrapped, "device", stable=True).result()
                      == want(wrapped))
    wrapped_holes = [*wrapped[:2], None, *wrapped[3:]]
    for _ in range(2):
        wrapped_ok.append(hashing.digest_tensors_async(wrapped_holes, "device", stable=True)
                          .result() == want(wrapped_holes))
    wrapped[4]._local_tensor = some[4].clone() + 5
    wrapped_ok.append(hashing.digest_tensors_async(wrapped_holes, "device", stable=True).result()
                      == want(wrapped_holes))
    # a new local tensor at the same address (half of the old one, as a re-sharded view)
    hashing.digest_tensors_async(wrapped, "device", stable=True).result()  # cached as it is now
    old_local = wrapped[0]._local_tensor
    wrapped[0]._local_tensor = old_local.reshape(-1)[: old_local.numel() // 2]
    wrapped_ok.append(hashing.digest_tensors_async(wrapped, "device", stable=True).result()
                      == want(wrapped))
    # the parameters at a step's entry (buffer rows None) and after it (every row) share a key
    # (length and ends): both stay cached, neither is built again
    entry_like = [some[0], None, *some[2:]]
    built = []
    real_run = hashing_triton._run
    hashing_triton._run = lambda *a, **k: built.append(1) or real_run(*a, **k)
    shared_key = []
    for _ in range(3):
        shared_key.append(hashing.digest_tensors_async(entry_like, "device", stable=True).result()
                          == want(entry_like))
        shared_key.append(hashing.digest_tensors_async(some, "device", stable=True).result()
                          == want(some))
    hashing_triton._run = real_run
    shared_key.append(len(built))
    # the same address, another byte length, layout or dtype (``p.data = p.data[:2]``,
    # ``.t()``, ``.view(int32)``): both checks build again; and a gradient of the same owner at
    # the same address with fewer bytes (a parameter shrunk through ``.data``)
    sq = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 0.5
    same_addr = [sq, some[1]]
    same_address = []
    for change in (lambda: sq[:2], lambda: sq.t(), lambda: sq.view(torch.int32)):
        hashing.digest_tensors_async(same_addr, "device", stable=True).result()  # cached
        kept_sq = sq.data
        sq.data = change()
        same_address.append(hashing.digest_tensors_async(same_addr, "device", stable=True)
                            .result() == want(same_addr))
        sq.data = kept_sq
    grads_sq = [sq.clone(), some[1].clone()]
    grad_owners = [torch.empty(0), torch.empty(0)]
    hashing.digest_tensors_async(grads_sq, "device", owners=grad_owners).result()  # cached
    grads_sq[0] = grads_sq[0][:2]
    same_address.append(hashing.digest_tensors_async(grads_sq, "device", owners=grad_owners)
                        .result() == want(grads_sq))
    return {
        "same_address_other_layout_or_dtype": same_address,
        "shared_key": shared_key,
        "holes_in_gradients": holes_grads,
        "wrapped": wrapped_ok,
        "new_storage": new_storage,
        "other_members": d4.result() == b"".join(hashing._digests_torch(other)),
        "back_to_first": d5.result() == ref,
        "same_addresses_other_member": d_half.result() == b"".join(hashing._digests_torch(half)),
        "owners": [e1.result() == ref, e1b.result() == ref,
                   e2.result() == b"".join(hashing._digests_torch(g2))],
    }


if __name__ == "__main__":
    sys.exit(main())
