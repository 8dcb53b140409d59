"""The GPU facts that change numerics, for ``meta.json`` ``gpu`` (docs/artifacts.md).

Why: two runs that differ in any of these can legitimately differ bitwise (another GPU model or
cuBLAS/cuDNN picks other kernels, TF32 rounds matmul inputs, NCCL changes reduction order), so
the diff names them (``parity/diff/env.py``) before anyone hunts for a bug in the trainer.

Everything is read from what the process already loaded; nothing initializes CUDA (the call is
made after the trainer's first step, when CUDA is initialized if the job uses it) and nothing
starts a subprocess. A fact that cannot be read is ``None``.
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["collect"]


def _driver() -> str | None:
    """The NVIDIA kernel driver version, from /proc (no nvidia-smi subprocess in a rank)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    return None


def _driver_cuda() -> int | None:
    """The CUDA version the driver supports (cuDriverGetVersion, e.g. 12080)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return v.value
    except (OSError, AttributeError):
        pass
    return None


def _nccl() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # not built with NCCL, or no CUDA
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def collect(device: torch.device | str | None = None) -> dict | None:
    """The facts for ``device`` (a CUDA device; default the current one), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        name = torch.cuda.get_device_name(idx)
        cap = ".".join(str(x) for x in torch.cuda.get_device_capability(idx))
    except Exception:  # noqa: BLE001 - a fact we cannot read is None, never a failed capture
        name = cap = None
    cudnn = torch.backends.cudnn
    return {
        "name": name, "capability": cap, "driver": _driver(), "driver_cuda": _driver_cuda(),
        "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
        "cudnn": cudnn.version() if cudnn.is_available() else None, "nccl": _nccl(),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_enabled": bool(cudnn.enabled),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
