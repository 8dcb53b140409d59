"""Unit tests for capture's hashing and FQN normalization (no processes started)."""

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.artifacts import NO_HASH
from parity.capture.hashing import device_digest, device_digests, digest_tensors, host_digest
from parity.capture.names import normalize_fqn
from parity.capture.steps import sampled

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool]


def _tensor(dtype, n=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def _flip(t, byte, bit):
    u = t.clone()
    u.view(torch.uint8).reshape(-1)[byte] ^= 1 << bit
    return u


def test_host_digest_is_xxh3_of_the_bytes():
    t = torch.randn(5, 7)
    assert host_digest(t) == xxhash.xxh3_128_digest(t.numpy().tobytes())
    assert host_digest(t).hex() == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    # non-contiguous: hashed as its contiguous copy; 0-d and empty work
    assert host_digest(t.t()) == xxhash.xxh3_128_digest(t.t().contiguous().numpy().tobytes())
    assert len(host_digest(torch.tensor(3.0))) == 16
    assert host_digest(torch.zeros(0)) == xxhash.xxh3_128_digest(b"")
    # bf16 has no numpy dtype: the uint8 view sidesteps it
    b = t.bfloat16()
    assert host_digest(b) == xxhash.xxh3_128_digest(b.view(torch.int16).numpy().tobytes())
    # requires_grad parameters
    assert host_digest(torch.nn.Parameter(t.clone())) == host_digest(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_digest_single_bit_flips(dtype):
    t = _tensor(dtype)
    base = device_digest(t)
    nbytes = t.numel() * t.element_size()
    for byte in (0, 1, nbytes // 2, nbytes - 1):
        for bit in range(8):
            u = _flip(t, byte, bit)
            if dtype == torch.bool and bit:  # bools hold 0/1: only bit 0 is a valid flip
                continue
            assert device_digest(u) != base, (byte, bit)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_digest_swaps_and_stability(dtype):
    t = _tensor(dtype)
    base = device_digest(t)
    assert device_digest(t.clone()) == base  # stable across calls and copies
    assert device_digest(t) == base
    flat = t.reshape(-1)
    for i, j in ((0, 1), (0, flat.numel() - 1), (10, 200)):
        if flat[i] == flat[j]:
            continue
        u = flat.clone()
        u[i], u[j] = flat[j].clone(), flat[i].clone()
        assert device_digest(u) != base, (i, j)


def test_device_digest_known_values_are_stable_across_runs():
    # Pinned: a change here changes every recorded device digest (say so in docs/capture.md and
    # raise hashing.DEVICE_DIGEST_VERSION: runs of different versions are never compared).
    from parity.capture import hashing

    assert hashing.DEVICE_DIGEST_VERSION == 2
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert device_digest(t).hex() == "2394f582c787ae51f5a3e4edbc02cfde"
    assert device_digest(torch.arange(5, dtype=torch.bfloat16)).hex() == \
        "1dd353e0c38ea546b016203c8d13f8dc"
    assert device_digest(torch.arange(3, dtype=torch.float64)).hex() == "25d548c45b9194b4bf61c5bf7d0081da"


def test_finish_is_a_bijection_of_the_word_lanes_and_keyed():
    """Distinct (L0, L2) give distinct digests (the guarantees of the lanes carry over); the
    same lanes under another length or dtype give another digest; zero lanes are not NO_HASH."""
    from parity.capture.hashing import finish

    seen = set()
    for l0 in (0, 1, 2, 2**63, 2**64 - 1):
        for l2 in (0, 1, 3, 2**40, 2**64 - 1):
            seen.add(finish([l0, 0, l2, 0], 8, torch.float32))
    assert len(seen) == 25
    z = finish([0, 0, 0, 0], 8, torch.float32)
    assert z != NO_HASH
    assert z != finish([0, 0, 0, 0], 12, torch.float32)
    assert z != finish([0, 0, 0, 0], 8, torch.int32)


def test_words_make_bf16_fp16_and_bytes_position_sensitive():
    """Version 2 reads 1/2/4-byte dtypes as uint32 words: a swap of two elements inside one
    word, or of elements at different places of two words, still changes the digest."""
    for dtype in (torch.bfloat16, torch.float16, torch.int8, torch.uint8):
        t = _tensor(dtype, n=131)
        base = device_digest(t)
        flat = t.reshape(-1)
        for i, j in ((0, 1), (2, 3), (0, 3), (1, 2), (5, 130), (64, 129)):
            if torch.equal(flat[i].reshape(1).view(torch.uint8), flat[j].reshape(1).view(torch.uint8)):
                continue
            u = flat.clone()
            u[i], u[j] = flat[j].clone(), flat[i].clone()
            assert device_digest(u) != base, (dtype, i, j)
        # the zero padding of the last word is not the same as a real zero element
        assert device_digest(t[:-1]) != device_digest(torch.cat([t[:-1], t.new_zeros(1)]))


def test_device_digest_catches_a_change_that_cancels_in_the_linear_lanes():
    from parity.capture import hashing

    t = torch.full((8,), 5, dtype=torch.int32)
    u = t.clone()
    u[0] += 2  # weight a_0 = 1
    u[1] -= 1  # weight a_1 = 2: the linear lane sees 2*1 - 1*2 = 0; the b lane 2*b_0 - b_1
    la, lb = hashing.device_lanes_torch([t, u])
    assert la[0] == lb[0] and la[2] != lb[2]
    assert device_digest(u) != device_digest(t)


def test_device_digest_depends_on_length_and_dtype():
    assert device_digest(torch.zeros(4)) != device_digest(torch.zeros(5))
    assert device_digest(torch.zeros(4)) != device_digest(torch.zeros(4, dtype=torch.int32))
    assert device_digest(torch.zeros(0)) != device_digest(torch.zeros(1))


def test_device_digest_chunks_and_noncontiguous():
    from parity.capture import hashing

    t = torch.randn(3 * hashing._CHUNK + 5)
    assert device_digest(t) != device_digest(_flip(t, t.numel() * 4 - 1, 7))
    u = t.clone()
    u[hashing._CHUNK - 1], u[hashing._CHUNK] = t[hashing._CHUNK], t[hashing._CHUNK - 1]
    assert device_digest(u) != device_digest(t)
    m = torch.randn(6, 5)
    assert device_digest(m.t()) == device_digest(m.t().contiguous())
    assert device_digests([m, t, torch.zeros(0)]) == [device_digest(m), device_digest(t),
                                                     device_digest(torch.zeros(0))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=64),
       st.data())
def test_device_digest_property_swap_and_flip(values, data):
    t = torch.tensor(values, dtype=torch.float32)
    base = device_digest(t)
    i = data.draw(st.integers(0, len(values) - 1))
    j = data.draw(st.integers(0, len(values) - 1))
    if t.view(torch.int32)[i] != t.view(torch.int32)[j]:
        u = t.clone()
        u[i], u[j] = t[j].clone(), t[i].clone()
        assert device_digest(u) != base
    byte = data.draw(st.integers(0, 4 * len(values) - 1))
    bit = data.draw(st.integers(0, 7))
    assert device_digest(_flip(t, byte, bit)) != base


def test_digest_tensors_orders_and_missing():
    a, b = torch.randn(3), torch.randn(4)
    raw = digest_tensors([a, None, b], "xxh3")
    assert raw == host_digest(a) + NO_HASH + host_digest(b)
    assert digest_tensors([a, None, b], "auto") == raw  # CPU tensors: xxh3
    dev = digest_tensors([a, None, b], "device")
    assert dev == device_digest(a) + NO_HASH + device_digest(b)
    assert np.frombuffer(dev, np.uint8).reshape(-1, 16).shape == (3, 16)


@pytest.mark.parametrize("raw,norm", [
    ("layers.0.attention.wq.weight", "layers.0.attention.wq.weight"),
    ("_orig_mod.layers.0.attention.wq.weight", "layers.0.attention.wq.weight"),
    ("layers.0._checkpoint_wrapped_module.attention.wq.weight", "layers.0.attention.wq.weight"),
    ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w", "layers.0.w"),
    ("module.layers.0.w", "layers.0.w"),
    ("module._orig_mod.layers.0.w", "layers.0.w"),
    ("_orig_mod.module.layers.0.w", "layers.0.w"),
    ("layers.module.w", "layers.module.w"),  # not a DDP root wrapper
    ("out.parametrizations.weight.original", "out.weight"),
    ("out.parametrizations.weight.original0", "out.weight.original0"),
    ("module", "module"),
    ("weight", "weight"),
])
def test_normalize_fqn(raw, norm):
    assert normalize_fqn(raw) == norm
    assert normalize_fqn(norm) == norm  # idempotent


def test_sampling_rule():
    assert [s for s in range(11) if sampled(s, 3)] == [0, 1, 3, 6, 9]
    assert all(sampled(s, 1) for s in range(5))


# ------------------------------------------------------------------ the device digest's definition
M64 = (1 << 64) - 1


def spec_units(t: torch.Tensor) -> list[int]:
    """docs/capture.md's units of a tensor, as unsigned ints: 8-byte elements as they are, any
    other width as the little-endian uint32 words of the bytes (the last padded with zeros)."""
    flat = t.contiguous().reshape(-1)
    if flat.element_size() % 8 == 0:
        return [v & M64 for v in flat.view(torch.int64).tolist()]
    raw = bytes(flat.view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 4)
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]


def spec_lanes(values: list[int], first: int = 0) -> list[int]:
    """docs/capture.md's definition written out with Python ints: ``values`` are the units as
    unsigned ints, ``first`` the position of the first one."""
    lanes = [0, 0, 0, 0]
    for k, v in enumerate(values):
        q1 = ((first + k) % 2**31) + 1
        b = (((q1 * 0x9E3779B1) % 2**32) >> 1) | 1
        lo, hi = v & 0xFFFFFFFF, v >> 32
        for lane, (word, weight) in enumerate(((lo, q1), (hi, q1), (lo, b), (hi, b))):
            lanes[lane] = (lanes[lane] + word * weight) & M64
    return lanes


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn], ids=str)
def test_torch_ops_lanes_follow_the_definition(dtype):
    from parity.capture import hashing

    t = _tensor(dtype if dtype != torch.float8_e4m3fn else torch.float32, n=301).to(dtype)
    assert hashing.device_lanes_torch([t]) == [spec_lanes(spec_units(t))]
    assert hashing.device_lanes_torch([t[1:]]) == [spec_lanes(spec_units(t[1:]))]  # unaligned


