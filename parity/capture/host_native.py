"""The compiled host check of the device digest's cached tables (host_native.cpp): built once
per machine, torch and Python, loaded where it builds, and the Python loop where it does not.

Why: from a table's second use on, a call of the device digest is one CUDA graph replay (~4 us)
and a check that the listed tensors are still where the table says. In Python that check is a
method call per tensor (``data_ptr``, ``is_contiguous``: ~60-100 ns each); capture makes three
calls per step over a model's parameters and gradients, and for 3,000 tensors of 1-64 KB the
addresses alone cost ~0.42 ms of the 0.9-1.2 ms measured per step on an H100 host (2026-11-26,
docs/gpu.md). torch's own C++ loop (``_tensors_data_ptrs_at_indices_equal``) converts each row
through pybind and was no faster. The loop in host_native.cpp reads each row's address, byte
length, dtype and layout in ~8 ns (1,500 CPU tensors: 12 us against 92 us for the Python
addresses alone on a 2-core CPU host).

How it is built: the platform's C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) and
the C++ standard that torch's own builder uses (``_standards``), with torch's include and
library folders (the ones ``torch.utils.cpp_extension`` names, found without importing it:
``_torch_paths``), no ninja, no setuptools, ~10-20 s once. The result lives in
``$PARITY_CACHE_DIR`` (default ``~/.cache/parity``) under a key of the source, how it is built
(``BUILD``), torch's version and commit, Python's version and the compiler, so an upgraded torch
gets a new build and never an old binary. Several processes (ranks) may build at once: each
writes its own file and renames it into place; a process that finds a build under way waits for
it (up to two minutes) before it builds itself. A build that fails is written down beside it
(``failed.txt``: the commands and what the compiler said) and not tried again for that key.

How it is used: ``get()`` returns the loaded ``check`` or None. Its first call starts the build
and load in a background thread (the compiler runs as a subprocess; the job's thread is not
held) and returns None, so the calls until it is ready take the Python loop; tests and the
benchmark call ``build_now()``. Before it is used, the loaded check is tried on tensors made for
the purpose (a match, a moved address, another dtype, a non-contiguous row, other members) and
set aside if any answer is wrong. ``PARITY_HOST_NATIVE=0`` never builds or loads it.
"""

from __future__ import annotations

import array
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

__all__ = ["get", "build_now", "status", "failure_log", "ENV", "SOURCE"]

ENV = "PARITY_HOST_NATIVE"  # "0": the Python loop only
ENV_CACHE = "PARITY_CACHE_DIR"
SOURCE = Path(__file__).with_name("host_native.cpp")
MODULE = "parity_host_native"
BUILD = "2"  # how it is built (_command, _standards): a change gets new builds, not old failures
WAIT_FOR_OTHER_S = 120.0  # how long a process waits for another one's build of the same key

_state: dict = {"check": None, "status": "not built", "thread": None}
_lock = threading.RLock()  # reentrant: a finalizer that hashes (table.py) may run inside


def _disabled() -> bool:
    return os.environ.get(ENV, "1") == "0"


def get():
    """The compiled check, or None while it is not loaded (building in the background, failed,
    disabled). Cheap enough for every call of the device digest."""
    check = _state["check"]
    if check is not None:
        return None if _disabled() else check
    if _state["thread"] is None and not _disabled():
        with _lock:
            if _state["thread"] is None:
                t = threading.Thread(target=_build_and_load, name="parity-host-native",
                                     daemon=True)
                _state["thread"] = t
                _state["status"] = "building"
                t.start()
    return None


def build_now(timeout: float | None = None):
    """Build (or find) and load the check now; the check or None (``status()`` says why)."""
    if _disabled():
        return None
    get()
    t = _state["thread"]
    if t is not None:
        t.join(timeout)
    return _state["check"]


def status() -> str:
    """What checks the tables (meta.json, benchmarks): ``native (ready in N s)``, ``building``,
    ``python loop (why)``, ``not built`` (not asked for yet) or ``disabled (...)``."""
    if _disabled():
        return f"disabled ({ENV}=0)"
    return _state["status"]


# ---------------------------------------------------------------------------------- building
def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _cache_root() -> Path:
    root = os.environ.get(ENV_CACHE)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "parity"


def _key(cxx: str) -> str:
    import torch

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), BUILD.encode(), torch.__version__.encode(),
                 str(getattr(torch.version, "git_version", "")).encode(), sys.version.encode(),
                 cxx.encode(), platform.machine().encode(), sysconfig.get_config_var("SOABI")
                 and sysconfig.get_config_var("SOABI").encode() or b""):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _build_dir(cxx: str) -> Path:
    """The cache folder of this source, build, torch, Python and compiler (``_key``)."""
    return _cache_root() / "host_native" / _key(cxx)


def failure_log() -> Path | None:
    """What the compiler said when the check failed to build here (``failed.txt``: commands
    and errors), or None where no build failed; for scripts that show why (gpu_check.sh)."""
    cxx = _compiler()
    if cxx is None:
        return None
    path = _build_dir(cxx) / "failed.txt"
    return path if path.is_file() else None


def _torch_paths() -> tuple[list[str], list[str]]:
    """torch's include and library folders: what ``torch.utils.cpp_extension.include_paths()``
    and ``library_paths()`` return for the CPU (torch 2.11-2.15), read from the installed
    package. Not through that module: importing it imports setuptools (absent from a plain
    Python 3.12 venv, and it patches distutils inside the job) and, where a CUDA build of torch
    sees no GPU, logs a warning into the job's stderr."""
    import torch

    root = Path(torch.__file__).resolve().parent
    include, lib = root / "include", root / "lib"
    if not (include / "torch" / "csrc" / "autograd" / "python_variable.h").is_file():
        raise RuntimeError(f"torch's C++ headers are not installed ({include})")
    return [str(include), str(include / "torch" / "csrc" / "api" / "include")], [str(lib)]


