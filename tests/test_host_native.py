"""The compiled host check of the device digest's cached tables (parity/capture/host_native.py
and host_native.cpp): built by the platform's compiler into a cache folder, deciding what the
Python loop in hashing_triton decides (``_python_check``, case by case below), failing to
build in one line and once, disabled by PARITY_HOST_NATIVE=0. The check reads host-side
metadata only, so CPU tensors stand in for CUDA ones. The cached-table behaviour through the
digest itself, with and without it: test_capture_hashing_triton.py (the interpreter)."""

import array
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parity.capture import host_native

ROOT = Path(__file__).resolve().parent.parent
need_compiler = pytest.mark.skipif(host_native._compiler() is None or
                                   not sys.platform.startswith("linux"),
                                   reason="no C++ compiler on this machine (or not Linux): the "
                                          "Python loop is what runs here")


def _child(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PARITY_CACHE_DIR=str(cache), **env)
    full.pop(host_native.ENV, None)
    full.update({k: v for k, v in env.items()})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    cache = tmp_path_factory.mktemp("parity-cache")
    old = os.environ.get(host_native.ENV_CACHE)
    os.environ[host_native.ENV_CACHE] = str(cache)
    saved = dict(host_native._state)
    host_native._state.update(check=None, status="not built", thread=None)
    try:
        got = host_native.build_now()
        assert got is not None, host_native.status()
        assert host_native.status().startswith("native")
        assert list((cache / "host_native").glob("*/parity_host_native.so"))
        yield got
    finally:
        host_native._state.clear()
        host_native._state.update(saved)
        if old is None:
            os.environ.pop(host_native.ENV_CACHE, None)
        else:
            os.environ[host_native.ENV_CACHE] = old


def _sig(rows, unwrap=False):
    locs = [None if t is None else (t._local_tensor if unwrap else t) for t in rows]
    ptrs = array.array("q", [0 if t is None else t.data_ptr() for t in locs]).tobytes()
    nb = array.array("q", [0 if t is None else t.nbytes for t in locs]).tobytes()
    return ptrs, nb, [None if t is None else t.dtype for t in locs]


class Wrapped:  # a DTensor as the check sees one: an object with a _local_tensor
    def __init__(self, t):
        self._local_tensor = t


class NoStorage(torch.Tensor):  # a wrapper subclass: its own data pointer cannot be read
    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