def test_torch_ops_lanes_wrap_and_carry_like_uint64(monkeypatch):
    from parity.capture import hashing

    # int64 words near 2**64 make every lane wrap; small chunks exercise the carry folding and
    # the weights of chunks that do not start at position 0
    monkeypatch.setattr(hashing, "_CHUNK", 16)
    monkeypatch.setattr(hashing, "_WEIGHTS", {})
    t = torch.tensor([-1, -2, 2**63 - 1, -(2**63)] * 13, dtype=torch.int64)
    values = [v & M64 for v in t.tolist()]
    assert hashing.device_lanes_torch([t]) == [spec_lanes(values)]
    assert max(spec_lanes(values)) >= 2**63
    # the positions restart at 2**31: a_i = (i mod 2**31) + 1
    assert spec_lanes([7], first=2**31) == spec_lanes([7], first=0)
    assert hashing.B_MULT == 0x9E3779B1



# ------------------------------------------------------------------ figures (issue 34)


def _reference_figures(t):
    """(sum, sum of squares, max |x|) of ``t`` in float64, the slow obvious way."""
    v = torch.view_as_real(t) if t.is_complex() else t
    v = v.to(torch.float64).reshape(-1)
    if not v.numel():
        return (0.0, 0.0, 0.0)
    return (v.sum().item(), (v * v).sum().item(), v.abs().max().item())


