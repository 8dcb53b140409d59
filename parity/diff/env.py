"""Differences between two runs in the facts that change numerics on a GPU.

Why a separate check: a bitwise difference between two runs on different GPU models, drivers,
CUDA/cuDNN/NCCL builds or TF32/cuDNN settings is expected, not a bug; the diff still compares
the hashes, and these lines (reported as warnings, ``problems`` with no side) tell the reader why
a mismatch may be the environment's. Reads ``meta.json`` ``gpu`` (parity/capture/gpu_facts.py)
and ``device``; runs recorded before ``gpu`` existed are not compared here.
"""

from __future__ import annotations

__all__ = ["numerics_env_differences"]

_LABELS = {
    "name": "GPU", "capability": "compute capability", "driver": "NVIDIA driver",
    "driver_cuda": "driver CUDA version", "cuda": "CUDA", "hip": "HIP", "cudnn": "cuDNN",
    "nccl": "NCCL", "matmul_allow_tf32": "TF32 matmul (torch.backends.cuda.matmul.allow_tf32)",
    "cudnn_allow_tf32": "TF32 cuDNN (torch.backends.cudnn.allow_tf32)",
    "float32_matmul_precision": "float32 matmul precision", "cudnn_enabled": "cuDNN enabled",
    "cudnn_deterministic": "cudnn.deterministic", "cudnn_benchmark": "cudnn.benchmark",
    "CUBLAS_WORKSPACE_CONFIG": "CUBLAS_WORKSPACE_CONFIG",
}


def _device_type(meta: dict) -> str | None:
    dev = meta.get("device")
    return dev.split(":")[0] if isinstance(dev, str) else None


def numerics_env_differences(meta_a: dict | None, meta_b: dict | None) -> list[str]:
    """One line per GPU fact that differs between two ranks' ``meta.json`` (A's and B's)."""
    if not meta_a or not meta_b:
        return []
    ta, tb = _device_type(meta_a), _device_type(meta_b)
    if ta and tb and ta != tb:
        return [f"the runs used different devices (A {ta}, B {tb}): bitwise equality is not "
                "expected across device types"]
    ga, gb = meta_a.get("gpu"), meta_b.get("gpu")
    if not isinstance(ga, dict) or not isinstance(gb, dict):
        return []
    out = []
    for key in sorted(set(ga) | set(gb), key=lambda k: (k not in _LABELS, list(_LABELS).index(k)
                                                        if k in _LABELS else 0, k)):
        va, vb = ga.get(key), gb.get(key)
        if va != vb:
            out.append(f"{_LABELS.get(key, key)} differs (A {va!r}, B {vb!r}): "
                       "this can change results bitwise")
    return out