def _standards() -> tuple[str, str]:
    """The C++ standards to build with, the one torch's own extension builder passes first:
    ``-std=c++17`` up to torch 2.12, ``-std=c++20`` from 2.13 (2.14's headers need it:
    ``requires``, ``std::strong_ordering``); the other is tried when the first fails (a torch
    this list does not know, a compiler without C++20)."""
    import torch

    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        major, minor = 2, 13
    return ("c++20", "c++17") if (major, minor) >= (2, 13) else ("c++17", "c++20")


def _command(cxx: str, out: Path, std: str) -> list[str]:
    import torch

    includes, libs = _torch_paths()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return [cxx, "-O2", f"-std={std}", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in includes),
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE), "-o", str(out),
            *(f"-L{p}" for p in libs), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
            *(f"-Wl,-rpath,{p}" for p in libs)]


def _built_library() -> Path:
    """The path of the built library (building it here if no other process has); raises
    RuntimeError with a one-line reason when it cannot be built."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"built on Linux only (this is {sys.platform})")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (CXX, c++, g++, clang++)")
    where = _build_dir(cxx)
    lib = where / f"{MODULE}.so"
    failed = where / "failed.txt"
    if lib.exists():
        return lib
    if failed.exists():
        raise RuntimeError(f"an earlier build failed ({failed})")
    where.mkdir(parents=True, exist_ok=True)
    marker = where / "building"
    try:  # another process building the same key: wait for it
        if time.time() - marker.stat().st_mtime < WAIT_FOR_OTHER_S:
            deadline = time.time() + WAIT_FOR_OTHER_S
            while time.time() < deadline and not lib.exists() and not failed.exists():
                time.sleep(0.5)
            if lib.exists():
                return lib
            if failed.exists():
                raise RuntimeError(f"the build of another process failed ({failed})")
    except OSError:
        pass
    marker.write_text(str(os.getpid()))
    tmp = where / f".{MODULE}.{os.getpid()}.{threading.get_ident()}.so"
    try:
        said = []
        for std in _standards():
            command = _command(cxx, tmp, std)
            run = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if run.returncode == 0:
                break
            # the first errors say why; the last lines are often the compiler's summary
            lines = (run.stderr or run.stdout).strip().splitlines()
            if len(lines) > 20:
                lines = [*lines[:12], "...", *lines[-8:]]
            said += [" ".join(command), *lines, ""]
        else:
            _write_atomic(failed, "\n".join(said))
            raise RuntimeError(f"the compiler failed (exit {run.returncode}; {failed})")
        os.replace(tmp, lib)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError("the compiler ran over 600 s") from e
    finally:
        tmp.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
    return lib


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load(lib: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(lib))
    spec = importlib.util.spec_from_file_location(MODULE, str(lib), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.check


def _validate(check) -> str | None:
    """None when ``check`` answers as the Python loop would on tensors made for the purpose,
    else what it got wrong."""
    import torch

    cpu = torch.device("cpu")  # explicit: a trainer's default device or dtype is not ours
    ts = [torch.arange(6, dtype=torch.float32, device=cpu),
          torch.ones(4, dtype=torch.bfloat16, device=cpu),
          torch.zeros(3, 3, dtype=torch.float32, device=cpu)]
    owners = [object() for _ in ts]

    def sig(rows):
        ptrs = array.array("q", [0 if t is None else t.data_ptr() for t in rows]).tobytes()
        nb = array.array("q", [0 if t is None else t.nbytes for t in rows]).tobytes()
        return ptrs, nb, [None if t is None else t.dtype for t in rows]

    ptrs, nb, dts = sig(ts)
    cases = [
        ("a match", check(ts, owners, owners, ptrs, nb, dts, 0, None, True), 1),
        ("other members", check(ts, owners[::-1], owners, ptrs, nb, dts, 0, None, True), 0),
        ("a moved address", check([ts[0].clone(), *ts[1:]], None, None, ptrs, nb, dts, 0, None,
                                  False), 2),
        ("another dtype", check([ts[0].view(torch.int32), *ts[1:]], None, None, ptrs, nb, dts, 0,
                                None, False), 2),
        ("a non-contiguous row", check([*ts[:2], ts[2].t()], None, None, ptrs, nb, dts, 0, None,
                                       True), 2),
        ("a row left out", check([ts[0], None, ts[2]], None, None, *sig([ts[0], None, ts[2]]),
                                 0, None, False), 1),
        ("a row filled", check(ts, None, None, *sig([ts[0], None, ts[2]]), 0, None, False), 2),
    ]
    for what, got, want in cases:
        if got != want:
            return f"{what}: answered {got}, expected {want}"
    return None


def _build_and_load() -> None:
    t0 = time.perf_counter()
    try:
        check = _load(_built_library())
        wrong = _validate(check)
        if wrong is not None:
            raise RuntimeError(f"set aside: {wrong}")
    except Exception as e:  # noqa: BLE001 - the Python loop stays; one line says why
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        _state["status"] = f"python loop ({msg})"
        print(f"parity: compiled host check unavailable ({msg}); the Python loop checks the "
              f"digest tables", file=sys.stderr)
        return
    _state["status"] = f"native (ready in {time.perf_counter() - t0:.1f} s)"
    _state["check"] = check