def _figures(raw: bytes):
    return [tuple(row) for row in np.frombuffer(raw, "<f8").reshape(-1, 3).tolist()]


FIG_CASES = [torch.randn(100), torch.randn(70_000), torch.randn(300, 3).t(), torch.randn(300, 301),
             torch.randn(40, 2000).to(torch.bfloat16).t(),
             torch.randn(50).to(torch.bfloat16), torch.randn(66_001).to(torch.bfloat16),
             torch.randint(-50, 50, (33,)), torch.rand(20) > 0.5, torch.zeros(0),
             torch.randn(7, dtype=torch.complex64), torch.tensor(3.5), torch.randn(9).half()]


def test_figures_come_with_the_same_digests_and_the_obvious_values():
    """``digest_tensors(..., figures=True)``: the digests are those without figures, and each
    tensor's figures are its float64 sum, sum of squares and max |x|, on the host path (small
    tensors together, large ones chunk by chunk) and on the torch-ops device path alike."""
    from parity.artifacts import NO_FIGURES

    tensors = [*FIG_CASES, None]
    for hasher in ("xxh3", "device"):
        digests, raw = digest_tensors(tensors, hasher, figures=True)
        assert digests == digest_tensors(tensors, hasher)
        got = _figures(raw)
        assert raw[-24:] == NO_FIGURES and got[-1][1] == -1.0  # no tensor: never a real row
        for t, fig in zip(FIG_CASES, got):
            want = _reference_figures(t)
            assert np.allclose(fig, want, rtol=1e-12, atol=1e-12), (hasher, t.dtype, fig, want)
    from parity.capture.hashing import tensor_figures  # one tensor, as the host path records it

    host = _figures(digest_tensors(FIG_CASES, "xxh3", figures=True)[1])
    for t, fig in zip(FIG_CASES, host):
        assert np.allclose(tensor_figures(t), fig, rtol=1e-12, atol=1e-12)