@need_compiler
def test_the_check_answers_what_the_python_loop_answers_and_more(check):
    ts = [torch.arange(10, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
          torch.zeros(7, dtype=torch.int64), torch.ones(2, 2, dtype=torch.float16)]
    owners = [object() for _ in ts]
    p, nb, dts = _sig(ts)

    def ask(rows, members=None, seen=None, sig=(p, nb, dts), unwrap=0, locs=None, contig=True):
        return check(rows, members, seen, *sig, unwrap, locs, contig)

    assert ask(ts) == 1
    assert ask(list(ts), members=owners, seen=list(owners)) == 1
    # members: another object or order is another list (0: the caller looks further)
    assert ask(ts, members=owners[::-1], seen=owners) == 0
    assert ask(ts, members=owners[:3], seen=owners) == 0
    # new storage, another dtype or byte length, a lazy negation, a transposed layout at the
    # same address: the table no longer describes the row (2: built again)
    assert ask([ts[0].clone(), *ts[1:]]) == 2
    assert ask([ts[0].view(torch.int32), *ts[1:]]) == 2
    assert ask([ts[0][:5], *ts[1:]]) == 2
    assert ask([ts[0], ts[1], ts[2], ts[3]._neg_view()]) == 2
    assert ask([ts[0], ts[1].t(), *ts[2:]]) == 2
    # (the same address, length and dtype: only the layout says it; hashing_triton always asks
    # for it)
    assert ask([ts[0], ts[1].t(), *ts[2:]], contig=False) == 1
    # rows left out stay out; a row that gains a tensor, or loses one, is built again
    holes = [ts[0], None, ts[2], None]
    hs = _sig(holes)
    assert ask(holes, sig=hs) == 1
    assert ask(ts, sig=hs) == 2
    assert ask([ts[0], None, None, None], sig=hs) == 2
    assert ask([None, *ts[1:]]) == 2
    # not tensors, or tensors whose pointer cannot be read: 2, never an exception
    assert ask([1.5, *ts[1:]]) == 2
    assert ask([NoStorage(ts[0]), *ts[1:]]) == 2
    # a wrong length of the recorded rows
    assert ask(ts[:3]) == 2
    # wrapped tensors (unwrap 1: all, 2: row by row) and their local tensors by identity
    w = [Wrapped(t) for t in ts]
    ws = _sig(w, unwrap=True)
    assert ask(w, sig=ws, unwrap=1) == 1
    assert ask(w, sig=ws, unwrap=1, locs=list(ts)) == 1
    mixed = [w[0], ts[1], w[2], ts[3]]
    assert ask(mixed, sig=ws, unwrap=2) == 1
    assert ask(mixed, sig=ws, unwrap=1) == 2  # a plain row where every row must be wrapped
    w[2]._local_tensor = ts[2].view(torch.int64)  # a new local tensor at the same address
    assert ask(w, sig=ws, unwrap=1) == 1  # same address, dtype and length: the same bytes ...
    assert ask(w, sig=ws, unwrap=1, locs=list(ts)) == 2  # ... but not the recorded object
    # arguments of the wrong kind are a TypeError (a caller's bug), not an answer
    with pytest.raises(TypeError):
        check(tuple(ts), None, None, p, nb, dts, 0, None, True)
    with pytest.raises(TypeError):
        check(ts, None, None, p, nb, dts, 0, None)


def _cases():
    """(name, rows, recorded rows, unwrap, True when the table still describes rows)."""
    ts = [torch.arange(10, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
          torch.zeros(7, dtype=torch.int64), torch.ones(2, 2, dtype=torch.complex64)]
    sq = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    holes = [ts[0], None, ts[2], None]
    w = [Wrapped(t) for t in ts]
    return [
        ("same", list(ts), ts, 0, True),
        ("new storage", [ts[0].clone(), *ts[1:]], ts, 0, False),
        ("shorter at the same address", [ts[0][:5], *ts[1:]], ts, 0, False),
        ("another dtype at the same address", [ts[0].view(torch.int32), *ts[1:]], ts, 0, False),
        ("transposed at the same address", [sq.t(), *ts[1:]], [sq, *ts[1:]], 0, False),
        ("a lazy conjugate", [*ts[:3], ts[3].conj()], ts, 0, False),
        ("a lazy negation", [*ts[:3], ts[3]._neg_view()], ts, 0, False),
        ("rows left out, still out", list(holes), holes, 0, True),
        ("a row left out gains a tensor", list(ts), holes, 0, False),
        ("a row loses its tensor", [None, *ts[1:]], ts, 0, False),
        ("not a tensor", [1.5, *ts[1:]], ts, 0, False),
        ("no readable storage", [NoStorage(ts[0]), *ts[1:]], ts, 0, False),
        ("wrapped", list(w), w, 1, True),
        ("wrapped, a shorter local tensor at the same address",
         [Wrapped(ts[0][:4]), *w[1:]], w, 1, False),
    ]


def _python_seen(recorded, unwrap):
    from parity.capture import hashing_triton as ht

    locs = [None if t is None else (t._local_tensor if unwrap else t) for t in recorded]
    idx = [i for i, t in enumerate(locs) if t is not None]
    holes = [i for i, t in enumerate(locs) if t is None]
    seen = ht._Seen(list(recorded), [0 if t is None else t.data_ptr() for t in locs], idx, holes,
                    None, unwrap, None, None, [0 if t is None else t.nbytes for t in locs],
                    [None if t is None else t.dtype for t in locs])
    return ht, seen


def test_the_python_loop_reads_every_row_as_the_compiled_check_does():
    """Where no compiler is (or PARITY_HOST_NATIVE=0) the Python loop checks the cached tables:
    it reuses a table exactly when the compiled check does, a tensor given another byte length,
    dtype or layout at the same address included (before 2026-11-27 it read layout for
    gradients only and dtype for nothing: a gradient shrunk at its old address was read past
    its bytes)."""
    for name, rows, recorded, unwrap, want in _cases():
        ht, seen = _python_seen(recorded, unwrap)
        assert ht._python_check(seen, rows) is want, name


@need_compiler
def test_the_compiled_check_decides_the_python_loops_cases_alike(check):
    for name, rows, recorded, unwrap, want in _cases():
        _, seen = _python_seen(recorded, unwrap)
        got = check(rows, None, None, seen.ptrs_b, seen.nbytes_b, seen.dtypes, unwrap, None, True)
        assert got == (1 if want else 2), name


@need_compiler
def test_validation_passes_on_the_built_check(check):
    assert host_native._validate(check) is None


def test_a_new_torch_python_or_compiler_gets_its_own_build(monkeypatch):
    base = host_native._key("/usr/bin/c++")
    assert host_native._key("/usr/bin/clang++") != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert host_native._key("/usr/bin/c++") != base


def test_disabled_builds_nothing(tmp_path):
    got = _child("""
        from parity.capture import host_native as h
        print(h.get(), h.build_now(), h._state["thread"], h.status())
    """, tmp_path, PARITY_HOST_NATIVE="0")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("\n")[0] == "None None None disabled (PARITY_HOST_NATIVE=0)"
    assert not (tmp_path / "host_native").exists()


def test_the_standard_torchs_own_builder_uses_comes_first(monkeypatch):
    # torch.utils.cpp_extension passes -std=c++17 in 2.11 and -std=c++20 from 2.13; 2.14's
    # headers do not build as C++17
    for version, first in (("2.11.0+cu130", "c++17"), ("2.12.0", "c++17"), ("2.13.0+cpu", "c++20"),
                           ("2.14.1+cu130", "c++20"), ("2.15.0", "c++20"), ("3.0.0a0", "c++20"),
                           ("unknown", "c++20")):
        monkeypatch.setattr(torch, "__version__", version)
        got = host_native._standards()
        assert got[0] == first and sorted(got) == ["c++17", "c++20"], version


@need_compiler
def test_the_other_standard_is_tried_when_the_first_fails(tmp_path):
    # a compiler that refuses the first standard (an old one without C++20, a torch whose
    # headers need the other): the second builds, and nothing is written down as failed
    log = tmp_path / "calls"
    real = host_native._compiler()
    first = host_native._standards()[0]
    cxx = tmp_path / "picky-c++"
    cxx.write_text(f"#!/bin/sh\necho \"$2\" >> {log}\n"
                   f"if [ \"$2\" = \"-std={first}\" ]; then echo 'no {first}' >&2; exit 1; fi\n"
                   f"exec {real} \"$@\"\n")
    cxx.chmod(0o755)
    got = _child("""
        from parity.capture import host_native as h
        print(h.build_now() is not None, h.status())
    """, tmp_path, CXX=str(cxx))
    assert got.returncode == 0, got.stderr
    assert log.read_text().split() == [f"-std={first}", f"-std={host_native._standards()[1]}"]
    if torch.__version__ >= "2.14":
        # 2.14's headers need C++20 (docs/torch-versions.md): refused C++20, the build fails,
        # says so and leaves the Python loop
        assert got.stdout.startswith("False python loop"), (got.stdout, got.stderr)
        assert len(list((tmp_path / "host_native").glob("*/failed.txt"))) == 1
        return
    assert got.stdout.startswith("True native"), (got.stdout, got.stderr)
    assert not list((tmp_path / "host_native").glob("*/failed.txt"))


def test_a_failed_build_says_so_in_one_line_and_is_not_tried_again(tmp_path):
    log = tmp_path / "calls"
    cxx = tmp_path / "fake-c++"
    cxx.write_text(f"#!/bin/sh\necho called >> {log}\necho 'fake.cpp:1: error: no' >&2\nexit 1\n")
    cxx.chmod(0o755)
    code = """
        from parity.capture import host_native as h
        print(h.build_now())
        print(h.status())
    """
    first = _child(code, tmp_path, CXX=str(cxx))
    assert first.returncode == 0, first.stderr
    out = first.stdout.splitlines()
    assert out[0] == "None"
    assert out[1].startswith("python loop (RuntimeError: the compiler failed (exit 1; ")
    lines = [ln for ln in first.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("parity: compiled host check unavailable")
    failed = list((tmp_path / "host_native").glob("*/failed.txt"))
    said = failed[0].read_text() if len(failed) == 1 else ""
    assert said.count("error: no") == 2 and "-std=c++20" in said and "-std=c++17" in said
    second = _child(code, tmp_path, CXX=str(cxx))
    assert "an earlier build failed" in second.stdout.splitlines()[1]
    # the compiler ran twice in all (C++20 and C++17, the first process), never again
    assert log.read_text().count("called") == 2
    assert not list((tmp_path / "host_native").glob("*/.parity_host_native.*"))  # no leftovers


def test_failure_log_is_what_the_compiler_said_or_none(tmp_path):
    cxx = tmp_path / "fake-c++"
    cxx.write_text("#!/bin/sh\necho 'fake.cpp:1: error: no' >&2\nexit 1\n")
    cxx.chmod(0o755)
    got = _child("""
        from parity.capture import host_native as h
        print(h.failure_log())
        h.build_now()
        print(h.failure_log().read_text().count("error: no"))
    """, tmp_path, CXX=str(cxx))
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["None", "2"]


@need_compiler
def test_two_processes_building_at_once_both_load_it(tmp_path):
    code = """
        from parity.capture import host_native as h
        h.build_now()
        print(h.status())
    """
    env = dict(os.environ, PARITY_CACHE_DIR=str(tmp_path))
    env.pop(host_native.ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err
        assert out.startswith("native"), (out, err)
    where = list((tmp_path / "host_native").iterdir())
    assert len(where) == 1
    assert sorted(f.name for f in where[0].iterdir()) == ["parity_host_native.so"]


@need_compiler
def test_get_builds_in_the_background_and_answers_none_until_then(tmp_path):
    got = _child("""
        import time
        from parity.capture import host_native as h
        first = h.get()
        t = h._state["thread"]
        t.join(600)
        print(first is None, h.status().startswith("native"), h.get() is not None)
        import sys  # the build runs inside the job: it must not import setuptools into it
        print("torch.utils.cpp_extension" in sys.modules, "setuptools" in sys.modules)
    """, tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", "True", "True", "False", "False"]
    assert not got.stderr.strip(), got.stderr  # nothing in the job's stderr when it builds