def test_large_tensors_hash_in_chunks_to_the_one_shot_digest():
    """A tensor larger than FIG_CHUNK is fed to a streaming xxh3 chunk by chunk (each chunk
    summed while in cache): the digest is still xxh3-128 of the whole bytes."""
    from parity.capture import hashing

    for shape in ((hashing.FIG_CHUNK + 1,), (3, hashing.FIG_CHUNK), (517, 640),
                  (5, 3, hashing.FIG_CHUNK // 8 + 7)):
        t = torch.randn(shape)
        d, raw = digest_tensors([t], "xxh3", figures=True)
        assert d == xxhash.xxh3_128_digest(t.numpy().tobytes()) == host_digest(t)
        assert np.allclose(_figures(raw)[0], _reference_figures(t), rtol=1e-12)


def test_figures_see_a_last_bit_change_in_the_sum():
    """One element one ulp up: the float64 sum moves by exactly that ulp (the figures resolve
    last-bit differences of float32 values)."""
    t = torch.randn(1000)
    u = t.clone()
    u[17] = torch.nextafter(u[17], torch.tensor(float("inf")))
    (_, fa), (_, fb) = (digest_tensors([x], "xxh3", figures=True) for x in (t, u))
    sa, sb = _figures(fa)[0][0], _figures(fb)[0][0]
    assert sb - sa == pytest.approx(float(u[17]) - float(t[17]), rel=1e-6)


def test_pending_device_figures_read_back_like_the_host_ones():
    """The figures a device path queues behind its digests (``_figures_pending``: torch ops on
    the tensors' device, read back through ``Pending``) are the host path's, in list order."""
    from parity.capture import hashing

    ts = [torch.randn(100), torch.randn(70_000), torch.randn(33).to(torch.bfloat16)]
    pending = hashing._figures_pending(ts)
    d = hashing.Digests(4, [([0, 1, 3], digest_tensors(ts, "xxh3"))], [],
                        [([0, 1, 3], pending)])
    got, host = _figures(d.figures()), _figures(digest_tensors(ts, "xxh3", figures=True)[1])
    assert np.allclose([got[0], got[1], got[3]], host, rtol=1e-12)
    assert got[2][1] == -1.0  # position 2: no tensor (NO_FIGURES)
    assert d.ready()


def _figures_as_first_written(t) -> tuple:
    """The host figures exactly as the first version computed them (issue 34, before the
    faster path): per 64 Ki chunk a float64 copy, ``sum``, ``einsum`` and |x| then ``max``;
    small tensors by ``reduceat`` over a float64 concatenation."""
    from parity.capture import hashing

    v = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
    v = v.detach().contiguous().reshape(-1)
    if v.dtype not in hashing._NUMPY_DTYPES:
        v = v.to(torch.float32)
    a = v.numpy()
    if t.numel() == 0:
        return (0.0, 0.0, 0.0)
    if t.numel() <= hashing.FIG_CHUNK:
        d = a.astype(np.float64)
        off = np.zeros(1, np.int64)
        return (float(np.add.reduceat(d, off)[0]), float(np.add.reduceat(d * d, off)[0]),
                float(np.maximum.reduceat(np.abs(d), off)[0]))
    step = hashing.FIG_CHUNK * (2 if t.is_complex() else 1)
    acc = [0.0, 0.0, 0.0]
    for s in range(0, a.size, step):
        d = a[s:s + step].astype(np.float64)
        acc[0] += float(d.sum())
        acc[1] += float(np.einsum("i,i->", d, d))
        acc[2] = float(np.maximum(acc[2], np.abs(d).max()))
    return tuple(acc)


def test_host_figures_keep_the_bits_of_the_first_version():
    """The faster host path (one cast per chunk, max |x| from max and min, bfloat16 widened
    straight to float64, small tensors summed in cache-sized batches) changes no bit: figures
    of runs recorded before it compare with new ones as they are (no figures version)."""
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(70_000, generator=g), torch.randn(300, 301, generator=g),
             torch.randn(66_001, generator=g).bfloat16(),
             torch.randn(40, 2000, generator=g).bfloat16().t(),
             torch.randn(130_000, generator=g).half(),
             torch.randint(-100, 100, (70_000,), generator=g),
             torch.randn(70_000, generator=g, dtype=torch.complex64),
             torch.randn(70_001, generator=g, dtype=torch.float64),
             torch.tensor([float("nan")] + [1.0] * 70_000),
             torch.tensor([1.0] * 70_000 + [float("nan")]).bfloat16(),
             torch.tensor([float("-inf")] + [1.0] * 70_000),
             torch.zeros(70_000), -torch.zeros(100), torch.rand(70_000, generator=g) > 0.5,
             torch.randn(100, generator=g), torch.randn(7, generator=g).bfloat16(),
             torch.randint(-128, 127, (50,), generator=g, dtype=torch.int8),
             torch.randint(-128, 127, (70_000,), generator=g, dtype=torch.int8),
             torch.randn(70_000, generator=g).to(torch.float8_e4m3fn),
             torch.randn(50, generator=g).to(torch.float8_e5m2), torch.tensor([-0.0, -1.5]),
             torch.zeros(0)]
    cases += [torch.randn(int(n), generator=g) for n in torch.randint(1, 3000, (120,),
                                                                       generator=g)]
    got = np.frombuffer(digest_tensors(cases, "xxh3", figures=True)[1], "<f8").reshape(-1, 3)
    for t, row in zip(cases, got):
        want = np.array(_figures_as_first_written(t), dtype="<f8")
        assert row.tobytes() == want.tobytes(), (t.dtype, t.shape, row, want)


def test_auto_is_resolved_once_per_run_so_cpu_rows_of_a_device_run_get_the_device_digest():
    """--hasher auto picks one digest for the whole run at its first digest (table.py
    ``_table_hasher``): a device run's rows that sit on the CPU (a buffer kept on the host, the
    final state after ``model.cpu()``) get the device digest (by torch ops), which equals the
    other run's digest of the same values on a GPU; per tensor, xxh3 and the device digest never
    agree (found by reading, round 5). Pure logic: a stand-in for a CUDA tensor (no GPU here)."""
    from parity.capture.hashing import digest_tensors_async
    from parity.capture.table import ParamTable

    class OnCuda:  # what _table_hasher reads of a CUDA tensor
        is_cuda = True
        layout = torch.strided

        def detach(self):
            return self

    class Run(ParamTable):
        def __init__(self, hasher):
            self.hasher, self._resolved_hasher = hasher, None
            self.table, self._buffer_keys = [], set()

    cpu = torch.arange(6, dtype=torch.float32)
    run = Run("auto")
    assert run._table_hasher([OnCuda(), cpu]) == "device"
    assert run._table_hasher([cpu]) == "device"  # resolved once: a later CPU-only call too
    got = digest_tensors_async([cpu], run._table_hasher([cpu])).result()
    assert got == device_digests([cpu])[0] != host_digest(cpu)
    run = Run("auto")
    assert run._table_hasher([cpu]) == "xxh3" and run._table_hasher([OnCuda()]) == "xxh3"
    assert Run("device")._table_hasher([cpu]) == "device"
